// Device helpers shared by the CUDA kernels: exact GELU and its derivative, programmatic dependent
// launch, launch checks, vectorized access.
#pragma once

#include <cuda_runtime.h>
#include <torch/csrc/stable/macros.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <type_traits>
#include <utility>

#include "stable_tensor.h"

namespace fused_pool_gelu {
namespace cuda {

// The current CUDA stream of the current device, where PyTorch's own kernels launch.
inline cudaStream_t current_stream() {
  void* stream = nullptr;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(/*device_index=*/-1, &stream));
  return static_cast<cudaStream_t>(stream);
}

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

// Programmatic dependent launch (sm_90+), both halves: a kernel that calls
// allow_dependent_launch() lets the next kernel on the stream (launched with the attribute,
// dependent_launch_config) start once all its CTAs have executed it; that kernel waits in
// wait_for_previous_grid() until the one before has completed and its writes are visible, before
// it reads or writes any global memory. The dependent's launch then overlaps the kernel before it
// instead of following it. Elsewhere both are no-ops (the host launches without the attribute).
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Asks L2 to fetch [p, p + bytes) (sm_90+: one bulk prefetch; p 16-byte aligned, bytes a multiple
// of 16), so that loads issued later find the lines there or on their way; elsewhere a no-op.
__device__ __forceinline__ void prefetch_to_l2(const void* p, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// An L2 policy under which loaded lines are evicted before the others (createpolicy evict_first:
// data read once, which should not push out data read again). Made once, before a load loop.
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
#else
  return 0;
#endif
}

// A load of read-only data under an L2 policy (l2_evict_first_policy); elsewhere a plain __ldg.
__device__ __forceinline__ float4 ldg_with_policy(const float4* p, uint64_t policy) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float4 v;
  asm("ld.global.nc.L2::cache_hint.v4.f32 {%0, %1, %2, %3}, [%4], %5;\n"
      : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
      : "l"(p), "l"(policy));
  return v;
#else
  return __ldg(p);
#endif
}

// A launch of `blocks` x `threads` on `stream`, as a programmatic dependent of the kernel before it
// when `dependent` (dependent_launch_enabled for the kernel launched). `attribute` must
// outlive the launch call.
inline cudaLaunchConfig_t dependent_launch_config(int64_t blocks, int threads, cudaStream_t stream,
                                                  cudaLaunchAttribute& attribute,
                                                  bool dependent) {
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(threads);
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = dependent ? 1 : 0;
  return config;
}

// Whether kKernel (a __global__ function that calls wait_for_previous_grid() before it touches
// global memory) may be launched as a programmatic dependent on `device`, the current device. The
// device must support it (compute capability 9.0 or later), and so must the code the runtime
// loaded for the kernel there: wait_for_previous_grid() is an instruction only in code compiled
// for sm_90 or later. A build that reaches a newer GPU only through older PTX
// (TORCH_CUDA_ARCH_LIST="8.0+PTX" on an H100, compiled just in time) has it compiled to nothing,
// and its dependents would read their inputs before the kernel before them had written them.
// Asked of the runtime once per device, then an atomic load.
template <auto kKernel>
bool dependent_launch_enabled(int device) {
  constexpr int kCachedDevices = 64;
  // 0: not asked yet; 1: no; 2: yes. Two first calls racing both ask and store the same answer.
  static std::atomic<int8_t> answer[kCachedDevices] = {};
  const bool cached = 0 <= device && device < kCachedDevices;
  if (cached) {
    const int8_t known = answer[device].load(std::memory_order_relaxed);
    if (known != 0) return known == 2;
  }
  int major = 0;
  STD_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  cudaFuncAttributes attributes{};
  STD_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kKernel));
  const bool enabled = major >= 9 && attributes.ptxVersion >= 90;
  if (cached) answer[device].store(enabled ? 2 : 1, std::memory_order_relaxed);
  return enabled;
}

// 16 bytes is the widest global load/store one thread can issue (LDG.E.128 / STG.E.128).
constexpr int kVectorBytes = 16;

// Elements of T in one 16-byte access: 4 floats, 8 halves or bfloat16s.
template <typename T>
constexpr int vector_width() {
  return kVectorBytes / static_cast<int>(sizeof(T));
}

// VEC elements that move between global memory and registers as one aligned access. Callers check
// on the host that every address they use is a multiple of sizeof(AlignedVector) (is_aligned).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) AlignedVector {
  T val[VEC];
};

// One access of VEC elements at p (VEC == 1 is a plain scalar access). 16-byte accesses are
// written in PTX: nvcc 13 split a plain 16-byte struct store into four 4-byte stores when the
// column index came out of a 64-bit division (seen in the PTX of fold_backward), and that would
// quarter the store instructions' width on a purely store-bound kernel. The loads use ld.global.nc
// (the read-only path): every caller reads an input that no thread writes during the kernel.
// Both are volatile so that the compiler never speculates one out of the bounds check guarding it.
template <typename T, int VEC>
__device__ __forceinline__ AlignedVector<T, VEC> load_vector(const T* p) {
  AlignedVector<T, VEC> v;
  if constexpr (sizeof(v) == 16) {
    uint4 bits;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(bits.x), "=r"(bits.y), "=r"(bits.z), "=r"(bits.w)
        : "l"(__cvta_generic_to_global(p)));
    memcpy(&v, &bits, sizeof(v));
  } else {
    v = *reinterpret_cast<const AlignedVector<T, VEC>*>(p);
  }
  return v;
}

