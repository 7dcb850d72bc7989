// fold_backward's arithmetic, shared by fold.cu's fold_backward_kernel and backward.cu's segment
// kernels (which write fold's adjoint of the pooled gradient directly for model_backward), so that
// model_backward gives the bits of forward_backward then fold_backward.
#pragma once

#include <ATen/OpMathType.h>

#include <cstdint>

namespace fused_pool_gelu {
namespace cuda {

// Row r of pool group n of the weight gradient from the pooled gradient g of row n: g / k, computed
// in the op-math type and rounded once. k == 1 returns g itself (the division is exact).
template <typename scalar_t>
__device__ __forceinline__ scalar_t fold_adjoint(scalar_t g, int64_t k) {
  using acc_t = at::opmath_type<scalar_t>;
  return static_cast<scalar_t>(static_cast<acc_t>(g) / static_cast<acc_t>(k));
}

}  // namespace cuda
}  // namespace fused_pool_gelu
