"""prepare_weight and the forward's prepared_weight argument (csrc/prepared_weight.h).

The layout is checked against a float64 reading of the weight on every device; the forward with a
prepared weight must give the same bits as without it where both calls take the same path (not
from 257 to 512 rows, nor from 33 to one row per SM, on sm_90a on weights large enough, where only
the call with it takes the certified path: test_certified.py::
test_the_default_takes_the_certified_path_from_its_batch_and_weight_size and
test_the_default_takes_the_fused_rows_with_a_prepared_weight), and must refuse a
prepared weight that no longer matches its weight. On CUDA the certified path (forced on) is where
the copy is read; the CPU forward validates it and ignores it, so on the CPU the same-bits tests
check that it is accepted, and the layout tests check the CPU's copy itself.
"""

import math

import pytest
import torch

import fused_pool_gelu
from fused_pool_gelu import ops

_OPS = torch.ops.fused_pool_gelu


def _size(pooled, in_features):
    return pooled * (128 * math.ceil(in_features / 64) + 16)


def _copy_positions(copy_halves):
    """Where each column sits in a row of the copy: prepared_copy_group (csrc/prepared_weight.h)
    moves column group bits (g3 g2 g1 g0) within each block of 64 columns to (g3 g1 g0 g2)."""
    column = torch.arange(copy_halves)
    group = column // 4
    g = group % 16
    moved = (group - g) + (g & 8) + ((g & 3) << 1) + ((g >> 2) & 1)
    return 4 * moved + column % 4


def _unpack(prepared, pooled, in_features):
    """(copy [N, K] float16 in column order, norm, residual norm, inverse scale, the copy's
    padding, the trailers' spare slot) of a prepared weight (csrc/prepared_weight.h)."""
    copy_halves = 64 * math.ceil(in_features / 64)
    raw = prepared.cpu()
    assert raw.shape == (_size(pooled, in_features),)
    stored = raw[: pooled * 2 * copy_halves].view(torch.float16).view(pooled, copy_halves)
    copy = stored[:, _copy_positions(copy_halves)]
    trailer = raw[pooled * 2 * copy_halves :].view(torch.float32).view(pooled, 4)
    return (copy[:, :in_features], trailer[:, 0], trailer[:, 1], trailer[:, 2],
            copy[:, in_features:], trailer[:, 3])


def _expected_copy(weight64, inverse_scale):
    scaled = weight64 / inverse_scale.double()[:, None]
    kept = torch.where(scaled.abs() < 2.0**-14, torch.zeros_like(scaled), scaled)
    return kept.float().half(), scaled


@pytest.mark.parametrize("pooled,in_features", [(7, 13), (5, 64), (3, 1), (9, 8200)])
def test_layout_matches_float64(pooled, in_features, device):
    weight = torch.randn(pooled, in_features, device=device) * torch.logspace(
        -3, 3, pooled, device=device
    )[:, None]
    prepared = fused_pool_gelu.prepare_weight(weight)
    assert prepared.dtype == torch.uint8 and prepared.device == weight.device
    unpacked = _unpack(prepared, pooled, in_features)
    copy, norm, residual_norm, inverse_scale, padding, spare = unpacked
    assert bool((padding == 0).all()) and bool((spare == 0).all())
    # Powers of two that put each row's largest magnitude in [2^14, 2^15).
    mantissa, _ = torch.frexp(inverse_scale)
    assert bool((mantissa == 0.5).all())
    w64 = weight.double().cpu()
    largest = (w64.abs().amax(dim=1) / inverse_scale.double())
    assert bool(((largest >= 2**14) & (largest < 2**15)).all()), largest
    expected, scaled = _expected_copy(w64, inverse_scale)
    assert torch.equal(copy, expected)
    # Upper bounds on the float64 norms, and tight ones.
    norm64 = w64.norm(dim=1)
    residual64 = ((scaled - copy.double()) * inverse_scale.double()[:, None]).norm(dim=1)
    assert bool((norm.double() >= norm64).all())
    assert bool((norm.double() <= norm64 * (1 + 1e-5)).all())
    assert bool((residual_norm.double() >= residual64).all())
    assert bool((residual_norm.double() <= residual64 * (1 + 1e-5) + 1e-30).all())


