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
#include "checks.h"
#include "cpu/dtypes.h"
#include "cpu/huge_pages.h"
#include "summation_order.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

namespace fused_pool_gelu {
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

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_backward_cpu(
    const c10::optional<at::Tensor>& grad_out, const c10::optional<at::Tensor>& grad_preactivation,
    const at::Tensor& x, const at::Tensor& weight, const at::Tensor& argmax,
    const at::Tensor& preactivation, double scale) {
  check_forward_backward_inputs(grad_out, grad_preactivation, x, weight, argmax, preactivation);
  check_dtype_in("forward_backward", "x", x, kCpuDtypes, kCpuDtypesText);
  if (is_reduced_float(x)) {
    auto [grad_x, grad_weight, grad_bias] = forward_backward_cpu(
        to_float(grad_out), to_float(grad_preactivation), x.to(at::kFloat), weight.to(at::kFloat),
        argmax, preactivation.to(at::kFloat), scale);
    const auto dtype = x.scalar_type();
    return {grad_x.to(dtype), grad_weight.to(dtype), grad_bias.to(dtype)};
  }
  const int64_t batch = x.size(0);
  const int64_t in_features = x.size(1);
  const int64_t pooled = weight.size(0);

  const at::Tensor argmax_c = argmax.contiguous();
  const int64_t* argmax_ptr = argmax_c.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(argmax_ptr[b] >= 0 && argmax_ptr[b] < pooled,
                "fused_pool_gelu.forward_backward: argmax must hold indices in [0, ", pooled,
                "), got ", argmax_ptr[b], " at position ", b);
  }

  const at::Tensor x_c = x.contiguous();
  const at::Tensor weight_c = weight.contiguous();
  at::Tensor grad_x = cpu::empty_with_huge_pages({batch, in_features}, x.options());
  at::Tensor grad_weight = cpu::empty_with_huge_pages({pooled, in_features}, x.options()).zero_();
  at::Tensor grad_bias = at::zeros({pooled}, x.options());
  if (batch == 0) return {grad_x, grad_weight, grad_bias};

  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "forward_backward_cpu", [&] {
    const scalar_t s = static_cast<scalar_t>(scale);
    at::Tensor dz = at::empty({batch}, x.options());
    scalar_t* dz_ptr = dz.mutable_data_ptr<scalar_t>();
    const at::Tensor pre = preactivation.contiguous();
    const at::Tensor g_out = grad_out.has_value() ? grad_out->contiguous() : at::Tensor();
    const at::Tensor g_pre =
        grad_preactivation.has_value() ? grad_preactivation->contiguous() : at::Tensor();
    const scalar_t* pre_ptr = pre.const_data_ptr<scalar_t>();
    for (int64_t b = 0; b < batch; ++b) {
      scalar_t d = scalar_t(0);
      if (g_out.defined()) d = g_out.const_data_ptr<scalar_t>()[b] * s * gelu_grad(pre_ptr[b]);
      if (g_pre.defined()) d += g_pre.const_data_ptr<scalar_t>()[b];
      dz_ptr[b] = d;
    }

    const scalar_t* x_ptr = x_c.const_data_ptr<scalar_t>();
    const scalar_t* w_ptr = weight_c.const_data_ptr<scalar_t>();
    scalar_t* gx_ptr = grad_x.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
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
    at::parallel_for(0, in_features, kColumnGrain, [&](int64_t begin, int64_t end) {
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

}  // namespace

TORCH_LIBRARY_IMPL(fused_pool_gelu, CPU, m) {
  m.impl("forward_backward", &forward_backward_cpu);
}

}  // namespace fused_pool_gelu
