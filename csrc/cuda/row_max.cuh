// The row-max pieces shared by the forward's epilogues (epilogue.cu's argmax_epilogue_kernel and
// the certified path's kernels, certified.cu): torch.max's ordering of (value, index)
// candidates, a warp's arg-max and the split-K partial sums of one output.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fused_pool_gelu {
namespace cuda {

// Does candidate a beat candidate b under torch.max's rule? NaN beats every number; between two
// NaNs, or two equal numbers, the smaller index wins.
__device__ __forceinline__ bool beats(float va, int64_t ia, float vb, int64_t ib) {
  const bool a_nan = isnan(va);
  const bool b_nan = isnan(vb);
  if (a_nan || b_nan) return a_nan && (!b_nan || ia < ib);
  return va > vb || (va == vb && ia < ib);
}

struct Candidate {
  float value;
  int64_t index;  // n; the sentinel N (loses to every real column) when empty
  float z;

  __device__ __forceinline__ void take_if_better(const Candidate& o) {
    if (beats(o.value, o.index, value, index)) *this = o;
  }
  __device__ __forceinline__ Candidate shfl_xor(int mask) const {
    return Candidate{__shfl_xor_sync(0xffffffffu, value, mask),
                     static_cast<int64_t>(__shfl_xor_sync(
                         0xffffffffu, static_cast<long long>(index), mask)),
                     __shfl_xor_sync(0xffffffffu, z, mask)};
  }
};

// Butterfly max over the warp: `beats` is a strict total order on distinct indices, so every
// lane ends with the same winner.
__device__ __forceinline__ Candidate warp_argmax(Candidate c) {
#pragma unroll
  for (int mask = 16; mask >= 1; mask /= 2) c.take_if_better(c.shfl_xor(mask));
  return c;
}

// Split partials loaded before they are added (in split order), per thread: memory-level
// parallelism against registers. The epilogue (epilogue.cu) loads this many at a time only past its
// split bound of 64; up to that, and in the certified path's kernels, every split's load is issued
// at once (sum_few_splits; the certified selection's load_split_partials).
constexpr int kSplitBatch = 8;

// z = partial[0][col] + partial[1][col] + ... (split order), loads issued kBatch at a time.
template <int kBatch>
__device__ __forceinline__ float sum_splits(const float* p, int64_t stride, int splits) {
  if (splits == 0) return 0.f;
  float z = __ldg(p);
  int s = 1;
  for (; s + kBatch <= splits; s += kBatch) {
    float v[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) v[i] = __ldg(p + (s + i) * stride);
#pragma unroll
    for (int i = 0; i < kBatch; ++i) z += v[i];
  }
  for (; s < splits; ++s) z += __ldg(p + s * stride);
  return z;
}

// The same sum for 1 <= splits <= kMaxSplits: every load issued at once (one round trip to L2 where
// sum_splits makes a chain of them past its batches), in 32-bit offsets (the caller keeps
// kMaxSplits x stride below 2^31). Loads past the last split read that split again instead of
// being predicated off: their offsets then depend on the arguments alone, so a caller's loop over
// columns computes them once rather than per load (an L1 hit is cheaper than the address math).
template <int kMaxSplits>
__device__ __forceinline__ float sum_few_splits(const float* p, int stride, int splits) {
  float v[kMaxSplits];
#pragma unroll
  for (int i = 0; i < kMaxSplits; ++i) v[i] = __ldg(p + min(i, splits - 1) * stride);
  float z = v[0];
#pragma unroll
  for (int i = 1; i < kMaxSplits; ++i) {
    if (i < splits) z += v[i];
  }
  return z;
}

}  // namespace cuda
}  // namespace fused_pool_gelu
