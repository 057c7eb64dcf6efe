# The two set-up commands of the README: `make demo` and `make test`.
# Each creates .venv on first use and installs the project with the pinned CPU torch.
#
# Tiers:
#   make test      before every commit: ruff, mypy, the suite (pytest-xdist on every core, then
#                  the `serial` tests alone), the soaks at CI_SOAK_SCALE; the main venv only.
#   make test-all  what CI runs (.ci/run): every leg even when one fails, then one table
#                  (scripts/test_legs.py): `make demo` and `make test` in a fresh clone without
#                  a pip cache, the full soaks, the suite on torch 2.11 and on Python 3.12
#                  (PyPI's wheels, ~5 GB of venv each).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The soak tests (marker `slow`) scale their executions and examples by this (tests/support/soak.py):
# `make soak` runs them in full (test-all's leg); `make test` runs them at CI_SOAK_SCALE.
SOAK_SCALE ?= 1
CI_SOAK_SCALE ?= 0.1

# The lowest torch pyproject admits gets the whole suite too, in a venv of its own: PyPI's wheel
# (a CUDA build, 5.4 GB of venv on disk with its libraries (2026-11-27), which runs on the CPU here) and the same pins
# as the main venv but torch's.
TORCH_MIN ?= 2.11.0
VENV_MIN ?= .venv-torch-min

# Python 3.12 with the newest torch pyproject admits (PyPI's wheel): what only 3.12 has, such as
# the eager task factory, runs there. Found as python3.12 or pyenv's; without one, `make test`
# says plainly that this leg did not run.
PYTHON_312 ?= $(shell for p in python3.12 $(HOME)/.pyenv/versions/3.12*/bin/python3.12; do \
	$$p -c '' 2>/dev/null && { echo $$p; break; }; done)
TORCH_312 ?= 2.13.0
VENV_312 ?= .venv-py312

.PHONY: demo test test-all lint typecheck unit soak test-torch-min test-py312 py312-suite \
	fresh-clone gpu-report \
	bench-nativert bench-ort bench-serve install clean

# pytest, as every leg runs it: the skip reasons (-rs) and the 25 slowest tests. With JUNIT_DIR
# (set by scripts/test_legs.py) each run also writes JUnit XML there, for the summary table.
PYTEST_FLAGS = -q -p no:cacheprovider -rfEs --durations=25
junit = $(if $(JUNIT_DIR),--junitxml=$(JUNIT_DIR)/$(1).xml)
# The suite in two runs: everything that may share the cores on xdist's workers, then the tests
# marked `serial` (they measure loop lag, wall time or overlap) alone.
# $(3): extra pytest arguments (the Python 3.12 leg leaves out what depends on torch only).
define suite
	$(1) -m pytest $(PYTEST_FLAGS) -n auto -m "not serial and not slow" $(call junit,$(2)-parallel) $(3)
	$(1) -m pytest $(PYTEST_FLAGS) -m "serial and not slow" $(call junit,$(2)-serial) $(3)
endef

# `make demo` installs what the demo needs (the cli extra: about 1.0 GB with torch); `make test`
# the dev extra on top (ray, onnxruntime, grpc, the linters...: 1.7 GB). Both in the same .venv.
# EDITABLE: setuptools warns on every editable install of a flat layout that "folders with the
# same name as your package" may take precedence during imports; here that folder is the
# package the install maps, so the warning (and only it) is silenced.
EDITABLE = PYTHONWARNINGS="ignore:Editable installation"
$(VENV)/.cli-installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(EDITABLE) $(BIN)/python -m pip install --quiet -c constraints.txt -e '.[cli]'
	touch $@

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(EDITABLE) $(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $@ $(VENV)/.cli-installed

install: $(VENV)/.installed

$(VENV_MIN)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV_MIN)
	$(VENV_MIN)/bin/python -m pip install --quiet --upgrade pip
	grep -v '^torch==' constraints.txt > $(VENV_MIN)/constraints.txt
	$(EDITABLE) $(VENV_MIN)/bin/python -m pip install --quiet -c $(VENV_MIN)/constraints.txt \
		'torch==$(TORCH_MIN)' -e '.[dev]'
	touch $@

$(VENV_312)/.installed: pyproject.toml constraints.txt
	@test -n "$(PYTHON_312)" || { echo "error: no Python 3.12 here (python3.12 or pyenv's)"; exit 1; }
	$(PYTHON_312) -m venv $(VENV_312)
	$(VENV_312)/bin/python -m pip install --quiet --upgrade pip
	grep -v '^torch==' constraints.txt > $(VENV_312)/constraints.txt
	$(EDITABLE) $(VENV_312)/bin/python -m pip install --quiet -c $(VENV_312)/constraints.txt \
		'torch==$(TORCH_312)' -e '.[dev]'
	touch $@

demo: $(VENV)/.cli-installed
	$(BIN)/asyncgraph demo

