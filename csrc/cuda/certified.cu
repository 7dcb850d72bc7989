// The certified path's kernels after pass 1 and its host side: prepare_weight's scaled fp16 copy
// (prepare_rows_kernel), the selection of the columns that may hold each row's maximum, their
// float32 rescoring, and certified_forward, which runs pass 1 (certified_pass1_sm90a.cu) and them.
// The scheme and its error bound: certified.cuh.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/certified.cuh"
#include "cuda/common.cuh"
#include "cuda/forward_launch.h"
#include "prepared_weight.h"

namespace fused_pool_gelu {
namespace cuda {
namespace certified {

struct PrepareParams {
  const float* w;         // [n, k_padded], row stride ldw (a CTA per row)
  int64_t ldw;
  int64_t k4;             // k_padded / 4
  int64_t copy_halves;    // prepared_copy_halves(k_padded), a multiple of 64
  __half* copy;           // [n, copy_halves] (prepared_weight.h)
  float4* trailers;       // [n]
  float squares_floor;    // certified.cuh's norm_constants
  float norm_slack;
};

// Pieces of 4 floats a prepare_rows_kernel thread keeps in registers: rows of up to kThreads x
// this many pieces (K <= 8192) are read once; longer ones twice (the second read mostly from L1
// and L2).
constexpr int kPrepareCachedPieces = 8;

// One CTA per weight row: the row's scale from its largest magnitude, then its fp16 copy and the
// trailer (inverse scale and norms; see the top and prepared_weight.h). kCached: the row fits in
// the threads' registers (k4 <= kThreads x kPrepareCachedPieces), read once.
template <bool kCached>
__global__ void __launch_bounds__(kThreads) prepare_rows_kernel(const PrepareParams p) {
  allow_dependent_launch();
  __shared__ float s_value[kWarps];
  __shared__ int s_flag[kWarps];
  __shared__ float2 s_partial[kWarps];
  const int64_t row = blockIdx.x;
  const float4* source = reinterpret_cast<const float4*>(p.w + row * p.ldw);
  uint2* copy = reinterpret_cast<uint2*>(p.copy + row * p.copy_halves);

  float4 cached[kCached ? kPrepareCachedPieces : 1];
  float largest = 0.f;  // NaN never wins fmaxf; a NaN element reaches the norms below
  auto take = [&](const float4& v) {
    largest = fmaxf(largest, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
  };
  if constexpr (kCached) {
#pragma unroll
    for (int j = 0; j < kPrepareCachedPieces; ++j) {
      const int64_t i = threadIdx.x + j * kThreads;
      cached[j] = i < p.k4 ? __ldg(source + i) : make_float4(0.f, 0.f, 0.f, 0.f);
      take(cached[j]);
    }
  } else {
#pragma unroll 4
    for (int64_t i = threadIdx.x; i < p.k4; i += kThreads) take(__ldg(source + i));
  }
  bool unused = false;
  largest = block_max(largest, unused, s_value, s_flag);
  const int exponent = scale_exponent(largest, 14);
  const float scale = ldexpf(1.f, exponent);

  // Squares of the scaled values in .x, of their residuals in .y.
  float2 sums = make_float2(0.f, 0.f);
  auto convert = [&](int64_t i, const float4& v) {
    const float scaled[4] = {v.x * scale, v.y * scale, v.z * scale, v.w * scale};
    const uint32_t low = fp16_pair(scaled[0], scaled[1]);
    const uint32_t high = fp16_pair(scaled[2], scaled[3]);
    const float2 low_back = __half22float2(*reinterpret_cast<const __half2*>(&low));
    const float2 high_back = __half22float2(*reinterpret_cast<const __half2*>(&high));
    const float residual[4] = {scaled[0] - low_back.x, scaled[1] - low_back.y,
                               scaled[2] - high_back.x, scaled[3] - high_back.y};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      sums.x = fmaf(scaled[e], scaled[e], sums.x);
      sums.y = fmaf(residual[e], residual[e], sums.y);
    }
    copy[prepared_copy_group(i)] = make_uint2(low, high);
  };
  // The same pieces in the same order either way: the same sums.
  if constexpr (kCached) {
#pragma unroll
    for (int j = 0; j < kPrepareCachedPieces; ++j) {
      const int64_t i = threadIdx.x + j * kThreads;
      if (i < p.k4) convert(i, cached[j]);
    }
  } else {
#pragma unroll 4
    for (int64_t i = threadIdx.x; i < p.k4; i += kThreads) convert(i, __ldg(source + i));
  }
  // The copy's zero padding up to 128-byte rows.
  for (int64_t i = p.k4 + threadIdx.x; i < p.copy_halves / 4; i += kThreads) {
    copy[prepared_copy_group(i)] = make_uint2(0u, 0u);
  }
  sums = block_sum(sums, s_partial);
  if (threadIdx.x == 0) {
    const float inverse = ldexpf(1.f, -exponent);
    auto norm = [&](float sum) {
      return norm_from_squares(sum, p.squares_floor, p.norm_slack, inverse);
    };
    float trailer[4] = {};
    trailer[kPreparedNorm] = norm(sums.x);
    trailer[kPreparedResidualNorm] = norm(sums.y);
    trailer[kPreparedInverseScale] = inverse;
    p.trailers[row] = make_float4(trailer[0], trailer[1], trailer[2], trailer[3]);
  }
}

// An x row's norms from pass 1's per-split sums, by one warp (lane s: split s), every lane getting
// the result: each split's sums are in the units of that split's scale 2^e_s, so they are brought
// to the largest of the row's scales' inverses (the smallest e) by factors 2^(2 (e_min - e_s)) <= 1
// and added, all rounded up (a sum of S terms, outside gamma'); then sqrt(sum + K 2^-148)
// (1 + gamma' + 2^-22) 2^-e_min, rounded up (see the top). The terms are added by a butterfly
// over the warp: the bound needs only an upper bound of their sum, which rounding every addition
// of non-negative terms up gives in any order, and both lanes of a pair compute the same sum
// (addition commutes, its rounding too), so every lane ends with the same bits. A sum in split
// order would be 32 dependent shuffle-and-add steps per sum.
// One lane per split: at most 32 (static_assert at kFusedMaxSplits).
__device__ __forceinline__ Norms x_row_norms(const SelectParams& p, int64_t row, int lane) {
  const bool mine = lane < p.splits;
  float squares = 0.f, residual_squares = 0.f;
  int exponent = INT_MAX;  // no split: never the smallest
  if (mine) {
    // Row-major by split, so that a warp's 32 lanes read one row's splits in 4 sectors
    // (split-major, each lane's sum would be a sector of its own: 8 times the row's bytes).
    const int64_t offset = row * p.splits + lane;
    squares = __ldg(p.x_sumsq + offset);
    residual_squares = __ldg(p.x_residual_sumsq + offset);
    exponent = __ldg(p.x_scale_exponent + offset);
  }
  int smallest = exponent;
#pragma unroll
  for (int mask = 16; mask >= 1; mask /= 2) {
    smallest = min(smallest, __shfl_xor_sync(0xffffffffu, smallest, mask));
  }
  // 2^(e_min - e_s) >= 2^-126 is a normal float; applied twice, each product rounded up.
  const float factor = mine ? ldexpf(1.f, smallest - exponent) : 0.f;
  // Lanes past the last split hold 0, which adds exactly.
  float sum = __fmul_ru(__fmul_ru(squares, factor), factor);
  float residual_sum = __fmul_ru(__fmul_ru(residual_squares, factor), factor);
#pragma unroll
  for (int mask = 16; mask >= 1; mask /= 2) {
    sum = __fadd_ru(sum, __shfl_xor_sync(0xffffffffu, sum, mask));
    residual_sum = __fadd_ru(residual_sum, __shfl_xor_sync(0xffffffffu, residual_sum, mask));
  }
  const float inverse = ldexpf(1.f, -smallest);
  auto norm = [&](float squares_sum) {
    return norm_from_squares(squares_sum, p.bound.squares_floor, p.bound.norm_slack, inverse);
  };
  return Norms{norm(sum), norm(residual_sum)};
}

__host__ __device__ constexpr int select_smem_bytes(int64_t n) {
  return static_cast<int>(n * sizeof(float));
}

// Threads of a selection CTA (one row): 128, 4 columns each at N = 512, 12 CTAs per SM at 40
// registers. Against 256 threads at 6 per SM, the per-CTA code (the x norms, the block max, the
// candidate slots) is paid once per 4 columns instead of 2, and B = 1024's rows fit in one wave
// (research/README.md, "The certified path: selection").
constexpr int kSelectThreads = 128;
constexpr int kSelectWarps = kSelectThreads / 32;
// Adjacent columns a selection thread takes per loop step (the kernel's template argument): 1,
// or 4 where N % 4 == 0, each split's four partials then in one 8-byte load and all of the step's
// loads in flight at once: at N = 512 a thread's whole share in one round trip instead of four.
// Four need 64 registers, 8 CTAs per SM instead of 12: faster where the rows fit in one wave of 8
// per SM (B = 1024), slower past it (B = 4096: 3.9 waves instead of 2.6), so four only there.
__host__ __device__ constexpr int select_blocks_per_sm(int columns_per_thread) {
  return columns_per_thread == 1 ? 12 : 8;
}
inline int select_columns_per_thread(int64_t batch, int64_t n, int sms) {
  return n % 4 == 0 && batch <= int64_t{select_blocks_per_sm(4)} * sms ? 4 : 1;
}

// Shared memory of select_row, the candidates' upper ends aside (dynamic: [n] floats).
template <int kCtaWarps>
struct SelectScratch {
  float value[kCtaWarps];
  int flag[kCtaWarps];
  int count;
  Norms x_norms;
};

// The selection of one row by a CTA of kCtaThreads threads (see select_candidates_kernel): the
// row's candidates in candidates[0, count) (a row of p.candidates, or shared memory) and count
// returned to every thread, or -1: rescore every column. kNormsPerWarp: every warp takes the row's
// x norms itself, after issuing its first columns' loads, so that the two round trips overlap and
// no barrier waits for one warp's (select_rescore_kernel, one CTA per SM); else warp 0 takes them
// and hands them over through shared memory, which keeps the column loop's registers free of that
// code's (the selection kernel's 40-register cap). on_candidate(col) is called for each candidate
// column as it is found, before the list is complete.
template <int kSplitBound, int kColumnsPerThread, int kCtaThreads, bool kNormsPerWarp,
          typename OnCandidate>
__device__ __forceinline__ int select_row(const SelectParams& p, int64_t row, float* s_upper,
                                          SelectScratch<kCtaThreads / 32>& scratch, int* candidates,
                                          OnCandidate&& on_candidate) {
  constexpr int kCtaWarps = kCtaThreads / 32;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int64_t row_index = row * p.n;  // of the row's first partial in each split
  const int64_t first_column = kColumnsPerThread * threadIdx.x;
  float partials[kColumnsPerThread][kSplitBound];
  Norms w_norms[kColumnsPerThread];
  float bias[kColumnsPerThread];
  // Everything a column step reads from global memory, issued together.
  auto load_step = [&](int64_t first) {
    load_split_partials<kSplitBound>(p, static_cast<uint32_t>(row_index + first), partials);
#pragma unroll
    for (int c = 0; c < kColumnsPerThread; ++c) {
      w_norms[c] = load_norms(p.w_norms + (first + c) * p.w_norms_stride);
      bias[c] = p.bias != nullptr ? __ldg(p.bias + first + c) : 0.f;
    }
  };
  Norms x_norms;
  if constexpr (kNormsPerWarp) {
    // The first step's loads (the weight norms and bias too: after the x norms, which wait on
    // their own loads, they would be a round trip of their own) in flight behind the x norms'.
    // Issued by every thread (a thread past the row's end re-reads its last columns, never used):
    // under `if (first_column < p.n)` ptxas converts the bfloat16 partials inside the branch, so
    // it waits for them before the x norms' loads are issued, a round trip of its own.
    load_step(min(first_column, p.n - kColumnsPerThread));
    x_norms = x_row_norms(p, row, lane);
    if (threadIdx.x == 0) scratch.count = 0;  // first used after block_max's barrier
  } else {
    if (warp == 0) {
      const Norms norms = x_row_norms(p, row, lane);
      if (lane == 0) {
        scratch.x_norms = norms;
        scratch.count = 0;
      }
    }
    __syncthreads();
    x_norms = scratch.x_norms;
  }

  float best_lower = -INFINITY;
  bool whole_row = false;
  for (int64_t first = first_column; first < p.n; first += kColumnsPerThread * kCtaThreads) {
    if (!kNormsPerWarp || first != first_column) load_step(first);
#pragma unroll
    for (int c = 0; c < kColumnsPerThread; ++c) {
      float lo = -INFINITY, hi = INFINITY;
      whole_row |= !column_value_interval(p, add_splits<kSplitBound>(p, partials[c]), bias[c],
                                          x_norms, w_norms[c], lo, hi);
      best_lower = fmaxf(best_lower, lo);
      s_upper[first + c] = hi;
    }
  }
  // Also the barrier after which every thread sees s_upper.
  best_lower = block_max<kCtaWarps>(best_lower, whole_row, scratch.value, scratch.flag);

  if (!whole_row) {
    for (int64_t col = threadIdx.x; col < p.n; col += kCtaThreads) {
      if (s_upper[col] >= best_lower) {
        on_candidate(col);
        const int slot = atomicAdd(&scratch.count, 1);
        if (slot < kMaxCandidates) candidates[slot] = static_cast<int>(col);
      }
    }
  }
  __syncthreads();
  const int count = scratch.count;
  return whole_row || count > kMaxCandidates ? -1 : count;
}

// One CTA per row, with every load it needs in flight together (a warp per row leaves too few warps
// to hide the latency). Here warp 0 first takes the row's x norms (x_row_norms; a kernel of their
// own would cost a launch), passed on through shared memory before the column loop, so that none of
// that code's registers are live in it. Then the CTA computes each column's interval once (its S
// split partials loaded at once, the weight's norms from prepare_rows_kernel), keeping its upper
// end in shared memory, and takes the block max of the lower ends. Each candidate takes its slot in
// the row's list from a shared counter: the list's order depends on the warps' timing, its contents
// and count do not, and neither do the rescoring's results (rescore_kernel: every column's
// arithmetic is the same in any slot, and the arg-max rule orders by value, then index). 40
// registers with one column per thread, 64 with four (at 8 splits), no spill. The square roots'
// slow path (arguments below 2^-101: zero and tiny rows; Inf, NaN) is a call, in warp 0 only.
template <int kSplitBound, int kColumnsPerThread>
__global__ void __launch_bounds__(kSelectThreads, select_blocks_per_sm(kColumnsPerThread))
    select_candidates_kernel(const SelectParams p) {
  wait_for_previous_grid();
  extern __shared__ float s_upper[];  // [n]
  __shared__ SelectScratch<kSelectWarps> scratch;
  const int64_t row = blockIdx.x;
  const int result = select_row<kSplitBound, kColumnsPerThread, kSelectThreads, false>(
      p, row, s_upper, scratch, p.candidates + row * kMaxCandidates, [](int64_t) {});
  if (threadIdx.x == 0) {
    p.count[row] = result;
    // Which CTA rescores the row does not change its result (rescore_kernel's arithmetic is per
    // row), so the order's dependence on the CTAs' timing leaves the outputs deterministic.
    const bool heavy = result < 0 || result >= kRescoreHeavyCandidates;
    const int64_t slot = heavy ? atomicAdd(p.rescore_ends, 1)
                               : p.batch - 1 - atomicAdd(p.rescore_ends + 1, 1);
    p.rescore_rows[slot] = static_cast<int>(row);
    p.rescore_counts[slot] = result;
  }
}

struct RescoreParams {
  const float* x;         // [batch, k_padded] rows of stride ldx (zero-padded past K)
  int64_t ldx;
  const float* w;         // [n, k_padded], stride ldw
  int64_t ldw;
  int64_t k4;             // k_padded / 4
  const float* bias;      // [n] or nullptr
  float scale;
  int64_t n;
  const int* candidates;
  const int* rescore_rows;    // SelectParams'
  const int* rescore_counts;
};

// Columns rescored together: one read of x feeds up to kGroup dot products, and that many weight
// rows are in flight per thread.
constexpr int kGroup = 4;

// A barrier over the kThreads threads of rescoring group `group` of a CTA of kGroups such groups
// (rescore_row): the CTA's own when there is one group, else named barrier 1 + group.
template <int kGroups>
__device__ __forceinline__ void group_barrier(int group) {
  if constexpr (kGroups == 1) {
    __syncthreads();
  } else {
    asm volatile("bar.sync %0, %1;" ::"r"(1 + group), "r"(kThreads) : "memory");
  }
}

// x[row] . w[cols[g]] in float32 for the kColumns columns of a group: per thread an FMA chain over
// every 256th group of 4 floats, then the threads' sums in a fixed tree. Every column's arithmetic
// is the same whichever slot or group it is in (deterministic, and the same function for every
// column, which the selection's argument needs). A group holds exactly the row's next columns, no
// placeholder: most rows have 1-2 candidates, and a fixed group of 4 would read a placeholder
// weight row for each empty slot.
template <int kColumns, bool kDeepLoads, int kGroups>
__device__ __forceinline__ void rescore_dots(const RescoreParams& p, const float4* x_row,
                                             const int64_t* cols, float* dots,
                                             float (*s_sum)[kWarps], int thread, int group) {
  const float4* w_rows[kColumns];
#pragma unroll
  for (int g = 0; g < kColumns; ++g) {
    w_rows[g] = reinterpret_cast<const float4*>(p.w + cols[g] * p.ldw);
    dots[g] = 0.f;
  }
  // Unrolled so that each thread has several iterations' loads in flight: a CTA rescoring one
  // row is latency-bound otherwise (~8 dependent round trips to L2 per group at K = 8192). Two
  // for groups of 3-4, four for 1-2 (the rows with one candidate, most of them, end the kernel):
  // within the 64 registers that let 4 CTAs share an SM (rescore_kernel; four for every group
  // needed 80, 3 CTAs per SM). kDeepLoads (select_rescore_kernel, one CTA per SM): twice that,
  // so that at K = 8192 a row's x and its first two candidates are one round trip.
  // x's row is read once per group of its candidates, a weight row by every row that has it as a
  // candidate: from B ~ 1024 the two no longer fit L2 together, and x's lines should go first.
  // (The fused kernel's few rows fit L2 many times over, and the policy's registers spill there.)
  const uint64_t x_policy = kDeepLoads ? 0 : l2_evict_first_policy();
#pragma unroll((kColumns <= 2 ? 4 : 2) * (kDeepLoads ? 2 : 1))
  for (int64_t i = thread; i < p.k4; i += kThreads) {
    const float4 a = kDeepLoads ? __ldg(x_row + i) : ldg_with_policy(x_row + i, x_policy);
#pragma unroll
    for (int g = 0; g < kColumns; ++g) {
      const float4 b = __ldg(w_rows[g] + i);
      dots[g] = fmaf(a.x, b.x, dots[g]);
      dots[g] = fmaf(a.y, b.y, dots[g]);
      dots[g] = fmaf(a.z, b.z, dots[g]);
      dots[g] = fmaf(a.w, b.w, dots[g]);
    }
  }
  const int warp = thread / 32;
  group_barrier<kGroups>(group);  // s_sum is reused by the next group of columns
#pragma unroll
  for (int g = 0; g < kColumns; ++g) {
#pragma unroll
    for (int mask = 16; mask >= 1; mask /= 2) {
      dots[g] += __shfl_xor_sync(0xffffffffu, dots[g], mask);
    }
    if (thread % 32 == 0) s_sum[g][warp] = dots[g];
  }
  group_barrier<kGroups>(group);
#pragma unroll
  for (int g = 0; g < kColumns; ++g) {
    dots[g] = s_sum[g][0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) dots[g] += s_sum[g][w];
  }
}

// Shared memory of rescore_row.
template <int kGroups>
struct RescoreScratch {
  float sum[kGroups][kGroup][kWarps];
  Candidate best[kGroups];
};

// Row `row`'s candidates (candidates[0, count), or every column where count < 0) rescored in
// float32 by the CTA's kGroups groups of kThreads threads (group g takes the candidates j with j
// mod kGroups = g), then the arg-max with torch.max's rule, written by thread 0. Each column's dot
// product is rescore_dots' whatever the group, so the result does not depend on kGroups (and the
// rule orders by value, then index, whichever group found a column).
template <bool kDeepLoads, int kGroups>
__device__ __forceinline__ void rescore_row(const RescoreParams& p, int64_t row, int count,
                                            const int* candidates,
                                            RescoreScratch<kGroups>& scratch, float* out,
                                            int64_t* argmax, float* preactivation) {
  // (One group: the CTA is kThreads threads, which the compiler cannot know from threadIdx.)
  const int group = kGroups == 1 ? 0 : static_cast<int>(threadIdx.x) / kThreads;
  const int thread = kGroups == 1 ? static_cast<int>(threadIdx.x)
                                  : static_cast<int>(threadIdx.x) % kThreads;
  const float4* x_row = reinterpret_cast<const float4*>(p.x + row * p.ldx);
  const int64_t columns = count < 0 ? p.n : count;
  // This group's share: candidates group, group + kGroups, ...
  const int64_t mine = columns > group ? (columns - group + kGroups - 1) / kGroups : 0;
  Candidate best{-INFINITY, p.n, 0.f};
  for (int64_t j0 = 0; j0 < mine; j0 += kGroup) {
    const int size = static_cast<int>(mine - j0 < kGroup ? mine - j0 : kGroup);
    int64_t cols[kGroup];
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      const int64_t j = group + kGroups * (j0 + (g < size ? g : 0));  // past `size`: never read
      cols[g] = count < 0 ? j : candidates[j];
    }
    // The columns' biases. With one CTA per SM's registers (kDeepLoads) they are issued before the
    // rows' loads: after the dot products' barriers they are one more round trip per group. Under
    // rescore_kernel's 64-register cap ptxas spills them there, and the spill store waits on the
    // load, a round trip before the rows' loads are issued: so that kernel loads them after.
    auto load_bias = [&](int g) { return p.bias != nullptr ? __ldg(p.bias + cols[g]) : 0.f; };
    float early_bias[kGroup];
    if constexpr (kDeepLoads) {
#pragma unroll
      for (int g = 0; g < kGroup; ++g) early_bias[g] = load_bias(g);
    }
    float dots[kGroup];
    auto dots_of = [&](auto column_count) {
      rescore_dots<decltype(column_count)::value, kDeepLoads, kGroups>(
          p, x_row, cols, dots, scratch.sum[group], thread, group);
    };
    switch (size) {
      case 1: dots_of(std::integral_constant<int, 1>{}); break;
      case 2: dots_of(std::integral_constant<int, 2>{}); break;
      case 3: dots_of(std::integral_constant<int, 3>{}); break;
      default: dots_of(std::integral_constant<int, kGroup>{}); break;
    }
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      if (g >= size) break;
      const float bias = kDeepLoads ? early_bias[g] : load_bias(g);
      const float z = p.bias != nullptr ? dots[g] + bias : dots[g];
      const float v = isfinite(z) ? gelu(z) * p.scale : NAN;
      best.take_if_better(Candidate{v, cols[g], z});
    }
  }
  if constexpr (kGroups > 1) {
    if (thread == 0) scratch.best[group] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
#pragma unroll
      for (int g = 1; g < kGroups; ++g) best.take_if_better(scratch.best[g]);
    }
  }
  if (threadIdx.x == 0) {
    out[row] = best.value;
    argmax[row] = best.index;
    preactivation[row] = best.z;
  }
}

