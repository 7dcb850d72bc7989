"""ModelNew across processes: FSDP2, the PoolGroupParallel DTensor plan, both on a 2-D mesh, and
distributed checkpoints, each against the unsharded model as a specification.

Each world size runs ONE spawned job (process start and torch import cost seconds per rank on a
small machine): every rank runs every scenario below in order and records a traceback or None, and
each test asserts one scenario's record. A scenario compares the distributed model with the
unsharded ModelNew (and Model) on the same parameters and data, which every rank builds from the
same seed.

Shapes are chosen so that DTensor's row split both keeps whole pooling groups and cuts them (the
ranks then borrow rows), leaves some rank without any group, and puts an O % k tail at the end.
"""

from __future__ import annotations

import contextlib
import copy
import faulthandler
import json
import operator
import runpy
import traceback
import warnings
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fused_pool_gelu
from fused_pool_gelu import Model, ModelNew, _autograd, _fold_cache

BATCH, IN_FEATURES, POOL, SCALE, TAIL = 16, 24, 4, 2.0, 3
# A rank stuck in a collective (because another failed) gives up after this long.
COLLECTIVE_TIMEOUT_S = 30
# As conftest's tolerance of bfloat16 against float64, for FSDP2's bfloat16 mixed precision.
BFLOAT16_TOLERANCE = 1e-2


def _split_shapes(world_size):
    """(out_features, pool_kernel_size) that DTensor's Shard(0) split (ceil(O / world_size) rows
    per rank) cuts between groups, with a tail; cuts inside groups, so that ranks borrow rows
    (at 4 ranks: three ranks lend to one); and leaves a rank with tail rows only."""
    return [
        (2 * world_size * POOL + TAIL if world_size == 1 else 2 * world_size * POOL, POOL),
        ((2 * world_size + 1) * POOL + TAIL, POOL),
        (12, 5),
    ]


def _out_features(world_size):
    return (2 * world_size + 1) * POOL + TAIL


def _tolerance(dtype):
    # As conftest's for a dtype against float64: the sharded and unsharded sums differ only in
    # their order (per rank, then across ranks), a few ulps.
    return {torch.float64: 1e-10, torch.float32: 1e-5}[dtype]


def _models(ctx, out_features=None, pool=POOL, dtype=None, seed=0):
    """(Model, ModelNew) with equal parameters, the same on every rank."""
    torch.manual_seed(seed)
    out_features = _out_features(ctx.world_size) if out_features is None else out_features
    reference = Model(IN_FEATURES, out_features, pool, SCALE)
    reference = reference.to(device=ctx.device, dtype=dtype or ctx.dtype)
    return reference, ModelNew.from_model(reference)


def _inputs(ctx, dtype=None, batch=BATCH, seed=1):
    """x [B, K] and an upstream gradient [B], the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(batch, IN_FEATURES, generator=generator, dtype=torch.float64)
    grad_out = torch.randn(batch, generator=generator, dtype=torch.float64)
    return x.to(ctx.device, dtype or ctx.dtype), grad_out.to(ctx.device, dtype or ctx.dtype)


def _plan(model, mesh, **kwargs):
    from torch.distributed.tensor.parallel import parallelize_module

    from fused_pool_gelu.parallel import PoolGroupParallel

    return parallelize_module(model, mesh, PoolGroupParallel(**kwargs))


def _full(tensor):
    """A DTensor made whole (a collective), a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _run(model, x, grad_out):
    """(out, grad_x) of model on a fresh leaf copy of x; parameter grads land on the model."""
    x = x.clone().requires_grad_(True)
    out = model(x)
    out.backward(grad_out)
    return out.detach(), x.grad


def _assert_matches_unsharded(sharded, full, x, grad_out, tol, equal_nan=False):
    """Same output, x grad and (made whole) parameter grads as `full`; the grads of DTensor
    parameters are DTensors placed as the parameters. Returns _path_taken's counts of `sharded`."""
    with _path_taken() as counts:
        out, grad_x = _run(sharded, x, grad_out)
    expected_out, expected_grad_x = _run(full, x, grad_out)
    close = dict(atol=tol, rtol=tol, equal_nan=equal_nan)
    torch.testing.assert_close(out, expected_out, **close)
    torch.testing.assert_close(grad_x, expected_grad_x, **close)
    for name, parameter in sharded.named_parameters():
        grad = parameter.grad
        if hasattr(parameter, "placements"):
            assert grad.placements == parameter.placements, name
            assert grad.to_local().shape == parameter.to_local().shape, name
        torch.testing.assert_close(_full(grad), full.get_parameter(name).grad, **close)
    return counts


@contextlib.contextmanager
def _path_taken():
    """Counts the folds of ModelNew's fused path (the plan's included) and the calls of Model's
    computation. A fold is counted at the ops that fold: ops.fold, the fold cache's own fold call,
    and the training node's _model_forward_with_argmax, or, with the C++ node (which calls it from
    C++), ModelNew's call of that node after a parameter update (model_forward_and_fold)."""
    counts = {"fused": 0, "reference": 0}
    patched = [(fused_pool_gelu.ops, "fold"), (_fold_cache, "_FOLD"),
               (_autograd, "_model_forward_with_argmax")]
    if _autograd.MODEL_FORWARD_NODE is not None:
        patched.append((_autograd, "model_forward_and_fold"))
    real = {(module, name): getattr(module, name) for module, name in patched}
    real_reference = ModelNew._reference_forward

    def counting(module, name):
        def call(*args, **kwargs):
            counts["fused"] += 1
            return real[module, name](*args, **kwargs)
        return call

    def reference(self, *args, **kwargs):
        counts["reference"] += 1
        return real_reference(self, *args, **kwargs)

    try:
        for module, name in patched:
            setattr(module, name, counting(module, name))
        ModelNew._reference_forward = reference
        yield counts
    finally:
        for (module, name), function in real.items():
            setattr(module, name, function)
        ModelNew._reference_forward = real_reference


