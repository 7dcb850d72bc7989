// The forward's epilogue: per row, z = partial[0] + ... + partial[S-1] (in that order) + bias,
// v = gelu(z) * scale (NaN where z is not finite: docs/input_classes.md), and the (value, index,
// z) maximum with torch.max's rule (first index on ties, NaN wins). forward_plan.h's
// plan_epilogue picks the form: a CTA per row (256 threads, 1024 for wide rows with few splits)
// while the batch is small, a warp per row once the rows fill the GPU; on sm_90+ it is the GEMM's
// programmatic dependent, its CTAs spread over the SMs.
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <type_traits>

#include "argmax_band.h"
#include "cuda/common.cuh"
#include "cuda/forward_launch.h"
#include "cuda/row_max.cuh"

namespace fused_pool_gelu {
namespace cuda {
namespace {

// The CTA size of the epilogue with kThreadsPerRow threads per row (32: a warp per row).
constexpr int epilogue_cta_threads(int threads_per_row) {
  return threads_per_row == 32 ? kEpilogueThreads : threads_per_row;
}

// kColumns adjacent columns of a row of z or of the bias in one load (4 or 16 bytes of float32, 2
// or 8 of a half type; the caller keeps the address aligned to it), widened to float where used. A
// half type's values stay the loaded bits until then: moving them into registers of their own
// right after the load would make it wait for the load there, before the loads after it issue.
template <int kColumns, typename T>
struct Columns {
  static_assert(sizeof(T) == 2, "a half type (float32: the specialization below)");
  std::conditional_t<kColumns == 1, unsigned short, uint2> bits;

  __device__ __forceinline__ float operator[](int j) const {
    unsigned short value;
    if constexpr (kColumns == 1) {
      value = bits;
    } else {
      value = static_cast<unsigned short>((j < 2 ? bits.x : bits.y) >> (16 * (j % 2)));
    }
    return static_cast<float>(T(value, T::from_bits()));  // exact
  }
};

template <int kColumns>
struct Columns<kColumns, float> {
  float v[kColumns];

