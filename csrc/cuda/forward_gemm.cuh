// The split-K GEMM kernels of the forward: partial[s, b, n] = sum over the k of split s of
// x[b, k] * weight[n, k], written to an fp32 workspace [splits, B, N] that the epilogue kernel
// (forward.cu) reduces in split order, so results are bitwise reproducible run to run.
//
//   simt_splitk_kernel     small batch (a GEMV): exact fp32 FMA, the weight streamed once with
//                          16-byte loads, the x rows' K chunk staged in shared memory.
//   rowwise_gemv_kernel    B <= 4 with enough weight rows to fill the GPU: whole rows per CTA, no
//                          split-K (one "split"), exact fp32 FMA.
//   tf32x3_gemv_splitk_kernel  17-32 rows: the 3xTF32 products of the kernel below on a 32-row
//                          batch tile, the weight streamed once as by the GEMVs.
//   tf32x3_splitk_kernel   larger batch: tensor cores (mma.sync m16n8k8 TF32, sm_80 and later)
//                          with float32-class accuracy from the 3xTF32 split of every operand.
//
// Operand contract (the host code in forward.cu guarantees it, copying when needed): float32,
// row-major rows with unit column stride, K a multiple of 4 (zero padded), row strides a
// multiple of 4 floats and 16-byte aligned base pointers, so every 4-float chunk of a row is one
// aligned 16-byte load.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common.cuh"

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
// matrix j. This is exactly the TF32 m16n8k8 A / B fragment layout (see the kernel below).
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

// What every split-K GEMM kernel of the forward gets (one launch covers `rows` rows of x).
struct GemmParams {
  const float* x;         // [rows, k], row stride ldx
  int64_t ldx;
  const float* w;         // [n, k], row stride ldw
  int64_t ldw;
  float* partial;         // partial[s * split_stride + row * n + col]
  // certified_pass1_kernel's partials instead, in bfloat16 (same layout; partial is null there)
  __nv_bfloat16* rounded_partial;
  int64_t split_stride;
  int64_t rows;           // rows of x in this launch
  int64_t n;
  int64_t k;              // padded K (multiple of 4; the GEMV also needs < 2^31 - 2 kSimtChunkK)
  int64_t k_per_split;    // a multiple of the kernel's planning granularity (its K step)
  // certified_pass1_kernel only (the others leave them null): the power of two that undoes the
  // scaling of each weight row's fp16 copy, w_inverse_scale[n * w_inverse_scale_stride] (the
  // prepared weight's trailers, prepared_weight.h); per x row and split (x_sumsq[row * splits + s],
  // this launch's rows) the exponent of the row's scale in that split and the sums of squares of
  // its scaled values and of their fp16 residuals, for the error bound of the selection
  // (forward_certified.cuh).
  const float* w_inverse_scale;
  int64_t w_inverse_scale_stride;
  float* x_sumsq;
  float* x_residual_sumsq;
  int* x_scale_exponent;
  // certified_pass1_kernel: two ints it sets to 0 (the selection's rescore_ends; pass 1 runs before
  // the selection in every call, so no memset of its own is needed).
  int* zeroed_counters;
};

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

// ------------------------------------------------------------------------------------------------
// Small batch: SIMT split-K GEMV.
//
// A CTA owns kSimtRowsPerCta weight rows and one K range (its split). Inside a warp, a quad of 4
// lanes shares a row and reads 4 x 16 B = 64 contiguous bytes per load instruction (8 rows per
// instruction, every 32-byte sector fully used); each lane works on kSimtRowsPerLane rows so each
// float4 of x read from shared memory feeds 8 FMAs. The 8 warps split the K range: warp w takes
// step w of every staged chunk of x, then the warps' sums are added in warp order through shared
// memory.
// Weights: the next chunk's loads are issued before the current chunk is computed (register double
// buffering). x: chunks are staged with cp.async into two shared buffers, the next chunk landing
// while the current one is computed.
// ------------------------------------------------------------------------------------------------

constexpr int kSimtThreads = 256;
constexpr int kSimtWarps = kSimtThreads / 32;
// 4 lanes x 16 B = 64 B of a row per load instruction: two full 32-byte sectors.
constexpr int kSimtLanesPerRow = 4;
constexpr int kSimtQuadsPerWarp = 32 / kSimtLanesPerRow;  // 8 rows per load instruction
// Rows per lane: each x value loaded from shared memory is used for this many rows (2 keeps the
// shared-memory traffic at 1 LDS.128 per 8 FMAs).
constexpr int kSimtRowsPerLane = 2;
constexpr int kSimtRowsPerCta = kSimtQuadsPerWarp * kSimtRowsPerLane;  // 16
// 16-byte loads per row and lane per step: a step covers 2 x 64 B = one 128-byte line per row.
constexpr int kSimtLoadsPerRow = 2;
constexpr int kSimtSegmentK = kSimtLanesPerRow * 4;              // 16 floats per instruction
constexpr int kSimtStepK = kSimtSegmentK * kSimtLoadsPerRow;     // 32 floats per warp step
constexpr int kSimtChunkK = kSimtStepK * kSimtWarps;             // 256 floats of x staged at once
constexpr int kSimtXBuffers = 2;                                 // x chunk double buffer
// Batch rows per CTA (register arrays): the host picks the smallest power of two >= B, up to this;
// more rows run as several batch tiles (grid z). Registers (ptxas, sm_90a, CUDA 13.0): 126 at 16,
// 2 CTAs per SM. A 32-row tile took 246 (one CTA of 8 warps per SM) and ran B = 17-32 slower than
// two 16-row tiles, though those read the weight twice (the second time mostly from L2). H200 own
// times, GEMV + epilogue, B = 24 / 32 (profile_forward.py, 2026-11-30 14:33-14:41 UTC), one 32-row
// tile against two 16-row tiles: N x K = 128 x 2048 6.4 / 6.5 against 5.6 / 5.5 us, 256 x 4096
// 10.0 / 10.1 against 9.4 / 9.5, 128 x 16384 13.0 / 13.1 against 12.3 / 12.2, 256 x 8192 13.7 /
// 13.8 against 12.7 / 12.9, 512 x 4096 15.4 / 15.5 against 13.2 / 14.3-14.6, 1024 x 2048 16.0 /
// 17.5 against 13.8 / 14.0-14.3. With __launch_bounds__(256, 2) the 32-row tile spilled and lost
// to both (256 x 4096: 11.6 / 11.7).
constexpr int kSimtMaxBatchTile = 16;


