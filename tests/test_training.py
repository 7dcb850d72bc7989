"""Training with ModelNew at scale: autocast, torch.compile, CUDA graphs, DDP over NCCL, and
examples/train.py under --amp. docs/training.md cites these tests by name.

Autocast's reference is Model under the same autocast: its nn.Linear computes in the autocast dtype
and everything after it stays there. ModelNew must give the same output dtype, values equal within
bf16/fp16 rounding, and float32 gradients on float32 parameters; the fold is not an autocast op
(a mean, like AvgPool1d) and stays float32.

Tests marked ``cuda`` need a GPU with the CUDA kernels and skip cleanly without one.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fused_pool_gelu
from fused_pool_gelu import Model, ModelNew, _fold_cache, ops

# (in_features, out_features, pool_kernel_size, scale_factor): an O % k tail of 2 rows.
ARGS = (64, 50, 4, 2.0)
# Autocast dtypes per device. CPU autocast takes float16 too; bfloat16 is what --amp uses.
AUTOCAST_CASES = [
    pytest.param("cpu", torch.bfloat16, id="cpu-bfloat16"),
    pytest.param("cpu", torch.float16, id="cpu-float16"),
    pytest.param("cuda", torch.bfloat16, id="cuda-bfloat16", marks=pytest.mark.cuda),
    pytest.param("cuda", torch.float16, id="cuda-float16", marks=pytest.mark.cuda),
]
# Autocast results are compared with atol = rtol = this, atol relative to the output's scale:
# both models round to an 8-bit (bf16) or 11-bit (fp16) mantissa, in different places.
AUTOCAST_TOLERANCE = 2e-2


def _pair(device, args=ARGS):
    """(Model, ModelNew) with equal parameters, float32, on device (built on the CPU first, so
    that the parameters do not depend on the device's random generator)."""
    reference = Model(*args)
    return reference.to(device), ModelNew.from_model(reference).to(device)


def _assert_close_at_scale(actual, expected, tol):
    scale = expected.detach().abs().max().clamp_min(1e-6).item()
    torch.testing.assert_close(
        actual.detach().float(), expected.detach().float(), atol=tol * scale, rtol=tol
    )


def _clear_maximum_rows(model, x, margin=0.05):
    """The rows of x whose largest pooled value beats the second by `margin` (relative), in
    float64: rounding to bf16 cannot change their arg-max, so gradients can be compared."""
    reference = copy.deepcopy(model).double()
    with torch.no_grad():
        z = reference.matmul(x.double())
        pooled = F.avg_pool1d(z.unsqueeze(1), reference.avg_pool.kernel_size).squeeze(1)
        values = F.gelu(pooled) * reference.scale_factor
    top = values.topk(2, dim=1).values
    clear = (top[:, 0] - top[:, 1]) > margin * top[:, 0].abs().clamp_min(1e-3)
    return x[clear]


# ----------------------------------------------------------------------------------------------
# Autocast: ModelNew behaves as Model does under the same autocast


@pytest.mark.parametrize("device,dtype", AUTOCAST_CASES)
def test_autocast_output_dtype_and_values_match_model(device, dtype):
    model, new = _pair(device)
    x = torch.rand(32, ARGS[0]).to(device)
    with torch.autocast(device, dtype=dtype):
        expected = model(x)
        out = new(x)
    assert expected.dtype == dtype
    assert out.dtype == expected.dtype
    _assert_close_at_scale(out, expected, AUTOCAST_TOLERANCE)


@pytest.mark.parametrize("device,dtype", AUTOCAST_CASES)
def test_autocast_gradients_are_float32_and_match_model(device, dtype):
    model, new = _pair(device)
    x = _clear_maximum_rows(model, torch.rand(96, ARGS[0], device=device))
    assert x.shape[0] >= 8, "the data must give enough rows with a clear arg-max"
    # Positive upstream gradients: no cancellation in the per-group sums of the weight gradient.
    grad_out = (torch.rand(x.shape[0]) + 0.5).to(device)
    inputs = {}
    for name, module in (("model", model), ("new", new)):
        inputs[name] = x.clone().requires_grad_(True)
        with torch.autocast(device, dtype=dtype):
            out = module(inputs[name])
        out.float().backward(grad_out)
    for p_ref, p_new in zip(model.parameters(), new.parameters()):
        assert p_new.dtype == torch.float32 and p_new.grad.dtype == torch.float32
        _assert_close_at_scale(p_new.grad, p_ref.grad, AUTOCAST_TOLERANCE)
    assert inputs["new"].grad.dtype == torch.float32
    _assert_close_at_scale(inputs["new"].grad, inputs["model"].grad, AUTOCAST_TOLERANCE)


@pytest.mark.parametrize("device,dtype", AUTOCAST_CASES)
def test_autocast_forward_equals_forward_on_inputs_cast_to_the_autocast_dtype(
    device, dtype, make_inputs
):
    x, weight, bias = make_inputs(24, 40, 30, torch.float32, device)
    pooled_weight, pooled_bias = ops.fold(weight, bias, 3)
    with torch.autocast(device, dtype=dtype):
        out, argmax, pre = ops.forward_with_argmax(x, pooled_weight, pooled_bias, 2.0)
        out_only = ops.forward(x, pooled_weight, pooled_bias, 2.0)
    cast = [t.to(dtype) for t in (x, pooled_weight, pooled_bias)]
    expected_out, expected_argmax, expected_pre = ops.forward_with_argmax(*cast, 2.0)
    assert out.dtype == pre.dtype == out_only.dtype == dtype and argmax.dtype == torch.int64
    assert torch.equal(out, expected_out) and torch.equal(out_only, expected_out)
    assert torch.equal(argmax, expected_argmax) and torch.equal(pre, expected_pre)


@pytest.mark.parametrize("device,dtype", AUTOCAST_CASES)
def test_autocast_accepts_inputs_of_mixed_floating_dtypes_like_linear(device, dtype, make_inputs):
    # nn.Linear under autocast takes a bf16 x with float32 weights: both are cast.
    x, weight, bias = make_inputs(8, 40, 30, torch.float32, device)
    pooled_weight, pooled_bias = ops.fold(weight, bias, 3)
    other = torch.bfloat16 if dtype == torch.float16 else torch.float16
    with torch.autocast(device, dtype=dtype):
        out = ops.forward(x.to(other), pooled_weight, pooled_bias, 2.0)
    cast = [t.to(dtype) for t in (x.to(other), pooled_weight, pooled_bias)]
    expected = ops.forward(*cast, 2.0)
    assert out.dtype == dtype and torch.equal(out, expected)


def test_autocast_leaves_a_float64_model_in_float64_like_model():
    # Autocast casts float32 (and half) inputs only: Model in float64 stays float64 under it,
    # because nn.Linear's autocast leaves float64 tensors alone.
    model, new = _pair("cpu")
    model, new = model.double(), new.double()
    x = torch.rand(16, ARGS[0], dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
        out = new(x)
    assert expected.dtype == torch.float64
    assert out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-10)


def test_autocast_gradients_equal_those_of_explicit_casts():
    # The autocast kernel is a cast followed by the op, so autograd sees exactly that: gradients
    # flow back through the casts to the float32 parameters and x.
    _, new = _pair("cpu")
    x = torch.rand(32, ARGS[0])
    grad_out = torch.randn(32)

    x_auto = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        new(x_auto).float().backward(grad_out)
    auto_grads = [p.grad.clone() for p in new.parameters()]
    new.zero_grad(set_to_none=True)

    x_cast = x.clone().requires_grad_(True)
    pooled_weight, pooled_bias = ops.fold(new.matmul.weight, new.matmul.bias, ARGS[2])
    bf16 = [t.to(torch.bfloat16) for t in (x_cast, pooled_weight, pooled_bias)]
    ops.forward(*bf16, ARGS[3]).float().backward(grad_out)
    for auto, explicit in zip(auto_grads, (p.grad for p in new.parameters())):
        assert torch.equal(auto, explicit)
    assert torch.equal(x_auto.grad, x_cast.grad)


@pytest.mark.parametrize("device,dtype", AUTOCAST_CASES)
def test_autocast_model_forward_equals_fold_then_forward_under_autocast(device, dtype, make_inputs):
    # ModelNew's eager training path under autocast: outputs and gradients bit for bit those of the
    # ops one by one (float32 fold, then the fused op's autocast cast).
    x, weight, bias = make_inputs(24, 40, 30, torch.float32, device)
    grad_out = torch.randn(24, device=device)
    results = []
    for fused in (True, False):
        leaves = [t.clone().requires_grad_(True) for t in (x, weight, bias)]
        with torch.autocast(device, dtype=dtype):
            if fused:
                out = ops.model_forward(*leaves, 3, 2.0)
            else:
                out = ops.forward(leaves[0], *ops.fold(leaves[1], leaves[2], 3), 2.0)
        out.float().backward(grad_out)
        results.append([out, *(leaf.grad for leaf in leaves)])
    assert results[0][0].dtype == dtype
    for a, b in zip(*results):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("device,dtype", AUTOCAST_CASES)
def test_fold_is_not_autocast_and_stays_float32_like_avg_pool1d(device, dtype, make_inputs):
    _, weight, bias = make_inputs(1, 40, 30, torch.float32, device)
    expected = ops.fold(weight, bias, 3)
    with torch.autocast(device, dtype=dtype):
        pooled = ops.fold(weight, bias, 3)
        avg_pooled = F.avg_pool1d(weight.t().unsqueeze(0), 3)  # the reference's pooling op
    assert avg_pooled.dtype == torch.float32
    for got, want in zip(pooled, expected):
        assert got.dtype == torch.float32 and torch.equal(got, want)


@pytest.mark.parametrize("device,dtype", AUTOCAST_CASES)
@pytest.mark.parametrize("grad_mode", ["training", "no_grad"])
def test_model_new_folds_in_float32_under_autocast(device, dtype, grad_mode, monkeypatch):
    # What ModelNew passes to the fused op under autocast: float32 pooled parameters (folded in
    # the graph when training, from the cache otherwise), which the op's autocast kernel casts.
    _, new = _pair(device)
    folded, seen = [], []
    real_forward = ops.forward

    def recording(real_fold):
        def recording_fold(*args):
            result = real_fold(*args)
            folded.append(tuple(t.dtype for t in result))
            return result
        return recording_fold

    def recording_forward(x, weight, bias, scale, prepared_weight=None):
        seen.append((weight.dtype, bias.dtype))
        return real_forward(x, weight, bias, scale, prepared_weight)

    # The public op (the training graph's fold) and the op the cache calls.
    monkeypatch.setattr(fused_pool_gelu.ops, "fold", recording(ops.fold))
    monkeypatch.setattr(_fold_cache, "_FOLD", recording(_fold_cache._FOLD))
    monkeypatch.setattr(fused_pool_gelu.ops, "forward", recording_forward)
    x = torch.rand(8, ARGS[0]).to(device)
    with torch.autocast(device, dtype=dtype), torch.set_grad_enabled(grad_mode == "training"):
        out = new(x)
    assert out.dtype == dtype
    assert folded == [(torch.float32, torch.float32)]
    assert seen == [(torch.float32, torch.float32)]


def test_compiled_model_new_under_autocast_equals_eager():
    torch._dynamo.reset()
    try:
        _, new = _pair("cpu")
        compiled = torch.compile(new, backend="aot_eager", fullgraph=True)
        x = torch.rand(16, ARGS[0])
        grads = []
        for module in (compiled, new):
            new.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = module(x)
            out.float().sum().backward()
            grads.append((out.detach(), [p.grad.clone() for p in new.parameters()]))
    finally:
        torch._dynamo.reset()
    (out_c, grads_c), (out_e, grads_e) = grads
    assert out_c.dtype == out_e.dtype == torch.bfloat16
    assert torch.equal(out_c, out_e)
    for c, e in zip(grads_c, grads_e):
        assert torch.equal(c, e)


# ----------------------------------------------------------------------------------------------
# CUDA graphs: a whole training step captured and replayed equals the same steps run eagerly

GRAPH_ARGS = (256, 520, 16, 2.0)  # 32 pooling groups and an 8-row tail
GRAPH_BATCH = 64
GRAPH_REPLAYS = 5

OPTIMIZERS = {
    "sgd_foreach": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True),
    "adam_capturable": lambda params: torch.optim.Adam(params, lr=1e-2, capturable=True),
}


