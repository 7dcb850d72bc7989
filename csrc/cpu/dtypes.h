// The dtypes the CPU kernels accept. float16 and bfloat16 (autocast's lower precision on the CPU)
// are computed in float32 and rounded once at the end; float64 serves gradcheck.
#pragma once

#include <c10/core/ScalarType.h>

#include <initializer_list>

namespace fused_pool_gelu {

constexpr std::initializer_list<at::ScalarType> kCpuDtypes = {at::kFloat, at::kDouble, at::kHalf,
                                                               at::kBFloat16};
constexpr const char* kCpuDtypesText = "float32, float64, float16 or bfloat16";

}  // namespace fused_pool_gelu
