// Device helpers shared by the CUDA kernels: exact GELU and its derivative, launch checks.
#pragma once

#include <c10/cuda/CUDAException.h>

#include <cmath>
#include <cstdint>

namespace fused_pool_gelu {
namespace cuda {

constexpr double kSqrtHalf = 0.70710678118654752440;      // 1 / sqrt(2)
constexpr double kInvSqrt2Pi = 0.39894228040143267794;    // 1 / sqrt(2 pi)

// Exact (erf) GELU as torch computes it: 0.5 * z * (1 + erf(z / sqrt(2))), in the accumulate type.
template <typename T>
__device__ __forceinline__ T gelu(T z) {
  return T(0.5) * z * (T(1) + erf(z * T(kSqrtHalf)));
}

// d/dz gelu(z) = Phi(z) + z * phi(z), Phi the normal CDF and phi its density.
template <typename T>
__device__ __forceinline__ T gelu_grad(T z) {
  const T cdf = T(0.5) * (T(1) + erf(z * T(kSqrtHalf)));
  const T pdf = exp(T(-0.5) * z * z) * T(kInvSqrt2Pi);
  return cdf + z * pdf;
}

template <typename T>
__host__ __device__ constexpr T ceil_div(T a, T b) {
  return (a + b - 1) / b;
}

}  // namespace cuda
}  // namespace fused_pool_gelu
