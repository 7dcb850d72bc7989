"""The ops (fold, fold_backward, forward, forward_with_argmax, forward_backward, model_forward,
model_backward) as specifications.

Each op is compared with plain PyTorch float64 formulas (conftest ``ref``), across the shapes
that break kernels: tiny K, O % k != 0, k = 1, k = O, empty and single-row batches,
non-contiguous inputs, special values; then opcheck and the documented errors.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.library import opcheck

from fused_pool_gelu import ModelNew, ops

_OPS = torch.ops.fused_pool_gelu

DTYPES = [torch.float32, torch.float64]

# (B, K, O, k): batch, in_features, out_features, pool kernel size.
SHAPES = [
    pytest.param((5, 1, 8, 2), id="K=1"),
    pytest.param((5, 3, 12, 4), id="K=3"),
    pytest.param((5, 257, 64, 4), id="K=257"),
    pytest.param((7, 32, 50, 8), id="O%k!=0"),
    pytest.param((5, 32, 16, 1), id="k=1"),
    pytest.param((5, 32, 24, 24), id="k=O"),
    pytest.param((0, 32, 32, 4), id="B=0"),
    pytest.param((1, 32, 32, 4), id="B=1"),
    pytest.param((5, 16, 1, 1), id="N=1,O=1"),
    pytest.param((300, 96, 80, 4), id="B=300"),
]


def _pooled_inputs(make_inputs, shape, dtype, device, bias=True):
    """x [B, K] and a pooled weight [N = O // k, K] with its bias [N] (or None)."""
    batch, in_features, out_features, k = shape
    x, weight, b = make_inputs(batch, in_features, out_features // k, dtype, device, bias=bias)
    return x, weight, b


# ----------------------------------------------------------------------------------------------
# fold / fold_backward


@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
def test_fold_returns_group_means_of_rows(shape, dtype, has_bias, device, make_inputs, ref):
    _, in_features, out_features, k = shape
    _, weight, bias = make_inputs(1, in_features, out_features, dtype, device, bias=has_bias)
    pooled_weight, pooled_bias = ops.fold(weight, bias, k)
    expected_weight, expected_bias = ref.fold(weight, bias, k)
    n = out_features // k
    assert pooled_weight.shape == (n, in_features) and pooled_bias.shape == (n,)
    assert pooled_weight.dtype == dtype and pooled_bias.dtype == dtype
    assert pooled_weight.device == weight.device and pooled_bias.device == weight.device
    tol = ref.tolerance(dtype)
    torch.testing.assert_close(pooled_weight.double(), expected_weight, atol=tol, rtol=tol)
    torch.testing.assert_close(pooled_bias.double(), expected_bias, atol=tol, rtol=tol)


def test_fold_without_bias_gives_zero_pooled_bias(device, make_inputs):
    _, weight, _ = make_inputs(1, 8, 12, torch.float32, device, bias=False)
    _, pooled_bias = ops.fold(weight, None, 3)
    assert torch.equal(pooled_bias, torch.zeros(4, device=device))


def test_fold_drops_the_tail_rows(device, make_inputs):
    _, weight, bias = make_inputs(1, 8, 11, torch.float32, device)
    changed_weight, changed_bias = weight.clone(), bias.clone()
    changed_weight[9:] = torch.randn(2, 8, device=device)
    changed_bias[9:] = torch.randn(2, device=device)
    for a, b in zip(ops.fold(weight, bias, 3), ops.fold(changed_weight, changed_bias, 3)):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "layout", ["transposed", "sliced_rows", "sliced_columns", "expanded"]
)
def test_fold_accepts_non_contiguous_weight(layout, device, ref):
    out_features, in_features, k = 12, 10, 3
    if layout == "transposed":
        weight = torch.randn(in_features, out_features, device=device).t()
    elif layout == "sliced_rows":
        weight = torch.randn(2 * out_features, in_features, device=device)[::2]
    elif layout == "sliced_columns":
        weight = torch.randn(out_features, 2 * in_features + 1, device=device)[:, 1::2]
    else:
        weight = torch.randn(1, in_features, device=device).expand(out_features, in_features)
    bias = torch.randn(2 * out_features, device=device)[::2]
    assert not weight.is_contiguous()
    pooled_weight, pooled_bias = ops.fold(weight, bias, k)
    expected_weight, expected_bias = ref.fold(weight, bias, k)
    torch.testing.assert_close(pooled_weight.double(), expected_weight, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(pooled_bias.double(), expected_bias, atol=1e-6, rtol=1e-6)


# (O, K, k); O % k != 0 in the last three: the tail rows, which fold_backward must write as zeros
# into its fresh output (NaN-filled here by the deterministic mode).
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape",
    [(9, 4, 3), (8, 5, 8), (7, 3, 1), (1, 2, 1), (10, 4, 3), (13, 5, 4), (7, 9, 2)],
    ids=str,
)
def test_fold_backward_spreads_each_pooled_row_over_its_group_divided_by_k(
    shape, dtype, device, deterministic_algorithms, ref
):
    out_features, in_features, k = shape
    n = out_features // k
    grad_pooled_weight = torch.randn(n, in_features, dtype=dtype, device=device)
    grad_pooled_bias = torch.randn(n, dtype=dtype, device=device)
    grad_weight, grad_bias = _OPS.fold_backward(
        grad_pooled_weight, grad_pooled_bias, out_features, k
    )
    expected_weight, expected_bias = ref.fold_backward(
        grad_pooled_weight, grad_pooled_bias, out_features, k
    )
    assert grad_weight.shape == (out_features, in_features) and grad_weight.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(grad_weight.double(), expected_weight, atol=tol, rtol=tol)
    torch.testing.assert_close(grad_bias.double(), expected_bias, atol=tol, rtol=tol)


def test_fold_backward_is_the_adjoint_of_fold(device, exact_dtype, ref):
    # <fold(W, b), (G, g)> == <(W, b), fold_backward(G, g)> for every W, b, G, g.
    out_features, in_features, k = 14, 6, 4
    gen = dict(dtype=exact_dtype, device=device)
    weight = torch.randn(out_features, in_features, **gen)
    bias = torch.randn(out_features, **gen)
    grad_w = torch.randn(out_features // k, in_features, **gen)
    grad_b = torch.randn(out_features // k, **gen)
    pooled_weight, pooled_bias = ops.fold(weight, bias, k)
    back_w, back_b = _OPS.fold_backward(grad_w, grad_b, out_features, k)
    lhs = (pooled_weight * grad_w).sum() + (pooled_bias * grad_b).sum()
    rhs = (weight * back_w).sum() + (bias * back_b).sum()
    tol = ref.tolerance(exact_dtype)
    torch.testing.assert_close(lhs, rhs, atol=tol, rtol=tol)


def _transparent_huge_pages_mode():
    """The system's THP setting ("always", "madvise", "never"), or None where there is none."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as file:
            text = file.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def _mapping_flags(address):
    """VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    with open("/proc/self/smaps") as file:
        inside = False
        for line in file:
            fields = line.split()
            if "-" in fields[0] and ":" not in fields[0]:  # a mapping's header: start-end ...
                start, end = (int(v, 16) for v in fields[0].split("-"))
                inside = start <= address < end
            elif inside and fields[0] == "VmFlags:":
                return fields[1:]
    raise AssertionError(f"no mapping holds address {address:#x}")


@pytest.mark.skipif(_transparent_huge_pages_mode() != "madvise",
                    reason="needs Linux with transparent huge pages set to madvise")
def test_large_cpu_gradients_are_advised_to_take_huge_pages(ref):
    # The fold's adjoint writes the dense weight gradient on every step: fresh memory, whose 4 KB
    # page faults made most of a small-batch CPU step (docs/training.md, "On the CPU"). Its
    # buffer is advised to take huge pages (csrc/cpu/huge_pages.h), with the same values. The
    # advice is what the op controls, and smaps records it ("hg"); whether the kernel then maps
    # huge pages depends on the buffer's history (memory the allocator reuses from its heap is
    # already mapped) and on the system's free memory.
    out_features, in_features, k = 2048, 4096, 4  # a 32 MB gradient
    grad_pooled_weight = torch.randn(out_features // k, in_features)
    grad_pooled_bias = torch.randn(out_features // k)
    grad_weight, grad_bias = _OPS.fold_backward(
        grad_pooled_weight, grad_pooled_bias, out_features, k
    )
    # The advice covers the buffer's whole 2 MB pages: its middle lies in them (the mapping is
    # split where the advice starts).
    middle = grad_weight.data_ptr() + grad_weight.nbytes // 2
    assert "hg" in _mapping_flags(middle)
    expected_weight, expected_bias = ref.fold_backward(
        grad_pooled_weight, grad_pooled_bias, out_features, k
    )
    torch.testing.assert_close(grad_weight.double(), expected_weight, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad_bias.double(), expected_bias, atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------------------------
# forward / forward_with_argmax


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_with_argmax_matches_reference(shape, dtype, device, make_inputs, check_forward):
    x, weight, bias = _pooled_inputs(make_inputs, shape, dtype, device)
    out, argmax, preactivation = ops.forward_with_argmax(x, weight, bias, 2.0)
    check_forward(out, argmax, preactivation, x, weight, bias, 2.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch, pooled", [(600, 16384), (2500, 4096)], ids=["N=16384", "N=4096"])
def test_cpu_forward_over_several_row_blocks(batch, pooled, dtype, make_inputs, check_forward):
    # The CPU forward multiplies blocks of max(256, 16 MB / (N x element size)) rows: 256 rows
    # (float32 and float64) at N = 16384, 1024 / 512 at N = 4096; both batches end in a partial
    # block.
    # Its memory bound (docs/input_classes.md): no allocation larger than a block's product,
    # where the whole [batch, N] product would be 2.3-4.9 times larger.
    from torch.profiler import ProfilerActivity, profile

    x, weight, bias = make_inputs(batch, 8, pooled, dtype, "cpu")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out, argmax, preactivation = ops.forward_with_argmax(x, weight, bias, 2.0)
    check_forward(out, argmax, preactivation, x, weight, bias, 2.0)
    product_bytes = 8 if dtype == torch.float64 else 4  # half types multiply in float32
    block_bound = max(16 << 20, 256 * pooled * product_bytes)
    assert block_bound < batch * pooled * product_bytes
    allocations = [event.cpu_memory_usage for event in prof.events() if event.cpu_memory_usage > 0]
    assert allocations and max(allocations) <= block_bound


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
def test_fold_then_forward_matches_model(shape, dtype, device, make_inputs, ref):
    batch, in_features, out_features, k = shape
    x, weight, bias = make_inputs(batch, in_features, out_features, dtype, device)
    pooled_weight, pooled_bias = ops.fold(weight, bias, k)
    out = ops.forward(x, pooled_weight, pooled_bias, 2.0)
    expected = ref.model_forward(x, weight, bias, k, 2.0)
    assert out.shape == (batch,) and out.dtype == dtype
    tol = ref.tolerance(dtype)
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(
    batch=st.integers(0, 9),
    in_features=st.integers(1, 40),
    out_features=st.integers(1, 40),
    k_fraction=st.floats(0.0, 1.0),
    scale=st.floats(-4.0, 4.0, allow_nan=False),
    has_bias=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_fold_then_forward_matches_model_on_any_shape(
    batch, in_features, out_features, k_fraction, scale, has_bias, seed
):
    # Property form of the shape list above (CPU, float64): any K, any O, any 1 <= k <= O.
    k = 1 + int(k_fraction * (out_features - 1))
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, in_features, dtype=torch.float64, generator=generator)
    weight = torch.randn(out_features, in_features, dtype=torch.float64, generator=generator)
    bias = torch.randn(out_features, dtype=torch.float64, generator=generator) if has_bias else None
    out = ops.forward(x, *ops.fold(weight, bias, k), scale)
    expected = _model_forward64(x, weight, bias, k, scale)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-10)


def _model_forward64(x, weight, bias, k, scale):
    y = x @ weight.t() + (0 if bias is None else bias)
    y = torch.nn.functional.avg_pool1d(y.unsqueeze(1), k).squeeze(1)
    return (torch.nn.functional.gelu(y) * scale).max(dim=1).values


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_equals_out_of_forward_with_argmax(dtype, device, make_inputs):
    x, weight, bias = make_inputs(9, 40, 6, dtype, device)
    out = ops.forward(x, weight, bias, 1.5)
    out_with_argmax, _, _ = ops.forward_with_argmax(x, weight, bias, 1.5)
    assert torch.equal(out, out_with_argmax)


@pytest.mark.parametrize("scale", [2.0, -1.5, 0.0, 1e-3], ids=str)
def test_forward_honours_any_scale(scale, device, exact_dtype, make_inputs, check_forward):
    x, weight, bias = make_inputs(16, 24, 9, exact_dtype, device)
    out, argmax, preactivation = ops.forward_with_argmax(x, weight, bias, scale)
    check_forward(out, argmax, preactivation, x, weight, bias, scale)


def test_forward_with_zero_scale_returns_zero_at_the_first_index(device, make_inputs):
    x, weight, bias = make_inputs(6, 16, 5, torch.float32, device)
    out, argmax, _ = ops.forward_with_argmax(x, weight, bias, 0.0)
    assert torch.equal(out.abs(), torch.zeros(6, device=device))
    assert torch.equal(argmax, torch.zeros(6, dtype=torch.long, device=device))


def test_negative_scale_takes_the_smallest_gelu(device, exact_dtype, make_inputs, ref):
    x, weight, bias = make_inputs(10, 16, 7, exact_dtype, device)
    out = ops.forward(x, weight, bias, -3.0)
    gelu = ref.values(x, weight, bias, 1.0)
    tol = ref.tolerance(exact_dtype)
    torch.testing.assert_close(
        out.double(), -3.0 * gelu.min(dim=1).values, atol=tol, rtol=tol
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_with_bias_none_equals_zero_bias(dtype, device, make_inputs, check_forward):
    x, weight, _ = make_inputs(8, 20, 6, dtype, device, bias=False)
    result = ops.forward_with_argmax(x, weight, None, 2.0)
    check_forward(*result, x, weight, None, 2.0)
    with_zeros = ops.forward_with_argmax(x, weight, torch.zeros(6, dtype=dtype, device=device), 2.0)
    for a, b in zip(result, with_zeros):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


X_LAYOUTS = ["transposed", "sliced_columns", "offset_columns", "sliced_rows", "expanded"]


def _x_with_layout(layout, batch, in_features, dtype, device):
    if layout == "transposed":
        x = torch.randn(in_features, batch, dtype=dtype, device=device).t()
    elif layout == "sliced_columns":
        x = torch.randn(batch, 2 * in_features, dtype=dtype, device=device)[:, ::2]
    elif layout == "offset_columns":
        x = torch.randn(batch, in_features + 3, dtype=dtype, device=device)[:, 3:]
    elif layout == "sliced_rows":
        x = torch.randn(3 * batch, in_features, dtype=dtype, device=device)[1::3]
    elif layout == "expanded":
        x = torch.randn(1, in_features, dtype=dtype, device=device).expand(batch, in_features)
    else:
        raise ValueError(layout)
    assert not x.is_contiguous()
    return x


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", X_LAYOUTS)
def test_forward_accepts_non_contiguous_x(layout, dtype, device, make_inputs, check_forward):
    _, weight, bias = make_inputs(1, 33, 7, dtype, device)
    x = _x_with_layout(layout, 10, 33, dtype, device)
    out, argmax, preactivation = ops.forward_with_argmax(x, weight, bias, 2.0)
    check_forward(out, argmax, preactivation, x, weight, bias, 2.0)


@pytest.mark.parametrize("layout", ["transposed", "sliced_rows", "sliced_columns"])
def test_forward_accepts_non_contiguous_weight_and_bias(layout, device, make_inputs, check_forward):
    x, _, _ = make_inputs(10, 33, 7, torch.float32, device)
    n, in_features = 7, 33
    if layout == "transposed":
        weight = torch.randn(in_features, n, device=device).t()
    elif layout == "sliced_rows":
        weight = torch.randn(2 * n, in_features, device=device)[::2]
    else:
        weight = torch.randn(n, 2 * in_features, device=device)[:, 1::2]
    weight = weight / in_features**0.5
    bias = torch.randn(2 * n, device=device)[1::2]
    out, argmax, preactivation = ops.forward_with_argmax(x, weight, bias, 2.0)
    check_forward(out, argmax, preactivation, x, weight, bias, 2.0)


@pytest.mark.parametrize("batch", [0, 1])
def test_forward_small_batches_have_matching_shapes(batch, device, make_inputs):
    x, weight, bias = make_inputs(batch, 12, 4, torch.float32, device)
    out, argmax, preactivation = ops.forward_with_argmax(x, weight, bias, 2.0)
    assert out.shape == argmax.shape == preactivation.shape == (batch,)
    assert argmax.dtype == torch.int64
    assert ops.forward(x, weight, bias, 2.0).shape == (batch,)


def _exact_tie_inputs(batch, in_features, dtype, device):
    """Weight rows and biases duplicated in an interleaved order, values on a dyadic grid so that
    every dot product is exact whatever the summation order: duplicate columns tie bitwise."""
    base_rows = 4
    order = torch.tensor([2, 0, 3, 1, 0, 2, 1, 3, 3, 0])  # each base row appears 2-3 times
    x = torch.randint(-3, 4, (batch, in_features)).to(dtype) / 4
    base_weight = torch.randint(-4, 5, (base_rows, in_features)).to(dtype) / 8
    base_bias = torch.randint(-4, 5, (base_rows,)).to(dtype) / 8
    return (
        x.to(device),
        base_weight[order].contiguous().to(device),
        base_bias[order].contiguous().to(device),
        order,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", [2.0, -0.5])
def test_argmax_ties_go_to_the_smallest_index(scale, dtype, device, ref):
    x, weight, bias, order = _exact_tie_inputs(40, 24, dtype, device)
    out, argmax, preactivation = ops.forward_with_argmax(x, weight, bias, scale)
    values = ref.values(x, weight, bias, scale)
    best, first = torch.max(values, dim=1)
    # The test only means something if each row's maximum is reached at least twice.
    assert bool(((values == best[:, None]).sum(dim=1) >= 2).all())
    assert torch.equal(argmax, first)
    # and the first occurrence of each base row is the one chosen.
    first_of_base = {int(r): i for i, r in reversed(list(enumerate(order.tolist())))}
    assert all(int(a) == first_of_base[int(order[a])] for a in argmax.cpu())
    tol = ref.tolerance(dtype)
    torch.testing.assert_close(out.double(), best, atol=tol, rtol=tol)


def test_argmax_ties_among_all_columns_pick_index_zero(device):
    # Dyadic values: every dot product is exact, so the six identical columns tie bitwise.
    x = (torch.randint(-3, 4, (5, 12)) / 4).to(device)
    weight = (torch.randint(-4, 5, (1, 12)) / 8).expand(6, 12).contiguous().to(device)
    _, argmax, _ = ops.forward_with_argmax(x, weight, torch.full((6,), 0.25, device=device), 2.0)
    assert torch.equal(argmax, torch.zeros(5, dtype=torch.long, device=device))


def _preactivations_around_the_band(case, dtype, rows, columns, generator):
    """Pre-activations z [rows, columns], a bias (or None) and a scale that put columns where the
    CPU forward's shortcut (csrc/cpu/forward.cpp, best_column_of_row: the GELU evaluated only for z
    within 2^-10 of the row's largest) must either see every winner or fall back to every column."""
    finfo = torch.finfo(dtype)
    uniform = lambda low, high: low + (high - low) * torch.rand(  # noqa: E731
        rows, columns, generator=generator, dtype=dtype)
    shuffled = lambda z: z.gather(  # noqa: E731
        1, torch.argsort(torch.rand(rows, columns, generator=generator), dim=1))
    bias, scale = None, 2.0
    if case == "ulp_ties":
        # z ulps apart in ascending order, where scale * gelu(z) = 1.5 z rounds up a binade (z in
        # [2^3 4 / 3, 2^4)): neighbouring z tie, and the first of a tie is not z_max's column.
        top = uniform(2**3 * 4 / 3, 2**4)[:, :1]
        steps = torch.randint(0, 8, (rows, columns), generator=generator).to(dtype)
        z = (top - steps * (finfo.eps * 2**3)).sort(dim=1).values  # an ulp of [2^3, 2^4): exact
        scale = 1.5
    elif case == "near_smallest":  # z_max and the values around sqrt(smallest normal)
        z = math.sqrt(finfo.tiny) * uniform(0.25, 4.0)
    elif case == "subnormal_z":  # 0.5 z of neighbouring subnormals ties; a huge scale hides it
        subnormals = torch.arange(1, columns + 1, dtype=dtype) * (finfo.smallest_normal * finfo.eps)
        z = shuffled(subnormals.expand(rows, columns))
        scale = 2.0**100 if dtype == torch.float32 else 2.0**1000
    elif case == "overflow":  # scale * gelu is Inf for many columns: the first one wins
        z = finfo.max * uniform(1e-8, 0.9)
        scale = 1e10
    elif case == "underflow":  # scale * gelu a few subnormal ulps: ties far outside the band
        z = uniform(0.5, 4.0)
        scale = 2.0**-146 if dtype == torch.float32 else 2.0**-1071
    elif case == "negative_scale":
        z = torch.randn(rows, columns, generator=generator, dtype=dtype)
        scale = -2.0
    elif case == "all_negative":  # z_max < 0: the largest GELU may be the most negative z's
        z = -torch.randn(rows, columns, generator=generator, dtype=dtype).abs() * 4
    elif case in ("nan_and_minus_inf", "plus_inf"):  # through the bias; the first one wins
        z = torch.randn(rows, columns, generator=generator, dtype=dtype)
        bias = torch.zeros(columns, dtype=dtype)
        if case == "plus_inf":  # becomes z_max: caught by the band's best value, NaN
            bias[[17, 3]] = float("inf")
        else:  # below z_max: caught only by the finiteness test
            bias[[30, 9]] = torch.tensor([float("nan"), -float("inf")], dtype=dtype)
    elif case == "with_bias":  # the band and z_max are of z + bias
        z = torch.randn(rows, columns, generator=generator, dtype=dtype)
        bias = torch.randn(columns, generator=generator, dtype=dtype) * 2
    else:
        assert case == "randn"
        z = torch.randn(rows, columns, generator=generator, dtype=dtype)
    # An identity GEMM reproduces z bit for bit: every other term is +-0 (so no z may be 0, whose
    # sign the sum could change, and no z may be infinite: Inf x 0 is NaN).
    assert bool((z != 0).all() and z.isfinite().all())
    return z, bias, scale


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "case",
    ["randn", "with_bias", "ulp_ties", "near_smallest", "subnormal_z", "overflow", "underflow",
     "negative_scale", "all_negative", "nan_and_minus_inf", "plus_inf"],
)
def test_cpu_forward_takes_the_first_best_of_every_columns_own_value(case, dtype):
    # With an identity weight z = x exactly, so each column's own value is the forward of that
    # column alone; the row's answer must be torch.max's rule over all of them, bit for bit,
    # whichever columns the CPU kernel evaluated. (The values come from the kernel's own GELU:
    # this checks the selection; the GELU is checked against float64 elsewhere.)
    rows, columns = 64, 80
    z, bias, scale = _preactivations_around_the_band(
        case, dtype, rows, columns, torch.Generator().manual_seed(columns))
    out, argmax, preactivation = ops.forward_with_argmax(
        z, torch.eye(columns, dtype=dtype), bias, scale)
    one = torch.ones(1, 1, dtype=dtype)
    own = torch.stack(
        [ops.forward_with_argmax(z[:, n : n + 1], one, None if bias is None else bias[n : n + 1],
                                 scale)[0] for n in range(columns)], dim=1)
    nan = own.isnan()
    best = torch.where(nan.any(dim=1), nan.to(torch.int8).argmax(dim=1),
                       (own == own.max(dim=1, keepdim=True).values).to(torch.int8).argmax(dim=1))
    assert torch.equal(argmax, best)
    rows_index = torch.arange(rows)
    bits = torch.int32 if dtype == torch.float32 else torch.int64
    assert torch.equal(out.view(bits), own[rows_index, best].view(bits))
    z_biased = z if bias is None else z + bias
    assert torch.equal(preactivation.view(bits), z_biased[rows_index, best].view(bits))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("where", ["x_row", "weight_rows", "bias_entries"])
def test_nan_makes_the_output_nan_at_the_first_nan_index(
    where, dtype, device, make_inputs, check_forward, ref
):
    x, weight, bias = make_inputs(8, 20, 9, dtype, device)
    if where == "x_row":
        x[3, 7] = float("nan")
    elif where == "weight_rows":
        weight[6, 2] = float("nan")
        weight[4, 11] = float("nan")
    else:
        bias[5] = float("nan")
        bias[8] = float("nan")
    out, argmax, preactivation = ops.forward_with_argmax(x, weight, bias, 2.0)
    check_forward(out, argmax, preactivation, x, weight, bias, 2.0)
    expected_best, expected_index = torch.max(ref.values(x, weight, bias, 2.0), dim=1)
    assert torch.equal(torch.isnan(out), torch.isnan(expected_best))
    assert bool(torch.isnan(out).any())
    nan_rows = torch.isnan(expected_best)
    assert torch.equal(argmax[nan_rows], expected_index[nan_rows])
    if where == "x_row":
        assert torch.isnan(out).nonzero().flatten().tolist() == [3]
    elif where == "weight_rows":
        assert bool((argmax == 4).all())
    else:
        assert bool((argmax == 5).all())


# docs/input_classes.md: a row holding any non-finite pre-activation gives NaN, with the
# arg-max at its first non-finite column. (case, the row(s) affected, the expected arg-max there).
INF_CASES = {
    "x_inf_positive_column": ([2], 0),  # every z of row 2 is +inf
    "x_inf_mixed_signs": ([2], 0),  # +inf and -inf in row 2
    "bias_pos_inf": (None, 4),  # column 4 is +inf in every row
    "bias_pos_and_neg_inf": (None, 3),  # column 5 is +inf and column 3 -inf in every row
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(INF_CASES))
def test_inf_input_gives_nan_at_the_first_non_finite_column(
    case, dtype, device, make_inputs, check_forward
):
    x, weight, bias = make_inputs(6, 16, 7, dtype, device)
    if case == "x_inf_positive_column":
        weight[:, 5] = weight[:, 5].abs() + 0.1
        x[2, 5] = float("inf")
    elif case == "x_inf_mixed_signs":
        weight[:, 5] = torch.linspace(-1, 1, 7, dtype=dtype, device=device) + 0.05
        x[2, 5] = float("-inf")
    elif case == "bias_pos_inf":
        bias[4] = float("inf")
    else:
        bias[5] = float("inf")
        bias[3] = float("-inf")
    out, argmax, preactivation = ops.forward_with_argmax(x, weight, bias, 2.0)
    check_forward(out, argmax, preactivation, x, weight, bias, 2.0)
    rows, column = INF_CASES[case]
    rows = list(range(6)) if rows is None else rows
    assert torch.isnan(out).nonzero().flatten().tolist() == rows
    assert argmax[rows].tolist() == [column] * len(rows)
    assert not bool(torch.isfinite(preactivation[rows]).any())


def test_overflowing_preactivation_gives_nan_at_its_column(device, make_inputs):
    # Finite float32 inputs whose dot product overflows: row 2 of z is +inf at column 4 only.
    x, weight, bias = make_inputs(5, 16, 7, torch.float32, device)
    x[2] = 3e37
    weight[4] = 1.0
    out, argmax, preactivation = ops.forward_with_argmax(x, weight, bias, 2.0)
    assert torch.isnan(out).nonzero().flatten().tolist() == [2]
    assert int(argmax[2]) == 4 and not bool(torch.isfinite(preactivation[2]))
    assert bool(torch.isfinite(out[[0, 1, 3, 4]]).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_preactivation_is_z_at_the_argmax(dtype, device, make_inputs, ref):
    x, weight, bias = make_inputs(12, 50, 10, dtype, device)
    _, argmax, preactivation = ops.forward_with_argmax(x, weight, bias, -2.0)
    z = ref.preactivation(x, weight, bias)
    tol = ref.tolerance(dtype)
    torch.testing.assert_close(
        preactivation.double(), z.gather(1, argmax[:, None]).squeeze(1), atol=tol, rtol=tol
    )


def test_forward_is_deterministic_run_to_run(device, make_inputs):
    x, weight, bias = make_inputs(600, 300, 40, torch.float32, device)
    first = ops.forward_with_argmax(x, weight, bias, 2.0)
    second = ops.forward_with_argmax(x, weight, bias, 2.0)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------
# opcheck (schema, autograd registration, fake tensor, AOT dispatch)


def _opcheck_cases(device, requires_grad):
    gen = dict(dtype=torch.float64 if device == "cpu" else torch.float32, device=device)
    weight = torch.randn(10, 7, **gen)
    bias = torch.randn(10, **gen)
    x = torch.randn(5, 7, **gen)
    pooled_weight, pooled_bias = ops.fold(weight, bias, 3)
    _, argmax, preactivation = ops.forward_with_argmax(x, pooled_weight, pooled_bias, 2.0)

    def leaf(t):
        return t.detach().clone().requires_grad_(requires_grad)

    prepared_leaf = leaf(pooled_weight)  # the weight that the prepared cases' copy is made from

    return {
        "fold": (_OPS.fold.default, (leaf(weight), leaf(bias), 3)),
        "fold_no_bias": (_OPS.fold.default, (leaf(weight), None, 3)),
        "fold_k1": (_OPS.fold.default, (leaf(weight), leaf(bias), 1)),
        "fold_backward": (
            _OPS.fold_backward.default,
            (leaf(pooled_weight), leaf(pooled_bias), 10, 3),
        ),
        "fold_backward_tail": (
            _OPS.fold_backward.default,
            (leaf(pooled_weight), leaf(pooled_bias), 11, 3),
        ),
        "forward": (_OPS.forward.default, (leaf(x), leaf(pooled_weight), leaf(pooled_bias), 2.0)),
        "forward_no_bias": (_OPS.forward.default, (leaf(x), leaf(pooled_weight), None, -1.0)),
        "forward_with_argmax": (
            _OPS.forward_with_argmax.default,
            (leaf(x), leaf(pooled_weight), leaf(pooled_bias), 2.0),
        ),
        "forward_with_argmax_no_bias": (
            _OPS.forward_with_argmax.default,
            (leaf(x), leaf(pooled_weight), None, 0.5),
        ),
        "forward_prepared": (
            _OPS.forward.default,
            (leaf(x), prepared_leaf, leaf(pooled_bias), 2.0, ops.prepare_weight(prepared_leaf)),
        ),
        "forward_with_argmax_prepared": (
            _OPS.forward_with_argmax.default,
            (leaf(x), prepared_leaf, None, 0.5, ops.prepare_weight(prepared_leaf)),
        ),
        "prepare_weight": (_OPS.prepare_weight.default, (leaf(pooled_weight),)),
        "forward_with_argmax_empty_batch": (
            _OPS.forward_with_argmax.default,
            (leaf(x[:0]), leaf(pooled_weight), leaf(pooled_bias), 2.0),
        ),
        "model_forward": (
            _OPS.model_forward.default, (leaf(x), leaf(weight), leaf(bias), 3, 2.0)
        ),
        "model_forward_no_bias": (
            _OPS.model_forward.default, (leaf(x), leaf(weight), None, 3, -1.0)
        ),
        "model_forward_k1": (
            _OPS.model_forward.default, (leaf(x), leaf(weight), leaf(bias), 1, 0.5)
        ),
        "model_forward_empty_batch": (
            _OPS.model_forward.default, (leaf(x[:0]), leaf(weight), leaf(bias), 3, 2.0)
        ),
    }, (x, pooled_weight, argmax, preactivation)


OPCHECK_CASES = list(_opcheck_cases("cpu", False)[0])


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_opcheck(case, requires_grad, device):
    op, args = _opcheck_cases(device, requires_grad)[0][case]
    opcheck(op, args)


@pytest.mark.parametrize("out_features", [9, 10], ids=["exact", "tail"])
def test_opcheck_model_backward(out_features, device):
    # model_backward's own autograd raises by design (no double backward): requires_grad off.
    _, (x, pooled_weight, argmax, preactivation) = _opcheck_cases(device, False)
    grad_out = torch.randn_like(preactivation)
    opcheck(
        _OPS.model_backward.default,
        (grad_out, x, pooled_weight, argmax, preactivation, 2.0, out_features, 3),
    )


@pytest.mark.parametrize("case", ["bias", "no_bias", "k1", "empty_batch"])
def test_opcheck_model_forward_with_argmax(case, device):
    # Its autograd kernel refuses a gradient by design (it is the forward inside model_forward's
    # node): requires_grad off.
    name = "model_forward" if case == "bias" else f"model_forward_{case}"
    _, (x, weight, bias, k, scale) = _opcheck_cases(device, False)[0][name]
    opcheck(_OPS._model_forward_with_argmax.default, (x, weight, bias, k, scale))


def _assert_same_tensors(got, expected):
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


# (B, K, O, k): odd widths, a tail of O % k rows, one pooled row.
MODEL_FORWARD_WITH_ARGMAX_SHAPES = [(7, 33, 50, 4), (1, 5, 3, 3), (40, 130, 17, 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("shape", MODEL_FORWARD_WITH_ARGMAX_SHAPES, ids=str)
def test_model_forward_with_argmax_is_fold_then_forward_with_argmax_bit_for_bit(
    shape, has_bias, dtype, device, make_inputs
):
    batch, in_features, out_features, k = shape
    x, weight, bias = make_inputs(batch, in_features, out_features, dtype, device, bias=has_bias)
    got = _OPS._model_forward_with_argmax(x, weight, bias, k, -1.5)
    pooled_weight, pooled_bias = ops.fold(weight, bias, k)
    expected = (*ops.forward_with_argmax(x, pooled_weight, pooled_bias, -1.5), pooled_weight,
                pooled_bias)
    assert len(got) == 5
    _assert_same_tensors(got, expected)


def test_model_forward_with_argmax_refuses_a_gradient(device, make_inputs):
    x, weight, bias = make_inputs(4, 16, 12, torch.float32, device)
    weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"_model_forward_with_argmax: weight requires grad, "
                       r"but no gradient flows through this op .* call "
                       r"fused_pool_gelu\.ops\.model_forward"):
        _OPS._model_forward_with_argmax(x, weight, bias, 3, 2.0)
    with torch.no_grad():
        out = _OPS._model_forward_with_argmax(x, weight, bias, 3, 2.0)[0]
    assert torch.equal(out, ops.model_forward(x, weight.detach(), bias, 3, 2.0))


def test_model_forward_with_argmax_checks_its_inputs_as_model_forward(device, make_inputs):
    x, weight, bias = make_inputs(4, 16, 12, torch.float32, device)
    with pytest.raises(RuntimeError, match=r"model_forward: weight must be \[out_features, "
                       r"in_features\] with in_features = x.size\(1\) = 15"):
        _OPS._model_forward_with_argmax(x[:, :15], weight, bias, 3, 2.0)
    with pytest.raises(RuntimeError, match="fold: pool_kernel_size must be"):
        _OPS._model_forward_with_argmax(x, weight, bias, 13, 2.0)


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("case", ["bias", "no_bias", "k1", "empty_batch"])
def test_opcheck_model_forward_and_fold(case, requires_grad, device):
    name = "model_forward" if case == "bias" else f"model_forward_{case}"
    _, (x, weight, bias, k, scale) = _opcheck_cases(device, requires_grad)[0][name]
    opcheck(_OPS._model_forward_and_fold.default, (x, weight, bias, k, scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("shape", MODEL_FORWARD_WITH_ARGMAX_SHAPES, ids=str)
def test_model_forward_and_fold_is_model_forward_and_its_fold_bit_for_bit(
    shape, has_bias, dtype, device, make_inputs
):
    batch, in_features, out_features, k = shape
    x, weight, bias = make_inputs(batch, in_features, out_features, dtype, device, bias=has_bias)
    weight.requires_grad_(True)
    got = _OPS._model_forward_and_fold(x, weight, bias, k, -1.5)
    expected = (ops.model_forward(x, weight, bias, k, -1.5), *ops.fold(weight, bias, k))
    assert len(got) == 3
    _assert_same_tensors(got, expected)
    # The fold carries no gradient; the output's reaches the weight as model_forward's does.
    assert got[0].requires_grad and not got[1].requires_grad and not got[2].requires_grad
    grad_out = torch.randn_like(got[0])
    (got_grad,) = torch.autograd.grad(got[0], weight, grad_out)
    (expected_grad,) = torch.autograd.grad(expected[0], weight, grad_out)
    assert torch.equal(got_grad, expected_grad)


@pytest.mark.parametrize("grads", ["out", "preactivation", "both"])
def test_opcheck_forward_backward(grads, device):
    # forward_backward's own autograd raises by design (no double backward): requires_grad off.
    _, (x, pooled_weight, argmax, preactivation) = _opcheck_cases(device, False)
    grad_out = torch.randn_like(preactivation) if grads != "preactivation" else None
    grad_pre = torch.randn_like(preactivation) if grads != "out" else None
    opcheck(
        _OPS.forward_backward.default,
        (grad_out, grad_pre, x, pooled_weight, argmax, preactivation, 2.0),
    )


# ----------------------------------------------------------------------------------------------
# Bad inputs raise the documented errors (csrc/checks.h).


def _bad_input_cases():
    """name -> (call(device) raising, regex of a distinctive part of the message)."""
    f32 = torch.float32

    def t(*shape, dtype=f32, device="cpu"):
        return torch.randn(*shape, dtype=torch.float64).to(device=device, dtype=dtype)

    def backward_args(device, **over):
        """The arguments both backward ops take, valid unless overridden."""
        args = dict(
            grad_out=t(4, device=device),
            grad_pre=None,
            x=t(4, 6, device=device),
            weight=t(3, 6, device=device),
            argmax=torch.tensor([0, 2, 1, 0], device=device),
            pre=t(4, device=device),
        )
        args.update(over)
        return args

    def fwb(device, **over):
        a = backward_args(device, **over)
        return lambda: _OPS.forward_backward(
            a["grad_out"], a["grad_pre"], a["x"], a["weight"], a["argmax"], a["pre"], 2.0
        )

    def model_backward(device, out_features=7, k=2, **over):
        a = backward_args(device, **over)
        return lambda: _OPS.model_backward(
            a["grad_out"], a["x"], a["weight"], a["argmax"], a["pre"], 2.0, out_features, k
        )

    return {
        # fold
        "fold_weight_rank": (
            lambda d: ops.fold(t(2, 3, 4, device=d), None, 2),
            r"fold: weight must be 2-D \[out_features, in_features\], got shape \[2, 3, 4\]",
        ),
        "fold_k_zero": (
            lambda d: ops.fold(t(8, 4, device=d), None, 0),
            r"fold: pool_kernel_size must be >= 1, got 0",
        ),
        "fold_k_negative": (
            lambda d: ops.fold(t(8, 4, device=d), None, -3),
            r"fold: pool_kernel_size must be >= 1, got -3",
        ),
        "fold_k_above_out_features": (
            lambda d: ops.fold(t(8, 4, device=d), None, 9),
            r"fold: pool_kernel_size must be <= out_features \(8\)",
        ),
        "fold_bias_shape": (
            lambda d: ops.fold(t(8, 4, device=d), t(7, device=d), 2),
            r"fold: bias must be 1-D \[out_features\] = \[8\], got shape \[7\]",
        ),
        "fold_bias_rank": (
            lambda d: ops.fold(t(8, 4, device=d), t(8, 1, device=d), 2),
            r"fold: bias must be 1-D \[out_features\] = \[8\]",
        ),
        "fold_bias_dtype": (
            lambda d: ops.fold(t(8, 4, device=d), t(8, dtype=torch.float64, device=d), 2),
            r"fold: bias must have the same dtype as weight \(Float\), got Double",
        ),
        "fold_int_weight": (
            lambda d: ops.fold(torch.ones(8, 4, dtype=torch.int32, device=d), None, 2),
            r"fold: weight must be float32.* on (cpu|cuda), got Int",
        ),
        # fold_backward
        "fold_backward_rank": (
            lambda d: _OPS.fold_backward(t(4, device=d), t(4, device=d), 8, 2),
            r"fold_backward: grad_pooled_weight must be 2-D",
        ),
        "fold_backward_rows": (
            lambda d: _OPS.fold_backward(t(3, 5, device=d), t(3, device=d), 8, 2),
            r"fold_backward: grad_pooled_weight must have "
            r"out_features // pool_kernel_size = 4 rows",
        ),
        "fold_backward_k_zero": (
            lambda d: _OPS.fold_backward(t(3, 5, device=d), t(3, device=d), 8, 0),
            r"fold_backward: pool_kernel_size must be >= 1, got 0",
        ),
        "fold_backward_bias_shape": (
            lambda d: _OPS.fold_backward(t(4, 5, device=d), t(5, device=d), 8, 2),
            r"fold_backward: grad_pooled_bias must be 1-D \[pooled_features\] = \[4\]",
        ),
        "fold_backward_dtype": (
            lambda d: _OPS.fold_backward(
                t(4, 5, device=d), t(4, dtype=torch.float64, device=d), 8, 2
            ),
            r"fold_backward: grad_pooled_bias must have the same dtype as grad_pooled_weight",
        ),
        "fold_backward_int_dtype": (
            lambda d: _OPS.fold_backward(
                torch.ones(4, 5, dtype=torch.int32, device=d),
                torch.ones(4, dtype=torch.int32, device=d),
                8,
                2,
            ),
            r"fold_backward: grad_pooled_weight must be float32.* on (cpu|cuda), got Int",
        ),
        # The integer tensor is the one named, not the float one beside it.
        "fold_backward_int_grad_beside_a_float_bias": (
            lambda d: _OPS.fold_backward(
                torch.ones(4, 5, dtype=torch.int32, device=d), t(4, device=d), 8, 2
            ),
            r"fold_backward: grad_pooled_weight must be a floating-point tensor, got Int",
        ),
        # forward
        "forward_x_rank_3": (
            lambda d: ops.forward(t(2, 4, 32, device=d), t(3, 32, device=d), None, 2.0),
            r"forward: x must be 2-D \[batch, in_features\], got shape \[2, 4, 32\]",
        ),
        "forward_x_rank_1": (
            lambda d: ops.forward(t(32, device=d), t(3, 32, device=d), None, 2.0),
            r"forward: x must be 2-D \[batch, in_features\], got shape \[32\]",
        ),
        # forward_with_argmax runs forward's kernels, and its docstring says they name forward.
        "forward_with_argmax_x_rank_3": (
            lambda d: ops.forward_with_argmax(t(2, 4, 32, device=d), t(3, 32, device=d), None, 2.0),
            r"forward: x must be 2-D \[batch, in_features\], got shape \[2, 4, 32\]",
        ),
        "forward_weight_rank": (
            lambda d: ops.forward(t(4, 32, device=d), t(32, device=d), None, 2.0),
            r"forward: weight must be 2-D \[pooled_features, in_features\]",
        ),
        "forward_mismatched_in_features": (
            lambda d: ops.forward(t(4, 32, device=d), t(3, 31, device=d), None, 2.0),
            r"forward: weight must be \[pooled_features, in_features\] with in_features = "
            r"x.size\(1\) = 32, got shape \[3, 31\]",
        ),
        "forward_no_pooled_features": (
            lambda d: ops.forward(t(4, 32, device=d), t(0, 32, device=d), None, 2.0),
            r"forward: weight must have at least one row",
        ),
        "forward_bias_shape": (
            lambda d: ops.forward(t(4, 32, device=d), t(3, 32, device=d), t(4, device=d), 2.0),
            r"forward: bias must be 1-D \[pooled_features\] = \[3\], got shape \[4\]",
        ),
        "forward_weight_dtype": (
            lambda d: ops.forward(
                t(4, 32, device=d), t(3, 32, dtype=torch.float64, device=d), None, 2.0
            ),
            r"forward: weight must have the same dtype as x \(Float\), got Double",
        ),
        "forward_bias_dtype": (
            lambda d: ops.forward(
                t(4, 32, device=d), t(3, 32, device=d), t(3, dtype=torch.float64, device=d), 2.0
            ),
            r"forward: bias must have the same dtype as x \(Float\), got Double",
        ),
        "forward_int_dtype": (
            lambda d: ops.forward(
                torch.ones(4, 32, dtype=torch.int64, device=d),
                torch.ones(3, 32, dtype=torch.int64, device=d),
                None,
                2.0,
            ),
            r"forward: x must be float32.* on (cpu|cuda), got Long",
        ),
        "forward_int_x_beside_a_float_weight": (
            lambda d: ops.forward(
                torch.ones(4, 32, dtype=torch.int64, device=d), t(3, 32, device=d), None, 2.0
            ),
            r"forward: x must be a floating-point tensor, got Long",
        ),
        "forward_with_argmax_x_rank": (
            lambda d: ops.forward_with_argmax(t(4, device=d), t(3, 4, device=d), None, 2.0),
            r"forward: x must be 2-D \[batch, in_features\]",
        ),
        # model_forward: x and the weight's rank and width by model_forward itself (the weight
        # the caller passed, not the pooled one), the rest by the op each goes to (fold, forward)
        "model_forward_weight_rank": (
            lambda d: ops.model_forward(t(4, 8, device=d), t(8, device=d), None, 2, 2.0),
            r"model_forward: weight must be 2-D \[out_features, in_features\], got shape \[8\]",
        ),
        "model_forward_k_above_out_features": (
            lambda d: ops.model_forward(t(4, 8, device=d), t(6, 8, device=d), None, 7, 2.0),
            r"fold: pool_kernel_size must be <= out_features \(6\)",
        ),
        "model_forward_bias_shape": (
            lambda d: ops.model_forward(
                t(4, 8, device=d), t(6, 8, device=d), t(5, device=d), 2, 2.0
            ),
            r"fold: bias must be 1-D \[out_features\] = \[6\], got shape \[5\]",
        ),
        "model_forward_x_rank": (
            lambda d: ops.model_forward(t(4, 2, 8, device=d), t(6, 8, device=d), None, 2, 2.0),
            r"model_forward: x must be 2-D \[batch, in_features\], got shape \[4, 2, 8\]",
        ),
        "model_forward_mismatched_in_features": (
            lambda d: ops.model_forward(t(4, 9, device=d), t(6, 8, device=d), None, 2, 2.0),
            r"model_forward: weight must be \[out_features, in_features\] with in_features = "
            r"x.size\(1\) = 9, got shape \[6, 8\]",
        ),
        "model_forward_mismatched_in_features_training": (
            lambda d: ops.model_forward(
                t(4, 9, device=d), t(6, 8, device=d).requires_grad_(), None, 2, 2.0
            ),
            r"model_forward: weight must be \[out_features, in_features\] with in_features = "
            r"x.size\(1\) = 9, got shape \[6, 8\]",
        ),
        # A required tensor given as None (an undefined tensor to the kernels)
        "forward_x_none": (
            lambda d: ops.forward(None, t(3, 32, device=d), None, 2.0),
            r"forward: x must be a tensor, got None",
        ),
        "forward_weight_none": (
            lambda d: ops.forward(t(4, 32, device=d), None, t(3, device=d), 2.0),
            r"forward: weight must be a tensor, got None",
        ),
        "fold_weight_none": (
            lambda d: ops.fold(None, t(6, device=d), 2),
            r"fold: weight must be a tensor, got None",
        ),
        "model_forward_x_none": (
            lambda d: ops.model_forward(None, t(6, 8, device=d), None, 2, 2.0),
            r"model_forward: x must be a tensor, got None",
        ),
        "model_forward_x_none_training": (
            lambda d: ops.model_forward(None, t(6, 8, device=d).requires_grad_(), None, 2, 2.0),
            r"model_forward: x must be a tensor, got None",
        ),
        "model_forward_weight_none": (
            lambda d: ops.model_forward(t(4, 8, device=d), None, None, 2, 2.0),
            r"model_forward: weight must be a tensor, got None",
        ),
        "fold_backward_bias_none": (
            lambda d: _OPS.fold_backward(t(4, 5, device=d), None, 8, 2),
            r"fold_backward: grad_pooled_bias must be a tensor, got None",
        ),
        "fold_no_tensor_none": (  # no tensor at all: the Python wrapper's check, not the kernels'
            lambda d: ops.fold(None, None, 2),
            r"fold: weight must be a tensor, got None",
        ),
        "prepare_weight_none": (
            lambda d: ops.prepare_weight(None),
            r"prepare_weight: weight must be a tensor, got None",
        ),
        # No tensor at all, through the dispatcher: the message of the kernels' checks, not the
        # dispatcher's "There were no tensor arguments".
        "raw_fold_no_tensor": (
            lambda d: _OPS.fold(None, None, 2),
            r"fold: weight must be a tensor, got None",
        ),
        "raw_prepare_weight_none": (
            lambda d: _OPS.prepare_weight(None),
            r"prepare_weight: weight must be a tensor, got None",
        ),
        "raw_fold_backward_no_tensor": (
            lambda d: _OPS.fold_backward(None, None, 8, 2),
            r"fold_backward: grad_pooled_weight must be a tensor, got None",
        ),
        "raw_forward_with_argmax_no_tensor": (
            lambda d: _OPS.forward_with_argmax(None, None, None, 2.0),
            r"forward: x must be a tensor, got None",
        ),
        "raw_forward_backward_no_tensor": (
            lambda d: _OPS.forward_backward(None, None, None, None, None, None, 2.0),
            r"forward_backward: x must be a tensor, got None",
        ),
        "fold_backward_out_features_past_memory": (  # 2 rows of 2^61 each: 2^62 x 4 floats
            lambda d: _OPS.fold_backward(t(2, 4, device=d), t(2, device=d), 2**62, 2**61),
            r"fold_backward: out_features must keep the \[out_features, in_features\] gradient's "
            r"bytes within 2\^63, got \[4611686018427387904, 4\] of 4-byte elements",
        ),
        "raw_model_backward_no_tensor": (
            lambda d: _OPS.model_backward(None, None, None, None, None, 2.0, 8, 2),
            r"model_backward: grad_out must be a tensor, got None",
        ),
        "forward_backward_argmax_none": (
            lambda d: fwb(d, argmax=None)(),
            r"forward_backward: argmax must be a tensor, got None",
        ),
        "forward_backward_preactivation_none": (
            lambda d: fwb(d, pre=None)(),
            r"forward_backward: preactivation must be a tensor, got None",
        ),
        "model_backward_grad_out_none": (
            lambda d: model_backward(d, grad_out=None)(),
            r"model_backward: grad_out must be a tensor, got None",
        ),
        "model_forward_x_dtype": (
            lambda d: ops.model_forward(
                t(4, 8, dtype=torch.float64, device=d), t(6, 8, device=d), None, 2, 2.0
            ),
            r"forward: weight must have the same dtype as x \(Double\), got Float",
        ),
        # forward_backward
        "forward_backward_argmax_too_large": (
            lambda d: fwb(d, argmax=torch.tensor([0, 3, 1, 0], device=d))(),
            r"forward_backward: argmax must hold indices in \[0, 3\), got 3 at position 1",
        ),
        "forward_backward_argmax_negative": (
            lambda d: fwb(d, argmax=torch.tensor([0, 1, 1, -1], device=d))(),
            r"forward_backward: argmax must hold indices in \[0, 3\), got -1 at position 3",
        ),
        "forward_backward_argmax_dtype": (
            lambda d: fwb(d, argmax=torch.tensor([0, 1, 1, 0], dtype=torch.int32, device=d))(),
            r"forward_backward: argmax must be int64, got Int",
        ),
        "forward_backward_argmax_shape": (
            lambda d: fwb(d, argmax=torch.tensor([0, 1, 1], device=d))(),
            r"forward_backward: argmax must be 1-D \[batch\] = \[4\], got shape \[3\]",
        ),
        "forward_backward_preactivation_shape": (
            lambda d: fwb(d, pre=t(5, device=d))(),
            r"forward_backward: preactivation must be 1-D \[batch\] = \[4\]",
        ),
        "forward_backward_grad_out_shape": (
            lambda d: fwb(d, grad_out=t(4, 1, device=d))(),
            r"forward_backward: grad_out must be 1-D \[batch\] = \[4\]",
        ),
        "forward_backward_int_dtype": (
            lambda d: fwb(
                d,
                grad_out=torch.ones(4, dtype=torch.int64, device=d),
                x=torch.ones(4, 6, dtype=torch.int64, device=d),
                weight=torch.ones(3, 6, dtype=torch.int64, device=d),
                pre=torch.ones(4, dtype=torch.int64, device=d),
            )(),
            r"forward_backward: x must be float32.* on (cpu|cuda), got Long",
        ),
        "forward_backward_x_rank": (
            lambda d: fwb(d, x=t(4, 2, 6, device=d))(),
            r"forward_backward: x must be 2-D \[batch, in_features\], got shape \[4, 2, 6\]",
        ),
        "forward_backward_weight_dtype": (
            lambda d: fwb(d, weight=t(3, 6, dtype=torch.float64, device=d))(),
            r"forward_backward: weight must have the same dtype as x \(Float\), got Double",
        ),
        "forward_backward_grad_preactivation_dtype": (
            lambda d: fwb(d, grad_pre=t(4, dtype=torch.float64, device=d))(),
            r"forward_backward: grad_preactivation must have the same dtype as x",
        ),
        # model_backward
        "model_backward_out_features": (
            lambda d: model_backward(d, out_features=13, k=3)(),
            r"model_backward: pooled_weight must have out_features // pool_kernel_size = 4 rows, "
            r"got shape \[3, 6\]",
        ),
        "model_backward_out_features_negative": (
            lambda d: model_backward(d, out_features=-1, k=2)(),
            r"model_backward: out_features must be >= 0, got -1",
        ),
        "model_backward_k_zero": (
            lambda d: model_backward(d, k=0)(),
            r"model_backward: pool_kernel_size must be >= 1, got 0",
        ),
        "model_backward_mismatched_in_features": (
            lambda d: model_backward(d, x=t(4, 7, device=d))(),
            r"model_backward: pooled_weight must be \[pooled_features, in_features\] with "
            r"in_features = x.size\(1\) = 7, got shape \[3, 6\]",
        ),
        "model_backward_argmax_shape": (
            lambda d: model_backward(d, argmax=torch.tensor([0, 1, 1], device=d))(),
            r"model_backward: argmax must be 1-D \[batch\] = \[4\], got shape \[3\]",
        ),
        "model_backward_argmax_dtype": (
            lambda d: model_backward(
                d, argmax=torch.tensor([0, 1, 1, 0], dtype=torch.int32, device=d)
            )(),
            r"model_backward: argmax must be int64, got Int",
        ),
        "model_backward_grad_out_shape": (
            lambda d: model_backward(d, grad_out=t(5, device=d))(),
            r"model_backward: grad_out must be 1-D \[batch\] = \[4\], got shape \[5\]",
        ),
    }


BAD_INPUT_CASES = _bad_input_cases()


# A range check of argmax needs its values on the host: on the GPU that would be a sync (or a
# device assert that poisons the CUDA context), so the range is checked on the CPU only.
HOST_ONLY_CASES = {"forward_backward_argmax_too_large", "forward_backward_argmax_negative"}


@pytest.mark.parametrize("case", list(BAD_INPUT_CASES))
def test_bad_input_raises_documented_error(case, device):
    if device != "cpu" and case in HOST_ONLY_CASES:
        pytest.skip("argmax values are range-checked on the CPU only (no host sync on the GPU)")
    call, message = BAD_INPUT_CASES[case]
    with pytest.raises(RuntimeError, match=message):
        call(device)


def _meta_mixes():
    x, weight, bias = torch.rand(3, 8), torch.rand(4, 8), torch.rand(4)
    pooled_weight, pooled_bias = ops.fold(weight, bias, 2)
    prepared = ops.prepare_weight(pooled_weight)
    meta = lambda t: t.to("meta")  # noqa: E731
    return {
        "forward-bias": (lambda: ops.forward(x, pooled_weight, meta(pooled_bias), 2.0),
                         r"forward: bias must be on the same device as x \(cpu\), got meta"),
        "forward-weight": (lambda: ops.forward(x, meta(pooled_weight), pooled_bias, 2.0),
                           r"forward: weight must be on the same device as x \(cpu\), got meta"),
        "forward-prepared": (
            lambda: ops.forward(x, pooled_weight, pooled_bias, 2.0, meta(prepared)),
            r"forward: prepared_weight must be on weight's device \(cpu\), got meta"),
        "fold-bias": (lambda: ops.fold(weight, meta(bias), 2),
                      r"fold: bias must be on the same device as weight \(cpu\), got meta"),
        "model-new-on-meta": (lambda: ModelNew(8, 4, 2, 2.0).to("meta")(x),
                              r"must be on the same device as x \(cpu\), got meta"),
    }


@pytest.mark.parametrize("case", ["forward-bias", "forward-weight", "forward-prepared",
                                  "fold-bias", "model-new-on-meta"])
def test_a_meta_tensor_beside_cpu_ones_raises_instead_of_computing(case):
    # Any meta input sends the call to the Meta kernels (the fake ones): they must check devices
    # as the CPU and CUDA kernels do, not return an uninitialised CPU tensor.
    call, message = _meta_mixes()[case]
    with pytest.raises(RuntimeError, match=message):
        call()


def test_all_meta_inputs_give_meta_outputs_of_the_right_shape():
    x, weight, bias = (torch.empty(shape, device="meta") for shape in ((3, 8), (8, 8), (8,)))
    pooled_weight, pooled_bias = ops.fold(weight, bias, 2)
    assert pooled_weight.shape == (4, 8) and pooled_weight.is_meta
    out, argmax, preactivation = ops.forward_with_argmax(x, pooled_weight, pooled_bias, 2.0)
    assert out.is_meta and out.shape == argmax.shape == preactivation.shape == (3,)
    assert argmax.dtype == torch.int64


def _forward_mode_cases(device):
    x, weight, bias = (torch.rand(shape, device=device) for shape in ((3, 8), (8, 8), (8,)))
    pooled_weight, pooled_bias = ops.fold(weight, bias, 2)
    new = ModelNew(8, 8, 2, 2.0).to(device)
    return {
        "forward-x": (x, lambda d: ops.forward(d, pooled_weight, pooled_bias, 2.0),
                      "forward: x carries a forward-mode AD tangent"),
        "forward_with_argmax-weight": (
            pooled_weight, lambda d: ops.forward_with_argmax(x, d, pooled_bias, 2.0),
            "forward_with_argmax: weight carries a forward-mode AD tangent"),
        "fold-weight": (weight, lambda d: ops.fold(d, bias, 2),
                        "fold: weight carries a forward-mode AD tangent"),
        "fold-bias": (bias, lambda d: ops.fold(weight, d, 2),
                      "fold: bias carries a forward-mode AD tangent"),
        "model-new-no-grad": (x, lambda d: new(d), "forward: x carries a forward-mode AD tangent"),
    }


@pytest.mark.parametrize("case", ["forward-x", "forward_with_argmax-weight", "fold-weight",
                                  "fold-bias", "model-new-no-grad"])
def test_forward_mode_ad_raises_instead_of_dropping_the_tangent(case, device):
    # The ops have no forward-mode formula; a tangent that reached a kernel was dropped, and the
    # result's tangent was silently zero (torch.func.jacfwd gave a zero Jacobian).
    import torch.autograd.forward_ad as forward_ad

    primal, call, message = _forward_mode_cases(device)[case]
    with forward_ad.dual_level(), torch.no_grad():
        dual = forward_ad.make_dual(primal, torch.ones_like(primal))
        with pytest.raises(RuntimeError, match=message):
            call(dual)


def _jvp_cases(device):
    x, weight, bias = (torch.rand(shape, device=device) for shape in ((3, 8), (8, 8), (8,)))
    pooled_weight, pooled_bias = ops.fold(weight, bias, 2)
    new = ModelNew(8, 8, 2, 2.0).to(device)
    # (primal, function of it, "op: argument" expected to refuse its tangent)
    return {
        "forward": (x, lambda t: ops.forward(t, pooled_weight, pooled_bias, 2.0), "forward: x"),
        "forward_with_argmax": (
            pooled_weight, lambda t: ops.forward_with_argmax(x, t, pooled_bias, 2.0)[0],
            "forward_with_argmax: weight"),
        "fold-bias": (bias, lambda t: ops.fold(weight, t, 2)[1], "fold: bias"),
        "fold_backward": (
            pooled_weight,
            lambda t: torch.ops.fused_pool_gelu.fold_backward(t, pooled_bias, 8, 2)[0],
            "fold_backward: grad_pooled_weight"),
        "model_forward": (weight, lambda t: ops.model_forward(x, t, bias, 2, 2.0),
                          "model_forward: weight"),
        "ModelNew": (x, new, r"\w+: x"),
    }


@pytest.mark.parametrize("case", ["forward", "forward_with_argmax", "fold-bias", "fold_backward",
                                  "model_forward", "ModelNew"])
@pytest.mark.parametrize("transform", ["jvp", "jacfwd"])
def test_torch_func_forward_mode_transforms_raise_instead_of_a_zero_tangent(
    case, transform, device
):
    # functorch unwraps the inputs before the device kernels, whose own check then sees no
    # tangent: before the autograd-level checks (registration.cpp) every one of these returned a
    # zero tangent without an error.
    primal, fn, op_and_argument = _jvp_cases(device)[case]
    message = rf"fused_pool_gelu\.{op_and_argument} carries a forward-mode AD tangent"
    with pytest.raises(RuntimeError, match=message):
        if transform == "jvp":
            torch.func.jvp(fn, (primal,), (torch.ones_like(primal),))
        else:
            torch.func.jacfwd(lambda t: fn(t).sum())(primal)


def test_ops_on_constants_inside_torch_func_transforms_run(device):
    # A frozen ModelNew as a feature extractor inside torch.func.grad / jvp / vmap(grad): its
    # inputs carry no tangent or gradient, so it runs, and the transforms' results are exact.
    x = torch.rand(3, 8, device=device)
    frozen = ModelNew(8, 8, 2, 2.0).to(device).requires_grad_(False)
    features = frozen(x)
    head = torch.rand((), device=device)
    grad = torch.func.grad(lambda h: (h * frozen(x)).sum())(head)
    torch.testing.assert_close(grad, features.sum())
    _, tangent = torch.func.jvp(lambda h: h * frozen(x), (head,), (torch.ones((), device=device),))
    torch.testing.assert_close(tangent, features, rtol=0, atol=0)
    heads = torch.rand(4, device=device)
    per_sample = torch.func.vmap(torch.func.grad(lambda h: (h * frozen(x)).sum()))(heads)
    torch.testing.assert_close(per_sample, features.sum().expand(4))


@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_vmap_runs_the_op_per_sample(device):
    # vmap is not a forward-mode transform: PyTorch's per-sample fallback runs the op (and warns).
    x, weight, bias = (torch.rand(shape, device=device) for shape in ((4, 3, 8), (8, 8), (8,)))
    pooled_weight, pooled_bias = ops.fold(weight, bias, 2)
    batched = torch.func.vmap(lambda t: ops.forward(t, pooled_weight, pooled_bias, 2.0))(x)
    expected = torch.stack([ops.forward(t, pooled_weight, pooled_bias, 2.0) for t in x])
    torch.testing.assert_close(batched, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_types_on_cpu_compute_in_float32_and_round_once(dtype, make_inputs):
    x, weight, bias = (t.to(dtype) for t in make_inputs(6, 20, 12, torch.float32, "cpu"))
    pooled = ops.fold(weight, bias, 3)
    pooled_f32 = ops.fold(weight.float(), bias.float(), 3)
    for half, single in zip(pooled, pooled_f32):
        assert half.dtype == dtype and torch.equal(half, single.to(dtype))
    pw, pb = pooled
    out, argmax, pre = ops.forward_with_argmax(x, pw, pb, 2.0)
    out32, argmax32, pre32 = ops.forward_with_argmax(x.float(), pw.float(), pb.float(), 2.0)
    assert out.dtype == pre.dtype == dtype
    assert torch.equal(out, out32.to(dtype)) and torch.equal(argmax, argmax32)
    assert torch.equal(pre, pre32.to(dtype))
    grad_out = torch.randn(6).to(dtype)
    grads = _OPS.forward_backward(grad_out, None, x, pw, argmax, pre, 2.0)
    grads32 = _OPS.forward_backward(
        grad_out.float(), None, x.float(), pw.float(), argmax, pre.float(), 2.0
    )
    for half, single in zip(grads, grads32):
        assert half.dtype == dtype and torch.equal(half, single.to(dtype))
    for out_features in (12, 14):  # 14: two tail rows (zero gradient)
        back = _OPS.fold_backward(grads[1], grads[2], out_features, 3)
        back32 = _OPS.fold_backward(grads[1].float(), grads[2].float(), out_features, 3)
        for half, single in zip(back, back32):
            assert half.dtype == dtype and torch.equal(half, single.to(dtype))


# The cases whose checks are on shapes, integer arguments and None, which the fake kernels mirror
# (not dtypes or devices, which tracing leaves to the kernels, nor argmax's values).
SHAPE_CASES = [
    case
    for case in BAD_INPUT_CASES
    if "dtype" not in case and "_int_" not in case and case not in HOST_ONLY_CASES
]


# With autograd, model_forward's C++ autograd kernel checks before its fake kernel runs; under
# inference_mode the fake kernels are reached directly (as for meta tensors).
@pytest.mark.parametrize("grad_mode", ["autograd", "inference_mode"])
@pytest.mark.parametrize("case", SHAPE_CASES)
def test_fake_kernels_raise_the_eager_shape_errors(case, grad_mode):
    from torch._subclasses.fake_tensor import FakeTensorMode

    if grad_mode == "inference_mode" and case.endswith("_training"):
        pytest.skip("a tensor that requires grad cannot be made under inference_mode")
    call, message = BAD_INPUT_CASES[case]
    mode = torch.inference_mode() if grad_mode == "inference_mode" else contextlib.nullcontext()
    with FakeTensorMode(), mode, pytest.raises(RuntimeError, match=message):
        call("cpu")


@pytest.mark.parametrize(
    "case",
    ["model_forward_mismatched_in_features", "model_forward_x_rank", "model_forward_weight_none"],
)
def test_model_forward_under_autocast_checks_its_own_inputs(case):
    # Its autocast kernel is Python (fold then forward): the checks of its C++ kernels, first.
    call, message = BAD_INPUT_CASES[case]
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(RuntimeError, match=message):
        call("cpu")


def test_bad_input_errors_also_raise_while_tracing():
    # The fake kernels mirror the shape checks, so torch.compile fails the way eager does.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, 32)
        weight = torch.empty(3, 31)
        with pytest.raises(RuntimeError, match=r"in_features = x.size\(1\) = 32"):
            ops.forward(x, weight, None, 2.0)
        with pytest.raises(RuntimeError, match=r"pool_kernel_size must be <= out_features \(3\)"):
            ops.fold(weight, None, 4)
        with pytest.raises(RuntimeError, match=r"in_features = x.size\(1\) = 32"):
            ops.model_forward(x, weight, None, 1, 2.0)
