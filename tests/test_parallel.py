"""fused_pool_gelu.parallel.TensorParallelPoolGelu as specifications: sharded equals unsharded.

Each world size runs ONE spawned job (process start and torch import cost seconds per rank on a
small machine): every rank runs every scenario below in order and records a traceback or None, and
each test asserts one scenario's record. A scenario compares the sharded module with the unsharded
ModelNew (and Model) on the same parameters and data, which every rank builds from the same seed.

Shapes are chosen so that the number of pooled features N = 2 * world_size + 1 does not divide
evenly over the ranks and out_features has an O % k tail.
"""

from __future__ import annotations

import json
import operator
import runpy
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fused_pool_gelu import Model, ModelNew
from fused_pool_gelu.parallel import TensorParallelPoolGelu, split_groups

BATCH, IN_FEATURES, POOL, SCALE, TAIL = 16, 24, 4, 2.0, 3
# A rank stuck in a collective (because another failed) gives up after this long.
COLLECTIVE_TIMEOUT_S = 30


def _out_features(world_size):
    return (2 * world_size + 1) * POOL + TAIL


def _tolerance(dtype):
    # As conftest's for a dtype against float64: the sharded and unsharded sums differ only in
    # their order (per rank, then across ranks), a few ulps.
    return {torch.float64: 1e-10, torch.float32: 1e-5}[dtype]


def _models(dtype, device, seed=0):
    """(Model, ModelNew) with equal parameters, the same on every rank."""
    torch.manual_seed(seed)
    reference = Model(IN_FEATURES, _out_features(dist.get_world_size()), POOL, SCALE)
    reference = reference.to(device=device, dtype=dtype)
    return reference, ModelNew.from_model(reference)


