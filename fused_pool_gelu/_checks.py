"""Input checks of the ops in Python, with csrc/checks.h's messages.

The fake kernels (_fake.py) run them so that tracing fails the way eager does; the public
wrappers (ops.py) and model_forward's autocast kernel (_autocast.py) run the few they need before
any C++ kernel can. Each function is named after its csrc/checks.h twin.
"""

from __future__ import annotations

import torch


def check(cond, message):
    torch._check(cond, lambda: f"fused_pool_gelu.{message}")


def check_defined(op, name, t):
    # None for a required tensor (the kernels get an undefined one). A plain raise, not
    # torch._check: the public wrappers call this too, and Dynamo (torch 2.11) cannot trace
    # torch._check's message closure there (a graph break, an error under fullgraph=True).
    # `t is None` is a constant while tracing, so this costs the graph nothing.
    if t is None:
        raise RuntimeError(f"fused_pool_gelu.{op}: {name} must be a tensor, got None")


def check_int64(op, name, value):
    # An int of the schema: past int64, torch's argument parser would fail with "Expected a value
    # of type 'int' ... but instead found type 'int'". A plain raise, as check_defined's.
    if isinstance(value, int) and not -(2**63) <= value < 2**63:
        raise RuntimeError(f"fused_pool_gelu.{op}: {name} must fit in int64, got {value}")


# c10's names for the dtypes, as csrc/checks.h's messages print them.
_SCALAR_TYPE_NAMES = {
    torch.float32: "Float", torch.float64: "Double", torch.float16: "Half",
    torch.bfloat16: "BFloat16", torch.int64: "Long", torch.int32: "Int", torch.uint8: "Byte",
    torch.bool: "Bool",
}


def dtype_name(dtype):
    return _SCALAR_TYPE_NAMES.get(dtype, str(dtype))


def check_same_device(op, name, t, ref_name, ref):
    check(
        t.device == ref.device,
        f"{op}: {name} must be on the same device as {ref_name} ({ref.device}), got {t.device}",
    )


def check_same_dtype(op, name, t, ref_name, ref):
    # Where the dtypes differ, a non-floating ref is the one named.
    check(
        t.dtype == ref.dtype or ref.dtype.is_floating_point,
        f"{op}: {ref_name} must be a floating-point tensor, got {dtype_name(ref.dtype)}",
    )
    check(
        t.dtype == ref.dtype,
        f"{op}: {name} must have the same dtype as {ref_name} ({dtype_name(ref.dtype)}), got "
        f"{dtype_name(t.dtype)}",
    )


def check_fold_inputs(weight, bias, pool_kernel_size):
    check_defined("fold", "weight", weight)
    check(
        weight.dim() == 2,
        f"fold: weight must be 2-D [out_features, in_features], got shape {list(weight.shape)}",
    )
    check(pool_kernel_size >= 1, f"fold: pool_kernel_size must be >= 1, got {pool_kernel_size}")
    check(
        pool_kernel_size <= weight.shape[0],
        f"fold: pool_kernel_size must be <= out_features ({weight.shape[0]}) so that at least one "
        f"pooled feature exists, got {pool_kernel_size}",
    )
    if bias is not None:
        check(
            bias.dim() == 1 and bias.shape[0] == weight.shape[0],
            f"fold: bias must be 1-D [out_features] = [{weight.shape[0]}], "
            f"got shape {list(bias.shape)}",
        )
        check_same_device("fold", "bias", bias, "weight", weight)
        check_same_dtype("fold", "bias", bias, "weight", weight)


def check_unfolded_shape(op, name, pooled, out_features, pool_kernel_size):
    check(pool_kernel_size >= 1, f"{op}: pool_kernel_size must be >= 1, got {pool_kernel_size}")
    check(out_features >= 0, f"{op}: out_features must be >= 0, got {out_features}")
    rows = out_features // pool_kernel_size
    check(
        rows == pooled.shape[0],
        f"{op}: {name} must have out_features // pool_kernel_size = {rows} rows, got shape "
        f"{list(pooled.shape)}",
    )
    in_features, element_size = pooled.shape[1], pooled.element_size()
    check(
        in_features == 0 or out_features <= (2**63 - 1) // element_size // in_features,
        f"{op}: out_features must keep the [out_features, in_features] gradient's bytes within "
        f"2^63, got [{out_features}, {in_features}] of {element_size}-byte elements",
    )


