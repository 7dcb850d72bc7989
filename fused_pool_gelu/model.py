"""The reference block (KernelBench level 2 #98) and its drop-in replacement."""

from __future__ import annotations

import collections.abc
import copy
import math
import numbers
import operator
import sys
import warnings
import weakref
from typing import Optional, Tuple

import torch
from torch import Tensor, nn
from torch.autograd import forward_ad
from torch.nn.modules import module as _module

from . import _autograd, _fold_cache, ops

__all__ = ["Model", "ModelNew"]


def _checked_pool_kernel_size(pool_kernel_size) -> int:
    # AvgPool1d takes any iterable of one element too (its _single: a 1-tuple, a list, a NumPy
    # array of shape [1]), and any integer type with __index__ (NumPy's scalars); a float with an
    # integral value is accepted as well.
    value = pool_kernel_size
    if isinstance(value, collections.abc.Iterable) and not isinstance(value, (str, bytes)):
        try:
            items = tuple(value)
        except TypeError:  # a 0-d tensor: Iterable by type, not by value
            items = None
        if items is not None and len(items) == 1:
            (value,) = items
    if not isinstance(value, bool):
        try:
            value = operator.index(value)
        except TypeError:
            if isinstance(value, float) and math.isfinite(value) and int(value) == value:
                value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"pool_kernel_size must be a positive integer, got {pool_kernel_size!r}")
    if value >= 2**63:
        raise ValueError(f"pool_kernel_size must be below 2**63, got {pool_kernel_size!r}")
    return value


def _checked_scale_factor(scale_factor):
    # What multiplies a tensor in Model: a real number (a float for the fused op; NumPy's scalars
    # included) or a tensor (whose gradient Model computes: ModelNew runs Model's computation).
    if type(scale_factor) is float or isinstance(scale_factor, Tensor):
        return scale_factor
    if isinstance(scale_factor, numbers.Real):
        return float(scale_factor)
    raise TypeError(
        f"fused_pool_gelu.ModelNew: scale_factor must be a real number or a tensor, got "
        f"{scale_factor!r}"
    )


def _pooled_gelu_max(linear_out: Tensor, pool, scale_factor) -> Tensor:
    """Model's computation after its Linear: pool (an AvgPool1d, or F.avg_pool1d with its
    kernel size) over the features, GELU, scale, max over the features."""
    x = pool(linear_out.unsqueeze(1)).squeeze(1)
    x = torch.nn.functional.gelu(x)
    x = x * scale_factor
    return torch.max(x, dim=1).values


_LINEAR_FORWARD = nn.Linear.forward
# torch's registries of global module hooks: dicts it fills and empties in place.
_GLOBAL_FORWARD_PRE_HOOKS = _module._global_forward_pre_hooks
_GLOBAL_FORWARD_HOOKS = _module._global_forward_hooks
_GLOBAL_BACKWARD_PRE_HOOKS = _module._global_backward_pre_hooks
_GLOBAL_BACKWARD_HOOKS = _module._global_backward_hooks


def _is_plain_linear(linear: nn.Module) -> bool:
    """linear(x) is x @ weight.T + bias with nothing else run: nn.Linear's own forward, and no
    module hooks on it (spectral_norm, pruning and the old weight_norm work through forward
    pre-hooks) nor global ones. Only then can ModelNew read the parameters and fold them. (Runs
    at every call: a few dict truth tests, ~0.3 us.)"""
    return (
        type(linear).forward is _LINEAR_FORWARD
        and not (linear._forward_pre_hooks or linear._forward_hooks
                 or linear._backward_pre_hooks or linear._backward_hooks)
        and not (_GLOBAL_FORWARD_PRE_HOOKS or _GLOBAL_FORWARD_HOOKS
                 or _GLOBAL_BACKWARD_PRE_HOOKS or _GLOBAL_BACKWARD_HOOKS)
    )


