"""Autocast kernels of forward_with_argmax, forward and model_forward (CPU and CUDA).

The reference block's Linear runs in autocast's lower-precision dtype (bfloat16 or float16) and
everything after it stays in that dtype, so under autocast forward_with_argmax casts its floating
inputs to the autocast dtype of their device and returns outputs in that dtype (accumulating in
float32 inside). fold is a mean, which autocast leaves alone, like AvgPool1d. model_forward under
autocast is fold then forward, the ops one by one: float32 pooled parameters that
forward_with_argmax's autocast kernel casts (and autograd through the casts).
"""

from __future__ import annotations

import torch

from . import ops
from ._checks import check_model_forward_inputs

_ops = torch.ops.fused_pool_gelu


def autocast_cast(t, dtype):
    """Autocast's rule for the fused op's inputs: floating tensors other than float64 take
    `dtype` (None: autocast off); anything else passes."""
    if dtype is None or t is None or not t.is_floating_point() or t.dtype == torch.float64:
        return t
    return t.to(dtype)


def _make_autocast_kernel(device_type, op):
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
            return op(cast(x), cast_weight, cast(bias), scale, prepared_weight)

    return kernel


_AUTOCAST_KEYS = torch._C.DispatchKeySet(
    torch._C.DispatchKey.AutocastCPU
) | torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCUDA)
_autocast_lib = torch.library.Library("fused_pool_gelu", "IMPL")


def _model_forward_autocast(x, weight, bias, pool_kernel_size, scale, pooled_weight=None,
                            pooled_bias=None, prepared_weight=None):
    # Through the public wrappers (looked up on ops at each call), as ModelNew's other paths call
    # the ops and as test_model_new_folds_in_float32_under_autocast observes them, after
    # model_forward's own checks (its C++ kernels', which this path does not reach). A given fold
    # is not used: autograd runs below this key, and must reach weight and bias through the fold.
    check_model_forward_inputs(x, weight)
    return ops.forward(x, *ops.fold(weight, bias, pool_kernel_size), scale)


for _device_type, _key in (("cpu", "AutocastCPU"), ("cuda", "AutocastCUDA")):
    for _name in ("forward_with_argmax", "forward"):
        _autocast_lib.impl(
            _name, _make_autocast_kernel(_device_type, getattr(_ops, _name)), _key,
            with_keyset=True,
        )
    _autocast_lib.impl("model_forward", _model_forward_autocast, _key)
