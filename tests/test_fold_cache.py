"""The fold cache (fused_pool_gelu/_fold_cache.py): the paths that run ModelNew on unchanged
parameters fold once per parameter update — grad-enabled eager calls, torch.compile and
torch.export inference, jit.trace — and none of them serves a stale fold.

Folds are counted where they run, as fused_pool_gelu::fold calls seen by the profiler, so that a
fold inside a compiled graph counts as much as one made by the cache."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch.autograd import forward_ad
from torch.profiler import ProfilerActivity, profile

from fused_pool_gelu import Model, ModelNew, ops
from fused_pool_gelu import _fold_cache

IN_FEATURES, OUT_FEATURES, POOL, SCALE = 40, 30, 4, 2.0


@pytest.fixture(autouse=True)
def _fresh_dynamo_and_cache():
    torch._dynamo.reset()
    _fold_cache._ENTRIES.clear()  # counts must not depend on the tests before
    yield
    torch._dynamo.reset()


def _folds_run(fn, calls=3):
    """(fn's last result, the ops that fold executed over `calls` calls of fn: fold, and the
    training node's _model_forward_with_argmax)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            result = fn()
    folds = sum(1 for event in prof.events() if event.name in (
        "fused_pool_gelu::fold", "fused_pool_gelu::_model_forward_with_argmax"))
    return result, folds


def _models(device, seed=0):
    torch.manual_seed(seed)
    reference = Model(IN_FEATURES, OUT_FEATURES, POOL, SCALE).to(device)
    return reference, ModelNew.from_model(reference)


def _x(device, batch=10, requires_grad=False):
    return torch.rand(batch, IN_FEATURES, device=device).requires_grad_(requires_grad)


def _unfused_fold_forward(model, x):
    """The fold recorded in the graph at every call (what the cache must equal bit for bit)."""
    linear = model.matmul
    return ops.forward(x, *ops.fold(linear.weight, linear.bias, POOL), SCALE)


def _assert_matches_float64(out, reference, x):
    expected = copy.deepcopy(reference).double()(x.double())
    tol = 1e-5  # float32 against the float64 reference, relative to the outputs' size
    torch.testing.assert_close(out.double(), expected, atol=tol * float(expected.abs().max()),
                               rtol=tol)


# ----------------------------------------------------------------------------------------------
# Grad-enabled eager calls


def test_gradient_accumulation_folds_once_per_update_with_the_same_gradient_bits(device):
    _, model = _models(device)
    twin = copy.deepcopy(model)
    xs = [_x(device, requires_grad=True) for _ in range(3)]
    grad_outs = [torch.randn(10, device=device) for _ in range(3)]

    def accumulate(fn, module):
        module.zero_grad()
        grad_xs = []
        for x, grad_out in zip(xs, grad_outs):
            x = x.detach().clone().requires_grad_(True)
            fn(module, x).backward(grad_out)
            grad_xs.append(x.grad)
        return [p.grad.clone() for p in module.parameters()], grad_xs

    (grads, grad_xs), folds = _folds_run(lambda: accumulate(lambda m, x: m(x), model), calls=1)
    assert folds == 1
    expected_grads, expected_grad_xs = accumulate(_unfused_fold_forward, twin)
    for got, expected in zip(grads + grad_xs, expected_grads + expected_grad_xs):
        assert torch.equal(got, expected)

    # An optimizer step changes the parameters: the next forward folds again, once.
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    torch.optim.SGD(twin.parameters(), lr=0.1).step()
    x = _x(device)
    out, folds = _folds_run(lambda: model(x))
    assert folds == 1
    assert torch.equal(out, _unfused_fold_forward(twin, x))


@pytest.mark.cuda
@pytest.mark.parametrize("certified", ["1", "0"])
def test_training_after_evaluation_takes_the_prepared_copy_with_the_same_bits(
        certified, set_debug_knobs):
    # An evaluation call caches the prepared copy next to the fold; a training call then hands
    # both to model_forward, whose forward (certified where forced) gives the same bits as one
    # that prepares its own.
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    set_debug_knobs(FUSED_POOL_GELU_CERTIFIED=certified)
    _, model = _models("cuda")
    twin = copy.deepcopy(model)
    x = _x("cuda", batch=64)
    with torch.no_grad():
        model(x)
    assert _fold_cache.cached_fold(model.matmul.weight, model.matmul.bias, POOL)[2] is not None
    grad_out = torch.randn(64, device="cuda")
    out = model(x)
    out.backward(grad_out)
    expected = _unfused_fold_forward(twin, x)
    expected.backward(grad_out)
    assert torch.equal(out, expected)
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter.grad, twin.get_parameter(name).grad), name


