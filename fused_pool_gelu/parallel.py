"""Tensor parallelism as a DTensor plan: ModelNew sharded by pooling groups over a DeviceMesh.

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from fused_pool_gelu.parallel import PoolGroupParallel

    mesh = init_device_mesh("cuda", (world_size,))  # "cpu": gloo
    parallelize_module(model, mesh, PoolGroupParallel())  # or {"block": PoolGroupParallel()}
    out = model(x)         # x the same on every rank; out [B], the same on every rank
    out.sum().backward()   # matmul.weight.grad / .bias.grad: DTensors, Shard(0) like the parameters

Layout. ``matmul.weight`` and ``matmul.bias`` become DTensors placed ``Shard(0)``: DTensor's own
row split (each rank ceil(O / world_size) rows, the last ranks fewer or none), so that
torch.distributed.checkpoint, FSDP2 and optimizers treat them as any Shard(0) parameter, and a
checkpoint loads onto any number of ranks. The fused op needs whole pooling groups (k consecutive
rows): each group is computed by the rank holding its first row. Where the split cuts a group
(ceil(O / world_size) not a multiple of k), that rank borrows the group's other rows (fewer than
k, from the ranks after it) for each forward through one all-gather of at most k - 1 rows per
rank, and sends their gradients back in the backward; where it cuts none (O a multiple of
world_size * k, for one), nothing moves. The O % k tail rows, which AvgPool1d drops, stay where
the split puts them, at the end, with a zero gradient as in ModelNew. A rank may compute no group
(only tail rows, or more ranks than groups): it still joins every collective.

Forward. Each rank folds its groups and runs the fused op on them (local max, local arg-max,
pre-activation there), and two all-reduces combine the ranks with torch.max semantics over the
GLOBAL pooled index, so the result equals the unsharded model's, ties and NaN included:
  1. MAX of [value with NaN replaced by -inf, NaN flag]: the global max, and whether the row has a
     NaN. The flag is reduced explicitly because collectives do not promise to propagate NaN
     (NCCL's float max behaves like fmax and drops it).
  2. MIN of the global index each rank proposes: its local arg-max if its local value is the global
     max (in a NaN row: if its local value is NaN), else int64 max. The kernel's local arg-max is
     the first local maximum (the first local NaN), so the minimum is the first global one: the
     smallest global index wins ties, and the first NaN wins a NaN row.
Backward. Only the rank owning a row's arg-max passes gradient for that row: the others run the
arg-max backward with that row's grad_out and pre-activation set to zero, so they contribute exact
zeros (a zero pre-activation, because gelu' of a non-finite one is NaN and 0 * NaN is NaN). x is
replicated, so its gradient is the all-reduce SUM of the ranks' parts; weight and bias gradients
stay with the shard (``ops.fold``'s autograd maps them back to the k rows of each group).

Every rank of the mesh must call the model in the same order with the same x (shape, dtype,
requires_grad and values), as with any collective. The shape, dtype and requires_grad are
compared first (one all-gather of a few integers, read on the host: on CUDA a synchronisation per
call), and a mismatch raises on every rank instead of a collective hanging or aborting. If x
itself holds Inf or NaN, the row's output and its gradients are NaN in both models, and the
non-owner ranks' weight gradients at their local arg-max pick up 0 * NaN as well (the dense
reference Model spreads it to every row). The fold runs in every call (no cache, unlike ModelNew).
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from . import ops
from ._autocast import autocast_cast
from .model import ModelNew, _checked_pool_kernel_size, _fsdp_forward_hooks, _is_plain_linear

__all__ = ["PoolGroupParallel"]

_NO_PROPOSAL = torch.iinfo(torch.int64).max  # larger than every global index: loses every MIN
# The dtypes x may have, numbered for the cross-rank comparison (-1: any other).
_DTYPE_CODES = {torch.float64: 0, torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}


class _Part(NamedTuple):
    """One rank's part of the O rows under DTensor's Shard(0) split, in pooling groups of k."""

    rows: range    # its rows of the full weight
    groups: range  # the pooling groups it computes: those whose first row it holds
    lent: int      # its first rows, which belong to a group an earlier rank computes
    own: int       # the rows of its own groups that it holds (after the lent ones)


def _parts(out_features: int, pool_kernel_size: int, world_size: int) -> List[_Part]:
    """Every rank's _Part, in rank order."""
    chunk = -(-out_features // world_size)  # DTensor's Shard(0): torch.chunk's sizes
    grouped = out_features // pool_kernel_size * pool_kernel_size  # rows before the tail
    parts = []
    for rank in range(world_size):
        start = min(rank * chunk, out_features)
        stop = min(start + chunk, out_features)
        first = -(-start // pool_kernel_size)
        end = max(first, -(-min(stop, grouped) // pool_kernel_size))
        lent = max(0, min(stop, first * pool_kernel_size, grouped) - start)
        own = max(0, min(stop, grouped) - start - lent)
        parts.append(_Part(range(start, stop), range(first, end), lent, own))
    return parts


def _lenders(parts: List[_Part], rank: int, pool_kernel_size: int) -> List[int]:
    """The ranks after `rank` whose lent rows complete its last group, in row order."""
    part = parts[rank]
    needed = len(part.groups) * pool_kernel_size - part.own
    lenders = []
    for other in range(rank + 1, len(parts)):
        if needed <= 0:
            break
        lenders.append(other)
        needed -= parts[other].lent
    return lenders


def _rows_and_bias(weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    return weight if bias is None else torch.cat([weight, bias[:, None]], dim=1)


def _padded(rows: Tensor, count: int) -> Tensor:
    padded = rows.new_zeros((count, rows.shape[1]))
    padded[: rows.shape[0]] = rows
    return padded


class _BorrowedRows(torch.autograd.Function):
    """The rows of this rank's last group that the ranks after it hold (their lent rows), and in
    the backward, the gradients of this rank's lent rows from the rank that borrowed them."""

    @staticmethod
    def forward(ctx, lent_weight, lent_bias, parts, rank, pool_kernel_size, group):
        has_bias = lent_bias is not None
        width = max(part.lent for part in parts)
        sent = _padded(_rows_and_bias(lent_weight, lent_bias), width)
        gathered = [torch.empty_like(sent) for _ in parts]
        dist.all_gather(gathered, sent, group=group)
        lenders = _lenders(parts, rank, pool_kernel_size)
        borrowed = torch.cat([gathered[other][: parts[other].lent] for other in lenders]
                             or [sent[:0]])
        ctx.parts, ctx.rank, ctx.group = parts, rank, group
        ctx.pool_kernel_size, ctx.has_bias = pool_kernel_size, has_bias
        in_features = lent_weight.shape[1]
        return borrowed[:, :in_features], (borrowed[:, in_features] if has_bias else None)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_borrowed_weight, grad_borrowed_bias):
        parts, rank, group = ctx.parts, ctx.rank, ctx.group
        width = max(len(p.groups) * ctx.pool_kernel_size - p.own for p in parts)
        has_bias = ctx.has_bias
        if grad_borrowed_bias is None and has_bias:
            grad_borrowed_bias = grad_borrowed_weight.new_zeros(grad_borrowed_weight.shape[0])
        sent = _padded(_rows_and_bias(grad_borrowed_weight, grad_borrowed_bias), width)
        gathered = [torch.empty_like(sent) for _ in parts]
        dist.all_gather(gathered, sent, group=group)
        # The borrower of this rank's lent rows lists them after those of the lenders before it.
        lent = parts[rank].lent
        grad = sent[:0]
        if lent:
            borrower = next(other for other in range(rank)
                            if rank in _lenders(parts, other, ctx.pool_kernel_size))
            offset = sum(parts[other].lent
                         for other in _lenders(parts, borrower, ctx.pool_kernel_size)
                         if other < rank)
            grad = gathered[borrower][offset : offset + lent]
        in_features = grad.shape[1] - (1 if has_bias else 0)
        return (grad[:, :in_features], grad[:, in_features] if has_bias else None,
                None, None, None, None)


class _ShardedFusedMax(torch.autograd.Function):
    """out[b] = max over every rank's pooled features, from each rank's folded groups."""

    @staticmethod
    def forward(ctx, x, pooled_weight, pooled_bias, scale, first_group, group):
        # Under autocast the op computes in the autocast dtype (autocast_cast's rule): cast
        # here, so that the backward gets the tensors the op saw, and its gradients go back to the
        # inputs' dtypes.
        device_type = x.device.type
        dtype = (torch.get_autocast_dtype(device_type)
                 if torch.is_autocast_enabled(device_type) else None)
        ctx.input_dtypes = (x.dtype, pooled_weight.dtype,
                            None if pooled_bias is None else pooled_bias.dtype)
        x, pooled_weight, pooled_bias = (
            autocast_cast(t, dtype) for t in (x, pooled_weight, pooled_bias))
        batch = x.shape[0]
        if pooled_weight.shape[0]:
            local_out, local_argmax, local_pre = torch.ops.fused_pool_gelu.forward_with_argmax(
                x, pooled_weight, pooled_bias, scale
            )
        else:  # no group on this rank: it proposes nothing
            local_out = x.new_full((batch,), float("-inf"))
            local_argmax = torch.zeros(batch, dtype=torch.int64, device=x.device)
            local_pre = x.new_zeros(batch)
        is_nan = torch.isnan(local_out)
        stats = torch.stack(
            [local_out.masked_fill(is_nan, float("-inf")), is_nan.to(local_out.dtype)]
        )
        dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
        global_max, any_nan = stats[0], stats[1] > 0

        local_index = local_argmax + first_group
        candidate = torch.where(any_nan, is_nan, local_out == global_max)
        if not pooled_weight.shape[0]:
            candidate = torch.zeros_like(candidate)
        owner_index = torch.where(candidate, local_index, _NO_PROPOSAL)
        dist.all_reduce(owner_index, op=dist.ReduceOp.MIN, group=group)
        # Index ranges of different ranks are disjoint, so only the owner finds its own index.
        owner = owner_index == local_index

        ctx.save_for_backward(x, pooled_weight, local_argmax, local_pre, owner)
        ctx.scale = scale
        ctx.group = group
        return global_max.masked_fill(any_nan, float("nan"))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x, pooled_weight, local_argmax, local_pre, owner = ctx.saved_tensors
        if pooled_weight.shape[0]:
            grad_x, grad_weight, grad_bias = torch.ops.fused_pool_gelu.forward_backward(
                torch.where(owner, grad_out, 0),
                None,
                x,
                pooled_weight,
                local_argmax,
                torch.where(owner, local_pre, 0),
                ctx.scale,
            )
        else:
            grad_x = torch.zeros_like(x)
            grad_weight, grad_bias = pooled_weight.new_zeros(pooled_weight.shape), None
        if ctx.needs_input_grad[0]:
            dist.all_reduce(grad_x, op=dist.ReduceOp.SUM, group=ctx.group)
        else:
            grad_x = None
        x_dtype, weight_dtype, bias_dtype = ctx.input_dtypes
        if bias_dtype is not None and grad_bias is None:
            grad_bias = grad_weight.new_zeros(grad_weight.shape[0])
        return (
            None if grad_x is None else grad_x.to(x_dtype),
            grad_weight.to(weight_dtype),
            None if bias_dtype is None else grad_bias.to(bias_dtype),
            None, None, None,
        )


def _shard_mesh_dim(weight: DTensor, bias: Optional[Tensor]) -> int:
    """The mesh dimension the parameters are split over: PoolGroupParallel's Shard(0) on one
    dimension, Replicate on any other (the data-parallel dimension of a 2-D mesh under FSDP2)."""
    placements = tuple(weight.placements)
    sharded = [dim for dim, placement in enumerate(placements) if placement == Shard(0)]
    if len(sharded) != 1 or any(
        placement != Replicate() for dim, placement in enumerate(placements) if dim != sharded[0]
    ):
        raise RuntimeError(
            "fused_pool_gelu.ModelNew: a DTensor matmul.weight must be placed Shard(0) on one "
            "mesh dimension and Replicate on the others, as PoolGroupParallel places it, got "
            f"{placements}"
        )
    if bias is not None and (
        not isinstance(bias, DTensor)
        or tuple(bias.placements) != placements
        or bias.device_mesh != weight.device_mesh
    ):
        got = tuple(bias.placements) if isinstance(bias, DTensor) else type(bias).__name__
        raise RuntimeError(
            "fused_pool_gelu.ModelNew: matmul.bias must be a DTensor placed like matmul.weight "
            f"({placements}), got {got}"
        )
    return sharded[0]


def _check_same_call(x: Tensor, in_features: int, group, rank_in_group: int) -> None:
    """Raise on every rank where the ranks' x differ in shape, dtype or requires_grad (their
    collectives would not match), or where x is not [batch, in_features]."""
    shape = list(x.shape[:2]) + [-1] * (2 - min(x.dim(), 2))
    needs_grad = x.requires_grad and torch.is_grad_enabled()
    mine = torch.tensor(
        [x.dim(), *shape, int(needs_grad), _DTYPE_CODES.get(x.dtype, -1)],
        dtype=torch.int64, device=x.device,
    )
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    calls = [t.tolist() for t in gathered]
    if any(call != calls[0] for call in calls):
        names = {code: str(dtype).replace("torch.", "") for dtype, code in _DTYPE_CODES.items()}
        seen = ", ".join(
            f"rank {rank}: {[size for size in sizes if size >= 0][:dim]} "
            f"{names.get(code, 'other dtype')} requires_grad={bool(grad)}"
            for rank, (dim, *sizes, grad, code) in enumerate(calls)
        )
        raise RuntimeError(
            "fused_pool_gelu.ModelNew (PoolGroupParallel): every rank of the mesh must call the "
            f"model with x of the same shape, dtype and requires_grad, got {seen} (this is rank "
            f"{rank_in_group})"
        )
    if x.dim() != 2 or x.shape[1] != in_features:
        raise RuntimeError(
            f"fused_pool_gelu.ModelNew: x must be [batch, in_features] = [batch, {in_features}] "
            f"(matmul.in_features), got shape {list(x.shape)}"
        )


def sharded_forward(
    x: Tensor, weight: DTensor, bias: Optional[DTensor], pool_kernel_size, scale
) -> Tensor:
    """ModelNew's forward on parameters that PoolGroupParallel sharded (see the module's
    docstring): [B] on every rank, a plain tensor."""
    mesh_dim = _shard_mesh_dim(weight, bias)
    mesh = weight.device_mesh
    group = mesh.get_group(mesh_dim)
    world_size = mesh.size(mesh_dim)
    rank = mesh.get_local_rank(mesh_dim)
    out_features, in_features = weight.shape
    pool_kernel_size = _checked_pool_kernel_size(pool_kernel_size)
    if pool_kernel_size > out_features:
        raise ValueError(
            f"fused_pool_gelu.ModelNew: pool_kernel_size must be <= out_features ({out_features}) "
            f"so that at least one pooled feature exists, got {pool_kernel_size}"
        )
    if isinstance(x, DTensor):
        x = x.full_tensor()
    _check_same_call(x, in_features, group, rank)

    parts = _parts(out_features, pool_kernel_size, world_size)
    part = parts[rank]
    local_weight = weight.to_local()
    local_bias = None if bias is None else bias.to_local()
    if local_weight.shape[0] != len(part.rows):
        raise RuntimeError(
            f"fused_pool_gelu.ModelNew: rank {rank}'s shard of matmul.weight must hold DTensor's "
            f"Shard(0) rows [{part.rows.start}, {part.rows.stop}) of {out_features}, got "
            f"{local_weight.shape[0]} rows (a DTensor built with an uneven from_local?)"
        )
    own = slice(part.lent, part.lent + part.own)
    rows = local_weight[own]
    rows_bias = None if local_bias is None else local_bias[own]
    if any(p.lent for p in parts):  # the split cuts a group: every rank joins the exchange
        lent = slice(0, part.lent)
        borrowed_weight, borrowed_bias = _BorrowedRows.apply(
            local_weight[lent], None if local_bias is None else local_bias[lent],
            parts, rank, pool_kernel_size, group,
        )
        rows = torch.cat([rows, borrowed_weight])
        if local_bias is not None:
            rows_bias = torch.cat([rows_bias, borrowed_bias])
    if part.groups:
        pooled_weight, pooled_bias = ops.fold(rows, rows_bias, pool_kernel_size)
    else:  # nothing to fold; the empty rows keep the backward's collectives on this rank
        pooled_weight, pooled_bias = rows[:0], None if rows_bias is None else rows_bias[:0]
    return _ShardedFusedMax.apply(x, pooled_weight, pooled_bias, scale, part.groups.start, group)


def _refuse_what_the_shards_cannot_run(module: ModelNew, what: str) -> None:
    # ModelNew runs Model's computation where its matmul does more than x @ weight.T + bias, and
    # for a tensor scale_factor; the shards cannot. FSDP2's own hooks on matmul are run around
    # the fused block, so they are fine.
    linear = module.matmul
    if not _is_plain_linear(linear) and _fsdp_forward_hooks(linear) is None:
        raise RuntimeError(
            f"{what}: matmul must compute only x @ weight.T + bias, as nn.Linear does: no module "
            f"hooks on it (FSDP2's aside) or global ones, no subclass forward (got "
            f"{type(linear).__name__}); the shards cannot run what ModelNew hands to Model's "
            "computation"
        )
    if isinstance(module.scale_factor, Tensor):
        raise TypeError(f"{what}: scale_factor must be a Python number, got a Tensor")


class PoolGroupParallel(ParallelStyle):
    """Shard a :class:`~fused_pool_gelu.ModelNew` by pooling groups over a 1-D DeviceMesh.

    ``parallelize_module(model, mesh, PoolGroupParallel())`` (or a plan dict naming the ModelNew
    inside a larger model) turns ``matmul.weight`` and ``matmul.bias`` into DTensors placed
    ``Shard(0)``; the forward then computes each rank's groups and combines the ranks exactly as
    the unsharded model would (the module docstring has the layout and the rules). x is taken
    replicated: a plain tensor, the same on every rank, or a DTensor of any placement (made whole
    first). Compose with FSDP2 by sharding a 2-D mesh's ``"tp"`` dimension with this style and
    then ``fully_shard(model, mesh=mesh["dp"])``.

    Keyword Args:
        use_local_output: return ``out`` as a plain tensor (default), or as a DTensor placed
            ``Replicate()`` on the mesh.

    Where ModelNew would run Model's computation instead of the fold (module hooks on ``matmul``
    other than FSDP2's, global module hooks, a Linear subclass's own forward, a tensor
    ``scale_factor``), this style and the sharded forward raise: the shards cannot run it.
    """

    def __init__(self, *, use_local_output: bool = True):
        super().__init__()
        self.use_local_output = use_local_output

    def _partition(self, name, module, device_mesh):
        if name != "matmul":
            return
        for param_name, param in module.named_parameters(recurse=False):
            module.register_parameter(param_name, nn.Parameter(
                distribute_tensor(param, device_mesh, [Shard(0)],
                                  src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad,
            ))

    @staticmethod
    def _prepare_input(module, inputs, device_mesh):
        _refuse_what_the_shards_cannot_run(module, "fused_pool_gelu.ModelNew (PoolGroupParallel)")
        return inputs

    def _prepare_output(self, module, output, device_mesh):
        if self.use_local_output:
            return output
        return DTensor.from_local(output, device_mesh, [Replicate()], run_check=False)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        what = "PoolGroupParallel"
        if not isinstance(module, ModelNew):
            raise TypeError(
                f"{what} shards a fused_pool_gelu.ModelNew (name it in the plan), got "
                f"{type(module).__name__}"
            )
        if device_mesh.ndim != 1:
            raise ValueError(
                f"{what}: device_mesh must be 1-D, as parallelize_module asks (slice a 2-D mesh: "
                f"mesh['tp']), got a {device_mesh.ndim}-D mesh"
            )
        _refuse_what_the_shards_cannot_run(module, what)
        weight = module.matmul.weight
        if isinstance(weight, DTensor):
            raise ValueError(
                f"{what}: matmul.weight is a DTensor already ({tuple(weight.placements)}); apply "
                "PoolGroupParallel to the plain module, before fully_shard"
            )
        out_features = weight.shape[0]
        pool_kernel_size = _checked_pool_kernel_size(module.pool_kernel_size)
        if pool_kernel_size > out_features:
            raise ValueError(
                f"{what}: pool_kernel_size must be <= out_features ({out_features}) so that at "
                f"least one pooled feature exists, got {pool_kernel_size}"
            )
        return distribute_module(
            module, device_mesh, self._partition, self._prepare_input, self._prepare_output
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(use_local_output={self.use_local_output})"