def _fsdp_forward_hooks(linear: nn.Module):
    """(pre_hook, post_hook) where the only hooks on ``linear`` are the two that FSDP2's
    ``fully_shard(linear)`` registers (unshard and input cast before the forward; reshard, the
    pre-backward hook and output cast after it), else None. Around them the Linear is a plain
    x @ weight.T + bias on the unsharded parameters, which ModelNew can fold."""
    fsdp_state = sys.modules.get(_fold_cache.FSDP_STATE_MODULE)
    if fsdp_state is None or type(linear).forward is not _LINEAR_FORWARD:
        return None
    pre_hooks, post_hooks = linear._forward_pre_hooks, linear._forward_hooks
    if (len(pre_hooks) != 1 or len(post_hooks) != 1
            or linear._backward_pre_hooks or linear._backward_hooks
            or _GLOBAL_FORWARD_PRE_HOOKS or _GLOBAL_FORWARD_HOOKS
            or _GLOBAL_BACKWARD_PRE_HOOKS or _GLOBAL_BACKWARD_HOOKS):
        return None
    ((pre_id, pre_hook),) = pre_hooks.items()
    ((post_id, post_hook),) = post_hooks.items()
    state_type = fsdp_state.FSDPState
    state = getattr(pre_hook, "__self__", None)
    if (not isinstance(state, state_type)
            or getattr(post_hook, "__self__", None) is not state
            or getattr(pre_hook, "__func__", None) is not state_type._pre_forward
            or getattr(post_hook, "__func__", None) is not state_type._post_forward
            or not linear._forward_pre_hooks_with_kwargs.get(pre_id, False)
            or post_id in linear._forward_hooks_with_kwargs):
        return None
    return pre_hook, post_hook


def _is_dtensor(tensor) -> bool:
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(tensor, dtensor.DTensor)


def _what_the_fold_cannot_run(linear: nn.Module) -> str:
    """The hooks and forward that make ``linear`` more than x @ weight.T + bias, named."""

    def name(hook):
        hook = getattr(hook, "__func__", hook)
        return getattr(hook, "__qualname__", type(hook).__qualname__)

    parts = []
    if type(linear).forward is not _LINEAR_FORWARD:
        parts.append(f"its own forward ({type(linear).__qualname__}.forward)")
    for kind, hooks in (
        ("forward pre-hook", linear._forward_pre_hooks),
        ("forward hook", linear._forward_hooks),
        ("backward pre-hook", linear._backward_pre_hooks),
        ("backward hook", linear._backward_hooks),
    ):
        parts += [f"{kind} {name(hook)}" for hook in hooks.values()]
    if (_GLOBAL_FORWARD_PRE_HOOKS or _GLOBAL_FORWARD_HOOKS
            or _GLOBAL_BACKWARD_PRE_HOOKS or _GLOBAL_BACKWARD_HOOKS):
        parts.append("global module hooks (torch.nn.modules.module.register_module_*_hook)")
    return ", ".join(parts)


# ModelNew instances that have warned that they run Model's computation.
_WARNED_UNFUSED = weakref.WeakSet()


def pool_kernel_size_of(model: nn.Module) -> int:
    """The pooling window of a :class:`Model` or :class:`ModelNew` (the callers check which),
    checked."""
    if isinstance(model, ModelNew):
        return _checked_pool_kernel_size(model.pool_kernel_size)
    kernel_size = model.avg_pool.kernel_size
    if isinstance(kernel_size, (tuple, list)):
        (kernel_size,) = kernel_size
    return _checked_pool_kernel_size(kernel_size)


class Model(nn.Module):
    """Linear -> AvgPool1d -> GELU -> scale -> max, exactly as KernelBench defines it."""

    def __init__(self, in_features, out_features, pool_kernel_size, scale_factor):
        super().__init__()
        self.matmul = nn.Linear(in_features, out_features)
        self.avg_pool = nn.AvgPool1d(kernel_size=pool_kernel_size)
        self.scale_factor = scale_factor

    def forward(self, x):
        return _pooled_gelu_max(self.matmul(x), self.avg_pool, self.scale_factor)


