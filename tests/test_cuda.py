"""GPU-only behaviours: CUDA graphs, streams, determinism, half types, the contract's accuracy at
the default shape and batch sweep, 64-bit indexing, odd shapes and misaligned pointers.

Everything here is marked ``cuda`` and skips cleanly without a GPU or without compiled CUDA
kernels (conftest.py). The device-parametrized tests of the other files also run on "cuda".

Accuracy contract (docs/design.md): ||out - ref64|| / ||ref64|| <= 1e-6 and
allclose(out, Model float32, atol=rtol=1e-4). The float32 reference runs with IEEE float32
matmuls (no TF32) so that it is the reference the contract means.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import fused_pool_gelu
from fused_pool_gelu import Model, ModelNew, _debug, _fold_cache, ops

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
_OPS = torch.ops.fused_pool_gelu

DEFAULT = dict(batch=1024, in_features=8192, out_features=8192, k=16, scale=2.0)


@pytest.fixture(autouse=True)
def _ieee_float32_reference():
    """Reference matmuls in IEEE float32 (no TF32), restored afterwards."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)


def _relative_error(out, ref64):
    return ((out.double() - ref64).norm() / ref64.norm()).item()


def _models(in_features, out_features, k, scale, seed):
    """Model (float32, CUDA) from `seed` and ModelNew with its parameters."""
    torch.manual_seed(seed)
    model = Model(in_features, out_features, k, scale).to(DEVICE)
    return model, ModelNew.from_model(model)


def _model64_forward(model, x):
    """The reference Model in float64 on the same parameters (chunked over rows)."""
    weight = model.matmul.weight.double()
    bias = model.matmul.bias.double()
    k = model.avg_pool.kernel_size[0]
    outs = []
    for chunk in x.split(4096):
        y = F.linear(chunk.double(), weight, bias)
        y = F.avg_pool1d(y.unsqueeze(1), k).squeeze(1)
        outs.append((F.gelu(y) * model.scale_factor).max(dim=1).values)
    return torch.cat(outs)


def _pooled64_values(x, pooled_weight, pooled_bias, scale):
    z = x.double() @ pooled_weight.double().t()
    if pooled_bias is not None:
        z = z + pooled_bias.double()
    return z, F.gelu(z) * scale


def _pooled_relative_error(out, x, pooled_weight, pooled_bias, scale):
    """||out - ref64|| / ||ref64||, ref64 the float64 row max on the pooled weight."""
    _, v64 = _pooled64_values(x, pooled_weight, pooled_bias, scale)
    return _relative_error(out, v64.max(dim=1).values)


def _epilogues_run(kernels_run, fn):
    """(threads per row, split bound, columns per load) of each argmax_epilogue_kernel instance fn
    launches (any output type); kernels_run is the fixture."""
    found = (re.search(r"argmax_epilogue_kernel<(\d+), (\d+), [\w:]+, (\d+)>", name)
             for name in kernels_run(fn))
    return {tuple(int(group) for group in m.groups()) for m in found if m}


def _gemm_kernels_run(kernels_run, fn):
    """Names of the CUDA kernels fn launches whose name says they are a forward split-K GEMM."""
    return {name for name in kernels_run(fn) if "splitk_kernel" in name}


def _assert_contract(out, model, x):
    with torch.no_grad():
        ref32 = model(x)
        ref64 = _model64_forward(model, x)
    assert out.dtype == torch.float32 and out.shape == ref32.shape
    assert _relative_error(out, ref64) <= 1e-6
    torch.testing.assert_close(out, ref32, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------------------------
# Accuracy contract


@pytest.mark.parametrize("seed", range(5))
def test_default_shape_meets_the_accuracy_contract(seed):
    d = DEFAULT
    model, new = _models(d["in_features"], d["out_features"], d["k"], d["scale"], seed)
    x = torch.rand(d["batch"], d["in_features"], device=DEVICE)
    with torch.no_grad():
        out = new(x)
    _assert_contract(out, model, x)


@pytest.mark.parametrize("batch", [1, 16, 128, 4096])
def test_batch_sweep_meets_the_accuracy_contract(batch):
    model, new = _models(8192, 8192, 16, 2.0, seed=batch)
    x = torch.rand(batch, 8192, device=DEVICE)
    with torch.no_grad():
        out = new(x)
    _assert_contract(out, model, x)


@pytest.mark.parametrize("batch", [16, 1024])
def test_default_shape_gradients_match_float64_at_the_chosen_argmax(batch):
    # Gradients follow each row's arg-max; at a float32 near-tie either column is a correct
    # choice, so the float64 reference is taken at OUR arg-max (which must be a maximizer).
    model, new = _models(8192, 8192, 16, 2.0, seed=7)
    x = torch.rand(batch, 8192, device=DEVICE, requires_grad=True)
    grad_out = torch.randn(batch, device=DEVICE)
    pooled_weight, pooled_bias = ops.fold(new.matmul.weight, new.matmul.bias, 16)
    out, argmax, _ = ops.forward_with_argmax(x, pooled_weight, pooled_bias, 2.0)
    out.backward(grad_out)

    x64 = x.detach().double().requires_grad_(True)
    weight64 = model.matmul.weight.detach().double().requires_grad_(True)
    bias64 = model.matmul.bias.detach().double().requires_grad_(True)
    pw64 = weight64.reshape(512, 16, 8192).mean(dim=1)
    pb64 = bias64.reshape(512, 16).mean(dim=1)
    z64, v64 = _pooled64_values(x64, pw64, pb64, 2.0)
    best64 = v64.max(dim=1).values
    chosen64 = v64.gather(1, argmax[:, None]).squeeze(1)
    torch.testing.assert_close(chosen64, best64, atol=1e-5, rtol=1e-5)
    (chosen64 * grad_out.double()).sum().backward()
    for ours, ref in (
        (x.grad, x64.grad),
        (new.matmul.weight.grad, weight64.grad),
        (new.matmul.bias.grad, bias64.grad),
    ):
        assert ours is not None
        assert _relative_error(ours, ref) <= 1e-5
        torch.testing.assert_close(ours.double(), ref, atol=1e-5, rtol=1e-4)


# (B, K, N): every combination of the odd sizes, pooled weight directly.
ODD = [(b, k, n) for b in (1, 3, 1000) for k in (1, 3, 257, 4099) for n in (1, 3, 513)]
# Tiny batches with enough pooled rows to fill the GPU take the row-parallel GEMV (whole K per
# CTA, B <= 4): every batch tile, row tails, K % 4 != 0 and K longer than one unrolled step.
ROWWISE = [(b, k, n) for b in (1, 2, 3, 4) for k in (5, 8195) for n in (1023, 2050)]


@pytest.mark.parametrize(
    "batch,in_features,pooled", ODD + ROWWISE, ids=[f"B{b}-K{k}-N{n}" for b, k, n in ODD + ROWWISE]
)
def test_odd_shapes_forward_matches_float64(batch, in_features, pooled, make_inputs, check_forward,
                                            deterministic_algorithms):
    x, weight, bias = make_inputs(batch, in_features, pooled, torch.float32, DEVICE)
    out, argmax, preactivation = ops.forward_with_argmax(x, weight, bias, 2.0)
    check_forward(out, argmax, preactivation, x, weight, bias, 2.0)
    assert _pooled_relative_error(out, x, weight, bias, 2.0) <= 1e-6


ODD_BACKWARD = [(b, k, n) for b in (1, 1000) for k in (1, 257, 4099) for n in (1, 513)]


@pytest.mark.parametrize(
    "batch,in_features,pooled", ODD_BACKWARD, ids=[f"B{b}-K{k}-N{n}" for b, k, n in ODD_BACKWARD]
)
def test_odd_shapes_backward_matches_float64_at_the_chosen_argmax(
    batch, in_features, pooled, make_inputs
):
    x, weight, bias = make_inputs(batch, in_features, pooled, torch.float32, DEVICE)
    leaves = [t.clone().requires_grad_(True) for t in (x, weight, bias)]
    out, argmax, _ = ops.forward_with_argmax(*leaves, 2.0)
    grad_out = torch.randn(batch, device=DEVICE)
    out.backward(grad_out)
    refs = [t.double().requires_grad_(True) for t in (x, weight, bias)]
    z64 = refs[0] @ refs[1].t() + refs[2]
    z_at = z64.gather(1, argmax[:, None]).squeeze(1)
    (F.gelu(z_at) * 2.0 * grad_out.double()).sum().backward()
    for ours, ref in zip(leaves, refs):
        # grad_weight sums up to B float32 terms per pooled row: bound the error normwise.
        assert _relative_error(ours.grad, ref.grad) <= 1e-5
        torch.testing.assert_close(ours.grad.double(), ref.grad, atol=1e-4, rtol=1e-4)


# Past 16 MB (4M floats) of split-K workspace, the forward runs in slices of rows (forward_plan.h,
# kMaxWorkspaceFloats): tensor-core slices of 1024 rows and a 52-row tail, GEMV slices of 20 rows,
# row-parallel slices of 2 rows and a 1-row tail.
WORKSPACE_BOUND_BYTES = 16 << 20
SLICED = [(2100, 12, 4096), (40, 8, 200003), (3, 4, 1_500_000)]


@pytest.mark.parametrize(
    "batch,in_features,pooled", SLICED, ids=[f"B{b}-K{k}-N{n}" for b, k, n in SLICED]
)
def test_batches_past_the_workspace_bound_run_in_slices(
    batch, in_features, pooled, make_inputs, check_forward, deterministic_algorithms
):
    assert batch * pooled * 4 > WORKSPACE_BOUND_BYTES  # one split of the whole batch would not fit
    x, weight, bias = make_inputs(batch, in_features, pooled, torch.float32, DEVICE)
    ops.forward_with_argmax(x, weight, bias, 2.0)  # warm-up: per-device setup
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out, argmax, preactivation = ops.forward_with_argmax(x, weight, bias, 2.0)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    # The workspace plus the three outputs (16 bytes a row) and the allocator's rounding.
    assert extra <= WORKSPACE_BOUND_BYTES + 16 * batch + (1 << 20), extra
    check_forward(out, argmax, preactivation, x, weight, bias, 2.0)
    assert _pooled_relative_error(out, x, weight, bias, 2.0) <= 1e-6


@pytest.mark.profiler
def test_tiny_batch_at_the_default_shape_runs_the_row_parallel_gemv(make_inputs, kernels_run):
    x, weight, bias = make_inputs(1, 8192, 512, torch.float32, DEVICE)
    names = kernels_run(lambda: ops.forward_with_argmax(x, weight, bias, 2.0))
    assert any("rowwise_gemv_kernel" in n for n in names), names


@pytest.mark.parametrize("layout", ["offset_contiguous", "offset_strided"])
def test_misaligned_pointers_give_correct_results(layout, make_inputs, check_forward,
                                                  deterministic_algorithms):
    batch, in_features, pooled = 300, 1024, 64
    _, weight0, bias0 = make_inputs(1, in_features, pooled, torch.float32, DEVICE)
    if layout == "offset_contiguous":
        # Contiguous rows, data pointer 4 bytes past an allocation (storage offset 1).
        x = torch.randn(batch * in_features + 1, device=DEVICE)[1:].view(batch, in_features)
        weight = torch.empty(pooled * in_features + 1, device=DEVICE)[1:].view(pooled, in_features)
        weight.copy_(weight0)
    else:
        # Rows of odd stride K + 1 starting at offset 1: no row is 16-byte aligned.
        x = torch.randn(batch, in_features + 1, device=DEVICE)[:, 1:]
        weight = torch.empty(pooled, in_features + 1, device=DEVICE)[:, 1:]
        weight.copy_(weight0)
    bias = torch.empty(pooled + 1, device=DEVICE)[1:]
    bias.copy_(bias0)
    assert x.storage_offset() == 1 and weight.storage_offset() == 1
    out, argmax, preactivation = ops.forward_with_argmax(x, weight, bias, 2.0)
    check_forward(out, argmax, preactivation, x, weight, bias, 2.0)

    grad_out = torch.randn(batch, device=DEVICE)
    grads = _OPS.forward_backward(grad_out, None, x, weight, argmax, preactivation, 2.0)
    expected = _OPS.forward_backward(
        grad_out, None, x.contiguous(), weight.contiguous(), argmax, preactivation, 2.0
    )
    # The backward's sums have a fixed order whatever the layout (csrc/summation_order.h).
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, atol=0, rtol=0)


