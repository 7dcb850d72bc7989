// The CUDA kernels that model_forward's CUDA kernel (model_forward.cpp) calls directly.
#pragma once

#include <cstdint>
#include <optional>
#include <tuple>

#include "stable_tensor.h"

namespace fused_pool_gelu {
namespace cuda {

std::tuple<Tensor, Tensor> fold(const Tensor& weight, const std::optional<Tensor>& bias,
                                int64_t pool_kernel_size);
std::tuple<Tensor, Tensor, Tensor> forward_with_argmax(
    const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias, double scale,
    const std::optional<Tensor>& prepared_weight);

}  // namespace cuda
}  // namespace fused_pool_gelu
