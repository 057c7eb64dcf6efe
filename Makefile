# The two set-up commands of the README: `make demo` and `make test`.
# Each creates .venv on first use and installs the project with the pinned CPU torch.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The soak tests (marker `slow`) scale their executions and examples by this (tests/soak.py):
# `make soak` runs them in full (about 2 minutes on 2 cores); `make test` runs them at CI_SOAK_SCALE.
SOAK_SCALE ?= 1
CI_SOAK_SCALE ?= 0.25

# The lowest torch pyproject admits gets the whole suite too, in a venv of its own: PyPI's wheel
# (a CUDA build, about 4.6 GB with its libraries, which runs on the CPU here) and the same pins
# as the main venv but torch's.
TORCH_MIN ?= 2.11.0
VENV_MIN ?= .venv-torch-min

.PHONY: demo test lint typecheck unit soak test-torch-min install clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $@

install: $(VENV)/.installed

$(VENV_MIN)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV_MIN)
	$(VENV_MIN)/bin/python -m pip install --quiet --upgrade pip
	grep -v '^torch==' constraints.txt > $(VENV_MIN)/constraints.txt
	$(VENV_MIN)/bin/python -m pip install --quiet -c $(VENV_MIN)/constraints.txt \
		'torch==$(TORCH_MIN)' -e '.[dev]'
	touch $@

demo: install
	$(BIN)/asyncgraph demo

test: lint typecheck unit
	$(MAKE) soak SOAK_SCALE=$(CI_SOAK_SCALE)
	$(MAKE) test-torch-min

lint: install
	$(BIN)/ruff check asyncgraph kernels tests examples benchmarks

typecheck: install
	$(BIN)/mypy asyncgraph

unit: install
	$(BIN)/python -m pytest -q -p no:cacheprovider

soak: install
	ASYNCGRAPH_SOAK_SCALE=$(SOAK_SCALE) $(BIN)/python -m pytest -q -p no:cacheprovider -m slow --run-slow

test-torch-min: $(VENV_MIN)/.installed
	$(VENV_MIN)/bin/python -m pytest -q -p no:cacheprovider

clean:
	rm -rf $(VENV) $(VENV_MIN) build .pytest_cache .mypy_cache .ruff_cache
