// CUDA forward_with_argmax: out[b] = max_n scale * gelu(x[b] . weight[n] + bias[n]), with the
// arg-max n and the pre-activation there (torch.max semantics: first index on ties, NaN wins).
//
// Two launches per slice of rows (one slice unless the workspace would pass kMaxWorkspaceFloats):
//   1. a split-K GEMM writing fp32 partial sums to a workspace [splits, rows, N]: a row-parallel
//      GEMV (one split) for B <= 4, a SIMT split-K GEMV for small B (forward_gemm.cuh), from 17
//      rows on Hopper a 3xTF32 split-K GEMV on tensor cores (same file), a 3xTF32 tensor-core GEMM
//      for larger B: wgmma on sm_90a (forward_gemm_sm90.cuh), mma.sync elsewhere
//      (forward_gemm.cuh);
//   2. argmax_epilogue_kernel: per row, z = partial[0] + ... + partial[S-1] (in that order) + bias,
//      v = gelu(z) * scale (NaN where z is not finite, see README "Non-finite values"), and the
//      (value, index, z) maximum; a CTA per row (256 threads, 1024 for wide rows with few splits)
//      while B is small, a warp per row from 8192 rows (or, for one split of N < 1024, past one
//      wave of the 256-thread CTAs, half a wave with 16-byte loads, as for the half path's slices
//      of K), and on sm_90+ the GEMM's programmatic dependent, its CTAs spread over the SMs
//      (kMaxSpreadCtasPerSm).
// On sm_90a, from kCertifiedMinBatch rows (kCertifiedPreparedMinBatch with a prepared weight, and
// with one also from kCertifiedFusedMinBatch to one row per SM) for weights large enough
// (kCertifiedMinColumns and the constants after it; use_certified), the certified path replaces
// both: a scaled fp16 copy of the weight rows with their norms (prepared_weight.h; skipped when
// the caller passes prepare_weight's), a single-pass fp16 GEMM that converts x as it goes
// (forward_gemm_sm90.cuh's certified_pass1_kernel), a selection of the columns that may hold the
// row's maximum by a proven error bound (with x's norms from pass 1's split sums; pass 1's
// programmatic dependent, spread over the SMs like the epilogue), and a float32 rescoring of
// those (forward_certified.cuh; one kernel with the selection where the rows fit on the SMs at
// once, certified_fused_rows): two to four launches,
// the same results as the 3xTF32 path's to float32 rounding, with the same tie and NaN rules, and
// the same bits with or without a prepared weight.
// Float16 and bfloat16 operands take none of the GEMMs above: the products of their significands
// fit float32's 24 bits, so z is cuBLAS's tensor-core GEMM with float32 accumulation and a float32
// result (at::mm with out_dtype, PyTorch 2.8 on: the GEMM nn.Linear runs on them, its result kept
// in float32 instead of rounded to the half type before the GELU), which the epilogue reads as one
// split, or from 512 rows as up to four slices of K (kHalfGemmMaxSplits). Our kernels would
// first copy both operands to float32 and then pay for float32-accurate products of values that
// need no splitting (benchmarks/NOTES.md: 132 us at B = 1024 against 35 for PyTorch's bfloat16
// Linear, GELU and max).
// No float atomics and a fixed summation order: bitwise reproducible run to run (the half path as
// cuBLAS is: on one GPU model, with PyTorch's per-stream workspaces). Allocation goes through
// PyTorch's allocator only and nothing synchronizes with the host, so the op is CUDA-graph
// capturable.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/mm.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "argmax_band.h"
#include "checks.h"
#include "common.cuh"
#include "forward_certified.cuh"
#include "forward_gemm.cuh"
#include "forward_gemm_sm90.cuh"
#include "prepared_weight.h"
#include "row_max.cuh"

