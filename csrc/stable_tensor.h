// The LibTorch stable ABI as this library uses it (TORCH_TARGET_VERSION, set by setup.py): the
// tensor type, dtypes, the ATen ops that the target version's stable headers lack (called through
// the stable dispatcher, torch_call_dispatcher), and how tensor metadata prints in error messages
// (as ATen prints it: "[2, 4, 32]", "Float", "cuda:0").
//
// Nothing here, nor anywhere in csrc/, includes ATen, c10 or torch/library.h: the compiled library
// calls libtorch only through its stable C shims, so one binary loads under every torch from the
// target version on.
#pragma once

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/macros.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/stableivalue_conversions.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>
#include <torch/headeronly/util/shim_utils.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

// A failed shim call throws with libtorch's own message where the running torch can give it
// (STABLE_TORCH_ERROR_CODE_CHECK, from torch 2.13's headers on; it looks the message up at run
// time, so the binary still loads under the target version). Building against older headers, the
// header-only check: the call's name, file and line.
#ifndef STABLE_TORCH_ERROR_CODE_CHECK
#define STABLE_TORCH_ERROR_CODE_CHECK(call) TORCH_ERROR_CODE_CHECK(call)
#endif

namespace fused_pool_gelu {

using Tensor = torch::stable::Tensor;
using ScalarType = torch::headeronly::ScalarType;
using Device = torch::stable::Device;
using DeviceType = torch::headeronly::DeviceType;
using Half = torch::headeronly::Half;
using BFloat16 = torch::headeronly::BFloat16;

constexpr ScalarType kFloat = ScalarType::Float;
constexpr ScalarType kDouble = ScalarType::Double;
constexpr ScalarType kHalf = ScalarType::Half;
constexpr ScalarType kBFloat16 = ScalarType::BFloat16;
constexpr ScalarType kLong = ScalarType::Long;
constexpr ScalarType kInt = ScalarType::Int;
constexpr ScalarType kByte = ScalarType::Byte;

// The error of every check: std::runtime_error (Python's RuntimeError) whose message is exactly the
// arguments streamed in order. Not STD_TORCH_CHECK, which puts the C++ function, file and line
// before the message; ours start with "fused_pool_gelu.<op>: ".
template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  std::ostringstream message;
  (message << ... << args);
  throw std::runtime_error(message.str());
}

#define FPG_CHECK(cond, ...)                        \
  do {                                              \
    if (!(cond)) ::fused_pool_gelu::fail(__VA_ARGS__); \
  } while (0)

// Metadata as ATen prints it.
struct SizesText {
  torch::headeronly::IntHeaderOnlyArrayRef sizes;
};
inline std::ostream& operator<<(std::ostream& out, const SizesText& s) {
  out << "[";
  for (size_t i = 0; i < s.sizes.size(); ++i) out << (i ? ", " : "") << s.sizes[i];
  return out << "]";
}
inline SizesText sizes_text(const Tensor& t) { return SizesText{t.sizes()}; }

inline const char* device_type_text(DeviceType type) {
  switch (type) {
    case DeviceType::CPU:
      return "cpu";
    case DeviceType::CUDA:
      return "cuda";
    case DeviceType::Meta:
      return "meta";
    default:
      return "an unsupported device type";
  }
}

struct DeviceText {
  DeviceType type;
  int index;  // -1: none
};
inline std::ostream& operator<<(std::ostream& out, const DeviceText& d) {
  out << device_type_text(d.type);
  if (d.index >= 0) out << ":" << d.index;
  return out;
}
inline DeviceText device_text(const Tensor& t) {
  const Device device = t.device();
  return DeviceText{device.type(), static_cast<int>(device.index())};
}

// The type a kernel accumulates T in: float for the half types, T otherwise (ATen's opmath_type).
template <typename T>
using opmath_t =
    std::conditional_t<std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>, float, T>;

inline bool is_floating_point(ScalarType s) {
  return s == kFloat || s == kDouble || s == kHalf || s == kBFloat16;
}

// torch::stable::parallel_for, except that where ATen's parallel_for would run f inline (one grain
// of work, or one thread) f runs here, in its caller, as the classic build's at::parallel_for
// did: not behind the shim's function pointer, which the compiler cannot inline.
template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain_size, const F& f) {
  if (begin >= end) return;
  if (end - begin <= grain_size || torch::stable::get_num_threads() == 1) {
    f(begin, end);
    return;
  }
  torch::stable::parallel_for(begin, end, grain_size, f);
}

// The grain (items per task) that gives each parallel_for task at least ATen's GRAIN_SIZE (32768)
// elementary operations when one item costs `work_per_item`: a call with less work than that runs
// inline, as ATen's own kernels do, rather than paying the thread pool's fork and join
// (microseconds, the whole call at small shapes).
inline int64_t grain_for_work(int64_t work_per_item) {
  constexpr int64_t kGrainWork = 32768;
  return std::max<int64_t>(1, kGrainWork / std::max<int64_t>(1, work_per_item));
}

