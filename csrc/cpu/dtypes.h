// The dtypes the CPU kernels accept, and the switch from a dtype to its C++ type. float16 and
// bfloat16 (autocast's lower precision on the CPU) are computed in float32 and rounded once at the
// end; float64 serves gradcheck.
#pragma once

#include <initializer_list>
#include <type_traits>

#include "stable_tensor.h"

namespace fused_pool_gelu {

constexpr std::initializer_list<ScalarType> kCpuDtypes = {kFloat, kDouble, kHalf, kBFloat16};
constexpr const char* kCpuDtypesText = "float32, float64, float16 or bfloat16";

// body(T{}) with T the C++ type of `dtype`, one of float and double (with_halves: also Half and
// BFloat16). The callers have checked the dtype (check_dtype_in): another one is an internal error.
template <bool with_halves = false, typename Body>
void dispatch_cpu_floating(ScalarType dtype, const char* op, Body&& body) {
  switch (dtype) {
    case ScalarType::Float:
      return body(float{});
    case ScalarType::Double:
      return body(double{});
    case ScalarType::Half:
      if constexpr (with_halves) return body(Half{});
      break;
    case ScalarType::BFloat16:
      if constexpr (with_halves) return body(BFloat16{});
      break;
    default:
      break;
  }
  fail("fused_pool_gelu.", op, ": internal error: no CPU kernel for ", dtype);
}

}  // namespace fused_pool_gelu
