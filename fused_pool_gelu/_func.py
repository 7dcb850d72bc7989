"""The ops under torch.func transforms: grad, vjp, jacrev, vmap (and functional_call with them).

functorch refuses both kinds of autograd formula the ops have elsewhere: the ones
torch.library.register_autograd makes (_autograd.py), old-style autograd.Functions ("must override
the setup_context staticmethod"), and model_forward's C++ torch::autograd::Function. While a
transform is active, the public wrappers (ops.py) and ModelNew go through the autograd.Functions
below instead: the same ops and the same derivative formulas, in the form functorch takes, with
vmap rules. Forward mode (jvp, jacfwd) stays unsupported, with the kernels' error (the Functions'
jvp rules raise it too, for a forward-mode transform below another one).
"""

from __future__ import annotations

import torch
from torch._C._functorch import TransformType, peek_interpreter_stack

from ._autograd import FORWARD_DOUBLE_BACKWARD_ERROR
from ._checks import check_model_forward_inputs

_ops = torch.ops.fused_pool_gelu

def _refuse_tangents(op, names, tangents):
    # The kernels' check_no_tangent message (csrc/checks.h), for the first input with a tangent.
    name = next(n for n, t in zip(names, tangents) if isinstance(t, torch.Tensor))
    raise RuntimeError(
        f"fused_pool_gelu.{op}: {name} carries a forward-mode AD tangent; forward-mode AD "
        "(torch.func.jvp, jacfwd, torch.autograd.forward_ad) is not supported, use reverse mode "
        "(backward, torch.autograd.grad)"
    )


def transforms_active() -> bool:
    """Whether the innermost active torch.func transform is one the ops go through this module
    for: grad (vjp, jacrev) or vmap. Under forward mode (jvp, jacfwd) they keep their kernels, whose
    autograd-level checks refuse a tangent naming the op and the argument; under functionalize
    too, which takes the ops as they are and has no rule for autograd.Functions."""
    if not torch._C._are_functorch_transforms_active():
        return False
    return peek_interpreter_stack().key() in (TransformType.Grad, TransformType.Vmap)


def _select(t, dim, i):
    return t if t is None or dim is None else t.select(dim, i)


def _stack_per_sample(function, info, in_dims, *args):
    # vmap by a loop over the batch: for what no single call of the op covers.
    if info.batch_size == 0:
        raise RuntimeError(
            f"fused_pool_gelu: vmap of {function.__name__} over an empty batch is not supported "
            "(no sample to take the outputs' shapes from)"
        )
    outputs = [function.apply(*(_select(a, d, i) if isinstance(a, torch.Tensor) else a
                                for a, d in zip(args, in_dims)))
               for i in range(info.batch_size)]
    stacked = tuple(torch.stack(parts) for parts in zip(*outputs))
    return stacked, (0,) * len(stacked)


class Fold(torch.autograd.Function):
    """fold(weight, bias, k) -> (pooled_weight, pooled_bias); its derivative is fold_backward."""

    @staticmethod
    def forward(weight, bias, pool_kernel_size):
        return _ops.fold(weight, bias, pool_kernel_size)

    @staticmethod
    def setup_context(ctx, inputs, output):
        weight, bias, pool_kernel_size = inputs
        ctx.out_features = weight.shape[0]
        ctx.pool_kernel_size = pool_kernel_size
        ctx.has_bias = bias is not None

    @staticmethod
    def backward(ctx, grad_pooled_weight, grad_pooled_bias):
        grad_weight, grad_bias = FoldBackward.apply(
            grad_pooled_weight, grad_pooled_bias, ctx.out_features, ctx.pool_kernel_size
        )
        return grad_weight, (grad_bias if ctx.has_bias else None), None

    @staticmethod
    def jvp(ctx, *tangents):
        _refuse_tangents("fold", ("weight", "bias"), tangents)

    @staticmethod
    def vmap(info, in_dims, weight, bias, pool_kernel_size):
        return _stack_per_sample(Fold, info, in_dims, weight, bias, pool_kernel_size)