namespace fused_pool_gelu {
namespace cuda {
namespace {

namespace fg = forward_gemm;

// ------------------------------------------------------------------------------------------------
// Tuning knobs (measured on an H200 where a comment says so).
// ------------------------------------------------------------------------------------------------

// Batches up to this size take the SIMT GEMV (exact fp32 FMA; the weight is streamed once and the
// FMA work, B x N x K, is still small next to it); larger ones the 3xTF32 tensor-core GEMM, whose
// 128-row tiles are mostly padding below ~32 rows.
constexpr int64_t kSimtMaxBatch = 32;

// From kSimtMaxBatchWgmma + 1 rows (where the SIMT GEMV takes a second 16-row batch tile, which
// reads the weight again) to kSimtMaxBatch, weights of more than kTcSmallBatchMinWeightFloats
// floats go to a 3xTF32 tensor-core kernel, the same accuracy class as the larger batches'
// (smaller weights keep the SIMT GEMV's exact float32 FMAs, and with them exact denormals and
// largest values, docs/input_classes.md; 3xTF32's per-product error, up to ~2^-20 relative, is
// 16-48x float32's and came to 1.2e-6 of a 3-row output on the GPU suite's small shapes):
//   - the tensor-core GEMV (3xTF32 on a 32-row batch tile, forward_gemm.cuh; on devices with the
//     shared memory for it: Hopper) when its grid keeps kMinBusySmPercent of the SMs busy;
//   - else, where the wgmma GEMM serves (sm_90a), that GEMM when its grid does.
// H200 own times, GEMV kernel, B = 24 / 32 (profile_forward.py, 2026-11-30 17:12-17:14 UTC, two
// rounds): N x K = 512 x 8192 (16 MB) wgmma 14.5 / 14.5 -> tensor-core GEMV 10.7-10.9 /
// 10.9-11.0 us, medians 21.7 / 21.7 -> 17.6-17.7 / 17.8-17.9. Other 16 MB weights, medians at
// B = 17 / 24 / 32 (17:33-17:34 UTC, two rounds, c7d780f against 1356b77): 4096 x 1024 30.5-39.9
// / 32.4-34.9 / 32.6-33.8 -> 22.7-23.2 / 24.6-24.8 / 27.2-27.4 (the epilogue over 4096 columns
// takes 8.8-13.0 us of it); 2048 x 2048 24.5-24.7 -> 20.3-20.4 / 21.5-21.8 / 23.8-23.9; 1024 x
// 4096 23.1-23.2 -> 18.9-19.1 / 20.2-20.3 / 20.1-20.4. On smaller weights it also beat the
// SIMT GEMV (128 x 16384: 10.2-10.3 / 10.3 -> 8.1-8.5 us, medians 15.4-15.9 -> 13.6-14.1; 256 x
// 4096 6.9 / 7.0 -> 6.3 / 6.4), but is not used there for the accuracy above; on 1024 x 2048 its
// 4 splits (against the SIMT GEMV's 2) made the epilogue 3.5 -> 5.8 us and the medians 17.0-17.4
// -> 17.3-18.8, and on narrow grids (128 x 2048: 32 CTAs) it lost (4.8 / 4.9 against 3.8 / 3.7,
// an earlier form, 16:59-17:02 UTC). Up to 16 rows the exact SIMT GEMV stays at every weight
// size, though on the default shape the tensor-core GEMV would take B = 16 from 11.3 to 9.3 us.
// The wgmma GEMM against the SIMT GEMV at B = 24 / 32 (profile_forward.py, 2026-11-30
// 14:33-14:41 UTC), GEMV against wgmma, GEMM + epilogue: N x K = 512 x 8192 (16 MB)
// 19.6 / 20.8 against 18.4 / 18.4 us; at 8 MB the GEMV 13.2 / 14.3-14.6 at 512 x 4096, 12.7 / 12.9
// at 256 x 8192, 12.3 / 12.2 at 128 x 16384 against the wgmma GEMM's 13.7, 13.4 and 15.9 at
// 12:59-13:14 UTC (64 CTAs at 128 x 16384, kTcMaxSplits: 128 splits would shorten the GEMM by 3.5
// us and lengthen the epilogue by 3.8); larger weights favour the GEMM more (12 MB, 512 x 6144:
// 19.1 against 16.0 at 13:07 UTC, with the GEMV's former 32-row tile), smaller ones the GEMV (256 x
// 4096: 9.4 / 9.5 against 11.1).
constexpr int64_t kSimtMaxBatchWgmma = 16;
constexpr int64_t kTcSmallBatchMinWeightFloats = int64_t{1} << 21;

// The certified path (see the top) from this batch on: kCertifiedMinBatch rows when it makes the
// weight's fp16 copy itself, kCertifiedPreparedMinBatch when the caller passes one
// (prepare_weight). H200 medians on the benchmarks' data (a folded nn.Linear, x ~ U(0, 1);
// profile_forward.py, 2026-11-30 06:45 UTC, commit bd94239), certified (copy made per call /
// prepared) against 3xTF32: B = 256 46.1 / 36.3 against 31.5 us, 320 45.6 / 35.9 against 42.0, 384
// 49.4 / 39.7 against 42.6, 448 48.3 / 38.7 against 47.9, 512 50.2 / 40.5 against 48.7, 544 54.1 /
// 44.5 against 66.2; with a prepared weight (a second call, 06:45-06:47 UTC): 257 39.9 against 38.8
// (own times 33.0 against 36.4: a tie within the medians' run-to-run spread, 36.3-38.4 at 256), 288
// 37.3 against 41.2, 319 36.7 against 42.3. At 05:16 UTC (commit 88c45a5): 576 51.5 / 42.0 against
// 67.7, 640 53.0 / 42.9 against 61.2, 1024 63.4 / 55.0 against 87.2, 4096 158.0 / 148.7 against
// 326.8. Pass 1 takes 20-26 us from 256 to 1024 rows (too few 128-row tiles to fill the GPU without
// splits), and 3xTF32 steps with its 128-row tiles (at 257 and 513); the switches sit where
// certified wins at every measured batch from there on: the fifth tile's first row without a
// prepared weight, the third tile's first row with one. That step, with a prepared weight, on the
// kernels of commit ebdb81c (profile_forward.py, 2026-11-30 10:19 UTC, two rounds): certified 36.1
// / 36.4 against 32.1 / 32.1 at B = 256, 36.6 / 37.7 against 39.5 / 39.5 at 257, 36.7 / 37.5
// against 39.4 / 39.3 at 264, 36.1 / 35.8 against 41.7 / 41.7 at 272, 37.7 / 37.7 against 42.0 /
// 42.0 at 287 (own times at 257: 34.1 against 36.2).
constexpr int64_t kCertifiedMinBatch = 4 * fg::kTcBlockM + 1;
constexpr int64_t kCertifiedPreparedMinBatch = 2 * fg::kTcBlockM + 1;
// ... and only for weights of at least kCertifiedMinColumns rows (N) and kCertifiedMinWeightFloats
// floats (N x K), or, from kCertifiedLargeWorkMinColumns rows and
// kCertifiedLargeWorkMinWeightFloats floats, once the call's work B x N x K reaches
// kCertifiedMinWork. The certified path saves two of the 3xTF32 GEMM's three MMA passes, which
// grows with B x N x K, but pays the weight's copy, the selection (B x N) and the rescoring, which
// reads K floats of the weight for each candidate (1.1-2.6 per row on these data): B x K, whatever
// N. So narrow weights lose at every K, and small ones to the fixed costs until the batch is large.
// H200 own times (profile_forward.py, 2026-11-30 14:39-14:41 and 14:58-14:59 UTC), certified (copy
// made per call / prepared) against 3xTF32, N x K at B = 513 and 1024: 128 x 8192 38.8 / 36.5
// against 22.3, 43.6 / 39.7 against 32.7 us; 128 x 16384 65.7 / 58.7 against 33.8, 75.4 / 68.8
// against 50.1; 256 x 8192 40.0 / 34.8 against 32.7, 46.9 / 41.5 against 47.1; 512 x 1024 24.2 /
// 21.6 against 16.0, 27.5 / 24.8 against 21.1; 512 x 2048 27.6 / 23.9 against 28.0, 30.8 / 27.4
// against 30.3; 1024 x 1024 29.1 / 24.1 against 23.7, 33.1 / 28.4 against 30.8; 2048 x 512 34.7 /
// 27.1 against 30.4, 40.2 / 33.0 against 32.7; at B = 2048: 512 x 1024 35.6 / 32.7 against 32.9,
// 1024 x 512 41.2 / 37.0 against 34.4, 512 x 2048 40.8 / 37.0 against 50.6, 1024 x 1024 43.9 / 39.0
// against 51.8, 2048 x 512 55.4 / 48.2 against 61.0; from 2^21 floats at N >= 512: 512 x 4096 32.2
// / 26.7 against 38.8, 36.4 / 30.8 against 47.1; 1024 x 2048 35.3 / 29.2 against 35.7, 36.8 / 30.9
// against 48.1; 2048 x 1024 41.0 / 32.7 against 42.0, 43.1 / 34.8 against 50.0; 4096 x 1024 65.2 /
// 50.0 against 92.7, 66.2 / 51.2 against 96.9; at 257 rows with a prepared weight 23.8 against
// 23.1, 25.0 against 28.6, 25.4 against 31.3, 41.3 against 53.9; at B = 4096 (15:02-15:05 UTC): 512
// x 512 46.5 / 44.1 against 38.5, 512 x 1024 51.7 / 48.8 against 56.2, 256 x 8192 109.7 / 104.2
// against 166.8, 128 x 8192 106.1 / 101.5 against 92.8; on 222a1ff (15:38-15:40 UTC): 256 x 2048
// at B = 4096 56.7 / 54.2 against 54.1 / 53.8 (3xTF32 with and without a prepared weight), 512 x
// 1024 at 4096 51.4 / 48.3 against 55.9 / 55.4, 256 x 4096 at 1024 31.6 / 27.7 against 29.9 / 30.1
// and at 2048 44.4 / 41.4 against 49.4 / 49.0. Measured losses the rule leaves: with a prepared
// weight 2.2-4.0 us at N x K = 2^20 (512 x 2048, 1024 x 1024, 2048 x 512 at B = 513 or 1024, 256
// x 4096 at 1024: the 3xTF32 GEMM) and 0.7 us at 512 x 4096, B = 257 (the certified path);
// without one 2.6 us at 256 x 2048, B = 4096 (the certified path, at the rule's floor).
constexpr int64_t kCertifiedMinColumns = 512;
constexpr int64_t kCertifiedMinWeightFloats = int64_t{1} << 21;
constexpr int64_t kCertifiedLargeWorkMinColumns = 256;
constexpr int64_t kCertifiedLargeWorkMinWeightFloats = int64_t{1} << 19;
constexpr int64_t kCertifiedMinWork = int64_t{1} << 31;
// With a prepared weight the certified path also serves the batches of at most one row per SM
// (certified_fused_rows: pass 1 on 128-wide tiles, select_rescore_kernel) from
// kCertifiedFusedMinBatch rows, on weights of N >= kCertifiedMinColumns rows and N x K >=
// kCertifiedFusedMinWeightFloats floats. H200 medians (profile_forward.py --prepared yes,
// 2026-11-30 23:23-23:27 UTC), certified against 3xTF32, N x K at B = 33 / 64 / 128 / 132: 512 x
// 8192 19.7-20.2 / 19.6-20.5 / 20.7-21.7 / 20.6-21.7 against 20.1-20.9 / 20.9-21.1 / 21.7-22.8 /
// 30.2-30.3 (two rounds); 512 x 16384 24.6 / 25.9 / 27.6 / 29.5 against 30.1 / 30.4 / 32.2 / 48.6;
// 1024 x 8192 23.6 / 23.0 / 23.6 / 30.0 against 32.0 / 32.1 / 33.9 / 47.6; 1024 x 4096 19.8 /
// 20.2 / 20.6 / 21.6 against 22.7 / 23.1 / 24.8 / 29.6; 2048 x 8192 32.3 / 30.2 / 31.2 / 46.8
// against 48.8 / 49.2 / 51.0 / 84.4; but at 2^21 floats, 512 x 4096, 18.0 / 18.4 / 18.9 / 18.9
// against 16.3 / 16.5 / 18.3 / 21.2 (one round each; the 3xTF32 GEMM's 128-row tiles step at 129
// rows). Below 33 rows the GEMVs serve.
constexpr int64_t kCertifiedFusedMinBatch = kSimtMaxBatch + 1;
constexpr int64_t kCertifiedFusedMinWeightFloats = int64_t{1} << 22;

// Batches up to fg::kRowwiseMaxBatch take the row-parallel GEMV (no split-K, so the epilogue reads
// B x N dot products instead of S x B x N partials) when its CTAs, fg::kRowwiseRows weight rows
// each, keep at least kMinBusySmPercent of the SMs busy (each SM then streams its own rows at its
// share of DRAM bandwidth); fewer rows would leave SMs idle and take the split-K GEMV. At the
// default shape: 128 CTAs on 132 SMs. The same share decides whether the wgmma GEMM's grid is wide
// enough to replace the GEMV from kSimtMaxBatchWgmma + 1 rows.
constexpr int64_t kMinBusySmPercent = 75;

// The SIMT GEMV aims at one full wave of resident CTAs (all weight loads in flight at once), but
// at most this many CTAs per SM: more, smaller CTAs would only add split-K partials for the
// epilogue to sum, and 4 x 256 threads x 128 B of loads per SM is already plenty in flight.
constexpr int kSimtMaxCtasPerSm = 4;

// Split-K of the tensor-core GEMM: the number of splits s minimizes waves(tiles x s) x ceil(k_tiles
// / s), the time in k-tile steps of the slowest SM (ties -> fewer splits, less workspace). s is at
// most kTcMaxSplits and may not push the grid past kTcMaxSplitWaves waves: splitting is for filling
// the GPU (B = 1024: 32 tiles -> 4 splits), not for shaving the last partial wave of a grid that is
// already large (the workspace and epilogue grow with s). A split may be a single K tile: its CTA
// then issues all its loads at once, and a small K still fills the GPU. (Splits of at least 8 K
// tiles, before 2026-11-30, left small-K grids a few CTAs wide, each streaming 256 KB alone: H200
// own times at B = 40 / 128, wgmma, N x K = 128 x 2048: 14.5 / 15.2 us -> 7.6 / 9.0 with
// single-tile splits; 512 x 1024: 15.5 / 16.4 -> 9.6 / 11.9; 256 x 4096 at B = 64 / 128: 15.1 /
// 16.0 -> 11.6 / 13.5; mma.sync (FUSED_POOL_GELU_FORCE_MMA_SYNC) 19.4 / 21.2 -> 7.5 / 9.0 at 128
// x 2048; the default shape's plans unchanged.)
constexpr int64_t kTcMaxSplits = 64;
constexpr int64_t kTcMaxSplitWaves = 4;
// The certified pass 1 plans its splits the same way but keeps at least 8 of its 64-wide K tiles
// per split, as it was measured (K < 4096 at B >= 257 only: shorter splits there are untried);
// for the fused rows (certified_fused_rows) at least 4: at B = 128, K = 8192, N = 512 its 128 x 128
// tiles take 32 splits, 128 CTAs (9.0 us; 2 tiles per split would make 256 CTAs, two waves), and
// at B = 64 its 64 x 128 tiles (kPass1SmallTileMaxBatch) the same.
constexpr int64_t kPass1MinKTilesPerSplit = 8;
constexpr int64_t kPass1FusedMinKTilesPerSplit = 4;
// The fused rows' pass 1 takes 64 x rows per tile up to this batch, 128 beyond: one 64-row tile
// instead of a half-empty 128-row one gained 0.3-0.6 us at B = 33-64, but at B = 128 two 64-row
// tiles per column tile read a third more from L2 per CTA than one of 128 (x's tile for half the
// columns): pass 1 9.2 -> 10.2 us (NOTES, 2026-12-01).
constexpr int64_t kPass1SmallTileMaxBatch = 64;

// Epilogue: a whole CTA (256 threads) per row while B is small, so that summing many split
// partials of one row is spread over many threads; a warp per row once B alone fills the GPU
// (8192 rows = 8192 warps, ~62 per SM on 132 SMs), or, for rows of fewer than
// kEpilogueWideRowMinColumns columns of one split or of the half path's slices of K, once the rows
// outnumber one wave of the CTA-per-row kernel (DeviceInfo::epilogue_one_split_ctas_per_sm per
// SM; wide rows keep the wide-row kernel, not measured against a warp per row), or half a wave
// where the loads take 16 bytes (the half path slices K only where N % 4 == 0; a bias view not
// 4 columns aligned leaves its slices to a CTA per row). Within one wave every row's loads are in
// flight at once, but each CTA per SM adds its load, barrier and store (~0.3 us each at 4-8 per
// SM), and beyond it each wave adds ~4 us. A warp
// per row keeps 8 scalar loads in flight per lane, two rounds at N = 512, or, where N % 4 == 0 and
// the bias's start allows, 16 columns per lane in one round (4 columns per load: 16 bytes of z,
// 16 or 8 of the bias), and evaluates the GELU only on argmax_band.h's band (one GELU and no
// second read where the band holds one column: 5.6 -> 4.9 us at 4096 rows, bfloat16, NOTES
// 2026-12-02; at 2048 rows and below the epilogue waits on the GEMM's tail either way). On the
// H200, bfloat16, N = 512 (NOTES, 2026-12-01, ~19:50 UTC), own time: CTA per row 3.2 / 3.8 / 4.0
// / 4.3 / 4.7 us at 512 / 640 / 768 / 896 / 1024 rows (one wave: 1056) and 16.1 at 4096 (four); a
// warp per row with 16-byte loads and the band 3.5 at every one of those up to 1024, 4.0 / 5.4 at
// 2048 / 4096 (the crossover near 580 rows; half a wave is 528). Scalar loads (before the band:
// 6.8 / 7.0 / 7.7 / 9.9 at 512 / 1024 / 2048 / 4096) keep the one-wave rule.
constexpr int kEpilogueThreads = 256;
constexpr int64_t kEpilogueWarpPerRowMinBatch = 8192;
// A warp per row reads the 16-byte loads of up to this many splits at once, for the half path's
// slices of K (kHalfGemmMaxSplits): 16 loads of z per lane at 4, 112 registers (ptxas -v, no
// spills). The float32 GEMMs' split partials keep the epilogues measured for them.
constexpr int kEpilogueVectorMaxSplits = 4;
// Wide rows with few splits take a CTA of kEpilogueWideRowThreads per row: at 256 threads, each
// thread's GELUs over N / 256 columns make a chain of dependent steps that 8 warps per SM cannot
// hide, and a small batch leaves most SMs idle. 1024 threads allow at most 64 registers, which
// the loads of two outputs in flight fit up to kEpilogueWideRowMaxSplitBound splits (47 registers
// at 4, 64 at 8 with no spills, ptxas -v). On the H200 the epilogue went 5.8 -> 3.5 us at
// K x N = 1024 x 4096, B = 24, and 5.0 -> 4.2 at 4096 x 2048, B = 128 (8 splits); N = 512 is
// unchanged (benchmarks/NOTES.md, the wide-row rows of 2026-11-30).
constexpr int kEpilogueWideRowThreads = 1024;
constexpr int64_t kEpilogueWideRowMinColumns = 1024;
constexpr int kEpilogueWideRowMaxSplitBound = 8;

// The CTA size of the epilogue with kThreadsPerRow threads per row (32: a warp per row).
constexpr int epilogue_cta_threads(int threads_per_row) {
  return threads_per_row == 32 ? kEpilogueThreads : threads_per_row;
}
// Split partials: up to kEpilogueMaxSplitBound of them are loaded all at once per output
// (sum_few_splits, compiled for the power of two at or above the call's splits), one round trip to
// L2; more go in batches of kSplitBatch (row_max.cuh). Batches alone made a chain of round trips:
// B = 128's 32 splits took 1 + 4 of them (epilogue 7.5 us of 27.3 on the H200), and fewer than 9
// splits went one load at a time after the first. A thread holds its outputs' loads in registers
// (ptxas -v: 128 at the bound of 32 with two outputs in flight); the batches that take many splits
// are the small ones, whose epilogue runs one CTA per row on an otherwise idle GPU.
constexpr int kEpilogueMaxSplitBound = 64;
// The epilogue is a programmatic dependent of the GEMM (sm_90+), as the certified selection is of
// pass 1: a dependent's CTAs are placed while the kernel before it still runs, wherever there is
// room, and a small grid piled onto the few SMs the GEMM left free (a 128-CTA GEMM leaves 4 of
// 132). The rescoring, the selection's dependent, is not spread: it lost what the selection gained
// (NOTES, 19:03-19:05 UTC). Up to this many CTAs per SM, the launch asks for the
// shared memory (unused) that lets no more than ceil(CTAs / SMs) share an SM. On the H200 the
// epilogue went 10.1 -> 5.7 us at K x N = 1024 x 4096, B = 24, and 4.1 -> 3.5 at the default
// shape, B = 128; the selection 9.9 -> 6.8 at 4096 x 1024, B = 400 (benchmarks/NOTES.md, the
// spread rows of 2026-11-30, with every shape and batch measured).
constexpr int kMaxSpreadCtasPerSm = 4;

// The split-K workspace (splits x rows x N floats) stays within this: larger batches go through
// GEMM + epilogue in slices of rows, and the planners cap the splits of a slice. Unbounded, it
// would grow with B, and at k = 1 (N = O) be at least a [B, O] tensor, the Linear output the fused
// op exists to avoid. 16 MB keeps a slice at >= 4M outputs (>= 256 tensor-core tiles of 128 x 128,
// ~2 waves on 132 SMs), so slicing costs the GEMM little; the default shape needs 8 MB up to
// B = 4096 and is never sliced. A slice holds at least one row: past 4M pooled features (N alone
// over the bound) the workspace is one row's N floats, and each row of x is a slice of its own.
constexpr int64_t kMaxWorkspaceFloats = (int64_t{16} << 20) / static_cast<int64_t>(sizeof(float));
static_assert(std::max(certified::kMaxSplits, certified::kFusedMaxSplits) * kMaxWorkspaceFloats <=
                  std::numeric_limits<int>::max(),
              "the certified selection's partial offsets fit in an int");

// The half path's GEMM in up to kHalfGemmMaxSplits slices of K (one cuBLAS strided-batched GEMM
// over views of x and the weight, no copies; the epilogue sums the slices' z): from
// kHalfGemmSplitMinBatch rows, as many as keep 128 x 128 output tiles x slices within the SMs.
// Whole, cuBLAS runs 64 x 64 tiles up to ~1024 rows (with its own split-K and a reduction kernel
// at 512), whose CTAs read x and the weight from L2 twice as often per product as 128 x 128 tiles;
// the slices give it fewer rows of tiles and a K it splits no further. Measured on the H200,
// bfloat16, K x N = 8192 x 512, cuBLAS's own time (benchmarks/NOTES.md, 2026-12-01 ~20:10 UTC):
// whole 12.0 / 19.1 / 30.8 / 45.3 us at 512 / 1024 / 2048 / 4096 rows; 2 slices 11.1 / 16.4 /
// 24.4 / 46.8; 4 slices 8.4 / 14.1 / 26.3 / 50.1; 8 slices 8.8 / 16.0 / 30.2 / 56.8 (float16
// alike; five calls back to back, x and the weight in L2: in the op, after the benchmarks' flush,
// 21.3 -> 17.1 at 1024 rows). The rule picks 4 / 4 / 2 / 1, each the fastest; at most 4 keeps the
// epilogue's reads of the slices' partials (kEpilogueVectorMaxSplits) at one round of loads per
// lane. Nothing was measured below 512 rows or with slices of K below 2048 (more z to write and
// read for less GEMM to share out): one slice there.
constexpr int64_t kHalfGemmSplitMinBatch = 512;
constexpr int64_t kHalfGemmMaxSplits = 4;
constexpr int64_t kHalfGemmMinSliceK = 2048;
static_assert(kHalfGemmMaxSplits <= kEpilogueVectorMaxSplits, "the epilogue sums every slice");
constexpr int64_t kHalfGemmTile = 128;
// cuBLAS's fast kernels want 16-byte aligned operands: each slice starts 8 half elements apart.
constexpr int64_t kHalfGemmSliceAlign = 8;

// Largest supported K: padded to a multiple of 4, offsets inside a row plus two chunks of
// look-ahead must fit an int in the GEMV kernel. A multiple of 4 itself (2^31 - 516), so that K
// passes this bound exactly when its padded width does.
constexpr int64_t kMaxInFeatures = (std::numeric_limits<int>::max() - 2 * fg::kSimtChunkK) / 4 * 4;
static_assert(kMaxInFeatures == (int64_t{1} << 31) - 516, "the limit docs/input_classes.md states");

// gridDim.y's and gridDim.z's limit (gridDim.x's: common.cuh).
constexpr int64_t kMaxGridYZ = 65535;

// ------------------------------------------------------------------------------------------------
// Epilogue: bias + GELU + scale + row arg-max.
// ------------------------------------------------------------------------------------------------

struct EpilogueParams {
  const float* partial;  // [splits, batch, n] (nullptr when splits == 0, i.e. K == 0)
  int64_t split_stride;  // batch * n
  int splits;
  const void* bias;      // [n] in the output's dtype (x's), contiguous, or nullptr
  float scale;
  int64_t batch;
  int64_t n;
};

// kColumns adjacent columns of a row of z or of the bias in one load (4 or 16 bytes of float32, 2
// or 8 of a half type; the caller keeps the address aligned to it), widened to float where used. A
// half type's values stay the loaded bits until then: moving them into registers of their own
// right after the load made it wait for the load there, before the loads after it were issued.
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
    // product with scale. A non-finite pre-activation gives NaN, as in the CPU kernel (README
    // "Non-finite values").
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
          // Every load of the round before any sum: summed per load, ptxas issued the next
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
  f(argmax_epilogue_kernel<kThreadsPerRow, kSplitBound, at::Half>);
  f(argmax_epilogue_kernel<kThreadsPerRow, kSplitBound, at::BFloat16>);
  if constexpr (kSplitBound < kMaxSplitBound) {
    for_each_row_epilogue<kThreadsPerRow, kMaxSplitBound, kSplitBound == 0 ? 1 : 2 * kSplitBound>(
        f);
  }
}

// ------------------------------------------------------------------------------------------------
// Host side.
// ------------------------------------------------------------------------------------------------

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
  TORCH_CHECK(0 <= i && i < static_cast<int>(std::size(kValues)),
              "fused_pool_gelu.forward: internal error: instance index ", i);
  for_each_value<kValues>([&](auto value) {
    if (decltype(value)::value == kValues[i]) f(value);
  });
}

// The index of the smallest of kValues at or above v (the instance that holds v rows), or of the
// largest where none is.
template <const auto& kValues>
int smallest_at_or_above(int64_t v) {
  for (int i = 0; i < static_cast<int>(std::size(kValues)); ++i) {
    if (kValues[i] >= v) return i;
  }
  return static_cast<int>(std::size(kValues)) - 1;
}

constexpr int kSimtBatchTiles[] = {1, 2, 4, 8, 16};
constexpr int kNumSimtBatchTiles = static_cast<int>(std::size(kSimtBatchTiles));
static_assert(kSimtBatchTiles[kNumSimtBatchTiles - 1] == fg::kSimtMaxBatchTile, "batch tiles");

template <typename Kernel>
void set_max_dynamic_smem(Kernel kernel, int bytes) {
  C10_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

// The row-parallel GEMV's instances, by batch rows (launch_rowwise takes the smallest that holds
// B).
constexpr int kRowwiseBatches[] = {1, 2, 4};
static_assert(kRowwiseBatches[std::size(kRowwiseBatches) - 1] == fg::kRowwiseMaxBatch,
              "the largest serves every batch");

template <typename Kernel>
int resident_ctas_per_sm(Kernel kernel, int threads, int smem_bytes) {
  int ctas = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kernel, threads, smem_bytes));
  return ctas;
}

