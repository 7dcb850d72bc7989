"""The public ops: typed, documented wrappers of torch.ops.fused_pool_gelu.

The schemas live in csrc/registration.cpp and the CPU/CUDA kernels next to them. What else torch
needs of the ops is registered on import of the package: fake kernels (_fake.py), autograd
formulas (_autograd.py) and autocast kernels (_autocast.py). Under torch.func transforms the
wrappers go through _func.py's autograd.Functions, which functorch takes.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _autograd, _func, _prepared
from ._checks import check_defined, check_int64

__all__ = ["fold", "forward", "forward_with_argmax", "model_forward", "prepare_weight"]

_ops = torch.ops.fused_pool_gelu


def _eager() -> bool:
    # Eager calls go to the ops' autograd kernels (_autograd.py) directly, skipping the
    # dispatcher's round trip into Python; torch.compile and torch.jit.trace must see the ops, and
    # autocast's kernels (_autocast.py) come before the autograd kernels.
    return (not torch._C._is_any_autocast_enabled() and not torch.compiler.is_compiling()
            and torch._C._get_tracing_state() is None)


def fold(weight: Tensor, bias: Optional[Tensor], pool_kernel_size: int) -> Tuple[Tensor, Tensor]:
    """Fold Linear(K, O) -> AvgPool1d(k) into one Linear(K, O // k).

    Returns ``(pooled_weight [O // k, K], pooled_bias [O // k])``: the means of each group of k
    consecutive rows (AvgPool1d floor: the ``O % k`` tail rows are dropped). ``pooled_bias`` is
    zeros when ``bias`` is None. Differentiable in ``weight`` and ``bias``.
    """
    check_defined("fold", "weight", weight)
    check_int64("fold", "pool_kernel_size", pool_kernel_size)
    if _func.transforms_active():
        return _func.fold(weight, bias, pool_kernel_size)
    if _eager():
        return _autograd.fold_autograd(weight, bias, pool_kernel_size)
    return _ops.fold(weight, bias, pool_kernel_size)


def prepare_weight(weight: Tensor) -> Tensor:
    """What the forward reads of the pooled weight besides the weight itself, made once.

    Returns a 1-D uint8 tensor of ``N * (128 * ceil(K / 64) + 16)`` bytes: each row of
    ``weight`` scaled by a power of two and rounded to fp16 (128-byte rows), then per row its
    scale and two norms as float32 (layout in csrc/prepared_weight.h). Pass it as
    ``prepared_weight`` to :func:`forward` with the same ``weight``: the forward's float32-accurate
    certified path (sm_90a, from 513 rows, or with a prepared weight from 257 and from 33 to one
    row per SM, on weights large enough: docs/design.md) then skips making this copy, a read of
    the whole weight, on every call. Results are the same bits
    with or without it where both calls take the same path; where the copy moves the call onto the
    certified path (from 257 to 512 rows, and from 33 to one row per SM), the one without it takes
    the 3xTF32 GEMM, both float32-accurate but rounded in different orders (the last bits of
    ``out`` can differ). It is tied to ``weight``: once ``weight`` changes in place (an
    optimizer step, ``copy_``, ``load_state_dict``), or with another weight tensor, forward raises.
    Not seen: writes through ``.data``, in-place edits of an inference tensor (made under
    ``torch.inference_mode``, which keeps no version counter), and the origin of a copy of a
    prepared weight (``clone()``, a loaded one), which is trusted to match. The layout belongs to
    this version of the package: make a new one rather than load one saved by another version.
    Not differentiable.
    """
    check_defined("prepare_weight", "weight", weight)  # as in fold
    prepared = _ops.prepare_weight(weight)
    if not torch.compiler.is_compiling():
        _prepared.record(prepared, weight)
    return prepared


def forward(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    scale: float,
    prepared_weight: Optional[Tensor] = None,
) -> Tensor:
    """``out[b] = max_n scale * gelu(x[b] . weight[n] + bias[n])`` on the pooled weight.

    x ``[B, K]`` (any strides), weight ``[N, K]`` (the pooled weight from :func:`fold`),
    bias ``[N]`` or None, prepared_weight ``prepare_weight(weight)`` or None (float32-accurate
    either way, faster with it at large batch on CUDA; where it moves the call onto the certified
    path the last bits can differ, see :func:`prepare_weight`). Exact-erf GELU; max with
    torch.max semantics (a NaN in a row makes that row NaN). Differentiable in x, weight and bias.
    """
    if _func.transforms_active():
        out = _func.forward(x, weight, bias, scale, prepared_weight)
    elif _eager():
        out = _autograd.forward_autograd(x, weight, bias, scale, prepared_weight)
    else:
        out = _ops.forward(x, weight, bias, scale, prepared_weight)
    # After the op, whose checks of the prepared weight's layout come first.
    if prepared_weight is not None and not torch.compiler.is_compiling():
        _prepared.check("forward", prepared_weight, weight)
    return out


def forward_with_argmax(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    scale: float,
    prepared_weight: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`forward` plus the arg-max index and the pre-activation there.

    Returns ``(out [B], argmax [B] int64, preactivation [B])`` with
    ``preactivation[b] = x[b] . weight[argmax[b]] + bias[argmax[b]]``. Ties go to the smallest
    index; in a row holding NaN, the first NaN. Its shape, dtype and device errors are labelled
    ``forward`` (the kernels are forward's).
    """
    if _func.transforms_active():
        outputs = _func.forward_with_argmax(x, weight, bias, scale, prepared_weight)
    elif _eager():
        outputs = _autograd.forward_with_argmax_autograd(x, weight, bias, scale, prepared_weight)
    else:
        outputs = _ops.forward_with_argmax(x, weight, bias, scale, prepared_weight)
    if prepared_weight is not None and not torch.compiler.is_compiling():
        _prepared.check("forward", prepared_weight, weight)
    return outputs


def model_forward(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    pool_kernel_size: int,
    scale: float,
    pooled_weight: Optional[Tensor] = None,
    pooled_bias: Optional[Tensor] = None,
    prepared_weight: Optional[Tensor] = None,
) -> Tensor:
    """The block on the unfolded Linear parameters: ``forward(x, *fold(weight, bias, k), scale)``.

    Same values and gradients, bit for bit, as :func:`fold` then :func:`forward`, through one
    autograd node instead of two: less host time per training step. x's and the weight's ranks
    and widths are checked as ``model_forward``'s; the rest by the op each argument goes to, whose
    name the error gives (``fold`` or ``forward``).

    ``pooled_weight`` and ``pooled_bias``: ``fold(weight, bias, pool_kernel_size)`` when the caller
    already holds it (with ``prepared_weight``, its :func:`prepare_weight` copy, if any). The
    forward then uses them instead of folding; the gradients still reach ``weight`` and ``bias``
    (the fold's backward needs none of its forward values), none reaches the given tensors. Their
    shapes, device and dtype are checked, their values are trusted: they must be that fold. Under
    autocast and torch.func transforms they are ignored (the fold is recomputed).
    """
    check_int64("model_forward", "pool_kernel_size", pool_kernel_size)
    if _func.transforms_active():
        return _func.model_forward(x, weight, bias, pool_kernel_size, scale)
    if _eager():
        out = _autograd.model_forward_autograd(x, weight, bias, pool_kernel_size, scale,
                                               pooled_weight, pooled_bias, prepared_weight)
    else:
        out = _ops.model_forward(x, weight, bias, pool_kernel_size, scale, pooled_weight,
                                 pooled_bias, prepared_weight)
    if prepared_weight is not None and not torch.compiler.is_compiling():
        _prepared.check("model_forward", prepared_weight, pooled_weight)
    return out
