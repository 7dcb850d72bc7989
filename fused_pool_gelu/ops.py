"""The operator contract, Python side: wrappers, fake (meta) kernels and autograd formulas.

The schemas live in csrc/registration.cpp and the CPU/CUDA kernels next to them; this file is
everything else torch needs: shapes for tracing (register_fake) and derivatives
(register_autograd). The derivatives use the arg-max backward of DESIGN.md: no dense GEMM.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

__all__ = ["fold", "forward", "forward_with_argmax", "model_forward", "prepare_weight"]

_ops = torch.ops.fused_pool_gelu


def fold(weight: Tensor, bias: Optional[Tensor], pool_kernel_size: int) -> Tuple[Tensor, Tensor]:
    """Fold Linear(K, O) -> AvgPool1d(k) into one Linear(K, O // k).

    Returns ``(pooled_weight [O // k, K], pooled_bias [O // k])``: the means of each group of k
    consecutive rows (AvgPool1d floor: the ``O % k`` tail rows are dropped). ``pooled_bias`` is
    zeros when ``bias`` is None. Differentiable in ``weight`` and ``bias``.
    """
    # With no tensor at all the dispatcher would fail before any check, naming no argument.
    _check_defined("fold", "weight", weight)
    return _ops.fold(weight, bias, pool_kernel_size)


def prepare_weight(weight: Tensor) -> Tensor:
    """What the forward reads of the pooled weight besides the weight itself, made once.

    Returns a 1-D uint8 tensor of ``N * (128 * ceil(K / 64) + 16)`` bytes: each row of
    ``weight`` scaled by a power of two and rounded to fp16 (128-byte rows), then per row its
    scale and two norms as float32 (layout in csrc/prepared_weight.h). Pass it as
    ``prepared_weight`` to :func:`forward` with the same ``weight``: the forward's float32-accurate
    certified path (sm_90a, from 513 rows, or with a prepared weight from 257 and from 33 to one
    row per SM, on weights large enough: README, ``FUSED_POOL_GELU_CERTIFIED``) then skips making
    this copy on every call (~8-10 us at K = 8192, N = 512 on an H200). Results are the same bits
    with or without it where both calls take the same path; where the copy moves the call onto the
    certified path (from 257 to 512 rows, and from 33 to one row per SM), the one without it takes
    the 3xTF32 GEMM, both float32-accurate but rounded in different orders (the last bits of
    ``out`` can differ). It is tied to ``weight``: once ``weight`` changes in place (an
    optimizer step, ``copy_``, ``load_state_dict``), or with another weight tensor, forward raises.
    Not seen: writes through ``.data``, in-place edits of an inference tensor (made under
    ``torch.inference_mode``, which keeps no version counter), and the origin of a copy of a
    prepared weight (``clone()``, a loaded one), which is trusted to match. The layout belongs to
    this version of the package (it changed in 0.1.0's development): make a new one rather than
    load one saved by another version. Not differentiable.
    """
    _check_defined("prepare_weight", "weight", weight)  # as in fold
    return _ops.prepare_weight(weight)


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
    return _ops.forward(x, weight, bias, scale, prepared_weight)


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
    return _ops.forward_with_argmax(x, weight, bias, scale, prepared_weight)


def model_forward(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], pool_kernel_size: int, scale: float
) -> Tensor:
    """The block on the unfolded Linear parameters: ``forward(x, *fold(weight, bias, k), scale)``.

    Same values and gradients, bit for bit, as :func:`fold` then :func:`forward`, through one C++
    autograd node (csrc/model_forward.cpp) instead of two Python ones: less host time per training
    step. x's and the weight's ranks and widths are checked as ``model_forward``'s; the rest by the
    op each argument goes to, whose name the error gives (``fold`` or ``forward``).
    """
    return _ops.model_forward(x, weight, bias, pool_kernel_size, scale)


# ----------------------------------------------------------------------------------------------
# Fake kernels: output metadata only, with the shape, device and dtype checks of csrc/checks.h so
# that tracing fails the way eager does. They also serve as the Meta kernels, which the dispatcher
# picks when any input is a meta tensor: without the device checks a meta bias beside a CPU x
# would return an uninitialised CPU tensor instead of an error.


def _check(cond, message):
    torch._check(cond, lambda: f"fused_pool_gelu.{message}")


def _check_defined(op, name, t):
    # csrc/checks.h's check_defined: None for a required tensor (the kernels get an undefined one).
    # A plain raise, not torch._check: the public wrappers call this too, and Dynamo (torch 2.11)
    # cannot trace torch._check's message closure there (a graph break, an error under
    # fullgraph=True). `t is None` is a constant while tracing, so this costs the graph nothing.
    if t is None:
        raise RuntimeError(f"fused_pool_gelu.{op}: {name} must be a tensor, got None")


# c10's names for the dtypes, as csrc/checks.h's messages print them.
_SCALAR_TYPE_NAMES = {
    torch.float32: "Float", torch.float64: "Double", torch.float16: "Half",
    torch.bfloat16: "BFloat16", torch.int64: "Long", torch.int32: "Int", torch.uint8: "Byte",
    torch.bool: "Bool",
}


def _dtype_name(dtype):
    return _SCALAR_TYPE_NAMES.get(dtype, str(dtype))


def _check_same_device(op, name, t, ref_name, ref):
    _check(
        t.device == ref.device,
        f"{op}: {name} must be on the same device as {ref_name} ({ref.device}), got {t.device}",
    )


def _check_same_dtype(op, name, t, ref_name, ref):
    # As csrc/checks.h's: where the dtypes differ, a non-floating ref is the one named.
    _check(
        t.dtype == ref.dtype or ref.dtype.is_floating_point,
        f"{op}: {ref_name} must be a floating-point tensor, got {_dtype_name(ref.dtype)}",
    )
    _check(
        t.dtype == ref.dtype,
        f"{op}: {name} must have the same dtype as {ref_name} ({_dtype_name(ref.dtype)}), got "
        f"{_dtype_name(t.dtype)}",
    )


@torch.library.register_fake("fused_pool_gelu::fold")
def _fold_fake(weight, bias, pool_kernel_size):
    _check_defined("fold", "weight", weight)
    _check(
        weight.dim() == 2,
        f"fold: weight must be 2-D [out_features, in_features], got shape {list(weight.shape)}",
    )
    _check(pool_kernel_size >= 1, f"fold: pool_kernel_size must be >= 1, got {pool_kernel_size}")
    _check(
        pool_kernel_size <= weight.shape[0],
        f"fold: pool_kernel_size must be <= out_features ({weight.shape[0]}) so that at least one "
        f"pooled feature exists, got {pool_kernel_size}",
    )
    if bias is not None:
        _check(
            bias.dim() == 1 and bias.shape[0] == weight.shape[0],
            f"fold: bias must be 1-D [out_features] = [{weight.shape[0]}], "
            f"got shape {list(bias.shape)}",
        )
        _check_same_device("fold", "bias", bias, "weight", weight)
        _check_same_dtype("fold", "bias", bias, "weight", weight)
    pooled = weight.shape[0] // pool_kernel_size
    return weight.new_empty((pooled, weight.shape[1])), weight.new_empty((pooled,))


def _check_unfolded_shape(op, name, pooled, out_features, pool_kernel_size):
    _check(pool_kernel_size >= 1, f"{op}: pool_kernel_size must be >= 1, got {pool_kernel_size}")
    _check(out_features >= 0, f"{op}: out_features must be >= 0, got {out_features}")
    rows = out_features // pool_kernel_size
    _check(
        rows == pooled.shape[0],
        f"{op}: {name} must have out_features // pool_kernel_size = {rows} rows, got shape "
        f"{list(pooled.shape)}",
    )


@torch.library.register_fake("fused_pool_gelu::fold_backward")
def _fold_backward_fake(grad_pooled_weight, grad_pooled_bias, out_features, pool_kernel_size):
    op = "fold_backward"
    _check_defined(op, "grad_pooled_weight", grad_pooled_weight)
    _check(
        grad_pooled_weight.dim() == 2,
        f"{op}: grad_pooled_weight must be 2-D [pooled_features, in_features], got shape "
        f"{list(grad_pooled_weight.shape)}",
    )
    _check_unfolded_shape(op, "grad_pooled_weight", grad_pooled_weight, out_features,
                          pool_kernel_size)
    rows = grad_pooled_weight.shape[0]
    _check_defined(op, "grad_pooled_bias", grad_pooled_bias)
    _check(
        grad_pooled_bias.dim() == 1 and grad_pooled_bias.shape[0] == rows,
        f"{op}: grad_pooled_bias must be 1-D [pooled_features] = [{rows}], got shape "
        f"{list(grad_pooled_bias.shape)}",
    )
    _check_same_device(op, "grad_pooled_bias", grad_pooled_bias, "grad_pooled_weight",
                       grad_pooled_weight)
    _check_same_dtype(op, "grad_pooled_bias", grad_pooled_bias, "grad_pooled_weight",
                      grad_pooled_weight)
    return (
        grad_pooled_weight.new_empty((out_features, grad_pooled_weight.shape[1])),
        grad_pooled_weight.new_empty((out_features,)),
    )


def _check_x_and_weight(op, x, weight_name, weight, layout):
    # csrc/checks.h's check_x_and_weight: ranks and K, the weight's rows named by `layout`.
    _check_defined(op, "x", x)
    _check_defined(op, weight_name, weight)
    _check(x.dim() == 2, f"{op}: x must be 2-D [batch, in_features], got shape {list(x.shape)}")
    _check(
        weight.dim() == 2,
        f"{op}: {weight_name} must be 2-D {layout}, got shape {list(weight.shape)}",
    )
    _check(
        weight.shape[1] == x.shape[1],
        f"{op}: {weight_name} must be {layout} with in_features = x.size(1) = {x.shape[1]}, got "
        f"shape {list(weight.shape)}",
    )


def _check_forward_shapes(x, weight, bias, op="forward", weight_name="weight"):
    # op and weight_name: as check_forward_inputs' (the backward ops check the same inputs).
    _check_x_and_weight(op, x, weight_name, weight, "[pooled_features, in_features]")
    _check(
        weight.shape[0] >= 1,
        f"{op}: {weight_name} must have at least one row (pooled feature) to take the max over, "
        f"got shape {list(weight.shape)}",
    )
    _check_same_device(op, weight_name, weight, "x", x)
    _check_same_dtype(op, weight_name, weight, "x", x)
    if bias is not None:
        _check(
            bias.dim() == 1 and bias.shape[0] == weight.shape[0],
            f"{op}: bias must be 1-D [pooled_features] = [{weight.shape[0]}], "
            f"got shape {list(bias.shape)}",
        )
        _check_same_device(op, "bias", bias, "x", x)
        _check_same_dtype(op, "bias", bias, "x", x)


def _check_batch_vectors(op, x, optional=(), **vectors):
    # As check_forward_backward_inputs: on x's device; argmax int64, the others x's dtype. Those
    # named in `optional` may be None.
    batch = x.shape[0]
    for name, t in vectors.items():
        if name not in optional:
            _check_defined(op, name, t)
        if t is not None:
            _check(
                t.dim() == 1 and t.shape[0] == batch,
                f"{op}: {name} must be 1-D [batch] = [{batch}], got shape {list(t.shape)}",
            )
            _check_same_device(op, name, t, "x", x)
            if name == "argmax":
                _check(t.dtype == torch.int64,
                       f"{op}: argmax must be int64, got {_dtype_name(t.dtype)}")
            else:
                _check_same_dtype(op, name, t, "x", x)


def _prepared_bytes(rows, in_features):
    # csrc/prepared_weight.h: the fp16 copy in 128-byte rows, then 16 bytes per row (scale, norms).
    return rows * (128 * ((in_features + 63) // 64) + 16)


def _check_prepared_shape(weight, prepared_weight):
    if prepared_weight is None:
        return
    size = _prepared_bytes(weight.shape[0], weight.shape[1])
    _check(
        prepared_weight.device == weight.device,
        f"forward: prepared_weight must be on weight's device ({weight.device}), got "
        f"{prepared_weight.device}",
    )
    _check(
        prepared_weight.dtype == torch.uint8,
        f"forward: prepared_weight must be uint8 (made by fused_pool_gelu.prepare_weight), got "
        f"{_dtype_name(prepared_weight.dtype)}",
    )
    _check(
        prepared_weight.dim() == 1 and prepared_weight.shape[0] == size,
        f"forward: prepared_weight must be 1-D [pooled_features * (128 * ceil(in_features / 64) "
        f"+ 16)] = [{size}] for weight of shape {list(weight.shape)}, got shape "
        f"{list(prepared_weight.shape)}",
    )


@torch.library.register_fake("fused_pool_gelu::forward_with_argmax")
def _forward_with_argmax_fake(x, weight, bias, scale, prepared_weight=None):
    _check_forward_shapes(x, weight, bias)
    _check_prepared_shape(weight, prepared_weight)
    batch = x.shape[0]
    return x.new_empty((batch,)), x.new_empty((batch,), dtype=torch.long), x.new_empty((batch,))


@torch.library.register_fake("fused_pool_gelu::forward")
def _forward_fake(x, weight, bias, scale, prepared_weight=None):
    _check_forward_shapes(x, weight, bias)
    _check_prepared_shape(weight, prepared_weight)
    return x.new_empty((x.shape[0],))


@torch.library.register_fake("fused_pool_gelu::prepare_weight")
def _prepare_weight_fake(weight):
    _check_defined("prepare_weight", "weight", weight)
    _check(
        weight.dim() == 2,
        f"prepare_weight: weight must be 2-D [pooled_features, in_features], got shape "
        f"{list(weight.shape)}",
    )
    size = _prepared_bytes(weight.shape[0], weight.shape[1])
    return weight.new_empty((size,), dtype=torch.uint8)


def _check_model_forward_inputs(x, weight):
    # csrc/checks.h's check_model_forward_inputs.
    _check_x_and_weight("model_forward", x, "weight", weight, "[out_features, in_features]")


@torch.library.register_fake("fused_pool_gelu::model_forward")
def _model_forward_fake(x, weight, bias, pool_kernel_size, scale):
    _check_model_forward_inputs(x, weight)
    pooled_weight, pooled_bias = _fold_fake(weight, bias, pool_kernel_size)
    return _forward_fake(x, pooled_weight, pooled_bias, scale)


@torch.library.register_fake("fused_pool_gelu::forward_backward")
def _forward_backward_fake(grad_out, grad_preactivation, x, weight, argmax, preactivation, scale):
    op = "forward_backward"
    _check_forward_shapes(x, weight, None, op)
    _check_batch_vectors(op, x, optional=("grad_out", "grad_preactivation"), argmax=argmax,
                         preactivation=preactivation, grad_out=grad_out,
                         grad_preactivation=grad_preactivation)
    return (
        x.new_empty(x.shape),
        weight.new_empty(weight.shape),
        weight.new_empty((weight.shape[0],)),
    )


@torch.library.register_fake("fused_pool_gelu::model_backward")
def _model_backward_fake(
    grad_out, x, pooled_weight, argmax, preactivation, scale, out_features, pool_kernel_size
):
    op = "model_backward"
    _check_forward_shapes(x, pooled_weight, None, op, "pooled_weight")
    _check_batch_vectors(op, x, argmax=argmax, preactivation=preactivation, grad_out=grad_out)
    _check_unfolded_shape(op, "pooled_weight", pooled_weight, out_features, pool_kernel_size)
    return (
        x.new_empty(x.shape),
        pooled_weight.new_empty((out_features, pooled_weight.shape[1])),
        pooled_weight.new_empty((out_features,)),
    )


# ----------------------------------------------------------------------------------------------
# Autograd. fold and fold_backward are adjoint linear maps, so each is the other's derivative
# (double backward of the fold comes for free). forward_with_argmax's derivative is the arg-max
# backward; `forward`'s autograd kernel (csrc/registration.cpp) goes through forward_with_argmax
# when a gradient is needed and straight to the device kernel otherwise. model_forward's autograd
# kernel is C++ (csrc/model_forward.cpp): the same derivatives in one node.


def _fold_setup_context(ctx, inputs, output):
    weight, bias, pool_kernel_size = inputs
    ctx.out_features = weight.shape[0]
    ctx.pool_kernel_size = pool_kernel_size
    ctx.has_bias = bias is not None


def _fold_backward(ctx, grad_pooled_weight, grad_pooled_bias):
    grad_weight, grad_bias = _ops.fold_backward(
        grad_pooled_weight, grad_pooled_bias, ctx.out_features, ctx.pool_kernel_size
    )
    return grad_weight, (grad_bias if ctx.has_bias else None), None


torch.library.register_autograd(
    "fused_pool_gelu::fold", _fold_backward, setup_context=_fold_setup_context
)


def _fold_backward_setup_context(ctx, inputs, output):
    ctx.pool_kernel_size = inputs[3]


def _fold_backward_backward(ctx, grad_grad_weight, grad_grad_bias):
    ggw, ggb = _ops.fold(grad_grad_weight, grad_grad_bias, ctx.pool_kernel_size)
    return ggw, ggb, None, None


torch.library.register_autograd(
    "fused_pool_gelu::fold_backward",
    _fold_backward_backward,
    setup_context=_fold_backward_setup_context,
)


def _forward_setup_context(ctx, inputs, output):
    x, weight, bias, scale, _prepared_weight = inputs
    _, argmax, preactivation = output
    ctx.save_for_backward(x, weight, argmax, preactivation)
    ctx.scale = scale
    ctx.has_bias = bias is not None


def _forward_backward(ctx, grad_out, grad_argmax, grad_preactivation):
    x, weight, argmax, preactivation = ctx.saved_tensors
    grad_x, grad_weight, grad_bias = _ops.forward_backward(
        grad_out, grad_preactivation, x, weight, argmax, preactivation, ctx.scale
    )
    return grad_x, grad_weight, (grad_bias if ctx.has_bias else None), None, None


torch.library.register_autograd(
    "fused_pool_gelu::forward_with_argmax",
    _forward_backward,
    setup_context=_forward_setup_context,
)


def _forward_backward_backward(ctx, *grads):
    raise RuntimeError(
        "fused_pool_gelu.forward_backward: double backward (gradients of gradients of forward) "
        "is not supported"
    )


torch.library.register_autograd(
    "fused_pool_gelu::forward_backward",
    _forward_backward_backward,
    setup_context=lambda ctx, inputs, output: None,
)


def _model_backward_backward(ctx, *grads):
    raise RuntimeError(
        "fused_pool_gelu.model_backward: double backward (gradients of gradients of model_forward) "
        "is not supported"
    )


torch.library.register_autograd(
    "fused_pool_gelu::model_backward",
    _model_backward_backward,
    setup_context=lambda ctx, inputs, output: None,
)


# ----------------------------------------------------------------------------------------------
# Autocast. The reference block's Linear runs in autocast's lower-precision dtype (bfloat16 or
# float16) and everything after it stays in that dtype, so under autocast forward_with_argmax casts
# its floating inputs to the autocast dtype of their device and returns outputs in that dtype
# (accumulating in float32 inside). fold is a mean, which autocast leaves alone, like AvgPool1d.
# model_forward under autocast is fold then forward, the ops one by one: float32 pooled parameters
# that forward_with_argmax's autocast kernel casts (and autograd through the casts).


def autocast_cast(t, dtype):
    """Autocast's rule for the fused op's inputs: floating tensors other than float64 take
    `dtype` (None: autocast off); anything else passes."""
    if dtype is None or t is None or not t.is_floating_point() or t.dtype == torch.float64:
        return t
    return t.to(dtype)


def _make_autocast_kernel(device_type):
    def kernel(keyset, x, weight, bias, scale, prepared_weight=None):
        dtype = torch.get_autocast_dtype(device_type)

        def cast(t):
            return autocast_cast(t, dtype)

        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS):
            cast_weight = cast(weight)
            # prepared_weight is tied to the uncast weight (a cast one is another tensor), and
            # only the float32 path reads it: dropped when weight is cast.
            if cast_weight is not weight:
                prepared_weight = None
            return _ops.forward_with_argmax(
                cast(x), cast_weight, cast(bias), scale, prepared_weight
            )

    return kernel


_AUTOCAST_KEYS = torch._C.DispatchKeySet(
    torch._C.DispatchKey.AutocastCPU
) | torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCUDA)
_autocast_lib = torch.library.Library("fused_pool_gelu", "IMPL")


def _model_forward_autocast(x, weight, bias, pool_kernel_size, scale):
    # Through the public wrappers, as ModelNew's other paths call the ops (and as
    # test_model_new_folds_in_float32_under_autocast observes them), after model_forward's own
    # checks (its C++ kernels', which this path does not reach).
    _check_model_forward_inputs(x, weight)
    return forward(x, *fold(weight, bias, pool_kernel_size), scale)


for _device_type, _key in (("cpu", "AutocastCPU"), ("cuda", "AutocastCUDA")):
    _autocast_lib.impl(
        "forward_with_argmax", _make_autocast_kernel(_device_type), _key, with_keyset=True
    )
    _autocast_lib.impl("model_forward", _model_forward_autocast, _key)