def test_special_rows(device):
    k = 24
    weight = torch.randn(6, k, device=device)
    weight[0] = 0.0                      # scale 1, norms 0
    weight[1, 3] = float("nan")          # NaN norms: the forward rescores every column
    weight[2] *= 1e30                    # about 2^79 or more: the copy overflows, infinite residual
    weight[3] *= 1e-30                   # below 2^-49: the scale stops at 2^63, values flushed
    weight[4, ::2] = 1e-41               # subnormals next to normal values: flushed to 0
    prepared = fused_pool_gelu.prepare_weight(weight)
    copy, norm, residual_norm, inverse_scale, _, _ = _unpack(prepared, 6, k)
    # Norms 0 up to the floor that covers float32 sums of squares losing subnormal terms (CUDA).
    assert float(norm[0]) < 1e-20 and float(residual_norm[0]) < 1e-20
    assert float(inverse_scale[0]) == 1
    assert math.isnan(float(norm[1]))
    assert float(inverse_scale[2]) == 2.0**63 and math.isinf(float(residual_norm[2]))
    assert float(inverse_scale[3]) == 2.0**-63
    assert bool((copy[4, ::2] == 0).all())
    w64 = weight.double().cpu()
    assert float(norm[3]) >= float(w64[3].norm()) and float(residual_norm[3]) >= float(
        (w64[3] - copy[3].double() * float(inverse_scale[3])).norm()
    )


def test_norms_bound_values_that_underflow_once_scaled(device):
    # The row's scale is 2^-63 (its largest value 2^77): 2^-149 * 2^-63 underflows to 0 in
    # float32, so the copy drops it, and the residual norm must still bound what was dropped (the
    # CPU's had no floor for it: 0).
    weight = torch.tensor([[2.0**77, 2.0**-149, 0.0, 0.0], [1.0, 2.0**-149, -3.0, 0.5]],
                          device=device)
    copy, norm, residual_norm, inverse_scale, _, _ = _unpack(
        fused_pool_gelu.prepare_weight(weight), 2, 4)
    w64 = weight.double().cpu()
    for row in range(2):
        residual = w64[row] - copy[row].double() * float(inverse_scale[row])
        assert float(norm[row]) >= float(w64[row].norm()), row
        assert float(residual_norm[row]) >= float(residual.norm()) > 0, row