// An ATen op through the stable dispatcher: `stack` holds the arguments, then the returns.
template <size_t N>
void call_aten(const char* name, const char* overload, std::array<StableIValue, N>& stack) {
  STABLE_TORCH_ERROR_CODE_CHECK(
      torch_call_dispatcher(name, overload, stack.data(), TORCH_ABI_VERSION));
}

namespace aten {

using torch::stable::detail::from;
using torch::stable::detail::to;

// a @ b.
inline Tensor mm(const Tensor& a, const Tensor& b) {
  std::array<StableIValue, 2> stack{from(a), from(b)};
  call_aten("aten::mm", "", stack);
  return to<Tensor>(stack[0]);
}

// a @ b with the result in out_dtype (float16 / bfloat16 operands, float32 accumulation and result).
inline Tensor mm(const Tensor& a, const Tensor& b, ScalarType out_dtype) {
  std::array<StableIValue, 3> stack{from(a), from(b), from(out_dtype)};
  call_aten("aten::mm", "dtype", stack);
  return to<Tensor>(stack[0]);
}

// Batched a @ b with the result in out_dtype.
inline Tensor bmm(const Tensor& a, const Tensor& b, ScalarType out_dtype) {
  std::array<StableIValue, 3> stack{from(a), from(b), from(out_dtype)};
  call_aten("aten::bmm", "dtype", stack);
  return to<Tensor>(stack[0]);
}

// A view of t's storage (from t's offset) with `sizes` and `strides`, of any dimension: the C
// shim's own call, as for the allocations below. Not aoti_torch_as_strided, which reads as many
// sizes as t has dimensions (a 3-D view of a 2-D tensor comes back 2-D).
inline Tensor as_strided(const Tensor& t, const std::vector<int64_t>& sizes,
                         const std::vector<int64_t>& strides) {
  AtenTensorHandle handle = nullptr;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch__reinterpret_tensor(
      t.get(), static_cast<int64_t>(sizes.size()), sizes.data(), strides.data(),
      /*storage_offset=*/0, &handle));
  return Tensor(handle);
}

// The transpose of a 2-D tensor (a view).
inline Tensor transposed(const Tensor& t) {
  return as_strided(t, {t.size(1), t.size(0)}, {t.stride(1), t.stride(0)});
}

inline void zero_(const Tensor& t) { STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_zero_(t.get())); }

// t's bytes read as `dtype` (aten::view.dtype).
inline Tensor view_as_dtype(const Tensor& t, ScalarType dtype) {
  std::array<StableIValue, 2> stack{from(t), from(dtype)};
  call_aten("aten::view", "dtype", stack);
  return to<Tensor>(stack[0]);
}

// A new contiguous tensor of `sizes` on t's device, in `dtype` (t's by default). Through the C
// shim's own allocation call: the dispatcher's aten::empty costs an operator lookup and boxing on
// every call, host time that counts at small batch.
inline Tensor empty_like_device(const Tensor& t, std::vector<int64_t> sizes,
                                std::optional<ScalarType> dtype = std::nullopt) {
  std::vector<int64_t> strides(sizes.size());
  int64_t stride = 1;
  for (size_t i = sizes.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= std::max<int64_t>(sizes[i], 1);
  }
  int32_t device_type = 0, device_index = 0, shim_dtype = 0;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(t.get(), &device_type));
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_index(t.get(), &device_index));
  if (dtype) {
    shim_dtype = to<int32_t>(from(*dtype));
  } else {
    STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(t.get(), &shim_dtype));
  }
  AtenTensorHandle handle = nullptr;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(
      static_cast<int64_t>(sizes.size()), sizes.data(), strides.data(), shim_dtype, device_type,
      device_index, &handle));
  return Tensor(handle);
}

inline Tensor zeros_like_device(const Tensor& t, std::vector<int64_t> sizes,
                                std::optional<ScalarType> dtype = std::nullopt) {
  Tensor zeros = empty_like_device(t, std::move(sizes), dtype);
  zero_(zeros);
  return zeros;
}

// t in `dtype` (t itself where it already is).
inline Tensor to_dtype(const Tensor& t, ScalarType dtype) {
  return t.scalar_type() == dtype ? t : torch::stable::to(t, dtype);
}

inline Tensor contiguous(const Tensor& t) {
  return t.is_contiguous() ? t : torch::stable::contiguous(t);
}

inline Tensor narrow(const Tensor& t, int64_t dim, int64_t start, int64_t length) {
  Tensor self = t;  // the stable narrow takes a non-const reference
  return torch::stable::narrow(self, dim, start, length);
}

}  // namespace aten
}  // namespace fused_pool_gelu