@pytest.mark.parametrize("optimizer", ["adamw-fused", "sgd-for-loop", "adam-foreach"])
def test_every_optimizer_step_is_seen_fused_ones_included(device, optimizer):
    # A fused optimizer writes the parameters without bumping their version counters: the cache
    # counts optimizer steps too. After each step the grad-enabled and the no_grad forward both
    # give the bits of a fresh fold.
    _, model = _models(device)
    make = {"adamw-fused": lambda p: torch.optim.AdamW(p, lr=0.1, fused=True),
            "sgd-for-loop": lambda p: torch.optim.SGD(p, lr=0.1, foreach=False),
            "adam-foreach": lambda p: torch.optim.Adam(p, lr=0.1, foreach=True)}[optimizer]
    opt = make(model.parameters())
    x = _x(device)
    for _ in range(3):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        assert torch.equal(model(x), _unfused_fold_forward(model, x))
        with torch.no_grad():
            assert torch.equal(model(x), _unfused_fold_forward(model, x))


def test_evaluation_with_grad_enabled_reuses_the_training_fold(device):
    _, model = _models(device)
    model(_x(device)).sum().backward()
    out, folds = _folds_run(lambda: model(_x(device)))
    assert folds == 0 and out.requires_grad


def test_the_cached_fold_has_no_autograd_history(device):
    # Folded during a training call (grad mode on, parameters requiring grad): a graph node in the
    # entry would hold the parameters alive and send gradients nowhere.
    _, model = _models(device)
    model(_x(device)).sum().backward()
    for folded in model.folded_parameters():
        assert folded.grad_fn is None and not folded.requires_grad


@pytest.mark.parametrize("cache", ["miss", "hit"])
@pytest.mark.parametrize("parameter", ["weight", "bias"])
def test_a_forward_mode_tangent_on_the_parameters_is_refused_not_served_from_the_cache(
    parameter, cache, device
):
    # A dual tensor has its primal's storage and stamp: served the cached fold, the output's
    # tangent would be silently dropped.
    _, model = _models(device)
    model.requires_grad_(False)
    x = _x(device)
    if cache == "hit":
        model(x)
    else:
        model.invalidate_fold()
    primal = getattr(model.matmul, parameter)
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(primal, torch.randn_like(primal))
        with pytest.raises(RuntimeError, match=rf"fused_pool_gelu\.fold: {parameter} carries a "
                                               "forward-mode AD tangent"):
            torch.func.functional_call(model, {f"matmul.{parameter}": dual}, (x,))


def test_a_training_call_on_a_tensor_subclass_input_caches_a_plain_fold(device):
    # The node folds together with x on a miss; a subclass x would give the fold its type, and
    # every later call would be served subclass tensors.
    class Tagged(torch.Tensor):
        pass

    _, model = _models(device)
    x = _x(device)
    out = model(x.as_subclass(Tagged))
    assert type(out) is Tagged
    assert all(type(t) is torch.Tensor for t in model.folded_parameters())
    with torch.no_grad():
        assert type(model(x)) is torch.Tensor


def test_model_forward_checks_a_given_fold(device):
    x = _x(device)
    weight = torch.randn(OUT_FEATURES, IN_FEATURES, device=device)
    bias = torch.randn(OUT_FEATURES, device=device)
    pooled_weight, pooled_bias = ops.fold(weight, bias, POOL)
    out = ops.model_forward(x, weight, bias, POOL, SCALE, pooled_weight, pooled_bias)
    assert torch.equal(out, ops.forward(x, pooled_weight, pooled_bias, SCALE))
    cases = [
        ((pooled_weight, None), "pooled_weight and pooled_bias must be given together"),
        ((None, pooled_bias), "got only pooled_bias"),
        ((pooled_weight[1:], pooled_bias), r"pooled_weight must be fold's .* = \[7, 40\]"),
        ((pooled_weight, pooled_bias[1:]), r"pooled_bias must be fold's .* = \[7\]"),
        ((pooled_weight.double(), pooled_bias), "pooled_weight"),
        ((None, None, torch.zeros(8, dtype=torch.uint8, device=device)),
         "prepared_weight without pooled_weight"),
    ]
    for given, message in cases:
        with pytest.raises(RuntimeError, match=message):
            ops.model_forward(x, weight, bias, POOL, SCALE, *given)
    with pytest.raises(RuntimeError, match="pool_kernel_size must be >= 1"):
        ops.model_forward(x, weight, bias, 0, SCALE, pooled_weight, pooled_bias)


