"""Shared fixtures of the fused_pool_gelu test suite.

Tests run against the INSTALLED package (run pytest from outside the source tree). With
``--import-mode=importlib`` test modules cannot import this file, so everything shared is a
fixture:

- ``device``: parametrizes a test over "cpu" and "cuda"; the cuda case carries the ``cuda``
  marker and is skipped (with the reason) without a GPU or without compiled CUDA kernels.
- ``ref``: plain-PyTorch float64 formulas of the block (fold, pre-activations, values, Model).
- ``make_inputs``: fresh random x / weight / bias for a shape, built like nn.Linear's.
- ``check_forward``: asserts that (out, argmax, preactivation) is the block's answer.
- ``deterministic_algorithms``: deterministic mode, in which every fresh allocation (the ops'
  workspace included) is filled with NaN: a value a kernel never writes shows, even where an
  identical earlier call left the right one in the allocator's cache.
- ``deterministic_cublas``: the same, for tests whose ops call cuBLAS.
- ``set_debug_knobs``: set(**knobs) sets FUSED_POOL_GELU_* debug knobs (fused_pool_gelu._debug)
  for the rest of the test; they are restored, and re-read by the extension, after it.
- ``kernels_run``: the names of the CUDA kernels a call launches (torch.profiler), for tests that
  assert which path served them. CUPTI cannot attach under compute-sanitizer: mark such tests
  ``profiler`` (scripts/sanitize.sh leaves those out), or skip the check where
  FUSED_POOL_GELU_SANITIZER is set (sanitize.sh sets it), as test_certified.py does.

Every test starts from its own seed (derived from its node id): fresh data, reproducible.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import fused_pool_gelu
from fused_pool_gelu._debug import debug_knobs
from fused_pool_gelu.measure import capture_cuda_graph


def _cuda_skip_reason():
    if not torch.cuda.is_available():
        return "needs a CUDA GPU: torch.cuda.is_available() is False"
    if not fused_pool_gelu.build_info()["cuda_kernels"]:
        return (
            "fused_pool_gelu was built without CUDA kernels (build_info()['cuda_kernels'] is "
            "False): rebuild with a CUDA toolkit (FUSED_POOL_GELU_CUDA=1)"
        )
    return None


CUDA_SKIP_REASON = _cuda_skip_reason()


# The dtypes the CUDA kernels compute in (README, "Supported, and not"); float64 (gradcheck) is
# CPU-only.
CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` skip cleanly without a GPU; (cuda, float64) cases always skip."""
    skip_cuda = pytest.mark.skip(reason=CUDA_SKIP_REASON) if CUDA_SKIP_REASON else None
    skip_dtype = pytest.mark.skip(
        reason="float64 is a CPU dtype: the CUDA kernels run float32, float16 and bfloat16"
    )
    for item in items:
        if skip_cuda is not None and item.get_closest_marker("cuda") is not None:
            item.add_marker(skip_cuda)
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        if params.get("device") == "cuda" and params.get("dtype") not in (None, *CUDA_DTYPES):
            item.add_marker(skip_dtype)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request):
    """The device a behavioural test runs on: "cpu" always, "cuda" when a GPU and kernels exist."""
    return request.param


@pytest.fixture
def exact_dtype(device):
    """The most precise dtype the device computes in: float64 on the CPU, float32 on CUDA."""
    return torch.float64 if device == "cpu" else torch.float32


