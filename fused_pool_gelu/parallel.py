"""Tensor parallelism for weights that outgrow one device: ModelNew sharded by pooling groups.

    import torch.distributed as dist
    from fused_pool_gelu.parallel import TensorParallelPoolGelu

    dist.init_process_group("nccl")                 # or "gloo" on the CPU
    tp = TensorParallelPoolGelu.from_module(model)  # or .from_state_dict(sd, k, scale)
    tp = tp.to(f"cuda:{rank}")
    out = tp(x)            # x replicated on every rank; out [B], the same on every rank
    out.sum().backward()   # each rank gets the gradients of its own rows; x.grad is complete
    full = tp.gather()     # a full ModelNew again, on every rank

Layout. The O rows of ``matmul.weight`` (and ``matmul.bias``) form N = O // k pooling groups of
k consecutive rows. Each rank holds a contiguous range of whole groups, split as evenly as possible
(the first N % world_size ranks take one extra), so that it can fold and run the fused op on its
shard alone. The O % k tail rows, which AvgPool1d drops and which never reach the output, stay at
the end of the LAST rank's shard, exactly where ModelNew keeps them: ``ops.fold`` drops them there
as it does in ModelNew, their gradient is zero as in ModelNew (so optimizers, weight decay included,
treat them identically), and gathering the shards gives back the original rows bitwise. Every rank
must hold at least one group: fewer groups than ranks is an error (a rank with nothing to compute
would only add latency to every collective).

Forward. Each rank runs the fused op on its folded shard (local max, local arg-max, pre-activation
there), and two all-reduces combine the ranks with torch.max semantics over the GLOBAL pooled index,
so the result equals the unsharded model's, ties and NaN included:
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
stay local to the shard (``ops.fold``'s autograd maps them back to the k rows of each group).

Every rank must call forward (and backward) in the same order with the same x (same shape, values
and requires_grad), as with any collective. If x itself holds Inf or NaN, the row's output and its
gradients are NaN in both models, and the non-owner ranks' weight gradients at their local arg-max
pick up 0 * NaN as well (the dense reference Model spreads it to every row).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from . import ops
from ._autocast import autocast_cast
from .model import (
    Model,
    ModelNew,
    _checked_pool_kernel_size,
    _is_plain_linear,
    pool_kernel_size_of,
)

__all__ = ["TensorParallelPoolGelu", "split_groups"]

_NO_PROPOSAL = torch.iinfo(torch.int64).max  # larger than every global index: loses every MIN


def split_groups(num_groups: int, world_size: int) -> List[range]:
    """The pooling groups each rank holds: contiguous, sizes differing by at most one, the larger
    ones first."""
    base, extra = divmod(num_groups, world_size)
    starts = [rank * base + min(rank, extra) for rank in range(world_size + 1)]
    return [range(starts[rank], starts[rank + 1]) for rank in range(world_size)]


def _check_plain_matmul(what: str, linear: nn.Module) -> None:
    # ModelNew runs Model's computation where its matmul does more than x @ weight.T + bias (module
    # hooks, global module hooks, a subclass's forward: model._is_plain_linear); the shards cannot,
    # and would silently skip it.
    if not _is_plain_linear(linear):
        raise RuntimeError(
            f"{what} must compute only x @ weight.T + bias, as nn.Linear does: no module hooks "
            f"on it or global ones, no subclass forward (got {type(linear).__name__}); the shards "
            "cannot run what ModelNew hands to Model's computation"
        )


class _ShardedFusedMax(torch.autograd.Function):
    """out[b] = max over every rank's pooled features, from each rank's folded shard."""

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
        local_out, local_argmax, local_pre = torch.ops.fused_pool_gelu.forward_with_argmax(
            x, pooled_weight, pooled_bias, scale
        )
        is_nan = torch.isnan(local_out)
        stats = torch.stack(
            [local_out.masked_fill(is_nan, float("-inf")), is_nan.to(local_out.dtype)]
        )
        dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
        global_max, any_nan = stats[0], stats[1] > 0

        local_index = local_argmax + first_group
        candidate = torch.where(any_nan, is_nan, local_out == global_max)
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
        grad_x, grad_weight, grad_bias = torch.ops.fused_pool_gelu.forward_backward(
            torch.where(owner, grad_out, 0),
            None,
            x,
            pooled_weight,
            local_argmax,
            torch.where(owner, local_pre, 0),
            ctx.scale,
        )
        if ctx.needs_input_grad[0]:
            dist.all_reduce(grad_x, op=dist.ReduceOp.SUM, group=ctx.group)
        else:
            grad_x = None
        x_dtype, weight_dtype, bias_dtype = ctx.input_dtypes
        return (
            None if grad_x is None else grad_x.to(x_dtype),
            grad_weight.to(weight_dtype),
            None if bias_dtype is None else grad_bias.to(bias_dtype),
            None, None, None,
        )


class TensorParallelPoolGelu(nn.Module):
    """ModelNew with ``matmul.weight`` / ``matmul.bias`` sharded by whole pooling groups over the
    ranks of a process group (``group``; None: the default group).

    Build it with :meth:`from_module` or :meth:`from_state_dict` (every rank passes the same full
    model); get a full model back with :meth:`gather` or :meth:`full_state_dict`. Its own
    ``state_dict()`` holds this rank's shard under the full model's keys. ``group_range`` is the
    range of pooled features this rank holds, ``row_range`` its rows of the full weight (the last
    rank's include the O % k tail). Collectives run on the tensors' device: CUDA tensors with NCCL,
    CPU tensors with gloo. The fold runs in every call (no cache, unlike ModelNew). Where ModelNew
    would run Model's computation instead of the fold (hooks on ``matmul``, global module hooks, a
    Linear subclass's own forward, a tensor ``scale_factor``), this module raises: the shards
    cannot run it.
    """

    def __init__(
        self,
        state_dict: Dict[str, Tensor],
        pool_kernel_size: int,
        scale_factor: float,
        group: Optional[dist.ProcessGroup] = None,
    ):
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "TensorParallelPoolGelu: torch.distributed must be initialized first "
                "(torch.distributed.init_process_group), got no default process group"
            )
        if "matmul.weight" not in state_dict:
            raise KeyError(
                "TensorParallelPoolGelu: state_dict must hold 'matmul.weight' (and usually "
                f"'matmul.bias'), as ModelNew's and Model's do, got keys {sorted(state_dict)}"
            )
        weight = state_dict["matmul.weight"]
        bias = state_dict.get("matmul.bias")
        if weight.dim() != 2:
            raise ValueError(
                "TensorParallelPoolGelu: state_dict['matmul.weight'] must be 2-D "
                f"[out_features, in_features], got shape {list(weight.shape)}"
            )
        out_features, in_features = weight.shape
        if bias is not None and tuple(bias.shape) != (out_features,):
            raise ValueError(
                f"TensorParallelPoolGelu: state_dict['matmul.bias'] must be 1-D [out_features] = "
                f"[{out_features}], got shape {list(bias.shape)}"
            )
        try:
            checked_pool_kernel_size = _checked_pool_kernel_size(pool_kernel_size)
        except ValueError:
            checked_pool_kernel_size = None
        if checked_pool_kernel_size is None or checked_pool_kernel_size > out_features:
            raise ValueError(
                "TensorParallelPoolGelu: pool_kernel_size must be an integer in [1, out_features = "
                f"{out_features}], got {pool_kernel_size!r}"
            )
        pool_kernel_size = checked_pool_kernel_size
        if isinstance(scale_factor, Tensor):
            # ModelNew runs Model's computation for a tensor scale_factor (which may want its
            # gradient); the shards cannot.
            raise TypeError(
                "TensorParallelPoolGelu: scale_factor must be a Python number, got a Tensor"
            )
        num_groups = out_features // pool_kernel_size
        world_size = dist.get_world_size(group)
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError(
                "TensorParallelPoolGelu: this process must be a member of group, got rank -1"
            )
        if num_groups < world_size:
            raise ValueError(
                "TensorParallelPoolGelu: every rank must hold at least one pooling group, but "
                f"out_features // pool_kernel_size = {out_features} // {pool_kernel_size} = "
                f"{num_groups} groups cannot be spread over {world_size} ranks; use at most "
                f"{num_groups} ranks"
            )

        self.in_features = in_features
        self.out_features = out_features
        self.pool_kernel_size = pool_kernel_size
        self.scale_factor = scale_factor
        self.group = group
        self.rank = rank
        self.world_size = world_size
        groups = split_groups(num_groups, world_size)
        # Rows of each rank's shard: its groups' rows, and the O % k tail for the last rank.
        self._row_ranges = [
            range(g.start * pool_kernel_size, g.stop * pool_kernel_size) for g in groups
        ]
        self._row_ranges[-1] = range(self._row_ranges[-1].start, out_features)
        self.group_range = groups[rank]
        self.row_range = self._row_ranges[rank]

        rows = self.row_range
        # The shard is built on meta (no initialization, no RNG draws) and then given copies of its
        # rows: copies, so that the full tensors can be freed.
        self.matmul = nn.Linear(in_features, len(rows), bias=bias is not None, device="meta")
        self.matmul.weight = nn.Parameter(weight.detach()[rows.start : rows.stop].clone())
        if bias is not None:
            self.matmul.bias = nn.Parameter(bias.detach()[rows.start : rows.stop].clone())

    @classmethod
    def from_state_dict(
        cls,
        state_dict: Dict[str, Tensor],
        pool_kernel_size: int,
        scale_factor: float,
        group: Optional[dist.ProcessGroup] = None,
    ) -> "TensorParallelPoolGelu":
        """This rank's shard of the full state_dict of a ModelNew or Model (same on every rank)."""
        return cls(state_dict, pool_kernel_size, scale_factor, group)

    @classmethod
    def from_module(
        cls, model: nn.Module, group: Optional[dist.ProcessGroup] = None
    ) -> "TensorParallelPoolGelu":
        """This rank's shard of a full ModelNew or Model (the same on every rank), on its device and
        in its dtype."""
        if not isinstance(model, (Model, ModelNew)):
            raise TypeError(
                "TensorParallelPoolGelu.from_module: model must be a fused_pool_gelu.ModelNew or "
                f"Model, got {type(model).__name__}"
            )
        _check_plain_matmul("TensorParallelPoolGelu.from_module: model.matmul", model.matmul)
        sharded = cls(model.state_dict(), pool_kernel_size_of(model), model.scale_factor, group)
        # state_dict() detaches: frozen parameters stay frozen, as in ModelNew.from_model.
        sharded.matmul.weight.requires_grad_(model.matmul.weight.requires_grad)
        if model.matmul.bias is not None:
            sharded.matmul.bias.requires_grad_(model.matmul.bias.requires_grad)
        return sharded

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"pool_kernel_size={self.pool_kernel_size}, scale_factor={self.scale_factor}, "
            f"rank={self.rank}/{self.world_size}, groups=[{self.group_range.start}, "
            f"{self.group_range.stop}), rows=[{self.row_range.start}, {self.row_range.stop})"
        )

    def forward(self, x: Tensor) -> Tensor:
        _check_plain_matmul("TensorParallelPoolGelu: matmul", self.matmul)
        if isinstance(x, Tensor) and x.dim() == 2 and x.shape[1] != self.in_features:
            # The op's own message would name this rank's pooled shard, which the caller never made.
            raise RuntimeError(
                f"fused_pool_gelu.TensorParallelPoolGelu: x must be [batch, in_features] = [batch, "
                f"{self.in_features}], got shape {list(x.shape)}"
            )
        pooled_weight, pooled_bias = ops.fold(
            self.matmul.weight, self.matmul.bias, self.pool_kernel_size
        )
        return _ShardedFusedMax.apply(
            x, pooled_weight, pooled_bias, self.scale_factor, self.group_range.start, self.group
        )

    def _all_gather_rows(self, shard: Tensor) -> Tensor:
        # all_gather needs equal sizes on every rank: pad each shard to the largest, then trim.
        counts = [len(rows) for rows in self._row_ranges]
        padded = shard.new_zeros((max(counts),) + tuple(shard.shape[1:]))
        padded[: shard.shape[0]] = shard
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([part[:count] for part, count in zip(parts, counts)])

    @torch.no_grad()
    def full_state_dict(self) -> Dict[str, Tensor]:
        """The full model's state_dict, on every rank (a collective: call it on all ranks).

        Bitwise equal to the state_dict the module was built from, after any training since.
        """
        state = {"matmul.weight": self._all_gather_rows(self.matmul.weight)}
        if self.matmul.bias is not None:
            state["matmul.bias"] = self._all_gather_rows(self.matmul.bias)
        return state

    def gather(self) -> ModelNew:
        """A full ModelNew with the current parameters, on every rank (a collective: call it on all
        ranks)."""
        with torch.device("meta"):
            model = ModelNew(
                self.in_features, self.out_features, self.pool_kernel_size, self.scale_factor
            )
        if self.matmul.bias is None:
            model.matmul.bias = None
        model.load_state_dict(self.full_state_dict(), assign=True)
        return model