def _batches(count, device="cuda"):
    """`count` fresh (x, target) pairs, drawn on the CPU."""
    return [
        (torch.rand(GRAPH_BATCH, GRAPH_ARGS[0]).to(device), torch.rand(GRAPH_BATCH).to(device))
        for _ in range(count)
    ]


def _eager_step(model, optimizer, x, target):
    optimizer.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(x), target)
    loss.backward()
    optimizer.step()
    return loss.detach()


@pytest.mark.cuda
@pytest.mark.graphs
@pytest.mark.parametrize("optimizer_name", list(OPTIMIZERS))
@pytest.mark.parametrize("zero_grad", ["none_before_capture", "in_place_in_graph"])
def test_cuda_graph_replays_of_a_training_step_equal_eager_steps(optimizer_name, zero_grad):
    # The "whole network capture" recipe of the PyTorch CUDA semantics notes. Gradients either
    # are set to None before capture (the recipe: backward allocates them from the graph's pool and
    # every replay overwrites them), or are static tensors zeroed in place inside the graph.
    make_optimizer = OPTIMIZERS[optimizer_name]
    model = ModelNew(*GRAPH_ARGS).cuda()
    optimizer = make_optimizer(model.parameters())
    warm_up, replayed = _batches(3), _batches(GRAPH_REPLAYS)
    static_x, static_target = (t.clone() for t in warm_up[0])

    def step():
        if zero_grad == "in_place_in_graph":
            optimizer.zero_grad(set_to_none=False)
        loss = F.mse_loss(model(static_x), static_target)
        loss.backward()
        optimizer.step()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x, target in warm_up:  # real optimizer steps: they initialize the optimizer's state
            static_x.copy_(x)
            static_target.copy_(target)
            optimizer.zero_grad(set_to_none=True)
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    # The eager twin starts where the graphed model is now (parameters and optimizer state).
    twin = copy.deepcopy(model)
    twin_optimizer = make_optimizer(twin.parameters())
    # (a deep copy: load_state_dict keeps tensors already on the right device and dtype, so the
    # two optimizers would otherwise share their momentum buffers)
    twin_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))

    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=zero_grad == "none_before_capture")
    with torch.cuda.graph(graph):
        static_loss = step()

    for x, target in replayed:
        static_x.copy_(x)
        static_target.copy_(target)
        graph.replay()
        graph_loss = static_loss.clone()
        eager_loss = _eager_step(twin, twin_optimizer, x, target)
        torch.testing.assert_close(graph_loss, eager_loss, atol=1e-5, rtol=1e-5)
    for (name, graphed), eager in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(graphed, eager, atol=1e-5, rtol=1e-5, msg=name)