@pytest.fixture(autouse=True)
def _seed(request):
    """A fixed seed per test (from its node id): each test draws fresh, reproducible data."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield


# ----------------------------------------------------------------------------------------------
# Reference formulas (float64, plain PyTorch).


def _fold64(weight, bias, k):
    """AvgPool1d(k) of a Linear, as group means of its rows (floor: tail rows dropped)."""
    out_features, in_features = weight.shape
    n = out_features // k
    pooled_weight = weight.double()[: n * k].reshape(n, k, in_features).mean(dim=1)
    if bias is None:
        pooled_bias = torch.zeros(n, dtype=torch.float64, device=weight.device)
    else:
        pooled_bias = bias.double()[: n * k].reshape(n, k).mean(dim=1)
    return pooled_weight, pooled_bias


def _preactivation64(x, weight, bias):
    """z = x @ weight.T + bias in float64: [B, N]."""
    z = x.double() @ weight.double().t()
    if bias is not None:
        z = z + bias.double()
    return z


def _values64(x, weight, bias, scale):
    """scale * gelu(z) in float64 (exact erf GELU): [B, N]; the output is its row max.

    A non-finite pre-activation (Inf or NaN) gives NaN, as docs/input_classes.md documents,
    so that torch.max over these values (NaN wins, first index) is the documented answer.
    """
    z = _preactivation64(x, weight, bias)
    values = F.gelu(z) * scale
    return torch.where(torch.isfinite(z), values, torch.full_like(values, float("nan")))


def _model_forward(x, weight, bias, k, scale, dtype=None):
    """KernelBench's Model run on the given parameters (float64 unless dtype says otherwise)."""
    dtype = torch.float64 if dtype is None else dtype
    out_features, in_features = weight.shape
    model = fused_pool_gelu.Model(in_features, out_features, k, scale)
    model = model.to(device=weight.device, dtype=dtype)
    with torch.no_grad():
        model.matmul.weight.copy_(weight)
        if bias is None:
            model.matmul.bias.zero_()
        else:
            model.matmul.bias.copy_(bias)
    return model(x.to(dtype))


def _tolerance(dtype):
    """atol = rtol for comparing a result in `dtype` with the float64 reference."""
    return {
        torch.float64: 1e-10,
        torch.float32: 1e-5,
        torch.bfloat16: 1e-2,
        torch.float16: 1e-3,
    }[dtype]


SEGMENT_TILE_ROWS = 32  # kSegmentTileRows in csrc/summation_order.h


def _grouped_sums(x, dz, argmax, pooled):
    """grad_weight [N, K] and grad_bias [N] of the arg-max backward, summed in the order of
    csrc/summation_order.h in x's dtype: the rows b with argmax[b] == n in increasing b, sorted
    position p counted over the groups in order of n, cut into pieces where p is a multiple of
    SEGMENT_TILE_ROWS; each piece summed from zero (dz[b] * x[b] rounded before it is added),
    then the pieces. Rows with argmax out of [0, pooled) are in no group."""
    x, dz, argmax = x.cpu(), dz.cpu(), argmax.cpu()
    grad_weight = torch.zeros(pooled, x.shape[1], dtype=x.dtype)
    grad_bias = torch.zeros(pooled, dtype=x.dtype)
    valid = (argmax >= 0) & (argmax < pooled)
    position = 0
    for n in range(pooled):
        pieces = []  # (weight, bias) sums of the group's rows in one tile of sorted rows
        for b in torch.nonzero(valid & (argmax == n)).flatten().tolist():
            if not pieces or position % SEGMENT_TILE_ROWS == 0:
                zero = torch.zeros((), dtype=x.dtype)
                pieces.append((zero.expand(x.shape[1]), zero))
            weight_piece, bias_piece = pieces[-1]
            pieces[-1] = (weight_piece + dz[b] * x[b], bias_piece + dz[b])
            position += 1
        for weight_piece, bias_piece in pieces:
            grad_weight[n] += weight_piece
            grad_bias[n] += bias_piece
    return grad_weight, grad_bias


@pytest.fixture
def deterministic_algorithms():
    """Runs the test under torch.use_deterministic_algorithms(True), which also fills fresh
    allocations with NaN (an output element a kernel never writes shows); restores the previous
    mode."""
    previous, previous_warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous, warn_only=previous_warn_only)


@pytest.fixture
def deterministic_cublas(monkeypatch, deterministic_algorithms):
    """deterministic_algorithms for tests whose ops call cuBLAS (the half path's GEMM): in
    deterministic mode PyTorch refuses a cuBLAS call unless CUBLAS_WORKSPACE_CONFIG names one of
    cuBLAS's deterministic workspace settings, and it reads the variable at each call."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def _fold_backward64(grad_pooled_weight, grad_pooled_bias, out_features, k):
    """fold's adjoint in float64: each pooled row's gradient / k on the k rows of its group, zeros
    on the out_features % k tail rows (grad_weight [out_features, K], grad_bias [out_features])."""
    pooled, in_features = grad_pooled_weight.shape
    options = dict(dtype=torch.float64, device=grad_pooled_weight.device)
    grad_weight = torch.zeros(out_features, in_features, **options)
    grad_bias = torch.zeros(out_features, **options)
    grad_weight[: pooled * k] = grad_pooled_weight.double().repeat_interleave(k, dim=0) / k
    grad_bias[: pooled * k] = grad_pooled_bias.double().repeat_interleave(k) / k
    return grad_weight, grad_bias


def _gelu_grad64(z):
    """d/dz gelu(z) = Phi(z) + z phi(z), in z's dtype (float64 for a reference)."""
    cdf = 0.5 * (1 + torch.erf(z / math.sqrt(2)))
    return cdf + z * torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)


