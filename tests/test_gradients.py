"""Gradients: the arg-max backward (forward_backward) and the fold's adjoint against autograd of
the reference Model, gradcheck in float64, determinism."""

from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

import fused_pool_gelu
from fused_pool_gelu import ops

_OPS = torch.ops.fused_pool_gelu

# (B, K, O, k)
SHAPES = [
    pytest.param((6, 1, 8, 2), id="K=1"),
    pytest.param((6, 3, 12, 4), id="K=3"),
    pytest.param((6, 257, 64, 4), id="K=257"),
    pytest.param((7, 32, 50, 8), id="O%k!=0"),
    pytest.param((6, 32, 16, 1), id="k=1"),
    pytest.param((6, 32, 24, 24), id="k=O"),
    pytest.param((0, 32, 32, 4), id="B=0"),
    pytest.param((1, 32, 32, 4), id="B=1"),
    pytest.param((300, 64, 80, 4), id="B=300"),
]

def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _model_like(weight, bias, k, scale):
    """The reference Model in float64 on weight's device, holding weight and bias."""
    out_features, in_features = weight.shape
    model = fused_pool_gelu.Model(in_features, out_features, k, scale)
    model = model.to(device=weight.device, dtype=torch.float64)
    with torch.no_grad():
        model.matmul.weight.copy_(weight)
        model.matmul.bias.copy_(bias)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("shape", SHAPES)
def test_fold_forward_gradients_match_model(shape, dtype, device, make_inputs, ref):
    batch, in_features, out_features, k = shape
    scale = 2.0
    x, weight, bias = make_inputs(batch, in_features, out_features, dtype, device)
    grad_out = torch.randn(batch, dtype=dtype, device=device)

    model = _model_like(weight, bias, k, scale)
    x_ref = _leaf(x.double())
    (model(x_ref) * grad_out.double()).sum().backward()

    x_ours, weight_ours, bias_ours = _leaf(x), _leaf(weight), _leaf(bias)
    pooled_weight, pooled_bias = ops.fold(weight_ours, bias_ours, k)
    (ops.forward(x_ours, pooled_weight, pooled_bias, scale) * grad_out).sum().backward()

    tol = ref.tolerance(dtype)
    for ours, expected in [(x_ours, x_ref), (weight_ours, model.matmul.weight),
                           (bias_ours, model.matmul.bias)]:
        torch.testing.assert_close(ours.grad.double(), expected.grad, atol=tol, rtol=tol)


@pytest.mark.parametrize("layout", ["transposed", "sliced_columns", "sliced_rows"])
def test_gradients_for_non_contiguous_x_match_model(layout, device, exact_dtype, make_inputs, ref):
    batch, in_features, out_features, k = 9, 20, 30, 3
    _, weight, bias = make_inputs(1, in_features, out_features, exact_dtype, device)
    gen = dict(dtype=exact_dtype, device=device)
    if layout == "transposed":
        base = torch.randn(in_features, batch, **gen)
        view = lambda b: b.t()  # noqa: E731
    elif layout == "sliced_columns":
        base = torch.randn(batch, 2 * in_features + 1, **gen)
        view = lambda b: b[:, 1::2]  # noqa: E731
    else:
        base = torch.randn(2 * batch, in_features, **gen)
        view = lambda b: b[::2]  # noqa: E731
    model = _model_like(weight, bias, k, 2.0)
    base_ref, base_ours = _leaf(base.double()), _leaf(base)
    model(view(base_ref)).sum().backward()
    weight_ours, bias_ours = _leaf(weight), _leaf(bias)
    pooled_weight, pooled_bias = ops.fold(weight_ours, bias_ours, k)
    ops.forward(view(base_ours), pooled_weight, pooled_bias, 2.0).sum().backward()
    tol = ref.tolerance(exact_dtype)
    torch.testing.assert_close(base_ours.grad.double(), base_ref.grad, atol=tol, rtol=tol)
    torch.testing.assert_close(
        weight_ours.grad.double(), model.matmul.weight.grad, atol=tol, rtol=tol
    )


