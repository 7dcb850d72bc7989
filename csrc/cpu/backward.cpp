// CPU arg-max backward of forward_with_argmax (docs/design.md, "The backward").
//
// Only the arg-max column of each row carries gradient:
//   dz[b]          = grad_out[b] * scale * gelu'(z[b, j*]) + grad_preactivation[b]
//   grad_x[b, :]   = dz[b] * weight[j*(b), :]                         (a gather)
//   grad_weight[n] = sum over rows b with j*(b) = n of dz[b] * x[b]   (a scatter-add)
//   grad_bias[n]   = sum over the same rows of dz[b]
// O(B*K + N*K) work instead of the dense backward's two GEMMs. The scatter-add runs in the fixed
// order of summation_order.h (the CUDA backward's), each thread owning a range of columns: the
// result does not depend on the thread count, and given the same dz it is the CUDA result.
#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "checks.h"
#include "cpu/dtypes.h"
#include "cpu/huge_pages.h"
#include "cpu/kernels.h"
#include "summation_order.h"

namespace fused_pool_gelu {
namespace cpu {
namespace {

// Columns per parallel_for task of the scatter-add: each task walks every sorted row for its
// columns, so the grain trades that per-task walk against load balance; 256 columns (1 KB of a
// float32 row) keep the walk small next to the adds at K = 8192 (32 tasks). Not measured.
constexpr int64_t kColumnGrain = 256;

template <typename scalar_t>
scalar_t gelu_grad(scalar_t z) {
  const scalar_t cdf = scalar_t(0.5) * (scalar_t(1) + std::erf(z * scalar_t(M_SQRT1_2)));
  const scalar_t pdf = std::exp(scalar_t(-0.5) * z * z) * scalar_t(0.5 * M_2_SQRTPI * M_SQRT1_2);
  return cdf + z * pdf;
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor> forward_backward(
    const std::optional<Tensor>& grad_out, const std::optional<Tensor>& grad_preactivation,
    const Tensor& x, const Tensor& weight, const Tensor& argmax, const Tensor& preactivation,
    double scale) {
  check_forward_backward_inputs(grad_out, grad_preactivation, x, weight, argmax, preactivation);
  check_dtype_in("forward_backward", "x", x, kCpuDtypes, kCpuDtypesText);
  if (is_reduced_float(x)) {
    auto [grad_x, grad_weight, grad_bias] = forward_backward(
        to_float(grad_out), to_float(grad_preactivation), aten::to_dtype(x, kFloat),
        aten::to_dtype(weight, kFloat), argmax, aten::to_dtype(preactivation, kFloat), scale);
    const ScalarType dtype = x.scalar_type();
    return {aten::to_dtype(grad_x, dtype), aten::to_dtype(grad_weight, dtype),
            aten::to_dtype(grad_bias, dtype)};
  }
  const int64_t batch = x.size(0);
  const int64_t in_features = x.size(1);
  const int64_t pooled = weight.size(0);

  const Tensor argmax_c = aten::contiguous(argmax);
  const int64_t* argmax_ptr = argmax_c.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    FPG_CHECK(argmax_ptr[b] >= 0 && argmax_ptr[b] < pooled,
                "fused_pool_gelu.forward_backward: argmax must hold indices in [0, ", pooled,
                "), got ", argmax_ptr[b], " at position ", b);
  }

  const Tensor x_c = aten::contiguous(x);
  const Tensor weight_c = aten::contiguous(weight);
  Tensor grad_x = empty_with_huge_pages(x, {batch, in_features});
  Tensor grad_weight = empty_with_huge_pages(x, {pooled, in_features});
  aten::zero_(grad_weight);
  Tensor grad_bias = aten::zeros_like_device(x, {pooled});
  if (batch == 0) return {grad_x, grad_weight, grad_bias};

  dispatch_cpu_floating(x.scalar_type(), "forward_backward", [&](auto type) {
    using scalar_t = decltype(type);
    const scalar_t s = static_cast<scalar_t>(scale);
    std::vector<scalar_t> dz(batch);
    scalar_t* dz_ptr = dz.data();
    const Tensor pre = aten::contiguous(preactivation);
    const std::optional<Tensor> g_out =
        grad_out ? std::optional<Tensor>(aten::contiguous(*grad_out)) : std::nullopt;
    const std::optional<Tensor> g_pre =
        grad_preactivation ? std::optional<Tensor>(aten::contiguous(*grad_preactivation))
                           : std::nullopt;
    const scalar_t* pre_ptr = pre.const_data_ptr<scalar_t>();
    const scalar_t* g_out_ptr = g_out ? g_out->const_data_ptr<scalar_t>() : nullptr;
    const scalar_t* g_pre_ptr = g_pre ? g_pre->const_data_ptr<scalar_t>() : nullptr;
    for (int64_t b = 0; b < batch; ++b) {
      scalar_t d = scalar_t(0);
      if (g_out_ptr) d = g_out_ptr[b] * s * gelu_grad(pre_ptr[b]);
      if (g_pre_ptr) d += g_pre_ptr[b];
      dz_ptr[b] = d;
    }

    const scalar_t* x_ptr = x_c.const_data_ptr<scalar_t>();
    const scalar_t* w_ptr = weight_c.const_data_ptr<scalar_t>();
    scalar_t* gx_ptr = grad_x.mutable_data_ptr<scalar_t>();
    parallel_for(0, batch, grain_for_work(in_features), [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const scalar_t* w_row = w_ptr + argmax_ptr[b] * in_features;
        scalar_t* gx_row = gx_ptr + b * in_features;
        for (int64_t c = 0; c < in_features; ++c) gx_row[c] = dz_ptr[b] * w_row[c];
      }
    });

    // The rows grouped by arg-max, increasing b within a group (a stable counting sort): segment
    // n is order[starts[n] .. starts[n + 1]).
    std::vector<int64_t> starts(pooled + 1, 0);
    for (int64_t b = 0; b < batch; ++b) ++starts[argmax_ptr[b] + 1];
    for (int64_t n = 0; n < pooled; ++n) starts[n + 1] += starts[n];
    std::vector<int64_t> order(batch);
    std::vector<int64_t> next(starts.begin(), starts.end() - 1);
    for (int64_t b = 0; b < batch; ++b) order[next[argmax_ptr[b]]++] = b;

    // Each segment's rows in pieces that end at multiples of kSegmentTileRows sorted positions,
    // each piece summed from zero and then added to the segment's sum (grad_weight starts at zero,
    // and 0 + piece is the piece: a piece is never -0).
    scalar_t* gw_ptr = grad_weight.mutable_data_ptr<scalar_t>();
    scalar_t* gb_ptr = grad_bias.mutable_data_ptr<scalar_t>();
    parallel_for(0, in_features, std::max(kColumnGrain, grain_for_work(batch)),
                 [&](int64_t begin, int64_t end) {
      std::vector<scalar_t> piece(end - begin);
      for (int64_t n = 0; n < pooled; ++n) {
        scalar_t* gw_row = gw_ptr + n * in_features;
        for (int64_t p = starts[n]; p < starts[n + 1]; ++p) {
          if (p == starts[n] || p % kSegmentTileRows == 0) {
            if (p != starts[n]) {
              for (int64_t c = begin; c < end; ++c) gw_row[c] += piece[c - begin];
            }
            std::fill(piece.begin(), piece.end(), scalar_t(0));
          }
          const scalar_t d = dz_ptr[order[p]];
          const scalar_t* x_row = x_ptr + order[p] * in_features;
          for (int64_t c = begin; c < end; ++c) piece[c - begin] += d * x_row[c];
        }
        if (starts[n] != starts[n + 1]) {
          for (int64_t c = begin; c < end; ++c) gw_row[c] += piece[c - begin];
        }
      }
    });
    for (int64_t n = 0; n < pooled; ++n) {
      scalar_t piece = 0;
      for (int64_t p = starts[n]; p < starts[n + 1]; ++p) {
        if (p != starts[n] && p % kSegmentTileRows == 0) {
          gb_ptr[n] += piece;
          piece = 0;
        }
        piece += dz_ptr[order[p]];
      }
      if (starts[n] != starts[n + 1]) gb_ptr[n] += piece;
    }
  });
  return {grad_x, grad_weight, grad_bias};
}

}  // namespace cpu

STABLE_TORCH_LIBRARY_IMPL(fused_pool_gelu, CPU, m) {
  m.impl("forward_backward", TORCH_BOX(&cpu::forward_backward));
}

}  // namespace fused_pool_gelu
