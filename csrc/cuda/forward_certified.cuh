// Certified single pass (sm_90a, float32; the default from kCertifiedMinBatch rows, see forward.cu
// and FUSED_POOL_GELU_CERTIFIED; measurements in benchmarks/NOTES.md): a single-pass fp16 GEMM
// gives every z[b, n] up to a proven error bound; only the columns that may still hold the row's
// maximum are recomputed in float32.
//
// The fp16 copies. Every weight row v gets a power-of-two scale 2^e (prepare_rows_kernel, in the
// call or ahead of it by prepare_weight, prepared_weight.h: the row's largest |v_i| 2^e in
// [2^14, 2^15)), every x row one per split (pass 1, from the
// split's first 64 columns: their largest |v_i| 2^e in [2^10, 2^11), leaving a factor 32 of fp16's
// range for the split's later columns), |e| <= kMaxScaleExponent either way, and pass 1 multiplies
// h_i = fp16(v_i 2^e), rounded to nearest, or 0 where |v_i 2^e| < 2^-14, fp16's smallest normal:
// the tensor core never sees a subnormal, so how it treats them does not matter. fp16 keeps 11
// significant bits, as TF32 does, but rounds to nearest where the tensor core truncates float32
// to TF32, and takes half the bytes at twice the tensor-core rate; its narrow exponent range is
// what the scales are for. r_i = v_i 2^e - h_i is exact in float32 (h_i is 0, or within a factor
// 2 of v_i 2^e, and both are multiples of ulp(v_i 2^e) where h_i != 0); a value that overflows
// fp16 (above 65504 once scaled) makes h_i infinite, and with it z~ and the residual norm: the row
// is rescored whole.
//
// The bound. z = x . w + bias over K; pass 1 computes each split's partial p_s = (the tensor core's
// sum of h_x,i h_w,i over the split's K range) 2^-(e_x,s + e_w) and stores it in bfloat16 (step
// 6); the selection adds them and the bias in float32: z~. In each split's scaled units x' = x
// 2^e_x,s, w' = w 2^e_w:
//  1. Operands: x'_i w'_i - h_x,i h_w,i = x'_i r_w,i + r_x,i h_w,i and |h_w,i| <= |w'_i| + |r_w,i|.
//  2. Products of two 11-bit significands are exact in float32, and none is subnormal (normal
//     fp16 values are multiples of 2^-24 of at least 2^-14, so every sum of their products is 0
//     or at least 2^-48).
//  3. Tensor-core accumulation. Model (DESIGN.md's u = 2^-23 for tensor cores; Fasi et al. 2021
//     measured tensor cores aligning the addends to the largest exponent and truncating): one k8
//     step adds its 8 products to the accumulator with an error below 10 u (|acc| + sum |p|),
//     u = 2^-23 (9 aligned addends, one normalization). A k16 step of fp16 wgmma adds its 16
//     products as one block (17 aligned addends: below 18 u) or as two such k8 steps: either way
//     within the k8 model applied twice.
//     A chain of m k8 steps (C = 8 m products, from a zeroed accumulator to the float32
//     registers it is stored from) then errs by at most ((1 + 10 u)^m - 1) sum |p| <= g_tc sum |p|,
//     g_tc = gamma_m(10 u) (each step's error is at most 10 u times sums that earlier steps grew by
//     at most (1 + 10 u) each). C is a whole split in certified_pass1_kernel: its up to 128
//     accumulator floats per thread (128 x 256 tiles) leave no room for a second set to flush
//     into (at the default shape, 1024 products: g_tc ~ 2^-12.7, next to the operands' ~2^-12
//     with the residual norms).
//  4. Unscaling: 2^-(e_x,s + e_w) is a normal float (|e_x,s + e_w| <= 2 kMaxScaleExponent < 127),
//     so the product is exact unless it is subnormal: 2^-150 per split partial. Scaling by a power
//     of two carries 1-3 over to the original units exactly (residuals included: r 2^-e).
//  5. Float32 additions (round to nearest, no flush; a subnormal sum is exact): the S split
//     partials and the bias, at most S + 1 deep, and the chains' results inside a split (one chain
//     per split here): g_sum = gamma_{K/C + S + 2}(2^-24), with gamma_m(u) = m u / (1 - m u).
//  Summing, with g = g_tc (1 + g_sum) + g_sum, O = sum over i of |x_i| |r_w,i| + |r_x,i| (|w_i| +
//  |r_w,i|) (original units: r 2^-e) and sum |h_x,i h_w,i| 2^-(e_x,s + e_w) <= sum |x_i| |w_i| + O:
//  |z' - z| <= (1 + g) O + g sum |x_i| |w_i| + g_sum |bias| + (1 + g) S 2^-149 for z' the float32
//  sum of the unrounded p_s and the bias, and as well for their exact sum (it only drops the
//  additions' roundings, each of which the bound counts with a non-negative share).
//  6. Storage (forward_gemm_sm90.cuh's store_certified_partial): each p_s is stored rounded to
//     nearest bfloat16 (8 significant bits, float32's exponent range), p^_s, with |p^_s - p_s| <=
//     2^-8 |p^_s| + 2^-134 (half an ulp of p^_s's binade, or of bfloat16's subnormal spacing
//     2^-133). The selection adds the loaded p^_s, then the bias, in float32: z~ lies within
//     gamma_{S+1}(2^-24) (sum |p^_s| + |bias|) of their exact sum. With s^ >= sum |p^_s| (the
//     selection's, from the loaded values, rounded up) and g_s = gamma_{S+1}(2^-24):
//  |z~ - z| <= (1 + g) O + g sum |x_i| |w_i| + (g_sum + g_s) |bias| + (2^-8 + g_s) s^
//              + (1 + g) S 2^-149 + S 2^-134,
//  and Cauchy-Schwarz (sum |a_i| |b_i| <= ||a||_2 ||b||_2, the triangle inequality for
//  ||w| + |r_w||): O <= ||x|| ||r_w|| + ||r_x|| (||w|| + ||r_w||), all in the original units. The
//  norms are sums of squares of scaled values and of their residuals in float32, round to
//  nearest, no flush, at most D deep: relative error below gamma' = gamma_D(2^-24), plus 2^-149
//  per term lost in the subnormal range; taken as sqrt(sum + K 2^-148) (1 + gamma' + 2^-22) 2^-e,
//  rounded up. The weight's come from prepare_rows_kernel, one reduction per row (D =
//  reduction_depth, forward.cu's norm_constants); x's from pass 1's per-split sums
//  (D = max(K + S, reduction_depth); x_row_norms, at the start of the selection, brings them to
//  one scale and adds them, rounding up).
// The float32 rescoring (rescore_dots: an FMA chain per thread, then a fixed tree; reduction_depth
// roundings on any product's path, the bias addition included) errs by at most
// rho (||x|| ||w|| + |bias|), rho = gamma_depth(2^-24): the rescored z lies within
// E = bound + rescoring error of z~. Every constant comes from the host in double, rounded up.
//
// Selection. gelu decreases on (-inf, x0] and increases on [x0, inf), x0 = -0.7517915...: over
// [a, b] = [z~ - E, z~ + E] its minimum is at the end nearer x0 (or gelu(x0) when x0 is inside),
// its maximum at one end. Float32 gelu errs by at most 2^-17 (|gelu(t)| + |t|) + 2^-127 at any t
// (CUDA's erff: 2 ulp; with the evaluation's roundings ~2^-21 |t|, 16 times below). Widened by
// 2^-16 (|g| + |a| + |b|) + 2^-126 to cover that error at both the ends and the rescored point,
// and scaled with directed rounding (ends swapped for s < 0), this gives [lo_n, hi_n] holding the
// value the rescoring will compute for column n. Where a >= x0 (most columns) one erf serves both
// ends: the minimum is gelu(a), and every gelu(z) on [a, b] is at most gelu(a) + (b - a) D with D
// = min(1/2 + 2 phi(0) max(b, 0), gelu'(sqrt 2)) >= gelu' on (-inf, b] (gelu'(v) = Phi(v) + v
// phi(v); Phi <= 1/2 below 0 and concave above, phi <= phi(0); and gelu'' = phi(v) (2 - v^2), so
// gelu' peaks at v = sqrt 2, 1.1289041...); the errors at a and at the rescored point z then sum
// to at most 2^-16 (|a| + |z|) + 2^-126 <= widen(a, a, b), since |gelu(t)| <= |t| and |z| <= |a|
// + |b|. Near z = 0, where the benchmarks' data lies, D exceeds gelu'(b) by O(b^2): the upper end
// barely moves; far from 0 the cap keeps it within 13% of the interval's width of gelu(b) (the
// first form alone let ~48 of 96 columns per row through at |z| ~ 1e19).
// Candidates: the columns with hi_n >= M = max_n lo_n. Any other column's computed value would
// be below M, which the column attaining M reaches: it cannot be the winner, so the answer is
// the one rescoring every column would give (same torch.max rule on NaN and ties). A row with a
// non-finite z~, bound or value end, with ||x|| ||w|| >= 2^120 somewhere (where float32 sums
// could overflow), or with more than kMaxCandidates candidates, is rescored entirely.
//
// Pass 1 is forward_gemm_sm90.cuh's certified_pass1_kernel; the host side (the bound's constants,
// the launches, use_certified) is in forward.cu.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common.cuh"
#include "prepared_weight.h"
#include "row_max.cuh"