template <int kBatchTile>
constexpr int simt_smem_bytes() {
  return kSimtXBuffers * kBatchTile * kSimtChunkK * static_cast<int>(sizeof(float));
}

// End of simt_splitk_kernel: sums the lanes of a quad, then the warps in warp order through
// shared memory (the x buffers, free by now), and stores partial[split][b][n]. Thread and block
// indices are re-read here rather than kept live through the K loop.
template <int kBatchTile>
__device__ __forceinline__ void write_simt_partials(
    const GemmParams& p, float (&acc)[kSimtRowsPerLane][kBatchTile], float4* smem_f4) {
  const int tid = fresh_thread_x();
  const dim3 block = fresh_block_idx();
  const int warp = tid / 32;
  const int quad_lane = (tid % 32) % kSimtLanesPerRow;
  const int quad = (tid % 32) / kSimtLanesPerRow;
  const int64_t n0 = static_cast<int64_t>(block.x) * kSimtRowsPerCta;
  const int64_t split = block.y;
  const int64_t b0 = static_cast<int64_t>(block.z) * kBatchTile;

  // Sum the 4 lanes of a quad (a fixed butterfly: every lane ends with the same bits).
#pragma unroll
  for (int i = 0; i < kSimtRowsPerLane; ++i) {
#pragma unroll
    for (int b = 0; b < kBatchTile; ++b) {
      float v = acc[i][b];
      v += __shfl_xor_sync(0xffffffffu, v, 1);
      v += __shfl_xor_sync(0xffffffffu, v, 2);
      acc[i][b] = v;
    }
  }

  // Cross-warp sum in warp order, through the (now free) x buffers: red[warp][b][row].
  float* red = reinterpret_cast<float*>(smem_f4);
  __syncthreads();  // every warp is done reading x
#pragma unroll
  for (int i = 0; i < kSimtRowsPerLane; ++i) {
#pragma unroll
    for (int b = 0; b < kBatchTile; ++b) {
      // Spread the stores over the quad's lanes (they all hold the same value).
      if (b % kSimtLanesPerRow == quad_lane) {
        red[(warp * kBatchTile + b) * kSimtRowsPerCta + quad + i * kSimtQuadsPerWarp] = acc[i][b];
      }
    }
  }
  __syncthreads();
  store_warp_sums<kSimtWarps, kBatchTile, kSimtRowsPerCta, kSimtRowsPerCta, kSimtThreads>(
      p, red, tid, split, b0, n0);
}

