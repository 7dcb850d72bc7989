"""torch.func transforms over ModelNew and the ops (fused_pool_gelu/_func.py), and the clear
errors of what is not supported: forward-mode AD, double backward, torch.jit.script."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.func import functional_call, grad, jacrev, jvp, stack_module_state, vjp, vmap

import fused_pool_gelu
from fused_pool_gelu import Model, ModelNew

K, O, POOL, SCALE = 48, 40, 4, 2.0


def _pair(device, seed=0):
    torch.manual_seed(seed)
    model = ModelNew(K, O, POOL, SCALE).to(device)
    torch.manual_seed(seed)
    reference = Model(K, O, POOL, SCALE).to(device)
    return model, reference


def _params(model):
    return {name: p.detach() for name, p in model.named_parameters()}


def test_grad_of_functional_call_matches_model(device):
    model, reference = _pair(device)
    x = torch.rand(6, K, device=device)
    params = _params(model)

    def loss(module):
        return lambda p, x: functional_call(module, p, (x,)).square().sum()

    got = grad(loss(model), argnums=(0, 1))(params, x)
    expected = grad(loss(reference), argnums=(0, 1))(params, x)
    for name in params:
        torch.testing.assert_close(got[0][name], expected[0][name], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], expected[1], atol=1e-5, rtol=1e-5)


def test_vjp_matches_model(device):
    model, reference = _pair(device)
    x = torch.rand(6, K, device=device)
    cotangent = torch.rand(6, device=device)
    out, pullback = vjp(model, x)
    out_ref, pullback_ref = vjp(reference, x)
    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pullback(cotangent)[0], pullback_ref(cotangent)[0],
                               atol=1e-5, rtol=1e-5)


def test_jacrev_matches_model_without_a_batching_fallback(device):
    model, reference = _pair(device)
    x = torch.rand(5, K, device=device)
    with warnings.catch_warnings():
        # The backward has a vmap rule (_func.py): no "performance drop" fallback warning.
        warnings.simplefilter("error", UserWarning)
        jacobian = jacrev(model)(x)
    torch.testing.assert_close(jacobian, jacrev(reference)(x), atol=1e-5, rtol=1e-5)
    # Row b's output depends on row b's input alone.
    off_diagonal = jacobian.clone()
    off_diagonal[torch.arange(5), torch.arange(5)] = 0
    assert not off_diagonal.any()


def test_jacrev_of_the_ops_matches_a_dense_computation(device):
    torch.manual_seed(1)
    weight = torch.randn(O, K, device=device) / K**0.5
    bias = torch.randn(O, device=device)
    x = torch.rand(3, K, device=device)

    def ours(w):
        return fused_pool_gelu.forward(x, *fused_pool_gelu.fold(w, bias, POOL), SCALE)

    def dense(w):
        pooled = w.view(O // POOL, POOL, K).mean(1)
        z = x @ pooled.T + bias.view(O // POOL, POOL).mean(1)
        return (torch.nn.functional.gelu(z) * SCALE).max(dim=1).values

    torch.testing.assert_close(jacrev(ours)(weight), jacrev(dense)(weight), atol=1e-5, rtol=1e-5)


def test_vmap_over_inputs_is_one_call_of_the_stacked_rows(device):
    model, _ = _pair(device)
    xs = torch.rand(4, 6, K, device=device)
    with torch.no_grad():
        expected = torch.stack([model(x) for x in xs])
    torch.testing.assert_close(vmap(model)(xs), expected, atol=0, rtol=0)


def test_vmap_over_an_ensemble_of_models(device):
    models = [_pair(device, seed)[0] for seed in range(3)]
    params, buffers = stack_module_state(models)
    x = torch.rand(6, K, device=device)

    def call(p, b, x):
        return functional_call(models[0], (p, b), (x,))

    got = vmap(call, in_dims=(0, 0, None))(params, buffers, x)
    with torch.no_grad():
        expected = torch.stack([m(x) for m in models])
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


def test_forward_mode_raises_naming_the_op_and_the_alternative(device):
    model, _ = _pair(device)
    x = torch.rand(3, K, device=device)
    with pytest.raises(RuntimeError, match=r"fused_pool_gelu\.\w+: \w+ carries a forward-mode AD "
                                           r"tangent; .* not supported, use reverse mode"):
        jvp(model, (x,), (torch.ones_like(x),))


def test_double_backward_through_forward_raises(device):
    model, _ = _pair(device)
    x = torch.rand(1, K, device=device)
    with pytest.raises(RuntimeError, match="forward_backward: double backward"):
        grad(lambda x: grad(lambda y: model(y).sum())(x).sum())(x)


def test_double_backward_through_the_fold_works(device):
    torch.manual_seed(2)
    # float64 where the kernels have it (the CPU); CUDA's fold is float32.
    dtype = torch.float64 if device == "cpu" else torch.float32
    weight = torch.randn(O, K, device=device, dtype=dtype)

    def folded_square(w):
        return fused_pool_gelu.fold(w, None, POOL)[0].square().sum()

    def dense_square(w):
        return w.view(O // POOL, POOL, K).mean(1).square().sum()

    direction = torch.randn_like(weight)
    got = grad(lambda w: (grad(folded_square)(w) * direction).sum())(weight)
    expected = grad(lambda w: (grad(dense_square)(w) * direction).sum())(weight)
    torch.testing.assert_close(got, expected)


def test_jit_script_says_what_to_use_instead():
    model = ModelNew(K, O, POOL, SCALE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.script's own deprecation
        for scripted in (model, torch.nn.Sequential(torch.nn.Identity(), model)):
            with pytest.raises(RuntimeError, match="ModelNew does not support torch.jit.script"
                                                   r".*use torch.compile or torch.export"):
                torch.jit.script(scripted)


def test_functionalize_takes_the_ops_as_they_are(device):
    model, _ = _pair(device)
    x = torch.rand(4, K, device=device)
    with torch.no_grad():
        expected = model(x)
        torch.testing.assert_close(torch.func.functionalize(model)(x), expected, atol=0, rtol=0)


def test_vmap_over_one_dimensional_samples_raises_as_outside_vmap(device):
    # Samples of shape [K]: the op's own "must be 2-D", not a reshape of the wrong rows.
    weight = torch.rand(4, 1, device=device)
    bias = torch.rand(4, device=device)
    with pytest.raises(RuntimeError, match="forward: x must be 2-D"):
        vmap(lambda t: fused_pool_gelu.forward(t, weight, bias, SCALE))(
            torch.rand(3, 1, device=device)
        )


def test_a_prepared_weight_is_checked_under_transforms_too(device):
    torch.manual_seed(3)
    weight, other = torch.rand(4, K, device=device), torch.rand(4, K, device=device)
    bias = torch.rand(4, device=device)
    prepared = fused_pool_gelu.prepare_weight(other)
    x = torch.rand(3, K, device=device)
    with pytest.raises(RuntimeError, match="prepared_weight"):
        grad(lambda t: fused_pool_gelu.forward(t, weight, bias, SCALE, prepared).sum())(x)
    good = fused_pool_gelu.prepare_weight(weight)
    torch.testing.assert_close(
        grad(lambda t: fused_pool_gelu.forward(t, weight, bias, SCALE, good).sum())(x),
        grad(lambda t: fused_pool_gelu.forward(t, weight, bias, SCALE).sum())(x),
        atol=0, rtol=0,
    )
