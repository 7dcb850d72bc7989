# The two commands of the README, each setting itself up on a fresh machine:
#   make run    venv + torch, build and install the wheel, run `python -m fused_pool_gelu`
#   make test   venv + torch, build the sdist, the wheel from it, install it, run pytest against the
#               INSTALLED package
# Knobs: PYTHON, VENV, TORCH_SPEC, CUDA_HOME, TORCH_CUDA_ARCH_LIST, MAX_JOBS (see setup.py),
# PYTEST_ARGS (added to make test's pytest command).

PYTHON ?= python3
VENV ?= .venv
CUDA_HOME ?= /usr/local/cuda
# A CUDA build of torch where a toolkit exists (so the CUDA kernels are compiled, even on a
# machine without a GPU); otherwise 2.13.0, which the package index of our build machines serves as
# a CPU build (quick to install; from PyPI on Linux it would be a CUDA build, which works as well).
TORCH_SPEC ?= $(if $(wildcard $(CUDA_HOME)/bin/nvcc),torch==2.14.1,torch==2.13.0)
MAX_JOBS ?= 2
PYTEST_ARGS ?=

BIN := $(abspath $(VENV))/bin
# Named after the torch spec and the list below (v2: `build` added), so that a venv made for another
# spec or an older list is brought up to date.
STAMP := $(VENV)/.deps-v2-$(subst =,-,$(TORCH_SPEC))
export CUDA_HOME MAX_JOBS

.PHONY: run test wheel install clean

$(STAMP):
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade "pip>=23" "setuptools>=77" wheel
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)" numpy ninja pytest hypothesis expecttest build
	touch $@

# The wheel is built from the source distribution, as `pip install <sdist>` would build it: a file the
# sdist lacks (MANIFEST.in) fails here, not on a user's machine. An earlier build's egg-info goes
# first: setuptools would also pack whatever its SOURCES.txt lists.
wheel: $(STAMP)
	rm -rf dist *.egg-info
	$(BIN)/python -m build --sdist --no-isolation --outdir dist .
	$(BIN)/python -m pip wheel -q --no-build-isolation --no-deps -w dist dist/fused_pool_gelu-*.tar.gz

install: wheel
	$(BIN)/python -m pip install -q --force-reinstall --no-deps dist/fused_pool_gelu-*.whl

# Run from tests/ so that `import fused_pool_gelu` finds the installed wheel, not the source tree.
test: install
	cd tests && $(BIN)/python -m pytest -p no:cacheprovider $(PYTEST_ARGS) .

run: install
	cd tests && $(BIN)/python -m fused_pool_gelu

clean:
	rm -rf build dist *.egg-info $(VENV)