def check_fold_backward_inputs(grad_pooled_weight, grad_pooled_bias, out_features,
                               pool_kernel_size):
    op = "fold_backward"
    check_defined(op, "grad_pooled_weight", grad_pooled_weight)
    check(
        grad_pooled_weight.dim() == 2,
        f"{op}: grad_pooled_weight must be 2-D [pooled_features, in_features], got shape "
        f"{list(grad_pooled_weight.shape)}",
    )
    check_unfolded_shape(op, "grad_pooled_weight", grad_pooled_weight, out_features,
                         pool_kernel_size)
    rows = grad_pooled_weight.shape[0]
    check_defined(op, "grad_pooled_bias", grad_pooled_bias)
    check(
        grad_pooled_bias.dim() == 1 and grad_pooled_bias.shape[0] == rows,
        f"{op}: grad_pooled_bias must be 1-D [pooled_features] = [{rows}], got shape "
        f"{list(grad_pooled_bias.shape)}",
    )
    check_same_device(op, "grad_pooled_bias", grad_pooled_bias, "grad_pooled_weight",
                      grad_pooled_weight)
    check_same_dtype(op, "grad_pooled_bias", grad_pooled_bias, "grad_pooled_weight",
                     grad_pooled_weight)


def check_x_and_weight(op, x, weight_name, weight, layout):
    # Ranks and K, the weight's rows named by `layout`.
    # Messages made only on failure: model_forward's autograd kernel runs this on every training
    # step.
    check_defined(op, "x", x)
    check_defined(op, weight_name, weight)
    if x.dim() != 2:
        check(False, f"{op}: x must be 2-D [batch, in_features], got shape {list(x.shape)}")
    if weight.dim() != 2:
        check(False, f"{op}: {weight_name} must be 2-D {layout}, got shape {list(weight.shape)}")
    if weight.shape[1] != x.shape[1]:
        check(False, f"{op}: {weight_name} must be {layout} with in_features = x.size(1) = "
              f"{x.shape[1]}, got shape {list(weight.shape)}")


def check_forward_inputs(x, weight, bias, op="forward", weight_name="weight"):
    # op and weight_name: the names in errors (the backward ops check the same inputs).
    check_x_and_weight(op, x, weight_name, weight, "[pooled_features, in_features]")
    check(
        weight.shape[0] >= 1,
        f"{op}: {weight_name} must have at least one row (pooled feature) to take the max over, "
        f"got shape {list(weight.shape)}",
    )
    check_same_device(op, weight_name, weight, "x", x)
    check_same_dtype(op, weight_name, weight, "x", x)
    if bias is not None:
        check(
            bias.dim() == 1 and bias.shape[0] == weight.shape[0],
            f"{op}: bias must be 1-D [pooled_features] = [{weight.shape[0]}], "
            f"got shape {list(bias.shape)}",
        )
        check_same_device(op, "bias", bias, "x", x)
        check_same_dtype(op, "bias", bias, "x", x)


def _check_batch_vectors(op, x, optional=(), **vectors):
    # 1-D [batch] on x's device; argmax int64, the others x's dtype. Those named in `optional`
    # may be None.
    batch = x.shape[0]
    for name, t in vectors.items():
        if name not in optional:
            check_defined(op, name, t)
        if t is not None:
            check(
                t.dim() == 1 and t.shape[0] == batch,
                f"{op}: {name} must be 1-D [batch] = [{batch}], got shape {list(t.shape)}",
            )
            check_same_device(op, name, t, "x", x)
            if name == "argmax":
                check(t.dtype == torch.int64,
                      f"{op}: argmax must be int64, got {dtype_name(t.dtype)}")
            else:
                check_same_dtype(op, name, t, "x", x)


def check_forward_backward_inputs(grad_out, grad_preactivation, x, weight, argmax,
                                  preactivation):
    op = "forward_backward"
    check_forward_inputs(x, weight, None, op)
    _check_batch_vectors(op, x, optional=("grad_out", "grad_preactivation"), argmax=argmax,
                         preactivation=preactivation, grad_out=grad_out,
                         grad_preactivation=grad_preactivation)


