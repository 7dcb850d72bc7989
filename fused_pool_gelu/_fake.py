"""Fake kernels: each op's output shapes, dtypes and devices, for tracing (torch.compile, export).

Each runs its op's input checks first (_checks.py, csrc/checks.h's messages), so that tracing fails
the way eager does. They also serve as the Meta kernels, which the dispatcher picks when any input
is a meta tensor: without the device checks a meta bias beside a CPU x would return an
uninitialised CPU tensor instead of an error.
"""

from __future__ import annotations

import torch

from ._checks import (
    check_fold_backward_inputs,
    check_fold_inputs,
    check_forward_backward_inputs,
    check_forward_inputs,
    check_model_backward_inputs,
    check_model_forward_folded,
    check_model_forward_inputs,
    check_prepare_weight_inputs,
    check_prepared_weight,
    prepared_bytes,
)


@torch.library.register_fake("fused_pool_gelu::fold")
def _fold_fake(weight, bias, pool_kernel_size):
    check_fold_inputs(weight, bias, pool_kernel_size)
    pooled = weight.shape[0] // pool_kernel_size
    return weight.new_empty((pooled, weight.shape[1])), weight.new_empty((pooled,))


@torch.library.register_fake("fused_pool_gelu::fold_backward")
def _fold_backward_fake(grad_pooled_weight, grad_pooled_bias, out_features, pool_kernel_size):
    check_fold_backward_inputs(grad_pooled_weight, grad_pooled_bias, out_features,
                               pool_kernel_size)
    return (
        grad_pooled_weight.new_empty((out_features, grad_pooled_weight.shape[1])),
        grad_pooled_weight.new_empty((out_features,)),
    )


@torch.library.register_fake("fused_pool_gelu::forward_with_argmax")
def _forward_with_argmax_fake(x, weight, bias, scale, prepared_weight=None):
    check_forward_inputs(x, weight, bias)
    check_prepared_weight(weight, prepared_weight)
    batch = x.shape[0]
    return x.new_empty((batch,)), x.new_empty((batch,), dtype=torch.long), x.new_empty((batch,))


@torch.library.register_fake("fused_pool_gelu::forward")
def _forward_fake(x, weight, bias, scale, prepared_weight=None):
    check_forward_inputs(x, weight, bias)
    check_prepared_weight(weight, prepared_weight)
    return x.new_empty((x.shape[0],))


@torch.library.register_fake("fused_pool_gelu::prepare_weight")
def _prepare_weight_fake(weight):
    check_prepare_weight_inputs(weight)
    size = prepared_bytes(weight.shape[0], weight.shape[1])
    return weight.new_empty((size,), dtype=torch.uint8)


@torch.library.register_fake("fused_pool_gelu::model_forward")
def _model_forward_fake(x, weight, bias, pool_kernel_size, scale, pooled_weight=None,
                        pooled_bias=None, prepared_weight=None):
    check_model_forward_inputs(x, weight)
    check_model_forward_folded(weight, bias, pool_kernel_size, pooled_weight, pooled_bias,
                               prepared_weight)
    if pooled_weight is None:
        pooled_weight, pooled_bias = _fold_fake(weight, bias, pool_kernel_size)
    return _forward_fake(x, pooled_weight, pooled_bias, scale, prepared_weight)


@torch.library.register_fake("fused_pool_gelu::_model_forward_with_argmax")
def _model_forward_with_argmax_fake(x, weight, bias, pool_kernel_size, scale):
    check_model_forward_inputs(x, weight)
    pooled_weight, pooled_bias = _fold_fake(weight, bias, pool_kernel_size)
    return (*_forward_with_argmax_fake(x, pooled_weight, pooled_bias, scale), pooled_weight,
            pooled_bias)


@torch.library.register_fake("fused_pool_gelu::_model_forward_and_fold")
def _model_forward_and_fold_fake(x, weight, bias, pool_kernel_size, scale):
    check_model_forward_inputs(x, weight)
    pooled_weight, pooled_bias = _fold_fake(weight, bias, pool_kernel_size)
    return _forward_fake(x, pooled_weight, pooled_bias, scale, None), pooled_weight, pooled_bias


@torch.library.register_fake("fused_pool_gelu::forward_backward")
def _forward_backward_fake(grad_out, grad_preactivation, x, weight, argmax, preactivation, scale):
    check_forward_backward_inputs(grad_out, grad_preactivation, x, weight, argmax, preactivation)
    return (
        x.new_empty(x.shape),
        weight.new_empty(weight.shape),
        weight.new_empty((weight.shape[0],)),
    )


@torch.library.register_fake("fused_pool_gelu::model_backward")
def _model_backward_fake(
    grad_out, x, pooled_weight, argmax, preactivation, scale, out_features, pool_kernel_size
):
    check_model_backward_inputs(grad_out, x, pooled_weight, argmax, preactivation, out_features,
                                pool_kernel_size)
    return (
        x.new_empty(x.shape),
        pooled_weight.new_empty((out_features, pooled_weight.shape[1])),
        pooled_weight.new_empty((out_features,)),
    )