  __device__ __forceinline__ float operator[](int j) const { return v[j]; }
};

template <int kColumns, typename T>
__device__ __forceinline__ Columns<kColumns, T> load_columns(const T* first) {
  static_assert(kColumns == 1 || kColumns == 4, "a scalar or four adjacent columns");
  if constexpr (std::is_same_v<T, float> && kColumns == 1) {
    return {{__ldg(first)}};
  } else if constexpr (std::is_same_v<T, float>) {
    const float4 four = __ldg(reinterpret_cast<const float4*>(first));
    return {{four.x, four.y, four.z, four.w}};
  } else if constexpr (kColumns == 1) {
    return {*reinterpret_cast<const unsigned short*>(first)};
  } else {
    return {*reinterpret_cast<const uint2*>(first)};
  }
}

// A split sum of kColumns adjacent columns of z in sum_few_splits' order (row_max.cuh), from its
// splits' loads (kSplitBound of them, the ones past the last split repeating it as there): a warp
// per row and a CTA per row give a row the same z.
template <int kSplitBound, int kColumns>
__device__ __forceinline__ float split_sum(const Columns<kColumns, float> (&part)[kSplitBound],
                                           int splits, int j) {
  float z = part[0][j];
#pragma unroll
  for (int s = 1; s < kSplitBound; ++s) {
    if (s < splits) z += part[s][j];
  }
  return z;
}

// kSplitBound: the splits' bound for sum_few_splits (1, 2, 4, ..., kEpilogueMaxSplitBound), or 0:
// batches of kSplitBatch (no split, or more than kEpilogueMaxSplitBound). kColumnsPerLoad: 4 for a
// warp per row of one split or of the half path's slices of K whose loads launch_epilogue found
// aligned, else 1.
template <int kThreadsPerRow, int kSplitBound, typename out_t, int kColumnsPerLoad = 1>
__global__ void __launch_bounds__(epilogue_cta_threads(kThreadsPerRow))
    argmax_epilogue_kernel(const EpilogueParams p, out_t* __restrict__ out,
                           int64_t* __restrict__ argmax, out_t* __restrict__ preactivation) {
  wait_for_previous_grid();
  constexpr int kCtaThreads = epilogue_cta_threads(kThreadsPerRow);
  static_assert(kThreadsPerRow == 32 || kThreadsPerRow == kCtaThreads, "warp or CTA per row");
  static_assert(kCtaThreads <= 32 * 32, "one warp merges the warps' maxima");
  constexpr int kRowsPerCta = kCtaThreads / kThreadsPerRow;
  constexpr int kWarps = kCtaThreads / 32;

  const int tid = threadIdx.x;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerCta + tid / kThreadsPerRow;
  const int col0 = tid % kThreadsPerRow;

  // A warp's row of one split, or of up to kSplitBound splits in 16-byte loads, reduces over the
  // warp itself (argmax_band.h's band needs the row's largest z first).
  constexpr bool kWarpRow = kThreadsPerRow == 32 && (kSplitBound == 1 || kColumnsPerLoad == 4);
  Candidate best{-INFINITY, p.n, 0.f};
  if (row < p.batch) {
    const float* row_partial = p.partial + row * p.n;
    const out_t* bias = static_cast<const out_t*>(p.bias);
    // Column col's value from its z (split sum plus bias): torch's order, gelu(z) first, then the
    // product with scale. A non-finite pre-activation gives NaN, as in the CPU kernel
    // (docs/design.md, "Non-finite values").
    auto consider = [&](int64_t col, float z) {
      const float v = isfinite(z) ? gelu(z) * p.scale : NAN;
      if (beats(v, col, best.value, best.index)) best = Candidate{v, col, z};
    };
    if constexpr (kWarpRow) {
      // A warp's row: kLoads loads of z (of each split) and of the bias per lane issued before
      // their use (in the full pass, before their GELUs, whose erf branches keep the compiler from
      // hoisting loads across an unrolled loop's columns). Scalar, 8 columns per lane in flight
      // (two rounds at N = 512); 4 columns per load, 16 (the whole of a 512-column row in one
      // round) for about the registers of the 8 at one split.
      static_assert(kColumnsPerLoad == 1 || kColumnsPerLoad == 4, "scalar or 16-byte z loads");
      constexpr int kLoads = kColumnsPerLoad == 1 ? 8 : 4;
      constexpr int kStep = kColumnsPerLoad * kThreadsPerRow;  // columns between a lane's loads
      int split_offset[kSplitBound];
#pragma unroll
      for (int s = 0; s < kSplitBound; ++s) {
        split_offset[s] = min(s, p.splits - 1) * static_cast<int>(p.split_stride);
      }
      auto for_each_column = [&](auto&& f) {
        for (int64_t base = int64_t{col0} * kColumnsPerLoad; base < p.n; base += kLoads * kStep) {
          // Every load of the round before any sum: summed per load, ptxas issues the next
          // load's splits only after the sum (a round trip per load at 4 splits).
          Columns<kColumnsPerLoad, float> z[kLoads][kSplitBound] = {};
          Columns<kColumnsPerLoad, out_t> b[kLoads] = {};
#pragma unroll
          for (int u = 0; u < kLoads; ++u) {
            const int64_t col = base + u * kStep;
#pragma unroll
            for (int s = 0; s < kSplitBound; ++s) {
              if (col < p.n) {
                z[u][s] = load_columns<kColumnsPerLoad>(row_partial + split_offset[s] + col);
              }
            }
            if (col < p.n && bias != nullptr) b[u] = load_columns<kColumnsPerLoad>(bias + col);
          }
          // With kColumnsPerLoad = 4, N % 4 == 0: a load's columns are all inside the row.
#pragma unroll
          for (int u = 0; u < kLoads; ++u) {
            const int64_t col = base + u * kStep;
            if (col < p.n) {
#pragma unroll
              for (int j = 0; j < kColumnsPerLoad; ++j) {
                const float z_sum = split_sum(z[u], p.splits, j);
                f(col + j, bias != nullptr ? z_sum + b[u][j] : z_sum);
              }
            }
          }
        }
      };
      // argmax_band.h's band: the GELUs of the columns near the row's largest z only, where that
      // provably gives the full pass's bits, else every column's. The first pass keeps each
      // lane's two largest z (a z equal to the largest counts as the second too) and the largest's
      // column: where the band holds one column of the whole row (one lane's largest, no lane's
      // second), that column is the band's winner with no second read of the row and no warp
      // arg-max (on the benchmarks' data almost every row: the band is 2^-10 of z_max wide);
      // otherwise the band's columns are evaluated in a second read, from L1. The warp's
      // reductions leave every lane with the same z_max, flags and winner, so the branches are
      // uniform.
      float z_max = -INFINITY;
      float z_second = -INFINITY;
      int64_t z_max_col = p.n;
      // Inf x 0 and NaN x 0 are NaN, a finite z x 0 is +-0: one FFMA per column flags the row.
      float non_finite = 0.f;
      for_each_column([&](int64_t col, float z) {
        non_finite = fmaf(z, 0.f, non_finite);
        z_max_col = z > z_max ? col : z_max_col;
        z_second = fmaxf(z_second, fminf(z_max, z));
        z_max = fmaxf(z_max, z);
      });
      float row_z_max = z_max;
#pragma unroll
      for (int mask = 16; mask >= 1; mask /= 2) {
        row_z_max = fmaxf(row_z_max, __shfl_xor_sync(0xffffffffu, row_z_max, mask));
      }
      const bool finite = __all_sync(0xffffffffu, non_finite == 0.f);
      bool decided = false;
      if (argmax_band_applies(p.scale, finite, row_z_max)) {
        const float threshold = argmax_band_threshold(row_z_max);
        const unsigned lanes_in_band = __ballot_sync(0xffffffffu, z_max >= threshold);
        if (__popc(lanes_in_band) == 1 && !__any_sync(0xffffffffu, z_second >= threshold)) {
          const int owner = __ffs(lanes_in_band) - 1;
          const float z = __shfl_sync(0xffffffffu, z_max, owner);
          const int64_t col = static_cast<int64_t>(__shfl_sync(
              0xffffffffu, static_cast<long long>(z_max_col), owner));
          best = Candidate{gelu(z) * p.scale, col, z};  // consider's value: z is finite
        } else {
          for_each_column([&](int64_t col, float z) {
            if (z >= threshold) consider(col, z);
          });
          best = warp_argmax(best);
        }
        decided = argmax_band_decided(best.value);
        if (!decided) best = Candidate{-INFINITY, p.n, 0.f};
      }
      if (!decided) {
        for_each_column(consider);
        best = warp_argmax(best);
      }
    } else {
      // Two outputs' loads in flight per thread, but one at the bound of 64 (two spilled at 255
      // registers).
      constexpr int kColumnUnroll = kSplitBound >= 64 ? 1 : 2;
#pragma unroll kColumnUnroll
      for (int64_t col = col0; col < p.n; col += kThreadsPerRow) {
        float z;
        if constexpr (kSplitBound > 0) {
          z = sum_few_splits<kSplitBound>(row_partial + col, static_cast<int>(p.split_stride),
                                          p.splits);
        } else {
          z = sum_splits<kSplitBatch>(row_partial + col, p.split_stride, p.splits);
        }
        if (bias != nullptr) z += load_columns<1>(bias + col)[0];
        consider(col, z);
      }
    }
  }
  if constexpr (!kWarpRow) best = warp_argmax(best);

  if constexpr (kThreadsPerRow == kCtaThreads) {
    __shared__ float s_value[kWarps];
    __shared__ int64_t s_index[kWarps];
    __shared__ float s_z[kWarps];
    const int warp = tid / 32;
    const int lane = tid % 32;
    if (lane == 0) {
      s_value[warp] = best.value;
      s_index[warp] = best.index;
      s_z[warp] = best.z;
    }
    __syncthreads();
    if (warp != 0) return;
    best = lane < kWarps ? Candidate{s_value[lane], s_index[lane], s_z[lane]}
                         : Candidate{-INFINITY, p.n, 0.f};
    best = warp_argmax(best);
  }
  if (col0 == 0 && row < p.batch) {
    out[row] = static_cast<out_t>(best.value);
    argmax[row] = best.index;
    preactivation[row] = static_cast<out_t>(best.z);
  }
}

// Calls f(kernel) for each CTA-per-row epilogue instance: every split bound (0, 1, 2, 4, ...,
// kMaxSplitBound) and output type.
template <int kThreadsPerRow, int kMaxSplitBound, int kSplitBound = 0, typename F>
void for_each_row_epilogue(F&& f) {
  f(argmax_epilogue_kernel<kThreadsPerRow, kSplitBound, float>);
  f(argmax_epilogue_kernel<kThreadsPerRow, kSplitBound, Half>);
  f(argmax_epilogue_kernel<kThreadsPerRow, kSplitBound, BFloat16>);
  if constexpr (kSplitBound < kMaxSplitBound) {
    for_each_row_epilogue<kThreadsPerRow, kMaxSplitBound, kSplitBound == 0 ? 1 : 2 * kSplitBound>(
        f);
  }
}
}  // namespace

void configure_epilogue_kernels(int device, DeviceLimits& limits) {
  limits.epilogue_one_split_ctas_per_sm = std::numeric_limits<int>::max();
  for_each_row_epilogue<kEpilogueThreads, 1, 1>([&](auto kernel) {  // the output types' instances
    limits.epilogue_one_split_ctas_per_sm =
        std::min(limits.epilogue_one_split_ctas_per_sm,
                 resident_ctas_per_sm(kernel, kEpilogueThreads, 0));
  });
  if (limits.spread_smem_max > 0) {
    auto allow_spread = [&](auto kernel) { set_max_dynamic_smem(kernel, limits.spread_smem_max); };
    for_each_row_epilogue<kEpilogueThreads, kEpilogueMaxSplitBound>(allow_spread);
    for_each_row_epilogue<kEpilogueWideRowThreads, kEpilogueWideRowMaxSplitBound, 1>(allow_spread);
  }
  limits.dependent_launch =
      dependent_launch_enabled<argmax_epilogue_kernel<kEpilogueThreads, 1, float>>(device);
}

bool epilogue_vector_aligned(const EpilogueParams& p, const Tensor& out) {
  return p.n % 4 == 0 && is_aligned(p.partial, 4 * sizeof(float)) &&
         (p.bias == nullptr || is_aligned(p.bias, 4 * out.element_size()));
}

void launch_epilogue(const EpiloguePlan& plan, const EpilogueParams& p, Tensor& out,
                     Tensor& argmax, Tensor& preactivation, const DeviceLimits& limits,
                     bool dependent_launch, cudaStream_t stream) {
  FPG_DISPATCH_CUDA_FLOATING_TYPES(out.scalar_type(), "fused_pool_gelu.forward", [&] {
    using out_t = scalar_t;
    auto launch = [&](auto threads_per_row, auto split_bound, auto columns_per_load) {
      constexpr int kThreadsPerRow = decltype(threads_per_row)::value;
      constexpr int kCtaThreads = epilogue_cta_threads(kThreadsPerRow);
      constexpr int kRowsPerCta = kCtaThreads / kThreadsPerRow;
      const int64_t blocks = grid_blocks(p.batch, kRowsPerCta, "rows of x");
      cudaLaunchAttribute attribute{};
      cudaLaunchConfig_t config =
          dependent_launch_config(blocks, kCtaThreads, stream, attribute, dependent_launch);
      if (dependent_launch && kRowsPerCta == 1) {
        config.dynamicSmemBytes = spread_smem_bytes(limits, blocks, 0);
      }
      STD_CUDA_CHECK(cudaLaunchKernelEx(
          &config,
          argmax_epilogue_kernel<kThreadsPerRow, decltype(split_bound)::value, out_t,
                                 decltype(columns_per_load)::value>,
          p, out.mutable_data_ptr<out_t>(), argmax.mutable_data_ptr<int64_t>(), preactivation.mutable_data_ptr<out_t>()));
    };
    constexpr std::integral_constant<int, 1> kScalarLoads{};
    constexpr std::integral_constant<int, 4> kVectorLoads{};
    // Split bound 0 (batches of kSplitBatch) or a power of two up to max_bound.
    auto with_split_bound = [&](auto max_bound, auto threads_per_row, auto columns_per_load) {
      if (plan.split_bound == 0) {
        launch(threads_per_row, std::integral_constant<int, 0>{}, columns_per_load);
      } else {
        dispatch_split_bound<decltype(max_bound)::value>(plan.split_bound, [&](auto split_bound) {
          launch(threads_per_row, split_bound, columns_per_load);
        });
      }
    };
    constexpr std::integral_constant<int, kEpilogueMaxSplitBound> kScalarMax{};
    if (plan.threads_per_row == 32 && plan.columns_per_load == 4) {
      dispatch_split_bound<kEpilogueVectorMaxSplits>(plan.split_bound, [&](auto split_bound) {
        launch(std::integral_constant<int, 32>{}, split_bound, kVectorLoads);
      });
    } else if (plan.threads_per_row == 32) {
      with_split_bound(kScalarMax, std::integral_constant<int, 32>{}, kScalarLoads);
    } else if (plan.threads_per_row == kEpilogueWideRowThreads) {
      dispatch_split_bound<kEpilogueWideRowMaxSplitBound>(plan.split_bound, [&](auto split_bound) {
        launch(std::integral_constant<int, kEpilogueWideRowThreads>{}, split_bound, kScalarLoads);
      });
    } else {
      FPG_CHECK(plan.threads_per_row == kEpilogueThreads,
                  "fused_pool_gelu.forward: internal error: epilogue of ", plan.threads_per_row,
                  " threads per row");
      with_split_bound(kScalarMax, std::integral_constant<int, kEpilogueThreads>{}, kScalarLoads);
    }
  });
}

}  // namespace cuda
}  // namespace fused_pool_gelu