// One CTA per row, in the selection's order (heavy rows first, kRescoreHeavyCandidates): the
// candidates' float32 z, then the arg-max with torch.max's rule. Each CTA waits on L2 most of the
// time, so residency decides the speed: 64 registers for 4 CTAs per SM (research/README.md, "The
// certified path: rescoring"). ptxas -v reports 16 bytes of spill stores and 56 of loads at that
// cap, none of them in the K loop.
__global__ void __launch_bounds__(kThreads, 4)
    rescore_kernel(const RescoreParams p, float* __restrict__ out, int64_t* __restrict__ argmax,
                   float* __restrict__ preactivation) {
  wait_for_previous_grid();  // the selection's writes
  __shared__ RescoreScratch<1> scratch;
  const int64_t row = p.rescore_rows[blockIdx.x];
  rescore_row<false, 1>(p, row, p.rescore_counts[blockIdx.x],
                        p.candidates + row * kMaxCandidates, scratch, out, argmax, preactivation);
}

static_assert(kMaxSplits <= 32 && kFusedMaxSplits <= 32, "x_row_norms: one lane per split");
// select_rescore_kernel's CTA: two rescoring groups of kThreads.
constexpr int kFusedGroups = 2;
constexpr int kFusedThreads = kFusedGroups * kThreads;

