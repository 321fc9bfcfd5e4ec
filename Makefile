# Two commands on a fresh machine: `make run` and `make test`. Each sets itself up.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

CHROMIUM := /usr/bin/chromium
SUDO   := $(if $(filter 0,$(shell id -u)),,sudo -n )

.PHONY: setup browser run test test-unit bench loadtest soak lint clean

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e '.[dev,bench]'
	@touch $(STAMP)

setup: $(STAMP)

# Debian's chromium for the dashboard browser tests (Playwright drives it; it never downloads
# a browser). Nothing to do when it is there; if it cannot be installed those tests skip, saying why.
browser:
	@test -x $(CHROMIUM) || { echo "installing Debian's chromium for the browser tests..."; \
	  ( $(SUDO)apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO)apt-get install -y -q chromium ) >/dev/null \
	  || echo "warning: could not install chromium; the dashboard browser tests will be skipped"; }

run: setup
	$(BIN)/chat-engine run

test: setup browser
	$(BIN)/python -m pytest -q -p no:cacheprovider

test-unit: setup
	$(BIN)/python -m pytest -q tests/unit

# The benchmark's tools (locust, py-spy, pyinstrument, psutil) are the `bench` extra, which setup
# installs with the rest (tests/e2e/test_bench_programs.py runs both programs).
# ARGS passes flags: make bench ARGS=--growth
bench: setup
	$(BIN)/python -m services.bench $(ARGS)

loadtest: setup
	$(BIN)/python -m services.loadtest $(ARGS)

# 15 minutes of mixed load with faults on a schedule (SOAK_SECONDS to change); writes .data/soak.json.
# SOAK_ARGS=--overload instead measures the peak and offers twice that rate (.data/overload.json).
SOAK_SECONDS ?= 900
SOAK_ARGS ?=
soak: setup
	$(BIN)/python -m services.soak --seconds $(SOAK_SECONDS) $(SOAK_ARGS)

lint: setup
	$(BIN)/ruff check actors services storage tests

clean:
	rm -rf $(VENV) .data build *.egg-info

# mypy on the fakes in tests and the adapters against the ports they implement (the static half of
# tests/unit/test_port_conformance.py, which `make test` runs too)
.PHONY: typecheck
typecheck: setup
	$(BIN)/python -m mypy tests/unit/test_port_conformance.py
