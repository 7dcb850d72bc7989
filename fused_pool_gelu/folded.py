"""FoldedModel: a trained block turned into an inference-only module, as torch.nn.utils.fusion
folds a batch norm into a convolution.

Its buffers are what the forward reads: the pooled weight [O // k, K] and bias [O // k] (k times
less weight memory than the [O, K] Linear) and, on CUDA in float32, the pooled weight's
prepare_weight copy. No parameters, no fold per call, no cache to validate: a plain module that
torch.compile, torch.export and CUDA graphs take as it is.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch
from torch import Tensor, nn

from . import ops
from .model import (
    Model,
    ModelNew,
    _checked_pool_kernel_size,
    _checked_scale_factor,
    _is_plain_linear,
    pool_kernel_size_of,
)

__all__ = ["FoldedModel"]


class FoldedModel(nn.Module):
    """``out[b] = max_n scale_factor * gelu(x[b] . pooled_weight[n] + pooled_bias[n])``.

    Build it with :meth:`from_model` (a :class:`ModelNew` or :class:`Model`) or
    :meth:`from_state_dict` (their ``state_dict``), or from pooled tensors. Its ``state_dict``
    holds ``pooled_weight`` and ``pooled_bias``; ``prepared_weight`` is remade, not saved, after
    ``.to()`` / ``.cuda()`` and ``load_state_dict`` (its layout belongs to the build that makes it).
    After an in-place edit of ``pooled_weight``, call :meth:`prepare` (the forward refuses a stale
    copy). Differentiable in x only.
    """

    pooled_weight: Tensor
    pooled_bias: Tensor
    prepared_weight: Optional[Tensor]

    def __init__(self, pooled_weight: Tensor, pooled_bias: Tensor, scale_factor: float):
        super().__init__()
        if isinstance(scale_factor, Tensor):
            raise TypeError("fused_pool_gelu.FoldedModel: scale_factor must be a real number, "
                            "got a tensor")
        self.scale_factor = float(_checked_scale_factor(scale_factor))
        self.register_buffer("pooled_weight", pooled_weight.detach().clone())
        self.register_buffer("pooled_bias", pooled_bias.detach().clone())
        self.register_buffer("prepared_weight", None, persistent=False)
        self.register_load_state_dict_post_hook(lambda module, keys: module.prepare())
        self.prepare()

    @classmethod
    def from_model(cls, model: nn.Module) -> "FoldedModel":
        """The block of a :class:`ModelNew` or :class:`Model` with its current parameters, folded
        once (on their device and dtype)."""
        if not isinstance(model, (Model, ModelNew)):
            raise TypeError(
                f"fused_pool_gelu.FoldedModel.from_model: model must be a fused_pool_gelu.Model "
                f"or ModelNew, got {type(model).__name__}"
            )
        if not _is_plain_linear(model.matmul) or isinstance(model.scale_factor, Tensor):
            raise ValueError(
                "fused_pool_gelu.FoldedModel.from_model: the model's matmul must be a plain "
                "nn.Linear without hooks and its scale_factor a number: the fold cannot express "
                f"anything else (matmul: {type(model.matmul).__name__}, scale_factor: "
                f"{type(model.scale_factor).__name__})"
            )
        kernel_size = pool_kernel_size_of(model)
        with torch.no_grad():
            pooled_weight, pooled_bias = ops.fold(model.matmul.weight, model.matmul.bias,
                                                  kernel_size)
        return cls(pooled_weight, pooled_bias, model.scale_factor)

    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, Tensor], pool_kernel_size: int,
                        scale_factor: float) -> "FoldedModel":
        """From a :class:`Model` / :class:`ModelNew` ``state_dict`` (``matmul.weight``, and
        ``matmul.bias`` unless the Linear has none)."""
        if "matmul.weight" not in state_dict:
            raise KeyError(
                "fused_pool_gelu.FoldedModel.from_state_dict: state_dict must hold "
                f"'matmul.weight', got keys {sorted(state_dict)}"
            )
        kernel_size = _checked_pool_kernel_size(pool_kernel_size)
        with torch.no_grad():
            pooled_weight, pooled_bias = ops.fold(state_dict["matmul.weight"],
                                                  state_dict.get("matmul.bias"), kernel_size)
        return cls(pooled_weight, pooled_bias, scale_factor)

    def prepare(self) -> None:
        """(Re)makes ``prepared_weight`` for the current ``pooled_weight``: on CUDA in float32,
        where the certified path reads it; None elsewhere."""
        weight = self.pooled_weight
        with torch.no_grad():
            self.prepared_weight = (
                ops.prepare_weight(weight)
                if weight.is_cuda and weight.dtype == torch.float32
                else None
            )

    def _apply(self, fn, *args, **kwargs):
        # .to() / .cuda() / .half() make new buffers: the copy is tied to the tensor it was made
        # from, so it is made again (a moved copy would be refused as stale).
        self.prepared_weight = None
        module = super()._apply(fn, *args, **kwargs)
        self.prepare()
        return module

    def forward(self, x: Tensor) -> Tensor:
        return ops.forward(x, self.pooled_weight, self.pooled_bias, self.scale_factor,
                           self.prepared_weight)

    def extra_repr(self) -> str:
        features, in_features = self.pooled_weight.shape
        return (f"in_features={in_features}, pooled_features={features}, "
                f"scale_factor={self.scale_factor}")
