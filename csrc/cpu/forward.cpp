// CPU forward: out[b] = max_n scale * gelu(x[b] . pooled_weight[n] + pooled_bias[n]).
//
// The GEMM goes through ATen (BLAS): it is the fastest correct CPU matmul we have. It runs over
// blocks of rows so the [rows, N] product is a bounded scratch (rows_per_block) instead of a
// [B, N] tensor, and one fused pass over each block does bias + GELU + scale + max + arg-max,
// evaluating the GELU (a scalar erf) only for the columns that can win (best_column_of_row).
#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "argmax_band.h"
#include "checks.h"
#include "cpu/dtypes.h"
#include "cpu/kernels.h"
#include "prepared_weight.h"

namespace fused_pool_gelu {
namespace cpu {
namespace {

// Rows per GEMM block: as many as keep the block's [rows, N] product within kProductBytes (the
// CUDA forward's workspace bound, kMaxWorkspaceFloats in cuda/forward_plan.h), and at least
// kMinRowsPerBlock. Each block's GEMM reads the whole pooled weight again, which fewer blocks read
// fewer times (research/README.md, "CPU path (2-core EPYC)").
constexpr int64_t kProductBytes = int64_t{16} << 20;
constexpr int64_t kMinRowsPerBlock = 256;

int64_t rows_per_block(int64_t pooled, int64_t element_bytes) {
  return std::max(kMinRowsPerBlock, kProductBytes / (std::max<int64_t>(pooled, 1) * element_bytes));
}

// scale * gelu(z), with a non-finite pre-activation giving NaN. Why: the reference reaches Inf
// through the unpooled rows (the mean of +Inf and -Inf rows is NaN there, a finite weight mean
// here), and torch's GELU maps -Inf to NaN but +Inf to +Inf: a pre-activation that is +-Inf here
// may be finite, of the other sign or NaN there, so no Inf result could be matched in general;
// NaN says that the row overflowed. See docs/design.md, "Non-finite values".
template <typename scalar_t>
scalar_t activation(scalar_t z, scalar_t scale) {
  if (!std::isfinite(z)) return std::numeric_limits<scalar_t>::quiet_NaN();
  return scalar_t(0.5) * z * (scalar_t(1) + std::erf(z * scalar_t(M_SQRT1_2))) * scale;
}

template <typename scalar_t>
struct BestColumn {
  scalar_t value;  // scale * gelu(z)
  scalar_t z;
  int64_t index;
};

// Column n's pre-activation: one expression wherever z is read, so that every pass sees its bits.
template <typename scalar_t>
scalar_t preactivation_of(const scalar_t* z_row, const scalar_t* bias, int64_t n) {
  return z_row[n] + (bias ? bias[n] : scalar_t(0));
}

// torch.max's rule over activation(z_n, scale) for the columns n whose z_n `admit` accepts, in
// column order: the first maximum wins ties, and the first NaN beats everything.
template <typename scalar_t, typename Admit>
BestColumn<scalar_t> best_admitted_column(const scalar_t* z_row, const scalar_t* bias,
                                          int64_t pooled, scalar_t scale, Admit admit) {
  BestColumn<scalar_t> best{scalar_t(0), scalar_t(0), -1};
  for (int64_t n = 0; n < pooled; ++n) {
    const scalar_t z = preactivation_of(z_row, bias, n);
    if (!admit(z)) continue;
    const scalar_t v = activation(z, scale);
    if (best.index < 0 || v > best.value || (std::isnan(v) && !std::isnan(best.value))) {
      best = {v, z, n};
    }
  }
  return best;
}

// The row's answer, with the same bits as activation() on every column followed by torch.max's
// rule, but with the erf evaluated on a few columns only where that provably gives the answer: the
// band of argmax_band.h (the rule and its proof, shared with the CUDA epilogue).
template <typename scalar_t>
BestColumn<scalar_t> best_column_of_row(const scalar_t* z_row, const scalar_t* bias,
                                        int64_t pooled, scalar_t scale) {
  if (scale > 0) {
    scalar_t z_max = -std::numeric_limits<scalar_t>::infinity();
    bool finite = true;
    for (int64_t n = 0; n < pooled; ++n) {
      const scalar_t z = preactivation_of(z_row, bias, n);
      finite &= std::isfinite(z);
      z_max = z > z_max ? z : z_max;
    }
    if (argmax_band_applies(scale, finite, z_max)) {
      const scalar_t threshold = argmax_band_threshold(z_max);
      const BestColumn<scalar_t> best = best_admitted_column(
          z_row, bias, pooled, scale, [threshold](scalar_t z) { return z >= threshold; });
      if (argmax_band_decided(best.value)) return best;
    }
  }
  return best_admitted_column(z_row, bias, pooled, scale, [](scalar_t) { return true; });
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor> forward_with_argmax(
    const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias, double scale,
    const std::optional<Tensor>& prepared_weight) {
  check_forward_inputs(x, weight, bias);
  check_dtype_in("forward", "x", x, kCpuDtypes, kCpuDtypesText);
  // Checked as on CUDA, then unused: the CPU computes every column in x's dtype.
  if (prepared_weight.has_value()) check_prepared_weight("forward", *prepared_weight, weight);
  const ScalarType dtype = x.scalar_type();
  if (is_reduced_float(x)) {
    // float16 / bfloat16 (e.g. under autocast): computed in float32, rounded once at the end.
    auto [out, argmax, pre] =
        forward_with_argmax(aten::to_dtype(x, kFloat), aten::to_dtype(weight, kFloat),
                            to_float(bias), scale, std::nullopt);
    return {aten::to_dtype(out, dtype), argmax, aten::to_dtype(pre, dtype)};
  }
  const int64_t batch = x.size(0);
  const int64_t pooled = weight.size(0);
  Tensor out = aten::empty_like_device(x, {batch});
  Tensor argmax = aten::empty_like_device(x, {batch}, kLong);
  Tensor preactivation = aten::empty_like_device(x, {batch});
  if (batch == 0) return {out, argmax, preactivation};

  const std::optional<Tensor> bias_c =
      bias.has_value() ? std::optional<Tensor>(aten::contiguous(*bias)) : std::nullopt;
  // BLAS sees contiguous operands whatever the caller's layout (stride-0 or overlapping rows): a
  // view and its contiguous copy then give the same bits. Given the view itself, aten::mm may take
  // another kernel (on an AMD EPYC host it does, and the rows' sums round differently).
  const Tensor weight_t = aten::transposed(aten::contiguous(weight));
  dispatch_cpu_floating(dtype, "forward", [&](auto type) {
    using scalar_t = decltype(type);
    const scalar_t s = static_cast<scalar_t>(scale);
    const scalar_t* bias_ptr = bias_c ? bias_c->const_data_ptr<scalar_t>() : nullptr;
    scalar_t* out_ptr = out.mutable_data_ptr<scalar_t>();
    int64_t* argmax_ptr = argmax.mutable_data_ptr<int64_t>();
    scalar_t* pre_ptr = preactivation.mutable_data_ptr<scalar_t>();
    const int64_t block_rows = rows_per_block(pooled, sizeof(scalar_t));
    for (int64_t row0 = 0; row0 < batch; row0 += block_rows) {
      const int64_t rows = std::min(block_rows, batch - row0);
      // (No narrow() view in the usual one-block case: host time counts at B = 1.)
      const Tensor x_rows = rows == batch ? x : aten::narrow(x, 0, row0, rows);
      const Tensor product = aten::mm(aten::contiguous(x_rows), weight_t);  // [rows, N]
      const scalar_t* z_rows = product.const_data_ptr<scalar_t>();
      // A row costs more than its columns where erf runs on many of them (no band): 8 per column.
      parallel_for(0, rows, grain_for_work(8 * pooled), [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const BestColumn<scalar_t> best =
              best_column_of_row(z_rows + i * pooled, bias_ptr, pooled, s);
          out_ptr[row0 + i] = best.value;
          argmax_ptr[row0 + i] = best.index;
          pre_ptr[row0 + i] = best.z;
        }
      });
    }
  });
  return {out, argmax, preactivation};
}

// The prepared weight's layout (prepared_weight.h), made as the CUDA kernel makes it: the same
// scales and fp16 copy; the norms summed in double, with the CUDA kernel's floor, and rounded up
// (upper bounds either way: a CPU-made one may be moved to the GPU and serve the certified path).
Tensor prepare_weight(const Tensor& weight) {
  check_prepare_weight_inputs(weight);
  const Tensor w = aten::contiguous(aten::to_dtype(weight, kFloat));
  const int64_t n = w.size(0);
  const int64_t k = w.size(1);
  const int64_t copy_halves = prepared_copy_halves(k);
  Tensor prepared = aten::zeros_like_device(weight, {prepared_bytes(n, k)}, kByte);
  const float* source = w.const_data_ptr<float>();
  Half* const rows = reinterpret_cast<Half*>(prepared.mutable_data_ptr<uint8_t>());
  float* const trailers = reinterpret_cast<float*>(rows + n * copy_halves);
  parallel_for(0, n, grain_for_work(4 * k), [&](int64_t begin, int64_t end) {  // ~4 ops / element
    for (int64_t row = begin; row < end; ++row) {
      const float* v = source + row * k;
      Half* copy = rows + row * copy_halves;
      float largest = 0.f;  // fmax ignores NaN, as the kernel's fmaxf does
      for (int64_t i = 0; i < k; ++i) largest = std::fmax(largest, std::fabs(v[i]));
      int exponent = 0;
      if (largest > 0.f && std::isfinite(largest)) {
        exponent = std::clamp(14 - std::ilogb(largest), -kPreparedMaxScaleExponent,
                              kPreparedMaxScaleExponent);
      }
      const float scale = std::ldexp(1.f, exponent);
      double squares = 0.0, residual_squares = 0.0;
      for (int64_t i = 0; i < k; ++i) {
        const float scaled = v[i] * scale;
        const Half half(std::fabs(scaled) < 0x1p-14f ? 0.f : scaled);
        const float residual = scaled - static_cast<float>(half);
        copy[4 * prepared_copy_group(i / 4) + i % 4] = half;
        squares += static_cast<double>(scaled) * scaled;
        residual_squares += static_cast<double>(residual) * residual;
      }
      // sqrt(sum + K 2^-148) 2^-e, rounded up to float: the CUDA kernel's floor for what float
      // loses below its normal range (here in v[i] * scale itself, at most 2^-149 per value:
      // cuda/certified.cuh's top), and a slack above the double sum's K roundings and the four
      // after it (gamma_{K+4}(2^-53), doubled). Without the floor a value that underflows once
      // scaled (2^-149 in a row whose largest is 2^77) would leave a residual norm of 0.
      const double squares_floor = static_cast<double>(k) * kNormSquaresFloorPerTerm;
      const double slack = 1.0 + (static_cast<double>(k) + 4.0) * 0x1p-52;
      auto norm = [&](double sum) {
        const double bound =
            std::sqrt(sum + squares_floor) * slack * std::ldexp(1.0, -exponent);
        const float f = static_cast<float>(bound);
        return static_cast<double>(f) >= bound ? f : std::nextafter(f, INFINITY);
      };
      float* trailer = trailers + 4 * row;
      trailer[kPreparedNorm] = norm(squares);
      trailer[kPreparedResidualNorm] = norm(residual_squares);
      trailer[kPreparedInverseScale] = std::ldexp(1.f, -exponent);
    }
  });
  return prepared;
}

}  // namespace cpu

namespace {

// forward: forward_with_argmax without the outputs kept for backward.
Tensor forward_cpu(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                   double scale, const std::optional<Tensor>& prepared_weight) {
  return std::get<0>(cpu::forward_with_argmax(x, weight, bias, scale, prepared_weight));
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fused_pool_gelu, CPU, m) {
  m.impl("forward_with_argmax", TORCH_BOX(&cpu::forward_with_argmax));
  m.impl("forward", TORCH_BOX(&forward_cpu));
  m.impl("prepare_weight", TORCH_BOX(&cpu::prepare_weight));
}

}  // namespace fused_pool_gelu
