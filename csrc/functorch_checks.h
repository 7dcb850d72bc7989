// torch.func's autograd transforms run an op's autograd-level kernels (Autograd, ADInplaceOrView)
// at the transform's level, then unwrap the inputs and call the device kernel below it. For jvp
// (jacfwd, hessian) an op without a forward-mode formula, as these are, then returns a tangent of
// zeros with no error (checks.h's check_no_tangent sees no tangent there); grad, vjp and jacrev
// already fail on the ops' autograd functions, which functorch cannot transform. The ops' kernels
// at those keys refuse them all, whether or not this op's inputs carry tangents (inside the level
// the kernels cannot tell: every input is lifted to it). A transform is being processed exactly
// when functorch's dynamic-layer keys are in the thread's included set (what
// torch._C._are_functorch_transforms_active reads; the interpreter stack's own header is not
// usable from an extension); vmap's per-sample fallback calls the op with its level popped, so
// vmap alone still runs. Outside transforms the check reads one thread-local key set.
#pragma once

#include <c10/core/DispatchKey.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

#include <string_view>

namespace fused_pool_gelu {

inline void check_no_functorch_autograd_transform(std::string_view op) {
  const c10::DispatchKeySet included = c10::impl::tls_local_dispatch_key_set().included_;
  TORCH_CHECK_NOT_IMPLEMENTED(
      !included.has(c10::DispatchKey::FuncTorchDynamicLayerFrontMode) &&
          !included.has(c10::DispatchKey::FuncTorchDynamicLayerBackMode),
      "fused_pool_gelu.", op, ": torch.func's autograd transforms (jvp, jacfwd, hessian, grad, "
      "vjp, jacrev) are not supported: the op has no forward-mode derivative (a jvp would give a "
      "zero tangent) and functorch cannot transform its backward; use torch.autograd (backward, "
      "torch.autograd.grad)");
}

}  // namespace fused_pool_gelu