# ----------------------------------------------------------------------------------------------
# Traced inference: torch.compile, torch.export, jit.trace


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
def test_compiled_inference_folds_once_and_follows_updates(device, backend, grad_mode):
    reference, model = _models(device)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    context = torch.no_grad if grad_mode == "no_grad" else torch.inference_mode
    x = _x(device)
    with context():
        compiled(x)  # compiles
        out, folds = _folds_run(lambda: compiled(x))
        assert folds == 0
        _assert_matches_float64(out, reference, x)
        # An in-place update (version counter) is seen by the next call, folded once.
        model.matmul.weight.mul_(0.5)
        reference.matmul.weight.mul_(0.5)
        out, folds = _folds_run(lambda: compiled(x))
        assert folds == 1
        _assert_matches_float64(out, reference, x)


@pytest.mark.cuda
@pytest.mark.graphs
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_compiled_inference_with_cuda_graphs_follows_updates(mode):
    # inductor's CUDA graphs must not replay a fold cached when they were recorded: the op is
    # tagged cudagraph_unsafe, so it runs outside them.
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    reference, model = _models("cuda")
    compiled = torch.compile(model, mode=mode, fullgraph=True)
    x = _x("cuda", batch=64)
    with torch.no_grad():
        for step in range(4):
            out = compiled(x)
            _assert_matches_float64(out, reference, x)
            model.matmul.weight.mul_(0.5)
            reference.matmul.weight.mul_(0.5)


def test_compiled_inference_under_autocast_has_eager_s_dtype_and_bits(device):
    _, model = _models(device)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = _x(device)
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
        expected = model(x)
        out = compiled(x)
    assert out.dtype == expected.dtype == torch.bfloat16
    assert torch.equal(out, expected)


def test_compiled_inference_with_freezing_folds_once(device):
    reference, model = _models(device)
    compiled = torch.compile(model, fullgraph=True)
    x = _x(device)
    with torch.no_grad(), torch._inductor.config.patch(freezing=True):
        compiled(x)
        out, folds = _folds_run(lambda: compiled(x))
    assert folds == 0
    _assert_matches_float64(out, reference, x)


