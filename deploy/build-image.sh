#!/usr/bin/env bash
# Build toolquake's container image with podman, from a clean machine (`make image` runs this).
#
#   deploy/build-image.sh                      # toolquake:0.1.0 (core)
#   IMAGE=toolquake:0.1.0-replay EXTRAS=replay BAKE_CORPUS=1 deploy/build-image.sh
#   deploy/build-image.sh --setup-only         # only podman + containers.conf + the base image
#
# Steps (each skipped when already done):
#  1. podman, buildah, runc, debootstrap, catatonit from apt when missing (only as root with apt-get);
#  2. /etc/containers/containers.conf when none exists (as root): host network, cgroupfs, runc, file
#     events, default ulimits within what a sandboxed machine allows (see deploy/README.md);
#  3. the base images: PYTHON_IMAGE / BUILD_IMAGE when given; else the Dockerfile's python:3.11 images
#     when a registry answers; else a Debian bookworm root (its python3 is 3.11) made with debootstrap,
#     cached as a tarball under $TOOLQUAKE_CACHE/images and imported as localhost/toolquake-base;
#  4. `podman build --format docker` (keeps the HEALTHCHECK) with the host's CA bundle and pip
#     configuration mounted read-only into the RUN steps (nothing of them is baked into the image).
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${IMAGE:-toolquake:0.1.0}
EXTRAS=${EXTRAS:-}
BAKE_CORPUS=${BAKE_CORPUS:-0}
CACHE=${TOOLQUAKE_CACHE:-$HOME/.cache/toolquake}
BASE_TAR=$CACHE/images/debian-bookworm-python3.tar
BASE_IMAGE=localhost/toolquake-base:bookworm
CONTAINERS_CONF=${CONTAINERS_CONF:-/etc/containers/containers.conf}
log() { echo "build-image: $*" >&2; }

# ---- 1. the engine ------------------------------------------------------------------------------------
# catatonit: the pause process of a pod's infra container (`podman kube play`)
# golang-github-containernetworking-plugin-dnsname: service names inside a compose network (podman-compose)
if ! command -v podman >/dev/null || ! command -v debootstrap >/dev/null || ! command -v runc >/dev/null \
   || ! command -v catatonit >/dev/null || ! [ -x /usr/lib/cni/dnsname ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log "installing podman buildah runc debootstrap catatonit"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      podman buildah runc debootstrap catatonit uidmap fuse-overlayfs slirp4netns \
      golang-github-containernetworking-plugin-dnsname >&2
  else
    log "podman/runc/debootstrap missing and cannot be installed here (needs root and apt-get)"
    exit 3
  fi
fi

# ---- 2. containers.conf -------------------------------------------------------------------------------
if [ ! -e "$CONTAINERS_CONF" ] && [ "$(id -u)" = 0 ]; then
  log "writing $CONTAINERS_CONF"
  mkdir -p "$(dirname "$CONTAINERS_CONF")"
  cat >"$CONTAINERS_CONF" <<'EOF'
# written by toolquake's deploy/build-image.sh (see deploy/README.md, "Podman")
[containers]
# podman's default nofile/nproc limits exceed what a sandboxed machine allows
default_ulimits = ["nofile=20000:20000", "nproc=4096:4096"]
# no bridge networking in the sandbox: containers share the host's network
netns = "host"

[engine]
# crun fails on a hybrid cgroup layout; runc with cgroupfs works
cgroup_manager = "cgroupfs"
runtime = "runc"
events_logger = "file"
EOF
fi

# ---- 3. base images -----------------------------------------------------------------------------------
default_arg() { sed -n "s/^ARG $1=//p" deploy/Dockerfile | head -n 1; }
if [ -z "${PYTHON_IMAGE:-}" ] || [ -z "${BUILD_IMAGE:-}" ]; then
  want_runtime=$(default_arg PYTHON_IMAGE)
  if podman image exists "$want_runtime" 2>/dev/null \
     || timeout 30 podman pull -q "docker.io/library/$want_runtime" >/dev/null 2>&1; then
    PYTHON_IMAGE=${PYTHON_IMAGE:-$want_runtime}
    BUILD_IMAGE=${BUILD_IMAGE:-$(default_arg BUILD_IMAGE)}
  else
    if ! podman image exists "$BASE_IMAGE"; then
      if [ ! -s "$BASE_TAR" ]; then
        mirror=$(sed -n 's/^URIs: *//p; s/^deb \(\[[^]]*\] \)\?\(http[^ ]*\) .*/\2/p' \
                 /etc/apt/sources.list.d/*.sources /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
                 | grep -v security | head -n 1 || true)
        mirror=${DEBIAN_MIRROR:-${mirror:-http://deb.debian.org/debian}}
        log "no registry base: debootstrap bookworm from $mirror (about a minute, once; cached in $BASE_TAR)"
        root=$(mktemp -d)
        trap 'rm -rf "$root"' EXIT
        debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
          bookworm "$root" "$mirror" >&2
        rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
        mkdir -p "$(dirname "$BASE_TAR")"
        tar -C "$root" -cf "$BASE_TAR.part" . && mv "$BASE_TAR.part" "$BASE_TAR"
        rm -rf "$root"
        trap - EXIT
      fi
      log "importing $BASE_TAR as $BASE_IMAGE"
      podman import -q "$BASE_TAR" "$BASE_IMAGE" >/dev/null
    fi
    PYTHON_IMAGE=${PYTHON_IMAGE:-$BASE_IMAGE}
    BUILD_IMAGE=${BUILD_IMAGE:-$BASE_IMAGE}
  fi
fi
# prebuilt wheels the build looks in before compiling or downloading (deploy/Dockerfile, WHEELS_DIRS): the
# llama.cpp wheel `make install-local` caches, torch's CPU wheel in a local PIP_FIND_LINKS directory
wheel_dirs=()
for dir in "${TOOLQUAKE_WHEELS:-$CACHE/wheels/llama-portable}" ${PIP_FIND_LINKS:-}; do
  [ -d "$dir" ] && wheel_dirs+=("$dir")
done
# EXTRAS=local with no prebuilt llama.cpp wheel compiles it: a Debian build base needs gcc, g++ and cmake
case ",$EXTRAS," in *,local,*)
  version=$(sed -n 's/^llama-cpp-python==\([^ \\]*\).*/\1/p' "deploy/requirements/$(echo "$EXTRAS" | tr , -).txt" \
            2>/dev/null || true)
  prebuilt=""
  for dir in "${wheel_dirs[@]}"; do
    for whl in "$dir/llama_cpp_python-${version:-none}-"*.whl; do [ -e "$whl" ] && prebuilt=$whl; done
  done
  if [ "$BUILD_IMAGE" = "$BASE_IMAGE" ] && [ -z "$prebuilt" ]; then
    if ! podman image exists localhost/toolquake-build:bookworm; then
      log "no prebuilt llama_cpp_python-$version wheel: a build base with gcc, g++ and cmake (once)"
      # an empty build context: the Containerfile copies nothing (the repository, with its venv, is not sent)
      context=$(mktemp -d)
      printf 'FROM %s\nRUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends gcc g++ cmake make && rm -rf /var/lib/apt/lists/*\n' \
        "$BASE_IMAGE" | podman build -q -t localhost/toolquake-build:bookworm -f - "$context" >/dev/null
      rmdir "$context"
    fi
    BUILD_IMAGE=localhost/toolquake-build:bookworm
  fi;;
esac
if [ "${1:-}" = "--setup-only" ]; then
  echo "PYTHON_IMAGE=$PYTHON_IMAGE BUILD_IMAGE=$BUILD_IMAGE"
  exit 0
fi

# ---- 4. the image -------------------------------------------------------------------------------------
# the host's trust store and pip configuration, read-only, for the RUN steps only
mounts=()
for f in /etc/ssl/certs/ca-certificates.crt /etc/pip.conf /etc/xdg/pip "${wheel_dirs[@]}"; do
  [ -e "$f" ] && mounts+=(-v "$f:$f:ro")
done
log "building $IMAGE from deploy/Dockerfile (PYTHON_IMAGE=$PYTHON_IMAGE BUILD_IMAGE=$BUILD_IMAGE EXTRAS=$EXTRAS)"
podman build --format docker -f deploy/Dockerfile -t "$IMAGE" "${mounts[@]}" \
  --build-arg PYTHON_IMAGE="$PYTHON_IMAGE" --build-arg BUILD_IMAGE="$BUILD_IMAGE" \
  --build-arg EXTRAS="$EXTRAS" --build-arg BAKE_CORPUS="$BAKE_CORPUS" --build-arg WHEELS_DIRS="${wheel_dirs[*]}" \
  ${TORCH_INDEX_URL:+--build-arg TORCH_INDEX_URL="$TORCH_INDEX_URL"} .