def _parts(ctx, out_features, pool=POOL):
    from fused_pool_gelu.parallel import _parts

    return _parts(out_features, pool, ctx.world_size)


# ----------------------------------------------------------------------------------------------
# Scenarios: each runs on every rank with ctx (device, dtype, world_size, rank, mesh, directory);
# float64 on the CPU, float32 on CUDA.

SCENARIOS = {}


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


# PoolGroupParallel: tensor parallelism as a DTensor plan.


@scenario
def plan_places_parameters_as_dtensor_shard0_rows(ctx):
    from torch.distributed.tensor import DTensor, Shard

    for out_features, pool in _split_shapes(ctx.world_size):
        _, full = _models(ctx, out_features, pool)
        expected = {name: p.detach().clone() for name, p in full.named_parameters()}
        sharded = _plan(full, ctx.mesh)
        rows = _parts(ctx, out_features, pool)[ctx.rank].rows
        chunk = -(-out_features // ctx.world_size)  # torch.chunk's sizes, the last ones fewer
        assert rows.start == min(ctx.rank * chunk, out_features)
        assert len(rows) == max(0, min(chunk, out_features - ctx.rank * chunk))
        for name, parameter in sharded.named_parameters():
            assert isinstance(parameter, DTensor) and parameter.placements == (Shard(0),), name
            assert torch.equal(parameter.to_local(), expected[name][rows.start : rows.stop]), name
            assert torch.equal(parameter.full_tensor(), expected[name]), name


@scenario
def plan_forward_and_gradients_match_model_new(ctx):
    for out_features, pool in _split_shapes(ctx.world_size):
        _, full = _models(ctx, out_features, pool)
        x, grad_out = _inputs(ctx)
        # Each group the split cuts (its rows on two or more ranks) is made to win some rows, so
        # that the rows borrowed for it count in the output and get gradients: a weight of 5 on
        # feature i, which only every (len(cut) + 1)-th row of x holds.
        parts = _parts(ctx, out_features, pool)
        cut = sorted({part.rows.start // pool for part in parts if part.lent})
        x[:, : len(cut)] = 0
        with torch.no_grad():
            for i, group in enumerate(cut):
                full.matmul.weight[group * pool : (group + 1) * pool, i] += 5
                x[i :: len(cut) + 1, i] = 1
        _, argmax, _ = torch.ops.fused_pool_gelu.forward_with_argmax(
            x, *full.folded_parameters(), SCALE)
        assert set(cut) <= set(argmax.tolist()), (cut, argmax)
        sharded = _plan(copy.deepcopy(full), ctx.mesh)
        counts = _assert_matches_unsharded(sharded, full, x, grad_out, _tolerance(ctx.dtype))
        # A rank with no group (only tail rows) has nothing to fold.
        folds = 1 if parts[ctx.rank].groups else 0
        assert counts == {"fused": folds, "reference": 0}, counts


@scenario
def plan_forward_and_gradients_match_model(ctx):
    reference, new = _models(ctx)
    sharded = _plan(new, ctx.mesh)
    x, grad_out = _inputs(ctx)
    _assert_matches_unsharded(sharded, reference, x, grad_out, _tolerance(ctx.dtype))


@scenario
def plan_compiled_matches_model_new(ctx):
    # torch.compile of the planned model traces the sharded forward (local fold, borrowed rows,
    # the arg-max across ranks), not a fold of the DTensor parameters.
    for out_features, pool in _split_shapes(ctx.world_size):
        torch._dynamo.reset()
        _, full = _models(ctx, out_features, pool)
        x, grad_out = _inputs(ctx)
        sharded = _plan(copy.deepcopy(full), ctx.mesh)
        compiled = torch.compile(sharded, backend="aot_eager")
        out, grad_x = _run(compiled, x, grad_out)
        expected_out, expected_grad_x = _run(full, x, grad_out)
        close = dict(atol=_tolerance(ctx.dtype), rtol=_tolerance(ctx.dtype))
        torch.testing.assert_close(out, expected_out, **close)
        torch.testing.assert_close(grad_x, expected_grad_x, **close)
        for name, parameter in sharded.named_parameters():
            torch.testing.assert_close(_full(parameter.grad), full.get_parameter(name).grad,
                                       **close)
    torch._dynamo.reset()


@scenario
def plan_float32_and_without_bias_match(ctx):
    for bias in (True, False):
        _, full = _models(ctx, dtype=torch.float32)
        if not bias:
            full.matmul.bias = None
        sharded = _plan(copy.deepcopy(full), ctx.mesh)
        assert (sharded.matmul.bias is None) == (not bias)
        x, grad_out = _inputs(ctx, torch.float32)
        _assert_matches_unsharded(sharded, full, x, grad_out, _tolerance(torch.float32))


@scenario
def plan_exact_ties_across_ranks_go_to_the_smallest_global_index(ctx):
    # Small integers make every dot product and group mean exact, so duplicated groups tie exactly
    # whatever order each rank's GEMM sums in. The duplicates (+3 everywhere, bias 2) beat every
    # other group (entries in [-2, 2]) on every row, since x >= 1.
    reference, full = _models(ctx)
    parts = [part for part in _parts(ctx, full.matmul.out_features) if part.groups]
    tied = [parts[0].groups.stop - 1] + [part.groups.start for part in parts[1:]]
    generator = torch.Generator().manual_seed(2)
    weight = torch.randint(-2, 3, tuple(full.matmul.weight.shape), generator=generator)
    bias = torch.randint(-2, 3, tuple(full.matmul.bias.shape), generator=generator)
    for group in tied:
        weight[group * POOL : (group + 1) * POOL] = 3
        bias[group * POOL : (group + 1) * POOL] = 2
    with torch.no_grad():
        for model in (reference, full):
            model.matmul.weight.copy_(weight)
            model.matmul.bias.copy_(bias)
    x = torch.randint(1, 3, (BATCH, IN_FEATURES), generator=generator).to(ctx.device, ctx.dtype)
    _, grad_out = _inputs(ctx)

    pooled_weight, pooled_bias = full.folded_parameters()
    _, argmax, _ = torch.ops.fused_pool_gelu.forward_with_argmax(
        x, pooled_weight, pooled_bias, SCALE
    )
    assert bool((argmax == tied[0]).all()), "the data must make the tied groups win every row"

    for unsharded in (full, reference):
        sharded = _plan(ModelNew.from_model(reference), ctx.mesh)
        _assert_matches_unsharded(sharded, unsharded, x, grad_out, _tolerance(ctx.dtype))
        grad_rows = sharded.matmul.weight.grad.full_tensor().abs().sum(dim=1)
        for group in tied:
            has_gradient = bool((grad_rows[group * POOL : (group + 1) * POOL] > 0).all())
            assert has_gradient == (group == tied[0]), f"group {group}: only {tied[0]} gets any"


@scenario
def plan_nan_rows_go_to_the_first_nan_and_send_it_the_gradient(ctx):
    _, full = _models(ctx)
    parts = [part for part in _parts(ctx, full.matmul.out_features) if part.groups]
    first_nan, last_nan = parts[-1].groups.start, parts[-1].groups.stop - 1
    if ctx.world_size > 1:
        first_nan = parts[1].groups.start
    with torch.no_grad():
        for group in (first_nan, last_nan):
            full.matmul.weight[group * POOL, 0] = float("nan")
    sharded = _plan(copy.deepcopy(full), ctx.mesh)
    x, grad_out = _inputs(ctx)
    _assert_matches_unsharded(sharded, full, x, grad_out, _tolerance(ctx.dtype), equal_nan=True)
    with torch.no_grad():
        assert bool(sharded(x).isnan().all())
    grad = sharded.matmul.weight.grad.full_tensor()
    if last_nan != first_nan:  # the later NaN group gets no gradient
        assert bool((grad[last_nan * POOL : (last_nan + 1) * POOL] == 0).all())


@scenario
def plan_autocast_forward_and_gradients_match_model_new(ctx):
    # Under bfloat16 autocast the op computes in bfloat16 (_autocast.autocast_cast): the shards'
    # output is bfloat16 like ModelNew's, and the backward, which sees the cast tensors, returns
    # float32 gradients for the float32 parameters and x.
    _, full = _models(ctx, dtype=torch.float32)
    sharded = _plan(copy.deepcopy(full), ctx.mesh)
    x, grad_out = _inputs(ctx, torch.float32)
    # The ranks compare their maxima as bfloat16 values, ModelNew its columns before rounding: a
    # row whose two best columns round to one bfloat16 value may take either arg-max. Such rows
    # (top two within 5%, in float64) get no upstream gradient, so that both agree on the rest.
    with torch.no_grad():
        pooled_weight, pooled_bias = full.folded_parameters()
        z = x.double() @ pooled_weight.double().T + pooled_bias.double()
        top_two = (torch.nn.functional.gelu(z) * SCALE).topk(2, dim=1).values
        clear = top_two[:, 0] - top_two[:, 1] > 0.05 * top_two[:, 0].abs()
    assert bool(clear.any())
    grad_out = torch.where(clear, grad_out, 0)
    results = []
    for model in (sharded, full):
        leaf = x.clone().requires_grad_(True)
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16):
            out = model(leaf)
        assert out.dtype == torch.bfloat16
        out.float().backward(grad_out)
        assert leaf.grad.dtype == model.matmul.weight.grad.dtype == torch.float32
        results.append((out.detach().float(), leaf.grad))
    # The same bfloat16 products per column on both; the shard's and the full model's float32
    # sums may still round differently to bfloat16.
    close = dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(results[0][0], results[1][0], **close)
    torch.testing.assert_close(results[0][1], results[1][1], **close)
    for name in ("weight", "bias"):
        torch.testing.assert_close(
            getattr(sharded.matmul, name).grad.full_tensor(),
            getattr(full.matmul, name).grad, **close)


@scenario
def plan_sgd_steps_and_evaluation_stay_equal_to_unsharded(ctx):
    # SGD with weight decay: the tail rows (never any gradient) must decay exactly as in ModelNew.
    # Written out rather than torch.optim.SGD, whose first step imports torch._dynamo (seconds per
    # rank on a small machine); the update is elementwise either way, on DTensors too.
    learning_rate, weight_decay = 0.5, 0.1
    _, full = _models(ctx)
    sharded = _plan(copy.deepcopy(full), ctx.mesh)
    tol = _tolerance(ctx.dtype)
    for step in range(3):
        x, target = _inputs(ctx, seed=10 + step)
        outs = []
        for model in (sharded, full):
            model.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), target)
            loss.backward()
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter -= learning_rate * (parameter.grad + weight_decay * parameter)
                outs.append((loss, model(x)))
        torch.testing.assert_close(outs[0], outs[1], atol=tol, rtol=tol)
    for name, value in full.state_dict().items():
        torch.testing.assert_close(_full(sharded.state_dict()[name]), value, atol=tol, rtol=tol)