def test_compiled_training_keeps_the_fold_in_the_graph_and_its_gradients(device):
    _, model = _models(device)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = _x(device, requires_grad=True)
    compiled(x)  # compiles
    (out, folds) = _folds_run(lambda: compiled(x), calls=2)
    assert folds == 2  # one per call: a training graph folds in the graph
    out.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x.detach()).sum().backward()
    for got, expected in zip(grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("export_grad_mode", ["no_grad", "grad"])
def test_exported_model_new_folds_once_and_follows_updates(device, export_grad_mode):
    reference, model = _models(device)
    x = _x(device)
    if export_grad_mode == "no_grad":
        with torch.no_grad():
            exported = torch.export.export(model, (x,))
    else:
        exported = torch.export.export(model, (x,))
    module = exported.module()
    with torch.no_grad():
        module(x)
        out, folds = _folds_run(lambda: module(x))
        assert folds == 0
        _assert_matches_float64(out, reference, x)
        module.get_parameter("matmul.weight").mul_(0.5)
        reference.matmul.weight.mul_(0.5)
        out, folds = _folds_run(lambda: module(x))
        assert folds == 1
        _assert_matches_float64(out, reference, x)


def test_exported_model_new_trains_with_model_new_s_gradients(device):
    _, model = _models(device)
    x = _x(device)
    module = torch.export.export(model, (x,)).module()
    grad_out = torch.randn(10, device=device)
    module(x).backward(grad_out)
    model(x).backward(grad_out)
    for name, parameter in model.named_parameters():
        assert torch.equal(module.get_parameter(name).grad, parameter.grad), name


def test_jit_traced_model_new_follows_updates_without_refolding_per_call(device):
    reference, model = _models(device)
    x = _x(device)
    with torch.no_grad():
        traced = torch.jit.trace(model, (x,))
        out, folds = _folds_run(lambda: traced(x))
        assert folds == 0  # folded and cached while tracing, on the real parameters
        model.matmul.weight.mul_(0.5)
        reference.matmul.weight.mul_(0.5)
        out, folds = _folds_run(lambda: traced(x))
        assert folds == 1
        _assert_matches_float64(out, reference, x)


def test_aoti_package_of_an_exported_model_new_folds_once(tmp_path):
    # On the CPU: loading such a package built for CUDA has crashed inside torch's AOTInductor
    # loader (docs/training.md); a CUDA deployment exports FoldedModel instead.
    reference, model = _models("cpu")
    x = _x("cpu")
    with torch.no_grad():
        exported = torch.export.export(model, (x,))
    path = torch._inductor.aoti_compile_and_package(
        exported, package_path=str(tmp_path / "model_new.pt2"))
    runner = torch._inductor.aoti_load_package(path)
    with torch.no_grad():
        runner(x)
        out, folds = _folds_run(lambda: runner(x))
    assert folds == 0
    _assert_matches_float64(out, reference, x)


# ----------------------------------------------------------------------------------------------
# The cache itself


def test_an_entry_dies_with_its_parameters():
    _, model = _models("cpu")
    with torch.no_grad():
        model(_x("cpu"))
    storage = model.matmul.weight.untyped_storage()._cdata
    assert any(key[0] == storage for key in _fold_cache._ENTRIES)
    del model
    gc.collect()
    _, other = _models("cpu", seed=1)
    with torch.no_grad():
        other(_x("cpu"))  # a miss prunes the entries of freed storages
    assert not any(key[0] == storage for key in _fold_cache._ENTRIES)
    assert all(not ref.expired() for _, refs, _, _ in _fold_cache._ENTRIES.values()
               for ref in refs)


def test_a_parameter_update_keeps_the_entrys_references_and_prunes_freed_entries():
    # Refolding after an update (every training step) keeps the live storages' weak references
    # (no new ones per step) and still drops the entries of freed parameters.
    _, model = _models("cpu")
    _, other = _models("cpu", seed=1)
    with torch.no_grad():
        model(_x("cpu"))
        other(_x("cpu"))
    freed = model.matmul.weight.untyped_storage()._cdata
    key = next(k for k in _fold_cache._ENTRIES
               if k[0] == other.matmul.weight.untyped_storage()._cdata)
    refs = _fold_cache._ENTRIES[key][1]
    del model
    gc.collect()
    with torch.no_grad():
        other.matmul.weight.add_(1.0)
    other(_x("cpu", requires_grad=True)).sum().backward()  # a training step's miss
    assert not any(k[0] == freed for k in _fold_cache._ENTRIES)
    assert _fold_cache._ENTRIES[key][1] is refs
    with torch.no_grad():  # the entry the step made serves the next call
        _, folds = _folds_run(lambda: other(_x("cpu")), calls=1)
    assert folds == 0


def test_a_data_edit_is_served_stale_until_invalidate_fold(device):
    reference, model = _models(device)
    x = _x(device)
    with torch.no_grad():
        before = model(x)
        model.matmul.weight.data.mul_(0.5)  # bypasses the version counter, as documented
        reference.matmul.weight.data.mul_(0.5)
        assert torch.equal(model(x), before)  # stale, as documented
        model.invalidate_fold()
        _assert_matches_float64(model(x), reference, x)


def test_the_timed_training_step_folds_every_step_as_an_updating_one_does():
    # measure.training_step (what __main__ and bench_train time) updates no parameter: it bumps
    # their version counters each step, as an update does, so that the step timed costs what a
    # real one does.
    from fused_pool_gelu.measure import training_step

    _, model = _models("cpu")
    step = training_step(model, _x("cpu", requires_grad=True), list(model.parameters()))
    _, folds = _folds_run(step, calls=3)
    assert folds == 3
