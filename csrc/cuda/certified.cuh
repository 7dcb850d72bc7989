// Certified single pass (sm_90a, float32; the default from kCertifiedMinBatch rows, see
// forward_plan.h's use_certified and FUSED_POOL_GELU_CERTIFIED; measurements in
// docs/performance.md, "Certified or 3xTF32"): a single-pass fp16 GEMM
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
//  3. Tensor-core accumulation. Model (docs/design.md's u = 2^-23 for tensor cores; Fasi et al.
//     2021 measured tensor cores aligning the addends to the largest exponent and truncating):
//     one k8 step adds its 8 products to the accumulator with an error below 10 u (|acc| +
//     sum |p|), u = 2^-23 (9 aligned addends, one normalization). A k16 step of fp16 wgmma adds
//     its 16 products as one block (17 aligned addends: below 18 u) or as two such k8 steps:
//     either way within the k8 model applied twice.
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
//  6. Storage (certified_pass1_sm90a.cu's store_certified_partial): each p_s is stored rounded to
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
//  reduction_depth, norm_constants below); x's from pass 1's per-split sums
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
// uncapped form alone would let ~48 of 96 columns per row through at |z| ~ 1e19).
// Candidates: the columns with hi_n >= M = max_n lo_n. Any other column's computed value would
// be below M, which the column attaining M reaches: it cannot be the winner, so the answer is
// the one rescoring every column would give (same torch.max rule on NaN and ties). A row with a
// non-finite z~, bound or value end, with ||x|| ||w|| >= 2^120 somewhere (where float32 sums
// could overflow), or with more than kMaxCandidates candidates, is rescored entirely.
//
// Pass 1 is certified_pass1_sm90a.cu's certified_pass1_kernel; the host side: the bound's
// constants below, the launches in certified.cu, use_certified in forward_plan.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/row_max.cuh"
#include "cuda/tile_sizes.h"
#include "prepared_weight.h"

namespace fused_pool_gelu {
namespace cuda {
namespace certified {

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
// share), so a row with 5-7 candidates reads 3.5-4.5 times the bytes of one with 1 (most
// rows) at about the same rate. Launched in row order, such a row could start in the last wave
// and finish alone; heavy rows first, the last wave holds only light rows (longest-first
// scheduling in two classes: the selection appends heavy rows at the front of the order and light
// ones at the back). Measured: docs/performance.md, "Certified or 3xTF32".
constexpr int kRescoreHeavyCandidates = 2;

// The kernels below that sum pass 1's splits are compiled for a bound kSplitBound on the split
// count (the smallest of 1, 2, 4, ... at or above it, up to kMaxSplits for select_candidates_kernel
// and kFusedMaxSplits for select_rescore_kernel: common.cuh's dispatch_split_bound), so
// that their loads are all issued at once (a chain of S dependent loads per column makes the
// selection latency-bound) and a call with fewer splits issues few loads past its last split
// (B = 4096 takes two splits; loads for 8 would slow its selection by ~15%).

// Pass 1's split partials of kColumns adjacent columns of one row, from index = row * n + col of
// each split, every load issued at once, as sum_few_splits does (loads past the last split re-read
// it), but indexed in 32 bits (kMaxSplits or kFusedMaxSplits x rows x N fits, see kMaxSplits) and
// widened only after a split's offset is added: unsigned 32-bit sums cannot be widened term by
// term, so the compiler keeps each split's index in one register. From sum_few_splits' pointer
// (row_partial + col) it may keep a 64-bit address per split across the column loop: 8 more
// registers at 8 splits, spills at the 40-register cap. Each load's address also takes 2
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
// column's inverse scales multiply to a normal float (certified_pass1_sm90a.cu's
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

// ---- The bound's constants, on the host.

// The smallest float at or above v (the bound's constants are computed in double).
inline float round_up_to_float(double v) {
  const float f = static_cast<float>(v);
  return static_cast<double>(f) >= v ? f : std::nextafter(f, INFINITY);
}

// gamma_m(u) = m u / (1 - m u): how far m roundings of unit roundoff u can move a result.
inline double gamma(double terms, double u) { return terms * u / (1.0 - terms * u); }

// A norm bound's constants (see the top) for sums of squares of k_padded terms at most `depth`
// roundings deep: the floor K 2^-148 for the terms lost below the normal range, and
// the slack 1 + gamma_depth(2^-24) + 2^-22, both rounded up.
inline void norm_constants(int64_t k_padded, double depth, float& squares_floor,
                           float& norm_slack) {
  squares_floor = round_up_to_float(static_cast<double>(k_padded) * kNormSquaresFloorPerTerm);
  norm_slack = round_up_to_float(1.0 + gamma(depth, 0x1p-24) + 0x1p-22);
}

// The bound's constants (see the top, steps 1-6), computed in double and rounded up.
// chain_products: products a tensor-core accumulation chain sums before pass 1 adds it into
// float32 registers (a whole split when it never flushes).
inline Bound certified_bound(int64_t k_padded, int64_t splits, int64_t chain_products) {
  const double k = static_cast<double>(k_padded);
  const double s = static_cast<double>(splits);
  const double chain = static_cast<double>(chain_products);
  const auto up = round_up_to_float;
  const double depth = static_cast<double>(reduction_depth(k_padded / 4));
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

}  // namespace certified
}  // namespace cuda
}  // namespace fused_pool_gelu
