# Two commands on a fresh machine: `make run` and `make test`. Each sets itself up.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: setup run test test-unit bench loadtest lint clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e '.[dev]'
	@touch $(STAMP)

setup: $(STAMP)

run: setup
	$(BIN)/chat-engine run

test: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider

test-unit: setup
	$(BIN)/python -m pytest -q tests/unit

bench: setup
	$(BIN)/python -m services.bench

loadtest: setup
	$(BIN)/python -m services.loadtest

lint: setup
	$(BIN)/ruff check actors services storage tests

clean:
	rm -rf $(VENV) .data build *.egg-info
