"""torch.compile(fullgraph=True) traces the ops and ModelNew with no graph break, and the compiled
forward and backward equal eager."""

from __future__ import annotations

import copy

import pytest
import torch

from fused_pool_gelu import Model, ModelNew, ops

# aot_eager runs the traced graph (fake kernels, autograd formulas, functionalization) without
# codegen: fast. One test per kind also goes through inductor, the default backend.
FAST_BACKEND = "aot_eager"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def _fold_forward(x, weight, bias, k, scale):
    pooled_weight, pooled_bias = ops.fold(weight, bias, k)
    return ops.forward(x, pooled_weight, pooled_bias, scale)


def _run(fn, x, weight, bias, grad_out, *extra):
    x, weight, bias = _leaves(x, weight, bias)
    out = fn(x, weight, bias, *extra)
    out.backward(grad_out)
    return out.detach(), x.grad, weight.grad, bias.grad


def _assert_same(compiled, eager, tol=1e-5):
    for c, e in zip(compiled, eager):
        torch.testing.assert_close(c, e, atol=tol, rtol=tol)


def test_compiled_forward_op_equals_eager(device, make_inputs):
    x, weight, bias = make_inputs(12, 40, 8, torch.float32, device)
    grad_out = torch.randn(12, device=device)
    fn = lambda x, w, b: ops.forward(x, w, b, 2.0)  # noqa: E731
    compiled = torch.compile(fn, backend=FAST_BACKEND, fullgraph=True)
    _assert_same(_run(compiled, x, weight, bias, grad_out), _run(fn, x, weight, bias, grad_out))


def test_compiled_forward_with_argmax_equals_eager(device, make_inputs):
    x, weight, bias = make_inputs(12, 40, 8, torch.float32, device)
    fn = lambda x, w, b: ops.forward_with_argmax(x, w, b, -1.0)  # noqa: E731
    compiled = torch.compile(fn, backend=FAST_BACKEND, fullgraph=True)
    for c, e in zip(compiled(x, weight, bias), fn(x, weight, bias)):
        assert torch.equal(c, e)


def test_compiled_fold_then_forward_equals_eager(device, make_inputs):
    x, weight, bias = make_inputs(12, 40, 30, torch.float32, device)
    grad_out = torch.randn(12, device=device)
    compiled = torch.compile(_fold_forward, backend=FAST_BACKEND, fullgraph=True)
    _assert_same(
        _run(compiled, x, weight, bias, grad_out, 4, 2.0),
        _run(_fold_forward, x, weight, bias, grad_out, 4, 2.0),
    )


def test_compiled_fold_then_forward_with_inductor_equals_eager(device, make_inputs):
    x, weight, bias = make_inputs(8, 24, 18, torch.float32, device)
    grad_out = torch.randn(8, device=device)
    compiled = torch.compile(_fold_forward, fullgraph=True)  # default backend: inductor
    _assert_same(
        _run(compiled, x, weight, bias, grad_out, 4, 2.0),
        _run(_fold_forward, x, weight, bias, grad_out, 4, 2.0),
    )


def test_compiled_model_new_equals_eager(device):
    torch.manual_seed(5)
    model = ModelNew(40, 30, 4, 2.0).to(device)
    compiled = torch.compile(model, backend=FAST_BACKEND, fullgraph=True)
    x = torch.randn(10, 40, device=device)
    out_c = compiled(x)
    out_c.sum().backward()
    grads_c = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    out_e = model(x)
    out_e.sum().backward()
    torch.testing.assert_close(out_c, out_e, atol=1e-5, rtol=1e-5)
    for c, e in zip(grads_c, (p.grad for p in model.parameters())):
        torch.testing.assert_close(c, e, atol=1e-5, rtol=1e-5)