@pytest.mark.parametrize("scale", [-1.5, 0.0], ids=str)
def test_gradients_follow_any_scale(scale, device, exact_dtype, make_inputs, ref):
    x, weight, bias = make_inputs(8, 16, 12, exact_dtype, device)
    model = _model_like(weight, bias, 3, scale)
    x_ref = _leaf(x.double())
    model(x_ref).sum().backward()
    x_ours, weight_ours = _leaf(x), _leaf(weight)
    pooled_weight, pooled_bias = ops.fold(weight_ours, bias, 3)
    ops.forward(x_ours, pooled_weight, pooled_bias, scale).sum().backward()
    tol = ref.tolerance(exact_dtype)
    torch.testing.assert_close(x_ours.grad.double(), x_ref.grad, atol=tol, rtol=tol)
    torch.testing.assert_close(
        weight_ours.grad.double(), model.matmul.weight.grad, atol=tol, rtol=tol
    )


# gradcheck needs float64, a CPU dtype (the CUDA kernels run float32, float16 and bfloat16); the
# CUDA backward is checked against autograd of Model in float32 by the tests above and below.


def _gradcheck_inputs(device="cpu", dtype=torch.float64, batch=4, in_features=5, pooled=3):
    gen = dict(dtype=dtype, device=device, requires_grad=True)
    return (
        torch.randn(batch, in_features, **gen),
        torch.randn(pooled, in_features, **gen),
        torch.randn(pooled, **gen),
    )


@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "no_bias"])
def test_gradcheck_forward(has_bias):
    x, weight, bias = _gradcheck_inputs()
    if not has_bias:
        assert gradcheck(lambda x, w: ops.forward(x, w, None, 2.0), (x, weight))
    else:
        assert gradcheck(lambda x, w, b: ops.forward(x, w, b, 2.0), (x, weight, bias))


def test_gradcheck_forward_with_argmax_out_and_preactivation():
    x, weight, bias = _gradcheck_inputs()

    def f(x, w, b):
        out, _, preactivation = ops.forward_with_argmax(x, w, b, -0.7)
        return out, preactivation

    assert gradcheck(f, (x, weight, bias))


@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("shape", [(9, 4, 3), (8, 3, 8), (5, 2, 1)], ids=str)
def test_gradcheck_and_gradgradcheck_fold(shape, has_bias):
    out_features, in_features, k = shape
    gen = dict(dtype=torch.float64, requires_grad=True)
    weight = torch.randn(out_features, in_features, **gen)
    bias = torch.randn(out_features, **gen) if has_bias else None
    inputs = (weight, bias) if has_bias else (weight,)
    fold = (lambda w, b: ops.fold(w, b, k)) if has_bias else (lambda w: ops.fold(w, None, k))
    assert gradcheck(fold, inputs)
    assert gradgradcheck(fold, inputs)


