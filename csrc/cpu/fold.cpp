// CPU fold: average-pool groups of k rows of the Linear weight (and bias), and its adjoint.
//
// AvgPool1d over the outputs of a Linear is itself a Linear whose rows are the group means:
//   mean_r (x . W[n*k + r] + b[n*k + r]) = x . mean_r W[n*k + r] + mean_r b[n*k + r].
// Rows N*k .. O-1 (the O % k tail, dropped by AvgPool1d's floor) never reach the output.
#include <algorithm>
#include <tuple>

#include "checks.h"
#include "cpu/dtypes.h"
#include "cpu/huge_pages.h"
#include "cpu/kernels.h"

namespace fused_pool_gelu {
namespace cpu {
namespace {

// Columns per register tile of pool_rows: 16 float32 sums are four SSE registers.
constexpr int64_t kPoolColumns = 16;

// Means of the k rows of `group` (row stride `stride`) over its first `width` <= kPoolColumns
// columns, into `out`: each column summed over the rows in order, then divided by k. The sums stay
// in registers while the rows stream past (a loop over whole rows would store and reload them for
// every row: a 32 KB row at K = 8192 does not stay in L1). A half type is summed and divided in
// float32 and rounded once: the float32 kernel's answer on the widened values, without the
// whole-matrix copies to float32 and back (a 256 MB float32 weight at the default shape).
template <typename scalar_t>
void pool_columns(const scalar_t* group, int64_t stride, int64_t k, scalar_t* out,
                  int64_t width) {
  using opmath = opmath_t<scalar_t>;
  opmath sums[kPoolColumns];
  for (int64_t c = 0; c < kPoolColumns; ++c) {
    sums[c] = c < width ? static_cast<opmath>(group[c]) : opmath(0);
  }
  for (int64_t r = 1; r < k; ++r) {
    const scalar_t* row = group + r * stride;
    for (int64_t c = 0; c < kPoolColumns; ++c) {
      sums[c] += c < width ? static_cast<opmath>(row[c]) : opmath(0);
    }
  }
  for (int64_t c = 0; c < width; ++c) {
    out[c] = static_cast<scalar_t>(sums[c] / static_cast<opmath>(k));
  }
}

// Rows of `dst` [rows, cols] are means of k consecutive rows of `src` (row stride src_stride).
template <typename scalar_t>
void pool_rows(const scalar_t* src, int64_t src_stride, scalar_t* dst, int64_t rows,
               int64_t cols, int64_t k) {
  parallel_for(0, rows, grain_for_work(k * cols), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const scalar_t* group = src + n * k * src_stride;
      scalar_t* out = dst + n * cols;
      // Whole tiles with a constant width, for which the bounds tests fold away, then the rest.
      int64_t c0 = 0;
      for (; c0 + kPoolColumns <= cols; c0 += kPoolColumns) {
        pool_columns(group + c0, src_stride, k, out + c0, kPoolColumns);
      }
      if (c0 < cols) pool_columns(group + c0, src_stride, k, out + c0, cols - c0);
    }
  });
}

// grad_weight[n*k + r] = grad_pooled_weight[n] / k for n < N, tail rows zero; bias likewise.
// A group's rows are equal: the first of them in this thread's range is divided, the others are
// copies of the row before (one division per pooled element, not k). A half type's quotient is
// taken in float32 and rounded once, as converting to float32 and back around the float32 kernel
// would give, without the two whole-matrix copies (a 256 MB float32 intermediate at the default
// shape).
template <typename scalar_t>
void expand_rows(const scalar_t* src, int64_t src_stride, scalar_t* dst, int64_t pooled,
                 int64_t out_rows, int64_t cols, int64_t k) {
  using opmath = opmath_t<scalar_t>;
  parallel_for(0, out_rows, grain_for_work(cols), [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      scalar_t* out = dst + o * cols;
      const int64_t n = o / k;
      if (n >= pooled) {
        std::fill(out, out + cols, scalar_t(0));
      } else if (o % k == 0 || o == begin) {
        const scalar_t* row = src + n * src_stride;
        for (int64_t c = 0; c < cols; ++c) {
          out[c] = static_cast<scalar_t>(static_cast<opmath>(row[c]) / static_cast<opmath>(k));
        }
      } else {
        std::copy(out - cols, out, out);
      }
    }
  });
}

}  // namespace