def test_compiled_model_new_matches_model_under_no_grad(device):
    torch.manual_seed(6)
    reference = Model(40, 30, 4, 2.0).to(device)
    model = ModelNew.from_model(reference)
    compiled = torch.compile(model, backend=FAST_BACKEND, fullgraph=True)
    x = torch.rand(10, 40, device=device)

    def assert_matches_float64(out):
        expected = copy.deepcopy(reference).double()(x.double())
        tol = 1e-5  # float32 against the float64 reference, relative to the outputs' size
        torch.testing.assert_close(
            out.double(), expected, atol=tol * float(expected.abs().max()), rtol=tol
        )

    with torch.no_grad():
        assert_matches_float64(compiled(x))
        # The fold is part of the compiled graph: an in-place update is seen by the next call.
        model.matmul.weight.mul_(0.5)
        reference.matmul.weight.mul_(0.5)
        assert_matches_float64(compiled(x))


def test_compiled_model_new_with_inductor_equals_eager_forward():
    torch.manual_seed(7)
    model = ModelNew(24, 16, 4, 2.0)
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(6, 24)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)


class _LinearTimesTwo(torch.nn.Linear):
    """A Linear subclass with its own forward (as LoRA or quantized layers have)."""

    def forward(self, x):
        return 2.0 * super().forward(x)


def _hooked(linear):
    linear.register_forward_hook(lambda module, args, out: out - 0.25)


def _own_forward(linear):
    linear.__class__ = _LinearTimesTwo


def _tensor_scale(module):
    module.scale_factor = torch.nn.Parameter(torch.tensor(1.5, device=module.matmul.weight.device))


@pytest.mark.parametrize("tracer", ["compile", "jit.trace"])
@pytest.mark.parametrize("modify", [_hooked, _own_forward, _tensor_scale],
                         ids=["forward-hook", "own-forward", "tensor-scale"])
def test_traced_model_new_runs_models_computation_where_the_fold_cannot(tracer, modify, device):
    # ModelNew's traced branch (torch.compile, torch.jit.trace) makes its own choice between the
    # fold and Model's computation: a hook or a subclass's forward on matmul, or a tensor
    # scale_factor (whose gradient Model computes), must not be folded away there either.
    torch.manual_seed(8)
    reference = Model(24, 16, 4, 2.0).to(device)
    model = ModelNew.from_model(reference)
    modify(reference if modify is _tensor_scale else reference.matmul)
    modify(model if modify is _tensor_scale else model.matmul)
    x = torch.rand(6, 24, device=device)
    if tracer == "compile":
        traced = torch.compile(model, backend=FAST_BACKEND)
    else:
        traced = torch.jit.trace(model, x, check_trace=False)
    out = traced(x)
    expected = reference(x)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    out.sum().backward()
    expected.sum().backward()
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, reference.get_parameter(name).grad,
                                   atol=1e-6, rtol=1e-6, msg=name)


def test_compiled_with_dynamic_shapes_serves_several_batch_sizes(device, make_inputs):
    _, weight, bias = make_inputs(1, 40, 30, torch.float32, device)
    compiled = torch.compile(_fold_forward, backend=FAST_BACKEND, fullgraph=True, dynamic=True)
    for batch in (3, 7, 16):
        x = torch.randn(batch, 40, device=device)
        grad_out = torch.randn(batch, device=device)
        _assert_same(
            _run(compiled, x, weight, bias, grad_out, 4, 2.0),
            _run(_fold_forward, x, weight, bias, grad_out, 4, 2.0),
        )


def test_compile_reports_bad_shapes_while_tracing(device):
    fn = torch.compile(
        lambda x, w: ops.forward(x, w, None, 2.0), backend=FAST_BACKEND, fullgraph=True
    )
    # TorchRuntimeError: raised by the fake kernel while tracing. Without the fake kernel's check
    # the trace would pass and the eager kernel raise the same message as a plain RuntimeError.
    with pytest.raises(torch._dynamo.exc.TorchRuntimeError, match=r"in_features = x.size\(1\) = 8"):
        fn(torch.randn(4, 8, device=device), torch.randn(3, 7, device=device))