class ModelNew(nn.Module):
    """Drop-in replacement for :class:`Model`: same constructor, parameters and state_dict.

    The pooling is folded into the weight (``ops.fold``) and the rest runs as one fused op
    (``ops.forward``). The folded weight (with, on CUDA in float32, its ``ops.prepare_weight``
    copy) is cached (``fused_pool_gelu/_fold_cache.py``) and refolded only after ``matmul.weight``
    or ``matmul.bias`` change (optimizer step, in-place edit, ``load_state_dict``, ``.to()``, a new
    tensor assigned to ``.data``), detected through the parameters' storage, data pointer, shape,
    strides and version counter (no host sync per call), or ``pool_kernel_size`` does. In-place
    edits through ``.data`` bypass the version counter; call :meth:`invalidate_fold` after such an
    edit. Training (gradients needed) runs ``ops.model_forward``, one autograd node whose forward
    takes the cached fold and whose backward sends the gradients to weight and bias, so gradient
    accumulation and evaluation with grad enabled fold once per update; a CUDA-graph capture
    records the fold, so that replays follow updates. Under torch.compile, torch.export and
    torch.jit.trace the forward is one op that reads the same cache at run time
    (``cached_model_forward``); compiled training records ``ops.fold`` then ``ops.forward`` in its
    graph instead.

    What the fold cannot express runs Model's computation instead (Model's numbers and speed):
    a ``matmul`` that does more than ``x @ weight.T + bias`` (module hooks on it, as
    ``spectral_norm``, pruning and the old ``weight_norm`` register, global module hooks, or a
    subclass with its own ``forward``, e.g. a LoRA or quantized layer), and a tensor
    ``scale_factor`` (whose gradient Model computes). The hooks and subclasses warn once per
    module (a tensor ``scale_factor`` does not: it is asked for). The new-style
    ``torch.nn.utils.parametrize`` needs no hooks and keeps the fused path, and so does FSDP2:
    ``fully_shard`` of the model or of ``matmul`` (whose two hooks ModelNew runs around the fused
    block; FSDP2's unsharded parameters are refolded every call, never cached). DTensor parameters
    placed by :class:`fused_pool_gelu.parallel.PoolGroupParallel` run its sharded forward.
    """

    def __init__(self, in_features, out_features, pool_kernel_size, scale_factor):
        super().__init__()
        pool_kernel_size = _checked_pool_kernel_size(pool_kernel_size)
        _checked_scale_factor(scale_factor)
        # Created exactly as Model creates it, so the same seed gives the same parameters.
        self.matmul = nn.Linear(in_features, out_features)
        self.pool_kernel_size = pool_kernel_size
        self.scale_factor = scale_factor

    @classmethod
    def from_model(cls, model: Model) -> "ModelNew":
        """A ModelNew with a copy of ``model``'s parameters (same device, dtype, requires_grad)."""
        if not isinstance(model, Model):
            raise TypeError(
                f"ModelNew.from_model: model must be a fused_pool_gelu.Model, "
                f"got {type(model).__name__}"
            )
        kernel_size = pool_kernel_size_of(model)
        # Not through __init__: its nn.Linear would draw fresh parameters from the RNG.
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.matmul = copy.deepcopy(model.matmul)
        new.pool_kernel_size = kernel_size
        new.scale_factor = model.scale_factor
        return new

    def __prepare_scriptable__(self):
        # torch.jit.script calls this first, on every submodule: a clear error instead of
        # TorchScript's on the first Python construct it cannot compile in forward().
        raise RuntimeError(
            "fused_pool_gelu.ModelNew does not support torch.jit.script (TorchScript cannot "
            "compile its forward, and is deprecated): use torch.compile or torch.export, or "
            "torch.jit.trace"
        )

    def extra_repr(self) -> str:
        return f"pool_kernel_size={self.pool_kernel_size}, scale_factor={self.scale_factor}"

    def invalidate_fold(self) -> None:
        """Drop the cached folded weight (needed only after edits through ``.data``)."""
        _fold_cache.forget(self.matmul.weight, self.matmul.bias)

    def folded_parameters(self) -> Tuple[Tensor, Tensor]:
        """(pooled_weight, pooled_bias) for the current parameters, from the cache when valid.

        Detached (no autograd history, whatever the grad mode) and shared with the cache: an
        in-place change to them makes the next call refold instead of serving them."""
        linear = self.matmul
        pool_kernel_size = _checked_pool_kernel_size(self.pool_kernel_size)
        return self._folded(linear.weight, linear.bias, pool_kernel_size)[:2]

    def _folded(
        self, weight: Tensor, bias: Optional[Tensor], pool_kernel_size: int, prepare: bool = True
    ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """(pooled_weight, pooled_bias, prepared_weight or None) from the fold cache
        (_fold_cache.py), which serves them while the parameters are unchanged (pool_kernel_size:
        the attribute, checked; it may change, as the weight may). prepare: make the prepared
        copy where the forward reads one (CUDA float32); the training path does not ask (at small
        batch its forward would not read it)."""
        return _fold_cache.cached_fold(weight, bias, pool_kernel_size, prepare)

    @staticmethod
    def _capturing() -> bool:
        # A captured fold runs at each replay, so the graph follows parameter updates; a cache
        # filled during capture would hold values that exist only after the first replay.
        return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()

    def _reference_forward(self, linear: nn.Module, x: Tensor, pool_kernel_size: int) -> Tensor:
        # Model's computation, for what the fold cannot express: a `matmul` that runs more than
        # x @ weight.T + bias (hooks, its own forward) or a tensor scale_factor (which may want
        # its gradient). pool_kernel_size: the attribute, checked.
        return _pooled_gelu_max(
            linear(x),
            lambda y: torch.nn.functional.avg_pool1d(y, pool_kernel_size),
            self.scale_factor,
        )

    def forward(self, x: Tensor) -> Tensor:
        # Plain attributes, as Model's: checked at every call as the constructor checks them.
        pool_kernel_size = self.pool_kernel_size
        if type(pool_kernel_size) is not int or not 1 <= pool_kernel_size < 2**63:
            pool_kernel_size = _checked_pool_kernel_size(pool_kernel_size)
        scale = self.scale_factor
        if type(scale) is not float:
            scale = _checked_scale_factor(scale)
        if torch.compiler.is_compiling() or torch._C._get_tracing_state() is not None:
            linear = self.matmul
            if not _is_plain_linear(linear) or isinstance(scale, Tensor):
                return self._forward_around_hooks(linear, x, pool_kernel_size, scale)
            return self._traced_forward(linear, x, pool_kernel_size, scale)
        # nn.Module's attribute lookups go through __getattr__, about a microsecond of host time
        # each (3.6 us for these three, against a 7 us op at B = 1 on a CPU): the registered
        # parameters are read from the module's dicts. A parameter that is not a registered one
        # (torch.nn.utils.parametrize's property, an old weight_norm's plain tensor) takes the
        # attribute lookup, as before, and so does a `matmul` that is not a registered submodule
        # (a subclass's property).
        linear = self._modules.get("matmul")
        if linear is None:
            linear = self.matmul
        if not _is_plain_linear(linear) or (type(scale) is not float and isinstance(scale, Tensor)):
            return self._forward_around_hooks(linear, x, pool_kernel_size, scale)
        return self._fused_forward(linear, x, pool_kernel_size, scale)

    def _forward_around_hooks(self, linear: nn.Module, x: Tensor, pool_kernel_size: int,
                              scale) -> Tensor:
        # What _is_plain_linear refuses. FSDP2's own hooks on matmul are run around the fused
        # block, as nn.Module would run them around the Linear's forward; anything else runs
        # Model's computation, with a warning the first time (a tensor scale_factor, whose
        # gradient Model computes, is documented and does not warn).
        if isinstance(scale, Tensor):
            return self._reference_forward(linear, x, pool_kernel_size)
        hooks = _fsdp_forward_hooks(linear)
        if hooks is not None:
            pre_hook, post_hook = hooks
            args, _ = pre_hook(linear, (x,), {})
            fused_forward = (self._traced_forward if torch.compiler.is_compiling()
                             else self._fused_forward)
            out = fused_forward(linear, args[0], pool_kernel_size, scale)
            return post_hook(linear, args, out)
        if self not in _WARNED_UNFUSED:
            _WARNED_UNFUSED.add(self)
            warnings.warn(
                f"fused_pool_gelu.ModelNew: matmul ({type(linear).__name__}) runs more than "
                f"x @ weight.T + bias: {_what_the_fold_cannot_run(linear)}. The fold cannot see "
                "through that, so this module runs Model's computation (the unfused Linear, "
                "AvgPool1d, GELU and max: Model's numbers and speed, several to tens of times "
                "slower than the fused path, docs/performance.md). Remove it to get the fused "
                "path back; FSDP2's fully_shard(matmul) alone keeps it. Warned once per module.",
                stacklevel=5,  # the caller of model(x), through nn.Module.__call__
            )
        return self._reference_forward(linear, x, pool_kernel_size)

    @staticmethod
    def _traced_forward(linear: nn.Module, x: Tensor, pool_kernel_size: int, scale) -> Tensor:
        # Traced graphs cannot read version counters: the fold cache is an op that reads them at
        # run time (_fold_cache.py). Compiled training traces the ops through their fake kernels
        # and Python autograd formulas instead, the fold in the graph; an exported or
        # jit-traced graph is the op, which takes the gradient path when one is needed.
        weight, bias = linear.weight, linear.bias
        if _is_dtensor(weight):
            # Placed by PoolGroupParallel: its forward runs eagerly, a graph break (its
            # collectives depend on each rank's share of the groups, which traced graphs
            # would fix per rank).
            from .parallel import sharded_forward

            return torch.compiler.disable(sharded_forward)(x, weight, bias, pool_kernel_size,
                                                           scale)
        recorded = _fold_cache.needs_recorded_fold(weight)  # autocast: its kernels' dtypes
        if recorded or (torch.is_grad_enabled() and not torch.compiler.is_exporting()
                        and torch._C._get_tracing_state() is None
                        and (weight.requires_grad or (bias is not None and bias.requires_grad))):
            return ops.forward(x, *ops.fold(weight, bias, pool_kernel_size), scale)
        return _fold_cache.cached_model_forward(x, weight, bias, pool_kernel_size, scale)

    def _fused_forward(self, linear: nn.Module, x: Tensor, pool_kernel_size: int,
                       scale) -> Tensor:
        params = linear._parameters
        weight = params.get("weight")
        if weight is None:
            weight = linear.weight
        bias = params["bias"] if "bias" in params else linear.bias
        if type(weight) is not nn.Parameter and _is_dtensor(weight):
            # Sharded by fused_pool_gelu.parallel.PoolGroupParallel (the unsharded parameters
            # under FSDP2 alone are plain tensors).
            from .parallel import sharded_forward

            return sharded_forward(x, weight, bias, pool_kernel_size, scale)
        try:
            if torch.is_grad_enabled() and (
                weight.requires_grad or (bias is not None and bias.requires_grad)
            ):
                # Training, eager or captured in a CUDA graph: the fold must be in the autograd
                # graph for weight and bias to get gradients; model_forward records fold and
                # forward as one autograd node (less host time than the two ops' nodes, same
                # bits), whose backward is model_backward. Its forward takes the cached fold
                # (gradient accumulation, evaluation with grad enabled: one fold per parameter
                # update); a captured graph folds at every replay, and autocast and torch.func
                # transforms record the fold (_fold_cache.needs_recorded_fold).
                if self._capturing() or _fold_cache.needs_recorded_fold(weight):
                    return ops.model_forward(x, weight, bias, pool_kernel_size, scale)
                cached = None
                if type(x) in (Tensor, nn.Parameter):
                    # On a miss (every step after a parameter update) the node folds in the same
                    # op as its forward, and the cache keeps that fold: one op call from Python
                    # fewer than folding first. Not for a tensor subclass x, whose type the fold
                    # would take.
                    cached, miss = _fold_cache.lookup(weight, bias, pool_kernel_size)
                    if cached is None and miss is not None:
                        out, pooled_weight, pooled_bias = _autograd.model_forward_and_fold(
                            x, weight, bias, pool_kernel_size, scale
                        )
                        _fold_cache.store(miss, weight, bias, (pooled_weight, pooled_bias, None))
                        return out
                if cached is None:
                    cached = self._folded(weight, bias, pool_kernel_size, prepare=False)
                return _autograd.model_forward_on_cached_fold(
                    x, weight, bias, pool_kernel_size, scale, cached[0], cached[1]
                )
            if self._capturing():
                pooled_weight, pooled_bias = ops.fold(weight, bias, pool_kernel_size)
                return ops.forward(x, pooled_weight, pooled_bias, scale)
            pooled_weight, pooled_bias, prepared_weight = self._folded(
                weight, bias, pool_kernel_size
            )
            # No gradient (x's too: frozen parameters may still pass one to x) and nothing that
            # ops.forward routes elsewhere: straight to the kernel.
            if (not (x.requires_grad and torch.is_grad_enabled())
                    and forward_ad._current_level < 0 and not torch._C._is_any_autocast_enabled()
                    and not torch._C._are_functorch_transforms_active()):
                return _autograd.forward_on_cached_fold(x, pooled_weight, pooled_bias, scale,
                                                        prepared_weight)
            return ops.forward(x, pooled_weight, pooled_bias, scale, prepared_weight)
        except RuntimeError as error:
            # The op's own message would name the pooled weight, which the caller never made.
            if isinstance(x, Tensor) and x.dim() == 2 and x.shape[1] != weight.shape[1]:
                raise RuntimeError(
                    f"fused_pool_gelu.ModelNew: x must be [batch, in_features] = [batch, "
                    f"{weight.shape[1]}] (matmul.in_features), got shape {list(x.shape)}"
                ) from error
            raise
