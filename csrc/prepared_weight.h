// The prepared weight: prepare_weight's output and an optional argument of forward and
// forward_with_argmax (schemas in registration.cpp).
//
// What the certified forward (cuda/certified.cuh) reads of the pooled weight besides its
// float32 rows: an fp16 copy of every row scaled by a power of two, its inverse scale and upper
// bounds on two norms. Made per call otherwise (a DRAM read of the whole weight, ~10 us at the
// default shape on an H200), it can be made once when the weight is folded: ModelNew keeps one
// next to its cached fold. Layout, a 1-D uint8 tensor of prepared_bytes(N, K) bytes:
//   the copy, N rows of C = prepared_copy_halves(K) fp16 values: fp16(weight[n, i] 2^e_n) rounded
//     to nearest for i < K, 0 where that magnitude is below 2^-14 (fp16's smallest normal), then
//     zeros up to C (128-byte rows: pass 1's TMA boxes then start on 128-byte lines, which a
//     trailer inside each row would shift);
//     e_n puts the row's largest magnitude in [2^14, 2^15) (|e_n| <= 63). Within each block of
//     64 columns the values are in pass 1's multiply order, not in column order: column i's
//     group of 4 is stored as group prepared_copy_group(i / 4);
//   then N trailers of 4 float32: an upper bound on ||weight[n]||_2, one on the norm of the copy's
//     residual ||weight[n] - copy[n] 2^-e_n||_2, 2^-e_n, and 0.
// Bytes, not float16: the trailers' float32 bits are no fp16 values (some would read as NaN).
// The layout is this build's: nothing in the buffer names it, so one saved by another version
// with another layout would be read wrongly without an error.
// The CPU forward does not use it (it is validated and ignored there), nor do the CUDA paths other
// than the certified one; every device makes the same layout.
//
// A prepared weight is tied to the tensor it was made from; the stable ABI shows neither a tensor's
// storage nor its version counter, so that tie is kept in Python (fused_pool_gelu/_prepared.py):
// the kernels check the layout alone.
#pragma once

#include <cstdint>

#include "stable_tensor.h"

namespace fused_pool_gelu {

constexpr int64_t kPreparedTrailerBytes = 16;  // 4 float32

// Halves of a row's copy: K rounded up to a multiple of 64 (128-byte rows).
constexpr int64_t prepared_copy_halves(int64_t in_features) { return (in_features + 63) / 64 * 64; }

// Where column group `group` (columns 4 group .. 4 group + 3) of a row is stored in its copy.
// Pass 1 reads x in float32 from a 128-byte-swizzled tile and converts it into the m16n8k16 A
// fragment, whose lane (g, t) holds K positions 2t, 2t+1, 2t+8 and 2t+9 of each 16. Taken in
// column order, lanes g and g ^ 1 hit the same banks (the swizzle XORs the 16-byte chunk with the
// row's g): 37% of those loads' wavefronts would be conflicts. The bound
// does not depend on the order of the products along K, so the weight's copy takes the order that
// makes them conflict-free: in a block of 64 columns, group bits (g3 g2 g1 g0) move to (g3 g1 g0
// g2), so that lanes t < 2 and t >= 2 read chunks 4 apart, which no XOR with g < 4 or g >= 4 can
// make meet (certified_pass1_sm90a.cu's certified_pass1_kernel, x_offset).
constexpr int64_t prepared_copy_group(int64_t group) {
  const int64_t g = group & 15;
  return (group & ~int64_t{15}) | (g & 8) | ((g & 3) << 1) | ((g >> 2) & 1);
}

// Bytes before the trailers, and in all.
constexpr int64_t prepared_copy_bytes(int64_t rows, int64_t in_features) {
  return rows * 2 * prepared_copy_halves(in_features);
}
constexpr int64_t prepared_bytes(int64_t rows, int64_t in_features) {
  return prepared_copy_bytes(rows, in_features) + rows * kPreparedTrailerBytes;
}

// The scale exponents stay within +-63, so that a weight row's and an x row's inverse scales
// multiply to a normal float (cuda/certified.cuh); rows whose largest magnitude is about 2^79
// (65520 x 2^63) or more then overflow fp16 (an infinite norm: the forward rescores every column
// of every row).
constexpr int kPreparedMaxScaleExponent = 63;

// The norms' floor per term: a float32 sum of squares loses at most 2^-149 per term in float's
// subnormal range (cuda/certified.cuh's top), and every norm bound, the CUDA kernels' and the
// CPU prepare_weight's, is taken as sqrt(sum + K 2^-148), twice that.
constexpr double kNormSquaresFloorPerTerm = 0x1p-148;

// The trailer's float32 slots.
constexpr int kPreparedNorm = 0;
constexpr int kPreparedResidualNorm = 1;
constexpr int kPreparedInverseScale = 2;

// Raises, naming `op`, unless `prepared` has the layout of a prepare_weight output for `weight`
// (device, dtype, shape, not a view).
void check_prepared_weight(const char* op, const Tensor& prepared, const Tensor& weight);

}  // namespace fused_pool_gelu
