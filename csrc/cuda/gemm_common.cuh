// Device helpers of the split-K GEMM kernels (gemv.cu, gemm_sm80.cu, gemm_sm90a.cu): PTX
// wrappers, the 3xTF32 operand split, and the stores of split partial sums. Every kernel writes
// partial[s, b, n] = the sum over split s's K range of x[b, k] * weight[n, k] into an fp32
// workspace [splits, B, N] that the epilogue reduces in split order, so results are bitwise
// reproducible run to run.
//
// Operand contract (the host code in forward.cu guarantees it, copying when needed): float32,
// row-major rows with unit column stride, K a multiple of 4 (zero padded), row strides a
// multiple of 4 floats and 16-byte aligned base pointers, so every 4-float chunk of a row is one
// aligned 16-byte load.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/forward_launch.h"
#include "cuda/tile_sizes.h"

namespace fused_pool_gelu {
namespace cuda {
namespace forward_gemm {

// ------------------------------------------------------------------------------------------------
// Small PTX wrappers.
// ------------------------------------------------------------------------------------------------

__device__ __forceinline__ float4 load_global_f4(const float* ptr) {
  return __ldg(reinterpret_cast<const float4*>(ptr));
}

__device__ __forceinline__ uint32_t shared_address(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// 16-byte global -> shared copy that bypasses L1; src_bytes = 0 writes 16 zero bytes instead
// (nothing is read, but src must still be a valid address).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most `kPending` committed groups of this thread are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Four 8x8 matrices of 16-bit elements = four 8-row x 4-float tiles: thread t receives float
// (row t / 4, column t % 4) of matrix j in r[j]; threads 8j .. 8j+7 give the row addresses of
// matrix j. This is exactly the TF32 m16n8k8 A / B fragment layout (gemm_sm80.cu's top).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address)
               : "memory");
}

// d += a * b on a 16x8x8 tile: A row-major 16x8, B column-major 8x8 (= weight rows), fp32
// accumulation.
__device__ __forceinline__ void mma_tf32_16x8x8(float (&d)[4], const uint32_t (&a)[4],
                                                const uint32_t (&b)[2]) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Special registers read with volatile asm, so that the compiler re-reads them instead of keeping
// an earlier copy live through a long loop (used after the SIMT K loop, where sm_80 ptxas would
// otherwise spill a few index registers around the loop).
__device__ __forceinline__ int fresh_thread_x() {
  int v;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(v));
  return v;
}
__device__ __forceinline__ dim3 fresh_block_idx() {
  unsigned x, y, z;
  asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(x));
  asm volatile("mov.u32 %0, %%ctaid.y;\n" : "=r"(y));
  asm volatile("mov.u32 %0, %%ctaid.z;\n" : "=r"(z));
  return dim3(x, y, z);
}

// TF32 keeps the sign, the 8 exponent bits and the top 10 mantissa bits of a float32.
constexpr uint32_t kTf32Mask = 0xffffe000u;

// 3xTF32 operand split: v = big + small + (a remainder below 2^-20 |v|). big is v truncated to
// TF32; small = v - big is exact in fp32 and is truncated to TF32 too. Both halves are exact TF32
// values, so the product does not depend on whether the tensor core truncates or rounds its
// inputs. An infinite v gives big = inf and small = inf - inf = NaN, so products with a +-inf
// input are NaN where an fp32 GEMM gives +-inf or NaN: the same pre-activations are non-finite
// either way (a +-inf in x[b] makes all of row b non-finite in fp32 too, a +-inf in weight[n] all
// of column n), and the epilogue maps every non-finite pre-activation to NaN.
__device__ __forceinline__ void split_tf32(uint32_t v, uint32_t& big, uint32_t& small) {
  big = v & kTf32Mask;
  small = __float_as_uint(__uint_as_float(v) - __uint_as_float(big)) & kTf32Mask;
}

// acc += a b in 3xTF32 over a kM x kN grid of m16n8k8 tiles (fragment m with fragment n): the
// small terms first (as CUTLASS's OpMultiplyAddFastF32), the big x big product last.
template <int kM, int kN>
__device__ __forceinline__ void mma_3xtf32_grid(float (&acc)[kM][kN][4],
                                                const uint32_t (&a_big)[kM][4],
                                                const uint32_t (&a_small)[kM][4],
                                                const uint32_t (&b_big)[kN][2],
                                                const uint32_t (&b_small)[kN][2]) {
  auto grid = [&acc](const uint32_t (&a)[kM][4], const uint32_t (&b)[kN][2]) {
#pragma unroll
    for (int m = 0; m < kM; ++m) {
#pragma unroll
      for (int n = 0; n < kN; ++n) mma_tf32_16x8x8(acc[m][n], a[m], b[n]);
    }
  };
  grid(a_small, b_big);
  grid(a_big, b_small);
  grid(a_big, b_big);
}

// The second level of the tensor-core kernels' two-level accumulation: total += acc (fp32 adds,
// round to nearest), then acc = 0 for the next K tile's mma chain (tensor cores truncate as they
// accumulate; see tf32x3_splitk_kernel).
template <int kM, int kN>
__device__ __forceinline__ void flush_into_total(float (&total)[kM][kN][4],
                                                 float (&acc)[kM][kN][4]) {
#pragma unroll
  for (int m = 0; m < kM; ++m) {
#pragma unroll
    for (int n = 0; n < kN; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        total[m][n][e] += acc[m][n][e];
        acc[m][n][e] = 0.f;
      }
    }
  }
}

// Split `split`'s partial sums of batch rows b0 .. b0 + kBatchRows - 1 and weight rows n0 .. n0 +
// kRows - 1 (clipped to the launch's rows and N), each the sum in warp order of kWarps warps'
// values staged in shared memory as sums[(warp * kBatchRows + b) * kLd + row]; kThreads threads
// from `tid` on.
template <int kWarps, int kBatchRows, int kRows, int kLd, int kThreads>
__device__ __forceinline__ void store_warp_sums(const GemmParams& p, const float* sums, int tid,
                                                int64_t split, int64_t b0, int64_t n0) {
  for (int o = tid; o < kBatchRows * kRows; o += kThreads) {
    const int bb = o / kRows;
    const int row = o % kRows;
    float sum = sums[bb * kLd + row];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) sum += sums[(w * kBatchRows + bb) * kLd + row];
    const int64_t b = b0 + bb;
    const int64_t n = n0 + row;
    if (b < p.rows && n < p.n) p.partial[split * p.split_stride + b * p.n + n] = sum;
  }
}

// Columns col and col + 1 of `out_row` (a row of split partial sums), the pair an m16n8
// accumulator fragment holds at (g, 2t) or (g + 8, 2t), clipped to N: one float2 store where N is
// even (even_n: then col, always even, and col < N imply col + 1 < N).
__device__ __forceinline__ void store_partial_pair(float* out_row, int64_t col, int64_t n,
                                                   bool even_n, float v0, float v1) {
  if (even_n) {
    if (col < n) *reinterpret_cast<float2*>(out_row + col) = make_float2(v0, v1);
  } else {
    if (col < n) out_row[col] = v0;
    if (col + 1 < n) out_row[col + 1] = v1;
  }
}

}  // namespace forward_gemm
}  // namespace cuda
}  // namespace fused_pool_gelu