@pytest.fixture
def ref():
    return SimpleNamespace(
        fold=_fold64,
        preactivation=_preactivation64,
        values=_values64,
        model_forward=_model_forward,
        tolerance=_tolerance,
        grouped_sums=_grouped_sums,
        fold_backward=_fold_backward64,
        gelu_grad=_gelu_grad64,
    )


def _make_inputs(batch, in_features, out_features, dtype=torch.float32, device="cpu", bias=True):
    """x ~ randn [B, K]; weight, bias ~ U(-1/sqrt(K), 1/sqrt(K)) as nn.Linear(K, O) makes them."""
    bound = 1.0 / math.sqrt(in_features)
    x = torch.randn(batch, in_features, dtype=torch.float64).to(device=device, dtype=dtype)
    weight = (torch.rand(out_features, in_features, dtype=torch.float64) * 2 - 1) * bound
    weight = weight.to(device=device, dtype=dtype)
    b = None
    if bias:
        b = ((torch.rand(out_features, dtype=torch.float64) * 2 - 1) * bound).to(device, dtype)
    return x, weight, b


@pytest.fixture
def make_inputs():
    return _make_inputs


def _check_forward(out, argmax, preactivation, x, weight, bias, scale, tol=None):
    """(out, argmax, preactivation) of forward_with_argmax on the POOLED weight: the block's answer.

    - out is the row max of scale * gelu(z) in float64 (torch.max semantics: NaN wins; a
      non-finite z counts as NaN);
    - argmax is a maximizer: exactly torch.max's index in float64 and for non-finite rows,
      a column whose float64 value equals the max (within tol) otherwise (float32 may break a
      near-tie differently);
    - preactivation is the float64 z at argmax (non-finite where that z is).
    """
    tol = _tolerance(x.dtype) if tol is None else tol
    batch = x.shape[0]
    assert out.shape == (batch,) and out.dtype == x.dtype and out.device == x.device
    assert argmax.shape == (batch,) and argmax.dtype == torch.int64 and argmax.device == x.device
    assert preactivation.shape == (batch,) and preactivation.dtype == x.dtype
    z64 = _preactivation64(x, weight, bias)
    v64 = _values64(x, weight, bias, scale)
    if batch == 0:
        return
    best64, index64 = torch.max(v64, dim=1)
    torch.testing.assert_close(out.double(), best64, atol=tol, rtol=tol, equal_nan=True)
    exact = ~torch.isfinite(best64)
    if x.dtype == torch.float64:
        exact = torch.ones_like(exact)
    torch.testing.assert_close(argmax[exact], index64[exact])
    assert bool(((argmax >= 0) & (argmax < weight.shape[0])).all())
    chosen = v64.gather(1, argmax[:, None]).squeeze(1)
    torch.testing.assert_close(chosen, best64, atol=tol, rtol=tol, equal_nan=True)
    z_chosen = z64.gather(1, argmax[:, None]).squeeze(1)
    finite = torch.isfinite(z_chosen)
    torch.testing.assert_close(preactivation[finite].double(), z_chosen[finite], atol=tol, rtol=tol)
    # Where z is Inf or NaN only non-finiteness is specified (e.g. inf - inf inside a split
    # product may turn an Inf into NaN): the row is NaN either way.
    assert not bool(torch.isfinite(preactivation[~finite]).any())


@pytest.fixture
def check_forward():
    return _check_forward


def _kernels_run(fn):
    """Names of the CUDA kernels fn launches (torch.profiler), as the profiler spells them:
    `void fused_pool_gelu::cuda::certified::select_rescore_kernel<8>(...)`."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events()}


@pytest.fixture
def kernels_run():
    return _kernels_run


@pytest.fixture
def capture_graph():
    """measure.capture_cuda_graph: (graph, fn's outputs, computed by each replay)."""
    return capture_cuda_graph


@pytest.fixture
def set_debug_knobs():
    """set(**knobs): the debug knobs for the rest of the test (fused_pool_gelu._debug)."""
    with contextlib.ExitStack() as stack:
        yield lambda **values: stack.enter_context(debug_knobs(**values))
