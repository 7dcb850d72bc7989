"""Reliability: the input classes no other file covers (docs/input_classes.md has the full table),
property-based comparison with the reference Model, determinism, memory and threads.

- stride-0 (expanded) and overlapping views give the bits of a contiguous copy;
- K = 0; module-level errors where Model fails; out-of-range arg-max on CUDA;
- huge (1e30) and denormal values; NaN / Inf gradients stay in their row and arg-max group;
- hypothesis: ModelNew and the ops against Model (float64) on random shapes, scales and values,
  forward and backward;
- determinism under torch.use_deterministic_algorithms(True);
- no [B, O] intermediate on CUDA, memory and Python objects flat over thousands of calls;
- concurrent inference from several Python threads on one ModelNew.

Every device-parametrized test also runs on CUDA (``device`` fixture, conftest.py); the GPU-only
ones are marked ``cuda``. Tolerances are stated relative to ``M[b] = max_n sum_c |x[b, c]
pooled_weight[n, c]| + |pooled_bias[n]|``, the size of the terms a dot product adds up: a rounding
error bound that does not depend on cancellation.
"""

from __future__ import annotations

import gc
import math
import threading
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fused_pool_gelu import Model, ModelNew, ops

FLOAT32_ULP_OF_DENORMALS = 2.0**-149  # the spacing of float32 below 2^-126
SMALLEST_NORMAL_FLOAT32 = 2.0**-126


def _leaf(t):
    """A fresh contiguous leaf with the values of t."""
    return t.detach().clone(memory_format=torch.contiguous_format).requires_grad_(True)


def _model_with(weight, bias, k, scale, dtype=None, device=None):
    """Model (the reference) holding `weight` [O, K] and `bias` [O] (None: zeros)."""
    out_features, in_features = weight.shape
    # nn.Linear(0, O) warns that it cannot initialize an empty weight: not news here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = Model(in_features, out_features, k, scale)
    model = model.to(device=device or weight.device, dtype=dtype or weight.dtype)
    with torch.no_grad():
        model.matmul.weight.copy_(weight)
        model.matmul.bias.copy_(torch.zeros(out_features) if bias is None else bias)
    return model


def _model_new_with(weight, bias, k, scale):
    return ModelNew.from_model(_model_with(weight, bias, k, scale))


def _assert_within(actual, expected, bound, name):
    """|actual - expected| <= bound, entry by entry (float64, on the CPU)."""
    error = (actual.detach().cpu().double() - expected.cpu()).abs()
    excess = error - bound.cpu()
    assert bool((excess <= 0).all()), (
        f"{name}: error {error.flatten()[excess.argmax()]:.3e} above its bound "
        f"{bound.cpu().flatten()[excess.argmax()]:.3e} at flat index {int(excess.argmax())}"
    )


# ----------------------------------------------------------------------------------------------
# Stride-0 (expanded) and overlapping views: the bits of a contiguous copy.


def _forward_and_gradients(x, weight, bias, k, scale, grad_out, fold=True):
    """(out, argmax, preactivation, grad_x, grad_weight, grad_bias) of the ops on these tensors.

    The gradients are those of the tensors passed in (views included), through autograd.
    With fold=False, `weight` and `bias` go straight to forward_with_argmax as pooled ones."""
    inputs = [x, weight, bias]
    pooled_weight, pooled_bias = ops.fold(weight, bias, k) if fold else (weight, bias)
    out, argmax, preactivation = ops.forward_with_argmax(x, pooled_weight, pooled_bias, scale)
    grads = torch.autograd.grad(out, inputs, grad_out)
    return (out, argmax, preactivation, *grads)


def _view(layout, rows, cols, device):
    """A [rows, cols] float32 view with the requested strides, over fresh random storage."""

    def base(n):
        return torch.randn(n, device=device).requires_grad_(True)

    if layout == "rows_stride_0":  # every row is the same memory
        return base(cols).view(1, cols).expand(rows, cols)
    if layout == "columns_stride_0":  # every column is the same memory
        return base(rows).view(rows, 1).expand(rows, cols)
    if layout == "overlapping_rows":  # row r = storage[4r : 4r + cols]: rows share cols - 4
        return base(4 * rows + cols).as_strided((rows, cols), (4, 1))
    if layout == "overlapping_rows_odd_stride":  # row stride 3: no row is 16-byte aligned
        return base(3 * rows + cols).as_strided((rows, cols), (3, 1))
    raise ValueError(layout)


VIEW_LAYOUTS = [
    "rows_stride_0",
    "columns_stride_0",
    "overlapping_rows",
    "overlapping_rows_odd_stride",
]


def _assert_bitwise_equal(results, expected):
    names = ["out", "argmax", "preactivation", "grad_x", "grad_weight", "grad_bias"]
    for name, a, b in zip(names, results, expected):
        assert torch.equal(a, b), f"{name} differs from the contiguous copy's"


# B = 5 and B = 40: the GEMV and the GEMM path of the CUDA forward.
@pytest.mark.parametrize("batch", [5, 40], ids=["B=5", "B=40"])
@pytest.mark.parametrize("layout", VIEW_LAYOUTS)
def test_stride_0_and_overlapping_x_give_the_bits_of_a_contiguous_copy(
    layout, batch, device, make_inputs
):
    in_features, out_features, k = 36, 24, 3
    _, weight, bias = make_inputs(1, in_features, out_features, torch.float32, device)
    x = _view(layout, batch, in_features, device)
    grad_out = torch.randn(batch, device=device)
    results = _forward_and_gradients(x, _leaf(weight), _leaf(bias), k, 2.0, grad_out)
    expected = _forward_and_gradients(_leaf(x), _leaf(weight), _leaf(bias), k, 2.0, grad_out)
    assert not x.is_contiguous()
    _assert_bitwise_equal(results, expected)


