// Which kernels serve a CUDA forward call, and with which tiles and splits: the one place where
// the choice of path by shape is made. Host-only, plain C++ (no CUDA, no torch), so that
// tests/test_forward_plan.py compiles it into a small driver and checks the plans on the CPU.
//
// The paths (docs/design.md, "Which path serves which shape"):
//   no GEMM       K == 0: z = bias, the epilogue alone.
//   half GEMM     float16 / bfloat16: cuBLAS's tensor-core GEMM with a float32 result, whole or in
//                 slices of K, then the epilogue.
//   certified     float32 on sm_90a where it pays (use_certified): an fp16 pass 1 with a proven
//                 error bound, then selection and float32 rescoring of the few candidates.
//   split-K       float32 elsewhere: a GEMM into a workspace [splits, rows, N] (plan_gemm: the
//                 row-parallel, SIMT or 3xTF32 tensor-core GEMV, or the 3xTF32 GEMM), then the
//                 epilogue; in slices of rows where the workspace would pass kMaxWorkspaceFloats.
// Every tuning number below has one line on how it was chosen; the measurements behind it are in
// docs/performance.md, "How the path thresholds were chosen".
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "cuda/tile_sizes.h"
#include "debug_knobs.h"

namespace fused_pool_gelu {
namespace cuda {

namespace fg = forward_gemm;

template <typename T>
constexpr T ceil_div_host(T a, T b) {
  return (a + b - 1) / b;
}

// What the planner needs to know of a device: its SMs and each kernel's resident CTAs per SM
// (forward.cu's device_limits asks the runtime once per device; the unit test makes them up).
struct DeviceLimits {
  int sms = 0;
  int simt_ctas_per_sm[fg::kNumSimtBatchTiles] = {};
  // 0 where the kernel's shared memory does not fit the device (the tensor-core GEMV before
  // Hopper; the 3xTF32 GEMM on devices with 99 KB per block: every batch then takes the GEMVs).
  int tc_gemv_ctas_per_sm = 0;
  int tc_ctas_per_sm = 0;
  // 0 unless the sm_90a kernels (wgmma, the certified pass 1) run here: a compute capability 9.0
  // device and a build whose arch list holds 9.0a.
  int wgmma_ctas_per_sm = 0;
  // Resident CTAs per SM of the CTA-per-row epilogue for one split (its fewest over dtypes).
  int epilogue_one_split_ctas_per_sm = 0;
  // Shared memory per SM, and what a spread programmatic dependent may ask for (half of it plus a
  // byte; 0 where one CTA cannot get that).
  int smem_per_sm = 0;
  int spread_smem_max = 0;
  // Programmatic dependent launch (sm_90+, with code compiled for it).
  bool dependent_launch = false;
};

// The limits of CUDA device `device` as the forward sees them (forward.cu; for the tests, through
// fused_pool_gelu._C._device_limits).
const DeviceLimits& device_limits_of(int device);

// ------------------------------------------------------------------------------------------------
// Tuning constants.
// ------------------------------------------------------------------------------------------------

// Up to 32 rows the GEMVs serve (the weight streamed once; 128-row tensor-core tiles would be
// mostly padding). docs/performance.md, "GEMV or GEMM at small batch".
constexpr int64_t kSimtMaxBatch = 32;
// From 17 rows (where the SIMT GEMV would take a second 16-row tile) weights of more than 2^21
// floats take a 3xTF32 tensor-core kernel; smaller ones keep the exact-FMA SIMT GEMV.
constexpr int64_t kSimtMaxBatchWgmma = 16;
constexpr int64_t kTcSmallBatchMinWeightFloats = int64_t{1} << 21;
// A grid keeps the GPU busy from 75% of the SMs: the row-parallel GEMV (B <= 4) and the small-batch
// tensor-core kernels need that many CTAs, else the split-K GEMV serves.
constexpr int64_t kMinBusySmPercent = 75;
// The SIMT GEMV aims at one wave of resident CTAs, at most this many per SM: more, smaller CTAs
// only add split partials for the epilogue to sum.
constexpr int kSimtMaxCtasPerSm = 4;

// The certified path from the fifth 128-row tile's first row without a prepared weight (the copy
// costs ~10 us), from the third with one: where it won at every measured batch from there on.
// docs/performance.md, "Certified or 3xTF32".
constexpr int64_t kCertifiedMinBatch = 4 * fg::kTcBlockM + 1;
constexpr int64_t kCertifiedPreparedMinBatch = 2 * fg::kTcBlockM + 1;
// ... for weights of N >= 512 rows and 2^21 floats, or N >= 256 and 2^19 floats once B x N x K
// reaches 2^31: the single pass saves two of 3xTF32's three MMA passes (growing with B x N x K) but
// pays the copy, the selection (B x N) and the rescoring (B x K), so narrow or small weights lose.
constexpr int64_t kCertifiedMinColumns = 512;
constexpr int64_t kCertifiedMinWeightFloats = int64_t{1} << 21;
constexpr int64_t kCertifiedLargeWorkMinColumns = 256;
constexpr int64_t kCertifiedLargeWorkMinWeightFloats = int64_t{1} << 19;
constexpr int64_t kCertifiedMinWork = int64_t{1} << 31;
// With a prepared weight, also 33 rows to one row per SM (one CTA per row selects and rescores it)
// on weights of N >= 512 and 2^22 floats; at 2^21 floats the 3xTF32 GEMM is faster.
constexpr int64_t kCertifiedFusedMinBatch = kSimtMaxBatch + 1;
constexpr int64_t kCertifiedFusedMinWeightFloats = int64_t{1} << 22;
// The bound's gamma terms stay far below 1 up to this K.
constexpr int64_t kCertifiedMaxInFeatures = int64_t{1} << 20;

// Split-K of the tensor-core GEMMs: s minimizes waves(tiles x s) x ceil(k_tiles / s), at most
// kTcMaxSplits and within kTcMaxSplitWaves waves: splitting fills the GPU (B = 1024: 32 tiles -> 4
// splits) rather than shaving a large grid's last wave. docs/performance.md, "Split-K".
constexpr int64_t kTcMaxSplits = 64;
constexpr int64_t kTcMaxSplitWaves = 4;
// The certified pass 1 keeps at least 8 of its 64-wide K tiles per split (as measured; shorter
// splits at B >= 257 are untried), the fused rows at least 4 (B = 128: 32 splits, 128 CTAs).
constexpr int64_t kPass1MinKTilesPerSplit = 8;
constexpr int64_t kPass1FusedMinKTilesPerSplit = 4;
// The fused rows' pass 1 takes 64-row x tiles up to 64 rows (no half-empty 128-row tile), 128
// beyond: at B = 128 two 64-row tiles per column tile read a third more from L2.
constexpr int64_t kPass1SmallTileMaxBatch = 64;

// Epilogue: a CTA (256 threads) per row while B is small, so that many split partials of a row
// are summed by many threads; a warp per row once the rows fill the GPU (8192 rows, ~62 warps per
// SM), or past one wave of CTAs for rows of one split (half a wave with 16-byte loads).
// docs/performance.md, "Epilogue".
constexpr int kEpilogueThreads = 256;
constexpr int64_t kEpilogueWarpPerRowMinBatch = 8192;
// A warp per row reads the 16-byte loads of up to this many splits at once (the half path's
// slices of K): 112 registers at 4, no spills.
constexpr int kEpilogueVectorMaxSplits = 4;
// Rows of >= 1024 columns with at most 8 splits take a 1024-thread CTA per row: at 256 threads each
// thread's chain of GELUs is too long for 8 warps per SM to hide (64 registers at 8 splits).
constexpr int kEpilogueWideRowThreads = 1024;
constexpr int64_t kEpilogueWideRowMinColumns = 1024;
constexpr int kEpilogueWideRowMaxSplitBound = 8;
// Up to 64 split partials are loaded all at once per output (one round trip to L2); more go in
// batches of kSplitBatch (row_max.cuh).
constexpr int kEpilogueMaxSplitBound = 64;
// Programmatic dependents (the epilogue, the certified selection) ask for unused shared memory so
// that at most ceil(CTAs / SMs) share an SM, up to this many per SM: placed while the kernel before
// still runs, a small grid would otherwise pile onto the few SMs it left free.
constexpr int kMaxSpreadCtasPerSm = 4;

// The split-K workspace (splits x rows x N floats) stays within 16 MB: larger batches go through
// GEMM + epilogue in slices of rows. A slice keeps >= 4M outputs (~2 waves of 128 x 128 tiles on
// 132 SMs), so slicing costs the GEMM little. docs/performance.md, "Workspace".
constexpr int64_t kMaxWorkspaceFloats = (int64_t{16} << 20) / static_cast<int64_t>(sizeof(float));
static_assert(std::max(certified::kMaxSplits, certified::kFusedMaxSplits) * kMaxWorkspaceFloats <=
                  std::numeric_limits<int>::max(),
              "the certified selection's partial offsets fit in an int");

// The half path's GEMM in up to 4 slices of K (one cuBLAS strided-batched call; the epilogue sums
// the slices) from 512 rows, as many as keep 128 x 128 tiles x slices within the SMs: cuBLAS then
// runs 128 x 128 tiles instead of 64 x 64 ones. docs/performance.md, "Half-precision GEMM slices".
constexpr int64_t kHalfGemmSplitMinBatch = 512;
constexpr int64_t kHalfGemmMaxSplits = 4;
constexpr int64_t kHalfGemmMinSliceK = 2048;
static_assert(kHalfGemmMaxSplits <= kEpilogueVectorMaxSplits, "the epilogue sums every slice");
constexpr int64_t kHalfGemmTile = 128;
// cuBLAS's fast kernels want 16-byte aligned operands: each slice starts 8 half elements apart.
constexpr int64_t kHalfGemmSliceAlign = 8;

// Largest K: padded to a multiple of 4, offsets inside a row plus two chunks of look-ahead fit an
// int in the SIMT GEMV. A multiple of 4 itself, so K passes it exactly when its padding does.
constexpr int64_t kMaxInFeatures = (std::numeric_limits<int>::max() - 2 * fg::kSimtChunkK) / 4 * 4;
static_assert(kMaxInFeatures == (int64_t{1} << 31) - 516, "the limit docs/input_classes.md states");

// gridDim.y's and gridDim.z's limit.
constexpr int64_t kMaxGridYZ = 65535;

// ------------------------------------------------------------------------------------------------
// The path of a call.
// ------------------------------------------------------------------------------------------------

// The operands' dtype: float32, a half type (float16 / bfloat16), or another (float64: no CUDA
// path; only the certified path's diagnostic op asks about it).
enum class Operands { kFloat32, kHalf, kOther };

struct ForwardProblem {
  int64_t batch = 0;
  int64_t n = 0;  // weight rows (pooled features)
  int64_t k = 0;  // in_features
  Operands operands = Operands::kFloat32;
  bool prepared = false;  // a prepare_weight copy is passed
  double scale = 1.0;
  // The half path slices K only for row-major x and weight (views, no copies) and N % 4 == 0.
  bool unit_column_strides = true;
};

enum class ForwardPath { kNoGemm, kHalfGemm, kCertified, kSplitK };

inline int64_t padded_k(int64_t k) { return ceil_div_host(k, int64_t{4}) * 4; }

// Whether a grid of `ctas` CTAs keeps at least kMinBusySmPercent of the SMs busy.
inline bool keeps_sms_busy(const DeviceLimits& limits, int64_t ctas) {
  return 100 * ctas >= kMinBusySmPercent * limits.sms;
}

// Whether the tensor-core GEMM is the wgmma one here (else mma.sync).
inline bool wgmma_serves(const DeviceLimits& limits, const DebugKnobs& knobs) {
  return limits.wgmma_ctas_per_sm > 0 && !knobs.force_mma_sync;
}

// Rows per slice (see kMaxWorkspaceFloats): all of them when one split of the whole batch fits,
// else as many as fit, in whole 128-row tensor-core tiles where that leaves at least one.
inline int64_t rows_per_slice(int64_t batch, int64_t n) {
  if (batch * n <= kMaxWorkspaceFloats) return batch;
  const int64_t rows = std::max<int64_t>(1, kMaxWorkspaceFloats / n);
  return rows >= fg::kTcBlockM ? rows / fg::kTcBlockM * fg::kTcBlockM : rows;
}

// Whether the certified path serves `batch` rows with 128-wide pass-1 tiles and one CTA per row
// that selects and rescores it (select_rescore_kernel): where the rows fit on the SMs at once.
inline bool certified_fused_rows(const DeviceLimits& limits, int64_t batch) {
  return batch <= limits.sms;
}

// Where the certified path can run: the sm_90a kernels here, float32, a batch that pass 1's grid
// serves in one launch and one workspace slice, N <= kMaxSelectColumns (the selection's shared
// memory), 0 < K <= kCertifiedMaxInFeatures and a finite non-zero scale.
inline bool certified_applies(const DeviceLimits& limits, const DebugKnobs& knobs,
                              const ForwardProblem& p) {
  const int64_t k_padded = padded_k(p.k);
  return wgmma_serves(limits, knobs) && p.operands == Operands::kFloat32 &&
         p.batch > kSimtMaxBatch && p.batch <= kMaxGridYZ * fg::kPass1BlockM &&
         p.n <= certified::kMaxSelectColumns &&
         rows_per_slice(p.batch, p.n) == p.batch && k_padded > 0 &&
         k_padded <= kCertifiedMaxInFeatures && std::isfinite(p.scale) && p.scale != 0.0;
}

// Whether the certified path takes the call: where it applies and pays (the constants above), or
// wherever it applies under FUSED_POOL_GELU_CERTIFIED=1, never under =0.
inline bool use_certified(const DeviceLimits& limits, const DebugKnobs& knobs,
                          const ForwardProblem& p) {
  const int64_t min_batch = p.prepared ? kCertifiedPreparedMinBatch : kCertifiedMinBatch;
  // B x N x K compared as N x K against the work over B: the product may not fit in 64 bits.
  const int64_t weight_floats = p.n * padded_k(p.k);
  const bool fused_rows_pay = p.prepared && p.batch >= kCertifiedFusedMinBatch &&
                              certified_fused_rows(limits, p.batch) &&
                              p.n >= kCertifiedMinColumns &&
                              weight_floats >= kCertifiedFusedMinWeightFloats;
  const bool pays =
      fused_rows_pay ||
      (p.batch >= min_batch &&
       ((p.n >= kCertifiedMinColumns && weight_floats >= kCertifiedMinWeightFloats) ||
        (p.n >= kCertifiedLargeWorkMinColumns &&
         weight_floats >= kCertifiedLargeWorkMinWeightFloats &&
         weight_floats >= ceil_div_host(kCertifiedMinWork, p.batch))));
  return knobs.certified != CertifiedMode::kNever &&
         (knobs.certified == CertifiedMode::kAlways || pays) &&
         certified_applies(limits, knobs, p);
}

inline ForwardPath plan_path(const DeviceLimits& limits, const DebugKnobs& knobs,
                             const ForwardProblem& p) {
  if (p.k == 0) return ForwardPath::kNoGemm;
  if (p.operands == Operands::kHalf) return ForwardPath::kHalfGemm;
  if (use_certified(limits, knobs, p)) return ForwardPath::kCertified;
  return ForwardPath::kSplitK;
}

// ------------------------------------------------------------------------------------------------
// The split-K GEMM of a slice of rows.
// ------------------------------------------------------------------------------------------------

// The GEMVs' split of K: about target_ctas CTAs for `tiles` output tiles (one wave of resident
// CTAs, all weight loads in flight at once), each split a whole number of `granularity` floats.
struct SplitK {
  int64_t splits = 0;
  int64_t k_per_split = 0;
};

inline SplitK one_wave_split_k(int64_t target_ctas, int64_t tiles, int64_t k_padded,
                               int64_t granularity, int64_t split_cap) {
  const int64_t max_splits = ceil_div_host(k_padded, granularity);
  const int64_t splits = std::clamp<int64_t>(target_ctas / tiles, 1,
                                             std::min({max_splits, kMaxGridYZ, split_cap}));
  SplitK plan{};
  plan.k_per_split = ceil_div_host(ceil_div_host(k_padded, splits), granularity) * granularity;
  // Recounting after the rounding up leaves no empty split.
  plan.splits = ceil_div_host(k_padded, plan.k_per_split);
  return plan;
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

// Split-K plan of the SIMT GEMV.
struct SimtPlan {
  int tile_index = 0;  // into fg::kSimtBatchTiles
  int batch_tile = 0;
  SplitK split_k;
};

inline SimtPlan plan_simt(const DeviceLimits& limits, int64_t batch, int64_t n, int64_t k_padded,
                          int64_t split_cap) {
  SimtPlan plan{};
  plan.tile_index = smallest_at_or_above<fg::kSimtBatchTiles>(batch);
  plan.batch_tile = fg::kSimtBatchTiles[plan.tile_index];
  const int64_t n_tiles = ceil_div_host(n, int64_t{fg::kSimtRowsPerCta});
  const int64_t b_tiles = ceil_div_host(batch, int64_t{plan.batch_tile});
  const int64_t target_ctas =
      static_cast<int64_t>(limits.sms) *
      std::min(limits.simt_ctas_per_sm[plan.tile_index], kSimtMaxCtasPerSm);
  plan.split_k = one_wave_split_k(target_ctas, n_tiles * b_tiles, k_padded, fg::kSimtChunkK,
                                  split_cap);
  return plan;
}

// Split-K plan of the tensor-core GEMV.
inline SplitK plan_tc_gemv(const DeviceLimits& limits, int64_t batch, int64_t n, int64_t k_padded,
                           int64_t split_cap) {
  const int64_t n_tiles = ceil_div_host(n, int64_t{fg::kTcGemvRowsPerCta});
  const int64_t b_tiles = ceil_div_host(batch, int64_t{fg::kTcGemvBatchTile});
  const int64_t target_ctas = static_cast<int64_t>(limits.sms) * limits.tc_gemv_ctas_per_sm;
  return one_wave_split_k(target_ctas, n_tiles * b_tiles, k_padded, fg::kTcGemvSplitK, split_cap);
}

// K tiles per split for `tiles` output tiles of k_tiles K tiles each on `slots` resident CTAs:
// the split count s minimizes waves(tiles x s) x ceil(k_tiles / s) (see kTcMaxSplits), each split
// at least min_k_tiles long.
inline int64_t plan_k_tiles_per_split(int64_t tiles, int64_t k_tiles, int64_t slots,
                                      int64_t split_cap, int64_t min_k_tiles) {
  const int64_t max_splits =
      std::max<int64_t>(1, std::min({kTcMaxSplits, k_tiles / min_k_tiles, split_cap}));
  int64_t best_cost = std::numeric_limits<int64_t>::max();
  int64_t best_k_tiles_per_split = k_tiles;
  for (int64_t s = 1; s <= max_splits; ++s) {
    const int64_t per_split = ceil_div_host(k_tiles, s);
    const int64_t used_splits = ceil_div_host(k_tiles, per_split);
    if (used_splits > 1 && tiles * used_splits > kTcMaxSplitWaves * slots) break;
    const int64_t cost = ceil_div_host(tiles * used_splits, slots) * per_split;
    if (cost < best_cost) {
      best_cost = cost;
      best_k_tiles_per_split = per_split;
    }
  }
  return best_k_tiles_per_split;
}

// Output tiles of the tensor-core GEMMs (both 128 x 128) over `rows` x `n`.
inline int64_t tc_tiles(int64_t rows, int64_t n) {
  return ceil_div_host(rows, int64_t{fg::kTcBlockM}) * ceil_div_host(n, int64_t{fg::kTcBlockN});
}

// Split-K plan of the 3xTF32 GEMM (the mma.sync and wgmma kernels share their tiles).
struct TcPlan {
  bool wgmma = false;
  int64_t splits = 0;
  int64_t k_per_split = 0;
};

inline TcPlan plan_tc(const DeviceLimits& limits, const DebugKnobs& knobs, int64_t batch,
                      int64_t n, int64_t k_padded, int64_t split_cap) {
  const bool wgmma = wgmma_serves(limits, knobs);
  const int64_t tiles = tc_tiles(batch, n);
  const int64_t k_tiles = ceil_div_host(k_padded, int64_t{fg::kTcBlockK});
  const int64_t slots = static_cast<int64_t>(limits.sms) *
                        (wgmma ? limits.wgmma_ctas_per_sm : limits.tc_ctas_per_sm);
  TcPlan plan{};
  plan.wgmma = wgmma;
  plan.k_per_split = plan_k_tiles_per_split(tiles, k_tiles, slots, split_cap, 1) * fg::kTcBlockK;
  plan.splits = ceil_div_host(k_padded, plan.k_per_split);
  return plan;
}

// Whether the row-parallel GEMV serves slices of `rows` rows (at most fg::kRowwiseMaxBatch) of a
// weight of n rows: where its CTAs, kRowwiseRows weight rows each, keep the SMs busy.
inline bool use_rowwise(const DeviceLimits& limits, int64_t rows, int64_t n) {
  const int64_t ctas = ceil_div_host(n, int64_t{fg::kRowwiseRows});
  return rows <= fg::kRowwiseMaxBatch && keeps_sms_busy(limits, ctas);
}

// The tensor-core GEMV's plan for a slice of `rows` rows where that GEMV runs it (see
// kSimtMaxBatchWgmma), else none (splits == 0).
inline SplitK tc_gemv_plan(const DeviceLimits& limits, int64_t rows, int64_t n, int64_t k_padded,
                           int64_t split_cap) {
  if (rows <= kSimtMaxBatchWgmma || rows > kSimtMaxBatch || limits.tc_gemv_ctas_per_sm == 0 ||
      n * k_padded <= kTcSmallBatchMinWeightFloats) {
    return {};
  }
  const SplitK plan = plan_tc_gemv(limits, rows, n, k_padded, split_cap);
  if (!keeps_sms_busy(limits, ceil_div_host(n, int64_t{fg::kTcGemvRowsPerCta}) * plan.splits)) {
    return {};
  }
  return plan;
}

// The tensor-core GEMM's plan for a slice of `rows` rows that the tensor-core GEMV does not run,
// where that GEMM rather than the SIMT GEMV serves it, else none (splits == 0).
inline TcPlan tc_gemm_plan(const DeviceLimits& limits, const DebugKnobs& knobs, int64_t rows,
                           int64_t n, int64_t k_padded, int64_t split_cap) {
  // Past this check the device runs the tensor-core GEMM (tc_ctas_per_sm > 0), so plan_tc's slots
  // are not 0.
  if (rows <= kSimtMaxBatchWgmma || limits.tc_ctas_per_sm == 0) return {};
  const TcPlan plan = plan_tc(limits, knobs, rows, n, k_padded, split_cap);
  if (rows > kSimtMaxBatch) return plan;
  if (!wgmma_serves(limits, knobs) || n * k_padded <= kTcSmallBatchMinWeightFloats ||
      !keeps_sms_busy(limits, tc_tiles(rows, n) * plan.splits)) {
    return {};
  }
  return plan;
}

// Which GEMM runs a slice of `rows` rows, and its split-K plan (at most split_cap splits).
struct GemmPlan {
  enum class Kind { kRowwise, kSimt, kTcGemv, kTc } kind = Kind::kSimt;
  SimtPlan simt;
  SplitK tc_gemv;
  TcPlan tc;
  int64_t splits = 0;
};

// `rowwise`: use_rowwise for the call's slices (decided once per call, on the slice size).
inline GemmPlan plan_gemm(const DeviceLimits& limits, const DebugKnobs& knobs, bool rowwise,
                          int64_t rows, int64_t n, int64_t k_padded, int64_t split_cap) {
  GemmPlan plan{};
  if (rowwise) {
    plan.kind = GemmPlan::Kind::kRowwise;
    plan.splits = 1;
  } else if (const SplitK tc_gemv = tc_gemv_plan(limits, rows, n, k_padded, split_cap);
             tc_gemv.splits > 0) {
    plan.kind = GemmPlan::Kind::kTcGemv;
    plan.tc_gemv = tc_gemv;
    plan.splits = tc_gemv.splits;
  } else if (const TcPlan tc = tc_gemm_plan(limits, knobs, rows, n, k_padded, split_cap);
             tc.splits > 0) {
    plan.kind = GemmPlan::Kind::kTc;
    plan.tc = tc;
    plan.splits = tc.splits;
  } else {
    plan.kind = GemmPlan::Kind::kSimt;
    plan.simt = plan_simt(limits, rows, n, k_padded, split_cap);
    plan.splits = plan.simt.split_k.splits;
  }
  return plan;
}

// The most splits a slice of `slice_rows` rows may take within the workspace.
inline int64_t workspace_split_cap(int64_t slice_rows, int64_t n) {
  return std::max<int64_t>(1, kMaxWorkspaceFloats / (slice_rows * n));
}

// The half path's slices of K for a GEMM of `rows` rows (kHalfGemmMaxSplits' rule); 1 where x or
// the weight is not row-major with unit column stride, or where N % 4 != 0 (the epilogue would sum
// the slices a CTA per row, not a warp per row in 16-byte loads).
inline int64_t half_gemm_splits(const DeviceLimits& limits, const ForwardProblem& p,
                                int64_t rows) {
  if (rows < kHalfGemmSplitMinBatch || p.n % 4 != 0 || !p.unit_column_strides) return 1;
  const int64_t tiles = ceil_div_host(rows, kHalfGemmTile) * ceil_div_host(p.n, kHalfGemmTile);
  int64_t splits = 1;
  // The workspace's bound also keeps the epilogue's split offsets in an int; within the SMs'
  // tiles it does not bind (splits x rows x n <= SMs x 128 x 128).
  while (2 * splits <= kHalfGemmMaxSplits && 2 * splits * tiles <= limits.sms &&
         p.k >= 2 * splits * kHalfGemmMinSliceK && p.k % (2 * splits * kHalfGemmSliceAlign) == 0 &&
         2 * splits * rows * p.n <= kMaxWorkspaceFloats) {
    splits *= 2;
  }
  return splits;
}

// ------------------------------------------------------------------------------------------------
// The certified pass 1.
// ------------------------------------------------------------------------------------------------

struct CertifiedPlan {
  bool fused_rows = false;  // one CTA per row selects and rescores it
  int64_t block_m = 0;      // pass 1's tile: x rows
  int64_t block_n = 0;      //                weight rows
  int64_t max_splits = 0;
  int64_t splits = 0;
  int64_t k_per_split = 0;
};

inline CertifiedPlan plan_certified(const DeviceLimits& limits, int64_t batch, int64_t n,
                                    int64_t k_padded) {
  CertifiedPlan plan{};
  plan.fused_rows = certified_fused_rows(limits, batch);
  plan.block_m = plan.fused_rows && batch <= kPass1SmallTileMaxBatch ? 64 : 128;
  // 256 weight rows where the batch fills the GPU with long splits (twice 128's tensor-core work
  // per byte of x read); 128 for the fused rows, whose many splits each store their partials.
  plan.block_n = plan.fused_rows ? 128 : 256;
  plan.max_splits = plan.fused_rows ? certified::kFusedMaxSplits : certified::kMaxSplits;
  const int64_t tiles = ceil_div_host(batch, plan.block_m) * ceil_div_host(n, plan.block_n);
  // One CTA per SM (the kernel's shared memory); the whole split is one tensor-core chain.
  const int64_t split_cap = std::min(plan.max_splits, kMaxWorkspaceFloats / (batch * n));
  plan.k_per_split =
      plan_k_tiles_per_split(tiles, ceil_div_host(k_padded, int64_t{fg::kPass1BlockK}),
                             limits.sms, split_cap,
                             plan.fused_rows ? kPass1FusedMinKTilesPerSplit
                                             : kPass1MinKTilesPerSplit) *
      fg::kPass1BlockK;
  plan.splits = ceil_div_host(k_padded, plan.k_per_split);
  return plan;
}

// ------------------------------------------------------------------------------------------------
// The epilogue.
// ------------------------------------------------------------------------------------------------

struct EpiloguePlan {
  int threads_per_row = kEpilogueThreads;  // 32 (a warp per row), 256 or 1024 (a CTA per row)
  int columns_per_load = 1;                // 4: 16-byte loads of z (and the bias)
  // The bound the kernel sums splits for (1, 2, 4, ...: split_bound_for's, for the form's largest
  // bound), or 0: batches of kSplitBatch (no split, or more than the largest bound).
  int split_bound = 0;
};

// The smallest power of two at or above `splits`, up to max_bound (the kernels that load every
// split at once are compiled for these bounds).
inline int split_bound_for(int64_t splits, int max_bound) {
  int bound = 1;
  while (bound < max_bound && bound < splits) bound *= 2;
  return bound;
}

// `vector_aligned`: N % 4 == 0 and the workspace and the bias start where 4 columns load at once.
// `slices_of_k`: the splits are the half path's slices of K (summed with 16-byte loads too).
inline EpiloguePlan plan_epilogue(const DeviceLimits& limits, int64_t rows, int64_t n,
                                  int64_t splits, bool slices_of_k, bool vector_aligned) {
  EpiloguePlan plan{};
  const bool vector_loads =
      (splits == 1 || (slices_of_k && splits >= 1 && splits <= kEpilogueVectorMaxSplits)) &&
      vector_aligned;
  const int64_t one_wave_rows = int64_t{limits.sms} * limits.epilogue_one_split_ctas_per_sm;
  const int64_t warp_per_row_after = vector_loads ? one_wave_rows / 2 : one_wave_rows;
  const auto scalar_split_bound = [&] {
    return splits == 0 || splits > kEpilogueMaxSplitBound
               ? 0
               : split_bound_for(splits, kEpilogueMaxSplitBound);
  };
  if (rows >= kEpilogueWarpPerRowMinBatch ||
      ((splits == 1 || vector_loads) && n < kEpilogueWideRowMinColumns &&
       rows > warp_per_row_after)) {
    plan.threads_per_row = 32;
    if (vector_loads) {
      plan.columns_per_load = 4;
      plan.split_bound = split_bound_for(splits, kEpilogueVectorMaxSplits);
    } else {
      plan.split_bound = scalar_split_bound();
    }
  } else if (n >= kEpilogueWideRowMinColumns && splits >= 1 &&
             splits <= kEpilogueWideRowMaxSplitBound) {
    plan.threads_per_row = kEpilogueWideRowThreads;
    plan.split_bound = split_bound_for(splits, kEpilogueWideRowMaxSplitBound);
  } else {
    plan.threads_per_row = kEpilogueThreads;
    plan.split_bound = scalar_split_bound();
  }
  return plan;
}

// The dynamic shared memory for a programmatic dependent of `ctas` CTAs that need `needed` bytes
// each: enough that at most ceil(ctas / SMs) of them share an SM (a CTA taking more than 1 / (c +
// 1) of an SM's shared memory leaves room for at most c), up to kMaxSpreadCtasPerSm per SM;
// `needed` for larger grids, which fill every SM anyway.
inline int spread_smem_bytes(const DeviceLimits& limits, int64_t ctas, int needed) {
  const int64_t ctas_per_sm = ceil_div_host(ctas, int64_t{limits.sms});
  if (limits.spread_smem_max == 0 || ctas_per_sm > kMaxSpreadCtasPerSm) return needed;
  return std::max(needed, limits.smem_per_sm / static_cast<int>(ctas_per_sm + 1) + 1);
}

}  // namespace cuda
}  // namespace fused_pool_gelu