def _inputs(dtype, device, seed=1):
    """x [B, K] and an upstream gradient [B], the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(BATCH, IN_FEATURES, generator=generator, dtype=torch.float64)
    grad_out = torch.randn(BATCH, generator=generator, dtype=torch.float64)
    return x.to(device, dtype), grad_out.to(device, dtype)


def _run(model, x, grad_out):
    """(out, grad_x) of model on a fresh leaf copy of x; parameter grads land on the model."""
    x = x.clone().requires_grad_(True)
    out = model(x)
    out.backward(grad_out)
    return out.detach(), x.grad


def _assert_matches_unsharded(tp, full, x, grad_out, tol, equal_nan=False):
    """Same output and x grad as `full`; this rank's weight/bias grads are its rows of full's."""
    out, grad_x = _run(tp, x, grad_out)
    expected_out, expected_grad_x = _run(full, x, grad_out)
    close = dict(atol=tol, rtol=tol, equal_nan=equal_nan)
    torch.testing.assert_close(out, expected_out, **close)
    torch.testing.assert_close(grad_x, expected_grad_x, **close)
    rows = slice(tp.row_range.start, tp.row_range.stop)
    torch.testing.assert_close(tp.matmul.weight.grad, full.matmul.weight.grad[rows], **close)
    if full.matmul.bias is not None:
        torch.testing.assert_close(tp.matmul.bias.grad, full.matmul.bias.grad[rows], **close)


# ----------------------------------------------------------------------------------------------
# Scenarios: each runs on every rank with (device, dtype); float64 on the CPU, float32 on CUDA.

SCENARIOS = {}


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


@scenario
def shards_are_whole_groups_split_evenly(device, dtype):
    world_size, rank = dist.get_world_size(), dist.get_rank()
    _, full = _models(dtype, device)
    tp = TensorParallelPoolGelu.from_module(full)
    num_groups = _out_features(world_size) // POOL
    sizes = [len(groups) for groups in split_groups(num_groups, world_size)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] - sizes[-1] == 1
    assert sum(sizes) == num_groups
    assert tp.row_range.start == tp.group_range.start * POOL
    last = rank == world_size - 1
    assert tp.row_range.stop == (_out_features(world_size) if last else tp.group_range.stop * POOL)
    assert tp.matmul.weight.shape == (len(tp.row_range), IN_FEATURES)


@scenario
def forward_and_gradients_match_model_new(device, dtype):
    _, full = _models(dtype, device)
    tp = TensorParallelPoolGelu.from_module(full)
    x, grad_out = _inputs(dtype, device)
    _assert_matches_unsharded(tp, full, x, grad_out, _tolerance(dtype))


@scenario
def forward_and_gradients_match_model(device, dtype):
    reference, _ = _models(dtype, device)
    tp = TensorParallelPoolGelu.from_module(reference)
    x, grad_out = _inputs(dtype, device)
    _assert_matches_unsharded(tp, reference, x, grad_out, _tolerance(dtype))


@scenario
def float32_from_state_dict_matches_within_contract(device, dtype):
    _, full = _models(torch.float32, device)
    tp = TensorParallelPoolGelu.from_state_dict(full.state_dict(), POOL, SCALE)
    x, grad_out = _inputs(torch.float32, device)
    _assert_matches_unsharded(tp, full, x, grad_out, _tolerance(torch.float32))


@scenario
def without_bias_matches_and_gathers(device, dtype):
    _, full = _models(dtype, device)
    full.matmul.bias = None
    tp = TensorParallelPoolGelu.from_state_dict(full.state_dict(), POOL, SCALE)
    assert tp.matmul.bias is None
    x, grad_out = _inputs(dtype, device)
    _assert_matches_unsharded(tp, full, x, grad_out, _tolerance(dtype))
    gathered = tp.gather()
    assert gathered.matmul.bias is None
    assert torch.equal(gathered.matmul.weight, full.matmul.weight)


@scenario
def exact_ties_across_ranks_go_to_the_smallest_global_index(device, dtype):
    # Small integers make every dot product and group mean exact, so duplicated groups tie exactly
    # whatever order each rank's GEMM sums in. The duplicates (+3 everywhere, bias 2) beat every
    # other group (entries in [-2, 2]) on every row, since x >= 1.
    world_size = dist.get_world_size()
    reference, full = _models(dtype, device)
    groups = split_groups(_out_features(world_size) // POOL, world_size)
    tied = [groups[0].stop - 1] + [g.start for g in groups[1:]]
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
    x = torch.randint(1, 3, (BATCH, IN_FEATURES), generator=generator).to(device, dtype)
    _, grad_out = _inputs(dtype, device)

    pooled_weight, pooled_bias = full.folded_parameters()
    _, argmax, _ = torch.ops.fused_pool_gelu.forward_with_argmax(
        x, pooled_weight, pooled_bias, SCALE
    )
    assert bool((argmax == tied[0]).all()), "the data must make the tied groups win every row"

    for unsharded in (full, reference):
        tp = TensorParallelPoolGelu.from_module(unsharded)
        _assert_matches_unsharded(tp, unsharded, x, grad_out, _tolerance(dtype))
        grad_rows = tp.matmul.weight.grad.abs().sum(dim=1)
        for group in tied:
            if group in tp.group_range:
                first_row = (group - tp.group_range.start) * POOL
                has_gradient = bool((grad_rows[first_row : first_row + POOL] > 0).all())
                assert has_gradient == (group == tied[0]), f"group {group}: only {tied[0]} gets any"


@scenario
def nan_rows_go_to_the_first_nan_and_send_it_the_gradient(device, dtype):
    world_size = dist.get_world_size()
    _, full = _models(dtype, device)
    groups = split_groups(_out_features(world_size) // POOL, world_size)
    first_nan, last_nan = groups[1].start, groups[-1].stop - 1
    with torch.no_grad():
        for group in (first_nan, last_nan):
            full.matmul.weight[group * POOL, 0] = float("nan")
    tp = TensorParallelPoolGelu.from_module(full)
    x, grad_out = _inputs(dtype, device)
    _assert_matches_unsharded(tp, full, x, grad_out, _tolerance(dtype), equal_nan=True)
    out = tp(x)
    assert bool(out.isnan().all())
    if last_nan in tp.group_range:  # the later NaN group gets no gradient (its rank may hold both)
        local_row = (last_nan - tp.group_range.start) * POOL
        assert bool((tp.matmul.weight.grad[local_row : local_row + POOL] == 0).all())


@scenario
def autocast_forward_and_gradients_match_model_new(device, dtype):
    # Under bfloat16 autocast the op computes in bfloat16 (_autocast.autocast_cast): the shards'
    # output is bfloat16 like ModelNew's, and the backward, which sees the cast tensors, returns
    # float32 gradients for the float32 parameters and x.
    _, full = _models(torch.float32, device)
    tp = TensorParallelPoolGelu.from_module(full)
    x, grad_out = _inputs(torch.float32, device)
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
    for model in (tp, full):
        leaf = x.clone().requires_grad_(True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
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
    rows = slice(tp.row_range.start, tp.row_range.stop)
    torch.testing.assert_close(tp.matmul.weight.grad, full.matmul.weight.grad[rows], **close)
    torch.testing.assert_close(tp.matmul.bias.grad, full.matmul.bias.grad[rows], **close)


@scenario
def gather_round_trip_is_bitwise(device, dtype):
    _, full = _models(dtype, device)
    original = {key: value.clone() for key, value in full.state_dict().items()}
    tp = TensorParallelPoolGelu.from_state_dict(original, POOL, SCALE)
    state = tp.full_state_dict()
    assert state.keys() == original.keys()
    for key in original:
        assert state[key].dtype == original[key].dtype, key
        assert torch.equal(state[key], original[key]), key
    gathered = tp.gather()
    assert isinstance(gathered, ModelNew)
    assert gathered.pool_kernel_size == POOL and gathered.scale_factor == SCALE
    gathered_state = gathered.state_dict()
    assert gathered_state.keys() == original.keys()
    for key in original:
        assert torch.equal(gathered_state[key], original[key]), key
    x, _ = _inputs(dtype, device)
    with torch.no_grad():
        torch.testing.assert_close(gathered(x), full(x), atol=0, rtol=0)


@scenario
def sgd_steps_stay_equal_to_unsharded(device, dtype):
    # SGD with weight decay: the tail rows (never any gradient) must decay exactly as in ModelNew.
    # Written out rather than torch.optim.SGD, whose first step imports torch._dynamo (seconds per
    # rank on a small machine); the update is elementwise either way.
    learning_rate, weight_decay = 0.5, 0.1
    _, full = _models(dtype, device)
    tp = TensorParallelPoolGelu.from_module(full)
    tol = _tolerance(dtype)
    for step in range(3):
        x, target = _inputs(dtype, device, seed=10 + step)
        losses = []
        for model in (tp, full):
            model.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), target)
            loss.backward()
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter -= learning_rate * (parameter.grad + weight_decay * parameter)
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], atol=tol, rtol=tol)
    gathered = tp.full_state_dict()
    for key, value in full.state_dict().items():
        torch.testing.assert_close(gathered[key], value, atol=tol, rtol=tol)


@scenario
def errors_name_the_argument(device, dtype):
    world_size = dist.get_world_size()
    too_few = Model(IN_FEATURES, (world_size - 1) * POOL + TAIL, POOL, SCALE).to(device, dtype)
    spread = rf"= {world_size - 1} groups cannot be spread over {world_size} ranks"
    with pytest.raises(ValueError, match=spread):
        TensorParallelPoolGelu.from_module(too_few)
    with pytest.raises(KeyError, match=r"state_dict must hold 'matmul.weight'"):
        TensorParallelPoolGelu.from_state_dict({"weight": too_few.matmul.weight}, POOL, SCALE)
    with pytest.raises(ValueError, match=r"pool_kernel_size must be an integer in \[1, out_feat"):
        TensorParallelPoolGelu.from_state_dict(too_few.state_dict(), 0, SCALE)
    with pytest.raises(TypeError, match=r"must be a fused_pool_gelu.ModelNew or Model, got Linear"):
        TensorParallelPoolGelu.from_module(too_few.matmul)


class _LinearTimesTwo(torch.nn.Linear):
    """A Linear subclass with its own forward (as LoRA or quantized layers have)."""

    def forward(self, x):
        return 2.0 * super().forward(x)


@scenario
def what_the_shards_cannot_run_is_refused(device, dtype):
    # ModelNew runs Model's computation for these; sharded, they were silently skipped (a hook's
    # or a subclass's change of the output, a tensor scale_factor's gradient).
    plain = r"matmul must compute only x @ weight.T \+ bias"
    hooked, _ = _models(dtype, device)
    hooked.matmul.register_forward_hook(lambda module, args, out: out - 0.25)
    with pytest.raises(RuntimeError, match="from_module: model.matmul must compute only"):
        TensorParallelPoolGelu.from_module(hooked)
    subclassed, _ = _models(dtype, device)
    subclassed.matmul.__class__ = _LinearTimesTwo
    with pytest.raises(RuntimeError, match=plain):
        TensorParallelPoolGelu.from_module(subclassed)
    scaled, _ = _models(dtype, device)
    scaled.scale_factor = torch.nn.Parameter(torch.tensor(1.5, device=device, dtype=dtype))
    with pytest.raises(TypeError, match="scale_factor must be a Python number, got a Tensor"):
        TensorParallelPoolGelu.from_module(scaled)
    tp = TensorParallelPoolGelu.from_module(_models(dtype, device)[0])
    x, _ = _inputs(dtype, device)
    handle = tp.matmul.register_forward_pre_hook(lambda module, args: None)
    with pytest.raises(RuntimeError, match="TensorParallelPoolGelu: matmul must compute only"):
        tp(x)
    handle.remove()
    tp(x)  # every rank, in step


@scenario
def constructor_arguments_as_model_new_takes_them(device, dtype):
    full, _ = _models(dtype, device)
    # AvgPool1d's and ModelNew's 1-tuple pool size; a NaN named as the argument it is.
    from_tuple = TensorParallelPoolGelu.from_state_dict(full.state_dict(), (POOL,), SCALE)
    assert from_tuple.pool_kernel_size == POOL
    with pytest.raises(ValueError, match=r"pool_kernel_size must be an integer in \[1, out_feat"):
        TensorParallelPoolGelu.from_state_dict(full.state_dict(), float("nan"), SCALE)
    # Frozen parameters stay frozen, as in ModelNew.from_model.
    full.matmul.bias.requires_grad_(False)
    tp = TensorParallelPoolGelu.from_module(full)
    assert tp.matmul.weight.requires_grad and not tp.matmul.bias.requires_grad
    # A wrong-width x is named as x, not as this rank's pooled shard.
    wide = torch.rand(3, IN_FEATURES + 1, device=device, dtype=dtype)
    with pytest.raises(RuntimeError, match=rf"TensorParallelPoolGelu: x must be \[batch, "
                                           rf"in_features\] = \[batch, {IN_FEATURES}\], "
                                           rf"got shape \[3, {IN_FEATURES + 1}\]"):
        tp(wide)


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


def _worker(rank, world_size, backend, result_dir):
    """One rank: every scenario in order; stops at the first failure (the other ranks would then
    wait in a collective until the timeout, and anything after that would be out of step).

    The rendezvous is a file store: no TCP store server thread in rank 0 and no port to race for
    (with a TCP store a gloo rank can abort at teardown: _ddp_worker.py).
    """
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device, dtype = torch.device("cuda", rank), torch.float32
    else:
        device, dtype = torch.device("cpu"), torch.float64
    dist.init_process_group(
        backend,
        init_method=f"file://{result_dir}/rendezvous",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    results = {}
    try:
        for name, run in SCENARIOS.items():
            try:
                run(device, dtype)
                results[name] = None
            except Exception:  # recorded for the test that asserts this scenario
                results[name] = traceback.format_exc()
                break
        if all(error is None for error in results.values()):
            # Every rank done before any tears its group down, as in _ddp_worker.py (after a
            # failure the ranks are out of step, and a barrier would only wait for the timeout).
            dist.barrier()
    finally:
        with open(f"{result_dir}/rank{rank}.json", "w") as file:
            json.dump(results, file)
        dist.destroy_process_group()


class _Records:
    def __init__(self, world_size, result_dir):
        self.world_size = world_size
        self.per_rank = []
        for rank in range(world_size):
            with open(result_dir / f"rank{rank}.json") as file:
                self.per_rank.append(json.load(file))

    def check(self, name):
        failures = []
        for rank, results in enumerate(self.per_rank):
            if name not in results:
                failed_first = next(key for key, value in results.items() if value is not None)
                failures.append(f"rank {rank}: not run, {failed_first} failed first")
            elif results[name] is not None:
                failures.append(f"rank {rank}:\n{results[name]}")
        assert not failures, f"{name} at {self.world_size} ranks:\n" + "\n".join(failures)


def _spawn(world_size, backend, tmp_path_factory):
    result_dir = tmp_path_factory.mktemp(f"{backend}{world_size}")
    mp.spawn(
        _FromThisFile("_worker"),
        args=(world_size, backend, str(result_dir)),
        nprocs=world_size,
        join=True,
    )
    return _Records(world_size, result_dir)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def gloo_run(request, tmp_path_factory):
    """Every scenario, run once on the CPU with gloo at this many ranks (float64)."""
    return _spawn(request.param, "gloo", tmp_path_factory)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_gloo_sharded_matches_unsharded(gloo_run, name):
    gloo_run.check(name)


@pytest.mark.cuda
def test_nccl_sharded_matches_unsharded(tmp_path_factory):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs for NCCL, got {torch.cuda.device_count()}")
    records = _spawn(2, "nccl", tmp_path_factory)
    for name in SCENARIOS:
        records.check(name)


def test_needs_an_initialized_process_group():
    if dist.is_initialized():
        pytest.skip("a default process group is already initialized in this process")
    torch.manual_seed(0)
    model = ModelNew(IN_FEATURES, 4 * POOL, POOL, SCALE)
    with pytest.raises(RuntimeError, match=r"torch.distributed must be initialized first"):
        TensorParallelPoolGelu.from_module(model)