# Rows that overlap in memory (an expanded x: stride 0; a Hankel view: stride 4 < K) on the GEMVs
# (B = 1, 12), the 3xTF32 GEMM (B = 70) and the certified path (B = 600: its pass 1 reads x
# through a TMA tensor map with the row stride as given, 0 or 16 bytes here), with the same bits
# as a contiguous copy.
@pytest.mark.parametrize("layout", ["expanded", "hankel"])
@pytest.mark.parametrize("batch, in_features, pooled",
                         [(1, 512, 40), (12, 512, 40), (70, 1024, 200), (600, 4096, 512)],
                         ids=["B1", "B12", "B70", "B600"])
def test_overlapping_rows_of_x_give_correct_results(layout, batch, in_features, pooled,
                                                    make_inputs, check_forward):
    _, weight, bias = make_inputs(1, in_features, pooled, torch.float32, DEVICE)
    torch.manual_seed(batch)
    if layout == "expanded":
        x = torch.rand(1, in_features, device=DEVICE).expand(batch, in_features)
    else:
        storage = torch.rand(4 * batch + in_features, device=DEVICE)
        x = storage.as_strided((batch, in_features), (4, 1))
    out, argmax, preactivation = ops.forward_with_argmax(x, weight, bias, 2.0)
    check_forward(out, argmax, preactivation, x, weight, bias, 2.0)
    assert _pooled_relative_error(out, x, weight, bias, 2.0) <= 1e-6
    torch.testing.assert_close(out, ops.forward(x.contiguous(), weight, bias, 2.0), atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------
# The two tensor-core GEMMs: wgmma on sm_90a builds running on compute capability 9.0, the
# portable mma.sync kernel elsewhere (and on Hopper under FUSED_POOL_GELU_FORCE_MMA_SYNC=1).


def _has_tc_gemv():
    # tile_sizes.h, kTcGemvSmemBytes: Hopper's 227 KB per block; A100's 163 KB is too little.
    return (
        torch.cuda.is_available()
        and torch.cuda.get_device_properties(0).shared_memory_per_block_optin >= 192 * 1024
    )


def _has_wgmma_gemm():
    archs = fused_pool_gelu.build_info().get("cuda_archs", "")
    return (
        torch.cuda.is_available()
        and torch.cuda.get_device_capability() == (9, 0)
        and "9.0a" in archs
    )


@pytest.mark.profiler
@pytest.mark.skipif(
    not _has_wgmma_gemm(), reason="needs an sm_90a build on a compute capability 9.0 GPU"
)
def test_hopper_runs_the_wgmma_gemm_and_the_knob_selects_mma_sync(
    set_debug_knobs, make_inputs, kernels_run
):
    x, weight, bias = make_inputs(256, 1024, 256, torch.float32, DEVICE)
    run = lambda: ops.forward_with_argmax(x, weight, bias, 2.0)  # noqa: E731
    names = _gemm_kernels_run(kernels_run, run)
    assert any("wgmma" in n for n in names), names
    # The SIMT GEMV serves up to 16 rows, and from 17 to 32 on weights of at most 2^21 floats
    # (128 x 16384 exactly). Over that the tensor-core GEMV serves where its grid keeps 75% of the
    # SMs busy (forward_plan.h, kSimtMaxBatchWgmma): N x K = 512 x 8192 gives it 128 CTAs (16 row
    # tiles x 8 splits), 128 x 16400 132 (4 x 33), but 512 x 4100 only 96 (the splits rounded to
    # 256 floats: 6), and that weight goes to the wgmma GEMM, whose grid fills the GPU. Under the
    # knob below, 256 x 1024 stays on the SIMT GEMV.
    cases = [
        (16, 4100, 512, "simt_splitk"),
        (17, 8192, 512, "tf32x3_gemv"),
        (32, 16400, 128, "tf32x3_gemv"),
        (24, 16384, 128, "simt_splitk"),
        (17, 4100, 512, "wgmma"),
        (32, 4100, 512, "wgmma"),
    ]
    for batch, in_features, pooled, kernel in cases:
        x_b, weight_b, bias_b = make_inputs(batch, in_features, pooled, torch.float32, DEVICE)
        names = _gemm_kernels_run(
            kernels_run, lambda: ops.forward_with_argmax(x_b, weight_b, bias_b, 2.0)
        )
        assert names and all(kernel in n for n in names), (batch, in_features, pooled, names)
    set_debug_knobs(FUSED_POOL_GELU_FORCE_MMA_SYNC="1")
    names = _gemm_kernels_run(kernels_run, run)
    assert names and not any("wgmma" in n for n in names), names
    names = _gemm_kernels_run(
        kernels_run, lambda: ops.forward_with_argmax(x[:32], weight, bias, 2.0)
    )
    assert names and all("simt_splitk" in n for n in names), names


@pytest.mark.profiler
@pytest.mark.skipif(
    not _has_wgmma_gemm(), reason="needs an sm_90a build on a compute capability 9.0 GPU"
)
def test_debug_knobs_are_read_once_until_reloaded(
    monkeypatch, set_debug_knobs, make_inputs, kernels_run
):
    x, weight, bias = make_inputs(256, 1024, 256, torch.float32, DEVICE)
    run = lambda: ops.forward_with_argmax(x, weight, bias, 2.0)  # noqa: E731
    set_debug_knobs(FUSED_POOL_GELU_FORCE_MMA_SYNC=None)  # read: off
    monkeypatch.setenv("FUSED_POOL_GELU_FORCE_MMA_SYNC", "1")  # not read yet
    assert any("wgmma" in n for n in _gemm_kernels_run(kernels_run, run))
    _debug.reload()
    names = _gemm_kernels_run(kernels_run, run)
    assert names and not any("wgmma" in n for n in names), names


# The SIMT GEMV's split count at B = 8 and N <= 16 is K / 256 (one 256-float chunk per split, up to
# one wave of CTAs): 1, 2, 3, 5, 8, 48, 64 and 256 splits, so the epilogue runs at its split bounds
# 1, 2, 4, 8 and 64 (epilogue.cu: all loads at once, clamped past the last split) and in batches
# past 64 splits. The bound 32 also runs in the odd shapes above (B = 3, K = 4099, N <= 3: 17
# splits), 16 and 32 at the default shape in test_batch_sweep_meets_the_accuracy_contract (B = 16:
# 16 splits; B = 128: the 3xTF32 GEMM's 32).
EPILOGUE_SPLITS = [256, 512, 768, 1280, 2048, 12288, 16384, 65536]


@pytest.mark.profiler
@pytest.mark.parametrize("in_features", EPILOGUE_SPLITS, ids=lambda k: f"splits{k // 256}")
def test_epilogue_at_every_split_bound_matches_float64(in_features, make_inputs, check_forward,
                                                       deterministic_algorithms, kernels_run):
    x, weight, bias = make_inputs(8, in_features, 3, torch.float32, DEVICE)
    run = lambda: ops.forward_with_argmax(x, weight, bias, 2.0)  # noqa: E731
    # The split bound each split count takes (0: batches of splits, past the largest bound).
    bound = {1: 1, 2: 2, 3: 4, 5: 8, 8: 8, 48: 64, 64: 64, 256: 0}[in_features // 256]
    assert {launched[1] for launched in _epilogues_run(kernels_run, run)} == {bound}
    out, argmax, preactivation = run()
    check_forward(out, argmax, preactivation, x, weight, bias, 2.0)
    assert _pooled_relative_error(out, x, weight, bias, 2.0) <= 1e-6


# The epilogue's wide-row CTAs (forward_plan.h: 1024 threads per row for N >= 1024 at 1-8 splits),
# at each of their split bounds and with N tails, and the 256-thread CTA just below: (batch,
# in_features, pooled, CTA threads, the split bounds its plan may take).
WIDE_ROW_SHAPES = [
    (2, 300, 1025, 1024, {1}),        # row-parallel GEMV: one split
    (9, 1000, 2100, 1024, {2, 4}),    # SIMT GEMV: 2 or 4 splits (its CTAs per SM)
    (128, 1024, 4100, 1024, {4}),     # 3xTF32 GEMM: 33 tiles, 4 splits of 8 K tiles
    (128, 1024, 2050, 1024, {8}),     # 3xTF32 GEMM: 17 tiles, 7 splits of 5 K tiles
    (2, 300, 1023, 256, {1}),
]


@pytest.mark.profiler
@pytest.mark.parametrize(
    "batch,in_features,pooled,threads,bounds",
    WIDE_ROW_SHAPES,
    ids=[f"B{b}-K{k}-N{n}" for b, k, n, _, _ in WIDE_ROW_SHAPES],
)
def test_wide_row_epilogue_matches_float64(batch, in_features, pooled, threads, bounds, make_inputs,
                                           check_forward, deterministic_algorithms, kernels_run):
    x, weight, bias = make_inputs(batch, in_features, pooled, torch.float32, DEVICE)
    run = lambda: ops.forward_with_argmax(x, weight, bias, 2.0)  # noqa: E731
    launched = _epilogues_run(kernels_run, run)
    assert len(launched) == 1, launched
    ((cta_threads, bound, columns_per_load),) = launched
    assert cta_threads == threads and bound in bounds and columns_per_load == 1, launched
    out, argmax, preactivation = run()
    check_forward(out, argmax, preactivation, x, weight, bias, 2.0)
    assert _pooled_relative_error(out, x, weight, bias, 2.0) <= 1e-6


# The tensor-core GEMV (17-32 rows, weights over 2^21 floats, where its grid fills the GPU; each
# shape is checked to run it): batch tails (17 of 32 rows), weight-row tails (N % 32), K % 4 != 0,
# K tails inside a 32-float chunk and a split, a last split of 4 floats (one warp working), warps
# with unequal chunk counts, a single split, 131 splits, the default shape.
TC_GEMV_SHAPES = [
    (17, 8192, 512),
    (32, 8192, 512),
    (24, 32771, 100),
    (20, 4100, 1000),
    (18, 1100, 3200),
    (25, 1024, 4000),
    (31, 700004, 3),
]


@pytest.mark.profiler
@pytest.mark.skipif(not _has_tc_gemv(), reason="the tensor-core GEMV needs 192 KB of shared memory")
@pytest.mark.parametrize(
    "batch,in_features,pooled",
    TC_GEMV_SHAPES,
    ids=[f"B{b}-K{k}-N{n}" for b, k, n in TC_GEMV_SHAPES],
)
def test_tensor_core_gemv_matches_float64(batch, in_features, pooled, make_inputs, check_forward,
                                          deterministic_algorithms, kernels_run):
    x, weight, bias = make_inputs(batch, in_features, pooled, torch.float32, DEVICE)
    run = lambda: ops.forward_with_argmax(x, weight, bias, 2.0)  # noqa: E731
    names = _gemm_kernels_run(kernels_run, run)
    assert names and all("tf32x3_gemv" in n for n in names), names
    out, argmax, preactivation = run()
    check_forward(out, argmax, preactivation, x, weight, bias, 2.0)
    assert _pooled_relative_error(out, x, weight, bias, 2.0) <= 1e-6


# Shapes that reach the tensor-core GEMMs (B > 32; from 17 rows the wgmma GEMM on weights over
# 2^21 floats whose tensor-core GEMV grid is narrow: 512 x 4100, 96 CTAs): tails in every dimension,
# K % 4 != 0, one K tile, splits of one K tile each (9 at K = 257, the plan's 64 at K = 2048 with
# one output tile), and the default shape.
TC_SHAPES = [
    (33, 5, 7),
    (100, 257, 130),
    (40, 2048, 128),
    (20, 4100, 512),
    (1000, 4099, 513),
    (129, 32, 129),
    (1024, 8192, 512),
]


# "default": what the op picks (on sm_90a the certified path from 513 rows on weights large
# enough: (1000, 4099, 513) and (1024, 8192, 512); these tests pass no prepared weight);
# "3xtf32": the 3xTF32 GEMM at every batch (FUSED_POOL_GELU_CERTIFIED=0); "mma_sync": the portable
# kernel.
PATH_SWITCHES = {
    "default": {},
    "3xtf32": {"FUSED_POOL_GELU_CERTIFIED": "0"},
    "mma_sync": {"FUSED_POOL_GELU_FORCE_MMA_SYNC": "1"},
}


@pytest.mark.parametrize("path", sorted(PATH_SWITCHES))
@pytest.mark.parametrize(
    "batch,in_features,pooled", TC_SHAPES, ids=[f"B{b}-K{k}-N{n}" for b, k, n in TC_SHAPES]
)
def test_tensor_core_gemms_match_float64(
    batch, in_features, pooled, path, set_debug_knobs, make_inputs, check_forward
):
    set_debug_knobs(**PATH_SWITCHES[path])
    x, weight, bias = make_inputs(batch, in_features, pooled, torch.float32, DEVICE)
    out, argmax, preactivation = ops.forward_with_argmax(x, weight, bias, 2.0)
    check_forward(out, argmax, preactivation, x, weight, bias, 2.0)
    assert _pooled_relative_error(out, x, weight, bias, 2.0) <= 1e-6


# 3xTF32 keeps up to ~2^-20 relative error per product (16-48x float32's), and an output of a few
# rows averages little of it away: a CPU simulation of the split (research/README.md, the tensor
# cores' truncating accumulation not modelled) found at most 4.8-7.0e-7 at B = 17-64,
# N <= 3, a ~1.4x margin under the 1e-6 contract. From 33 rows every weight takes a 3xTF32 GEMM, so
# this sweeps that edge on the GPU (both GEMMs where the device has both), 40 seeds per shape.
@pytest.mark.profiler
@pytest.mark.parametrize("path", ["default", "mma_sync"])
@pytest.mark.parametrize("pooled", [1, 2, 3])
def test_tensor_core_gemms_keep_the_contract_on_few_output_columns(
    path, pooled, set_debug_knobs, make_inputs, deterministic_algorithms, kernels_run
):
    set_debug_knobs(**PATH_SWITCHES[path])
    worst = 0.0
    for seed in range(40):
        torch.manual_seed(seed)
        for batch in (33, 48, 64):
            x, weight, bias = make_inputs(batch, 257, pooled, torch.float32, DEVICE)
            run = lambda: ops.forward_with_argmax(x, weight, bias, 2.0)  # noqa: E731
            if seed == 0:
                names = _gemm_kernels_run(kernels_run, run)
                assert names and all("tf32x3" in n for n in names), names
            out, _, _ = run()
            worst = max(worst, _pooled_relative_error(out, x, weight, bias, 2.0))
    assert worst <= 1e-6, worst


def test_both_tensor_core_gemms_agree_to_float32_accuracy(set_debug_knobs):
    model, new = _models(8192, 8192, 16, 2.0, seed=11)
    x = torch.rand(512, 8192, device=DEVICE)
    pooled_weight, pooled_bias = new.folded_parameters()
    out = ops.forward(x, pooled_weight, pooled_bias, 2.0)
    set_debug_knobs(FUSED_POOL_GELU_FORCE_MMA_SYNC="1")
    out_mma = ops.forward(x, pooled_weight, pooled_bias, 2.0)
    torch.testing.assert_close(out, out_mma, atol=2e-6, rtol=2e-6)
    _assert_contract(out, model, x)


@pytest.mark.parametrize("in_features", [2**31 - 515, 2**31 - 513])
def test_in_features_past_the_limit_is_refused_naming_the_limit(in_features):
    # The limit is on K itself (2^31 - 516, a multiple of 4): K up to 3 past it once passed as
    # its padded width and was refused with a limit it was below. Stride-0 views: no 8 GB rows.
    x = torch.ones(1, 1, device=DEVICE).expand(2, in_features)
    weight = torch.ones(1, 1, device=DEVICE).expand(3, in_features)
    with pytest.raises(RuntimeError, match=rf"forward: in_features must be at most "
                                           rf"{2**31 - 516}, got {in_features}"):
        ops.forward(x, weight, None, 2.0)


@pytest.mark.slow
def test_more_than_2_to_the_31_elements_in_x(ref):
    in_features, pooled, scale = 4096, 32, 2.0
    batch = 2**31 // in_features + 1  # B * K > 2^31: 8.6 GB of float32
    torch.manual_seed(0)
    weight = (torch.rand(pooled, in_features, device=DEVICE) * 2 - 1) / in_features**0.5
    bias = (torch.rand(pooled, device=DEVICE) * 2 - 1) / in_features**0.5
    x = torch.rand(batch, in_features, device=DEVICE)
    out, argmax, preactivation = ops.forward_with_argmax(x, weight, bias, scale)
    chunks = [slice(start, min(start + 65536, batch)) for start in range(0, batch, 65536)]
    best64 = torch.empty(batch, dtype=torch.float64, device=DEVICE)
    chosen64 = torch.empty(batch, dtype=torch.float64, device=DEVICE)
    for rows in chunks:
        _, v64 = _pooled64_values(x[rows], weight, bias, scale)
        best64[rows] = v64.max(dim=1).values
        chosen64[rows] = v64.gather(1, argmax[rows, None]).squeeze(1)
    assert _relative_error(out, best64) <= 1e-6
    torch.testing.assert_close(out.double(), best64, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chosen64, best64, atol=1e-5, rtol=1e-5)
    # The last rows live past element 2^31 of x.
    tail = slice(batch - 8, batch)
    torch.testing.assert_close(out[tail].double(), best64[tail], atol=1e-6, rtol=1e-6)

    # Backward: the gather of grad_x and the segment reduction also index past 2^31.
    grad_out = torch.randn(batch, device=DEVICE)
    grad_x, grad_weight, grad_bias = _OPS.forward_backward(
        grad_out, None, x, weight, argmax, preactivation, scale
    )
    dz = grad_out.double() * scale * ref.gelu_grad(preactivation.double())
    for rows in (slice(0, 4), tail):
        expected = dz[rows, None] * weight.double()[argmax[rows]]
        torch.testing.assert_close(grad_x[rows].double(), expected, atol=1e-6, rtol=1e-5)
    expected_weight = torch.zeros(pooled, in_features, dtype=torch.float64, device=DEVICE)
    for rows in chunks:
        expected_weight.index_add_(0, argmax[rows], dz[rows, None] * x[rows].double())
    expected_bias = torch.zeros(pooled, dtype=torch.float64, device=DEVICE)
    expected_bias.index_add_(0, argmax, dz)
    assert _relative_error(grad_weight, expected_weight) <= 1e-5
    assert _relative_error(grad_bias, expected_bias) <= 1e-5


# ----------------------------------------------------------------------------------------------
# Half types


HALF_DTYPES = [torch.bfloat16, torch.float16]
HALF_TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-3}


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_half_types_match_the_model_run_in_that_dtype(dtype):
    model, _ = _models(2048, 2048, 16, 2.0, seed=3)
    model = model.to(dtype)
    new = ModelNew.from_model(model)
    x = torch.rand(256, 2048, device=DEVICE).to(dtype)
    with torch.no_grad():
        out = new(x)
        expected = model(x)
    assert out.dtype == dtype
    tol = 2 * HALF_TOLERANCE[dtype]  # both sides round: allow the reference's own error too
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_half_types_match_a_float32_reference_on_the_same_values(dtype):
    model, _ = _models(2048, 2048, 16, 2.0, seed=4)
    model = model.to(dtype)
    new = ModelNew.from_model(model)
    x = torch.rand(256, 2048, device=DEVICE).to(dtype)
    with torch.no_grad():
        out = new(x)
        expected = model.float()(x.float())  # the same (rounded) values, computed in float32
    tol = HALF_TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_half_types_backward_matches_float32_at_the_chosen_argmax(dtype, make_inputs):
    x, weight, bias = (t.to(dtype) for t in make_inputs(256, 1024, 64, torch.float32, DEVICE))
    leaves = [t.clone().requires_grad_(True) for t in (x, weight, bias)]
    out, argmax, _ = ops.forward_with_argmax(*leaves, 2.0)
    grad_out = torch.randn(256, device=DEVICE).to(dtype)
    out.backward(grad_out)
    refs = [t.double().requires_grad_(True) for t in (x, weight, bias)]
    z_at = (refs[0] @ refs[1].t() + refs[2]).gather(1, argmax[:, None]).squeeze(1)
    (F.gelu(z_at) * 2.0 * grad_out.double()).sum().backward()
    tol = 3 * HALF_TOLERANCE[dtype]
    for ours, ref in zip(leaves, refs):
        assert ours.grad.dtype == dtype
        # Absolute tolerance relative to the gradient's own size (grad_x's elements are ~0.02
        # here: an absolute 3e-2 would pass zeros).
        atol = tol * float(ref.grad.abs().max())
        torch.testing.assert_close(ours.grad.double(), ref.grad, atol=atol, rtol=tol)


# The half path (float16 / bfloat16 operands): z from cuBLAS's GEMM with float32 accumulation
# and a float32 result, then the epilogue. On values whose every partial sum is exact in float32,
# any accumulation order gives the exact z, so the half path must give the float32 path's answer on
# the same values, bit for bit, rounded once to the half type: a z rounded to the half type before
# the GELU, a misplaced slice or bias, or another tie rule would all show.

HALF_SHAPES = [  # (B, K, N)
    pytest.param((5, 0, 7), id="K=0"),  # z = bias: no GEMM on either path
    pytest.param((1, 1, 4), id="B=1,K=1"),
    pytest.param((5, 257, 3), id="K=257"),
    pytest.param((7, 64, 1), id="N=1"),
    pytest.param((300, 96, 20), id="B=300"),
    pytest.param((1024, 4096, 512), id="B=1024"),
    # B x N above the workspace's 2^22 floats: two slices of rows.
    pytest.param((8200, 16, 520), id="two-slices"),
    # One split over many rows: a CTA per row within one wave of them (1056 rows on an H200), a
    # warp per row beyond, 8 scalar columns per lane at a time where N % 4 != 0 (N = 7, below one
    # step of them) and 16 in 16-byte loads where N % 4 == 0 (N = 300: a step and a tail), which
    # take a warp per row from half a wave (B = 800 on an H200).
    pytest.param((600, 40, 7), id="B=600,N=7"),
    pytest.param((800, 40, 300), id="B=800,N=300"),
    pytest.param((2000, 40, 7), id="B=2000,N=7"),
    # K = 40: the float32 path this is checked against takes two splits (an epilogue of its own).
    pytest.param((2000, 40, 300), id="B=2000,N=300"),
    pytest.param((2000, 40, 4), id="B=2000,N=4"),  # one 4-column load per row, 31 lanes idle
    # From 512 rows the GEMM runs in slices of K where N % 4 == 0 (_expected_half_slices; on an
    # H200 4 slices at B = 600 and 1500, 2 at B = 2000), summed by the epilogue a warp per row in
    # 16-byte loads; B = 9216 is two slices of rows (the workspace), the second of 1024 rows in 4
    # slices of K; N = 301 keeps one slice.
    pytest.param((600, 8192, 300), id="B=600,K-slices"),
    pytest.param((1500, 8192, 8), id="B=1500,K-slices,N=8"),
    pytest.param((2000, 4096, 260), id="B=2000,K-slices,N=260"),
    pytest.param((9216, 8192, 512), id="row-slices,K-slices"),
    pytest.param((700, 8192, 301), id="B=700,N=301"),
]


def _expected_half_slices(batch, in_features, pooled):
    """forward_plan.h's half_gemm_splits for contiguous operands and a batch in one slice of rows:
    from 512 rows and N % 4 == 0, the most slices of K (up to 4) for which 128 x 128 output tiles
    x slices fit the SMs, each slice at least 2048 wide and starting 16 bytes after the last."""
    if batch < 512 or pooled % 4:
        return 1
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    tiles = -(-batch // 128) * -(-pooled // 128)
    slices = 1
    while (2 * slices <= 4 and 2 * slices * tiles <= sms and in_features >= 2 * slices * 2048
           and in_features % (16 * slices) == 0):
        slices *= 2
    return slices


def _exact_half_inputs(batch, in_features, pooled, dtype, bias=True):
    """x = i / 8, weight = j / 16 (|i|, |j| <= 16) and bias = m / 128 (|m| <= 128): exact in
    float16 and bfloat16; every partial sum of up to 2^14 products, with or without the bias, is a
    multiple of 2^-7 of magnitude at most 2^15 + 1 (23 significant bits), exact in float32."""
    assert in_features <= 2**14
    x = torch.randint(-16, 17, (batch, in_features), device=DEVICE).to(dtype) / 8
    weight = torch.randint(-16, 17, (pooled, in_features), device=DEVICE).to(dtype) / 16
    b = torch.randint(-128, 129, (pooled,), device=DEVICE).to(dtype) / 128 if bias else None
    return x, weight, b


def _assert_half_equals_float32_path(x, weight, bias, scale):
    out, argmax, preactivation = ops.forward_with_argmax(x, weight, bias, scale)
    as_float = [None if t is None else t.float() for t in (x, weight, bias)]
    out32, argmax32, preactivation32 = ops.forward_with_argmax(*as_float, scale)
    assert out.dtype == preactivation.dtype == x.dtype
    assert torch.equal(argmax, argmax32)
    assert torch.equal(out, out32.to(x.dtype))
    assert torch.equal(preactivation, preactivation32.to(x.dtype))


@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("shape", HALF_SHAPES)
def test_half_forward_is_the_float32_answer_rounded_once(
    shape, dtype, has_bias, deterministic_cublas
):
    batch, in_features, pooled = shape
    x, weight, bias = _exact_half_inputs(batch, in_features, pooled, dtype, has_bias)
    # A scale that is not a power of two: with 2, gelu(z) = z above ~5.3 would hide a z rounded
    # to the half type in the doubled output.
    _assert_half_equals_float32_path(x, weight, bias, 1.7)


@pytest.mark.profiler
@pytest.mark.parametrize("bias_offset", [0, 1], ids=["bias-aligned", "bias-offset-1"])
@pytest.mark.parametrize("shape", [(600, 32, 7), (2000, 24, 300), (4096, 96, 512)])
def test_one_split_epilogue_over_many_rows_matches_float64(
    shape, bias_offset, make_inputs, check_forward, kernels_run
):
    # float32 shapes whose GEMM takes one split (K within one 32-wide K tile, or one wgmma CTA
    # per SM): the one-split epilogues that the half path uses, a CTA per row within one wave of
    # them and a warp per row beyond (16-byte loads where N % 4 == 0 and the bias allows them: a
    # bias view one element into its storage does not), here on the float32 path's partials.
    batch, in_features, pooled = shape
    x, weight, bias = make_inputs(batch, in_features, pooled, torch.float32, DEVICE)
    bias = torch.cat([bias.new_full((bias_offset,), float("nan")), bias])[bias_offset:]
    run = lambda: ops.forward_with_argmax(x, weight, bias, 2.0)  # noqa: E731
    launched = _epilogues_run(kernels_run, run)
    assert len(launched) == 1, launched
    ((threads_per_row, bound, columns_per_load),) = launched
    assert bound == 1, launched
    if batch == 4096:  # past one wave of CTA-per-row CTAs on any GPU (1056 rows on an H200)
        assert threads_per_row == 32, launched
    vector_loads = threads_per_row == 32 and pooled % 4 == 0 and bias_offset == 0
    assert columns_per_load == (4 if vector_loads else 1), launched
    check_forward(*run(), x, weight, bias, 2.0)


@pytest.mark.profiler
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape",
    [(1024, 8192, 512), (2048, 4096, 512), (4096, 8192, 512), (1024, 8208, 512),
     (1024, 8200, 512), (1024, 4096, 512), (1024, 2048, 512), (511, 8192, 512)],
    ids=["B=1024", "B=2048", "B=4096", "K-a-multiple-of-16-not-32", "K-not-a-multiple-of-16",
         "K=4096", "K=2048", "B=511"],
)
def test_half_gemm_slices_of_k_follow_the_rule(shape, dtype, kernels_run, deterministic_cublas):
    # The epilogue's split bound shows the GEMM's slices of K (a warp per row past half a wave of
    # rows, which 1024 rows are on GPUs of fewer than 256 SMs at 8 CTAs per SM; B = 511 one
    # slice, a CTA per row on an H200 but a warp per row on GPUs of under 128 SMs). On an H200:
    # 4 / 2 / 1 / 2 / 1 / 2 / 1 / 1 slices.
    batch, in_features, pooled = shape
    slices = _expected_half_slices(batch, in_features, pooled)
    x, weight, bias = _exact_half_inputs(batch, in_features, pooled, dtype)
    launched = _epilogues_run(
        kernels_run, lambda: torch.ops.fused_pool_gelu.forward(x, weight, bias, 1.7)
    )
    if batch >= 1024:
        assert launched == {(32, slices, 4)}, (launched, slices)
    else:
        assert len(launched) == 1 and next(iter(launched))[1] == slices, (launched, slices)
    _assert_half_equals_float32_path(x, weight, bias, 1.7)


@pytest.mark.profiler
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_half_slices_of_k_give_the_same_bits_a_warp_or_a_cta_per_row(dtype, kernels_run):
    # Random values (sums not exact: their order shows): the same GEMM's slices summed by the
    # warp per row in 16-byte loads (an aligned bias) and by a CTA per row in scalar loads (a bias
    # view one element into its storage, the same values), in the same order: the same bits.
    torch.manual_seed(3)
    batch, in_features, pooled = 1024, 8192, 512
    slices = _expected_half_slices(batch, in_features, pooled)
    if slices == 1:
        pytest.skip("this GPU's SMs take no slices of K at this shape")
    x = torch.randn(batch, in_features, device=DEVICE, dtype=dtype)
    weight = torch.randn(pooled, in_features, device=DEVICE, dtype=dtype) / 64
    bias = torch.randn(pooled, device=DEVICE, dtype=dtype)
    shifted = torch.cat([bias.new_zeros(1), bias])[1:]
    runs = {}
    for name, b in (("aligned", bias), ("shifted", shifted)):
        launched = _epilogues_run(
            kernels_run, lambda b=b: ops.forward_with_argmax(x, weight, b, 1.7)
        )
        runs[name] = ops.forward_with_argmax(x, weight, b, 1.7)
        assert len(launched) == 1, launched
        ((threads_per_row, bound, columns_per_load),) = launched
        assert bound == slices, launched
        assert (threads_per_row, columns_per_load) == ((32, 4) if name == "aligned" else (256, 1))
    for got, want in zip(runs["aligned"], runs["shifted"]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.profiler
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_half_slices_of_k_over_views(dtype, kernels_run, deterministic_cublas):
    # Slices of K over views: x a column window of a wider tensor (stride(0) > K, a storage
    # offset), rows of x from the middle of a larger batch, and the weight a column window too.
    batch, in_features, pooled = 1024, 8192, 512  # 4 slices on an H200
    x, weight, bias = _exact_half_inputs(batch + 8, in_features + 16, pooled, dtype)
    x_view = x[5:5 + batch, 8:8 + in_features]
    weight_view = weight[:, 8:8 + in_features]
    assert x_view.stride(0) == in_features + 16 and weight_view.storage_offset() == 8
    slices = _expected_half_slices(batch, in_features, pooled)
    launched = _epilogues_run(kernels_run, lambda: _OPS.forward(x_view, weight_view, bias, 1.7))
    assert launched == {(32, slices, 4)}, (launched, slices)  # the views' slices, not one copy
    _assert_half_equals_float32_path(x_view, weight_view, bias, 1.7)


@pytest.mark.profiler
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("bias_offset", [0, 1, 2, 3, 4])
def test_half_forward_with_a_bias_view_not_aligned_to_four_columns(
    dtype, bias_offset, kernels_run, deterministic_cublas
):
    # A warp per row reads 4 columns of the bias at once where its start allows (8 bytes in a
    # half type: offsets 0 and 4); a view 1-3 elements into its storage must take scalar loads.
    # kEpilogueWarpPerRowMinBatch rows: a warp per row on any GPU, whatever one wave holds.
    x, weight, bias = _exact_half_inputs(8192, 40, 300, dtype)
    padded = torch.cat([torch.full((bias_offset,), float("nan"), device=DEVICE, dtype=dtype), bias])
    bias = padded[bias_offset:]
    launched = _epilogues_run(
        kernels_run, lambda: torch.ops.fused_pool_gelu.forward(x, weight, bias, 1.7)
    )
    assert launched == {(32, 1, 1 if bias_offset % 4 else 4)}, launched
    _assert_half_equals_float32_path(x, weight, bias, 1.7)


def _by_cta_per_row(kernels_run, x, weight, bias, scale):
    """forward_with_argmax's outputs computed 64 rows at a time, where the one-split epilogue takes
    a CTA per row and evaluates every column (asserted on the first 64): the bits that the warp
    per row's argmax_band.h band must give."""
    chunk = lambda rows: ops.forward_with_argmax(x[rows], weight, bias, scale)  # noqa: E731
    assert _epilogues_run(kernels_run, lambda: chunk(slice(0, 64))) == {(256, 1, 1)}
    return [torch.cat(parts) for parts in zip(
        *(chunk(slice(row, row + 64)) for row in range(0, x.shape[0], 64)))]


@pytest.mark.profiler
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize(
    "batch, in_features, pooled",
    [(8192, 40, 300), (8192, 40, 301), (1024, 8192, 300)],
    ids=["4-column-loads", "scalar-loads", "K-slices"],
)
@pytest.mark.parametrize(
    "bias_case", ["bias", "shifted", "nan-column", "one-column-band", "tie-in-one-lane"]
)
@pytest.mark.parametrize(
    "scale", [1.7, -1.7, 3e-45, 3e37],
    ids=["band", "negative-scale", "subnormal-products", "overflowing-products"],
)
def test_warp_row_band_gives_the_bits_of_every_columns_gelu(
    dtype, batch, in_features, pooled, bias_case, scale, kernels_run, deterministic_cublas
):
    # argmax_band.h's band in the warp-per-row epilogue (8192 rows: a warp per row of one split on
    # any GPU; 1024 rows of K = 8192: the half GEMM's slices of K, _expected_half_slices) against
    # the same op on 64 rows at a time (a CTA per row of one split, which evaluates every column),
    # on exact sums (z the same bits in both). The band decides (scale 1.7: the rows' largest z in
    # [0, 80], many columns within 2^-10 of it, ties across lanes), does not apply (a negative
    # scale; rows whose z are all negative, with the bias shifted by -20; a NaN bias element,
    # which makes one column of every row non-finite among finite ones; rows with a NaN or an Inf
    # x), or applies and does not decide (scale * gelu subnormal, or overflowing to Inf). Column
    # 77 lifted by 256 (z >= 175, the others' |z| <= 81) is alone in its rows' band: the kernel's
    # shortcut for a band of one column, with no second read; column 205, the same lane's column
    # in both load layouts, made equal to it ties with it exactly in its lane, and the first index
    # must win (which the shortcut would get right too: the test below is the one whose values
    # tie with different z). With K = 8192, x is zero but in 40 columns, 10 at the start of each
    # quarter of K (every slice contributes), so that z has the K = 40 cases' range.
    x, weight, bias = _exact_half_inputs(batch, in_features, pooled, dtype)
    if in_features > 40:
        keep = torch.zeros(in_features, dtype=torch.bool, device=DEVICE)
        for quarter in range(4):
            keep[quarter * in_features // 4:][:10] = True
        x[:, ~keep] = 0
    if bias_case == "shifted":
        bias = bias - 20  # rounded to the half type, still a multiple of 2^-7: z stays exact
    elif bias_case == "nan-column":
        bias[150] = float("nan")
    elif bias_case in ("one-column-band", "tie-in-one-lane"):
        bias[77] += 256  # rounded to the half type, a multiple of 2^-7 below 2^9: z stays exact
        if bias_case == "tie-in-one-lane":
            weight[205], bias[205] = weight[77], bias[77]
    x[5, 3] = float("nan")
    x[6, 7] = float("inf")
    launched = _epilogues_run(
        kernels_run, lambda: torch.ops.fused_pool_gelu.forward(x, weight, bias, scale)
    )
    slices = _expected_half_slices(batch, in_features, pooled)
    assert launched == {(32, slices, 4 if pooled % 4 == 0 else 1)}, launched
    out, argmax, preactivation = ops.forward_with_argmax(x, weight, bias, scale)
    expected = _by_cta_per_row(kernels_run, x, weight, bias, scale)
    for got, want in zip((out, argmax, preactivation), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert bool(out[5].isnan()) and bool(out[6].isnan())
    if bias_case == "nan-column":
        assert bool(out.isnan().all()) and bool((argmax <= 150).all())
    if bias_case in ("one-column-band", "tie-in-one-lane") and scale == 1.7:
        finite_rows = out.isfinite()
        assert int(finite_rows.sum()) == batch - 2
        assert bool((argmax[finite_rows] == 77).all())


@pytest.mark.profiler
@pytest.mark.parametrize("pooled", [300, 301], ids=["4-column-loads", "scalar-loads"])
@pytest.mark.parametrize("second", [205, 81], ids=["same-lane", "other-lane"])
def test_warp_row_band_keeps_the_first_of_two_columns_whose_values_round_equal(
    pooled, second, kernels_run
):
    # Columns 77 and `second` alone in the band, z_second = z77 + 2^-7, one float ulp at z ~ 98304
    # (bfloat16 holds that bias exactly; float16 does not), where gelu(z) = z and 0.75 z rounds two
    # neighbouring z to one value in about a quarter of the rows: there the first column wins with
    # the smaller z. Column 205 is 77's lane's in both load layouts (lane 19 of 4-column loads,
    # 13 of scalar ones), so the lane's largest z alone (the kernel's shortcut for a band of one
    # column) would give the wrong one: its second largest must send the row to the band's second
    # read. Column 81 is another lane's (20, 17), whose largest is in the band too. The same op on
    # 64 rows at a time (a CTA per row, every column evaluated) gives the bits to match; both
    # columns must win somewhere.
    batch, in_features = 8192, 40
    x, weight, bias = _exact_half_inputs(batch, in_features, pooled, torch.bfloat16)
    x[:, 0] = 1 / 8
    weight[second] = weight[77]
    weight[77, 0], weight[second, 0] = 0, 1 / 16  # x . (w_second - w77) = 2^-7 in every row
    bias[77] = bias[second] = 3 * 2**15
    scale = 0.75
    launched = _epilogues_run(
        kernels_run, lambda: torch.ops.fused_pool_gelu.forward(x, weight, bias, scale)
    )
    assert launched == {(32, 1, 4 if pooled % 4 == 0 else 1)}, launched
    out, argmax, preactivation = ops.forward_with_argmax(x, weight, bias, scale)
    expected = _by_cta_per_row(kernels_run, x, weight, bias, scale)
    for got, want in zip((out, argmax, preactivation), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    first_wins = int((argmax == 77).sum())
    assert batch // 8 < first_wins < batch // 2, first_wins
    assert first_wins + int((argmax == second).sum()) == batch


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_half_forward_on_non_contiguous_operands(dtype, deterministic_cublas):
    x, weight, bias = _exact_half_inputs(96, 2 * 300, 40, dtype)
    x_strided = x[:, ::2]  # row stride 600, column stride 2
    weight_t = weight[:, :300].t().contiguous().t()  # column-major
    bias_strided = torch.stack([bias, bias], dim=1)[:, 0]
    _assert_half_equals_float32_path(x_strided, weight_t, bias_strided, -1.5)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_half_forward_with_non_finite_values_takes_the_first_nan_column(
    dtype, check_forward, deterministic_cublas
):
    x, weight, bias = _exact_half_inputs(6, 64, 9, dtype)
    x[1, 3] = float("nan")  # every column of row 1 NaN: index 0
    x[2, 5] = float("-inf")  # row 2 non-finite in every column (0 x Inf is NaN as well)
    weight[:4, 5] = 0  # ... and NaN in its first four: still index 0
    out, argmax, preactivation = ops.forward_with_argmax(x, weight, bias, 2.0)
    check_forward(out, argmax, preactivation, x, weight, bias, 2.0)
    assert bool(out[1:3].isnan().all()) and argmax[1:3].tolist() == [0, 0]
    assert bool(out[[0, 3, 4, 5]].isfinite().all())


def test_float64_is_rejected_on_cuda_with_the_supported_dtypes():
    x = torch.randn(4, 8, device=DEVICE, dtype=torch.float64)
    with pytest.raises(
        RuntimeError, match=r"forward: x must be float32, float16 or bfloat16 on cuda"
    ):
        ops.forward(x, x[:2], None, 2.0)


# ----------------------------------------------------------------------------------------------
# Graphs, streams, determinism


@pytest.mark.graphs
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("batch", [8, 1024])
def test_cuda_graph_replay_of_the_op_equals_eager(batch, dtype, make_inputs, capture_graph):
    x, weight, bias = make_inputs(batch, 2048, 128, dtype, DEVICE)
    static_x = x.clone()
    graph, static_out = capture_graph(lambda: ops.forward_with_argmax(static_x, weight, bias, 2.0))
    for _ in range(3):
        fresh = torch.randn_like(x)
        static_x.copy_(fresh)
        graph.replay()
        expected = ops.forward_with_argmax(fresh, weight, bias, 2.0)
        for replayed, eager in zip(static_out, expected):
            assert torch.equal(replayed, eager)


@pytest.mark.graphs
@pytest.mark.parametrize("batch", [8, 1024])
def test_cuda_graph_replay_of_model_new_under_no_grad_equals_eager(batch, capture_graph):
    _, new = _models(2048, 2048, 16, 2.0, seed=5)
    static_x = torch.rand(batch, 2048, device=DEVICE)
    with torch.no_grad():
        graph, static_out = capture_graph(lambda: new(static_x))
        for _ in range(3):
            fresh = torch.rand_like(static_x)
            static_x.copy_(fresh)
            graph.replay()
            assert torch.equal(static_out, new(fresh))


@pytest.mark.graphs
@pytest.mark.profiler
@pytest.mark.parametrize("batch", [8, 128, 1024])
def test_cuda_graph_of_the_op_on_weights_folded_once_equals_model_new(
    batch, capture_graph, kernels_run
):
    # docs/training.md's pattern for fixed weights: the op captured on ModelNew's folded
    # parameters and their prepared copy (N x K = 2^22: the certified path at 128 and 1024 rows),
    # the same bits as ModelNew's eager calls, which read the same cache.
    _, new = _models(8192, 512, 1, 2.0, seed=6)
    static_x = torch.rand(batch, 8192, device=DEVICE)
    with torch.no_grad():
        pooled_weight, pooled_bias = new.folded_parameters()
        prepared_weight = fused_pool_gelu.prepare_weight(pooled_weight)
        call = lambda: fused_pool_gelu.forward(  # noqa: E731
            static_x, pooled_weight, pooled_bias, new.scale_factor, prepared_weight)
        certified = any("certified" in name for name in kernels_run(call))
        assert certified == (batch > 8 and _has_wgmma_gemm())
        graph, static_out = capture_graph(call)
        for _ in range(2):
            fresh = torch.rand_like(static_x)
            static_x.copy_(fresh)
            graph.replay()
            assert torch.equal(static_out, new(fresh))


@pytest.mark.graphs
def test_cuda_graph_capture_of_a_training_step_equals_eager(make_inputs, capture_graph):
    x, weight, bias = make_inputs(512, 1024, 256, torch.float32, DEVICE)
    weight, bias = weight.requires_grad_(True), bias.requires_grad_(True)
    static_x = x.clone()
    grad_out = torch.randn(512, device=DEVICE)

    def step():
        pooled_weight, pooled_bias = ops.fold(weight, bias, 4)
        out = ops.forward(static_x, pooled_weight, pooled_bias, 2.0)
        return torch.autograd.grad(out, (weight, bias), grad_out)

    graph, static_grads = capture_graph(step)
    fresh = torch.randn_like(x)
    static_x.copy_(fresh)
    graph.replay()
    for replayed, eager in zip(static_grads, step()):
        assert torch.equal(replayed, eager)


def test_ops_run_on_the_current_non_default_stream(make_inputs):
    x, weight, bias = make_inputs(1024, 2048, 128, torch.float32, DEVICE)
    expected = ops.forward_with_argmax(x, weight, bias, 2.0)
    grad_out = torch.randn(1024, device=DEVICE)
    expected_grads = _OPS.forward_backward(grad_out, None, x, weight, *expected[1:], 2.0)
    torch.cuda.synchronize()

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        # The input is produced on this stream after a long sleep: a kernel launched on any
        # other stream would read it before it is written.
        x_late = torch.empty_like(x)
        torch.cuda._sleep(50_000_000)
        x_late.copy_(x)
        result = ops.forward_with_argmax(x_late, weight, bias, 2.0)
        grads = _OPS.forward_backward(grad_out, None, x_late, weight, *result[1:], 2.0)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    for a, b in zip((*result, *grads), (*expected, *expected_grads)):
        assert torch.equal(a, b)


# (batch, pooled) around the grouping kernel's tile of 4096 rows and scan chunk of 4096 segments
# (group_rows in csrc/cuda/backward.cu): one tile, a tile boundary, several tiles, several
# chunks, single row and single segment. The crowded groups below span many of the segment
# reduction's tiles of sorted rows; with one group (96, 1) all rows are in it.
GROUPING_SHAPES = [(1, 1), (37, 5), (96, 1), (4096, 512), (4097, 4097), (10000, 300), (3000, 9000)]


@pytest.mark.parametrize("batch,pooled", GROUPING_SHAPES, ids=str)
@pytest.mark.parametrize(
    "in_features,x_layout", [(24, "contiguous"), (300, "column-major")], ids=str
)
def test_backward_adds_each_arg_max_group_in_its_fixed_order(
    batch, pooled, in_features, x_layout, ref
):
    # With grad_preactivation alone, dz[b] is that value exactly (no erf or exp), so grad_weight
    # and grad_bias must be, bit for bit, the float32 sums in the order of csrc/summation_order.h
    # (ref.grouped_sums): with random values any other order, or a row lost or counted twice, shows.
    # 24 columns of a contiguous x (part of one 256-column chunk of the segment reduction) and 300
    # of a column-major one (stride 1 along the batch; a full chunk and a partial one).
    gen = torch.Generator().manual_seed(batch * 7919 + pooled + in_features)
    if x_layout == "contiguous":
        x = torch.randn(batch, in_features, generator=gen)
    else:
        x = torch.randn(in_features, batch, generator=gen).t()
    weight = torch.randn(pooled, in_features, generator=gen)
    # Half the rows crowd into three groups (long groups across tiles), the rest spread out, and
    # about 5% are out of range (in no group: NaN grad_x, nothing added).
    crowded = torch.randint(0, min(pooled, 3), (batch,), generator=gen)
    spread = torch.randint(0, pooled, (batch,), generator=gen)
    pick = torch.rand(batch, generator=gen)
    argmax = torch.where(pick < 0.5, crowded, spread)
    argmax = torch.where(pick > 0.975, torch.full_like(argmax, -1), argmax)
    past_the_end = torch.full_like(argmax, pooled + 3)
    argmax = torch.where((pick > 0.95) & (pick <= 0.975), past_the_end, argmax)
    dz = torch.randn(batch, generator=gen)

    x_cuda = x.cuda()
    assert x_cuda.stride() == x.stride()
    grad_x, grad_weight, grad_bias = _OPS.forward_backward(
        None, dz.cuda(), x_cuda, weight.cuda(), argmax.cuda(), torch.randn(batch).cuda(), 2.0
    )
    expected_weight, expected_bias = ref.grouped_sums(x, dz, argmax, pooled)
    valid = (argmax >= 0) & (argmax < pooled)
    assert torch.equal(grad_weight.cpu().view(torch.int32), expected_weight.view(torch.int32))
    assert torch.equal(grad_bias.cpu().view(torch.int32), expected_bias.view(torch.int32))
    expected_x = dz[valid, None] * weight[argmax[valid]]
    assert torch.equal(grad_x.cpu()[valid].view(torch.int32), expected_x.view(torch.int32))
    assert bool(grad_x.cpu()[~valid].isnan().all())


def test_forward_and_backward_are_bitwise_deterministic_run_to_run(deterministic_algorithms):
    model, new = _models(2048, 2048, 16, 2.0, seed=9)
    x = torch.rand(1024, 2048, device=DEVICE)

    def run():
        new.zero_grad(set_to_none=True)
        x_leaf = x.clone().requires_grad_(True)
        out = new(x_leaf)
        out.backward(torch.linspace(-1, 1, 1024, device=DEVICE))
        return out.detach(), x_leaf.grad, new.matmul.weight.grad, new.matmul.bias.grad

    first = run()
    for _ in range(3):
        for a, b in zip(first, run()):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_default_shape_forward_is_bitwise_deterministic(dtype, deterministic_algorithms):
    _, new = _models(8192, 8192, 16, 2.0, seed=0)
    new = new.to(dtype)
    x = torch.rand(1024, 8192, device=DEVICE, dtype=dtype)
    with torch.no_grad():
        first = new(x)
        for _ in range(3):
            assert torch.equal(new(x), first)


@pytest.mark.profiler
def test_deterministic_mode_fills_the_forward_workspace(make_inputs, deterministic_algorithms):
    # What the tests taking deterministic_algorithms for a NaN-filled workspace rely on: every
    # at::empty of the op is filled before its kernels run, the split-K workspace as well as the
    # three outputs (B = 64 at K = 4096, N = 512: the 3xTF32 GEMM and its epilogue).
    x, weight, bias = make_inputs(64, 4096, 512, torch.float32, DEVICE)
    ops.forward_with_argmax(x, weight, bias, 2.0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        ops.forward_with_argmax(x, weight, bias, 2.0)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    fills = [n for n in names if "fill" in n.lower()]
    assert len(fills) >= 4, names


# ----------------------------------------------------------------------------------------------
# Devices


def test_inputs_on_different_devices_are_rejected():
    x = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(RuntimeError, match=r"forward: weight must be on the same device as x"):
        ops.forward(x, torch.randn(3, 8), None, 2.0)
    with pytest.raises(RuntimeError, match=r"fold: bias must be on the same device as weight"):
        ops.fold(torch.randn(8, 4, device=DEVICE), torch.randn(8), 2)


def test_model_new_cache_refolds_after_moving_between_devices(monkeypatch):
    calls = []
    real_fold = _fold_cache._FOLD  # the cache's own fold call
    monkeypatch.setattr(_fold_cache, "_FOLD", lambda *a: calls.append(a) or real_fold(*a))
    torch.manual_seed(12)
    model = Model(64, 48, 4, 2.0)
    new = ModelNew.from_model(model)
    x = torch.rand(16, 64)
    with torch.no_grad():
        new(x)
        new.to(DEVICE)
        on_gpu = new(x.to(DEVICE))
        new.cpu()
        back = new(x)
    assert len(calls) == 3
    assert on_gpu.device.type == "cuda" and back.device.type == "cpu"
    torch.testing.assert_close(on_gpu.cpu(), model(x), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(back, model(x), atol=1e-4, rtol=1e-4)


def test_model_new_cache_follows_a_dtype_round_trip():
    # The caching allocator hands the blocks freed by .half() straight back to .float(): the
    # parameters keep identity, address, version counter, dtype and device, but their values
    # were rounded. The cache must not serve the fold of the old values.
    torch.manual_seed(13)
    new = ModelNew(256, 256, 4, 2.0).to(DEVICE)
    x = torch.rand(32, 256, device=DEVICE)
    with torch.no_grad():
        new(x)
        new.half().float()
        out = new(x)
        fresh = ops.forward(x, *ops.fold(new.matmul.weight, new.matmul.bias, 4), 2.0)
    assert torch.equal(out, fresh)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_ops_run_on_the_device_of_their_inputs_not_the_current_device(make_inputs):
    x, weight, bias = make_inputs(64, 256, 16, torch.float32, "cuda:1")
    expected = ops.forward_with_argmax(x.cpu(), weight.cpu(), bias.cpu(), 2.0)
    with torch.cuda.device(0):
        result = ops.forward_with_argmax(x, weight, bias, 2.0)
    assert all(t.device == torch.device("cuda:1") for t in result)
    torch.testing.assert_close(result[0].cpu(), expected[0], atol=1e-5, rtol=1e-5)