def _fold_and_forward(model, x):
    """ModelNew's forward written with the ops: the fold runs on every call, no cache."""
    pooled_weight, pooled_bias = ops.fold(model.matmul.weight, model.matmul.bias,
                                          model.pool_kernel_size)
    return ops.forward(x, pooled_weight, pooled_bias, model.scale_factor)


def _sgd_like_update(model):
    """An in-place parameter update, as an optimizer step between evaluations makes."""
    with torch.no_grad():
        model.matmul.weight.mul_(0.5)
        model.matmul.bias.add_(0.1)


@pytest.mark.cuda
@pytest.mark.graphs
def test_captured_training_step_runs_model_forward_and_replays_the_eager_gradients(
    capture_graph, monkeypatch
):
    # Captured, training takes the eager path (model_forward, whose backward is model_backward),
    # not the two ops that torch.compile traces; a replay gives the eager step's gradients, bits.
    model = ModelNew(*GRAPH_ARGS).cuda()
    static_x = torch.rand(GRAPH_BATCH, GRAPH_ARGS[0]).cuda()
    calls = []
    real_model_forward = fused_pool_gelu.ops.model_forward

    def recording_model_forward(*args):
        calls.append(torch.cuda.is_current_stream_capturing())
        return real_model_forward(*args)

    def step():
        model.zero_grad(set_to_none=True)
        model(static_x).sum().backward()
        return [p.grad for p in model.parameters()]

    monkeypatch.setattr(fused_pool_gelu.ops, "model_forward", recording_model_forward)
    graph, static_grads = capture_graph(step)
    assert calls[-1] is True  # the captured forward
    graph.replay()
    replayed = [g.clone() for g in static_grads]
    eager = step()
    for got, want in zip(replayed, eager):
        assert torch.equal(got, want)


