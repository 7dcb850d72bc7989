"""The reference block (KernelBench level 2 #98) and its drop-in replacement."""

from __future__ import annotations

import copy
import weakref
from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from . import ops

__all__ = ["Model", "ModelNew"]


def _checked_pool_kernel_size(pool_kernel_size) -> int:
    if int(pool_kernel_size) != pool_kernel_size or pool_kernel_size < 1:
        raise ValueError(f"pool_kernel_size must be a positive integer, got {pool_kernel_size!r}")
    return int(pool_kernel_size)


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
        x = self.matmul(x)
        x = self.avg_pool(x.unsqueeze(1)).squeeze(1)
        x = torch.nn.functional.gelu(x)
        x = x * self.scale_factor
        x = torch.max(x, dim=1).values
        return x


class ModelNew(nn.Module):
    """Drop-in replacement for :class:`Model`: same constructor, parameters and state_dict.

    The pooling is folded into the weight (``ops.fold``) and the rest runs as one fused op
    (``ops.forward``). When no gradient is needed, the folded weight (with, on CUDA in float32,
    its ``ops.prepare_weight`` copy) is cached and refolded only after ``matmul.weight`` or
    ``matmul.bias`` change (optimizer step, in-place edit, ``load_state_dict``, ``.to()``),
    detected through the parameters' identity, storage pointer and version counter (no host sync
    per call), or ``pool_kernel_size`` does. Edits through ``.data`` bypass the version counter; call
    :meth:`invalidate_fold` after such an edit. When gradients are needed (training), the fold is
    recorded in the autograd graph each call so that weight and bias get their gradients: eagerly
    and under CUDA-graph capture through ``ops.model_forward`` (fold and forward as one autograd
    node), under torch.compile through ``ops.fold`` then ``ops.forward``.
    """

    def __init__(self, in_features, out_features, pool_kernel_size, scale_factor):
        super().__init__()
        pool_kernel_size = _checked_pool_kernel_size(pool_kernel_size)
        # Created exactly as Model creates it, so the same seed gives the same parameters.
        self.matmul = nn.Linear(in_features, out_features)
        self.pool_kernel_size = pool_kernel_size
        self.scale_factor = scale_factor
        self._fold_cache: Optional[tuple] = None

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
        new._fold_cache = None
        return new

    def extra_repr(self) -> str:
        return f"pool_kernel_size={self.pool_kernel_size}, scale_factor={self.scale_factor}"

    def invalidate_fold(self) -> None:
        """Drop the cached folded weight (needed only after edits through ``.data``)."""
        self._fold_cache = None

    def folded_parameters(self) -> Tuple[Tensor, Tensor]:
        """(pooled_weight, pooled_bias) for the current parameters, from the cache when valid."""
        linear = self.matmul
        return self._folded(linear.weight, linear.bias)[:2]

    @staticmethod
    def _stamp(weight: Tensor, bias: Optional[Tensor]) -> tuple:
        # A parameter is unchanged while it is the same object over the same storage with the same
        # version counter (every in-place op, optimizer steps and load_state_dict included, bumps
        # it).
        # One flat tuple: this runs at every inference call, and host time counts at small batch.
        if bias is None:
            return (weight.data_ptr(), weight._version, weight.dtype, weight.device)
        return (weight.data_ptr(), weight._version, weight.dtype, weight.device,
                bias.data_ptr(), bias._version, bias.dtype, bias.device)

    def _folded(
        self, weight: Tensor, bias: Optional[Tensor]
    ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """(pooled_weight, pooled_bias, prepared_weight or None), from the cache when valid."""
        cache = self._fold_cache
        # A plain attribute (as Model's avg_pool.kernel_size): it may change, like the weight.
        pool_kernel_size = self.pool_kernel_size
        if cache is not None:
            weight_ref, bias_ref, cached_pool_kernel_size, stamp, folded = cache
            cached_bias = None if bias_ref is None else bias_ref()
            same_objects = weight_ref() is weight and cached_bias is bias
            if (same_objects and cached_pool_kernel_size == pool_kernel_size
                    and stamp == self._stamp(weight, bias)):
                return folded
        # Plain tensors even when called under inference_mode: a frozen model cached there must
        # still serve later calls whose x requires grad (autograd cannot save inference tensors).
        with torch.inference_mode(False), torch.no_grad():
            pooled_weight, pooled_bias = ops.fold(weight, bias, pool_kernel_size)
            # Only the CUDA float32 forward reads the prepared copy (half the pooled weight's
            # bytes); it is made once here instead of in every large-batch call.
            prepared_weight = (
                ops.prepare_weight(pooled_weight)
                if pooled_weight.is_cuda and pooled_weight.dtype == torch.float32
                else None
            )
        folded = (pooled_weight, pooled_bias, prepared_weight)
        # One assignment of a whole entry: concurrent callers see either the old or the new one.
        self._fold_cache = (
            weakref.ref(weight),
            None if bias is None else weakref.ref(bias),
            pool_kernel_size,
            self._stamp(weight, bias),
            folded,
        )
        return folded

    def _apply(self, fn, *args, **kwargs):
        # .to() / .half() / .cuda() may swap storages through `param.data = ...`, which keeps the
        # version counter, and a caching allocator can hand the old address back: refold.
        self._fold_cache = None
        return super()._apply(fn, *args, **kwargs)

    @staticmethod
    def _capturing() -> bool:
        # A captured fold runs at each replay, so the graph follows parameter updates; a cache
        # filled during capture would hold values that exist only after the first replay.
        return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()

    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling():
            # Traced graphs cannot read version counters, and they trace the ops through their
            # fake kernels and Python autograd formulas: the fold becomes part of the graph.
            linear = self.matmul
            pooled_weight, pooled_bias = ops.fold(linear.weight, linear.bias, self.pool_kernel_size)
            return ops.forward(x, pooled_weight, pooled_bias, self.scale_factor)
        # nn.Module's attribute lookups go through __getattr__, about a microsecond of host time
        # each (3.6 us for these three, against a 7 us op at B = 1 on a CPU): the registered
        # parameters are read from the module's dicts. A parameter that is not a registered one
        # (torch.nn.utils.parametrize's property, an old weight_norm's plain tensor) takes the
        # attribute lookup, as before, and so does a `matmul` that is not a registered submodule
        # (a subclass's property).
        linear = self._modules.get("matmul")
        if linear is None:
            linear = self.matmul
        params = linear._parameters
        weight = params.get("weight")
        if weight is None:
            weight = linear.weight
        bias = params["bias"] if "bias" in params else linear.bias
        if torch.is_grad_enabled() and (
            weight.requires_grad or (bias is not None and bias.requires_grad)
        ):
            # Training, eager or captured in a CUDA graph: the fold must be in the autograd graph
            # for weight and bias to get gradients; model_forward records fold and forward as one
            # C++ node (less host time than the two ops' Python autograd nodes, same bits), whose
            # backward is model_backward.
            return ops.model_forward(x, weight, bias, self.pool_kernel_size, self.scale_factor)
        if self._capturing():
            pooled_weight, pooled_bias = ops.fold(weight, bias, self.pool_kernel_size)
            return ops.forward(x, pooled_weight, pooled_bias, self.scale_factor)
        pooled_weight, pooled_bias, prepared_weight = self._folded(weight, bias)
        return ops.forward(x, pooled_weight, pooled_bias, self.scale_factor, prepared_weight)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_fold_cache"] = None  # holds weak references, which do not pickle
        return state
