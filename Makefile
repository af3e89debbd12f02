# pyro_fa: one command sets up and runs the main job, one sets up and runs the tests.
#   make demo    # set up .venv, then `pyro-fa uci --quick` (the UCI benchmark on yacht, 2 splits)
#   make test    # set up .venv, then the whole test suite (slow statistical tests included) and `make docs`
#   make docs    # the API reference (Sphinx, numpydoc) into build/docs, warnings as errors
# TORCH selects the torch build; the default pins the CPU wheel these machines carry.
# Elsewhere use e.g. `make test TORCH="torch --index-url https://download.pytorch.org/whl/cpu"`.

PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
SHARED_UCI := $(abspath ../shared/data/uci)
ifneq ($(wildcard $(SHARED_UCI)),)
export PYRO_FA_DATA ?= $(SHARED_UCI)
endif
SHARED_POSTERIORDB := $(abspath ../shared/data/posteriordb)
ifneq ($(wildcard $(SHARED_POSTERIORDB)),)
export PYRO_FA_POSTERIORDB ?= $(SHARED_POSTERIORDB)
endif

.PHONY: setup demo test test-fast docs bench clean

# The peers of `pyro-fa classify` (extra `peers`) install with torch pinned to the build
# $(TORCH) gave. These three declare torchvision, which they do not import for what we use
# and whose PyPI wheel breaks beside a CPU torch, so they go in without dependencies.
PEERS_NODEPS := laplace-torch==0.3 backpack-for-pytorch==1.7.1 curvlinops-for-pytorch==3.0.1

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -c "from importlib.metadata import version; print('torch==' + version('torch').split('+')[0])" > $(VENV)/torch-constraint.txt
	$(BIN)/python -m pip install --quiet -c $(VENV)/torch-constraint.txt -e ".[dev,tutorials,peers,docs]"
	$(BIN)/python -m pip install --quiet --no-deps $(PEERS_NODEPS)
	touch $@

demo: setup
	$(BIN)/pyro-fa uci --quick

test: setup
	$(BIN)/python -m pytest -q
	$(MAKE) --no-print-directory docs

docs: setup
	$(BIN)/python -m sphinx -E -W --keep-going -q -b html docs/api build/docs

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

bench: setup
	$(BIN)/python benchmarks/bench_online_em.py

clean:
	rm -rf $(VENV) results .pytest_cache