test: lint typecheck unit
	$(MAKE) soak SOAK_SCALE=$(CI_SOAK_SCALE)

test-all:
	$(PYTHON) scripts/test_legs.py

lint: install
	$(BIN)/ruff check asyncgraph kernels tests examples benchmarks scripts

typecheck: install
	$(BIN)/mypy asyncgraph

unit: install
	$(call suite,$(BIN)/python,suite)

soak: install
	ASYNCGRAPH_SOAK_SCALE=$(SOAK_SCALE) $(BIN)/python -m pytest $(PYTEST_FLAGS) -n auto \
		-m slow --run-slow $(call junit,soak)

test-torch-min: $(VENV_MIN)/.installed
	$(call suite,$(VENV_MIN)/bin/python,torch-min)

# Without a Python 3.12 the leg says so (and test_legs.py's table shows NOT RUN) instead of failing.
test-py312:
	@if [ -z "$(PYTHON_312)" ]; then \
		echo "NOT RUN: no Python 3.12 on this machine (python3.12 or pyenv's)"; \
		if [ -n "$(JUNIT_DIR)" ]; then echo "NOT RUN: no Python 3.12" > $(JUNIT_DIR)/NOT-RUN; fi; \
	else $(MAKE) $(VENV_312)/.installed && $(MAKE) py312-suite; fi

# What differs on Python 3.12 is the interpreter and its asyncio (the eager task factory, task
# internals the executor's fast paths read): the runtime, serving and reliability tests. The
# conformance corpus and the AOTInductor compiles exercise torch, whose same release the main
# leg runs (and the torch 2.11 leg the other end of the range): they are left out here.
PY312_SKIP = --ignore=tests/conformance --ignore=tests/integration/test_compiled.py
py312-suite:
	$(call suite,$(VENV_312)/bin/python,py312,$(PY312_SKIP))

# The README as a newcomer follows it: a fresh clone (the committed tree plus uncommitted changes
# to tracked files), no pip cache; its install lines as written (scripts/readme_install.py, in a
# venv of their own, then the demo), then its two commands, `make demo` and `make test`.
FRESH ?= build/fresh-clone
fresh-clone:
	rm -rf $(FRESH)
	git clone -q . $(FRESH)
	git diff HEAD --binary | git -C $(FRESH) apply --allow-empty
	cd $(FRESH) && PIP_NO_CACHE_DIR=1 $(PYTHON) scripts/readme_install.py
	rm -rf $(FRESH)/build/readme-venv
	cd $(FRESH) && PIP_NO_CACHE_DIR=1 $(MAKE) demo
	cd $(FRESH) && PIP_NO_CACHE_DIR=1 $(MAKE) test

# asyncgraph against nativert (torch._C._nativert.PyModelRunner, whose run() only PyPI's torch
# 2.9-2.11 wheels have), AOTInductor and eager, in the torch 2.11 venv: benchmarks/nativert_compare.py.
# The first run compiles AOTInductor packages (minutes; cached under build/nativert_compare).
# NATIVERT_ARGS=--quick for a look, --json -o FILE for a report.
NATIVERT_ARGS ?=
bench-nativert: $(VENV_MIN)/.installed
	$(VENV_MIN)/bin/python -m benchmarks.nativert_compare $(NATIVERT_ARGS)

# One GPU run turned into a report (docs/gpu.md, "Turning a GPU run into a report"): env check,
# the GPU tests, probes, benchmarks.gpu and examples/gpu_check.py within 480 s. Without CUDA it
# says what it would have run and exits 0. No `install` step: a GPU machine may have no package
# index. GPU_REPORT_ARGS: e.g. --out DIR --commit-copy.
GPU_REPORT_ARGS ?=
gpu-report:
	$(BIN)/python scripts/gpu_report.py $(GPU_REPORT_ARGS)

# asyncgraph against ONNX Runtime (benchmarks/ort.py): the MLP, tiny BERT and the encoder at batch
# 1 and under 64 callers; the first run exports the ONNX models (cached under build/onnxruntime).
# ORT_ARGS=--quick for a look.
ORT_ARGS ?=
bench-ort: install
	$(BIN)/python -m benchmarks.ort $(ORT_ARGS)

# asyncgraph serve under NVIDIA's perf_analyzer 2.60.0 (benchmarks/perf_analyzer.py): HTTP and
# gRPC, concurrency 1 and 4, -b 4 against a batching server, --shared-memory system. Finds
# perf_analyzer via $$PERF_ANALYZER, PATH or ~/.cache/perf_analyzer (shared/tools'
# perf_analyzer_setup.sh makes it runnable); skips with the reason where none runs.
BENCH_SERVE_ARGS ?=
bench-serve: install
	$(BIN)/python -m benchmarks.perf_analyzer $(BENCH_SERVE_ARGS)

clean:
	rm -rf $(VENV) $(VENV_MIN) $(VENV_312) build .pytest_cache .mypy_cache .ruff_cache