@pytest.mark.parametrize("into", ["fold", "forward"])  # the raw weight, or a pooled weight
@pytest.mark.parametrize("layout", VIEW_LAYOUTS)
def test_stride_0_and_overlapping_weight_and_bias_give_the_bits_of_a_contiguous_copy(
    layout, into, device
):
    batch, in_features, k = 40, 36, 3
    rows = 24 if into == "fold" else 8
    x = torch.randn(batch, in_features, device=device)
    weight = _view(layout, rows, in_features, device)
    bias = torch.randn(1, device=device).requires_grad_(True).expand(rows)  # stride 0 too
    grad_out = torch.randn(batch, device=device)
    fold = into == "fold"
    results = _forward_and_gradients(_leaf(x), weight, bias, k, 2.0, grad_out, fold=fold)
    expected = _forward_and_gradients(
        _leaf(x), _leaf(weight), _leaf(bias), k, 2.0, grad_out, fold=fold
    )
    _assert_bitwise_equal(results, expected)


# ----------------------------------------------------------------------------------------------
# K = 0 and module-level errors.


@pytest.mark.parametrize("batch", [0, 5], ids=["B=0", "B=5"])
def test_zero_in_features_give_the_reference_answer_and_gradients(batch, device):
    # z = bias in every row: out[b] = max_n scale * gelu(pooled_bias[n]); only the bias gets
    # gradients.
    out_features, k, scale = 12, 3, 2.0
    weight = torch.empty(out_features, 0, device=device)
    bias = torch.randn(out_features, device=device)
    model = _model_with(weight, bias, k, scale)
    new = ModelNew.from_model(model)
    x = torch.empty(batch, 0, device=device, requires_grad=True)
    x_ref = torch.empty(batch, 0, device=device, requires_grad=True)
    out, ref = new(x), model(x_ref)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    grad_out = torch.randn(batch, device=device)
    out.backward(grad_out)
    ref.backward(grad_out)
    assert x.grad.shape == (batch, 0) and new.matmul.weight.grad.shape == (out_features, 0)
    torch.testing.assert_close(new.matmul.bias.grad, model.matmul.bias.grad, atol=1e-6, rtol=1e-6)


# case: ((in_features, out_features, k), x shape, x dtype, regex of ModelNew's message)
MODULE_ERRORS = {
    "x_rank_1": ((16, 12, 4), (16,), torch.float32, r"x must be 2-D .*, got shape \[16\]"),
    "x_rank_3": ((16, 12, 4), (2, 3, 16), torch.float32, r"x must be 2-D .* \[2, 3, 16\]"),
    "x_in_features": ((16, 12, 4), (3, 15), torch.float32,
                      r"ModelNew: x must be \[batch, in_features\] = \[batch, 16\] "
                      r"\(matmul.in_features\), got shape \[3, 15\]"),
    "x_float64": ((16, 12, 4), (3, 16), torch.float64, r"same dtype as x \(Double\), got Float"),
    "x_int64": ((16, 12, 4), (3, 16), torch.int64, r"x must be a floating-point tensor, got Long"),
    "k_above_out_features": (
        (16, 3, 4), (2, 16), torch.float32, r"fold: pool_kernel_size must be <= out_features \(3\)"
    ),
}


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("case", list(MODULE_ERRORS))
def test_model_new_raises_a_named_error_where_model_fails(case, grad, device):
    (in_features, out_features, k), shape, dtype, message = MODULE_ERRORS[case]
    model = Model(in_features, out_features, k, 2.0).to(device)
    new = ModelNew.from_model(model)
    x = torch.randn(shape, dtype=torch.float64).to(device=device, dtype=dtype)
    with torch.set_grad_enabled(grad):
        with pytest.raises(Exception):
            model(x)
        with pytest.raises(RuntimeError, match=message) as error:
            new(x)
    assert str(error.value).startswith("fused_pool_gelu.")  # names the op


@pytest.mark.cuda
def test_model_new_on_cuda_raises_a_named_error_for_x_on_the_cpu():
    new = ModelNew(16, 12, 4, 2.0).to("cuda")
    with pytest.raises(
        RuntimeError, match=r"forward: weight must be on the same device as x \(cpu\), got cuda"
    ):
        new(torch.randn(3, 16))