// The selection and the rescoring of a row by one CTA, for batches of at most one row per SM
// (forward_plan.h's certified_fused_rows): the two kernels' CTAs for a row, with the candidates
// handed over in shared memory instead of global memory and a launch. One CTA per SM spends its
// time on chains of round trips to L2, so here 512 threads: one column per thread at N = 512
// (every split load of the row in one round trip), the x norms taken by every warp while its
// loads are in flight (select_row's kNormsPerWarp), and two candidates rescored at once
// (rescore_row's groups). Same arithmetic per column as the two kernels, so the same results, and
// p.count[row] as the selection writes it.
template <int kSplitBound>
__global__ void __launch_bounds__(kFusedThreads, 1)
    select_rescore_kernel(const SelectParams p, const RescoreParams r, float* __restrict__ out,
                          int64_t* __restrict__ argmax, float* __restrict__ preactivation) {
  wait_for_previous_grid();
  extern __shared__ float s_upper[];  // [n]
  __shared__ SelectScratch<kFusedThreads / 32> select_scratch;
  __shared__ int s_candidates[kMaxCandidates];
  __shared__ RescoreScratch<kFusedGroups> rescore_scratch;
  const int64_t row = blockIdx.x;
  // Each candidate's weight row is asked of L2 as soon as the candidate is found: the rescoring's
  // loads of it wait for the list to be complete (a barrier), and pass 1 read only the weight's
  // fp16 copy, so the float32 row is in DRAM.
  const auto prefetch_row = [&](int64_t col) {
    prefetch_to_l2(r.w + col * r.ldw, static_cast<uint32_t>(r.k4 * sizeof(float4)));
  };
  const int count = select_row<kSplitBound, 1, kFusedThreads, true>(
      p, row, s_upper, select_scratch, s_candidates, prefetch_row);
  if (threadIdx.x == 0) p.count[row] = count;
  rescore_row<true, kFusedGroups>(r, row, count, s_candidates, rescore_scratch, out, argmax,
                                  preactivation);
}