class FoldBackward(torch.autograd.Function):
    """fold_backward, the adjoint of fold: each is the other's derivative."""

    @staticmethod
    def forward(grad_pooled_weight, grad_pooled_bias, out_features, pool_kernel_size):
        return _ops.fold_backward(grad_pooled_weight, grad_pooled_bias, out_features,
                                  pool_kernel_size)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.pool_kernel_size = inputs[3]

    @staticmethod
    def backward(ctx, grad_grad_weight, grad_grad_bias):
        return (*Fold.apply(grad_grad_weight, grad_grad_bias, ctx.pool_kernel_size), None, None)

    @staticmethod
    def vmap(info, in_dims, grad_pooled_weight, grad_pooled_bias, out_features, pool_kernel_size):
        return _stack_per_sample(FoldBackward, info, in_dims, grad_pooled_weight,
                                 grad_pooled_bias, out_features, pool_kernel_size)


class ForwardWithArgmax(torch.autograd.Function):
    """forward_with_argmax(x, weight, bias, scale, prepared_weight); its derivative is
    forward_backward (none for the prepared weight, a uint8 copy the op checks and reads)."""

    @staticmethod
    def forward(x, weight, bias, scale, prepared_weight):
        return _ops.forward_with_argmax(x, weight, bias, scale, prepared_weight)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, scale, _prepared_weight = inputs
        _, argmax, preactivation = output
        ctx.mark_non_differentiable(argmax)
        ctx.save_for_backward(x, weight, argmax, preactivation)
        ctx.scale = scale
        ctx.has_bias = bias is not None

    @staticmethod
    def backward(ctx, grad_out, grad_argmax, grad_preactivation):
        x, weight, argmax, preactivation = ctx.saved_tensors
        grad_x, grad_weight, grad_bias = ForwardBackward.apply(
            grad_out, grad_preactivation, x, weight, argmax, preactivation, ctx.scale
        )
        return grad_x, grad_weight, (grad_bias if ctx.has_bias else None), None, None

    @staticmethod
    def jvp(ctx, *tangents):
        _refuse_tangents("forward", ("x", "weight", "bias"), tangents)

    @staticmethod
    def vmap(info, in_dims, x, weight, bias, scale, prepared_weight):
        x_dim, weight_dim, bias_dim, _, prepared_dim = in_dims
        if (weight_dim is None and bias_dim is None and prepared_dim is None
                and x_dim is not None and x.dim() == 3):
            # Only x batched, samples [B, K] (ensembles of inputs): one call over the rows.
            x = x.movedim(x_dim, 0)
            outputs = ForwardWithArgmax.apply(x.reshape(-1, x.shape[-1]), weight, bias, scale,
                                              prepared_weight)
            return tuple(t.view(x.shape[:2]) for t in outputs), (0, 0, 0)
        # Anything else sample by sample, each checked by the op as outside vmap.
        return _stack_per_sample(ForwardWithArgmax, info, in_dims, x, weight, bias, scale,
                                 prepared_weight)


class ForwardBackward(torch.autograd.Function):
    """forward_backward, the arg-max backward; it has no derivative of its own."""

    @staticmethod
    def forward(grad_out, grad_preactivation, x, weight, argmax, preactivation, scale):
        return _ops.forward_backward(grad_out, grad_preactivation, x, weight, argmax,
                                     preactivation, scale)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(FORWARD_DOUBLE_BACKWARD_ERROR)

    @staticmethod
    def vmap(info, in_dims, grad_out, grad_preactivation, x, weight, argmax, preactivation,
             scale):
        return _stack_per_sample(ForwardBackward, info, in_dims, grad_out, grad_preactivation,
                                 x, weight, argmax, preactivation, scale)


def fold(weight, bias, pool_kernel_size):
    return Fold.apply(weight, bias, pool_kernel_size)


def forward_with_argmax(x, weight, bias, scale, prepared_weight=None):
    return ForwardWithArgmax.apply(x, weight, bias, scale, prepared_weight)


def forward(x, weight, bias, scale, prepared_weight=None):
    return ForwardWithArgmax.apply(x, weight, bias, scale, prepared_weight)[0]


def model_forward(x, weight, bias, pool_kernel_size, scale):
    check_model_forward_inputs(x, weight)  # model_forward's own checks, as its kernels'
    return forward(x, *fold(weight, bias, pool_kernel_size), scale)