@scenario
def plan_full_state_dict_round_trip_is_bitwise(ctx):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    _, full = _models(ctx)
    original = {key: value.clone() for key, value in full.state_dict().items()}
    sharded = _plan(copy.deepcopy(full), ctx.mesh)
    state = get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True))
    assert state.keys() == original.keys()
    for key in original:
        assert state[key].dtype == original[key].dtype, key
        assert torch.equal(state[key], original[key]), key
    gathered = ModelNew(IN_FEATURES, full.matmul.out_features, POOL, SCALE)
    gathered.load_state_dict(state)
    x, _ = _inputs(ctx)
    with torch.no_grad():
        torch.testing.assert_close(gathered.to(ctx.device, ctx.dtype)(x), full(x), atol=0, rtol=0)


@scenario
def plan_inside_a_larger_model_with_a_replicated_dtensor_output(ctx):
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from fused_pool_gelu.parallel import PoolGroupParallel

    _, full = _models(ctx)
    network = torch.nn.Sequential(torch.nn.Identity(), copy.deepcopy(full))
    parallelize_module(network, ctx.mesh, {"1": PoolGroupParallel(use_local_output=False)})
    x, _ = _inputs(ctx)
    with torch.no_grad():
        out = network(x)
        assert isinstance(out, DTensor) and out.placements == (Replicate(),)
        torch.testing.assert_close(out.to_local(), full(x), atol=_tolerance(ctx.dtype), rtol=0)
        # A DTensor x of another placement is made whole first.
        x_sharded = DTensor.from_local(x.chunk(ctx.world_size)[ctx.rank], ctx.mesh, [Shard(0)])
        torch.testing.assert_close(network(x_sharded).to_local(), out.to_local(), atol=0, rtol=0)