// What the planners need to know about a device, computed once per device (this also raises the
// kernels' dynamic shared memory limits there; those are per device).
struct DeviceInfo {
  int sms = 0;
  int simt_ctas_per_sm[kNumSimtBatchTiles] = {};
  // 0 where the tensor-core GEMV's shared memory does not fit (devices before Hopper).
  int tc_gemv_ctas_per_sm = 0;
  // 0 when the 3xTF32 kernel does not fit (e.g. sm_86 / sm_89 give 99 KB of shared memory per
  // block): every batch size then takes the SIMT kernel.
  int tc_ctas_per_sm = 0;
  // Programmatic dependent launch of the epilogue after the GEMM (dependent_launch_enabled: asked
  // of one epilogue instance, for the image this file's kernels share on the device).
  bool dependent_launch = false;
  // 0 unless the wgmma kernel can run here: a compute capability 9.0 device, a build holding
  // sm_90a code (FPG_WITH_SM90A) and that code being what the driver picked for this device.
  int wgmma_ctas_per_sm = 0;
  // Shared memory per SM, and the dynamic shared memory the spread dependents (the epilogue, the
  // certified selection) may ask for: half of it plus a byte, 0 where the device cannot give that
  // to one CTA.
  int smem_per_sm = 0;
  int spread_smem_max = 0;
  // Resident CTAs per SM of the CTA-per-row epilogue for one split, the fewest of its output
  // types' instances.
  int epilogue_one_split_ctas_per_sm = 0;
};

