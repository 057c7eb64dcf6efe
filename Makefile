# The two set-up commands of the README: `make demo` and `make test`.
# Each creates .venv on first use and installs the project with the pinned CPU torch.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint typecheck unit install clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/asyncgraph demo

test: lint typecheck unit

lint: install
	$(BIN)/ruff check asyncgraph kernels tests examples benchmarks

typecheck: install
	$(BIN)/mypy asyncgraph

unit: install
	$(BIN)/python -m pytest -q -p no:cacheprovider

clean:
	rm -rf $(VENV) build .pytest_cache .mypy_cache .ruff_cache