namespace fused_pool_gelu {
namespace cuda {
namespace certified {

// Splits of pass 1, at most (forward.cu's planner): the selection reads every split's partial of
// every (row, column), all at once (load_split_partials), and its workspace (splits x rows x N
// bfloat16 partials, plus x's split sums and the candidate lists) then stays within 4 x rows x N
// floats and the per-row lists (docs/input_classes.md). The default shape takes 8 anyway (16 tiles
// x 8 = 128 CTAs). The certified path runs on one workspace slice (rows x N <= forward.cu's
// kMaxWorkspaceFloats = 2^22), so kMaxSplits x rows x N offsets fit in an int.
constexpr int kMaxSplits = 8;

// Candidates kept per row; a row with more is rescored whole (benchmarks/simulate_certified.py,
// default shape: 3.6 per row on average, 99.9% of rows at most ~21).
constexpr int kMaxCandidates = 64;
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// gelu's minimum, at x0 = -0.75179152469...: floats just below and above x0, and one below
// gelu(x0) = -0.16997120748...
constexpr float kGeluX0Below = -0.7517916f;
constexpr float kGeluX0Above = -0.7517915f;
constexpr float kGeluMinLower = -0.1699713f;
// 2 phi(0) = sqrt(2 / pi) = 0.79788456..., rounded up; gelu's largest slope, gelu'(sqrt 2) =
// Phi(sqrt 2) + sqrt 2 phi(sqrt 2) = 1.12890415..., rounded up (to 1 + 33 / 256).
constexpr float kTwoPhi0Above = 0.797884583f;
constexpr float kGeluSlopeMaxAbove = 1.12890625f;

// Constants of the bound (see above), each a float32 at or above its exact value.
struct Bound {
  float operand;          // 1 + g: multiplies ||x|| ||r_w|| + ||r_x|| (||w|| + ||r_w||)
  float accumulation;     // g: multiplies ||x|| ||w||
  float bias;             // g_sum + g_s
  float storage;          // 2^-8 + g_s: multiplies s^, the bfloat16 partials' sum of magnitudes
  float absolute;         // (1 + g) S 2^-149 + S 2^-134
  float squares_floor;    // K 2^-148, added to a sum of squares
  float norm_slack;       // 1 + gamma' + 2^-22
  float rescore;          // rho
};

// A row's or a column's norm and the norm of its fp16 copy's residuals, in the original units.
struct alignas(8) Norms {
  float value;
  float residual;
};

// One 8-byte read-only load of a Norms pair (prepare_rows_kernel's output).
__device__ __forceinline__ Norms load_norms(const Norms* norms) {
  const float2 pair = __ldg(reinterpret_cast<const float2*>(norms));
  return Norms{pair.x, pair.y};
}

struct SelectParams {
  const __nv_bfloat16* partial;  // [splits, batch, n]
  int split_stride;       // batch * n
  int splits;
  // [batch, splits] each (row-major by split): pass 1's sums of squares of x's scaled rows and of
  // their residuals, and the scales' exponents (x_row_norms)
  const float* x_sumsq;
  const float* x_residual_sumsq;
  const int* x_scale_exponent;
  const Norms* w_norms;   // the prepared weight's: column n's at w_norms[n * w_norms_stride]
  int64_t w_norms_stride;
  const float* bias;      // [n] or nullptr
  // Finite and non-zero as the op's double (the host checks); rounded to float it may be +-inf
  // (|scale| > FLT_MAX: every interval end is then non-finite, every row rescored whole) or +-0
  // (below float's subnormals: every column a candidate). Either way the rescoring's answer.
  float scale;
  int64_t batch;
  int64_t n;
  Bound bound;
  int* count;             // [batch]: candidates, or -1: rescore every column
  int* candidates;        // [batch, kMaxCandidates]
  // The rescoring's order (see kRescoreHeavyCandidates): rescore_rows[i] and rescore_counts[i]
  // for rescoring CTA i; rescore_ends[0] heavy rows taken from the front, rescore_ends[1] light
  // ones from the back (zeroed by pass 1).
  int* rescore_rows;      // [batch]
  int* rescore_counts;    // [batch]
  int* rescore_ends;      // [2]
};

// The rescoring (one CTA per row) takes the rows with at least this many candidates, or whole
// rows, first. A row's CTA reads its x row once per group of kGroup candidates and one weight row
// per candidate, each CTA at a rate set by its loads in flight (latency-bound, not by the SM's
// share: NOTES), so a row with 5-7 candidates reads 3.5-4.5 times the bytes of one with 1 (most
// rows) at about the same rate. Launched in row order, such a row could start in the last wave
// and finish alone; heavy rows first, the last wave holds only light rows (longest-first
// scheduling in two classes: the selection appends heavy rows at the front of the order and light
// ones at the back). Rescoring 18.0 -> 15.0 us at B = 1024 on the H200 (NOTES).
constexpr int kRescoreHeavyCandidates = 2;

// The kernels below that sum pass 1's splits are compiled for a bound kSplitBound on the split
// count (the smallest of 1, 2, 4, ... at or above it, up to kMaxSplits for select_candidates_kernel
// and kFusedMaxSplits for select_rescore_kernel: forward.cu's dispatch_split_bound), so
// that their loads are all issued at once and a call with fewer splits issues few loads past its
// last split (B = 4096 takes two splits: one kernel for up to 8 made its selection 24.2 -> 28.0
// us). A chain of S dependent loads per column (the first version's split sums of squares) made
// the selection latency-bound (~60 us at B = 1024).

// Pass 1's split partials of kColumns adjacent columns of one row, from index = row * n + col of
// each split, every load issued at once, as sum_few_splits does (loads past the last split re-read
// it), but indexed in 32 bits (kMaxSplits or kFusedMaxSplits x rows x N fits, see kMaxSplits) and
// widened only after a split's offset is added: unsigned 32-bit sums cannot be widened term by
// term, so the compiler keeps each split's index in one register. From sum_few_splits' pointer
// (row_partial + col) it kept a 64-bit address per split across the column loop when the code
// before the loop changed: 8 more registers at 8 splits, 32-48 bytes of spills at the 40-register
// cap (the x norms computed in this kernel, or none at all). Each load's address also takes 2
// instructions, not 4. kColumns = 4 (col and N multiples of 4: 8-byte aligned) takes each split's
// four bfloat16 in one load.
template <int kSplitBound, int kColumns>
__device__ __forceinline__ void load_split_partials(const SelectParams& p, uint32_t index,
                                                    float (&v)[kColumns][kSplitBound]) {
  static_assert(kColumns == 1 || kColumns == 4, "one column, or four in one 8-byte load");
#pragma unroll
  for (int i = 0; i < kSplitBound; ++i) {
    const uint32_t offset = static_cast<uint32_t>(min(i, p.splits - 1) * p.split_stride);
    if constexpr (kColumns == 1) {
      v[0][i] = __bfloat162float(__ldg(p.partial + (index + offset)));
    } else {
      // A bfloat16 is the high half of its float; the lower address holds the lower half.
      const uint2 quad = __ldg(reinterpret_cast<const uint2*>(p.partial + (index + offset)));
      v[0][i] = __uint_as_float(quad.x << 16);
      v[1][i] = __uint_as_float(quad.x & 0xffff0000u);
      v[2][i] = __uint_as_float(quad.y << 16);
      v[3][i] = __uint_as_float(quad.y & 0xffff0000u);
    }
  }
}

// One column's split partials added in split order, and their magnitudes' sum s^, rounded up, for
// the storage's share of the bound (step 6).
struct SplitSum {
  float value;
  float magnitude;
};

template <int kSplitBound>
__device__ __forceinline__ SplitSum add_splits(const SelectParams& p,
                                               const float (&v)[kSplitBound]) {
  SplitSum sum{v[0], fabsf(v[0])};
#pragma unroll
  for (int i = 1; i < kSplitBound; ++i) {
    if (i < p.splits) {
      sum.value += v[i];
      sum.magnitude = __fadd_ru(sum.magnitude, fabsf(v[i]));
    }
  }
  return sum;
}

// z~ and its bound E for one column (bias: its bias, or 0); false when either is not finite or
// the norms are too large for the analysis.
__device__ __forceinline__ bool column_interval(const SelectParams& p, SplitSum partials,
                                               float bias, Norms x, Norms w, float& z, float& e) {
  z = partials.value + bias;
  const float product = __fmul_ru(x.value, w.value);
  const float operand = __fadd_ru(__fmul_ru(x.value, w.residual),
                                  __fmul_ru(x.residual, __fadd_ru(w.value, w.residual)));
  e = __fmaf_ru(p.bound.bias, fabsf(bias), p.bound.absolute);
  e = __fmaf_ru(p.bound.storage, partials.magnitude, e);
  e = __fmaf_ru(p.bound.accumulation, product, e);
  e = __fmaf_ru(p.bound.operand, operand, e);
  e = __fadd_ru(e, __fmul_ru(p.bound.rescore, __fadd_ru(product, fabsf(bias))));
  // Below 2^120 no partial sum of pass 1 or of the rescoring (each at most ~||x|| ||w||) can
  // overflow, which the error analysis assumes.
  return isfinite(z) && isfinite(e) && product < 0x1p120f;
}

__device__ __forceinline__ float widen(float g, float a, float b) {
  return 0x1p-16f * (fabsf(g) + fabsf(a) + fabsf(b)) + 0x1p-126f;
}

// [lo, hi] of scale * gelu over [z - e, z + e] as float32 computes it (see above).
__device__ __forceinline__ void value_interval(float z, float e, float scale, float& lo,
                                               float& hi) {
  const float a = __fsub_rd(z, e);
  const float b = __fadd_ru(z, e);
  const float ga = gelu(a);
  float g_lo, g_hi;
  if (a >= kGeluX0Above) {
    // gelu increases on [a, b]: one erf (see above).
    g_lo = __fsub_rd(ga, widen(ga, a, b));
    const float slope = fminf(__fmaf_ru(kTwoPhi0Above, fmaxf(b, 0.f), 0.5f), kGeluSlopeMaxAbove);
    g_hi = __fadd_ru(__fmaf_ru(__fsub_ru(b, a), slope, ga), widen(a, a, b));
  } else {
    const float gb = gelu(b);
    g_lo = b <= kGeluX0Below ? gb : kGeluMinLower;
    g_hi = fmaxf(ga, gb);
    g_lo = __fsub_rd(g_lo, widen(g_lo, a, b));
    g_hi = __fadd_ru(g_hi, widen(g_hi, a, b));
  }
  if (scale > 0.f) {
    lo = __fmul_rd(scale, g_lo);
    hi = __fmul_ru(scale, g_hi);
  } else {
    lo = __fmul_rd(scale, g_hi);
    hi = __fmul_ru(scale, g_lo);
  }
}

// [lo, hi] for one column; false when z~, its bound or either end is not finite (an overflow in
// the bound or in gelu * scale included): the row is then rescored whole, never compared with a
// NaN.
__device__ __forceinline__ bool column_value_interval(const SelectParams& p, SplitSum partials,
                                                      float bias, Norms x, Norms w, float& lo,
                                                      float& hi) {
  float z, e;
  if (!column_interval(p, partials, bias, x, w, z, e)) return false;
  value_interval(z, e, p.scale, lo, hi);
  return isfinite(lo) && isfinite(hi);
}

// Block-wide max (and OR of a flag) over kBlockWarps warps; every thread gets the result.
template <int kBlockWarps = kWarps>
__device__ __forceinline__ float block_max(float v, bool& flag, float* s_value, int* s_flag) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
#pragma unroll
  for (int mask = 16; mask >= 1; mask /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, mask));
  const bool any = __any_sync(0xffffffffu, flag);
  if (lane == 0) {
    s_value[warp] = v;
    s_flag[warp] = any;
  }
  __syncthreads();
  v = s_value[0];
  flag = s_flag[0];
#pragma unroll
  for (int w = 1; w < kBlockWarps; ++w) {
    v = fmaxf(v, s_value[w]);
    flag = flag || s_flag[w];
  }
  return v;
}

// Roundings on any term's path to a sum that rescore_dots or prepare_rows_kernel computes: an
// FMA chain per thread (4 per float4 piece, at most ceil(k4 / kThreads) pieces), 5 shuffle
// additions and kWarps - 1 additions of the warps' sums, then one more (the bias; the squares'
// floor). The bound's rho and gamma' are gamma of this depth (~K / 256, not K).
__host__ __device__ constexpr int64_t reduction_depth(int64_t k4) {
  return 4 * ((k4 + kThreads - 1) / kThreads) + 5 + (kWarps - 1) + 1;
}

// Block-wide sum of two values over kThreads threads in a fixed order (a shuffle tree, then the
// warps' sums in warp order); thread 0 gets the result.
__device__ __forceinline__ float2 block_sum(float2 v, float2* s_partial) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
#pragma unroll
  for (int mask = 16; mask >= 1; mask /= 2) {
    v.x += __shfl_xor_sync(0xffffffffu, v.x, mask);
    v.y += __shfl_xor_sync(0xffffffffu, v.y, mask);
  }
  if (lane == 0) s_partial[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    v = s_partial[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) {
      v.x += s_partial[w].x;
      v.y += s_partial[w].y;
    }
  }
  return v;
}