// The dynamic shared memory for a programmatic dependent of `ctas` CTAs that need `needed` bytes
// each: enough that at most ceil(ctas / SMs) of them share an SM (a CTA taking more than 1 / (c +
// 1) of an SM's shared memory leaves room for at most c), up to kMaxSpreadCtasPerSm per SM;
// `needed` for larger grids, which fill every SM anyway.
int spread_smem_bytes(const DeviceInfo& info, int64_t ctas, int needed) {
  const int64_t ctas_per_sm = ceil_div(ctas, int64_t{info.sms});
  if (info.spread_smem_max == 0 || ctas_per_sm > kMaxSpreadCtasPerSm) return needed;
  return std::max(needed, info.smem_per_sm / static_cast<int>(ctas_per_sm + 1) + 1);
}

#ifndef FPG_WITH_SM90A
#define FPG_WITH_SM90A 0
#endif

// FUSED_POOL_GELU_CERTIFIED: unset (or empty), the certified path serves the batches where it is
// faster (use_certified); "1", every batch it applies to (tests); "0", none (the 3xTF32 GEMM, for
// tests and comparisons). Read at each call, like the switch below.
enum class CertifiedMode { kAuto, kAlways, kNever };
CertifiedMode certified_mode() {
  const char* value = std::getenv("FUSED_POOL_GELU_CERTIFIED");
  if (value == nullptr || std::strcmp(value, "") == 0) return CertifiedMode::kAuto;
  return std::strcmp(value, "0") == 0 ? CertifiedMode::kNever : CertifiedMode::kAlways;
}

// FUSED_POOL_GELU_FORCE_MMA_SYNC=1 runs the portable mma.sync GEMM on Hopper too (tests of that
// path on an H200, debugging). Read at each call, so a test can flip it in-process.
bool force_mma_sync() {
  const char* value = std::getenv("FUSED_POOL_GELU_FORCE_MMA_SYNC");
  return value != nullptr && std::strcmp(value, "") != 0 && std::strcmp(value, "0") != 0;
}

const DeviceInfo& device_info(int device) {
  static std::mutex mutex;
  static std::vector<std::unique_ptr<DeviceInfo>> cache;
  std::lock_guard<std::mutex> lock(mutex);
  if (static_cast<int>(cache.size()) <= device) cache.resize(device + 1);
  if (!cache[device]) {
    auto info = std::make_unique<DeviceInfo>();
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&info->sms, cudaDevAttrMultiProcessorCount, device));
    int max_smem_optin = 0;
    C10_CUDA_CHECK(
        cudaDeviceGetAttribute(&max_smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    for_each_value<kRowwiseBatches>([&](auto batch) {
      constexpr int kBatch = decltype(batch)::value;
      constexpr int kSmem = fg::rowwise_smem_bytes(kBatch);
      TORCH_CHECK(kSmem <= max_smem_optin, "fused_pool_gelu.forward: the row-parallel GEMV needs ",
                  kSmem, " bytes of shared memory per block, the device offers ", max_smem_optin);
      set_max_dynamic_smem(fg::rowwise_gemv_kernel<kBatch>, kSmem);
    });
    for (int i = 0; i < kNumSimtBatchTiles; ++i) {
      dispatch_value<kSimtBatchTiles>(i, [&](auto tile) {
        constexpr int kTile = decltype(tile)::value;
        constexpr int kSmem = fg::simt_smem_bytes<kTile>();
        TORCH_CHECK(kSmem <= max_smem_optin, "fused_pool_gelu.forward: the GEMV kernel needs ",
                    kSmem, " bytes of shared memory per block, the device offers ",
                    max_smem_optin);
        set_max_dynamic_smem(fg::simt_splitk_kernel<kTile>, kSmem);
        info->simt_ctas_per_sm[i] =
            resident_ctas_per_sm(fg::simt_splitk_kernel<kTile>, fg::kSimtThreads, kSmem);
        TORCH_CHECK(info->simt_ctas_per_sm[i] >= 1,
                    "fused_pool_gelu.forward: the GEMV kernel cannot run on device ", device);
      });
    }
    if (fg::kTcGemvSmemBytes <= max_smem_optin) {
      set_max_dynamic_smem(fg::tf32x3_gemv_splitk_kernel, fg::kTcGemvSmemBytes);
      info->tc_gemv_ctas_per_sm = resident_ctas_per_sm(fg::tf32x3_gemv_splitk_kernel,
                                                       fg::kTcGemvThreads, fg::kTcGemvSmemBytes);
    }
    if (fg::kTcSmemBytes <= max_smem_optin) {
      set_max_dynamic_smem(fg::tf32x3_splitk_kernel, fg::kTcSmemBytes);
      info->tc_ctas_per_sm =
          resident_ctas_per_sm(fg::tf32x3_splitk_kernel, fg::kTcThreads, fg::kTcSmemBytes);
    }
    info->epilogue_one_split_ctas_per_sm = std::numeric_limits<int>::max();
    for_each_row_epilogue<kEpilogueThreads, 1, 1>([&](auto kernel) {  // the output types' instances
      info->epilogue_one_split_ctas_per_sm = std::min(
          info->epilogue_one_split_ctas_per_sm, resident_ctas_per_sm(kernel, kEpilogueThreads, 0));
    });
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&info->smem_per_sm,
                                          cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
    if (info->smem_per_sm / 2 + 1 <= max_smem_optin) {
      info->spread_smem_max = info->smem_per_sm / 2 + 1;
      auto allow_spread = [&](auto kernel) { set_max_dynamic_smem(kernel, info->spread_smem_max); };
      for_each_row_epilogue<kEpilogueThreads, kEpilogueMaxSplitBound>(allow_spread);
      for_each_row_epilogue<kEpilogueWideRowThreads, kEpilogueWideRowMaxSplitBound, 1>(
          allow_spread);
      certified::for_each_select_kernel(allow_spread);
    }
    int major = 0, minor = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    info->dependent_launch =
        dependent_launch_enabled<argmax_epilogue_kernel<kEpilogueThreads, 1, float>>(device);
    if (FPG_WITH_SM90A && major == 9 && minor == 0 &&
        std::max(fg::kWgSmemBytes, fg::Pass1Tiles::kMaxSmemBytes) <= max_smem_optin) {
      cudaFuncAttributes attributes{};
      C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, fg::tf32x3_wgmma_splitk_kernel));
      if (attributes.binaryVersion == 90) {
        set_max_dynamic_smem(fg::tf32x3_wgmma_splitk_kernel, fg::kWgSmemBytes);
        fg::Pass1Tiles::for_each([](auto tile) {
          using Tile = decltype(tile);
          set_max_dynamic_smem(fg::certified_pass1_kernel<Tile::kM, Tile::kN>, Tile::kSmemBytes);
        });
        info->wgmma_ctas_per_sm = resident_ctas_per_sm(fg::tf32x3_wgmma_splitk_kernel,
                                                       fg::kWgThreads, fg::kWgSmemBytes);
      }
    }
    cache[device] = std::move(info);
  }
  return *cache[device];
}

// An fp32 operand the GEMM kernels can read directly (see the contract in forward_gemm.cuh).
struct Operand {
  at::Tensor storage;  // keeps a copy alive
  const float* data;
  int64_t ld;
};

bool has_kernel_layout(const at::Tensor& t) {
  const int64_t rows = t.size(0);
  const int64_t cols = t.size(1);
  if (t.scalar_type() != at::kFloat || cols % 4 != 0) return false;
  if (cols > 1 && t.stride(1) != 1) return false;
  if (rows > 1 && t.stride(0) % 4 != 0) return false;
  return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
}

// A float32 copy is made once here for a float16 / bfloat16 tensor (prepare_weight takes any
// floating weight; the forward's half operands go to cuBLAS instead), other strides, K not a
// multiple of 4 and misaligned data: contiguous, with K zero-padded to a multiple of 4 (zeros do
// not change the dot products).
Operand as_kernel_operand(const at::Tensor& t, int64_t k_padded) {
  if (has_kernel_layout(t)) {
    return Operand{t, t.const_data_ptr<float>(), t.size(0) > 1 ? t.stride(0) : k_padded};
  }
  const int64_t k = t.size(1);
  at::Tensor buffer = at::empty({t.size(0), k_padded}, t.options().dtype(at::kFloat));
  buffer.narrow(1, 0, k).copy_(t);
  if (k_padded > k) buffer.narrow(1, k, k_padded - k).zero_();
  return Operand{buffer, buffer.const_data_ptr<float>(), k_padded};
}

// The GEMVs' split of K: about target_ctas CTAs for `tiles` output tiles (one wave of resident
// CTAs, all weight loads in flight at once), each split a whole number of `granularity` floats.
struct SplitK {
  int64_t splits;
  int64_t k_per_split;
};

SplitK one_wave_split_k(int64_t target_ctas, int64_t tiles, int64_t k_padded, int64_t granularity,
                        int64_t split_cap) {
  const int64_t max_splits = ceil_div(k_padded, granularity);
  const int64_t splits = std::clamp<int64_t>(target_ctas / tiles, 1,
                                             std::min({max_splits, kMaxGridYZ, split_cap}));
  SplitK plan{};
  plan.k_per_split = ceil_div(ceil_div(k_padded, splits), granularity) * granularity;
  // Recounting after the rounding up leaves no empty split.
  plan.splits = ceil_div(k_padded, plan.k_per_split);
  return plan;
}

// Split-K plan of the SIMT GEMV.
struct SimtPlan {
  int tile_index;  // into kSimtBatchTiles
  int batch_tile;
  SplitK split_k;
};

SimtPlan plan_simt(const DeviceInfo& info, int64_t batch, int64_t n, int64_t k_padded,
                   int64_t split_cap) {
  SimtPlan plan{};
  plan.tile_index = smallest_at_or_above<kSimtBatchTiles>(batch);
  plan.batch_tile = kSimtBatchTiles[plan.tile_index];
  const int64_t n_tiles = ceil_div(n, int64_t{fg::kSimtRowsPerCta});
  const int64_t b_tiles = ceil_div(batch, int64_t{plan.batch_tile});
  const int64_t target_ctas = static_cast<int64_t>(info.sms) *
                              std::min(info.simt_ctas_per_sm[plan.tile_index], kSimtMaxCtasPerSm);
  plan.split_k = one_wave_split_k(target_ctas, n_tiles * b_tiles, k_padded, fg::kSimtChunkK,
                                  split_cap);
  return plan;
}

// Split-K plan of the tensor-core GEMV.
SplitK plan_tc_gemv(const DeviceInfo& info, int64_t batch, int64_t n, int64_t k_padded,
                    int64_t split_cap) {
  const int64_t n_tiles = ceil_div(n, int64_t{fg::kTcGemvRowsPerCta});
  const int64_t b_tiles = ceil_div(batch, int64_t{fg::kTcGemvBatchTile});
  const int64_t target_ctas = static_cast<int64_t>(info.sms) * info.tc_gemv_ctas_per_sm;
  return one_wave_split_k(target_ctas, n_tiles * b_tiles, k_padded, fg::kTcGemvSplitK, split_cap);
}

// Split-K plan of the 3xTF32 GEMM (both kernels use the same 128 x 128 x 32 tiles).
struct TcPlan {
  bool wgmma;
  int64_t splits;
  int64_t k_per_split;
};