// kStreaming: st.global.cs (evict first) for the 16-byte path, for outputs far larger than L2 that
// no kernel of the call reads back (the fold's adjoint writes 256 MB at the default shape); other
// widths are plain stores.
template <typename T, int VEC, bool kStreaming = false>
__device__ __forceinline__ void store_vector(T* p, const AlignedVector<T, VEC>& v) {
  if constexpr (sizeof(v) == 16) {
    uint4 bits;
    memcpy(&bits, &v, sizeof(v));
    if constexpr (kStreaming) {
      asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(__cvta_generic_to_global(p)),
                   "r"(bits.x), "r"(bits.y), "r"(bits.z), "r"(bits.w)
                   : "memory");
    } else {
      asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(__cvta_generic_to_global(p)),
                   "r"(bits.x), "r"(bits.y), "r"(bits.z), "r"(bits.w)
                   : "memory");
    }
  } else {
    *reinterpret_cast<AlignedVector<T, VEC>*>(p) = v;
  }
}

inline bool is_aligned(const void* ptr, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % static_cast<uintptr_t>(bytes) == 0;
}

// True when the rows of `t` [rows, cols] can be read or written as AlignedVector<_, vec>: unit
// column stride, whole vectors per row, every row start 16-byte aligned. Otherwise the callers
// take their strided scalar paths.
inline bool rows_are_vectorizable(const Tensor& t, int vec) {
  return t.size(1) % vec == 0 && t.stride(1) == 1 && t.stride(0) % vec == 0 &&
         is_aligned(t.const_data_ptr(), kVectorBytes);
}

template <typename Kernel>
void set_max_dynamic_smem(Kernel kernel, int bytes) {
  STD_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

template <typename Kernel>
int resident_ctas_per_sm(Kernel kernel, int threads, int smem_bytes) {
  int ctas = 0;
  STD_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kernel, threads, smem_bytes));
  return ctas;
}

// Kernel families compiled for a list of sizes (kValues: ascending, distinct), one instance per
// value. for_each_value calls f(std::integral_constant<int, kValues[i]>) for each i.
template <const auto& kValues, typename F, size_t... kIndices>
void for_each_value(F&& f, std::index_sequence<kIndices...>) {
  (f(std::integral_constant<int, kValues[kIndices]>{}), ...);
}
template <const auto& kValues, typename F>
void for_each_value(F&& f) {
  for_each_value<kValues>(f, std::make_index_sequence<std::size(kValues)>{});
}

// Calls f(std::integral_constant<int, kValues[i]>) (the values are distinct: one call).
template <const auto& kValues, typename F>
void dispatch_value(int i, F&& f) {
  FPG_CHECK(0 <= i && i < static_cast<int>(std::size(kValues)),
              "fused_pool_gelu.forward: internal error: instance index ", i);
  for_each_value<kValues>([&](auto value) {
    if (decltype(value)::value == kValues[i]) f(value);
  });
}

// Calls f(std::integral_constant<int, bound>) for a power of two `bound` (1, 2, 4, ...,
// kMaxBound; forward_plan.h's split_bound_for picks it): the kernels that sum split partials with
// all their loads at once are compiled for these bounds.
template <int kMaxBound, int kBound = 1, typename F>
void dispatch_split_bound(int bound, F&& f) {
  static_assert(kMaxBound > 0 && (kMaxBound & (kMaxBound - 1)) == 0, "a power of two");
  if constexpr (kBound >= kMaxBound) {
    FPG_CHECK(bound == kMaxBound, "fused_pool_gelu.forward: internal error: split bound ",
                bound);
    f(std::integral_constant<int, kMaxBound>{});
  } else if (bound == kBound) {
    f(std::integral_constant<int, kBound>{});
  } else {
    dispatch_split_bound<kMaxBound, 2 * kBound>(bound, f);
  }
}

// gridDim.x's limit.
constexpr int64_t kMaxGridX = 0x7fffffff;

// Blocks of `per_block` items covering `items` (`what` they are, named in the error), checked
// against gridDim.x's limit.
inline unsigned int grid_blocks(int64_t items, int64_t per_block, const char* what) {
  const int64_t blocks = ceil_div(items, per_block);
  FPG_CHECK(blocks <= kMaxGridX, "fused_pool_gelu: ", items, " ", what, " need ", blocks,
              " CUDA blocks of ", per_block, ", more than gridDim.x's limit of ", kMaxGridX);
  return static_cast<unsigned int>(blocks);
}

}  // namespace cuda
}  // namespace fused_pool_gelu

// Calls the lambda __VA_ARGS__ with scalar_t the C++ type of TYPE, one of the dtypes the CUDA
// kernels are built for: float32, float16, bfloat16 (no float64 kernels: no check lets it through).
#define FPG_DISPATCH_CUDA_FLOATING_TYPES(TYPE, NAME, ...)                               \
  [&] {                                                                               \
    switch (TYPE) {                                                                   \
      case ::fused_pool_gelu::kFloat: {                                               \
        using scalar_t = float;                                                       \
        return __VA_ARGS__();                                                         \
      }                                                                               \
      case ::fused_pool_gelu::kHalf: {                                                \
        using scalar_t = ::fused_pool_gelu::Half;                                     \
        return __VA_ARGS__();                                                         \
      }                                                                               \
      case ::fused_pool_gelu::kBFloat16: {                                            \
        using scalar_t = ::fused_pool_gelu::BFloat16;                                 \
        return __VA_ARGS__();                                                         \
      }                                                                               \
      default:                                                                        \
        ::fused_pool_gelu::fail(NAME, ": internal error: no CUDA kernel for ", TYPE); \
    }                                                                                 \
  }()
