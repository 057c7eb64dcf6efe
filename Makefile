# The two set-up commands of the README: `make demo` and `make test`.
# Each creates .venv on first use and installs the project with the pinned CPU torch.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The soak tests (marker `slow`) scale their executions and examples by this (tests/soak.py):
# `make soak` runs them in full (about 2 minutes on 2 cores); `make test` runs them at CI_SOAK_SCALE.
SOAK_SCALE ?= 1
CI_SOAK_SCALE ?= 0.25

.PHONY: demo test lint typecheck unit soak install clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/asyncgraph demo

test: lint typecheck unit
	$(MAKE) soak SOAK_SCALE=$(CI_SOAK_SCALE)

lint: install
	$(BIN)/ruff check asyncgraph kernels tests examples benchmarks

typecheck: install
	$(BIN)/mypy asyncgraph

unit: install
	$(BIN)/python -m pytest -q -p no:cacheprovider

soak: install
	ASYNCGRAPH_SOAK_SCALE=$(SOAK_SCALE) $(BIN)/python -m pytest -q -p no:cacheprovider -m slow --run-slow

clean:
	rm -rf $(VENV) build .pytest_cache .mypy_cache .ruff_cache