@pytest.mark.cuda
@pytest.mark.graphs
def test_cuda_graph_of_fold_and_forward_under_no_grad_follows_parameter_updates(capture_graph):
    # Evaluation between training steps: capture the ops, fold included, not ModelNew's cache.
    model = ModelNew(*GRAPH_ARGS).cuda()
    static_x = torch.rand(GRAPH_BATCH, GRAPH_ARGS[0]).cuda()
    with torch.no_grad():
        graph, static_out = capture_graph(lambda: _fold_and_forward(model, static_x))
        for _ in range(2):
            _sgd_like_update(model)
            graph.replay()
            assert torch.equal(static_out, _fold_and_forward(model, static_x))


@pytest.mark.cuda
@pytest.mark.graphs
def test_cuda_graph_replays_of_a_no_grad_model_new_forward_follow_parameter_updates(capture_graph):
    # While a stream is capturing, ModelNew folds inside the graph instead of using its cache
    # (Python state that replays would not run), so each replay refolds the current parameters.
    model = ModelNew(*GRAPH_ARGS).cuda()
    static_x = torch.rand(GRAPH_BATCH, GRAPH_ARGS[0]).cuda()
    with torch.no_grad():
        graph, static_out = capture_graph(lambda: model(static_x))
        graph.replay()
        before_update = static_out.clone()
        _sgd_like_update(model)
        graph.replay()
        assert not torch.equal(static_out, before_update)
        torch.testing.assert_close(
            static_out, _fold_and_forward(model, static_x), atol=1e-6, rtol=1e-6
        )


