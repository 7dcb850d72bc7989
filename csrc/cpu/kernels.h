// The CPU kernels, registered in registration.cpp and called directly by model_forward's and
// model_backward's CPU kernels (model_forward.cpp).
#pragma once

#include <cstdint>
#include <optional>
#include <tuple>

#include "stable_tensor.h"

namespace fused_pool_gelu {
namespace cpu {

std::tuple<Tensor, Tensor> fold(const Tensor& weight, const std::optional<Tensor>& bias,
                                int64_t pool_kernel_size);
std::tuple<Tensor, Tensor> fold_backward(const Tensor& grad_pooled_weight,
                                         const Tensor& grad_pooled_bias, int64_t out_features,
                                         int64_t pool_kernel_size);
std::tuple<Tensor, Tensor, Tensor> forward_with_argmax(
    const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias, double scale,
    const std::optional<Tensor>& prepared_weight);
Tensor prepare_weight(const Tensor& weight);
std::tuple<Tensor, Tensor, Tensor> forward_backward(
    const std::optional<Tensor>& grad_out, const std::optional<Tensor>& grad_preactivation,
    const Tensor& x, const Tensor& weight, const Tensor& argmax, const Tensor& preactivation,
    double scale);

}  // namespace cpu
}  // namespace fused_pool_gelu