def test_empty_shapes(device):
    assert fused_pool_gelu.prepare_weight(torch.randn(0, 10, device=device)).shape == (0,)
    prepared = fused_pool_gelu.prepare_weight(torch.randn(3, 0, device=device))
    assert prepared.shape == (48,)
    _, norm, residual_norm, inverse_scale, _, _ = _unpack(prepared, 3, 0)
    assert bool((norm == 0).all()) and bool((residual_norm == 0).all())
    assert bool((inverse_scale == 1).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_dtypes_are_prepared_from_their_float32_values(dtype, device):
    # (test_layout_matches_float64 checks the float32 copy itself.)
    weight = torch.randn(4, 40, device=device).to(dtype)
    prepared = fused_pool_gelu.prepare_weight(weight)
    reference = fused_pool_gelu.prepare_weight(weight.float())
    assert torch.equal(prepared, reference)


# Shapes where the calls with and without a prepared weight take the same path by default (see the
# module's docstring).
@pytest.mark.parametrize("batch,in_features,pooled", [(1024, 512, 96), (33, 100, 7), (3, 77, 5)])
@pytest.mark.parametrize("certified_mode", ["default", "forced"])
def test_forward_gives_the_same_bits_with_and_without(
    batch, in_features, pooled, certified_mode, device, make_inputs, set_debug_knobs
):
    if certified_mode == "forced":
        if device == "cpu":
            pytest.skip("the certified path is CUDA's")
        set_debug_knobs(FUSED_POOL_GELU_CERTIFIED="1")
    x, weight, bias = make_inputs(batch, in_features, pooled, torch.float32, device)
    prepared = fused_pool_gelu.prepare_weight(weight)
    expected = ops.forward_with_argmax(x, weight, bias, 2.0)
    got = ops.forward_with_argmax(x, weight, bias, 2.0, prepared)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(fused_pool_gelu.forward(x, weight, bias, 2.0, prepared), expected[0])


def test_gradients_are_unchanged(device, make_inputs):
    leaves = [t.requires_grad_() for t in make_inputs(40, 64, 6, torch.float32, device)]
    prepared = fused_pool_gelu.prepare_weight(leaves[1])
    assert not prepared.requires_grad and prepared.grad_fn is None
    grads = []
    for p in (None, prepared):
        for t in leaves:
            t.grad = None
        fused_pool_gelu.forward(*leaves, 2.0, p).sum().backward()
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_stale_or_foreign_prepared_weights_are_refused(device):
    x = torch.randn(5, 16, device=device)
    weight = torch.randn(4, 16, device=device)
    prepared = fused_pool_gelu.prepare_weight(weight)
    fused_pool_gelu.forward(x, weight, None, 1.0, prepared)
    with pytest.raises(RuntimeError, match="made from another weight tensor"):
        fused_pool_gelu.forward(x, weight.clone(), None, 1.0, prepared)
    # A copy has no record of its weight (torch.compile's CUDA graphs and opcheck copy inputs): it
    # is trusted, and here it does match.
    torch.testing.assert_close(
        fused_pool_gelu.forward(x, weight, None, 1.0, prepared.clone()),
        fused_pool_gelu.forward(x, weight, None, 1.0), rtol=0, atol=0,
    )
    with pytest.raises(RuntimeError, match="must be uint8"):
        fused_pool_gelu.forward(x, weight, None, 1.0, prepared.view(torch.int8))
    with pytest.raises(RuntimeError, match=r"must be 1-D \[pooled_features \* \(128"):
        fused_pool_gelu.forward(x, weight, None, 1.0, prepared[:-16])
    with pytest.raises(RuntimeError, match="not a view"):
        fused_pool_gelu.forward(x, weight[:2], None, 1.0, prepared[16:16 + _size(2, 16)])
    # A view of the same memory is the same weight; an in-place change makes the copy stale.
    fused_pool_gelu.forward(x, weight.detach(), None, 1.0, prepared)
    weight.mul_(2)
    with pytest.raises(RuntimeError, match="prepared_weight is stale"):
        fused_pool_gelu.forward(x, weight, None, 1.0, prepared)
    fused_pool_gelu.forward(x, weight, None, 1.0, fused_pool_gelu.prepare_weight(weight))


@pytest.mark.parametrize("where", ["inside", "made inside, used outside"])
def test_an_inference_tensor_weight_is_prepared_and_checked_for_its_identity(where, device):
    # Inference tensors keep no version counter: prepare_weight and forward must not ask for it
    # (they raised "Inference tensors do not track version counter"), and still refuse a prepared
    # weight made from another tensor.
    x = torch.randn(5, 16, device=device)
    with torch.inference_mode():
        weight = torch.randn(4, 16, device=device)
        bias = torch.randn(4, device=device)
        if where == "inside":
            prepared = fused_pool_gelu.prepare_weight(weight)
            out = fused_pool_gelu.forward(x, weight, bias, 2.0, prepared)
            other = weight.clone()
    if where != "inside":
        prepared = fused_pool_gelu.prepare_weight(weight)
        out = fused_pool_gelu.forward(x, weight, bias, 2.0, prepared)
        with torch.inference_mode():
            other = weight.clone()
    torch.testing.assert_close(out, fused_pool_gelu.forward(x, weight, bias, 2.0), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="made from another weight tensor"):
        fused_pool_gelu.forward(x, other, bias, 2.0, prepared)


@pytest.mark.cuda
def test_prepared_weight_on_another_device_is_refused():
    weight = torch.randn(4, 16)
    prepared = fused_pool_gelu.prepare_weight(weight).cuda()
    with pytest.raises(RuntimeError, match="must be on weight's device"):
        fused_pool_gelu.forward(torch.randn(2, 16), weight, None, 1.0, prepared)


@pytest.mark.cuda
@pytest.mark.parametrize("pooled,in_features", [(7, 13), (64, 8192), (5, 4)])
def test_cuda_and_cpu_make_the_same_copy(pooled, in_features):
    weight = torch.randn(pooled, in_features) * 3
    cpu = _unpack(fused_pool_gelu.prepare_weight(weight), pooled, in_features)
    cuda = _unpack(fused_pool_gelu.prepare_weight(weight.cuda()), pooled, in_features)
    assert torch.equal(cpu[0], cuda[0]) and torch.equal(cpu[3], cuda[3])
    for a, b in zip(cpu[1:3], cuda[1:3]):  # norms: both upper bounds, summed differently
        torch.testing.assert_close(a, b, rtol=1e-5, atol=0)


def test_model_new_keeps_a_prepared_weight_on_cuda_only(device):
    model = fused_pool_gelu.ModelNew(32, 64, 4, 2.0).to(device)
    x = torch.randn(8, 32, device=device)
    with torch.no_grad():
        first = model(x)
        _, _, prepared = model._folded(model.matmul.weight, model.matmul.bias,
                                       model.pool_kernel_size)
        assert (prepared is not None) == (device == "cuda")
        with torch.no_grad():
            model.matmul.weight.add_(0.5)  # refolded and prepared again on the next call
        second = model(x)
    reference = fused_pool_gelu.Model(32, 64, 4, 2.0).to(device)
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(second, reference(x), rtol=1e-5, atol=1e-5)
    assert not torch.equal(first, second)


@pytest.mark.parametrize("where", ["argument", "inside"])
def test_compiled_function_with_a_prepared_weight_equals_eager(where, device, make_inputs):
    # Traced through the fake kernels with no graph break; at run time the guard sees the real
    # tensors (a prepared weight made inside the graph is recorded there like an eager one).
    x, weight, bias = make_inputs(40, 72, 5, torch.float32, device)

    def with_argument(x, weight, bias, prepared):
        return fused_pool_gelu.forward(x, weight, bias, 2.0, prepared)

    def inside(x, weight, bias):
        return fused_pool_gelu.forward(x, weight, bias, 2.0, fused_pool_gelu.prepare_weight(weight))

    torch._dynamo.reset()
    try:
        if where == "argument":
            prepared = fused_pool_gelu.prepare_weight(weight)
            compiled = torch.compile(with_argument, backend="aot_eager", fullgraph=True)
            got = compiled(x, weight, bias, prepared)
        else:
            compiled = torch.compile(inside, backend="aot_eager", fullgraph=True)
            got = compiled(x, weight, bias)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got, fused_pool_gelu.forward(x, weight, bias, 2.0), rtol=0, atol=0)


def test_threads_preparing_and_calling_concurrently_agree(make_inputs):
    # The table that ties prepared weights to their weights is shared by every thread.
    import threading

    x, weight, bias = make_inputs(16, 40, 6, torch.float32, "cpu")
    expected = fused_pool_gelu.forward(x, weight, bias, 2.0)
    failures = []

    def worker():
        try:
            for _ in range(20):
                own = weight.clone()
                prepared = fused_pool_gelu.prepare_weight(own)
                if not torch.equal(fused_pool_gelu.forward(x, own, bias, 2.0, prepared), expected):
                    failures.append("different result")
        except Exception as error:  # noqa: BLE001 - reported below
            failures.append(repr(error))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures
