"""The container image's size and start: seconds from `podman run` to /healthz 200 and to /readyz 200, with
warm-up off and on in the same run (alternating, so both see the same machine), against the fake upstream.

    python -m tests.bench.image_start [--image localhost/toolquake:0.1.0] [--runs 5]

Then the memory of one such container under `--memory 512m` (the sidecar's limit) after warm-up and one request
each through `expanded`, `noisy` and `padded-32k-mid` (BFCL's multiple_4 when the corpus is here): the
container's cgroup `memory.current` and its peak, read with `podman exec`.

Builds the image with deploy/build-image.sh when it is missing; prints "skipped: <why>" and exits 0 where podman
cannot run a container. The container runs as the manifests run it (read-only root, /tmp a tmpfs, one worker).
Timed from the `podman run` call (container creation included) with 20 ms polling. Goal (issue #29): the default
image <= 320 MB, /readyz within 2 s without embeddings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def podman(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, text=True, check=check, timeout=600)


def ensure_image(image: str) -> str | None:
    """None when the image is there (built now if needed), else why it cannot be."""
    try:
        if podman("image", "exists", image, check=False).returncode == 0:
            return None
    except FileNotFoundError:
        return "no podman here (make containers installs it as root)"
    build = subprocess.run([str(ROOT / "deploy" / "build-image.sh")], capture_output=True, text=True,
                           env={**os.environ, "IMAGE": image}, timeout=1800)
    return None if build.returncode == 0 else f"the image did not build: {build.stderr.strip()[-400:]}"


def one_start(image: str, upstream: str, warm_up: bool) -> dict[str, float]:
    from tests.support.ports import held_port

    with held_port() as port:  # the container on the host's network binds it (held here until then)
        return start_on(image, upstream, warm_up, port)


def start_on(image: str, upstream: str, warm_up: bool, port: int) -> dict[str, float]:
    t0 = time.monotonic()
    cid = podman("run", "-d", "--rm", "--read-only", "--read-only-tmpfs=false", "--tmpfs", "/tmp",
                 "-e", f"TOOLQUAKE_UPSTREAM={upstream}/v1", "-e", f"TOOLQUAKE_PORT={port}",
                 "-e", "TOOLQUAKE_WORKERS=1", "-e", f"TOOLQUAKE_WARM_UP={int(warm_up)}", image).stdout.strip()
    healthz = readyz = None
    try:
        while readyz is None:
            assert time.monotonic() - t0 < 120, podman("logs", cid, check=False).stderr[-2000:]
            try:
                if healthz is None and httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    healthz = time.monotonic() - t0
                if healthz is not None and httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                    readyz = time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
    finally:
        podman("rm", "-f", "-t", "0", cid, check=False)
    return {"healthz_s": healthz, "readyz_s": readyz}


MEMORY_PROFILES = ("expanded", "noisy", "padded-32k-mid")


def cgroup_mib(cid: str) -> list[float]:
    """memory.current and the peak of the container's cgroup (v2 names, else v1), MiB."""
    script = ("cat /sys/fs/cgroup/memory.current 2>/dev/null || cat /sys/fs/cgroup/memory/memory.usage_in_bytes; "
              "cat /sys/fs/cgroup/memory.peak 2>/dev/null || cat /sys/fs/cgroup/memory/memory.max_usage_in_bytes")
    return [int(v) / 2**20 for v in podman("exec", cid, "sh", "-c", script, check=False).stdout.split()]


def memory(image: str, upstream: str, limit: str = "512m") -> None:
    from tests.support.ports import held_port

    with held_port() as port:  # the container on the host's network binds it (held here until then)
        memory_on(image, upstream, limit, port)


def memory_on(image: str, upstream: str, limit: str, port: int) -> None:
    try:
        from toolquake.bfcl import corpus

        body = corpus.case_request(corpus.load_case("multiple_4"), model="fake-model")
    except (FileNotFoundError, ImportError):
        body = {"model": "m", "messages": [{"role": "user", "content": "weather in Oslo?"}], "tools": [
            {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]}
    t0 = time.monotonic()
    cid = podman("run", "-d", "--read-only", "--read-only-tmpfs=false", "--tmpfs", "/tmp", "--memory", limit,
                 "--memory-swap", limit, "-e", f"TOOLQUAKE_UPSTREAM={upstream}/v1", "-e", f"TOOLQUAKE_PORT={port}",
                 "-e", "TOOLQUAKE_WORKERS=1", image).stdout.strip()
    try:
        while True:
            state = podman("inspect", "-f", "{{.State.Status}} oom={{.State.OOMKilled}}", cid).stdout.strip()
            assert state.startswith("running"), f"{state}: {podman('logs', cid, check=False).stderr[-2000:]}"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() - t0 < 600, "never ready"
            time.sleep(0.2)
        print(f"memory, --memory {limit}: ready after {time.monotonic() - t0:.1f} s, "
              f"cgroup MiB current/peak {cgroup_mib(cid)}")
        for profile in MEMORY_PROFILES:
            t1 = time.monotonic()
            r = httpx.post(f"http://127.0.0.1:{port}/p/{profile}/v1/chat/completions", json=body, timeout=600)
            print(f"  {profile}: HTTP {r.status_code} in {time.monotonic() - t1:.2f} s, "
                  f"cgroup MiB current/peak {[round(v, 1) for v in cgroup_mib(cid)]}")
        print("  " + podman("inspect", "-f", "state {{.State.Status}} oom_killed={{.State.OOMKilled}}", cid).stdout)
    finally:
        podman("rm", "-f", "-t", "0", cid, check=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--image", default="localhost/toolquake:0.1.0")
    ap.add_argument("--runs", type=int, default=5, help="starts per warm-up setting")
    args = ap.parse_args()
    why = ensure_image(args.image)
    if why is None:
        probe = podman("run", "--rm", "--entrypoint", "true", args.image, check=False)
        why = None if probe.returncode == 0 else f"podman cannot run a container here: {probe.stderr.strip()[-400:]}"
    if why is not None:
        print(f"skipped: {why}")
        return 0
    from tests.support import start_fake_upstream

    size_mb = int(podman("image", "inspect", "-f", "{{.Size}}", args.image).stdout.strip()) / 1e6
    print(f"image {args.image}: {size_mb:.0f} MB (goal for the default image: <= 320 MB)")
    fake = start_fake_upstream()
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    try:
        memory(args.image, fake.url)
        for i in range(args.runs):
            for warm in (False, True):
                got = one_start(args.image, fake.url, warm)
                runs[warm].append(got)
                print(json.dumps({"run": i, "warm_up": warm, **{k: round(v, 3) for k, v in got.items()}}), flush=True)
    finally:
        fake.stop()
    if args.runs < 1:
        return 0
    print("| warm-up | /healthz median s | /readyz median s | /readyz max s |")
    print("|---|---:|---:|---:|")
    medians = {}
    for warm, rows in runs.items():
        medians[warm] = statistics.median(r["readyz_s"] for r in rows)
        print(f"| {'on' if warm else 'off'} | {statistics.median(r['healthz_s'] for r in rows):.2f} | "
              f"{medians[warm]:.2f} | {max(r['readyz_s'] for r in rows):.2f} |")
    print(f"ratio /readyz on/off: {medians[True] / medians[False]:.2f}; goal /readyz <= 2 s with warm-up on: "
          f"{'met' if medians[True] <= 2 else 'missed'} ({len(runs[True])} starts, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