// K tiles per split for `tiles` output tiles of k_tiles K tiles each on `slots` resident CTAs:
// the split count s minimizes waves(tiles x s) x ceil(k_tiles / s) (see kTcMaxSplits), each split
// at least min_k_tiles long.
int64_t plan_k_tiles_per_split(int64_t tiles, int64_t k_tiles, int64_t slots, int64_t split_cap,
                               int64_t min_k_tiles) {
  const int64_t max_splits = std::max<int64_t>(
      1, std::min({kTcMaxSplits, k_tiles / min_k_tiles, split_cap}));
  int64_t best_cost = std::numeric_limits<int64_t>::max();
  int64_t best_k_tiles_per_split = k_tiles;
  for (int64_t s = 1; s <= max_splits; ++s) {
    const int64_t per_split = ceil_div(k_tiles, s);
    const int64_t used_splits = ceil_div(k_tiles, per_split);
    if (used_splits > 1 && tiles * used_splits > kTcMaxSplitWaves * slots) break;
    const int64_t cost = ceil_div(tiles * used_splits, slots) * per_split;
    if (cost < best_cost) {
      best_cost = cost;
      best_k_tiles_per_split = per_split;
    }
  }
  return best_k_tiles_per_split;
}

// Output tiles of the tensor-core GEMMs (both 128 x 128) over `rows` x `n`.
int64_t tc_tiles(int64_t rows, int64_t n) {
  return ceil_div(rows, int64_t{fg::kTcBlockM}) * ceil_div(n, int64_t{fg::kTcBlockN});
}

// Whether the tensor-core GEMM is the wgmma one here (else mma.sync).
bool wgmma_serves(const DeviceInfo& info) {
  return info.wgmma_ctas_per_sm > 0 && !force_mma_sync();
}

TcPlan plan_tc(const DeviceInfo& info, int64_t batch, int64_t n, int64_t k_padded,
               int64_t split_cap) {
  static_assert(fg::kWgBlockM == fg::kTcBlockM && fg::kWgBlockN == fg::kTcBlockN &&
                    fg::kWgBlockK == fg::kTcBlockK,
                "one split-K plan for both tensor-core kernels");
  const bool wgmma = wgmma_serves(info);
  const int64_t tiles = tc_tiles(batch, n);
  const int64_t k_tiles = ceil_div(k_padded, int64_t{fg::kTcBlockK});
  const int64_t slots = static_cast<int64_t>(info.sms) *
                        (wgmma ? info.wgmma_ctas_per_sm : info.tc_ctas_per_sm);
  TcPlan plan{};
  plan.wgmma = wgmma;
  plan.k_per_split = plan_k_tiles_per_split(tiles, k_tiles, slots, split_cap, 1) * fg::kTcBlockK;
  plan.splits = ceil_div(k_padded, plan.k_per_split);
  return plan;
}

// The GEMM launch over x rows [row0, row0 + rows_per_launch) (clipped to the batch): grid limits
// split very large batches into several launches writing the same workspace.
fg::GemmParams gemm_params(const Operand& x, const Operand& w, float* partial, int64_t batch,
                           int64_t n, int64_t k_padded, int64_t k_per_split, int64_t row0,
                           int64_t rows_per_launch) {
  fg::GemmParams p{};
  p.x = x.data + row0 * x.ld;
  p.ldx = x.ld;
  p.w = w.data;
  p.ldw = w.ld;
  p.partial = partial + row0 * n;
  p.split_stride = batch * n;
  p.rows = std::min(rows_per_launch, batch - row0);
  p.n = n;
  p.k = k_padded;
  p.k_per_split = k_per_split;
  return p;
}

