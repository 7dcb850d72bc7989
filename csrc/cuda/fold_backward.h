// fold_backward's CUDA kernel as a C++ call, shared by the fold_backward op (fold.cu) and
// model_backward (backward.cu), so that both write the weight gradient with the same kernel.
#pragma once

#include <cstdint>
#include <tuple>

#include "stable_tensor.h"

namespace fused_pool_gelu {
namespace cuda {

// (grad_weight [out_features, K], grad_bias [out_features]) = fold's adjoint of the pooled gradient
// [out_features // k, K], [out_features // k] (see fold.cu). Inputs already checked, current device
// set. With segment_starts (a device array of out_features // k + 1 entries, the arg-max
// grouping's), pooled row n is taken as zero wherever segment_starts[n] == segment_starts[n + 1]
// and is not read there.
std::tuple<Tensor, Tensor> fold_backward_of(const Tensor& grad_pooled_weight,
                                            const Tensor& grad_pooled_bias, int64_t out_features,
                                            int64_t pool_kernel_size,
                                            const int64_t* segment_starts);

}  // namespace cuda
}  // namespace fused_pool_gelu