@pytest.mark.cuda
def test_cuda_forward_backward_with_out_of_range_argmax_gives_nan_rows_and_adds_nothing():
    # The CPU raises (test_ops.py); the GPU cannot check without a host sync, so such a row gets
    # NaN in grad_x and contributes nothing to grad_weight and grad_bias (csrc/cuda/backward.cu).
    x, weight = torch.randn(6, 20, device="cuda"), torch.randn(3, 20, device="cuda")
    argmax = torch.tensor([0, 3, 1, -1, 2, 1], device="cuda")
    preactivation, grad_out = torch.randn(6, device="cuda"), torch.randn(6, device="cuda")
    grads = torch.ops.fused_pool_gelu.forward_backward(
        grad_out, None, x, weight, argmax, preactivation, 2.0
    )
    valid = [0, 2, 4, 5]
    expected = torch.ops.fused_pool_gelu.forward_backward(
        grad_out[valid], None, x[valid], weight, argmax[valid], preactivation[valid], 2.0
    )
    grad_x, grad_weight, grad_bias = grads
    assert bool(torch.isnan(grad_x[[1, 3]]).all())
    torch.testing.assert_close(grad_x[valid], expected[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad_weight, expected[1], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad_bias, expected[2], atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------------------------
# Huge values.


def _huge_case(where, device, make_inputs):
    """x, weight, bias with 1e30 in every third row of x or in the third group of weight rows:
    pre-activations of order 1e29 .. 1e31, all finite in float32."""
    x, weight, bias = make_inputs(40, 48, 24, torch.float32, device)
    if where == "x":
        x[::3] *= 1e30
    else:
        weight[8:12] *= 1e30
    return x, weight, bias


def _size_of_terms(x, weight, bias, k):
    """M[b] (module docstring) of Model's float64 computation: its dot products add x * W over the
    k rows of each group, so the group means of |W| and |b| weigh |x|."""
    w64, b64 = weight.double().cpu(), bias.double().cpu()
    pooled = w64.shape[0] // k
    pooled_abs_weight = w64.abs()[: pooled * k].reshape(pooled, k, -1).mean(dim=1)
    pooled_abs_bias = b64.abs()[: pooled * k].reshape(pooled, k).mean(dim=1)
    return (x.double().cpu().abs() @ pooled_abs_weight.t() + pooled_abs_bias).max(dim=1).values


@pytest.mark.parametrize("where", ["x", "weight"])
def test_huge_finite_values_give_the_float64_answer(where, device, make_inputs):
    x, weight, bias = _huge_case(where, device, make_inputs)
    out = _model_new_with(weight, bias, 4, 2.0)(x)
    expected = _model_with(weight, bias, 4, 2.0, dtype=torch.float64)(x.double())
    assert bool(torch.isfinite(out).all())
    # Relative 1e-5, and 1e-6 of |scale| M[b]: a row whose terms (1e30) cancel to a z of 1e27
    # keeps the 3xTF32 GEMM's error, ~2^-22 of the terms, far above 1e-5 of that z.
    bound = 1e-5 * expected.abs().cpu() + 1e-6 * 2.0 * _size_of_terms(x, weight, bias, 4)
    _assert_within(out, expected, bound, "out")


@pytest.mark.parametrize("where", ["x", "weight"])
def test_huge_finite_values_give_the_float64_gradients(where, device, make_inputs):
    x, weight, bias = _huge_case(where, device, make_inputs)
    new = _model_new_with(weight, bias, 4, 2.0)
    model = _model_with(weight, bias, 4, 2.0, dtype=torch.float64)
    x_new, x_ref = _leaf(x), _leaf(x.double())
    grad_out = torch.randn(x.shape[0], device=device)
    new(x_new).backward(grad_out)
    model(x_ref).backward(grad_out.double())
    pairs = [
        (x_new, x_ref),
        (new.matmul.weight, model.matmul.weight),
        (new.matmul.bias, model.matmul.bias),
    ]
    for ours, ref in pairs:
        # grad_weight sums +-1e30 terms that cancel: errors are relative to the tensor's scale.
        assert bool(torch.isfinite(ours.grad).all())
        scale_of_terms = ref.grad.abs().max().item()
        torch.testing.assert_close(
            ours.grad.double(), ref.grad, atol=1e-6 * scale_of_terms, rtol=1e-5
        )


def test_products_overflowing_float32_give_nan_rows_where_the_reference_gives_nan(
    device, make_inputs
):
    # Rows 1 and 4 of x and the rows of pooled feature 2 are 1e30: their products (1e60) overflow,
    # so z[1, 2] and z[4, 2] are not finite (docs/input_classes.md: NaN rows, arg-max there).
    # Every other pre-activation is finite, 1e29 .. 1e31 where one factor is huge.
    x, weight, bias = make_inputs(8, 32, 24, torch.float32, device)
    x[[1, 4]] *= 1e30
    weight[8:12] *= 1e30
    new = _model_new_with(weight, bias, 4, 2.0)
    out = new(x)
    reference = _model_with(weight, bias, 4, 2.0)(x)
    _, argmax, _ = ops.forward_with_argmax(x, *new.folded_parameters(), 2.0)
    assert torch.isnan(out).nonzero().flatten().tolist() == [1, 4]
    assert torch.equal(torch.isnan(out), torch.isnan(reference))
    assert argmax[[1, 4]].tolist() == [2, 2]
    finite = ~torch.isnan(out)
    expected = _model_with(weight, bias, 4, 2.0, dtype=torch.float64)(x.double())
    torch.testing.assert_close(out[finite].double(), expected[finite], atol=1e-5, rtol=1e-5)


def test_scaled_gelu_above_the_float32_range_gives_inf_like_the_reference(device):
    # z = 1e38 is finite, so the row is not NaN; 4 * gelu(z) = 4e38 overflows to +inf, as in Model.
    x = torch.full((3, 4), 0.25e38, device=device)
    weight = torch.tensor([[1.0] * 4, [-1.0] * 4, [0.1] * 4], device=device)
    out, argmax, preactivation = ops.forward_with_argmax(x, weight, None, 4.0)
    reference = _model_with(weight, None, 1, 4.0)(x)
    assert torch.equal(out, torch.full((3,), math.inf, device=device))
    assert torch.equal(reference.detach(), out)
    assert argmax.tolist() == [0, 0, 0] and bool(torch.isfinite(preactivation).all())


def test_gelu_of_a_preactivation_above_half_the_float32_range_stays_finite(device):
    # z = 3e38: gelu(z) = z is representable; computing z * (1 + erf) before halving would give
    # +inf (torch's float32 GELU on the CPU does: Model returns inf here, docs/input_classes.md).
    x = torch.full((2, 4), 0.75e38, device=device)
    weight = torch.tensor([[1.0] * 4, [0.5] * 4], device=device)
    out, argmax, _ = ops.forward_with_argmax(x, weight, None, 1.0)
    assert torch.equal(out, torch.full((2,), 3e38, device=device))
    assert argmax.tolist() == [0, 0]


@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
def test_non_finite_x_gives_nan_gradients_only_in_its_row_and_its_arg_max_group(
    value, device, make_inputs
):
    # docs/input_classes.md: row 3 is NaN with its arg-max at its first non-finite column;
    # gradients flow through that column only, so NaN reaches grad_x[3] and the k rows of that
    # group in grad_weight / grad_bias, and every other entry is the gradient of the other rows.
    x, weight, bias = make_inputs(8, 32, 24, torch.float32, device)
    x[3, 7] = value
    weight[:, 7] = weight[:, 7].abs() + 0.1  # z[3, :] = +inf for value = inf
    grad_out = torch.randn(8, device=device)
    leaves = [_leaf(t) for t in (x, weight, bias)]
    pooled_weight, pooled_bias = ops.fold(leaves[1], leaves[2], 4)
    out, argmax, _ = ops.forward_with_argmax(leaves[0], pooled_weight, pooled_bias, 2.0)
    out.backward(grad_out)
    grad_x, grad_weight, grad_bias = (leaf.grad for leaf in leaves)
    assert int(argmax[3]) == 0
    group = slice(0, 4)  # the raw rows of pooled feature argmax[3] = 0
    assert bool(torch.isnan(grad_x[3]).all())
    assert bool(torch.isnan(grad_weight[group]).all()) and bool(torch.isnan(grad_bias[group]).all())
    others = [0, 1, 2, 4, 5, 6, 7]
    rest = [_leaf(t) for t in (x[others], weight, bias)]
    rest_out = ops.forward(rest[0], *ops.fold(rest[1], rest[2], 4), 2.0)
    rest_out.backward(grad_out[others])
    torch.testing.assert_close(grad_x[others], rest[0].grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad_weight[4:], rest[1].grad[4:], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad_bias[4:], rest[2].grad[4:], atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# Denormal values (float32 below 1.2e-38; the CUDA build compiles with -ftz=false).


def _denormal_case(operand, batch, device, make_inputs):
    """x [B, 64] and weight [24, 64] (k = 3), one of them scaled into the float32 denormal range,
    no bias: every pre-activation is a sum of denormal products."""
    x, weight, _ = make_inputs(batch, 64, 24, torch.float32, device, bias=False)
    if operand == "x":
        x = x.sign() * (x.abs() + 0.1) * 1e-39  # 1e-40 .. ~5e-39
        tiny = x
    else:
        weight = weight.sign() * (weight.abs() + 0.01) * 1e-38  # 1e-40 .. 1.35e-39
        tiny = weight
    assert bool((tiny != 0).all()) and bool((tiny.abs() < torch.finfo(torch.float32).tiny).all())
    return x, weight


def test_fold_keeps_denormal_weights(device, make_inputs):
    _, weight = _denormal_case("weight", 1, device, make_inputs)
    pooled_weight, _ = ops.fold(weight, None, 3)
    expected = weight.double().reshape(8, 3, 64).mean(dim=1)
    assert bool((pooled_weight != 0).all())
    torch.testing.assert_close(
        pooled_weight.double(), expected, atol=3 * FLOAT32_ULP_OF_DENORMALS, rtol=0
    )


# B = 8 and B = 40: the GEMV and the GEMM path of the CUDA forward.
@pytest.mark.parametrize("batch", [8, 40], ids=["B=8", "B=40"])
@pytest.mark.parametrize("operand", ["x", "weight"])
def test_denormal_values_give_the_float64_answer_on_the_folded_weights(
    operand, batch, device, make_inputs
):
    x, weight = _denormal_case(operand, batch, device, make_inputs)
    pooled_weight, _ = ops.fold(weight, None, 3)
    out, argmax, preactivation = ops.forward_with_argmax(x, pooled_weight, None, 2.0)
    z64 = x.double() @ pooled_weight.double().t()  # float64 holds these products as normal numbers
    best64, index64 = (2.0 * F.gelu(z64)).max(dim=1)
    # A rounding per product and per addition, each at most one denormal ulp (2^-149, values are
    # ~1e-40 .. 1e-38 = 1e5 .. 1e7 ulps): flushing denormals to zero would lose everything.
    atol = 4 * 64 * FLOAT32_ULP_OF_DENORMALS
    if device == "cuda" and batch > 32:
        # The 3xTF32 tensor-core path splits each operand into TF32 big + small parts; below
        # 2^-126 the small part of a denormal falls under TF32's precision and is lost, so products
        # of denormals keep only ~8 significant bits there. Absolute errors stay under 2^-126.
        atol = SMALLEST_NORMAL_FLOAT32
    assert bool((out != 0).all())
    torch.testing.assert_close(out.double(), best64, atol=atol, rtol=0)
    torch.testing.assert_close(
        preactivation.double(), z64.gather(1, argmax[:, None]).squeeze(1), atol=atol, rtol=0
    )
    top2 = (2.0 * F.gelu(z64)).topk(2, dim=1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * atol
    assert torch.equal(argmax[clear], index64[clear])


@pytest.mark.parametrize("operand", ["x", "weight"])
def test_denormal_values_give_the_float64_gradients(operand, device, make_inputs, ref):
    x, weight = _denormal_case(operand, 40, device, make_inputs)
    grad_out = torch.randn(40, device=device)
    x_leaf, weight_leaf = _leaf(x), _leaf(weight)
    pooled_weight, pooled_bias = ops.fold(weight_leaf, None, 3)
    _, argmax, _ = ops.forward_with_argmax(x_leaf, pooled_weight, pooled_bias, 2.0)
    out = ops.forward(x_leaf, pooled_weight, pooled_bias, 2.0)
    out.backward(grad_out)
    # float64 formulas at the chosen arg-max: dz = g * scale * gelu'(z), grad_x = dz * Wp[j],
    # grad_Wp[n] = sum over rows with j = n of dz * x, expanded to the 3 rows of group n as / 3.
    wp64 = pooled_weight.detach().double()
    z64 = (x.double() * wp64[argmax]).sum(dim=1)
    dz = grad_out.double() * 2.0 * ref.gelu_grad(z64)
    grad_x = dz[:, None] * wp64[argmax]
    grad_wp = torch.zeros_like(wp64).index_add_(0, argmax, dz[:, None] * x.double())
    grad_weight = grad_wp.repeat_interleave(3, dim=0) / 3
    # The denormal results: grad_x = dz * (denormal Wp), or grad_weight = sums of dz * (denormal x).
    tiny, tiny_expected = (
        (x_leaf.grad, grad_x) if operand == "weight" else (weight_leaf.grad, grad_weight)
    )
    assert bool((tiny_expected.abs() < torch.finfo(torch.float32).tiny).all())
    assert bool((tiny[tiny_expected != 0] != 0).all())
    atol = 4 * 40 * FLOAT32_ULP_OF_DENORMALS
    # Errors relative to the sizes of the terms (grad_weight sums terms of both signs).
    terms_x = dz.abs()[:, None] * wp64[argmax].abs()
    terms_wp = torch.zeros_like(wp64).index_add_(0, argmax, (dz[:, None] * x.double()).abs())
    terms_weight = terms_wp.repeat_interleave(3, dim=0) / 3
    _assert_within(x_leaf.grad, grad_x, atol + 1e-6 * terms_x, "grad_x")
    _assert_within(weight_leaf.grad, grad_weight, atol + 1e-6 * terms_weight, "grad_weight")


# ----------------------------------------------------------------------------------------------
# Property-based: ModelNew and the ops against the reference Model in float64.


@st.composite
def _cases(draw, max_batch, max_in, max_out, dtypes):
    out_features = draw(st.integers(1, max_out))
    return SimpleNamespace(
        batch=draw(st.integers(0, max_batch)),
        in_features=draw(st.integers(1, max_in)),
        out_features=out_features,
        k=draw(st.integers(1, out_features)),
        scale=draw(
            st.one_of(
                st.sampled_from([0.0, 1.0, -1.0]), st.floats(1e-3, 4.0), st.floats(-4.0, -1e-3)
            )
        ),
        # Values: normal, uniform, or on a dyadic grid (exact products: exact ties between columns),
        # each scaled by 10**exponent.
        distribution=draw(st.sampled_from(["normal", "uniform", "dyadic"])),
        x_exponent=draw(st.integers(-3, 3)),
        weight_exponent=draw(st.integers(-3, 3)),
        bias_exponent=draw(st.integers(-3, 3)),
        has_bias=draw(st.booleans()),
        x_layout=draw(st.sampled_from(["contiguous", "transposed", "strided"])),
        weight_layout=draw(st.sampled_from(["contiguous", "transposed", "strided"])),
        dtype=draw(st.sampled_from(dtypes)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _draw_values(case, generator):
    def values(shape, exponent):
        if case.distribution == "normal":
            t = torch.randn(shape, dtype=torch.float64, generator=generator)
        elif case.distribution == "uniform":
            t = torch.rand(shape, dtype=torch.float64, generator=generator) * 2 - 1
        else:
            t = torch.randint(-8, 9, shape, generator=generator).double() / 8
        return (t * 10.0**exponent).to(case.dtype)

    x = values((case.batch, case.in_features), case.x_exponent)
    weight = values((case.out_features, case.in_features), case.weight_exponent)
    bias = values((case.out_features,), case.bias_exponent) if case.has_bias else None
    return x, weight, bias


def _with_layout(t, layout):
    """The same values with other strides; a strided view's gaps hold NaN, so reading them shows."""
    if layout == "transposed":
        return t.t().contiguous().t()
    if layout == "strided":
        rows, cols = t.shape
        buffer = torch.full((rows, 2 * cols + 1), math.nan, dtype=t.dtype, device=t.device)
        buffer[:, 1::2] = t
        return buffer[:, 1::2]
    return t


class _Reference:
    """Model in float64 on the (dtype-rounded) values, and the error scales of the comparison."""

    def __init__(self, case, x, weight, bias, tol, tie_tol=1e-5):
        self.k, self.scale, self.tol = case.k, case.scale, tol
        x64, w64 = x.double(), weight.double()
        b64 = torch.zeros(case.out_features, dtype=torch.float64) if bias is None else bias.double()
        n = case.out_features // case.k
        self.pooled_weight = w64[: n * case.k].reshape(n, case.k, -1).mean(dim=1)
        pooled_bias = b64[: n * case.k].reshape(n, case.k).mean(dim=1)
        self.z = x64 @ self.pooled_weight.t() + pooled_bias
        values = F.gelu(self.z) * case.scale
        self.argmax = values.argmax(dim=1) if case.batch else torch.zeros(0, dtype=torch.long)
        # M[b]: sum of |terms| of the largest dot product of row b (Model adds x * W over the k
        # rows of each group: the group means of |W| and |b|); errors are measured against it.
        self.pooled_abs_weight = w64.abs()[: n * case.k].reshape(n, case.k, -1).mean(dim=1)
        pooled_abs_bias = b64.abs()[: n * case.k].reshape(n, case.k).mean(dim=1)
        terms = x64.abs() @ self.pooled_abs_weight.t() + pooled_abs_bias
        self.terms = terms.max(dim=1).values if case.batch else torch.zeros(0, dtype=torch.float64)
        self.magnitude = abs(case.scale) * self.terms
        # Rows whose two largest values are within tie_tol * M: another arg-max is legitimate there.
        if n >= 2 and case.batch:
            top2 = values.topk(2, dim=1).values
            self.near_tie = (top2[:, 0] - top2[:, 1]) <= tie_tol * self.magnitude
        else:
            self.near_tie = torch.zeros(case.batch, dtype=torch.bool)
        self.model = _model_with(w64, b64, case.k, case.scale)
        self.x = x64.clone().requires_grad_(True)

    def check_out(self, out, expected):
        bound = self.tol * (self.magnitude + expected.abs())
        _assert_within(out, expected, bound, "out")

    def check_gradients(self, grad_out, grad_x, grad_weight, grad_bias):
        """Gradients of sum(grad_out * out) against Model's autograd, with per-entry bounds from
        |dz| <= 1.13 |g scale| and the error of gelu' (|gelu''| <= 0.8) at an error of tol * M in z.
        """
        g = grad_out.double()
        model = self.model
        model.zero_grad(set_to_none=True)
        self.x.grad = None
        model(self.x).backward(g)
        d = self.tol * g.abs() * abs(self.scale) * (1.2 + self.magnitude)  # dz error bound, per row
        wp_abs = self.pooled_abs_weight
        bound_x = d[:, None] * wp_abs[self.argmax]
        n, k = wp_abs.shape[0], self.k
        bound_wp = torch.zeros_like(wp_abs).index_add_(
            0, self.argmax, d[:, None] * self.x.detach().abs()
        )
        bound_bp = torch.zeros(n, dtype=torch.float64).index_add_(0, self.argmax, d)
        tail = model.matmul.weight.shape[0] - n * k
        bound_w = torch.cat(
            [
                bound_wp.repeat_interleave(k, dim=0) / k,
                torch.zeros(tail, wp_abs.shape[1], dtype=torch.float64),
            ]
        )
        bound_b = torch.cat(
            [bound_bp.repeat_interleave(k) / k, torch.zeros(tail, dtype=torch.float64)]
        )
        pairs = [
            ("x", grad_x, self.x.grad, bound_x),
            ("weight", grad_weight, model.matmul.weight.grad, bound_w),
        ]
        if grad_bias is not None:
            pairs.append(("bias", grad_bias, model.matmul.bias.grad, bound_b))
        for name, ours, expected, bound in pairs:
            _assert_within(ours, expected, bound, f"grad_{name}")


def _grad_out(case, reference, device):
    """An upstream gradient that is zero on near-tie rows, where another arg-max is legitimate."""
    g = torch.randn(
        case.batch, dtype=torch.float64, generator=torch.Generator().manual_seed(case.seed + 1)
    )
    return g.masked_fill(reference.near_tie, 0.0).to(device=device, dtype=case.dtype)


TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def _check_model_new_against_model(case, device):
    generator = torch.Generator().manual_seed(case.seed)
    x, weight, bias = _draw_values(case, generator)
    reference = _Reference(case, x, weight, bias, TOLERANCE[case.dtype])
    expected = reference.model(reference.x.detach()).detach()
    new = ModelNew.from_model(_model_with(weight, bias, case.k, case.scale, device=device))
    x_new = _with_layout(x.to(device), case.x_layout).requires_grad_(True)
    with torch.no_grad():
        reference.check_out(new(x_new), expected)  # the cached fold
    out = new(x_new)  # the fold in the graph
    reference.check_out(out, expected)
    grad_out = _grad_out(case, reference, device)
    out.backward(grad_out)
    reference.check_gradients(
        grad_out.cpu(), x_new.grad, new.matmul.weight.grad, new.matmul.bias.grad
    )


def _check_ops_against_model(case, device):
    generator = torch.Generator().manual_seed(case.seed)
    x, weight, bias = _draw_values(case, generator)
    reference = _Reference(case, x, weight, bias, TOLERANCE[case.dtype])
    expected = reference.model(reference.x.detach()).detach()
    x_leaf = _with_layout(x.to(device), case.x_layout).requires_grad_(True)
    weight_leaf = _with_layout(weight.to(device), case.weight_layout).requires_grad_(True)
    bias_leaf = None if bias is None else bias.to(device).requires_grad_(True)
    pooled_weight, pooled_bias = ops.fold(weight_leaf, bias_leaf, case.k)
    out = ops.forward(x_leaf, pooled_weight, pooled_bias, case.scale)
    reference.check_out(out, expected)
    with torch.no_grad():
        _, argmax, preactivation = ops.forward_with_argmax(
            x_leaf, pooled_weight, pooled_bias, case.scale
        )
    clear = ~reference.near_tie
    assert torch.equal(argmax.cpu()[clear], reference.argmax[clear])
    z_chosen = reference.z.gather(1, reference.argmax[:, None]).squeeze(1)
    z_error = (preactivation.cpu().double() - z_chosen).abs()
    assert bool((z_error <= TOLERANCE[case.dtype] * reference.terms)[clear].all())
    grad_out = _grad_out(case, reference, device)
    out.backward(grad_out)
    reference.check_gradients(
        grad_out.cpu(), x_leaf.grad, weight_leaf.grad, None if bias_leaf is None else bias_leaf.grad
    )


CPU_CASES = _cases(max_batch=12, max_in=48, max_out=48, dtypes=[torch.float32, torch.float64])
# CUDA: batches on both sides of the GEMV / GEMM switch (32), K with several split-K slices,
# N over several 128-column tiles.
CUDA_CASES = _cases(max_batch=160, max_in=700, max_out=400, dtypes=[torch.float32])
_SETTINGS = dict(
    deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)


@settings(max_examples=150, **_SETTINGS)
@given(case=CPU_CASES)
def test_model_new_matches_model_forward_and_backward_on_random_inputs(case):
    _check_model_new_against_model(case, "cpu")


@settings(max_examples=150, **_SETTINGS)
@given(case=CPU_CASES)
def test_ops_match_model_forward_and_backward_on_random_inputs(case):
    _check_ops_against_model(case, "cpu")


@pytest.mark.cuda
@settings(max_examples=400, **_SETTINGS)
@given(case=CUDA_CASES)
def test_cuda_model_new_matches_model_forward_and_backward_on_random_inputs(case):
    _check_model_new_against_model(case, "cuda")


@pytest.mark.cuda
@settings(max_examples=400, **_SETTINGS)
@given(case=CUDA_CASES)
def test_cuda_ops_match_model_forward_and_backward_on_random_inputs(case):
    _check_ops_against_model(case, "cuda")


# ----------------------------------------------------------------------------------------------
# Determinism.


def _training_results(new, x, grad_out):
    """Inference (cached fold) output, then a training step's output and gradients."""
    with torch.no_grad():
        inference = new(x)
    new.zero_grad(set_to_none=True)
    x_leaf = _leaf(x)
    out = new(x_leaf)
    out.backward(grad_out)
    return [inference, out.detach(), x_leaf.grad, new.matmul.weight.grad, new.matmul.bias.grad]


# Many rows share each arg-max (the reductions of the backward), K splits on CUDA.
DETERMINISM_BATCHES = [pytest.param(8, id="B=8"), pytest.param(300, id="B=300")]


@pytest.mark.parametrize("batch", DETERMINISM_BATCHES)
def test_forward_and_backward_are_bitwise_identical_run_to_run_under_deterministic_algorithms(
    batch, device, deterministic_algorithms
):
    new = ModelNew(1024, 256, 4, 2.0).to(device)
    x = torch.randn(batch, 1024, device=device)
    grad_out = torch.randn(batch, device=device)
    first = _training_results(new, x, grad_out)
    for _ in range(3):
        for a, b in zip(first, _training_results(new, x, grad_out)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("batch", DETERMINISM_BATCHES)
def test_deterministic_algorithms_mode_changes_no_bit(batch, device):
    new = ModelNew(1024, 256, 4, 2.0).to(device)
    x = torch.randn(batch, 1024, device=device)
    grad_out = torch.randn(batch, device=device)
    default = _training_results(new, x, grad_out)
    new.invalidate_fold()
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        deterministic = _training_results(new, x, grad_out)
    finally:
        torch.use_deterministic_algorithms(previous)
    for a, b in zip(default, deterministic):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------
# Memory.


# k = 1 (no pooling): the pooled width is O, so only the bounded split-K workspace (16 MB, rows in
# slices beyond it) keeps the forward below a [B, O] tensor; B = 4096 makes [B, O] 64 MB.
MEMORY_SHAPES = [(1024, 4096, 4096, 16), (4096, 1024, 4096, 1)]


@pytest.mark.cuda
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize(
    "batch,in_features,out_features,k",
    MEMORY_SHAPES,
    ids=[f"B{b}-O{o}-k{k}" for b, _, o, k in MEMORY_SHAPES],
)
def test_cuda_forward_needs_less_memory_than_one_batch_by_out_features_tensor(
    batch, in_features, out_features, k, grad
):
    model = Model(in_features, out_features, k, 2.0).to("cuda")
    new = ModelNew.from_model(model)
    x = torch.randn(batch, in_features, device="cuda")
    one_batch_by_out_features = batch * out_features * 4  # bytes of a float32 [B, O] tensor

    def extra_peak(module):
        """Peak bytes allocated during one call above what was allocated before it (inputs,
        parameters, the fold cache): its intermediates and its output."""
        module(x)  # warm-up: the fold cache, per-device setup
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = module(x)
        torch.cuda.synchronize()
        del out
        return torch.cuda.max_memory_allocated() - before

    with torch.set_grad_enabled(grad):
        reference = extra_peak(model)
        ours = extra_peak(new)
    # The measurement sees a [B, O] tensor where there is one: Model's Linear output.
    assert reference >= one_batch_by_out_features
    assert ours < one_batch_by_out_features, f"{ours} bytes >= a [B, O] float32 tensor"


def _call(mode, new, x):
    if mode == "inference":
        with torch.no_grad():
            new(x)
    else:
        new(x).sum().backward()
        new.zero_grad(set_to_none=True)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["inference", "training"])
def test_cuda_memory_allocated_is_flat_over_10000_calls(mode):
    new = ModelNew(256, 256, 4, 2.0).to("cuda")
    x = torch.randn(64, 256, device="cuda")
    for _ in range(10):
        _call(mode, new, x)
    torch.cuda.synchronize()
    after_warm_up = torch.cuda.memory_allocated()
    for _ in range(10_000):
        _call(mode, new, x)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == after_warm_up


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_cpu_calls_accumulate_no_python_objects_and_no_memory(mode):
    # 2000 calls: a leak of one Python object per call would add 2000 objects, a leak of grad_x
    # [64, 256] (64 KB) per call 128 MB of resident memory; the bounds leave room for noise only.
    # One intra-op thread: what counts is the number of calls, and on a loaded machine OpenMP
    # barriers would make each call milliseconds long.
    new = ModelNew(256, 256, 4, 2.0)
    x = torch.randn(64, 256)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(100):
            _call(mode, new, x)
        gc.collect()
        objects, rss = len(gc.get_objects()), _rss_bytes()
        for _ in range(2000):
            _call(mode, new, x)
        gc.collect()
        object_growth, rss_growth = len(gc.get_objects()) - objects, _rss_bytes() - rss
    finally:
        torch.set_num_threads(threads)
    assert object_growth < 200, f"{object_growth} more Python objects after 2000 calls"
    assert rss_growth < 32 * 2**20, f"resident memory grew by {rss_growth} bytes"


# ----------------------------------------------------------------------------------------------
# Several Python threads, one ModelNew.


def test_concurrent_inference_on_one_model_new_gives_correct_results(device):
    # 4 threads x 50 calls per round, 3 rounds; the first call of the first round fills the fold
    # cache (from several threads at once), and the parameters change between rounds. Two threads
    # run under no_grad, two under inference_mode (grad mode is per thread).
    threads_count, calls, rounds = 4, 50, 3
    model = Model(96, 64, 4, 2.0)
    new = ModelNew.from_model(model).to(device)
    xs = [torch.randn(16 + i, 96) for i in range(threads_count)]
    xs_device = [x.to(device) for x in xs]
    for round_ in range(rounds):
        weight64 = new.matmul.weight.detach().cpu().double()
        bias64 = new.matmul.bias.detach().cpu().double()
        expected = [_model_with(weight64, bias64, 4, 2.0)(x.double()).detach() for x in xs]
        results = [[] for _ in range(threads_count)]
        errors = []
        barrier = threading.Barrier(threads_count)

        def work(i):
            try:
                barrier.wait(timeout=30)
                with torch.no_grad() if i % 2 == 0 else torch.inference_mode():
                    for _ in range(calls):
                        results[i].append(new(xs_device[i]))
            except BaseException as error:  # reported by the main thread
                errors.append(error)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(threads_count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not any(thread.is_alive() for thread in threads), "a thread hangs"
        assert not errors, errors
        for i in range(threads_count):
            assert len(results[i]) == calls
            for out in results[i]:
                torch.testing.assert_close(out.cpu().double(), expected[i], atol=1e-5, rtol=1e-5)
        with torch.no_grad():  # a parameter update between rounds: the next round must refold
            new.matmul.weight.add_(torch.randn_like(new.matmul.weight) * 0.1)
            new.matmul.bias.mul_(-1)


# ----------------------------------------------------------------------------------------------
# More than 2^31 elements in x, on the CPU (CUDA: test_cuda.py).


@pytest.mark.slow
def test_cpu_forward_of_x_with_more_than_2_to_the_31_elements():
    # A Hankel view (x[b, c] = storage[b + c]): 2^31 + 2^14 elements over 0.6 MB of storage,
    # every row different. Checked on the first rows, random rows and the last rows.
    in_features = 2**14
    batch = 2**31 // in_features + 1
    storage = torch.randn(batch + in_features - 1)
    x = storage.as_strided((batch, in_features), (1, 1))
    assert x.numel() > 2**31
    weight = (torch.rand(3, in_features) * 2 - 1) / in_features**0.5
    bias = torch.rand(3) * 0.1
    out, argmax, _ = ops.forward_with_argmax(x, weight, bias, 2.0)
    rows = torch.cat(
        [torch.arange(64), torch.randint(0, batch, (64,)), torch.arange(batch - 64, batch)]
    )
    values = F.gelu(x[rows].double() @ weight.double().t() + bias.double()) * 2.0
    best, index = values.max(dim=1)
    torch.testing.assert_close(out[rows].double(), best, atol=1e-5, rtol=1e-5)
    top2 = values.topk(2, dim=1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-4
    assert torch.equal(argmax[rows][clear], index[clear])