@scenario
def plan_x_that_differs_across_ranks_raises_on_every_rank(ctx):
    _, full = _models(ctx)
    sharded = _plan(full, ctx.mesh)
    x, _ = _inputs(ctx)
    if ctx.world_size > 1:
        mine = x[: BATCH // 2] if ctx.rank == 0 else x
        seen = rf"rank 0: \[{BATCH // 2}, {IN_FEATURES}\] .* rank 1: \[{BATCH}, {IN_FEATURES}\]"
        with pytest.raises(RuntimeError, match=r"every rank of the mesh must call the model with "
                                               r"x of the same shape, dtype and requires_grad, "
                                               r"got " + seen):
            sharded(mine)
        leaf = x.clone().requires_grad_(ctx.rank == 0)
        with pytest.raises(RuntimeError, match=r"requires_grad=True, rank 1: .* requires_grad="
                                               r"False"):
            sharded(leaf)
    wide = torch.rand(3, IN_FEATURES + 1, device=ctx.device, dtype=ctx.dtype)
    with pytest.raises(RuntimeError, match=rf"ModelNew: x must be \[batch, in_features\] = "
                                           rf"\[batch, {IN_FEATURES}\] \(matmul.in_features\), "
                                           rf"got shape \[3, {IN_FEATURES + 1}\]"):
        sharded(wide)
    with torch.no_grad():
        torch.testing.assert_close(sharded(x), full(x))  # every rank still in step


class _LinearTimesTwo(torch.nn.Linear):
    """A Linear subclass with its own forward (as LoRA or quantized layers have)."""

    def forward(self, x):
        return 2.0 * super().forward(x)


@scenario
def plan_refuses_what_the_shards_cannot_run(ctx):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from fused_pool_gelu.parallel import PoolGroupParallel

    plain = r"matmul must compute only x @ weight.T \+ bias"
    hooked, _ = _models(ctx)
    hooked = ModelNew.from_model(hooked)
    hooked.matmul.register_forward_hook(lambda module, args, out: out - 0.25)
    with pytest.raises(RuntimeError, match="PoolGroupParallel: " + plain):
        _plan(hooked, ctx.mesh)
    subclassed = ModelNew.from_model(_models(ctx)[0])
    subclassed.matmul.__class__ = _LinearTimesTwo
    with pytest.raises(RuntimeError, match=plain):
        _plan(subclassed, ctx.mesh)
    scaled = ModelNew.from_model(_models(ctx)[0])
    scaled.scale_factor = torch.nn.Parameter(torch.tensor(1.5, device=ctx.device, dtype=ctx.dtype))
    with pytest.raises(TypeError, match="scale_factor must be a Python number, got a Tensor"):
        _plan(scaled, ctx.mesh)
    with pytest.raises(TypeError, match="shards a fused_pool_gelu.ModelNew .*, got Model"):
        parallelize_module(_models(ctx)[0], ctx.mesh, PoolGroupParallel())
    if ctx.world_size % 2 == 0:
        mesh = init_device_mesh(ctx.device.type, (2, ctx.world_size // 2))
        with pytest.raises(ValueError, match="device_mesh must be 1-D"):
            _plan(ModelNew.from_model(_models(ctx)[0]), mesh)
    sharded = _plan(ModelNew.from_model(_models(ctx)[0]), ctx.mesh)
    with pytest.raises(ValueError, match="matmul.weight is a DTensor already"):
        _plan(sharded, ctx.mesh)
    x, _ = _inputs(ctx)
    handle = sharded.matmul.register_forward_pre_hook(lambda module, args: None)
    with pytest.raises(RuntimeError, match=r"ModelNew \(PoolGroupParallel\): " + plain):
        sharded(x)
    handle.remove()
    sharded(x)  # every rank, in step


# FSDP2 (fully_shard): data parallel with sharded parameters.


def _fully_shard(model, ctx, where, **kwargs):
    from torch.distributed.fsdp import fully_shard

    if where in ("matmul", "matmul and root"):
        fully_shard(model.matmul, mesh=ctx.mesh, **kwargs)
    if where in ("root", "matmul and root"):
        fully_shard(model, mesh=ctx.mesh, **kwargs)
    return model


def _data_parallel_step(model, x, grad_out, rank, world_size):
    """This rank's share of a data-parallel step: its chunk of the batch; FSDP averages the
    parameter gradients over the ranks."""
    out = model(x.chunk(world_size)[rank])
    out.backward(grad_out.chunk(world_size)[rank])
    return out.detach()


def _assert_fsdp_takes_the_fused_path_and_matches_model(ctx, compiled):
    # Wrapped at the root, at matmul (as setups that wrap every Linear do), or both: the same
    # outputs and averaged gradients as Model on the whole batch, through the fused ops; compiled,
    # FSDP's hooks on matmul run around the traced fold and forward, as in eager.
    from torch.distributed.tensor import DTensor, Shard

    reference, _ = _models(ctx)
    x, grad_out = _inputs(ctx)
    expected = reference(x)
    expected.backward(grad_out / ctx.world_size)
    tol = _tolerance(ctx.dtype)
    for where in ("root", "matmul", "matmul and root"):
        torch._dynamo.reset()
        model = _fully_shard(ModelNew.from_model(_models(ctx)[0]), ctx, where)
        run = torch.compile(model, backend="aot_eager") if compiled else model
        with warnings.catch_warnings(), _path_taken() as counts:
            warnings.simplefilter("error")  # no warning: nothing runs Model's computation
            out = _data_parallel_step(run, x, grad_out, ctx.rank, ctx.world_size)
        if compiled:  # counted while tracing
            assert counts["reference"] == 0 and counts["fused"] >= 1, (where, counts)
        else:
            assert counts == {"fused": 1, "reference": 0}, (where, counts)
        torch.testing.assert_close(out, expected.detach().chunk(ctx.world_size)[ctx.rank],
                                   atol=tol, rtol=tol)
        for name, parameter in model.named_parameters():
            if not compiled:
                assert isinstance(parameter.grad, DTensor), (where, name)
                assert parameter.grad.placements == (Shard(0),), (where, name)
            torch.testing.assert_close(parameter.grad.full_tensor(),
                                       reference.get_parameter(name).grad, atol=tol, rtol=tol)
    torch._dynamo.reset()


@scenario
def fsdp_takes_the_fused_path_and_matches_model(ctx):
    _assert_fsdp_takes_the_fused_path_and_matches_model(ctx, compiled=False)


@scenario
def fsdp_compiled_takes_the_fused_path_and_matches_model(ctx):
    _assert_fsdp_takes_the_fused_path_and_matches_model(ctx, compiled=True)


@scenario
def fsdp_evaluation_between_training_steps_sees_every_update(ctx):
    # FSDP2 all-gathers into the same unsharded parameter at every unshard, with its version
    # counter preserved (and on a caching allocator, often at the same address): ModelNew must not
    # cache a fold of it. The parameters are listed right after fully_shard, as an optimizer
    # lists them: the sharded ones (after a no_grad forward the root module holds the unsharded).
    learning_rate = 0.5
    for where in ("root", "matmul"):
        _, full = _models(ctx)
        model = _fully_shard(copy.deepcopy(full), ctx, where)
        parameters = {model: list(model.parameters()), full: list(full.parameters())}
        for step in range(3):
            x, grad_out = _inputs(ctx, seed=20 + step)
            for network in (model, full):
                for parameter in parameters[network]:
                    parameter.grad = None
                if network is model:
                    _data_parallel_step(network, x, grad_out, ctx.rank, ctx.world_size)
                else:
                    network(x).backward(grad_out / ctx.world_size)
                with torch.no_grad():
                    for parameter in parameters[network]:
                        parameter -= learning_rate * parameter.grad
            with torch.no_grad():
                expected = full(x)
                entries = set(_fold_cache._ENTRIES)
                out = model(x)
            assert set(_fold_cache._ENTRIES) == entries, where  # nothing cached for FSDP's
            torch.testing.assert_close(out, expected, atol=_tolerance(ctx.dtype), rtol=0)


@scenario
def fsdp_bfloat16_mixed_precision_matches_model_under_the_same_policy(ctx):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    reference, _ = _models(ctx, dtype=torch.float32)
    x, grad_out = _inputs(ctx, torch.float32)
    # Model rounds each Linear output to bfloat16 and ModelNew only its result, so a row whose two
    # best columns are within bfloat16's rounding may take either arg-max: such rows (top two
    # within 5%, in float64) get no upstream gradient, so that both agree on the rest.
    with torch.no_grad():
        fused = ModelNew.from_model(reference)
        pooled_weight, pooled_bias = fused.folded_parameters()
        z = x.double() @ pooled_weight.double().T + pooled_bias.double()
        top_two = (torch.nn.functional.gelu(z) * SCALE).topk(2, dim=1).values
        clear = top_two[:, 0] - top_two[:, 1] > 0.05 * top_two[:, 0].abs()
    assert bool(clear.any())
    grad_out = torch.where(clear, grad_out, 0)
    close = dict(atol=BFLOAT16_TOLERANCE, rtol=BFLOAT16_TOLERANCE)
    for where in ("root", "matmul and root"):
        models = [ModelNew.from_model(reference), copy.deepcopy(reference)]
        outs = []
        for model in models:
            _fully_shard(model, ctx, where, mp_policy=policy)
            with _path_taken() as counts:
                outs.append(_data_parallel_step(model, x, grad_out, ctx.rank, ctx.world_size))
            if isinstance(model, ModelNew):
                assert counts == {"fused": 1, "reference": 0}, (where, counts)
            assert outs[-1].dtype == torch.bfloat16
        torch.testing.assert_close(outs[0].float(), outs[1].float(), **close)
        for name, parameter in models[0].named_parameters():
            grad = parameter.grad.full_tensor()
            assert grad.dtype == torch.float32
            torch.testing.assert_close(grad, models[1].get_parameter(name).grad.full_tensor(),
                                       **close)


@scenario
def fsdp_with_a_hook_it_cannot_see_through_warns_once_and_runs_model(ctx):
    reference, _ = _models(ctx)
    model = ModelNew.from_model(reference)
    for network in (reference, model):
        network.matmul.register_forward_hook(lambda module, args, out: out - 0.25)
    _fully_shard(model, ctx, "matmul and root")
    x, grad_out = _inputs(ctx)
    expected = reference(x)
    expected.backward(grad_out / ctx.world_size)
    with warnings.catch_warnings(record=True) as caught, _path_taken() as counts:
        warnings.simplefilter("always")
        for _ in range(2):
            model.zero_grad()
            out = _data_parallel_step(model, x, grad_out, ctx.rank, ctx.world_size)
    assert counts["reference"] == 2 and counts["fused"] == 0, counts
    messages = [str(w.message) for w in caught if "fused_pool_gelu" in str(w.message)]
    assert len(messages) == 1, messages
    assert "forward hook" in messages[0] and "<lambda>" in messages[0], messages[0]
    assert "runs Model's computation" in messages[0] and "slower" in messages[0], messages[0]
    tol = _tolerance(ctx.dtype)
    torch.testing.assert_close(out, expected.detach().chunk(ctx.world_size)[ctx.rank],
                               atol=tol, rtol=tol)
    torch.testing.assert_close(model.matmul.weight.grad.full_tensor(), reference.matmul.weight.grad,
                               atol=tol, rtol=tol)


# FSDP2 over PoolGroupParallel on a 2-D mesh (data parallel x tensor parallel).


def _mesh_2d(ctx):
    from torch.distributed.device_mesh import init_device_mesh

    data_parallel = 2 if ctx.world_size % 2 == 0 else 1
    return init_device_mesh(ctx.device.type, (data_parallel, ctx.world_size // data_parallel),
                            mesh_dim_names=("dp", "tp"))


def _fsdp_over_plan(model, mesh, **kwargs):
    from torch.distributed.fsdp import fully_shard

    _plan(model, mesh["tp"])
    fully_shard(model.matmul, mesh=mesh["dp"], **kwargs)
    fully_shard(model, mesh=mesh["dp"], **kwargs)
    return model


@scenario
def fsdp_over_the_plan_on_a_2d_mesh_matches_model_new(ctx):
    mesh = _mesh_2d(ctx)
    data_parallel, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    _, full = _models(ctx)
    model = _fsdp_over_plan(copy.deepcopy(full), mesh)
    x, grad_out = _inputs(ctx)
    expected = full(x)
    expected.backward(grad_out / data_parallel)
    tol = _tolerance(ctx.dtype)
    with _path_taken() as counts:
        out = _data_parallel_step(model, x, grad_out, dp_rank, data_parallel)
    assert counts["reference"] == 0 and counts["fused"] == 1, counts
    torch.testing.assert_close(out, expected.detach().chunk(data_parallel)[dp_rank],
                               atol=tol, rtol=tol)
    for name, parameter in model.named_parameters():
        assert parameter.grad.placements == parameter.placements, name
        torch.testing.assert_close(parameter.grad.full_tensor(), full.get_parameter(name).grad,
                                   atol=tol, rtol=tol)
    # FSDP2's bfloat16 mixed precision over the plan: the shards compute on bfloat16 parameters.
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    model = _fsdp_over_plan(copy.deepcopy(full), mesh, mp_policy=policy)
    out = _data_parallel_step(model, x, grad_out, dp_rank, data_parallel)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.to(ctx.dtype), expected.detach().chunk(data_parallel)[dp_rank],
                               atol=BFLOAT16_TOLERANCE, rtol=BFLOAT16_TOLERANCE)


# Distributed checkpoints (torch.distributed.checkpoint), saved on one layout, loaded on another.


def _save(model, directory):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    dcp.save(get_model_state_dict(model), checkpoint_id=directory)


def _load(model, directory):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=directory)
    set_model_state_dict(model, state)
    return model


@scenario
def checkpoint_saved_sharded_loads_on_other_layouts(ctx):
    # Saved from the plan over every rank, and from the plan over half the ranks inside a 2-D mesh
    # (FSDP2 on the other dimension); loaded into each of those, into FSDP2 alone, and into the
    # unsharded model on every rank. Parameters bitwise, and the loaded models compute alike.
    _, trained = _models(ctx, seed=5)
    _, blank = _models(ctx, seed=6)
    layouts = {
        "plan": lambda model: _plan(model, ctx.mesh),
        "plan on a 2-D mesh under FSDP2": lambda model: _fsdp_over_plan(model, _mesh_2d(ctx)),
        "FSDP2": lambda model: _fully_shard(model, ctx, "matmul and root"),
        "unsharded": lambda model: model,
    }
    x, _ = _inputs(ctx)
    with torch.no_grad():
        expected = trained(x)
    for saved in ("plan", "plan on a 2-D mesh under FSDP2"):
        directory = f"{ctx.directory}/checkpoint-{saved.replace(' ', '-')}"
        _save(layouts[saved](copy.deepcopy(trained)), directory)
        for loaded, layout in layouts.items():
            model = _load(layout(copy.deepcopy(blank)), directory)
            for name, value in trained.state_dict().items():
                assert torch.equal(_full(model.state_dict()[name]), value), (saved, loaded, name)
            with torch.no_grad():
                torch.testing.assert_close(model(x), expected, atol=_tolerance(ctx.dtype), rtol=0)


# ----------------------------------------------------------------------------------------------
# Whether this torch's gloo runs, on CUDA tensors, the collectives the scenarios need: in torch
# 2.11 DTensor's all-gather of CUDA tensors over gloo kills the process (pytorch/pytorch#152645
# reports the same of gloo's coalesced all-gather), and a test of ours cannot mend that.

GLOO_CUDA_PROBES = {}


def probe(fn):
    GLOO_CUDA_PROBES[fn.__name__] = fn
    return fn


@probe
def all_gather_into_tensor(ctx):  # FSDP2's unshard, DTensor's Shard -> Replicate
    local = torch.full((3,), float(ctx.rank + 1), device=ctx.device)
    gathered = torch.empty(3 * ctx.world_size, device=ctx.device)
    dist.all_gather_into_tensor(gathered, local)
    expected = torch.arange(1, ctx.world_size + 1, device=ctx.device).repeat_interleave(3)
    assert torch.equal(gathered, expected.to(gathered.dtype)), gathered


@probe
def reduce_scatter_tensor(ctx):  # FSDP2's gradient reduction, DTensor's Partial -> Shard
    full = torch.arange(2 * ctx.world_size, dtype=torch.float32, device=ctx.device)
    reduced = torch.empty(2, device=ctx.device)
    dist.reduce_scatter_tensor(reduced, full)
    assert torch.equal(reduced, ctx.world_size * full[2 * ctx.rank : 2 * ctx.rank + 2]), reduced


@probe
def dtensor_full_tensor(ctx):
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(4.0 * ctx.world_size, device=ctx.device)
    assert torch.equal(distribute_tensor(full, ctx.mesh, [Shard(0)]).full_tensor(), full)


# ----------------------------------------------------------------------------------------------
# Launching: torch.multiprocessing.spawn, one process per rank.


class _FromThisFile:
    """Pickles as "run this file by path and take `name` from it".

    pytest's importlib mode imports this file under a module name ("tests.test_parallel") that
    spawned children cannot import, so a plain function reference would not unpickle there.
    """

    def __init__(self, name):
        self.name = name

    def __reduce__(self):
        return (operator.getitem, (_ThisFilesGlobals(), self.name))


class _ThisFilesGlobals:
    def __reduce__(self):
        return (runpy.run_path, (__file__,))


def _worker(rank, world_size, backend, device_type, result_dir, table):
    """One rank: every scenario of `table` (SCENARIOS or GLOO_CUDA_PROBES) in order; stops at the
    first failure (the other ranks would then wait in a collective until the timeout, and anything
    after that would be out of step).

    The rendezvous is a file store: no TCP store server thread in rank 0 and no port to race for
    (with a TCP store a gloo rank can abort at teardown: _ddp_worker.py).
    """
    from torch.distributed.device_mesh import init_device_mesh

    # A rank killed by a signal (a segfault in a backend) leaves its Python stack here; the file
    # stays open until the process exits.
    faulthandler.enable(open(f"{result_dir}/rank{rank}.crash", "w"))
    torch.set_num_threads(1)
    if device_type == "cuda":
        torch.cuda.set_device(0)  # one GPU, shared by the ranks
        device, dtype = torch.device("cuda", 0), torch.float32
    else:
        device, dtype = torch.device("cpu"), torch.float64
    dist.init_process_group(
        backend,
        init_method=f"file://{result_dir}/rendezvous",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    ctx = SimpleNamespace(
        device=device, dtype=dtype, world_size=world_size, rank=rank, directory=result_dir,
        mesh=init_device_mesh(device_type, (world_size,)),
    )
    results = {}
    try:
        for name, run in globals()[table].items():
            # Recorded before it runs: a rank that dies in it (a signal) leaves its name.
            _write_records(result_dir, rank, {**results, name: _DIED_HERE})
            try:
                run(ctx)
                results[name] = None
            except Exception:  # recorded for the test that asserts this scenario
                results[name] = traceback.format_exc()
                break
        if all(error is None for error in results.values()):
            # Every rank done before any tears its group down, as in _ddp_worker.py (after a
            # failure the ranks are out of step, and a barrier would only wait for the timeout).
            dist.barrier()
    finally:
        _write_records(result_dir, rank, results)
        dist.destroy_process_group()


_DIED_HERE = "the process died in this scenario"


def _write_records(result_dir, rank, results):
    with open(f"{result_dir}/rank{rank}.json", "w") as file:
        json.dump(results, file)


class _Records:
    def __init__(self, world_size, result_dir):
        self.world_size = world_size
        self.per_rank = []
        for rank in range(world_size):
            with open(result_dir / f"rank{rank}.json") as file:
                self.per_rank.append(json.load(file))

    def failed(self):
        """The scenarios that failed on some rank (not those left unrun after a failure)."""
        names = dict.fromkeys(name for results in self.per_rank for name in results)  # in order
        return [name for name in names
                if any(results.get(name) is not None for results in self.per_rank)]

    def check(self, name):
        failures = []
        for rank, results in enumerate(self.per_rank):
            if name not in results:
                failed_first = next(key for key, value in results.items() if value is not None)
                failures.append(f"rank {rank}: not run, {failed_first} failed first")
            elif results[name] is not None:
                failures.append(f"rank {rank}:\n{results[name]}")
        assert not failures, f"{name} at {self.world_size} ranks:\n" + "\n".join(failures)


class _RankDied(AssertionError):
    """A rank that died (a signal, or an exit outside the scenarios' own error handling);
    died_in: {rank: the scenarios it was in, [] where it died outside them}."""

    def __init__(self, message, died_in):
        super().__init__(message)
        self.died_in = died_in


def _spawn(world_size, backend, device_type, tmp_path_factory, table="SCENARIOS"):
    result_dir = tmp_path_factory.mktemp(f"{backend}-{device_type}{world_size}")
    try:
        mp.spawn(
            _FromThisFile("_worker"),
            args=(world_size, backend, device_type, str(result_dir), table),
            nprocs=world_size,
            join=True,
        )
    except mp.ProcessExitedException as error:  # a rank died: name its scenario, show its stack
        died_in, stacks = {}, []
        for rank in range(world_size):
            try:
                with open(result_dir / f"rank{rank}.json") as file:
                    records = json.load(file)
            except (OSError, ValueError):  # died before its first record
                records = {}
            died_in[rank] = [name for name, value in records.items() if value == _DIED_HERE]
            try:
                stack = (result_dir / f"rank{rank}.crash").read_text()
            except OSError:
                stack = ""
            if stack:
                stacks.append(f"rank {rank}'s stack when it died:\n{stack}")
        raise _RankDied("\n".join(
            [f"{error}; the scenario each rank was in: {died_in}", *stacks]), died_in) from error
    return _Records(world_size, result_dir)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def gloo_run(request, tmp_path_factory):
    """Every scenario, run once on the CPU with gloo at this many ranks (float64)."""
    return _spawn(request.param, "gloo", "cpu", tmp_path_factory)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_gloo_matches_unsharded(gloo_run, name):
    gloo_run.check(name)


@pytest.mark.cuda
def test_nccl_one_rank_matches_unsharded(tmp_path_factory):
    records = _spawn(1, "nccl", "cuda", tmp_path_factory)
    for name in SCENARIOS:
        records.check(name)


@pytest.mark.cuda
def test_gloo_ranks_sharing_a_gpu_match_unsharded(tmp_path_factory):
    try:
        failed = _spawn(2, "gloo", "cuda", tmp_path_factory, table="GLOO_CUDA_PROBES").failed()
    except _RankDied as error:
        killers = sorted({name for names in error.died_in.values() for name in names})
        if not killers:  # died outside the probes (set-up, teardown): not what the skip is for
            raise
        failed = [f"{name} killed a rank" for name in killers]
    if failed:
        pytest.skip(f"torch {torch.__version__}'s gloo cannot run on CUDA tensors the "
                    f"collectives of DTensor and FSDP2 ({', '.join(failed)}; see "
                    "pytorch/pytorch#152645)")
    records = _spawn(2, "gloo", "cuda", tmp_path_factory)
    for name in SCENARIOS:
        records.check(name)

