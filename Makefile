# toolquake — `make demo` runs the product on the embedded model, `make test` runs the tests.
# Both install what they need into $(VENV). Caches (corpus, llama.cpp wheel) live in $(CACHE).

PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export TOOLQUAKE_CACHE ?= $(HOME)/.cache/toolquake
export HF_HUB_OFFLINE := 1
PYTEST_ARGS ?=

.PHONY: install install-embeddings corpus tools test test-fast bench demo clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# core + dev + replay/multi-turn extras (light: no torch)
$(VENV)/.core: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev,replay,multiturn]'
	touch $@

install: $(VENV)/.core

# torch's CPU wheel first (an unpinned torch pulls several GB of CUDA packages), then the extra
$(VENV)/.embeddings: $(VENV)/.core
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[embeddings]'
	touch $@

install-embeddings: $(VENV)/.embeddings

# --with-backends: BFCL's multi-turn API simulators too (the cached wheel installed --no-deps)
corpus: install
	$(BIN)/toolquake corpus pull --with-backends

# promtool and prometheus (Debian package prometheus) for the deployment tests; CI runs as root
tools:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || { \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; }

# the README's test command: everything, as CI runs it (exit code 5 = no tests ran = failure)
test: install-embeddings corpus tools
	$(BIN)/python -m pytest -q $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

# without the heavy extras and the corpus: the proxy core only
test-fast: install
	$(BIN)/python -m pytest -q -m "not slow and not needs_corpus and not needs_embeddings" $(PYTEST_ARGS); \
	rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

# every benchmark under tests/bench/, one after another (see tests/bench/run_all.py; results in bench-results/)
bench: install-embeddings corpus
	$(BIN)/python -m tests.bench.run_all

clean:
	rm -rf $(VENV) .pytest_cache