void launch_simt(const SimtPlan& plan, const Operand& x, const Operand& w, float* partial,
                 int64_t batch, int64_t n, int64_t k_padded, cudaStream_t stream) {
  const unsigned n_tiles = grid_blocks(n, fg::kSimtRowsPerCta, "weight rows");
  // Batch tiles go on grid z (at most 65535): larger batches (only on devices without the
  // tensor-core kernel) are launched in slices of rows.
  const int64_t rows_per_launch = kMaxGridYZ * plan.batch_tile;
  dispatch_value<kSimtBatchTiles>(plan.tile_index, [&](auto tile) {
    constexpr int kTile = decltype(tile)::value;
    for (int64_t row0 = 0; row0 < batch; row0 += rows_per_launch) {
      const fg::GemmParams p = gemm_params(x, w, partial, batch, n, k_padded,
                                           plan.split_k.k_per_split, row0, rows_per_launch);
      const dim3 grid(n_tiles, static_cast<unsigned>(plan.split_k.splits),
                      static_cast<unsigned>(ceil_div(p.rows, int64_t{kTile})));
      fg::simt_splitk_kernel<kTile>
          <<<grid, fg::kSimtThreads, fg::simt_smem_bytes<kTile>(), stream>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
}

void launch_tc_gemv(const SplitK& plan, const Operand& x, const Operand& w, float* partial,
                    int64_t batch, int64_t n, int64_t k_padded, cudaStream_t stream) {
  const unsigned n_tiles = grid_blocks(n, fg::kTcGemvRowsPerCta, "weight rows");
  const fg::GemmParams p =
      gemm_params(x, w, partial, batch, n, k_padded, plan.k_per_split, 0, batch);
  const dim3 grid(n_tiles, static_cast<unsigned>(plan.splits),
                  static_cast<unsigned>(ceil_div(batch, int64_t{fg::kTcGemvBatchTile})));
  fg::tf32x3_gemv_splitk_kernel<<<grid, fg::kTcGemvThreads, fg::kTcGemvSmemBytes, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Whether a grid of `ctas` CTAs keeps at least kMinBusySmPercent of the SMs busy.
bool keeps_sms_busy(const DeviceInfo& info, int64_t ctas) {
  return 100 * ctas >= kMinBusySmPercent * info.sms;
}

bool use_rowwise(const DeviceInfo& info, int64_t batch, int64_t n) {
  const int64_t ctas = ceil_div(n, int64_t{fg::kRowwiseRows});
  return batch <= fg::kRowwiseMaxBatch && keeps_sms_busy(info, ctas);
}

void launch_rowwise(const Operand& x, const Operand& w, float* dot_products, int64_t batch,
                    int64_t n, int64_t k_padded, cudaStream_t stream) {
  const unsigned ctas = grid_blocks(n, fg::kRowwiseRows, "weight rows");
  const fg::GemmParams p = gemm_params(x, w, dot_products, batch, n, k_padded, k_padded, 0, batch);
  TORCH_CHECK(batch <= fg::kRowwiseMaxBatch,
              "fused_pool_gelu.forward: internal error: no row-parallel GEMV for ", batch, " rows");
  dispatch_value<kRowwiseBatches>(smallest_at_or_above<kRowwiseBatches>(batch), [&](auto rows) {
    constexpr int kBatch = decltype(rows)::value;
    fg::rowwise_gemv_kernel<kBatch><<<ctas, fg::kRowwiseThreads,
                                      fg::rowwise_smem_bytes(kBatch), stream>>>(p);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void launch_tc(const TcPlan& plan, const Operand& x, const Operand& w, float* partial,
               int64_t batch, int64_t n, int64_t k_padded, cudaStream_t stream) {
  const unsigned n_tiles = grid_blocks(n, fg::kTcBlockN, "weight rows");
  TORCH_CHECK(plan.splits <= kMaxGridYZ, "fused_pool_gelu.forward: internal error: ", plan.splits,
              " splits");
  // Row tiles go on grid y (at most 65535). A workspace slice holds at most kMaxWorkspaceFloats
  // partial sums, at least one per row, so its row tiles always fit there: one launch.
  static_assert(kMaxWorkspaceFloats <= kMaxGridYZ * fg::kTcBlockM, "slice row tiles fit grid y");
  TORCH_CHECK(batch <= kMaxGridYZ * fg::kTcBlockM, "fused_pool_gelu.forward: internal error: ",
              batch, " rows in one tensor-core launch");
  const fg::GemmParams p =
      gemm_params(x, w, partial, batch, n, k_padded, plan.k_per_split, 0, batch);
  // n tiles fastest: the CTAs running together share x row tiles, and the weight (N x K, the
  // smaller operand at large B) stays in L2 while the batch is swept.
  const dim3 grid(n_tiles,
                  static_cast<unsigned>(ceil_div(batch, int64_t{fg::kTcBlockM})),
                  static_cast<unsigned>(plan.splits));
  if (plan.wgmma) {
    fg::tf32x3_wgmma_splitk_kernel<<<grid, fg::kWgThreads, fg::kWgSmemBytes, stream>>>(p);
  } else {
    fg::tf32x3_splitk_kernel<<<grid, fg::kTcThreads, fg::kTcSmemBytes, stream>>>(p);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The half path's slices of K for a GEMM of `rows` rows (kHalfGemmMaxSplits' rule); 1 where x or
// the weight is not row-major with unit column stride (views of them would not be cuBLAS's
// operands without a copy), or where N % 4 != 0 (the epilogue would sum the slices a CTA per row,
// not a warp per row in 16-byte loads).
int64_t half_gemm_splits(const DeviceInfo& info, const at::Tensor& x, const at::Tensor& weight,
                         int64_t rows, int64_t n, int64_t k) {
  if (rows < kHalfGemmSplitMinBatch || n % 4 != 0 || x.stride(1) != 1 || weight.stride(1) != 1) {
    return 1;
  }
  const int64_t tiles = ceil_div(rows, kHalfGemmTile) * ceil_div(n, kHalfGemmTile);
  int64_t splits = 1;
  // The workspace's bound also keeps the epilogue's split offsets in an int; within the SMs'
  // tiles it does not bind (splits x rows x n <= SMs x 128 x 128).
  while (2 * splits <= kHalfGemmMaxSplits && 2 * splits * tiles <= info.sms &&
         k >= 2 * splits * kHalfGemmMinSliceK && k % (2 * splits * kHalfGemmSliceAlign) == 0 &&
         2 * splits * rows * n <= kMaxWorkspaceFloats) {
    splits *= 2;
  }
  return splits;
}

// Rows per slice (see kMaxWorkspaceFloats): all of them when one split of the whole batch fits,
// else as many as fit, in whole 128-row tensor-core tiles where that leaves at least one.
int64_t rows_per_slice(int64_t batch, int64_t n) {
  if (batch * n <= kMaxWorkspaceFloats) return batch;
  const int64_t rows = std::max<int64_t>(1, kMaxWorkspaceFloats / n);
  return rows >= fg::kTcBlockM ? rows / fg::kTcBlockM * fg::kTcBlockM : rows;
}

// The tensor-core GEMV's plan for a slice of `rows` rows where that GEMV runs it (see
// kSimtMaxBatchWgmma), else nothing.
std::optional<SplitK> tc_gemv_plan(const DeviceInfo& info, int64_t rows, int64_t n,
                                   int64_t k_padded, int64_t split_cap) {
  if (rows <= kSimtMaxBatchWgmma || rows > kSimtMaxBatch || info.tc_gemv_ctas_per_sm == 0 ||
      n * k_padded <= kTcSmallBatchMinWeightFloats) {
    return std::nullopt;
  }
  const SplitK plan = plan_tc_gemv(info, rows, n, k_padded, split_cap);
  if (!keeps_sms_busy(info, ceil_div(n, int64_t{fg::kTcGemvRowsPerCta}) * plan.splits)) {
    return std::nullopt;
  }
  return plan;
}

// The tensor-core GEMM's plan for a slice of `rows` rows that the tensor-core GEMV does not run,
// where that GEMM rather than the SIMT GEMV serves it (see kSimtMaxBatch and kSimtMaxBatchWgmma),
// else nothing.
std::optional<TcPlan> tc_gemm_plan(const DeviceInfo& info, int64_t rows, int64_t n,
                                   int64_t k_padded, int64_t split_cap) {
  // Past this check the device runs the tensor-core GEMM (tc_ctas_per_sm > 0), so plan_tc's slots
  // are not 0.
  if (rows <= kSimtMaxBatchWgmma || info.tc_ctas_per_sm == 0) return std::nullopt;
  const TcPlan plan = plan_tc(info, rows, n, k_padded, split_cap);
  if (rows > kSimtMaxBatch) return plan;
  if (!wgmma_serves(info) || n * k_padded <= kTcSmallBatchMinWeightFloats ||
      !keeps_sms_busy(info, tc_tiles(rows, n) * plan.splits)) {
    return std::nullopt;
  }
  return plan;
}

// Which GEMM runs a slice of `rows` rows, and its split-K plan (at most split_cap splits).
struct GemmPlan {
  enum class Kind { kRowwise, kSimt, kTcGemv, kTc } kind;
  SimtPlan simt;
  SplitK tc_gemv;
  TcPlan tc;
  int64_t splits;
};

GemmPlan plan_gemm(const DeviceInfo& info, bool rowwise, int64_t rows, int64_t n,
                   int64_t k_padded, int64_t split_cap) {
  GemmPlan plan{};
  if (rowwise) {
    plan.kind = GemmPlan::Kind::kRowwise;
    plan.splits = 1;
  } else if (const std::optional<SplitK> tc_gemv =
                 tc_gemv_plan(info, rows, n, k_padded, split_cap)) {
    plan.kind = GemmPlan::Kind::kTcGemv;
    plan.tc_gemv = *tc_gemv;
    plan.splits = tc_gemv->splits;
  } else if (const std::optional<TcPlan> tc = tc_gemm_plan(info, rows, n, k_padded, split_cap)) {
    plan.kind = GemmPlan::Kind::kTc;
    plan.tc = *tc;
    plan.splits = tc->splits;
  } else {
    plan.kind = GemmPlan::Kind::kSimt;
    plan.simt = plan_simt(info, rows, n, k_padded, split_cap);
    plan.splits = plan.simt.split_k.splits;
  }
  return plan;
}

void launch_gemm(const GemmPlan& plan, const Operand& x, const Operand& w, float* partial,
                 int64_t rows, int64_t n, int64_t k_padded, cudaStream_t stream) {
  switch (plan.kind) {
    case GemmPlan::Kind::kRowwise: launch_rowwise(x, w, partial, rows, n, k_padded, stream); break;
    case GemmPlan::Kind::kSimt:
      launch_simt(plan.simt, x, w, partial, rows, n, k_padded, stream);
      break;
    case GemmPlan::Kind::kTcGemv:
      launch_tc_gemv(plan.tc_gemv, x, w, partial, rows, n, k_padded, stream);
      break;
    case GemmPlan::Kind::kTc: launch_tc(plan.tc, x, w, partial, rows, n, k_padded, stream); break;
  }
}

// The smallest float at or above v (the bound's constants are computed in double).
float round_up_to_float(double v) {
  const float f = static_cast<float>(v);
  return static_cast<double>(f) >= v ? f : std::nextafter(f, INFINITY);
}

// gamma_m(u) = m u / (1 - m u): how far m roundings of unit roundoff u can move a result.
double gamma(double terms, double u) { return terms * u / (1.0 - terms * u); }

// A norm bound's constants (forward_certified.cuh's top) for sums of squares of k_padded terms at
// most `depth` roundings deep: the floor K 2^-148 for the terms lost below the normal range, and
// the slack 1 + gamma_depth(2^-24) + 2^-22, both rounded up.
void norm_constants(int64_t k_padded, double depth, float& squares_floor, float& norm_slack) {
  squares_floor = round_up_to_float(static_cast<double>(k_padded) * kNormSquaresFloorPerTerm);
  norm_slack = round_up_to_float(1.0 + gamma(depth, 0x1p-24) + 0x1p-22);
}

// The bound's constants (forward_certified.cuh's top, steps 1-6), computed in double and rounded
// up.
// chain_products: products a tensor-core accumulation chain sums before pass 1 adds it into
// float32 registers (a whole split when it never flushes).
certified::Bound certified_bound(int64_t k_padded, int64_t splits, int64_t chain_products) {
  const double k = static_cast<double>(k_padded);
  const double s = static_cast<double>(splits);
  const double chain = static_cast<double>(chain_products);
  const auto up = round_up_to_float;
  const double depth = static_cast<double>(certified::reduction_depth(k_padded / 4));
  const double squares_depth = std::max(k + s, depth);
  const double g_sum = gamma(std::ceil(k / chain) + s + 2, 0x1p-24);
  // The accumulation model counts k8 steps; an fp16 wgmma's k16 step is two of them.
  const double g_tc = gamma(std::ceil(chain / 8.0), 10.0 * 0x1p-23);
  const double g = g_tc * (1.0 + g_sum) + g_sum;
  // The selection's float32 sum of the bfloat16 partials and the bias (step 6).
  const double g_stored = gamma(s + 1, 0x1p-24);
  certified::Bound b{};
  b.operand = up(1.0 + g);
  b.accumulation = up(g);
  b.bias = up(g_sum + g_stored);
  b.storage = up(0x1p-8 + g_stored);
  b.absolute = up((1.0 + g) * s * 0x1p-149 + s * 0x1p-134);
  // x's norms: pass 1's per-split sums, then the selection's sum over the splits.
  norm_constants(k_padded, squares_depth, b.squares_floor, b.norm_slack);
  b.rescore = up(gamma(depth, 0x1p-24));
  return b;
}

// Whether the certified path serves `batch` rows with 128-wide pass-1 tiles split up to
// kFusedMaxSplits ways and one CTA per row that selects and rescores it (select_rescore_kernel):
// where the rows fit on the SMs at once. Larger batches take 256-wide tiles, at most
// certified::kMaxSplits splits, and the selection and rescoring kernels (the rescoring in heavy-
// rows-first order over several waves).
bool certified_fused_rows(const DeviceInfo& info, int64_t batch) { return batch <= info.sms; }

// Where the certified path can run: the wgmma kernels available, float32, a batch the pass-1 grid
// serves in one launch and one workspace slice, N <= kMaxSelectColumns (the selection's shared
// memory), a finite non-zero scale, and 0 < K <= kCertifiedMaxInFeatures.
// K's limit keeps the bound's gamma terms far below 1.
constexpr int64_t kCertifiedMaxInFeatures = int64_t{1} << 20;
bool certified_applies(const DeviceInfo& info, const at::Tensor& x, const at::Tensor& weight,
                       int64_t batch, int64_t n, int64_t k_padded, double scale) {
  return info.wgmma_ctas_per_sm > 0 && !force_mma_sync() && x.scalar_type() == at::kFloat &&
         weight.scalar_type() == at::kFloat && batch > kSimtMaxBatch &&
         batch <= kMaxGridYZ * fg::kPass1BlockM && n <= certified::kMaxSelectColumns &&
         rows_per_slice(batch, n) == batch && k_padded > 0 &&
         k_padded <= kCertifiedMaxInFeatures &&
         std::isfinite(scale) && scale != 0.0;
}

bool use_certified(const DeviceInfo& info, const at::Tensor& x, const at::Tensor& weight,
                   bool prepared, int64_t batch, int64_t n, int64_t k_padded, double scale) {
  const CertifiedMode mode = certified_mode();
  const int64_t min_batch = prepared ? kCertifiedPreparedMinBatch : kCertifiedMinBatch;
  // B x N x K compared as N x K against the work over B: the product may not fit in 64 bits.
  const int64_t weight_floats = n * k_padded;
  const bool fused_rows_pay = prepared && batch >= kCertifiedFusedMinBatch &&
                              certified_fused_rows(info, batch) && n >= kCertifiedMinColumns &&
                              weight_floats >= kCertifiedFusedMinWeightFloats;
  const bool pays =
      fused_rows_pay ||
      (batch >= min_batch &&
       ((n >= kCertifiedMinColumns && weight_floats >= kCertifiedMinWeightFloats) ||
        (n >= kCertifiedLargeWorkMinColumns &&
         weight_floats >= kCertifiedLargeWorkMinWeightFloats &&
         weight_floats >= ceil_div(kCertifiedMinWork, batch))));
  return mode != CertifiedMode::kNever && (mode == CertifiedMode::kAlways || pays) &&
         certified_applies(info, x, weight, batch, n, k_padded, scale);
}

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
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000,
                                                    cudaEnableDefault, &found));
    TORCH_CHECK(found == cudaDriverEntryPointSuccess && function != nullptr,
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
  TORCH_CHECK(result == CUDA_SUCCESS, "fused_pool_gelu.forward: cuTensorMapEncodeTiled failed (",
              static_cast<int>(result), ")");
  return map;
}

// The selection's result, as ints at the end of the call's float workspace: [batch] candidate
// counts (-1: every column), [batch, kMaxCandidates] candidate columns, then the rescoring's order
// ([batch] rows, [batch] counts, its 2 ends).
struct Selection {
  at::Tensor workspace;
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

// Calls f(std::integral_constant<int, bound>) with the smallest power of two bound at or above
// splits, kMaxBound for anything above it: the kernels that sum split partials with all their
// loads at once (sum_few_splits, load_split_partials) are compiled for these bounds (the certified
// selection, forward_certified.cuh, up to certified::kMaxSplits and its fused select_rescore_kernel
// up to certified::kFusedMaxSplits; the epilogue up to kEpilogueMaxSplitBound).
template <int kMaxBound, int kBound = 1, typename F>
void dispatch_split_bound(int64_t splits, F&& f) {
  static_assert(kMaxBound > 0 && (kMaxBound & (kMaxBound - 1)) == 0, "a power of two");
  if constexpr (kBound >= kMaxBound) {
    f(std::integral_constant<int, kMaxBound>{});
  } else if (splits <= kBound) {
    f(std::integral_constant<int, kBound>{});
  } else {
    dispatch_split_bound<kMaxBound, 2 * kBound>(splits, f);
  }
}

// Writes the prepared weight of w's n rows (prepared_bytes(n, k_padded) bytes at `prepared`,
// 16-byte aligned).
void launch_prepare(const Operand& w, int64_t n, int64_t k_padded, uint8_t* prepared,
                    cudaStream_t stream) {
  if (n == 0) return;
  TORCH_CHECK(n <= kMaxGridX, "fused_pool_gelu.prepare_weight: weight must have at most ",
              kMaxGridX, " rows, got ", n);
  certified::PrepareParams params{};
  params.w = w.data;
  params.ldw = w.ld;
  params.k4 = k_padded / 4;
  params.copy_halves = prepared_copy_halves(k_padded);
  params.copy = reinterpret_cast<__half*>(prepared);
  params.trailers = reinterpret_cast<float4*>(prepared + prepared_copy_bytes(n, k_padded));
  // The weight's norms: one reduction per row (reduction_depth), whatever pass 1's splits.
  norm_constants(k_padded, static_cast<double>(certified::reduction_depth(k_padded / 4)),
                 params.squares_floor, params.norm_slack);
  const dim3 grid(static_cast<unsigned>(n));
  if (params.k4 <= int64_t{certified::kThreads} * certified::kPrepareCachedPieces) {
    certified::prepare_rows_kernel<true><<<grid, certified::kThreads, 0, stream>>>(params);
  } else {
    certified::prepare_rows_kernel<false><<<grid, certified::kThreads, 0, stream>>>(params);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

struct CertifiedOutputs {
  float* out;
  int64_t* argmax;
  float* preactivation;
};

// The selection and the rescoring after pass 1: select_rescore_kernel where `fused`, else
// select_candidates_kernel and rescore_kernel.
void launch_selection_and_rescoring(const Operand& x, const Operand& w, const float* bias,
                                    float scale, int64_t batch, int64_t n, int64_t k_padded,
                                    const Selection& selection, const CertifiedOutputs& outputs,
                                    bool fused, const certified::SelectParams& select,
                                    const DeviceInfo& info, cudaStream_t stream) {
  certified::RescoreParams rescore{};
  rescore.x = x.data;
  rescore.ldx = x.ld;
  rescore.w = w.data;
  rescore.ldw = w.ld;
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
                                info.dependent_launch);
    // Spread like the selection: as pass 1's dependent its CTAs would otherwise pile onto the
    // few SMs pass 1 leaves free (the 256-thread form at B = 128: 13.3 -> 12.9 us own).
    config.dynamicSmemBytes = spread_smem_bytes(info, batch, certified::select_smem_bytes(n));
    dispatch_split_bound<certified::kFusedMaxSplits>(select.splits, [&](auto split_bound) {
      C10_CUDA_CHECK(cudaLaunchKernelEx(
          &config, certified::select_rescore_kernel<decltype(split_bound)::value>, select,
          rescore, outputs.out, outputs.argmax, outputs.preactivation));
    });
    return;
  }
  cudaLaunchConfig_t select_config =
      dependent_launch_config(batch, certified::kSelectThreads, stream, attribute,
                              info.dependent_launch);
  select_config.dynamicSmemBytes = spread_smem_bytes(info, batch, certified::select_smem_bytes(n));
  const int columns_per_thread = certified::select_columns_per_thread(batch, n, info.sms);
  dispatch_split_bound<certified::kMaxSplits>(select.splits, [&](auto split_bound) {
    constexpr int kSplitBound = decltype(split_bound)::value;
    C10_CUDA_CHECK(cudaLaunchKernelEx(
        &select_config,
        columns_per_thread == 1 ? certified::select_candidates_kernel<kSplitBound, 1>
                                : certified::select_candidates_kernel<kSplitBound, 4>,
        select));
  });
  cudaLaunchAttribute rescore_attribute{};
  const cudaLaunchConfig_t config =
      dependent_launch_config(batch, certified::kThreads, stream, rescore_attribute,
                              info.dependent_launch);
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, certified::rescore_kernel, rescore,
                                    outputs.out, outputs.argmax, outputs.preactivation));
}

// Pass 1 on block_m x block_n tiles (one of fg::Pass1Tiles), with `config`'s grid.
void launch_pass1(int64_t block_m, int64_t block_n, cudaLaunchConfig_t config,
                  const fg::GemmParams& gemm, const fg::TmaMaps& maps) {
  bool launched = false;
  fg::Pass1Tiles::for_each([&](auto tile) {
    using Tile = decltype(tile);
    if (block_m != Tile::kM || block_n != Tile::kN) return;
    config.dynamicSmemBytes = Tile::kSmemBytes;
    C10_CUDA_CHECK(
        cudaLaunchKernelEx(&config, fg::certified_pass1_kernel<Tile::kM, Tile::kN>, gemm, maps));
    launched = true;
  });
  TORCH_CHECK(launched, "fused_pool_gelu.forward: internal error: no pass-1 kernel for ", block_m,
              " x ", block_n, " tiles");
}

// The certified forward: the weight's prepared copy (prepared_weight.h; made here unless the
// caller passes one), pass 1 (single-pass fp16 wgmma), then the selection (which takes x's norms
// from pass 1's split sums) and the rescoring, fused per row or as two kernels
// (certified_fused_rows), each a programmatic dependent of the one before. Returns the selection's
// workspace (its counts: _certified_candidate_counts).
Selection certified_forward(const DeviceInfo& info, const Operand& x, const Operand& w,
                            const uint8_t* prepared, const float* bias, float scale, int64_t batch,
                            int64_t n, int64_t k_padded, const at::TensorOptions& options,
                            const CertifiedOutputs& outputs, cudaStream_t stream) {
  const bool fused = certified_fused_rows(info, batch);
  const int64_t block_m = fused && batch <= kPass1SmallTileMaxBatch ? 64 : 128;
  const int64_t block_n = fused ? 128 : 256;
  const int64_t max_splits = fused ? certified::kFusedMaxSplits : certified::kMaxSplits;
  const int64_t tiles = ceil_div(batch, block_m) * ceil_div(n, block_n);
  // One CTA per SM (the kernel's shared memory); the whole split is one tensor-core chain.
  const int64_t split_cap = std::min(max_splits, kMaxWorkspaceFloats / (batch * n));
  const int64_t k_per_split =
      plan_k_tiles_per_split(tiles, ceil_div(k_padded, int64_t{fg::kPass1BlockK}), info.sms,
                             split_cap,
                             fused ? kPass1FusedMinKTilesPerSplit : kPass1MinKTilesPerSplit) *
      fg::kPass1BlockK;
  const int64_t splits = ceil_div(k_padded, k_per_split);
  TORCH_CHECK(splits >= 1 && splits <= max_splits, "fused_pool_gelu.forward: internal error: ",
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
      at::empty({selection_offset + Selection::ints(batch)}, options.dtype(at::kFloat));
  selection.offset = selection_offset;
  selection.batch = batch;
  float* const workspace = selection.workspace.data_ptr<float>();
  __nv_bfloat16* const partial = reinterpret_cast<__nv_bfloat16*>(workspace);
  const certified::Bound bound = certified_bound(k_padded, splits, k_per_split);
  if (prepared == nullptr) {
    uint8_t* const copy = reinterpret_cast<uint8_t*>(workspace + copy_offset);
    launch_prepare(w, n, k_padded, copy, stream);
    prepared = copy;
  }
  // Row n's trailer: 4 floats at trailers + 4 n.
  const float* const trailers =
      reinterpret_cast<const float*>(prepared + prepared_copy_bytes(n, k_padded));

  fg::GemmParams gemm = gemm_params(x, w, nullptr, batch, n, k_padded, k_per_split, 0, batch);
  gemm.rounded_partial = partial;
  gemm.w_inverse_scale = trailers + kPreparedInverseScale;
  gemm.w_inverse_scale_stride = 4;
  gemm.x_sumsq = workspace + sums_offset;
  gemm.x_residual_sumsq = gemm.x_sumsq + splits * batch;
  gemm.x_scale_exponent = reinterpret_cast<int*>(gemm.x_residual_sumsq + splits * batch);
  gemm.zeroed_counters = selection.rescore_ends();
  // The copy's whole rows: its last block of 64 holds columns below k_padded at positions above
  // it (prepared_copy_group), and zeros for the rest; x's map zero-fills past k_padded.
  const fg::TmaMaps maps{tensor_map(x.data, x.ld, batch, k_padded, static_cast<int>(block_m)),
                         tensor_map(reinterpret_cast<const __half*>(prepared), copy_halves, n,
                                    copy_halves, static_cast<int>(block_n))};
  cudaLaunchAttribute pass1_attribute{};
  cudaLaunchConfig_t pass1_config =
      dependent_launch_config(1, fg::kWgThreads, stream, pass1_attribute, info.dependent_launch);
  pass1_config.gridDim = dim3(static_cast<unsigned>(ceil_div(n, block_n)),
                              static_cast<unsigned>(ceil_div(batch, block_m)),
                              static_cast<unsigned>(splits));
  launch_pass1(block_m, block_n, pass1_config, gemm, maps);

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
  launch_selection_and_rescoring(x, w, bias, scale, batch, n, k_padded, selection, outputs, fused,
                                 select, info, stream);
  return selection;
}

template <typename out_t>
void launch_epilogue(const EpilogueParams& p, at::Tensor& out, at::Tensor& argmax,
                     at::Tensor& preactivation, const DeviceInfo& info, bool slices_of_k,
                     bool dependent_launch, cudaStream_t stream) {
  auto launch = [&](auto threads_per_row, auto split_bound, auto columns_per_load) {
    constexpr int kThreadsPerRow = decltype(threads_per_row)::value;
    constexpr int kCtaThreads = epilogue_cta_threads(kThreadsPerRow);
    constexpr int kRowsPerCta = kCtaThreads / kThreadsPerRow;
    const int64_t blocks = grid_blocks(p.batch, kRowsPerCta, "rows of x");
    cudaLaunchAttribute attribute{};
    cudaLaunchConfig_t config =
        dependent_launch_config(blocks, kCtaThreads, stream, attribute, dependent_launch);
    if (dependent_launch && kRowsPerCta == 1) {
      config.dynamicSmemBytes = spread_smem_bytes(info, blocks, 0);
    }
    C10_CUDA_CHECK(cudaLaunchKernelEx(
        &config,
        argmax_epilogue_kernel<kThreadsPerRow, decltype(split_bound)::value, out_t,
                               decltype(columns_per_load)::value>,
        p,
        out.data_ptr<out_t>(), argmax.data_ptr<int64_t>(), preactivation.data_ptr<out_t>()));
  };
  constexpr std::integral_constant<int, 1> kScalarLoads{};
  // The split-K workspace (at most kMaxWorkspaceFloats) keeps sum_few_splits' offsets in an int.
  auto with_split_bound = [&](auto threads_per_row) {
    if (p.splits == 0 || p.splits > kEpilogueMaxSplitBound) {
      launch(threads_per_row, std::integral_constant<int, 0>{}, kScalarLoads);
    } else {
      dispatch_split_bound<kEpilogueMaxSplitBound>(
          p.splits, [&](auto split_bound) { launch(threads_per_row, split_bound, kScalarLoads); });
    }
  };
  // A row of one split, or of the half path's slices of K (slices_of_k), in 16-byte loads where
  // they stay aligned: N % 4 == 0 keeps every row's and every split's start at the workspace's
  // alignment, and the bias's own start must allow 4 columns at once.
  const bool vector_loads = (p.splits == 1 || (slices_of_k && p.splits >= 1 &&
                                               p.splits <= kEpilogueVectorMaxSplits)) &&
                            p.n % 4 == 0 && is_aligned(p.partial, 4 * sizeof(float)) &&
                            (p.bias == nullptr || is_aligned(p.bias, 4 * sizeof(out_t)));
  const int64_t one_wave_rows = int64_t{info.sms} * info.epilogue_one_split_ctas_per_sm;
  const int64_t warp_per_row_after = vector_loads ? one_wave_rows / 2 : one_wave_rows;
  if (p.batch >= kEpilogueWarpPerRowMinBatch ||
      ((p.splits == 1 || vector_loads) && p.n < kEpilogueWideRowMinColumns &&
       p.batch > warp_per_row_after)) {
    if (vector_loads) {
      dispatch_split_bound<kEpilogueVectorMaxSplits>(p.splits, [&](auto split_bound) {
        launch(std::integral_constant<int, 32>{}, split_bound, std::integral_constant<int, 4>{});
      });
    } else {
      with_split_bound(std::integral_constant<int, 32>{});
    }
  } else if (p.n >= kEpilogueWideRowMinColumns && p.splits >= 1 &&
             p.splits <= kEpilogueWideRowMaxSplitBound) {
    dispatch_split_bound<kEpilogueWideRowMaxSplitBound>(p.splits, [&](auto split_bound) {
      launch(std::integral_constant<int, kEpilogueWideRowThreads>{}, split_bound, kScalarLoads);
    });
  } else {
    with_split_bound(std::integral_constant<int, kEpilogueThreads>{});
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_with_argmax_cuda(
    const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
    double scale, const c10::optional<at::Tensor>& prepared_weight) {
  check_forward_inputs(x, weight, bias);
  check_cuda_floating_dtype("forward", "x", x);
  // Checked whichever path runs (only the certified one reads it): a stale one fails every call.
  if (prepared_weight.has_value()) check_prepared_weight("forward", *prepared_weight, weight);
  c10::cuda::CUDAGuard guard(x.device());

  const int64_t batch = x.size(0);
  const int64_t k = x.size(1);
  const int64_t n = weight.size(0);
  at::Tensor out = at::empty({batch}, x.options());
  at::Tensor argmax = at::empty({batch}, x.options().dtype(at::kLong));
  at::Tensor preactivation = at::empty({batch}, x.options());
  if (batch == 0) return {out, argmax, preactivation};

  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const DeviceInfo& info = device_info(x.get_device());

  // Contiguous, in x's dtype: the epilogue widens a half-type bias itself (a conversion kernel
  // before it cost 3.2 us per call on the H200), and the certified path takes float32 x only.
  at::Tensor bias_contiguous;
  if (bias.has_value()) bias_contiguous = bias->contiguous();
  // The epilogue reads the bias as its output type, x's: the same dtype (check_forward_inputs).
  TORCH_INTERNAL_ASSERT(!bias_contiguous.defined() ||
                        bias_contiguous.scalar_type() == x.scalar_type());

  // The GEMV kernel indexes inside a row with ints (fewer registers in its hot loop).
  TORCH_CHECK(k <= kMaxInFeatures, "fused_pool_gelu.forward: in_features must be at most ",
              kMaxInFeatures, ", got ", k);
  const int64_t k_padded = ceil_div(k, int64_t{4}) * 4;
  // K == 0 needs no GEMM and no workspace (z = bias): one slice.
  const bool half_gemm = k > 0 && is_reduced_float(x);  // x and weight have one dtype (checked)
  const Operand x_op = k > 0 && !half_gemm ? as_kernel_operand(x, k_padded) : Operand{};
  const Operand w_op = k > 0 && !half_gemm ? as_kernel_operand(weight, k_padded) : Operand{};
  if (k > 0 && !half_gemm &&
      use_certified(info, x, weight, prepared_weight.has_value(), batch, n, k_padded, scale)) {
    const float* bias_data =
        bias_contiguous.defined() ? bias_contiguous.const_data_ptr<float>() : nullptr;
    const float scale_f32 = static_cast<float>(scale);
    const uint8_t* prepared =
        prepared_weight.has_value() ? prepared_weight->const_data_ptr<uint8_t>() : nullptr;
    certified_forward(info, x_op, w_op, prepared, bias_data, scale_f32, batch, n, k_padded,
                      x.options(),
                      CertifiedOutputs{out.data_ptr<float>(), argmax.data_ptr<int64_t>(),
                                       preactivation.data_ptr<float>()},
                      stream);
    return {out, argmax, preactivation};
  }
  const int64_t slice_rows = k > 0 ? rows_per_slice(batch, n) : batch;

  at::Tensor workspace;  // split-K partial sums of the current slice, reused by the next one
  for (int64_t row0 = 0; row0 < batch; row0 += slice_rows) {
    const int64_t rows = std::min(slice_rows, batch - row0);
    int64_t splits = 0;
    if (half_gemm) {
      // Half-precision operands: z from cuBLAS's tensor-core GEMM in float32 (see the header),
      // in slices of K where kHalfGemmMaxSplits' rule asks: [splits, rows, n], the workspace's
      // layout.
      const at::Tensor x_rows = rows == batch ? x : x.narrow(0, row0, rows);
      splits = half_gemm_splits(info, x, weight, rows, n, k);
      if (splits == 1) {
        workspace = at::mm(x_rows, weight.t(), at::kFloat);
      } else {
        const int64_t slice = k / splits;
        workspace = at::bmm(x_rows.as_strided({splits, rows, slice}, {slice, x.stride(0), 1}),
                            weight.as_strided({splits, slice, n}, {slice, 1, weight.stride(0)}),
                            at::kFloat);
      }
    } else if (k > 0) {
      const int64_t split_cap = std::max<int64_t>(1, kMaxWorkspaceFloats / (slice_rows * n));
      const bool rowwise = use_rowwise(info, slice_rows, n);
      const Operand x_slice{x_op.storage, x_op.data + row0 * x_op.ld, x_op.ld};
      const GemmPlan plan = plan_gemm(info, rowwise, rows, n, k_padded, split_cap);
      splits = plan.splits;
      // Stream order makes reuse safe: this slice's GEMM starts after the last epilogue's end.
      if (!workspace.defined() || workspace.numel() < splits * rows * n) {
        workspace = at::empty({splits * rows * n}, x.options().dtype(at::kFloat));
      }
      launch_gemm(plan, x_slice, w_op, workspace.data_ptr<float>(), rows, n, k_padded, stream);
    }
    // The epilogue is the programmatic dependent of the GEMM before it where the device supports
    // it, cuBLAS's too: it waits for that grid's completion (griddepcontrol.wait) before reading z,
    // whatever the GEMM signals, so only its launch and set-up overlap the GEMM's tail.
    const bool pdl = info.dependent_launch && splits > 0;
    EpilogueParams p{};
    p.partial = splits > 0 ? workspace.data_ptr<float>() : nullptr;
    p.split_stride = rows * n;
    p.splits = static_cast<int>(splits);
    p.bias = bias_contiguous.defined() ? bias_contiguous.const_data_ptr() : nullptr;
    p.scale = static_cast<float>(scale);  // torch multiplies a float32 tensor by a float32 scalar
    p.batch = rows;
    p.n = n;
    // (No narrow() views in the usual one-slice case: host time counts at B = 1.)
    auto rows_of = [&](const at::Tensor& t) { return rows == batch ? t : t.narrow(0, row0, rows); };
    at::Tensor out_slice = rows_of(out);
    at::Tensor argmax_slice = rows_of(argmax);
    at::Tensor preactivation_slice = rows_of(preactivation);
    FPG_DISPATCH_CUDA_FLOATING_TYPES(x.scalar_type(), "fused_pool_gelu.forward", [&] {
      launch_epilogue<scalar_t>(p, out_slice, argmax_slice, preactivation_slice, info, half_gemm,
                                pdl, stream);
    });
  }
  return {out, argmax, preactivation};
}

at::Tensor certified_candidate_counts_cuda(const at::Tensor& x, const at::Tensor& weight,
                                           const c10::optional<at::Tensor>& bias, double scale) {
  check_forward_inputs(x, weight, bias);
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t batch = x.size(0);
  const int64_t n = weight.size(0);
  const int64_t k_padded = ceil_div(x.size(1), int64_t{4}) * 4;
  const DeviceInfo& info = device_info(x.get_device());
  TORCH_CHECK(certified_applies(info, x, weight, batch, n, k_padded, scale),
              "fused_pool_gelu._certified_candidate_counts: the certified path does not apply "
              "here (it needs an sm_90a build on a compute capability 9.0 GPU, "
              "FUSED_POOL_GELU_FORCE_MMA_SYNC unset, float32, ", kSimtMaxBatch + 1,
              " <= batch, one workspace slice, N <= ", certified::kMaxSelectColumns, ", 0 < K <= ",
              kCertifiedMaxInFeatures, " and a finite non-zero scale), got ", x.scalar_type(),
              " x and ", weight.scalar_type(), " weight, batch ", batch, ", N ", n, ", K ",
              x.size(1), ", scale ", scale);
  at::Tensor bias_contiguous;  // float32, as x (certified_applies)
  if (bias.has_value()) bias_contiguous = bias->contiguous();
  const Operand x_op = as_kernel_operand(x, k_padded);
  const Operand w_op = as_kernel_operand(weight, k_padded);
  // The forward's outputs are not returned: the counts are the selection's.
  at::Tensor out = at::empty({batch}, x.options());
  at::Tensor argmax = at::empty({batch}, x.options().dtype(at::kLong));
  at::Tensor preactivation = at::empty({batch}, x.options());
  const Selection selection = certified_forward(
      info, x_op, w_op, nullptr,
      bias_contiguous.defined() ? bias_contiguous.const_data_ptr<float>() : nullptr,
      static_cast<float>(scale), batch, n, k_padded, x.options(),
      CertifiedOutputs{out.data_ptr<float>(), argmax.data_ptr<int64_t>(),
                       preactivation.data_ptr<float>()},
      c10::cuda::getCurrentCUDAStream());
  return selection.workspace.narrow(0, selection.offset, batch).view(at::kInt).clone();
}

at::Tensor prepare_weight_cuda(const at::Tensor& weight) {
  check_prepare_weight_inputs(weight);
  c10::cuda::CUDAGuard guard(weight.device());
  const int64_t n = weight.size(0);
  const int64_t k = weight.size(1);
  const int64_t k_padded = ceil_div(k, int64_t{4}) * 4;
  at::Tensor prepared = at::empty({prepared_bytes(n, k)}, weight.options().dtype(at::kByte));
  // K == 0: no row to read; the kernel writes the trailers (norms 0, inverse scale 1).
  const Operand w_op = k > 0 && n > 0 ? as_kernel_operand(weight, k_padded) : Operand{};
  launch_prepare(w_op, n, k_padded,
                 prepared.mutable_data_ptr<uint8_t>(),
                 c10::cuda::getCurrentCUDAStream());
  record_prepared_weight(prepared, weight);
  return prepared;
}

}  // namespace
}  // namespace cuda
}  // namespace fused_pool_gelu

TORCH_LIBRARY_IMPL(fused_pool_gelu, CUDA, m) {
  m.impl("forward_with_argmax", &fused_pool_gelu::cuda::forward_with_argmax_cuda);
  m.impl("prepare_weight", &fused_pool_gelu::cuda::prepare_weight_cuda);
  m.impl("_certified_candidate_counts", &fused_pool_gelu::cuda::certified_candidate_counts_cuda);
}