// Calls f(kernel) for each selection instance: select_candidates_kernel at split bounds 1, 2, 4,
// ..., kMaxSplits, one or four columns per thread, and select_rescore_kernel at 1, 2, 4, ...,
// kFusedMaxSplits.
template <int kSplitBound = 1, typename F>
void for_each_select_kernel(F&& f) {
  static_assert(kFusedMaxSplits >= kMaxSplits, "one walk over the split bounds");
  if constexpr (kSplitBound <= kMaxSplits) {
    f(select_candidates_kernel<kSplitBound, 1>);
    f(select_candidates_kernel<kSplitBound, 4>);
  }
  f(select_rescore_kernel<kSplitBound>);
  if constexpr (kSplitBound < kFusedMaxSplits) for_each_select_kernel<2 * kSplitBound>(f);
}

}  // namespace certified

namespace {

// Pass 1's 2-D tensor map over `rows` rows of `columns` elements (row stride ld elements): boxes of
// 128 bytes (the swizzle span) x box_rows rows, 128-byte swizzle, zeros out of bounds. The driver's
// encoder is reached through the runtime (no link against libcuda).
template <typename T>
CUtensorMap tensor_map(const T* data, int64_t ld, int64_t rows, int64_t columns, int box_rows) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, __half>, "float32 or fp16");
  using Encode = PFN_cuTensorMapEncodeTiled_v12000;
  static const Encode encode = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found{};
    STD_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000,
                                                    cudaEnableDefault, &found));
    FPG_CHECK(found == cudaDriverEntryPointSuccess && function != nullptr,
                "fused_pool_gelu.forward: the CUDA driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<Encode>(function);
  }();
  CUtensorMap map{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(columns), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld) * sizeof(T)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(128 / sizeof(T)),
                             static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult result =
      encode(&map,
             std::is_same_v<T, float> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                      : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
             2, const_cast<T*>(data), dims, strides, box, element_strides,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  FPG_CHECK(result == CUDA_SUCCESS, "fused_pool_gelu.forward: cuTensorMapEncodeTiled failed (",
              static_cast<int>(result), ")");
  return map;
}

