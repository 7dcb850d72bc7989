// Calls of this library's ops through the dispatcher, for C++ kernels built from other ops
// (forward's, model_forward's and model_backward's kernels in registration.cpp and
// model_forward.cpp). Going through the dispatcher picks the device kernel, the autocast kernel or
// the autograd kernel that the current dispatch state asks for, exactly as a call from Python
// would.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Optional.h>

#include <tuple>

namespace fused_pool_gelu {

inline std::tuple<at::Tensor, at::Tensor> call_fold(const at::Tensor& weight,
                                                    const c10::optional<at::Tensor>& bias,
                                                    int64_t pool_kernel_size) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fused_pool_gelu::fold", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(
                           const at::Tensor&, const c10::optional<at::Tensor>&, int64_t)>();
  return op.call(weight, bias, pool_kernel_size);
}

inline std::tuple<at::Tensor, at::Tensor> call_fold_backward(const at::Tensor& grad_pooled_weight,
                                                             const at::Tensor& grad_pooled_bias,
                                                             int64_t out_features,
                                                             int64_t pool_kernel_size) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fused_pool_gelu::fold_backward", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, int64_t, int64_t)>();
  return op.call(grad_pooled_weight, grad_pooled_bias, out_features, pool_kernel_size);
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor> call_forward_with_argmax(
    const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
    double scale, const c10::optional<at::Tensor>& prepared_weight = c10::nullopt) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fused_pool_gelu::forward_with_argmax", "")
                       .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                           double, const c10::optional<at::Tensor>&)>();
  return op.call(x, weight, bias, scale, prepared_weight);
}

inline at::Tensor call_prepare_weight(const at::Tensor& weight) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fused_pool_gelu::prepare_weight", "")
                       .typed<at::Tensor(const at::Tensor&)>();
  return op.call(weight);
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor> call_forward_backward(
    const c10::optional<at::Tensor>& grad_out,
    const c10::optional<at::Tensor>& grad_preactivation, const at::Tensor& x,
    const at::Tensor& weight, const at::Tensor& argmax, const at::Tensor& preactivation,
    double scale) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fused_pool_gelu::forward_backward", "")
          .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
              const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&,
              const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
              double)>();
  return op.call(grad_out, grad_preactivation, x, weight, argmax, preactivation, scale);
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor> call_model_backward(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& pooled_weight,
    const at::Tensor& argmax, const at::Tensor& preactivation, double scale, int64_t out_features,
    int64_t pool_kernel_size) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fused_pool_gelu::model_backward", "")
                       .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, const at::Tensor&, double, int64_t, int64_t)>();
  return op.call(grad_out, x, pooled_weight, argmax, preactivation, scale, out_features,
                 pool_kernel_size);
}

}  // namespace fused_pool_gelu
