// The forward kernels' tile shapes: what the host-only planner (forward_plan.h) needs to know of
// the kernels, and the kernels build on. Plain C++ constants, no CUDA: forward_plan.h and its CPU
// unit test include this file. Each kernel's own file says how it uses its tile.
#pragma once

#include <cstdint>
#include <iterator>

namespace fused_pool_gelu {
namespace cuda {
namespace forward_gemm {

// ---- SIMT split-K GEMV (gemv.cu): exact float32 FMAs, the weight streamed once.
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
constexpr int kSimtSegmentK = kSimtLanesPerRow * 4;           // 16 floats per instruction
constexpr int kSimtStepK = kSimtSegmentK * kSimtLoadsPerRow;  // 32 floats per warp step
constexpr int kSimtChunkK = kSimtStepK * kSimtWarps;          // 256 floats of x staged at once
constexpr int kSimtXBuffers = 2;                              // x chunk double buffer
// Batch rows per CTA (register arrays): the host takes the smallest instance >= B; more rows run
// as several batch tiles (grid z). 16 rows take 126 registers (2 CTAs per SM); a 32-row tile
// (246 registers, 1 CTA per SM) runs 17-32 rows slower than two 16-row tiles.
constexpr int kSimtBatchTiles[] = {1, 2, 4, 8, 16};
constexpr int kNumSimtBatchTiles = static_cast<int>(std::size(kSimtBatchTiles));
constexpr int kSimtMaxBatchTile = kSimtBatchTiles[kNumSimtBatchTiles - 1];

// ---- Row-parallel GEMV (gemv.cu): B <= kRowwiseMaxBatch, whole weight rows per CTA, no split-K.
constexpr int kRowwiseThreads = 512;
constexpr int kRowwiseWarps = kRowwiseThreads / 32;
constexpr int kRowwiseRows = 4;
constexpr int kRowwiseUnroll = 2;
// The compiled batch sizes (the launch takes the smallest that holds B).
constexpr int kRowwiseBatches[] = {1, 2, 4};
constexpr int kRowwiseMaxBatch = kRowwiseBatches[std::size(kRowwiseBatches) - 1];
// The staged pieces of a step, [kRowwiseUnroll][kRowwiseRows + batch][kRowwiseThreads] float4.
constexpr int rowwise_smem_bytes(int batch) {
  return kRowwiseUnroll * (kRowwiseRows + batch) * kRowwiseThreads * 16;
}

// ---- 3xTF32 tensor-core GEMM, mma.sync (gemm_sm80.cu) and wgmma (gemm_sm90a.cu): one tile.
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
constexpr int kTcWarpTileM = kTcBlockM / kTcWarpsM;  // 64
constexpr int kTcWarpTileN = kTcBlockN / kTcWarpsN;  // 32
constexpr int kTcFragsM = kTcWarpTileM / kTcMmaM;    // 4
constexpr int kTcFragsN = kTcWarpTileN / kTcMmaN;    // 4
constexpr int kTcSmemLd = kTcBlockK + 4;             // padded shared row, in floats
constexpr int kTcTileAFloats = kTcBlockM * kTcSmemLd;
constexpr int kTcStageFloats = (kTcBlockM + kTcBlockN) * kTcSmemLd;
constexpr int kTcSmemBytes = kTcStages * kTcStageFloats * static_cast<int>(sizeof(float));
constexpr int kTcChunksPerRow = kTcBlockK / 4;                    // 16-byte chunks per tile row
constexpr int kTcLoadRowsPerPass = kTcThreads / kTcChunksPerRow;  // 32
constexpr int kTcLoadPassesA = kTcBlockM / kTcLoadRowsPerPass;    // 4
constexpr int kTcLoadPassesB = kTcBlockN / kTcLoadRowsPerPass;    // 4

// ---- 3xTF32 tensor-core GEMV (gemv.cu): 17 to 32 rows, a 32-row batch tile on mma.sync.
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
// flight per SM (Hopper; devices with less shared memory per block keep the SIMT GEMV).
constexpr int kTcGemvStages = 3;
constexpr int kTcGemvSmemBytes = kTcGemvWarps * kTcGemvStages * kTcGemvStageBytes;

// ---- The certified pass 1 (certified_pass1_sm90a.cu): fp16 wgmma over 64-wide K tiles.
// Its x tiles are 64 or 128 rows (forward_plan.h's plan_certified); grid y counts 128-row tiles.
constexpr int kPass1BlockM = 128;
constexpr int kPass1BlockK = 64;  // fp16 weight row: 128 bytes, one swizzle row

}  // namespace forward_gemm

namespace certified {

// Splits of pass 1, at most, on 128 x 256 tiles: the selection reads every split's partial of
// every (row, column) at once, and the workspace (splits x rows x N bfloat16 partials, x's split
// sums and the candidate lists) stays within 4 x rows x N floats and the per-row lists.
constexpr int kMaxSplits = 8;
// The same for the fused rows (one row per SM, select_rescore_kernel): few rows, so pass 1 fills
// the GPU by splitting K finely; a thread loads a column's partials of every split at once.
constexpr int kFusedMaxSplits = 32;
// Columns the selection serves: its CTA keeps the row's upper ends in shared memory, 16 KB at this
// width; wider layers take the 3xTF32 path.
constexpr int64_t kMaxSelectColumns = 4096;
// Candidates kept per row; a row with more is rescored whole (research/simulate_certified.py: 3.6
// per row on average at the default shape, 99.9% of rows at most ~21).
constexpr int kMaxCandidates = 64;

}  // namespace certified
}  // namespace cuda
}  // namespace fused_pool_gelu