// The fp16 copies' scale exponents stay within +-kMaxScaleExponent, so that a row's and a
// column's inverse scales multiply to a normal float (forward_gemm_sm90.cuh's
// store_certified_partial). Past the clamp, rows are scaled less than their target: from a
// largest |v| of 2^78 (the weight's copy, target 2^14) or 2^74 (x, kPass1XScaleTarget), and from
// about 2^79 (65520 x 2^63) they overflow fp16 (an infinite z~ or norm: the row is rescored
// whole); rows below 2^-49 (x: 2^-53) are scaled less than they could be (more of them flushed, a
// larger residual, more candidates): correct either way.
constexpr int kMaxScaleExponent = kPreparedMaxScaleExponent;

// The exponent e of a row's scale 2^e (see the top): its largest magnitude times 2^e lands in
// [2^target, 2^(target + 1)), within +-kMaxScaleExponent; 0 for a zero or non-finite row.
__device__ __forceinline__ int scale_exponent(float largest, int target) {
  if (!(largest > 0.f) || !isfinite(largest)) return 0;
  return min(max(target - ilogbf(largest), -kMaxScaleExponent), kMaxScaleExponent);
}

// fp16(v), rounded to nearest, or 0 where |v| < 2^-14 (see the top: the tensor core never sees a
// subnormal), packed two to a register: every fp16 copy, the weight's and x's, is made by this.
__device__ __forceinline__ uint32_t fp16_pair(float a, float b) {
  const __half2 h = __floats2half2_rn(fabsf(a) < 0x1p-14f ? 0.f : a, fabsf(b) < 0x1p-14f ? 0.f : b);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// A norm bound from a sum of squares of scaled values (see the top):
// sqrt(squares + floor) slack 2^-e, every step rounded up; inverse = 2^-e.
__device__ __forceinline__ float norm_from_squares(float squares, float squares_floor,
                                                   float norm_slack, float inverse) {
  const float scaled_norm = __fmul_ru(__fsqrt_ru(__fadd_ru(squares, squares_floor)), norm_slack);
  return __fmul_ru(scaled_norm, inverse);
}

struct PrepareParams {
  const float* w;         // [n, k_padded], row stride ldw (a CTA per row)
  int64_t ldw;
  int64_t k4;             // k_padded / 4
  int64_t copy_halves;    // prepared_copy_halves(k_padded), a multiple of 64
  __half* copy;           // [n, copy_halves] (prepared_weight.h)
  float4* trailers;       // [n]
  float squares_floor;    // forward.cu's norm_constants
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
// order (lane s's term broadcast, then added) was 32 dependent shuffle-and-add steps per sum:
// 13% of select_rescore_kernel's stall samples at B = 128 (NOTES, 2026-12-01).
// One lane per split: at most 32 (static_assert at kFusedMaxSplits).
__device__ __forceinline__ Norms x_row_norms(const SelectParams& p, int64_t row, int lane) {
  const bool mine = lane < p.splits;
  float squares = 0.f, residual_squares = 0.f;
  int exponent = INT_MAX;  // no split: never the smallest
  if (mine) {
    // Row-major by split, so that a warp's 32 lanes read one row's splits in 4 sectors
    // (split-major, each lane's sum was a sector of its own: 8 times the row's bytes, and 16% of
    // select_rescore_kernel's stall samples at B = 128 waited on them; Nsight Compute, 2026-12-01).
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

// Columns the selection serves: its CTA keeps the row's upper ends in shared memory, 16 KB at this
// width; wider layers take the 3xTF32 path.
constexpr int64_t kMaxSelectColumns = 4096;
__host__ __device__ constexpr int select_smem_bytes(int64_t n) {
  return static_cast<int>(n * sizeof(float));
}

// Threads of a selection CTA (one row): 128, 4 columns each at N = 512, 12 CTAs per SM at 40
// registers. Against 256 threads at 6 per SM, the per-CTA code (the x norms, the block max, the
// candidate slots) is paid once per 4 columns instead of 2 (Nsight Compute at B = 1024: 4.85 ->
// 3.52 M warp instructions) and B = 1024's rows fit in one wave (1.29 waves before). Measured on
// the H200: selection 26.6 -> 17.8 us at B = 4096, 8.8 unchanged at 1024 (Nsight Compute: SMs
// active ~70% of the kernel's time there either way; NOTES).
constexpr int kSelectThreads = 128;
constexpr int kSelectWarps = kSelectThreads / 32;
// Adjacent columns a selection thread takes per loop step (the kernel's template argument): 1,
// or 4 where N % 4 == 0, each split's four partials then in one 8-byte load and all of the step's
// loads in flight at once: at N = 512 a thread's whole share in one round trip instead of four.
// Four need 64 registers, 8 CTAs per SM instead of 12: measured on the H200 (NOTES), selection
// 8.4 -> 7.0 us at B = 1024, whose rows fit in one wave of 8 per SM, but 19.0 -> 19.6-20.1 at
// 4096 (3.9 waves instead of 2.6), so four only where the rows fit in one such wave.
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
    // their own loads, they were a round trip of their own) in flight behind the x norms'. Issued
    // by every thread (a thread past the row's end re-reads its last columns, never used): under
    // `if (first_column < p.n)` ptxas converted the bfloat16 partials inside the branch, so it
    // waited for them before the x norms' loads were issued, a round trip of its own (SASS).
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

// One CTA per row, with every load it needs in flight together: the first version (a serial chain
// of S loads per column for the weight norms) was latency-bound, ~13 us at B = 1024, and one warp
// per row with batched loads left too few warps to hide the latency (65 us). Here warp 0 first
// takes the row's x norms (x_row_norms; a kernel of their own cost a launch), passed on through
// shared memory before the column loop, so that none of that code's registers are live in it. Then
// the CTA computes each column's interval once (its S split partials loaded at once, the weight's
// norms from prepare_rows_kernel), keeping its upper end in shared memory, and takes the block max
// of the lower ends. Each candidate takes its slot in the row's list from a shared counter: the
// list's order depends on the warps' timing, its contents and count do not, and neither do the
// rescoring's results (rescore_kernel: every column's arithmetic is the same in any slot, and the
// arg-max rule orders by value, then index). 40 registers with one column per thread, 64 with four
// (at 8 splits), no spill. The square roots' slow path (arguments below 2^-101: zero and tiny rows;
// Inf, NaN) is a call, in warp 0 only.
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
// placeholder: most rows have 1-2 candidates (1.74 on average on the benchmarks' data at B =
// 1024), and a fixed group of 4 read a placeholder weight row for each empty slot (with the
// earlier bound's 4.05 candidates: 7.5 row reads of 32 KB per row instead of 5.7).
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
// time, so residency decides the speed: 64 registers for 4 CTAs per SM (80 and 3 before: rescoring
// 40.6 -> 34.5 us at B = 1024, 123.7 -> 106.9 at 4096 on the H200). ptxas -v reports 16 bytes of
// spill stores and 56 of loads at that cap; Nsight Compute counted 75 K local-memory requests at B
// = 1024, ~0.3 per thread, so none sits in the K loop.
__global__ void __launch_bounds__(kThreads, 4)
    rescore_kernel(const RescoreParams p, float* __restrict__ out, int64_t* __restrict__ argmax,
                   float* __restrict__ preactivation) {
  wait_for_previous_grid();  // the selection's writes
  __shared__ RescoreScratch<1> scratch;
  const int64_t row = p.rescore_rows[blockIdx.x];
  rescore_row<false, 1>(p, row, p.rescore_counts[blockIdx.x],
                        p.candidates + row * kMaxCandidates, scratch, out, argmax, preactivation);
}

// Splits of pass 1 that select_rescore_kernel sums, at most: the rows it serves are few (at most
// one per SM), so pass 1 fills the GPU by splitting K finely, and a thread loads each column's
// partials of every split at once (load_split_partials: 32 registers, one column per thread).
constexpr int kFusedMaxSplits = 32;
static_assert(kMaxSplits <= 32 && kFusedMaxSplits <= 32, "x_row_norms: one lane per split");
// select_rescore_kernel's CTA: two rescoring groups of kThreads.
constexpr int kFusedGroups = 2;
constexpr int kFusedThreads = kFusedGroups * kThreads;

// The selection and the rescoring of a row by one CTA, for batches of at most one row per SM
// (forward.cu's certified_fused_rows): the two kernels' CTAs for a row, with the candidates handed
// over in shared memory instead of global memory and a launch. Alone, each kernel at B = 128 (K =
// 8192, N = 512, H200) spends its time on one CTA per SM's chain of round trips to L2 (selection
// ~4 us, rescoring ~7 own); a first fused form with 256 threads took 12.3-12.9 us for both
// (Nsight Compute: 13.5 cycles per issued instruction at 8 warps per SM, 23% of the samples on
// the x norms and the barrier after them, 38% on two rounds of 32 split loads per thread; NOTES).
// So here 512 threads: one column per thread at N = 512 (every split load of the row in one round
// trip), the x norms taken by every warp while its loads are in flight (select_row's
// kNormsPerWarp), and two candidates rescored at once (rescore_row's groups). Same arithmetic per
// column as the two kernels, so the same results, and p.count[row] as the selection writes it.
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

}  // namespace cuda
}  // namespace fused_pool_gelu