@pytest.mark.cuda
@pytest.mark.graphs
def test_eager_no_grad_call_after_capturing_a_no_grad_forward_gives_the_right_output():
    # The parameters changed since the warm-up, so the capture misses the cache and records a
    # fold, whose kernel does not run until the first replay: the eager call after it must not be
    # served those not-yet-computed pooled weights.
    model = ModelNew(*GRAPH_ARGS).cuda()
    static_x = torch.rand(GRAPH_BATCH, GRAPH_ARGS[0]).cuda()
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                model(static_x)
        torch.cuda.current_stream().wait_stream(side)
        _sgd_like_update(model)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model(static_x)
        out = model(static_x)
        expected = _fold_and_forward(model, static_x)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)


def _has_triton():
    try:
        from torch.utils._triton import has_triton
    except ImportError:
        return False
    return has_triton()


@pytest.mark.cuda
def test_reduce_overhead_compiled_training_steps_equal_eager_steps():
    if not _has_triton():
        pytest.skip("torch.compile's inductor needs triton on CUDA, and it is not installed")
    torch._dynamo.reset()
    try:
        model = ModelNew(*GRAPH_ARGS).cuda()
        twin = copy.deepcopy(model)
        compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
        optimizer = OPTIMIZERS["sgd_foreach"](model.parameters())
        twin_optimizer = OPTIMIZERS["sgd_foreach"](twin.parameters())
        for x, target in _batches(6):  # warm-up, recording, then replays of the CUDA graphs
            torch.compiler.cudagraph_mark_step_begin()
            compiled_loss = _eager_step(compiled, optimizer, x, target).clone()
            eager_loss = _eager_step(twin, twin_optimizer, x, target)
            torch.testing.assert_close(compiled_loss, eager_loss, atol=1e-5, rtol=1e-5)
        for (name, trained), eager in zip(model.named_parameters(), twin.parameters()):
            torch.testing.assert_close(trained, eager, atol=1e-5, rtol=1e-5, msg=name)
    finally:
        torch._dynamo.reset()


# ----------------------------------------------------------------------------------------------
# DistributedDataParallel over NCCL (one GPU, world_size 1): NCCL and the ops work together.
# The 2-process gloo version is test_model.py::test_ddp_gradients_equal_single_process_gradients.


@pytest.fixture
def nccl_world_of_one(tmp_path):
    if not dist.is_available() or not dist.is_nccl_available():
        pytest.skip("torch.distributed was built without NCCL")
    if dist.is_initialized():
        pytest.skip("a default process group is already initialized in this process")
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl",
        init_method=f"file://{tmp_path}/rendezvous",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=60),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
def test_ddp_over_nccl_gives_the_gradients_of_the_plain_module(nccl_world_of_one):
    plain = ModelNew(*ARGS).cuda()
    wrapped = copy.deepcopy(plain)
    ddp = torch.nn.parallel.DistributedDataParallel(wrapped, device_ids=[0])
    x, target = torch.rand(32, ARGS[0]).cuda(), torch.rand(32).cuda()
    for module in (plain, ddp):
        F.mse_loss(module(x), target).backward()
    for (name, p), q in zip(plain.named_parameters(), wrapped.parameters()):
        assert q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=1e-6, msg=name)


# ----------------------------------------------------------------------------------------------
# examples/train.py --amp (tests/test_example.py covers the float32 and DDP runs)

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train.py"


def test_example_with_amp_trains_model_new_in_bfloat16_like_model(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    args = ["--device", "cpu", "--steps", "6", "--log-every", "3", "--batch", "16",
            "--in-features", "64", "--out-features", "100", "--pool", "8", "--compare", "--amp",
            # The default (0.1) covers the worst of 200 steps; these 6 differ by ~5e-3, and a 3%
            # error in ModelNew's output moves them to ~4e-2.
            "--tol", "0.02"]
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "--amp: output dtype ModelNew torch.bfloat16, Model torch.bfloat16" in result.stdout
    match = re.search(r"max relative loss difference ModelNew vs Model: (\S+) \(within --tol 0.02\)",
                      result.stdout)
    assert match, result.stdout