template <int kBatchTile>
__global__ void __launch_bounds__(kSimtThreads) simt_splitk_kernel(const GemmParams p) {
  static_assert(kBatchTile >= 1 && kBatchTile <= kSimtMaxBatchTile, "batch tile");
  static_assert(kSimtWarps * kBatchTile * kSimtRowsPerCta <= kBatchTile * kSimtChunkK,
                "the cross-warp sums must fit in the x buffer they reuse");
  allow_dependent_launch();
  constexpr int kChunkF4 = kSimtChunkK / 4;          // float4 per staged x row
  constexpr int kBufferF4 = kBatchTile * kChunkF4;   // float4 per x buffer
  constexpr int kStageIters = ceil_div(kBufferF4, kSimtThreads);

  // kSimtXBuffers x chunks [kBatchTile][kSimtChunkK]; after the K loop: warp sums [warp][b][row].
  extern __shared__ float4 smem_f4[];

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int quad_lane = lane % kSimtLanesPerRow;  // which 16 B of a 64 B segment
  const int quad = lane / kSimtLanesPerRow;       // row within a group of 8

  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kSimtRowsPerCta;
  const int64_t split = blockIdx.y;
  const int64_t b0 = static_cast<int64_t>(blockIdx.z) * kBatchTile;
  const int64_t k_begin = split * p.k_per_split;
  // Length of this split's K range; offsets inside it are ints (see GemmParams::k).
  const int k_len = static_cast<int>(min(p.k_per_split, p.k - k_begin));
  const int num_chunks = ceil_div(k_len, kSimtChunkK);

  // This lane's first float of a chunk: warp w owns floats [32 w, 32 w + 32) of every chunk.
  const int lane_k = warp * kSimtStepK + quad_lane * 4;
  // This lane's rows: n0 + quad + 8 i. Rows past N read nothing (zeros) and store nothing.
  const float* w_ptr[kSimtRowsPerLane];
  bool row_ok[kSimtRowsPerLane];
#pragma unroll
  for (int i = 0; i < kSimtRowsPerLane; ++i) {
    const int64_t n = n0 + quad + i * kSimtQuadsPerWarp;
    row_ok[i] = n < p.n;
    w_ptr[i] = p.w + (row_ok[i] ? n : 0) * p.ldw + k_begin + lane_k;
  }

  auto load_w = [&](int chunk, float4 (&dst)[kSimtRowsPerLane][kSimtLoadsPerRow]) {
#pragma unroll
    for (int j = 0; j < kSimtLoadsPerRow; ++j) {
      const int k = chunk * kSimtChunkK + j * kSimtSegmentK;  // from this lane's start
      const bool k_ok = k + lane_k < k_len;  // multiples of 4 on both sides: a float4 is in or out
#pragma unroll
      for (int i = 0; i < kSimtRowsPerLane; ++i) {
        dst[i][j] = (row_ok[i] && k_ok) ? load_global_f4(w_ptr[i] + k)
                                        : make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
  };

  // x[b0 .. b0 + kBatchTile)[chunk] -> buffer chunk % 2, zeros past the batch or the split.
  const float* x_base = p.x + b0 * p.ldx + k_begin;
  const uint32_t smem_base = shared_address(smem_f4);
  auto stage_x = [&](int chunk) {
    const uint32_t buffer = smem_base + (chunk % kSimtXBuffers) * kBufferF4 * 16;
#pragma unroll
    for (int it = 0; it < kStageIters; ++it) {
      const int e = tid + it * kSimtThreads;
      if (kBufferF4 % kSimtThreads == 0 || e < kBufferF4) {
        const int bb = e / kChunkF4;
        const int k = chunk * kSimtChunkK + 4 * (e % kChunkF4);
        const bool ok = b0 + bb < p.rows && k < k_len;
        cp_async_16(buffer + e * 16, ok ? x_base + bb * p.ldx + k : p.x, ok ? 16 : 0);
      }
    }
  };

  float acc[kSimtRowsPerLane][kBatchTile];
#pragma unroll
  for (int i = 0; i < kSimtRowsPerLane; ++i) {
#pragma unroll
    for (int b = 0; b < kBatchTile; ++b) acc[i][b] = 0.f;
  }

  float4 w_cur[kSimtRowsPerLane][kSimtLoadsPerRow];
  load_w(0, w_cur);
  stage_x(0);
  cp_async_commit();

  for (int chunk = 0; chunk < num_chunks; ++chunk) {
    // Prefetch the next chunk's weights (zeros past the split) before waiting on anything.
    float4 w_next[kSimtRowsPerLane][kSimtLoadsPerRow];
    load_w(chunk + 1, w_next);

    // Every warp is done with chunk - 1, whose buffer receives chunk + 1. One commit per
    // iteration (even empty) keeps "groups committed = chunk + 2", so waiting until at most one is
    // pending means chunk's group has landed.
    __syncthreads();
    if (chunk + 1 < num_chunks) stage_x(chunk + 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();  // chunk's x, copied by all threads, is visible to all

    // This lane's float4 of x row b, load j: floats lane_k + 16 j of the chunk.
    const float4* xs = smem_f4 + (chunk % kSimtXBuffers) * kBufferF4 + lane_k / 4;
#pragma unroll
    for (int j = 0; j < kSimtLoadsPerRow; ++j) {
#pragma unroll
      for (int b = 0; b < kBatchTile; ++b) {
        const float4 xv = xs[b * kChunkF4 + j * (kSimtSegmentK / 4)];
#pragma unroll
        for (int i = 0; i < kSimtRowsPerLane; ++i) {
          acc[i][b] = fmaf(w_cur[i][j].x, xv.x, acc[i][b]);
          acc[i][b] = fmaf(w_cur[i][j].y, xv.y, acc[i][b]);
          acc[i][b] = fmaf(w_cur[i][j].z, xv.z, acc[i][b]);
          acc[i][b] = fmaf(w_cur[i][j].w, xv.w, acc[i][b]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kSimtRowsPerLane; ++i) {
#pragma unroll
      for (int j = 0; j < kSimtLoadsPerRow; ++j) w_cur[i][j] = w_next[i][j];
    }
  }
  cp_async_wait<0>();  // only an empty group can remain
  write_simt_partials<kBatchTile>(p, acc, smem_f4);
}

// ------------------------------------------------------------------------------------------------
// Tiny batch (B <= kRowwiseMaxBatch) with enough weight rows to fill the GPU: a row-parallel GEMV.
//
// A CTA owns kRowwiseRows whole weight rows (all of K): no split-K, so the kernel writes the final
// dot products as one "split" (partial[0, b, n]) and the epilogue reads B x N floats instead of
// S x B x N. At the default shape that is 128 CTAs of 4 rows (32 KB each) on 132 SMs, one wave.
// Thread t takes float4 number t, t + 512, ... of each weight row and each x row, kRowwiseUnroll
// of them per row per step (K = 8192: two steps). A step's pieces go to shared memory by cp.async,
// all issued before the first is waited on, and each thread reads back only its own. Loaded into
// registers instead, ptxas spread them over rounds of five loads, each waited on before the next
// (SASS: four rounds per step at B = 1), and x's loads after the weight's. H200 own times
// (profile_forward.py, 2026-11-30 16:05-16:06 UTC, two rounds), register loads -> staged, K x N =
// 8192 x 512 at B = 1 / 2 / 3 / 4: 7.9 / 8.2 / 10.4 / 11.2 -> 7.5 / 7.7 / 8.5 / 8.5 us; 2048 x
// 1024: 5.7 / 7.0 / 11.3 / 11.5 -> 5.1 / 5.3 / 8.4 / 8.4; 16384 x 1024: 23.8 / 24.2 / 35.0 / 38.7
// -> 23.1 / 23.9 / 25.5 / 25.6; 1024 x 4096: 11.5 / 13.7 / 26.5 / 26.7 -> 9.5 / 10.5 / 18.0 /
// 18.1. The default shape at B = 1 barely moves: 16 MB read while the L2 writes back the benchmark
// timer's dirty lines, at the DRAM's rate either way (NOTES). Four pieces per step (160 KB of
// shared memory at B = 1, one CTA per SM) made 2048 x 1024 slower at B = 1 (5.8 -> 6.8: 256 CTAs
// in two waves); two keep two CTAs per SM at B <= 2. x (B x K, at most 128 KB) is read by every
// CTA, mostly from L2. The sums are reduced over the warp with a fixed butterfly, then over the
// warps in warp order through shared memory: bitwise reproducible, and the same bits as the
// register-loading version (each thread's FMAs in the same order).
// ------------------------------------------------------------------------------------------------

constexpr int kRowwiseThreads = 512;
constexpr int kRowwiseWarps = kRowwiseThreads / 32;
constexpr int kRowwiseRows = 4;
constexpr int kRowwiseMaxBatch = 4;
constexpr int kRowwiseUnroll = 2;
// The staged pieces of a step, [kRowwiseUnroll][kRowwiseRows + batch][kRowwiseThreads] float4.
constexpr int rowwise_smem_bytes(int batch) {
  return kRowwiseUnroll * (kRowwiseRows + batch) * kRowwiseThreads * 16;
}

template <int kBatch>
__global__ void __launch_bounds__(kRowwiseThreads) rowwise_gemv_kernel(const GemmParams p) {
  static_assert(kBatch >= 1 && kBatch <= kRowwiseMaxBatch, "batch");
  allow_dependent_launch();
  __shared__ float warp_sums[kRowwiseWarps][kBatch][kRowwiseRows];

  const int tid = threadIdx.x;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kRowwiseRows;
  const int64_t k4 = p.k / 4;  // float4 per row (K is padded to a multiple of 4)

  const float* w_row[kRowwiseRows];
  bool row_ok[kRowwiseRows];
#pragma unroll
  for (int r = 0; r < kRowwiseRows; ++r) {
    row_ok[r] = n0 + r < p.n;
    w_row[r] = p.w + (row_ok[r] ? n0 + r : 0) * p.ldw;
  }

  float acc[kBatch][kRowwiseRows];
#pragma unroll
  for (int b = 0; b < kBatch; ++b) {
#pragma unroll
    for (int r = 0; r < kRowwiseRows; ++r) acc[b][r] = 0.f;
  }

  // Every piece of a step (weight and x) goes to shared memory by cp.async, all issued before any
  // is waited on: stage[u][j][tid], j < kRowwiseRows the weight rows, then the x rows.
  constexpr int kPieces = kRowwiseRows + kBatch;
  extern __shared__ float4 stage[];
  const uint32_t stage_base = shared_address(stage);
  for (int64_t base = tid; base < k4; base += int64_t{kRowwiseThreads} * kRowwiseUnroll) {
#pragma unroll
    for (int u = 0; u < kRowwiseUnroll; ++u) {
      const int64_t i = base + int64_t{u} * kRowwiseThreads;
      const bool k_ok = i < k4;
#pragma unroll
      for (int j = 0; j < kPieces; ++j) {
        const bool ok = k_ok && (j < kRowwiseRows ? row_ok[j] : j - kRowwiseRows < p.rows);
        const float* src = j < kRowwiseRows ? w_row[j] + 4 * i
                                            : p.x + (j - kRowwiseRows) * p.ldx + 4 * i;
        cp_async_16(stage_base + ((u * kPieces + j) * kRowwiseThreads + tid) * 16,
                    ok ? src : p.w, ok ? 16 : 0);
      }
    }
    cp_async_commit();
    // Each thread reads only its own slots, so neither this wait nor the next step's copies into
    // the same slots (after these reads in program order) need a barrier. Not unrolled: ptxas
    // hoisted every piece's shared load ahead of the FMAs, 8 bytes of spills at B = 2.
    cp_async_wait<0>();
#pragma unroll 1
    for (int u = 0; u < kRowwiseUnroll; ++u) {
      float4 xv[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        xv[b] = stage[(u * kPieces + kRowwiseRows + b) * kRowwiseThreads + tid];
      }
#pragma unroll
      for (int r = 0; r < kRowwiseRows; ++r) {
        const float4 w = stage[(u * kPieces + r) * kRowwiseThreads + tid];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          acc[b][r] = fmaf(w.x, xv[b].x, acc[b][r]);
          acc[b][r] = fmaf(w.y, xv[b].y, acc[b][r]);
          acc[b][r] = fmaf(w.z, xv[b].z, acc[b][r]);
          acc[b][r] = fmaf(w.w, xv[b].w, acc[b][r]);
        }
      }
    }
  }

  const int warp = tid / 32;
  const int lane = tid % 32;
#pragma unroll
  for (int b = 0; b < kBatch; ++b) {
#pragma unroll
    for (int r = 0; r < kRowwiseRows; ++r) {
      float v = acc[b][r];
#pragma unroll
      for (int mask = 16; mask >= 1; mask /= 2) v += __shfl_xor_sync(0xffffffffu, v, mask);
      if (lane == 0) warp_sums[warp][b][r] = v;
    }
  }
  __syncthreads();
  store_warp_sums<kRowwiseWarps, kBatch, kRowwiseRows, kRowwiseRows, kRowwiseThreads>(
      p, &warp_sums[0][0][0], tid, /*split=*/0, /*b0=*/0, n0);
}

// ------------------------------------------------------------------------------------------------
// Larger batch: 3xTF32 tensor-core split-K GEMM.
//
// CTA tile kTcBlockM (batch rows) x kTcBlockN (weight rows) x kTcBlockK, 8 warps as 2 (M) x 4 (N),
// warp tile 64 x 32 = 4 x 4 mma tiles of 16 x 8. Global -> shared with cp.async in a kTcStages
// ring (zero fill past M, N and the split's K range). Shared rows are padded to 36 floats: eight
// consecutive rows then start 16 bytes apart modulo 128, so ldmatrix phases (8 rows x 16 B) and
// the cp.async writes are free of bank conflicts.
//
// m16n8k8 TF32 fragments (g = lane / 4, t = lane % 4), PTX ISA "mma.m16n8k8" (.tf32):
//   A (16 x 8, row): a0 (g, t)  a1 (g + 8, t)  a2 (g, t + 4)  a3 (g + 8, t + 4)
//   B (8 x 8, col):  b0 (k = t, n = g)  b1 (k = t + 4, n = g)
//   C (16 x 8):      c0 (g, 2t)  c1 (g, 2t + 1)  c2 (g + 8, 2t)  c3 (g + 8, 2t + 1)
// ldmatrix.x4 delivers float (row t/4, col t%4) of matrix j in r[j] (see ldmatrix_x4), so
//   A: matrices (rows 0-7, k 0-3), (rows 8-15, k 0-3), (rows 0-7, k 4-7), (rows 8-15, k 4-7)
//      = a0..a3: lane l points at row (l & 7) + 8 ((l >> 3) & 1), column 4 (l >> 4);
//   B: matrices (n 0-7, k 0-3), (n 0-7, k 4-7), (n 8-15, k 0-3), (n 8-15, k 4-7)
//      = b0, b1 of n tile 2p and b0, b1 of n tile 2p + 1: lane l points at weight row
//      (l & 7) + 8 (l >> 4), column 4 ((l >> 3) & 1).
// ------------------------------------------------------------------------------------------------

constexpr int kTcBlockM = 128;
constexpr int kTcBlockN = 128;
// 32 floats = 128 B of a row per stage: one full line per row and cp.async chunk group.
constexpr int kTcBlockK = 32;
// 4 stages (3 tiles in flight while one is computed) to cover DRAM/L2 latency with 1 CTA per SM;
// 4 x 36 KB = 144 KB of shared memory (sm_80: 163 KB, sm_90: 227 KB opt-in).
constexpr int kTcStages = 4;
constexpr int kTcWarpsM = 2;
constexpr int kTcWarpsN = 4;
constexpr int kTcThreads = 32 * kTcWarpsM * kTcWarpsN;
constexpr int kTcMmaM = 16;
constexpr int kTcMmaN = 8;
constexpr int kTcMmaK = 8;
constexpr int kTcWarpTileM = kTcBlockM / kTcWarpsM;    // 64
constexpr int kTcWarpTileN = kTcBlockN / kTcWarpsN;    // 32
constexpr int kTcFragsM = kTcWarpTileM / kTcMmaM;      // 4
constexpr int kTcFragsN = kTcWarpTileN / kTcMmaN;      // 4
constexpr int kTcSmemLd = kTcBlockK + 4;               // padded shared row, in floats
constexpr int kTcTileAFloats = kTcBlockM * kTcSmemLd;
constexpr int kTcStageFloats = (kTcBlockM + kTcBlockN) * kTcSmemLd;
constexpr int kTcSmemBytes = kTcStages * kTcStageFloats * static_cast<int>(sizeof(float));
constexpr int kTcChunksPerRow = kTcBlockK / 4;                    // 16-byte chunks per tile row
constexpr int kTcLoadRowsPerPass = kTcThreads / kTcChunksPerRow;  // 32
constexpr int kTcLoadPassesA = kTcBlockM / kTcLoadRowsPerPass;    // 4
constexpr int kTcLoadPassesB = kTcBlockN / kTcLoadRowsPerPass;    // 4

static_assert(kTcFragsN % 2 == 0, "B fragments are loaded two n tiles per ldmatrix.x4");
static_assert(kTcBlockM % kTcLoadRowsPerPass == 0 && kTcBlockN % kTcLoadRowsPerPass == 0, "loader");
static_assert((kTcSmemLd * 4) % 16 == 0, "ldmatrix / cp.async rows must stay 16-byte aligned");


__global__ void __launch_bounds__(kTcThreads, 1) tf32x3_splitk_kernel(const GemmParams p) {
  extern __shared__ __align__(16) float smem[];  // kTcStages x {A [128][36], B [128][36]}
  allow_dependent_launch();

  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int warp_m = warp / kTcWarpsN;
  const int warp_n = warp % kTcWarpsN;

  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kTcBlockN;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kTcBlockM;
  const int64_t split = blockIdx.z;
  const int64_t k_begin = split * p.k_per_split;
  const int64_t k_end = min(k_begin + p.k_per_split, p.k);
  const int num_k_tiles = static_cast<int>(ceil_div(k_end - k_begin, int64_t{kTcBlockK}));

  // Loader: thread -> tile rows load_row + 32 pass, floats [load_col, load_col + 4).
  const int load_row = tid / kTcChunksPerRow;
  const int load_col = (tid % kTcChunksPerRow) * 4;
  const float* a_src[kTcLoadPassesA];
  bool a_ok[kTcLoadPassesA];
#pragma unroll
  for (int pass = 0; pass < kTcLoadPassesA; ++pass) {
    const int64_t m = m0 + load_row + pass * kTcLoadRowsPerPass;
    a_ok[pass] = m < p.rows;
    a_src[pass] = p.x + (a_ok[pass] ? m : 0) * p.ldx + k_begin + load_col;
  }
  const float* b_src[kTcLoadPassesB];
  bool b_ok[kTcLoadPassesB];
#pragma unroll
  for (int pass = 0; pass < kTcLoadPassesB; ++pass) {
    const int64_t n = n0 + load_row + pass * kTcLoadRowsPerPass;
    b_ok[pass] = n < p.n;
    b_src[pass] = p.w + (b_ok[pass] ? n : 0) * p.ldw + k_begin + load_col;
  }
  const uint32_t smem_base = shared_address(smem);
  constexpr uint32_t kStageBytes = kTcStageFloats * sizeof(float);
  constexpr uint32_t kPassBytes = kTcLoadRowsPerPass * kTcSmemLd * sizeof(float);
  const uint32_t a_dst = smem_base + (load_row * kTcSmemLd + load_col) * sizeof(float);
  const uint32_t b_dst = a_dst + kTcTileAFloats * sizeof(float);

  auto load_tile = [&](int stage, int k_tile) {
    const int64_t k_off = static_cast<int64_t>(k_tile) * kTcBlockK;
    // The chunk holds floats [k, k + 4) with k and k_end multiples of 4: all in or all out.
    const bool k_ok = k_begin + k_off + load_col < k_end;
    const uint32_t stage_off = stage * kStageBytes;
#pragma unroll
    for (int pass = 0; pass < kTcLoadPassesA; ++pass) {
      const bool ok = a_ok[pass] && k_ok;
      cp_async_16(a_dst + stage_off + pass * kPassBytes, ok ? a_src[pass] + k_off : p.x,
                  ok ? 16 : 0);
    }
#pragma unroll
    for (int pass = 0; pass < kTcLoadPassesB; ++pass) {
      const bool ok = b_ok[pass] && k_ok;
      cp_async_16(b_dst + stage_off + pass * kPassBytes, ok ? b_src[pass] + k_off : p.w,
                  ok ? 16 : 0);
    }
  };

  // ldmatrix row addresses of this lane (bytes from the stage base), see the header comment.
  const uint32_t a_frag_off =
      ((warp_m * kTcWarpTileM + (lane & 7) + 8 * ((lane >> 3) & 1)) * kTcSmemLd + 4 * (lane >> 4)) *
      sizeof(float);
  const uint32_t b_frag_off =
      (kTcTileAFloats +
       (warp_n * kTcWarpTileN + (lane & 7) + 8 * (lane >> 4)) * kTcSmemLd + 4 * ((lane >> 3) & 1)) *
      sizeof(float);
  constexpr uint32_t kFragRowsBytes = 16 * kTcSmemLd * sizeof(float);  // 16 rows down

  // Two-level accumulation: the mma chain of one K tile (12 mma per element) goes into `acc`, which
  // is then added into `total` (plain fp32 adds, round to nearest) and cleared. Tensor cores
  // accumulate with truncation (Fasi et al. 2021): one chain over K = 8192 (3072 mma) would bias
  // the sums by ~1e-4 relative in a CPU model of that, against ~6e-7 with a flush per K tile.
  float acc[kTcFragsM][kTcFragsN][4] = {};
  float total[kTcFragsM][kTcFragsN][4] = {};

  // Prologue: tiles 0 .. kTcStages - 2. One commit per tile slot, even when empty, so that the
  // group count stays "tile index + 1" and the wait below is exact.
#pragma unroll
  for (int s = 0; s < kTcStages - 1; ++s) {
    if (s < num_k_tiles) load_tile(s, s);
    cp_async_commit();
  }

  for (int kt = 0; kt < num_k_tiles; ++kt) {
    // Groups committed so far: kTcStages - 1 + kt. At most kTcStages - 2 pending => tile kt landed.
    cp_async_wait<kTcStages - 2>();
    // All threads' copies of tile kt are visible, and every warp is done with tile kt - 1, whose
    // stage ((kt - 1) % kTcStages) is refilled next.
    __syncthreads();
    {
      const int next = kt + kTcStages - 1;
      if (next < num_k_tiles) load_tile(next % kTcStages, next);
      cp_async_commit();
    }

    const uint32_t stage_base = smem_base + (kt % kTcStages) * kStageBytes;
#pragma unroll
    for (int kk = 0; kk < kTcBlockK / kTcMmaK; ++kk) {
      const uint32_t k_byte = kk * kTcMmaK * sizeof(float);
      uint32_t a_big[kTcFragsM][4], a_small[kTcFragsM][4];
      uint32_t b_big[kTcFragsN][2], b_small[kTcFragsN][2];
#pragma unroll
      for (int mt = 0; mt < kTcFragsM; ++mt) {
        uint32_t r[4];
        ldmatrix_x4(r, stage_base + a_frag_off + mt * kFragRowsBytes + k_byte);
#pragma unroll
        for (int e = 0; e < 4; ++e) split_tf32(r[e], a_big[mt][e], a_small[mt][e]);
      }
#pragma unroll
      for (int np = 0; np < kTcFragsN / 2; ++np) {
        uint32_t r[4];
        ldmatrix_x4(r, stage_base + b_frag_off + np * kFragRowsBytes + k_byte);
        split_tf32(r[0], b_big[2 * np][0], b_small[2 * np][0]);
        split_tf32(r[1], b_big[2 * np][1], b_small[2 * np][1]);
        split_tf32(r[2], b_big[2 * np + 1][0], b_small[2 * np + 1][0]);
        split_tf32(r[3], b_big[2 * np + 1][1], b_small[2 * np + 1][1]);
      }
      mma_3xtf32_grid(acc, a_big, a_small, b_big, b_small);
    }
    flush_into_total(total, acc);
  }
  cp_async_wait<0>();  // only empty groups can remain; drained for tidiness

  // Store the fp32 tile: c0, c1 at (g, 2t), (g, 2t + 1); c2, c3 eight rows down.
  const int g = lane >> 2;
  const int t = lane & 3;
  float* out = p.partial + split * p.split_stride;
  const bool even_n = (p.n % 2) == 0;
#pragma unroll
  for (int mt = 0; mt < kTcFragsM; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t m = m0 + warp_m * kTcWarpTileM + mt * kTcMmaM + g + 8 * h;
      if (m >= p.rows) continue;
      float* out_row = out + m * p.n;
#pragma unroll
      for (int nt = 0; nt < kTcFragsN; ++nt) {
        const int64_t col = n0 + warp_n * kTcWarpTileN + nt * kTcMmaN + 2 * t;
        store_partial_pair(out_row, col, p.n, even_n, total[mt][nt][2 * h],
                           total[mt][nt][2 * h + 1]);
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// 17 to 32 batch rows: 3xTF32 split-K GEMV on tensor cores (mma.sync m16n8k8).
//
// Past 16 rows the SIMT GEMV takes a second 16-row batch tile (the weight read twice) and the
// wgmma GEMM pads the batch to 128 rows. Here a CTA owns kTcGemvRowsPerCta weight rows (4 n tiles
// of 8) and one K range (its split), for the whole 32-row batch tile (two m tiles of 16; rows past
// B are zero-filled copies, which read nothing). Warp w takes the 32-float chunks w, w + 8, ... of
// the range; the warps' sums are added in warp order through shared memory at the end, as in the
// SIMT GEMV, and the epilogue adds the splits in order: bitwise reproducible.
//
// Operands go through a per-warp cp.async ring in shared memory (kTcGemvStages chunks, all but one
// in flight), no CTA barrier in the K loop. Copies take whole 128-byte lines, 8 lanes per row
// and 4 rows per instruction. With 4 lanes per row (each lane copying exactly the pieces of its
// own fragments) every instruction asked L2 for 8 half lines and the kernel read 16 MB in 10.8 us
// at B = 16 (Nsight Compute: DRAM 32% busy, SM 24%); whole lines: 9.3 (H200, 2026-11-30). Lanes
// then read their fragments from the stage after a __syncwarp.
//
// Fragments (layout in the mma section above) with K permuted inside each 16-float segment s of a
// chunk: lane (g, t) takes floats 16 s + 4 t .. + 3 of weight row g of each n tile (B operand) and
// of batch rows g and g + 8 of each m tile (A operand), one float4 each; mma step q of the segment
// uses floats 4 t + 2 q as k = t and 4 t + 2 q + 1 as k = t + 4. The same permutation on both
// operands leaves every dot product's terms unchanged.
//
// Accuracy as tf32x3_splitk_kernel: every operand split into TF32 big + small, the small terms
// first, 12 mma per 32-float chunk in `acc`, then added into `total` in fp32 (tensor cores
// truncate as they accumulate). This is the tensor-core GEMMs' accuracy class, not the SIMT
// GEMV's exact float32 FMAs (docs/input_classes.md).
// ------------------------------------------------------------------------------------------------

constexpr int kTcGemvThreads = 256;
constexpr int kTcGemvWarps = kTcGemvThreads / 32;
constexpr int kTcGemvRowFrags = 4;                                // n tiles of 8 weight rows
constexpr int kTcGemvRowsPerCta = kTcGemvRowFrags * kTcMmaN;      // 32
constexpr int kTcGemvBatchFrags = 2;                              // m tiles of 16 batch rows
constexpr int kTcGemvBatchTile = kTcGemvBatchFrags * kTcMmaM;     // 32
constexpr int kTcGemvSegmentK = 16;                               // 4 lanes x float4
constexpr int kTcGemvChunkK = 32;                                 // one 128-byte line per row
constexpr int kTcGemvSegments = kTcGemvChunkK / kTcGemvSegmentK;  // 2
constexpr int kTcGemvSplitK = kTcGemvWarps * kTcGemvChunkK;       // split granularity, 256
// A stage: the chunk of every weight row and batch row, [tile row][8 pieces of 16 bytes].
constexpr int kTcGemvTileRows = kTcGemvRowsPerCta + kTcGemvBatchTile;
constexpr int kTcGemvStageBytes = kTcGemvTileRows * kTcGemvChunkK * 4;  // 8 KB
// 3 stages x 8 warps x 8 KB = 192 KB: one CTA per SM, two stages (128 KB, half of it weight) in
// flight per SM (Hopper; devices with less shared memory per block keep the SIMT GEMV and the
// wgmma GEMM).
constexpr int kTcGemvStages = 3;
constexpr int kTcGemvSmemBytes = kTcGemvWarps * kTcGemvStages * kTcGemvStageBytes;

__global__ void __launch_bounds__(kTcGemvThreads, 1) tf32x3_gemv_splitk_kernel(const GemmParams p) {
  constexpr int kStageF4 = kTcGemvStageBytes / 16;
  // Sum rows padded by one float: a warp's store (8 batch rows g x 4 rows 2 t) spreads over banks
  // g + 2 t, at most 4 lanes to a bank, against 8 on 4 banks (2 t) unpadded.
  constexpr int kSumsLd = kTcGemvRowsPerCta + 1;
  static_assert(kTcGemvWarps * kTcGemvBatchTile * kSumsLd * 4 <= kTcGemvSmemBytes,
                "the cross-warp sums must fit in the rings they reuse");
  extern __shared__ float4 smem_f4[];  // [warp][stage][tile row][piece]; then sums [warp][b][row]
  allow_dependent_launch();

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane / 4;
  const int t = lane % 4;

  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kTcGemvRowsPerCta;
  const int64_t split = blockIdx.y;
  const int64_t b0 = static_cast<int64_t>(blockIdx.z) * kTcGemvBatchTile;
  const int64_t k_begin = split * p.k_per_split;
  // Length of this split's K range; offsets inside it are ints (see GemmParams::k).
  const int k_len = static_cast<int>(min(p.k_per_split, p.k - k_begin));
  const int num_chunks = ceil_div(k_len, kTcGemvChunkK);
  const int warp_chunks = warp < num_chunks ? ceil_div(num_chunks - warp, kTcGemvWarps) : 0;

  // Copy round u: tile row 4 u + lane / 8 (weight rows, then batch rows), piece lane % 8.
  constexpr int kCopyRounds = kTcGemvTileRows / 4;
  const int copy_piece = lane % 8;
  const float* src[kCopyRounds];
  bool src_ok[kCopyRounds];
#pragma unroll
  for (int u = 0; u < kCopyRounds; ++u) {
    const int row = 4 * u + lane / 8;
    if (row < kTcGemvRowsPerCta) {
      const int64_t n = n0 + row;
      src_ok[u] = n < p.n;
      src[u] = p.w + (src_ok[u] ? n : 0) * p.ldw + k_begin + 4 * copy_piece;
    } else {
      const int64_t b = b0 + row - kTcGemvRowsPerCta;
      src_ok[u] = b < p.rows;
      src[u] = p.x + (src_ok[u] ? b : 0) * p.ldx + k_begin + 4 * copy_piece;
    }
  }

  // Piece c of tile row r sits at c ^ 4 (r % 2): a quarter warp (8 lanes) reads rows 2 i and
  // 2 i + 1 at pieces 4 s + t, t = 0 .. 3, which then fall in 8 distinct 16-byte bank groups; the
  // 8 lanes copying one row write its 8 pieces, a permutation.
  auto slot = [](int row, int piece) { return row * 8 + (piece ^ (4 * (row % 2))); };
  float4* const ring = smem_f4 + warp * kTcGemvStages * kStageF4;
  const uint32_t ring_address = shared_address(ring);
  // Chunk i of this warp (floats (warp + 8 i) 32 .. + 32 of the split) -> ring stage `stage`.
  auto issue = [&](int i, int stage) {
    const int k = (warp + i * kTcGemvWarps) * kTcGemvChunkK;
    // Multiples of 4 on both sides: a lane's float4 is all in the split or all out.
    const bool k_ok = k + 4 * copy_piece < k_len;
#pragma unroll
    for (int u = 0; u < kCopyRounds; ++u) {
      const bool ok = src_ok[u] && k_ok;
      const int f4 = stage * kStageF4 + slot(4 * u + lane / 8, copy_piece);
      cp_async_16(ring_address + f4 * 16, ok ? src[u] + k : p.x, ok ? 16 : 0);
    }
  };

  float acc[kTcGemvBatchFrags][kTcGemvRowFrags][4] = {};
  float total[kTcGemvBatchFrags][kTcGemvRowFrags][4] = {};

  // One commit per chunk slot, even empty: before iteration i's wait, chunk i is group i of
  // kTcGemvStages + i committed, so "at most kTcGemvStages - 1 pending" means it has landed.
#pragma unroll
  for (int s = 0; s < kTcGemvStages - 1; ++s) {
    if (s < warp_chunks) issue(s, s);
    cp_async_commit();
  }
  for (int i = 0; i < warp_chunks; ++i) {
    __syncwarp();  // every lane is done reading the stage refilled here (iteration i - 1)
    const int next = i + kTcGemvStages - 1;
    if (next < warp_chunks) issue(next, next % kTcGemvStages);
    cp_async_commit();
    cp_async_wait<kTcGemvStages - 1>();
    __syncwarp();  // chunk i, copied by all lanes, is visible to all

    const float4* stage = ring + (i % kTcGemvStages) * kStageF4;
#pragma unroll
    for (int s = 0; s < kTcGemvSegments; ++s) {
      float4 w_piece[kTcGemvRowFrags];      // weight row 8 j + g
      float4 x_piece[kTcGemvBatchFrags][2];  // batch rows 16 mf + g, 16 mf + g + 8
#pragma unroll
      for (int j = 0; j < kTcGemvRowFrags; ++j) {
        w_piece[j] = stage[slot(kTcMmaN * j + g, 4 * s + t)];
      }
#pragma unroll
      for (int mf = 0; mf < kTcGemvBatchFrags; ++mf) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          x_piece[mf][h] = stage[slot(kTcGemvRowsPerCta + kTcMmaM * mf + 8 * h + g, 4 * s + t)];
        }
      }
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        uint32_t b_big[kTcGemvRowFrags][2], b_small[kTcGemvRowFrags][2];
#pragma unroll
        for (int j = 0; j < kTcGemvRowFrags; ++j) {
          const float4 v = w_piece[j];
          split_tf32(__float_as_uint(q == 0 ? v.x : v.z), b_big[j][0], b_small[j][0]);
          split_tf32(__float_as_uint(q == 0 ? v.y : v.w), b_big[j][1], b_small[j][1]);
        }
        uint32_t a_big[kTcGemvBatchFrags][4], a_small[kTcGemvBatchFrags][4];
#pragma unroll
        for (int mf = 0; mf < kTcGemvBatchFrags; ++mf) {
          const float4 lo = x_piece[mf][0];
          const float4 hi = x_piece[mf][1];
          split_tf32(__float_as_uint(q == 0 ? lo.x : lo.z), a_big[mf][0], a_small[mf][0]);
          split_tf32(__float_as_uint(q == 0 ? hi.x : hi.z), a_big[mf][1], a_small[mf][1]);
          split_tf32(__float_as_uint(q == 0 ? lo.y : lo.w), a_big[mf][2], a_small[mf][2]);
          split_tf32(__float_as_uint(q == 0 ? hi.y : hi.w), a_big[mf][3], a_small[mf][3]);
        }
        mma_3xtf32_grid(acc, a_big, a_small, b_big, b_small);
      }
    }
    flush_into_total(total, acc);
  }
  cp_async_wait<0>();  // only empty groups can remain

  // Cross-warp sums in warp order through the rings: sums[warp][b][row] (row stride kSumsLd);
  // c0..c3 of fragment (mf, j) are batch rows 16 mf + g (+ 8 for c2, c3) and weight rows
  // 8 j + 2 t (+ 1 for c1, c3).
  float* sums = reinterpret_cast<float*>(smem_f4);
  __syncthreads();  // every warp is done with its ring
#pragma unroll
  for (int mf = 0; mf < kTcGemvBatchFrags; ++mf) {
#pragma unroll
    for (int j = 0; j < kTcGemvRowFrags; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int b = kTcMmaM * mf + g + 8 * (e / 2);
        const int row = kTcMmaN * j + 2 * t + e % 2;
        sums[(warp * kTcGemvBatchTile + b) * kSumsLd + row] = total[mf][j][e];
      }
    }
  }
  __syncthreads();
  store_warp_sums<kTcGemvWarps, kTcGemvBatchTile, kTcGemvRowsPerCta, kSumsLd, kTcGemvThreads>(
      p, sums, tid, split, b0, n0);
}

}  // namespace forward_gemm
}  // namespace cuda
}  // namespace fused_pool_gelu