// The selection's result, as ints at the end of the call's float workspace: [batch] candidate
// counts (-1: every column), [batch, kMaxCandidates] candidate columns, then the rescoring's order
// ([batch] rows, [batch] counts, its 2 ends).
struct Selection {
  Tensor workspace;
  int64_t offset;  // floats before the ints
  int64_t batch;
  static int64_t ints(int64_t batch) { return batch * (3 + certified::kMaxCandidates) + 2; }
  int* count() const {
    return reinterpret_cast<int*>(workspace.mutable_data_ptr<float>() + offset);
  }
  int* candidates() const { return count() + batch; }
  int* rescore_rows() const { return candidates() + batch * certified::kMaxCandidates; }
  int* rescore_counts() const { return rescore_rows() + batch; }
  int* rescore_ends() const { return rescore_counts() + batch; }
};

// The selection and the rescoring after pass 1: select_rescore_kernel where `fused`, else
// select_candidates_kernel and rescore_kernel.
void launch_selection_and_rescoring(const GemmOperands& ops, const float* bias, float scale,
                                    int64_t batch, int64_t n, int64_t k_padded,
                                    const Selection& selection, const CertifiedOutputs& outputs,
                                    bool fused, const certified::SelectParams& select,
                                    const DeviceLimits& limits, cudaStream_t stream) {
  certified::RescoreParams rescore{};
  rescore.x = ops.x;
  rescore.ldx = ops.ldx;
  rescore.w = ops.w;
  rescore.ldw = ops.ldw;
  rescore.k4 = k_padded / 4;
  rescore.bias = bias;
  rescore.scale = scale;
  rescore.n = n;
  rescore.candidates = selection.candidates();
  rescore.rescore_rows = selection.rescore_rows();
  rescore.rescore_counts = selection.rescore_counts();
  cudaLaunchAttribute attribute{};
  if (fused) {
    cudaLaunchConfig_t config =
        dependent_launch_config(batch, certified::kFusedThreads, stream, attribute,
                                limits.dependent_launch);
    // Spread like the selection: as pass 1's dependent its CTAs would otherwise pile onto the
    // few SMs pass 1 leaves free.
    config.dynamicSmemBytes = spread_smem_bytes(limits, batch, certified::select_smem_bytes(n));
    dispatch_split_bound<certified::kFusedMaxSplits>(
        split_bound_for(select.splits, certified::kFusedMaxSplits), [&](auto split_bound) {
      STD_CUDA_CHECK(cudaLaunchKernelEx(
          &config, certified::select_rescore_kernel<decltype(split_bound)::value>, select,
          rescore, outputs.out, outputs.argmax, outputs.preactivation));
    });
    return;
  }
  cudaLaunchConfig_t select_config =
      dependent_launch_config(batch, certified::kSelectThreads, stream, attribute,
                              limits.dependent_launch);
  select_config.dynamicSmemBytes =
      spread_smem_bytes(limits, batch, certified::select_smem_bytes(n));
  const int columns_per_thread = certified::select_columns_per_thread(batch, n, limits.sms);
  dispatch_split_bound<certified::kMaxSplits>(
      split_bound_for(select.splits, certified::kMaxSplits), [&](auto split_bound) {
    constexpr int kSplitBound = decltype(split_bound)::value;
    STD_CUDA_CHECK(cudaLaunchKernelEx(
        &select_config,
        columns_per_thread == 1 ? certified::select_candidates_kernel<kSplitBound, 1>
                                : certified::select_candidates_kernel<kSplitBound, 4>,
        select));
  });
  cudaLaunchAttribute rescore_attribute{};
  const cudaLaunchConfig_t config =
      dependent_launch_config(batch, certified::kThreads, stream, rescore_attribute,
                              limits.dependent_launch);
  STD_CUDA_CHECK(cudaLaunchKernelEx(&config, certified::rescore_kernel, rescore,
                                    outputs.out, outputs.argmax, outputs.preactivation));
}

}  // namespace

