"""The ops' autograd kernels: their derivatives, and the refusal of forward-mode AD.

The compiled library holds only device kernels (the LibTorch stable ABI has no autograd), so every
op's Autograd-key kernel is registered here, but for model_forward's where the wheel holds a C++
node built for the running torch (csrc/autograd_node/: ModelNew's training step, whose host time
counts at small batch; `MODEL_FORWARD_NODE` says which one runs). Each one first refuses a
forward-mode tangent on any tensor argument (the ops have no forward-mode formula: a tangent
reaching a kernel would be dropped, the result's tangent silently zero; torch.func's jvp shows its
tangents at this key and not below it), then either records one autograd node (grad mode on and an
input requiring grad) or calls the device kernel below autograd. The public wrappers (ops.py)
call the kernels of fold, forward, forward_with_argmax and model_forward directly when eager: the
same work without the dispatcher's round trip into Python, host time that counts at small batch.

fold and fold_backward are adjoint linear maps, so each is the other's derivative (double backward
of the fold comes for free). forward_with_argmax's derivative is the arg-max backward (no dense
GEMM); forward goes through forward_with_argmax when a gradient is needed. model_forward is fold
and forward_with_argmax in one node (forward_with_argmax alone on a fold the caller gives) whose
backward is model_backward; that node's forward calls _model_forward_with_argmax, which folds and
returns what the node saves. _model_forward_and_fold is the same node returning the fold it made
as well (no gradient flows through it), for ModelNew's cache after a parameter update.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from pathlib import Path

import torch
from torch import _C
from torch.autograd import forward_ad

from . import _C as _extension
from ._checks import check_model_forward_folded, check_model_forward_inputs

_ops = torch.ops.fused_pool_gelu
_lib = torch.library.Library("fused_pool_gelu", "IMPL")
_below_autograd = _C._AutoDispatchBelowADInplaceOrView
# The overloads themselves: a call through the packet (torch.ops.fused_pool_gelu.fold) adds a
# Python frame, host time on every call at small batch.
_fold = _ops.fold.default
_forward = _ops.forward.default
_forward_with_argmax = _ops.forward_with_argmax.default
_model_backward = _ops.model_backward.default
_model_forward_with_argmax = _ops._model_forward_with_argmax.default
_forward_backward = _ops.forward_backward.default

FORWARD_DOUBLE_BACKWARD_ERROR = (
    "fused_pool_gelu.forward_backward: double backward (gradients of gradients of forward) is not "
    "supported"
)


def tangent_error(op: str, name: str) -> RuntimeError:
    return RuntimeError(
        f"fused_pool_gelu.{op}: {name} carries a forward-mode AD tangent; forward-mode AD "
        "(torch.func.jvp, jacfwd, torch.autograd.forward_ad) is not supported, use reverse mode "
        "(backward, torch.autograd.grad)"
    )


def _check_no_tangents(op: str, names, tensors) -> None:
    # Two flag reads when no forward-mode AD is active, as on every training and inference call.
    level = forward_ad._current_level
    if level < 0 and not _C._are_functorch_transforms_active():
        return
    for name, t in zip(names, tensors):
        if t is not None and torch._unpack_dual(t, max(level, 0))[1] is not None:
            raise tangent_error(op, name)


def _needs_grad(*tensors) -> bool:
    return _C.is_grad_enabled() and _C._any_requires_grad(*tensors)


def _call_in_backward(op, *args):
    # With create_graph (grad mode on in a backward) through the op's autograd kernel, which
    # records the gradient's own derivative or raises a clear error; otherwise straight to the
    # device kernel.
    if _C.is_grad_enabled():
        return op(*args)
    with _below_autograd():
        return op(*args)


class _Fold(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, bias, pool_kernel_size):
        ctx.out_features = weight.shape[0]
        ctx.pool_kernel_size = pool_kernel_size
        ctx.has_bias = bias is not None
        with _below_autograd():
            return _fold(weight, bias, pool_kernel_size)

    @staticmethod
    def backward(ctx, grad_pooled_weight, grad_pooled_bias):
        grad_weight, grad_bias = _call_in_backward(
            _ops.fold_backward, grad_pooled_weight, grad_pooled_bias, ctx.out_features,
            ctx.pool_kernel_size,
        )
        return grad_weight, (grad_bias if ctx.has_bias else None), None


def fold_autograd(weight, bias, pool_kernel_size):
    _check_no_tangents("fold", ("weight", "bias"), (weight, bias))
    if _needs_grad(weight, bias):
        return _Fold.apply(weight, bias, pool_kernel_size)
    with _below_autograd():
        return _fold(weight, bias, pool_kernel_size)


class _FoldBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, grad_pooled_weight, grad_pooled_bias, out_features, pool_kernel_size):
        ctx.pool_kernel_size = pool_kernel_size
        with _below_autograd():
            return _ops.fold_backward(grad_pooled_weight, grad_pooled_bias, out_features,
                                      pool_kernel_size)

    @staticmethod
    def backward(ctx, grad_grad_weight, grad_grad_bias):
        ggw, ggb = _call_in_backward(_ops.fold, grad_grad_weight, grad_grad_bias,
                                     ctx.pool_kernel_size)
        return ggw, ggb, None, None


def _fold_backward_autograd(grad_pooled_weight, grad_pooled_bias, out_features, pool_kernel_size):
    tensors = (grad_pooled_weight, grad_pooled_bias)
    _check_no_tangents("fold_backward", ("grad_pooled_weight", "grad_pooled_bias"), tensors)
    if _needs_grad(*tensors):
        return _FoldBackward.apply(*tensors, out_features, pool_kernel_size)
    with _below_autograd():
        return _ops.fold_backward(*tensors, out_features, pool_kernel_size)


class _ForwardWithArgmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, scale, prepared_weight):
        with _below_autograd():
            out, argmax, preactivation = _forward_with_argmax(
                x, weight, bias, scale, prepared_weight
            )
        ctx.save_for_backward(x, weight, argmax, preactivation)
        ctx.scale = scale
        ctx.has_bias = bias is not None
        return out, argmax, preactivation

    @staticmethod
    def backward(ctx, grad_out, grad_argmax, grad_preactivation):
        x, weight, argmax, preactivation = ctx.saved_tensors
        grad_x, grad_weight, grad_bias = _call_in_backward(
            _ops.forward_backward, grad_out, grad_preactivation, x, weight, argmax, preactivation,
            ctx.scale,
        )
        return grad_x, grad_weight, (grad_bias if ctx.has_bias else None), None, None


_FORWARD_TENSORS = ("x", "weight", "bias", "prepared_weight")


def forward_with_argmax_autograd(x, weight, bias, scale, prepared_weight=None):
    _check_no_tangents("forward_with_argmax", _FORWARD_TENSORS, (x, weight, bias, prepared_weight))
    if _needs_grad(x, weight, bias):
        return _ForwardWithArgmax.apply(x, weight, bias, scale, prepared_weight)
    with _below_autograd():
        return _forward_with_argmax(x, weight, bias, scale, prepared_weight)


def forward_autograd(x, weight, bias, scale, prepared_weight=None):
    _check_no_tangents("forward", _FORWARD_TENSORS, (x, weight, bias, prepared_weight))
    if _needs_grad(x, weight, bias):
        return _ForwardWithArgmax.apply(x, weight, bias, scale, prepared_weight)[0]
    with _below_autograd():
        return _forward(x, weight, bias, scale, prepared_weight)


class _NoDerivative(torch.autograd.Function):
    """An op whose outputs carry gradients but have no derivative of their own (the backward ops):
    a gradient of them raises `message`."""

    @staticmethod
    def forward(ctx, op, message, *args):
        ctx.message = message
        with _below_autograd():
            return op(*args)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(ctx.message)


_FORWARD_BACKWARD_TENSORS = ("grad_out", "grad_preactivation", "x", "weight", "argmax",
                             "preactivation")


def _forward_backward_autograd(grad_out, grad_preactivation, x, weight, argmax, preactivation,
                               scale):
    args = (grad_out, grad_preactivation, x, weight, argmax, preactivation)
    _check_no_tangents("forward_backward", _FORWARD_BACKWARD_TENSORS, args)
    if _needs_grad(grad_out, grad_preactivation, x, weight, preactivation):
        return _NoDerivative.apply(_ops.forward_backward, FORWARD_DOUBLE_BACKWARD_ERROR, *args,
                                   scale)
    with _below_autograd():
        return _ops.forward_backward(*args, scale)


_MODEL_BACKWARD_TENSORS = ("grad_out", "x", "pooled_weight", "argmax", "preactivation")
MODEL_DOUBLE_BACKWARD_ERROR = (
    "fused_pool_gelu.model_backward: double backward (gradients of gradients of model_forward) is "
    "not supported"
)


def _model_backward_autograd(grad_out, x, pooled_weight, argmax, preactivation, scale,
                             out_features, pool_kernel_size):
    args = (grad_out, x, pooled_weight, argmax, preactivation)
    _check_no_tangents("model_backward", _MODEL_BACKWARD_TENSORS, args)
    rest = (scale, out_features, pool_kernel_size)
    if _needs_grad(grad_out, x, pooled_weight, preactivation):
        return _NoDerivative.apply(_ops.model_backward, MODEL_DOUBLE_BACKWARD_ERROR, *args, *rest)
    with _below_autograd():
        return _ops.model_backward(*args, *rest)


class _ModelForward(torch.autograd.Function):
    """fold and forward_with_argmax as one node, or forward_with_argmax alone on a given fold; its
    backward is model_backward (forward_backward then fold_backward, the same sums in the same
    order as the separate ops' backward), or forward_backward alone when only x needs a
    gradient. The given fold is not differentiated: the gradients reach weight and bias through
    fold_backward, which needs none of fold's values."""

    @staticmethod
    def forward(ctx, x, weight, bias, pool_kernel_size, scale, pooled_weight, pooled_bias,
                prepared_weight, fold_sink=None):
        # fold_sink: a list that receives the fold made here (_model_forward_and_fold), or None.
        with _below_autograd():
            if pooled_weight is None:
                out, argmax, preactivation, pooled_weight, pooled_bias = (
                    _model_forward_with_argmax(x, weight, bias, pool_kernel_size, scale))
                if fold_sink is not None:
                    fold_sink.append((pooled_weight, pooled_bias))
            else:
                out, argmax, preactivation = _forward_with_argmax(
                    x, pooled_weight, pooled_bias, scale, prepared_weight
                )
        ctx.save_for_backward(x, pooled_weight, argmax, preactivation)
        ctx.shape = (weight.shape[0], pool_kernel_size, scale, bias is not None)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, pooled_weight, argmax, preactivation = ctx.saved_tensors
        out_features, pool_kernel_size, scale, has_bias = ctx.shape
        needs_x, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        needs_bias = needs_bias and has_bias
        # With create_graph through the ops' autograd kernels, which raise a clear error on a
        # gradient of these gradients; otherwise straight to the device kernels.
        below = contextlib.nullcontext() if _C.is_grad_enabled() else _below_autograd()
        # No gradient for the preactivation output: the separate ops' autograd passes zeros there,
        # which costs an allocation and a fill per step for nothing but the sign of a zero grad_x.
        with below:
            if needs_weight or needs_bias:
                grad_x, grad_weight, grad_bias = _model_backward(
                    grad_out, x, pooled_weight, argmax, preactivation, scale, out_features,
                    pool_kernel_size,
                )
                return (grad_x if needs_x else None, grad_weight if needs_weight else None,
                        grad_bias if needs_bias else None, None, None, None, None, None, None)
            grad_x = _forward_backward(grad_out, None, x, pooled_weight, argmax, preactivation,
                                       scale)[0]
        return grad_x, None, None, None, None, None, None, None, None


def _model_forward_autograd_python(x, weight, bias, pool_kernel_size, scale, pooled_weight=None,
                                   pooled_bias=None, prepared_weight=None):
    check_model_forward_inputs(x, weight)
    if pooled_weight is not None or pooled_bias is not None or prepared_weight is not None:
        check_model_forward_folded(weight, bias, pool_kernel_size, pooled_weight, pooled_bias,
                                   prepared_weight)
    _check_no_tangents("model_forward", ("x", "weight", "bias"), (x, weight, bias))
    if _needs_grad(x, weight, bias):
        return _ModelForward.apply(x, weight, bias, pool_kernel_size, scale, pooled_weight,
                                   pooled_bias, prepared_weight)
    with _below_autograd():
        return _ops.model_forward(x, weight, bias, pool_kernel_size, scale, pooled_weight,
                                  pooled_bias, prepared_weight)


def _model_forward_on_cached_fold_python(x, weight, bias, pool_kernel_size, scale, pooled_weight,
                                         pooled_bias):
    """ModelNew's eager training call: model_forward's autograd node on the fold that ModelNew's
    cache made of this weight, bias and pool_kernel_size (nothing of it to check), where ModelNew
    found a gradient needed and autocast and torch.func transforms off. The checks and routing of
    ops.model_forward and model_forward_autograd that this skips are host time on every step."""
    check_model_forward_inputs(x, weight)
    _check_no_tangents("model_forward", ("x", "weight", "bias"), (x, weight, bias))
    return _ModelForward.apply(x, weight, bias, pool_kernel_size, scale, pooled_weight,
                               pooled_bias, None)


def _model_forward_and_fold_python(x, weight, bias, pool_kernel_size, scale):
    """_model_forward_and_fold's autograd kernel in Python: model_forward's node, which folds, and
    the fold it made (ModelNew's training call after a parameter update; its cache keeps the
    fold, one op call fewer than folding first)."""
    check_model_forward_inputs(x, weight)
    _check_no_tangents("model_forward", ("x", "weight", "bias"), (x, weight, bias))
    if not _needs_grad(x, weight, bias):
        with _below_autograd():
            return _ops._model_forward_and_fold.default(x, weight, bias, pool_kernel_size, scale)
    fold_sink = []
    out = _ModelForward.apply(x, weight, bias, pool_kernel_size, scale, None, None, None,
                              fold_sink)
    return (out, *fold_sink[0])


def forward_on_cached_fold(x, pooled_weight, pooled_bias, scale, prepared_weight):
    """ModelNew's eager inference call: the forward kernel on the fold (and prepared copy) that
    ModelNew's cache made, where no gradient is needed and neither autocast, a torch.func
    transform nor forward-mode AD is active (the caller checks). The routing of ops.forward and
    forward_autograd that this skips, and the prepared copy's tie check (the cache made it from
    this pooled weight), are host time on every call."""
    with _below_autograd():
        return _forward(x, pooled_weight, pooled_bias, scale, prepared_weight)


def _model_forward_with_argmax_autograd(x, weight, bias, pool_kernel_size, scale):
    # model_forward's forward inside its node (_ModelForward), which calls it below autograd: a
    # call that needs a gradient is one from elsewhere, and model_forward is the op to call.
    _check_no_tangents("_model_forward_with_argmax", ("x", "weight", "bias"), (x, weight, bias))
    if _needs_grad(x, weight, bias):
        name = next(n for n, t in (("x", x), ("weight", weight), ("bias", bias))
                    if t is not None and t.requires_grad)
        raise RuntimeError(
            f"fused_pool_gelu._model_forward_with_argmax: {name} requires grad, but no gradient "
            "flows through this op (the forward of model_forward's autograd node); call "
            "fused_pool_gelu.ops.model_forward, which is differentiable, or run it under "
            "torch.no_grad()"
        )
    with _below_autograd():
        return _model_forward_with_argmax(x, weight, bias, pool_kernel_size, scale)


def _prepare_weight_autograd(weight):
    # Not differentiable (a copy in another precision, for the forward's selection only): its
    # output never carries a gradient function.
    _check_no_tangents("prepare_weight", ("weight",), (weight,))
    with _below_autograd():
        return _ops.prepare_weight(weight)


def _certified_candidate_counts_autograd(x, weight, bias, scale):
    # Diagnostic integer counts: nothing to differentiate.
    _check_no_tangents("_certified_candidate_counts", ("x", "weight", "bias"), (x, weight, bias))
    with _below_autograd():
        return _ops._certified_candidate_counts(x, weight, bias, scale)


def _load_model_forward_node():
    """The path of the C++ model_forward node loaded for the running torch, or None.

    Each node (fused_pool_gelu/_model_forward_node_torch<major>_<minor>.so) is built against one
    torch's own C++ headers, whose ABI holds across that minor version's releases: it is loaded
    under a release of that version, or under exactly the torch the wheel was built with (a
    source build against a pre-release). Anything else, or a node that fails to load, gets the
    Python node: same values and gradients, more host time per training step."""
    release = re.fullmatch(r"\d+\.\d+\.\d+", torch.__version__.split("+")[0])
    built_with = _extension.compiled_build_info()["torch"]
    minor = re.match(r"(\d+)\.(\d+)", torch.__version__)
    if minor is None:
        return None
    path = Path(__file__).with_name(f"_model_forward_node_torch{minor[1]}_{minor[2]}.so")
    if not path.exists() or (release is None and torch.__version__ != built_with):
        return None
    try:
        torch.ops.load_library(str(path))
    except OSError as error:
        warnings.warn(
            f"fused_pool_gelu: the C++ autograd node built for torch {minor[0]} ({path.name}) did "
            f"not load under torch {torch.__version__} ({error}); training uses the Python node "
            "instead (same results, more host time per step)",
            stacklevel=2,
        )
        return None
    return str(path)


MODEL_FORWARD_NODE = _load_model_forward_node()
if MODEL_FORWARD_NODE is not None:
    # The node is model_forward's Autograd kernel: the op itself, with C++ checks.
    model_forward_autograd = _ops.model_forward.default

    model_forward_and_fold = _ops._model_forward_and_fold.default

    def model_forward_on_cached_fold(x, weight, bias, pool_kernel_size, scale, pooled_weight,
                                     pooled_bias):
        # ModelNew's training call on its cached fold.
        return model_forward_autograd(x, weight, bias, pool_kernel_size, scale, pooled_weight,
                                      pooled_bias, None)
else:
    model_forward_autograd = _model_forward_autograd_python
    model_forward_on_cached_fold = _model_forward_on_cached_fold_python
    # Called directly by ModelNew (no round trip through the dispatcher into Python).
    model_forward_and_fold = _model_forward_and_fold_python


for _name, _kernel in (
    ("fold", fold_autograd),
    ("fold_backward", _fold_backward_autograd),
    ("forward_with_argmax", forward_with_argmax_autograd),
    ("forward", forward_autograd),
    ("forward_backward", _forward_backward_autograd),
    ("model_backward", _model_backward_autograd),
    ("_model_forward_with_argmax", _model_forward_with_argmax_autograd),
    ("prepare_weight", _prepare_weight_autograd),
    ("_certified_candidate_counts", _certified_candidate_counts_autograd),
):
    _lib.impl(_name, _kernel, "Autograd")
if MODEL_FORWARD_NODE is None:
    _lib.impl("model_forward", model_forward_autograd, "Autograd")
    _lib.impl("_model_forward_and_fold", _model_forward_and_fold_python, "Autograd")