def check_model_backward_inputs(grad_out, x, pooled_weight, argmax, preactivation, out_features,
                                pool_kernel_size):
    op = "model_backward"
    check_defined(op, "grad_out", grad_out)  # first, as for a call without any tensor
    check_forward_inputs(x, pooled_weight, None, op, "pooled_weight")
    _check_batch_vectors(op, x, argmax=argmax, preactivation=preactivation, grad_out=grad_out)
    check_unfolded_shape(op, "pooled_weight", pooled_weight, out_features, pool_kernel_size)


def prepared_bytes(rows, in_features):
    # csrc/prepared_weight.h: the fp16 copy in 128-byte rows, then 16 bytes per row (scale, norms).
    return rows * (128 * ((in_features + 63) // 64) + 16)


def check_prepared_weight(weight, prepared_weight):
    if prepared_weight is None:
        return
    size = prepared_bytes(weight.shape[0], weight.shape[1])
    check(
        prepared_weight.device == weight.device,
        f"forward: prepared_weight must be on weight's device ({weight.device}), got "
        f"{prepared_weight.device}",
    )
    check(
        prepared_weight.dtype == torch.uint8,
        f"forward: prepared_weight must be uint8 (made by fused_pool_gelu.prepare_weight), got "
        f"{dtype_name(prepared_weight.dtype)}",
    )
    check(
        prepared_weight.dim() == 1 and prepared_weight.shape[0] == size,
        f"forward: prepared_weight must be 1-D [pooled_features * (128 * ceil(in_features / 64) "
        f"+ 16)] = [{size}] for weight of shape {list(weight.shape)}, got shape "
        f"{list(prepared_weight.shape)}",
    )


def check_prepare_weight_inputs(weight):
    check_defined("prepare_weight", "weight", weight)
    check(
        weight.dim() == 2,
        f"prepare_weight: weight must be 2-D [pooled_features, in_features], got shape "
        f"{list(weight.shape)}",
    )


def check_model_forward_inputs(x, weight):
    check_x_and_weight("model_forward", x, "weight", weight, "[out_features, in_features]")


def check_model_forward_folded(weight, bias, pool_kernel_size, pooled_weight, pooled_bias,
                               prepared_weight):
    # A given fold (not None): its pairing, fold's checks, and the fold's shape, device and dtype
    # against the weight (check_model_forward_inputs ran: weight is 2-D); x against the pooled
    # weight is forward_with_argmax's to check. Conditions first, messages made only on failure:
    # model_forward's autograd kernel runs this on every training step with a cached fold.
    if pooled_weight is None or pooled_bias is None:
        if pooled_weight is not None or pooled_bias is not None:
            given = "pooled_weight" if pooled_weight is not None else "pooled_bias"
            check(False, "model_forward: pooled_weight and pooled_bias must be given together "
                  f"(fold's two outputs), got only {given}")
        if prepared_weight is not None:
            check(False, "model_forward: prepared_weight is made from pooled_weight, which must "
                  "be given with it, got prepared_weight without pooled_weight")
        return
    out_features, in_features = weight.shape
    dtype, device = weight.dtype, weight.device
    if not 1 <= pool_kernel_size <= out_features or bias is not None and (
            bias.shape != (out_features,) or bias.dtype != dtype or bias.device != device):
        check_fold_inputs(weight, bias, pool_kernel_size)
    rows = out_features // pool_kernel_size
    if pooled_weight.shape != (rows, in_features):
        check(False, "model_forward: pooled_weight must be fold's [out_features // "
              f"pool_kernel_size, in_features] = [{rows}, {in_features}], got shape "
              f"{list(pooled_weight.shape)}")
    if pooled_bias.shape != (rows,):
        check(False, "model_forward: pooled_bias must be fold's [out_features // "
              f"pool_kernel_size] = [{rows}], got shape {list(pooled_bias.shape)}")
    if (pooled_weight.device != device or pooled_weight.dtype != dtype
            or pooled_bias.device != device or pooled_bias.dtype != dtype):
        check_same_device("model_forward", "pooled_weight", pooled_weight, "weight", weight)
        check_same_dtype("model_forward", "pooled_weight", pooled_weight, "weight", weight)
        check_same_device("model_forward", "pooled_bias", pooled_bias, "weight", weight)
        check_same_dtype("model_forward", "pooled_bias", pooled_bias, "weight", weight)