void configure_certified_kernels(DeviceLimits& limits) {
  if (limits.spread_smem_max == 0) return;
  certified::for_each_select_kernel(
      [&](auto kernel) { set_max_dynamic_smem(kernel, limits.spread_smem_max); });
}

// Writes the prepared weight of w's n rows (prepared_bytes(n, k_padded) bytes at `prepared`,
// 16-byte aligned).
void launch_prepare(const float* w, int64_t ldw, int64_t n, int64_t k_padded, uint8_t* prepared,
                    cudaStream_t stream) {
  if (n == 0) return;
  FPG_CHECK(n <= kMaxGridX, "fused_pool_gelu.prepare_weight: weight must have at most ",
              kMaxGridX, " rows, got ", n);
  certified::PrepareParams params{};
  params.w = w;
  params.ldw = ldw;
  params.k4 = k_padded / 4;
  params.copy_halves = prepared_copy_halves(k_padded);
  params.copy = reinterpret_cast<__half*>(prepared);
  params.trailers = reinterpret_cast<float4*>(prepared + prepared_copy_bytes(n, k_padded));
  // The weight's norms: one reduction per row (reduction_depth), whatever pass 1's splits.
  certified::norm_constants(k_padded, static_cast<double>(certified::reduction_depth(k_padded / 4)),
                 params.squares_floor, params.norm_slack);
  const dim3 grid(static_cast<unsigned>(n));
  if (params.k4 <= int64_t{certified::kThreads} * certified::kPrepareCachedPieces) {
    certified::prepare_rows_kernel<true><<<grid, certified::kThreads, 0, stream>>>(params);
  } else {
    certified::prepare_rows_kernel<false><<<grid, certified::kThreads, 0, stream>>>(params);
  }
  STD_CUDA_KERNEL_LAUNCH_CHECK();
}

