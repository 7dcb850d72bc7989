// The small-batch GEMVs of the forward (forward_plan.h picks one per call):
//   simt_splitk_kernel     small batch (a GEMV): exact fp32 FMA, the weight streamed once with
//                          16-byte loads, the x rows' K chunk staged in shared memory.
//   rowwise_gemv_kernel    B <= 4 with enough weight rows to fill the GPU: whole rows per CTA, no
//                          split-K (one "split"), exact fp32 FMA.
//   tf32x3_gemv_splitk_kernel  17-32 rows: the 3xTF32 products of the kernel below on a 32-row
//                          batch tile, the weight streamed once as by the GEMVs.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/forward_launch.h"
#include "cuda/gemm_common.cuh"

namespace fused_pool_gelu {
namespace cuda {
namespace forward_gemm {

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
// all issued before the first is waited on, and each thread reads back only its own: loaded into
// registers, ptxas spreads them over rounds of five loads, each waited on before the next
// (research/README.md, "Small batches (GEMVs, B <= 32)"). Two pieces per step keep two CTAs per
// SM at B <= 2; four (160 KB of shared memory at B = 1) leave one CTA per SM, slower on small
// weights. x (B x K, at most 128 KB) is read by every CTA, mostly from L2. The sums are reduced
// over the warp with a fixed butterfly, then over the warps in warp order through shared memory:
// bitwise reproducible.
// ------------------------------------------------------------------------------------------------



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
    // the same slots (after these reads in program order) need a barrier. Not unrolled: unrolled,
    // ptxas hoists every piece's shared load ahead of the FMAs and spills at B = 2.
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
// and 4 rows per instruction (4 lanes per row, each copying only its own fragments' pieces, would
// ask L2 for half lines). Lanes then read their fragments from the stage after a __syncwarp.
//
// Fragments (layout: gemm_sm80.cu's top) with K permuted inside each 16-float segment s of a
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

// ------------------------------------------------------------------------------------------------
// Host side.
// ------------------------------------------------------------------------------------------------

void configure_gemv_kernels(int device, int max_smem_optin, DeviceLimits& limits) {
  for_each_value<fg::kRowwiseBatches>([&](auto batch) {
    constexpr int kBatch = decltype(batch)::value;
    constexpr int kSmem = fg::rowwise_smem_bytes(kBatch);
    FPG_CHECK(kSmem <= max_smem_optin, "fused_pool_gelu.forward: the row-parallel GEMV needs ",
                kSmem, " bytes of shared memory per block, the device offers ", max_smem_optin);
    set_max_dynamic_smem(fg::rowwise_gemv_kernel<kBatch>, kSmem);
  });
  for (int i = 0; i < fg::kNumSimtBatchTiles; ++i) {
    dispatch_value<fg::kSimtBatchTiles>(i, [&](auto tile) {
      constexpr int kTile = decltype(tile)::value;
      constexpr int kSmem = fg::simt_smem_bytes<kTile>();
      FPG_CHECK(kSmem <= max_smem_optin, "fused_pool_gelu.forward: the GEMV kernel needs ",
                  kSmem, " bytes of shared memory per block, the device offers ", max_smem_optin);
      set_max_dynamic_smem(fg::simt_splitk_kernel<kTile>, kSmem);
      limits.simt_ctas_per_sm[i] =
          resident_ctas_per_sm(fg::simt_splitk_kernel<kTile>, fg::kSimtThreads, kSmem);
      FPG_CHECK(limits.simt_ctas_per_sm[i] >= 1,
                  "fused_pool_gelu.forward: the GEMV kernel cannot run on device ", device);
    });
  }
  if (fg::kTcGemvSmemBytes <= max_smem_optin) {
    set_max_dynamic_smem(fg::tf32x3_gemv_splitk_kernel, fg::kTcGemvSmemBytes);
    limits.tc_gemv_ctas_per_sm = resident_ctas_per_sm(fg::tf32x3_gemv_splitk_kernel,
                                                      fg::kTcGemvThreads, fg::kTcGemvSmemBytes);
  }
}

void launch_rowwise_gemv(const GemmOperands& ops, float* dot_products, int64_t batch, int64_t n,
                         int64_t k_padded, cudaStream_t stream) {
  const unsigned ctas = grid_blocks(n, fg::kRowwiseRows, "weight rows");
  const fg::GemmParams p = gemm_params(ops, dot_products, batch, n, k_padded, k_padded, 0, batch);
  FPG_CHECK(batch <= fg::kRowwiseMaxBatch,
              "fused_pool_gelu.forward: internal error: no row-parallel GEMV for ", batch, " rows");
  dispatch_value<fg::kRowwiseBatches>(
      smallest_at_or_above<fg::kRowwiseBatches>(batch), [&](auto rows) {
        constexpr int kBatch = decltype(rows)::value;
        fg::rowwise_gemv_kernel<kBatch>
            <<<ctas, fg::kRowwiseThreads, fg::rowwise_smem_bytes(kBatch), stream>>>(p);
      });
  STD_CUDA_KERNEL_LAUNCH_CHECK();
}

void launch_simt_gemv(const SimtPlan& plan, const GemmOperands& ops, float* partial,
                      int64_t batch, int64_t n, int64_t k_padded, cudaStream_t stream) {
  const unsigned n_tiles = grid_blocks(n, fg::kSimtRowsPerCta, "weight rows");
  // Batch tiles go on grid z (at most 65535): larger batches (only on devices without the
  // tensor-core kernel) are launched in slices of rows.
  const int64_t rows_per_launch = kMaxGridYZ * plan.batch_tile;
  dispatch_value<fg::kSimtBatchTiles>(plan.tile_index, [&](auto tile) {
    constexpr int kTile = decltype(tile)::value;
    for (int64_t row0 = 0; row0 < batch; row0 += rows_per_launch) {
      const fg::GemmParams p = gemm_params(ops, partial, batch, n, k_padded,
                                           plan.split_k.k_per_split, row0, rows_per_launch);
      const dim3 grid(n_tiles, static_cast<unsigned>(plan.split_k.splits),
                      static_cast<unsigned>(ceil_div(p.rows, int64_t{kTile})));
      fg::simt_splitk_kernel<kTile>
          <<<grid, fg::kSimtThreads, fg::simt_smem_bytes<kTile>(), stream>>>(p);
      STD_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
}

void launch_tc_gemv(const SplitK& plan, const GemmOperands& ops, float* partial, int64_t batch,
                    int64_t n, int64_t k_padded, cudaStream_t stream) {
  const unsigned n_tiles = grid_blocks(n, fg::kTcGemvRowsPerCta, "weight rows");
  const fg::GemmParams p =
      gemm_params(ops, partial, batch, n, k_padded, plan.k_per_split, 0, batch);
  const dim3 grid(n_tiles, static_cast<unsigned>(plan.splits),
                  static_cast<unsigned>(ceil_div(batch, int64_t{fg::kTcGemvBatchTile})));
  fg::tf32x3_gemv_splitk_kernel<<<grid, fg::kTcGemvThreads, fg::kTcGemvSmemBytes, stream>>>(p);
  STD_CUDA_KERNEL_LAUNCH_CHECK();
}
}  // namespace cuda
}  // namespace fused_pool_gelu