@pytest.mark.parametrize("shape", [(9, 4, 3), (8, 3, 8), (5, 2, 1)], ids=str)
def test_gradcheck_and_gradgradcheck_fold_backward(shape):
    out_features, in_features, k = shape
    gen = dict(dtype=torch.float64, requires_grad=True)
    grad_pooled_weight = torch.randn(out_features // k, in_features, **gen)
    grad_pooled_bias = torch.randn(out_features // k, **gen)

    def fold_backward(gw, gb):
        return _OPS.fold_backward(gw, gb, out_features, k)

    assert gradcheck(fold_backward, (grad_pooled_weight, grad_pooled_bias))
    assert gradgradcheck(fold_backward, (grad_pooled_weight, grad_pooled_bias))


def test_double_backward_of_forward_raises_a_clear_error(device, exact_dtype):
    x, weight, bias = _gradcheck_inputs(device, exact_dtype)
    out = ops.forward(x, weight, bias, 2.0)
    (grad_x,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward .* is not supported"):
        grad_x.sum().backward()


@pytest.mark.parametrize("used", ["out", "preactivation", "both"])
def test_gradient_of_preactivation_is_honoured(used, device, exact_dtype, make_inputs, ref):
    x, weight, bias = make_inputs(10, 24, 6, exact_dtype, device)
    scale = 1.5
    g_out = torch.randn(10, dtype=exact_dtype, device=device)
    g_pre = torch.randn(10, dtype=exact_dtype, device=device)

    leaves = [_leaf(t) for t in (x, weight, bias)]
    out, argmax, preactivation = ops.forward_with_argmax(*leaves, scale)
    loss = 0
    if used != "preactivation":
        loss = loss + (out * g_out).sum()
    if used != "out":
        loss = loss + (preactivation * g_pre).sum()
    loss.backward()

    # Reference: autograd through the float64 formula, at the same arg-max.
    ref_leaves = [_leaf(t.double()) for t in (x, weight, bias)]
    z = ref_leaves[0] @ ref_leaves[1].t() + ref_leaves[2]
    z_at = z.gather(1, argmax[:, None]).squeeze(1)
    ref_loss = 0
    if used != "preactivation":
        ref_loss = ref_loss + (torch.nn.functional.gelu(z_at) * scale * g_out.double()).sum()
    if used != "out":
        ref_loss = ref_loss + (z_at * g_pre.double()).sum()
    ref_loss.backward()
    tol = ref.tolerance(exact_dtype)
    for ours, expected in zip(leaves, ref_leaves):
        torch.testing.assert_close(ours.grad.double(), expected.grad, atol=tol, rtol=tol)


def test_backward_is_deterministic(device, make_inputs):
    # Many rows share each arg-max, so the scatter-add into grad_weight really has to reduce.
    x, weight, bias = make_inputs(1000, 600, 120, torch.float32, device)

    def grads():
        leaves = [_leaf(t) for t in (x, weight, bias)]
        pooled_weight, pooled_bias = ops.fold(leaves[1], leaves[2], 4)
        ops.forward(leaves[0], pooled_weight, pooled_bias, 2.0).sum().backward()
        return [leaf.grad for leaf in leaves]

    first, second = grads(), grads()
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_cpu_backward_does_not_depend_on_the_thread_count(make_inputs):
    x, weight, bias = make_inputs(700, 900, 8, torch.float32, "cpu")
    _, argmax, preactivation = ops.forward_with_argmax(x, weight, bias, 2.0)
    grad_out = torch.randn(700)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = _OPS.forward_backward(grad_out, None, x, weight, argmax, preactivation, 2.0)
    finally:
        torch.set_num_threads(threads)
    torch.set_num_threads(max(threads, 2))
    try:
        multi = _OPS.forward_backward(grad_out, None, x, weight, argmax, preactivation, 2.0)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(single, multi):
        assert torch.equal(a, b)


# (batch, pooled): one group holding every row (a piece per tile of 32 sorted rows), and crowded
# groups beside short ones.
ORDER_SHAPES = [(96, 1), (300, 7), (1000, 40)]


@pytest.mark.parametrize("batch,pooled", ORDER_SHAPES, ids=str)
def test_backward_sums_each_group_in_the_order_both_devices_share(batch, pooled, device, ref):
    # With grad_preactivation alone dz[b] is that value exactly (no erf or exp), so on either
    # device grad_weight and grad_bias must be, bit for bit, the sums in the order of
    # csrc/summation_order.h (ref.grouped_sums), and so the same on both.
    gen = torch.Generator().manual_seed(batch + pooled)
    in_features = 40
    x = torch.randn(batch, in_features, generator=gen)
    weight = torch.randn(pooled, in_features, generator=gen)
    crowded = torch.randint(0, min(pooled, 2), (batch,), generator=gen)
    spread = torch.randint(0, pooled, (batch,), generator=gen)
    argmax = torch.where(torch.rand(batch, generator=gen) < 0.6, crowded, spread)
    dz = torch.randn(batch, generator=gen)
    _, grad_weight, grad_bias = _OPS.forward_backward(
        None, dz.to(device), x.to(device), weight.to(device), argmax.to(device),
        torch.randn(batch).to(device), 2.0,
    )
    expected_weight, expected_bias = ref.grouped_sums(x, dz, argmax, pooled)
    assert torch.equal(grad_weight.cpu().view(torch.int32), expected_weight.view(torch.int32))
    assert torch.equal(grad_bias.cpu().view(torch.int32), expected_bias.view(torch.int32))


def test_bias_none_gives_no_bias_gradient(device, exact_dtype, make_inputs, ref):
    x, weight, _ = make_inputs(8, 16, 12, exact_dtype, device, bias=False)
    x_ours, weight_ours = _leaf(x), _leaf(weight)
    pooled_weight, pooled_bias = ops.fold(weight_ours, None, 3)
    ops.forward(x_ours, pooled_weight, None, 2.0).sum().backward()

    linear = torch.nn.Linear(16, 12, bias=False).to(device=device, dtype=torch.float64)
    with torch.no_grad():
        linear.weight.copy_(weight)
    x_ref = _leaf(x.double())
    y = torch.nn.functional.avg_pool1d(linear(x_ref).unsqueeze(1), 3).squeeze(1)
    (torch.nn.functional.gelu(y) * 2.0).max(dim=1).values.sum().backward()

    tol = ref.tolerance(exact_dtype)
    torch.testing.assert_close(x_ours.grad.double(), x_ref.grad, atol=tol, rtol=tol)
    torch.testing.assert_close(weight_ours.grad.double(), linear.weight.grad, atol=tol, rtol=tol)
    # The zero pooled bias of a bias-free fold depends on nothing: no gradient flows from it.
    (grad_weight,) = torch.autograd.grad(pooled_bias.sum(), weight_ours, allow_unused=True)
    assert grad_weight is None or not bool(grad_weight.any())


def test_forward_without_bias_matches_reference_gradients(device, exact_dtype, make_inputs, ref):
    x, weight, _ = make_inputs(5, 8, 3, exact_dtype, device, bias=False)
    x, weight = _leaf(x), _leaf(weight)
    grads = torch.autograd.grad(ops.forward(x, weight, None, 2.0).sum(), (x, weight))
    x_ref, weight_ref = _leaf(x.double()), _leaf(weight.double())
    out_ref = (torch.nn.functional.gelu(x_ref @ weight_ref.t()) * 2.0).max(dim=1).values
    expected = torch.autograd.grad(out_ref.sum(), (x_ref, weight_ref))
    tol = ref.tolerance(exact_dtype)
    for ours, theirs in zip(grads, expected):
        torch.testing.assert_close(ours.double(), theirs, atol=tol, rtol=tol)


# ----------------------------------------------------------------------------------------------
# model_forward: fold then forward as one C++ autograd node, the same bits as the two ops


def _bits(t):
    """The raw bits of a float tensor, zeros made +0.0: the separate ops' autograd adds a zero
    preactivation gradient that model_forward skips, which only changes the sign of a zero."""
    t = torch.where(t == 0, torch.zeros_like(t), t)
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _fold_then_forward_grads(x, weight, bias, k, scale, grad_out, fused):
    """(out, grad of each input that requires grad) through model_forward or fold then forward."""
    if fused:
        out = ops.model_forward(x, weight, bias, k, scale)
    else:
        out = ops.forward(x, *ops.fold(weight, bias, k), scale)
    inputs = [t for t in (x, weight, bias) if t is not None and t.requires_grad]
    return (out, *torch.autograd.grad(out, inputs, grad_out))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scale", [2.0, -1.0, 0.0], ids=str)
@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "no_bias"])
def test_model_forward_equals_fold_then_forward_bit_for_bit(
    has_bias, scale, dtype, device, make_inputs
):
    # scale 0: dz = -0.0 on some rows (zero gradients, whose sign is not compared).
    x, weight, bias = make_inputs(40, 24, 34, dtype, device, bias=has_bias)
    grad_out = torch.randn(40, device=device).to(dtype)
    leaves = [None if t is None else _leaf(t) for t in (x, weight, bias)]
    fused = _fold_then_forward_grads(*leaves, 4, scale, grad_out, fused=True)
    leaves = [None if t is None else _leaf(t) for t in (x, weight, bias)]
    separate = _fold_then_forward_grads(*leaves, 4, scale, grad_out, fused=False)
    assert len(fused) == len(separate)
    for a, b in zip(fused, separate):
        assert a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("needs", ["x", "weight", "bias", "weight_and_bias"])
def test_model_forward_returns_only_the_gradients_asked_for(
    needs, device, exact_dtype, make_inputs
):
    x, weight, bias = make_inputs(10, 16, 12, exact_dtype, device)
    leaves = {"x": x.clone(), "weight": weight.clone(), "bias": bias.clone()}
    for name in needs.split("_and_"):
        leaves[name].requires_grad_(True)
    ops.model_forward(leaves["x"], leaves["weight"], leaves["bias"], 3, 2.0).sum().backward()
    separate = {name: _leaf(t) for name, t in (("x", x), ("weight", weight), ("bias", bias))}
    folded = ops.fold(separate["weight"], separate["bias"], 3)
    ops.forward(separate["x"], *folded, 2.0).sum().backward()
    for name, leaf in leaves.items():
        if leaf.requires_grad:
            assert torch.equal(leaf.grad, separate[name].grad)
        else:
            assert leaf.grad is None


def test_model_forward_records_one_autograd_node(device, make_inputs):
    x, weight, bias = (_leaf(t) for t in make_inputs(4, 16, 12, torch.float32, device))
    out = ops.model_forward(x, weight, bias, 3, 2.0)
    # Straight from the op's node to the leaves: no fold node, no forward_with_argmax node.
    leaves = [fn.variable for fn, _ in out.grad_fn.next_functions]
    assert leaves == [x, weight, bias]


def test_model_forward_without_grad_mode_records_nothing(device, make_inputs):
    x, weight, bias = (_leaf(t) for t in make_inputs(4, 16, 12, torch.float32, device))
    with torch.no_grad():
        out = ops.model_forward(x, weight, bias, 3, 2.0)
    with torch.inference_mode():
        inference_out = ops.model_forward(x, weight, bias, 3, 2.0)
    expected = ops.forward(x.detach(), *ops.fold(weight.detach(), bias.detach(), 3), 2.0)
    assert out.grad_fn is None and not out.requires_grad
    assert torch.equal(out, expected) and torch.equal(inference_out, expected)


def test_double_backward_of_model_forward_raises_a_clear_error(device, exact_dtype):
    x, weight, bias = _gradcheck_inputs(device, exact_dtype, pooled=6)
    out = ops.model_forward(x, weight, bias, 2, 2.0)
    (grad_x,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward .* is not supported"):
        grad_x.sum().backward()


def test_gradcheck_model_forward():
    x, weight, bias = _gradcheck_inputs(pooled=6)
    assert gradcheck(lambda x, w, b: ops.model_forward(x, w, b, 2, 2.0), (x, weight, bias))


def test_model_forward_saved_input_edited_in_place_raises(device, make_inputs):
    # x is saved for the backward: autograd's version check catches an edit between the passes.
    x, weight, bias = (_leaf(t) for t in make_inputs(4, 16, 12, torch.float32, device))
    x_used = x * 1.0
    out = ops.model_forward(x_used, weight, bias, 3, 2.0)
    with torch.no_grad():
        x_used.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


# ----------------------------------------------------------------------------------------------
# model_backward: forward_backward then fold_backward in one op (model_forward's backward). On CUDA
# it leaves the pooled gradient's rows of empty segments unwritten and never reads them, so every
# case below has empty segments, and runs in deterministic mode, which fills every allocation with
# NaN: a row read by mistake shows as NaN instead of a lucky zero.

# (batch, pooled, in_features, k, out_features, arg-max distribution)
MODEL_BACKWARD_CASES = [
    pytest.param((0, 3, 8, 2, 6, "uniform"), id="B=0"),
    pytest.param((1, 4, 5, 1, 4, "uniform"), id="B=1-K=5"),
    pytest.param((40, 8, 24, 4, 34, "uniform"), id="B=40-tail"),
    # Groups that span many tiles of 32 sorted rows; K = 37: the scalar (unvectorized) path.
    pytest.param((300, 7, 37, 3, 22, "few"), id="B=300-few-K=37"),
    pytest.param((1000, 50, 64, 2, 100, "one"), id="B=1000-one"),
    pytest.param((777, 600, 40, 1, 600, "uniform"), id="B=777-N=600"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", MODEL_BACKWARD_CASES)
def test_model_backward_equals_fold_backward_of_forward_backward_bit_for_bit(
    case, dtype, device, ref, deterministic_algorithms
):
    batch, pooled, in_features, k, out_features, distribution = case
    generator = torch.Generator().manual_seed(batch * 1000 + pooled)

    def rand(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(device, dtype)

    x, pooled_weight = rand(batch, in_features), rand(pooled, in_features)
    grad_out, preactivation = rand(batch), rand(batch)
    if distribution == "uniform":  # over every column but the last
        argmax = torch.randint(0, pooled - 1, (batch,), generator=generator)
    elif distribution == "few":
        argmax = torch.tensor([0, pooled // 2, pooled - 1])[
            torch.randint(0, 3, (batch,), generator=generator)
        ]
    else:
        argmax = torch.full((batch,), pooled // 2, dtype=torch.int64)
    argmax = argmax.to(device)
    assert argmax.unique().numel() < pooled  # some segments are empty

    ours = _OPS.model_backward(
        grad_out, x, pooled_weight, argmax, preactivation, 2.0, out_features, k
    )
    grad_x, grad_pooled_weight, grad_pooled_bias = _OPS.forward_backward(
        grad_out, None, x, pooled_weight, argmax, preactivation, 2.0
    )
    expected = (grad_x, *_OPS.fold_backward(grad_pooled_weight, grad_pooled_bias, out_features, k))
    shapes = [(batch, in_features), (out_features, in_features), (out_features,)]
    for got, want, shape in zip(ours, expected, shapes):
        assert tuple(got.shape) == shape and got.dtype == dtype and got.device == want.device
        assert torch.equal(_bits(got), _bits(want))
    assert not ours[1].isnan().any() and not ours[2].isnan().any()

    # On the CPU model_backward is that very composition (csrc/model_forward.cpp): the values are
    # checked against the float64 formulas too, so that the CPU case can fail.
    dz = grad_out.double().cpu() * 2.0 * ref.gelu_grad(preactivation.double().cpu())
    weight64, argmax64 = pooled_weight.double().cpu(), argmax.cpu()
    grad_pooled_weight64, grad_pooled_bias64 = ref.grouped_sums(x.double(), dz, argmax64, pooled)
    grad_weight64, grad_bias64 = ref.fold_backward(
        grad_pooled_weight64, grad_pooled_bias64, out_features, k
    )
    tol = ref.tolerance(dtype)
    for got, want in zip(ours, (dz[:, None] * weight64[argmax64], grad_weight64, grad_bias64)):
        scale = float(want.abs().max()) if want.numel() else 0.0
        torch.testing.assert_close(got.double().cpu(), want, atol=tol * scale, rtol=tol)


def test_model_backward_double_backward_raises_a_clear_error(device):
    x, pooled_weight = torch.randn(5, 8, device=device), torch.randn(3, 8, device=device)
    grad_out = torch.randn(5, device=device, requires_grad=True)
    argmax = torch.tensor([0, 2, 2, 1, 0], device=device)
    preactivation = torch.randn(5, device=device)
    grads = _OPS.model_backward(grad_out, x, pooled_weight, argmax, preactivation, 2.0, 7, 2)
    with pytest.raises(RuntimeError, match="model_backward: double backward .* is not supported"):
        grads[1].sum().backward()
