"""Autograd formulas of the ops whose derivatives are registered in Python.

fold and fold_backward are adjoint linear maps, so each is the other's derivative (double backward
of the fold comes for free). forward_with_argmax's derivative is the arg-max backward (no dense
GEMM); `forward`'s autograd kernel (csrc/registration.cpp) goes through forward_with_argmax when a
gradient is needed and straight to the device kernel otherwise. model_forward's autograd kernel is
C++ (csrc/model_forward.cpp): the same derivatives in one node.
"""

from __future__ import annotations

import torch

_ops = torch.ops.fused_pool_gelu


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


FORWARD_DOUBLE_BACKWARD_ERROR = (
    "fused_pool_gelu.forward_backward: double backward (gradients of gradients of forward) is not "
    "supported"
)


def _forward_backward_backward(ctx, *grads):
    raise RuntimeError(FORWARD_DOUBLE_BACKWARD_ERROR)


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