std::tuple<Tensor, Tensor> fold(const Tensor& weight, const std::optional<Tensor>& bias,
                                int64_t pool_kernel_size) {
  check_fold_inputs(weight, bias, pool_kernel_size);
  check_dtype_in("fold", "weight", weight, kCpuDtypes, kCpuDtypesText);
  const int64_t k = pool_kernel_size;
  const int64_t pooled = weight.size(0) / k;
  const int64_t in_features = weight.size(1);
  // Rows must be unit-stride for the inner loop; a transposed or sliced weight is copied once.
  const Tensor w = weight.stride(1) == 1 ? weight : torch::stable::contiguous(weight);
  Tensor pooled_weight = empty_with_huge_pages(weight, {pooled, in_features});
  Tensor pooled_bias = bias.has_value() ? aten::empty_like_device(weight, {pooled})
                                        : aten::zeros_like_device(weight, {pooled});
  dispatch_cpu_floating</*with_halves=*/true>(weight.scalar_type(), "fold", [&](auto type) {
    using scalar_t = decltype(type);
    pool_rows<scalar_t>(w.const_data_ptr<scalar_t>(), w.stride(0),
                        pooled_weight.mutable_data_ptr<scalar_t>(), pooled, in_features, k);
    if (bias.has_value()) {
      const Tensor b = aten::contiguous(*bias);
      pool_rows<scalar_t>(b.const_data_ptr<scalar_t>(), 1, pooled_bias.mutable_data_ptr<scalar_t>(),
                          pooled, 1, k);
    }
  });
  return {pooled_weight, pooled_bias};
}

std::tuple<Tensor, Tensor> fold_backward(const Tensor& grad_pooled_weight,
                                         const Tensor& grad_pooled_bias, int64_t out_features,
                                         int64_t pool_kernel_size) {
  check_fold_backward_inputs(grad_pooled_weight, grad_pooled_bias, out_features, pool_kernel_size);
  check_dtype_in("fold_backward", "grad_pooled_weight", grad_pooled_weight, kCpuDtypes,
                 kCpuDtypesText);
  const int64_t k = pool_kernel_size;
  const int64_t pooled = grad_pooled_weight.size(0);
  const int64_t in_features = grad_pooled_weight.size(1);
  const Tensor gw = grad_pooled_weight.stride(1) == 1 ? grad_pooled_weight
                                                      : torch::stable::contiguous(grad_pooled_weight);
  const Tensor gb = aten::contiguous(grad_pooled_bias);
  // The step's largest write (256 MB at the default shape): huge pages (cpu/huge_pages.h).
  Tensor grad_weight = empty_with_huge_pages(gw, {out_features, in_features});
  Tensor grad_bias = aten::empty_like_device(gw, {out_features});
  dispatch_cpu_floating</*with_halves=*/true>(gw.scalar_type(), "fold_backward", [&](auto type) {
    using scalar_t = decltype(type);
    expand_rows<scalar_t>(gw.const_data_ptr<scalar_t>(), gw.stride(0),
                          grad_weight.mutable_data_ptr<scalar_t>(), pooled, out_features,
                          in_features, k);
    expand_rows<scalar_t>(gb.const_data_ptr<scalar_t>(), 1, grad_bias.mutable_data_ptr<scalar_t>(),
                          pooled, out_features, 1, k);
  });
  return {grad_weight, grad_bias};
}

}  // namespace cpu

STABLE_TORCH_LIBRARY_IMPL(fused_pool_gelu, CPU, m) {
  m.impl("fold", TORCH_BOX(&cpu::fold));
  m.impl("fold_backward", TORCH_BOX(&cpu::fold_backward));
}

}  // namespace fused_pool_gelu