// The certified forward: the weight's prepared copy (prepared_weight.h; made here unless the
// caller passes one), pass 1 (single-pass fp16 wgmma), then the selection (which takes x's norms
// from pass 1's split sums) and the rescoring, fused per row or as two kernels
// (certified_fused_rows), each a programmatic dependent of the one before. Returns the selection's
// workspace (its counts: _certified_candidate_counts).
CertifiedWorkspace certified_forward(const DeviceLimits& limits, const CertifiedPlan& plan,
                                     const GemmOperands& ops, const uint8_t* prepared,
                                     const float* bias, float scale, int64_t batch, int64_t n,
                                     int64_t k_padded, const Tensor& like,
                                     const CertifiedOutputs& outputs, cudaStream_t stream) {
  const bool fused = plan.fused_rows;
  const int64_t block_m = plan.block_m;
  const int64_t block_n = plan.block_n;
  const int64_t k_per_split = plan.k_per_split;
  const int64_t splits = plan.splits;
  FPG_CHECK(splits >= 1 && splits <= plan.max_splits, "fused_pool_gelu.forward: internal error: ",
              splits, " certified splits");
  // One allocation (each costs host time in every call), freed on return: the caching allocator
  // reuses it only after this stream's kernels. The partials (bfloat16, two to a float); x's split
  // sums of squares, of squared residuals and scale exponents (the selection makes x's norms from
  // them); the weight's prepared copy unless the caller has one (at a 16-byte offset, as TMA
  // needs); then the selection's ints, which the caller keeps.
  const int64_t copy_halves = prepared_copy_halves(k_padded);
  const int64_t sums_offset = ceil_div(splits * batch * n, int64_t{2});
  const int64_t copy_offset = ceil_div(sums_offset + 3 * splits * batch, int64_t{4}) * 4;
  const int64_t copy_floats =
      prepared == nullptr ? ceil_div(prepared_bytes(n, k_padded), int64_t{4}) : 0;
  const int64_t selection_offset = copy_offset + copy_floats;
  static_assert(sizeof(int) == sizeof(float) && 2 * sizeof(__half) == sizeof(float) &&
                    2 * sizeof(__nv_bfloat16) == sizeof(float),
                "the ints, the fp16 copy and the bfloat16 partials share the float allocation");
  Selection selection;
  selection.workspace =
      aten::empty_like_device(like, {selection_offset + Selection::ints(batch)}, kFloat);
  selection.offset = selection_offset;
  selection.batch = batch;
  float* const workspace = selection.workspace.mutable_data_ptr<float>();
  __nv_bfloat16* const partial = reinterpret_cast<__nv_bfloat16*>(workspace);
  const certified::Bound bound = certified::certified_bound(k_padded, splits, k_per_split);
  if (prepared == nullptr) {
    uint8_t* const copy = reinterpret_cast<uint8_t*>(workspace + copy_offset);
    launch_prepare(ops.w, ops.ldw, n, k_padded, copy, stream);
    prepared = copy;
  }
  // Row n's trailer: 4 floats at trailers + 4 n.
  const float* const trailers =
      reinterpret_cast<const float*>(prepared + prepared_copy_bytes(n, k_padded));

  fg::GemmParams gemm = gemm_params(ops, nullptr, batch, n, k_padded, k_per_split, 0, batch);
  gemm.rounded_partial = partial;
  gemm.w_inverse_scale = trailers + kPreparedInverseScale;
  gemm.w_inverse_scale_stride = 4;
  gemm.x_sumsq = workspace + sums_offset;
  gemm.x_residual_sumsq = gemm.x_sumsq + splits * batch;
  gemm.x_scale_exponent = reinterpret_cast<int*>(gemm.x_residual_sumsq + splits * batch);
  gemm.zeroed_counters = selection.rescore_ends();
  // The copy's whole rows: its last block of 64 holds columns below k_padded at positions above
  // it (prepared_copy_group), and zeros for the rest; x's map zero-fills past k_padded.
  const fg::TmaMaps maps{tensor_map(ops.x, ops.ldx, batch, k_padded, static_cast<int>(block_m)),
                         tensor_map(reinterpret_cast<const __half*>(prepared), copy_halves, n,
                                    copy_halves, static_cast<int>(block_n))};
  launch_certified_pass1(block_m, block_n, splits, limits.dependent_launch, stream, gemm, maps);

  certified::SelectParams select{};
  select.partial = partial;
  select.split_stride = static_cast<int>(batch * n);
  select.splits = static_cast<int>(splits);
  select.x_sumsq = gemm.x_sumsq;
  select.x_residual_sumsq = gemm.x_residual_sumsq;
  select.x_scale_exponent = gemm.x_scale_exponent;
  static_assert(kPreparedResidualNorm == kPreparedNorm + 1, "a Norms pair");
  select.w_norms = reinterpret_cast<const certified::Norms*>(trailers + kPreparedNorm);
  select.w_norms_stride = 2;  // in Norms: one trailer
  select.bias = bias;
  select.scale = scale;
  select.batch = batch;
  select.n = n;
  select.bound = bound;
  select.count = selection.count();
  select.candidates = selection.candidates();
  select.rescore_rows = selection.rescore_rows();
  select.rescore_counts = selection.rescore_counts();
  select.rescore_ends = selection.rescore_ends();
  launch_selection_and_rescoring(ops, bias, scale, batch, n, k_padded, selection, outputs, fused,
                                 select, limits, stream);
  return {selection.workspace, selection.offset};
}

}  // namespace cuda
}  // namespace fused_pool_gelu
