// fold and fold_backward on CUDA: average-pool groups of k rows of a Linear's weight and bias
// (docs/design.md, "The fold"), and the adjoint of that linear map.
//
// Both are pure streaming kernels with no reuse, so the only things that matter are 16-byte
// accesses, coalescing and enough bytes in flight per SM to cover DRAM latency. At the default
// shape (O = K = 8192, k = 16, float32):
//   fold           reads N*k*K*4 = 256 MiB of weight, writes N*K*4 = 16 MiB.
//   fold_backward  reads 16 MiB of grad_pooled_weight, writes O*K*4 = 256 MiB.
// Each thread owns one 16-byte column vector of one pooled row n and walks the k rows of its
// group, so every weight element is read (fold) or written (fold_backward) exactly once and the
// pooled side is touched once too.
//
// Summation order (both paths, every dtype): acc = 0; acc += weight[n*k + r] for r = 0 .. k-1 in
// the accumulate type (float for float16 / bfloat16, rounded once at the end); then acc / k, a true
// division, not a multiplication by 1/k. The vectorized and the strided path give the same bits.

#include <algorithm>
#include <tuple>

#include "checks.h"
#include "cuda/common.cuh"
#include "cuda/fold_backward.h"
#include "cuda/kernels.h"

namespace fused_pool_gelu {
namespace cuda {
namespace {

// 8 warps per block: a multiple of the warp, small enough that the 62-register kernel still fits
// 4 blocks per SM (a short tail of idle warps), large enough that the grid (4096 blocks at the
// default shape, ~8 waves of 528 on 132 SMs) is not dominated by block launch.
constexpr int kFoldThreads = 256;

// Rows of a group whose 16-byte loads a thread issues before it adds any of them. Little's law:
// ~4.3 TB/s x ~0.7 us latency needs ~3 MB in flight, ~23 KB per SM; 8 rows x 16 B x 1024+
// resident threads per SM is ~128 KB, comfortably more, for 32 registers of load buffer. k = 16
// (the default) is two full batches.
constexpr int kFoldRowsInFlight = 8;

// Same reasoning as kFoldThreads.
constexpr int kFoldBackwardThreads = 256;

// fold_backward's k stores per thread are independent (nothing waits on a store), so a short
// unroll only trims loop overhead.
constexpr int kFoldBackwardStoreUnroll = 4;

// Thread (n, v): pooled_weight[n, v*VEC .. v*VEC+VEC-1]; the thread with v == 0 also pools bias[n]
// (one lane in 1 of 64 warps at the default shape does k extra scalar loads: cheaper than a second
// launch). vecs_per_row >= 1 even for in_features == 0, so that the bias is still pooled.
// VEC > 1 requires w_stride1 == 1 and 16-byte aligned rows (rows_are_vectorizable).
template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kFoldThreads)
    fold_kernel(const scalar_t* __restrict__ weight, int64_t w_stride0, int64_t w_stride1,
                const scalar_t* __restrict__ bias, int64_t b_stride,
                scalar_t* __restrict__ pooled_weight, scalar_t* __restrict__ pooled_bias,
                int64_t pooled, int64_t in_features, int64_t k, int64_t vecs_per_row) {
  using acc_t = opmath_t<scalar_t>;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kFoldThreads + threadIdx.x;
  if (item >= pooled * vecs_per_row) return;
  const int64_t n = item / vecs_per_row;
  const int64_t v = item - n * vecs_per_row;
  const int64_t col = v * VEC;
  const int64_t first_row = n * k;  // rows first_row .. first_row + k - 1 < pooled * k <= O

  if (col < in_features) {
    const scalar_t* src = weight + first_row * w_stride0 + col * w_stride1;
    acc_t acc[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] = acc_t(0);
    for (int64_t r0 = 0; r0 < k; r0 += kFoldRowsInFlight) {
      // All loads of the batch first (independent, so they overlap), then the adds in r order.
      AlignedVector<scalar_t, VEC> rows[kFoldRowsInFlight];
#pragma unroll
      for (int u = 0; u < kFoldRowsInFlight; ++u) {
        if (r0 + u < k) rows[u] = load_vector<scalar_t, VEC>(src + (r0 + u) * w_stride0);
      }
#pragma unroll
      for (int u = 0; u < kFoldRowsInFlight; ++u) {
        if (r0 + u < k) {
#pragma unroll
          for (int j = 0; j < VEC; ++j) acc[j] += static_cast<acc_t>(rows[u].val[j]);
        }
      }
    }
    AlignedVector<scalar_t, VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      out.val[j] = static_cast<scalar_t>(acc[j] / static_cast<acc_t>(k));
    }
    store_vector<scalar_t, VEC>(pooled_weight + n * in_features + col, out);
  }

  if (v == 0) {
    if (bias != nullptr) {
      acc_t sum = acc_t(0);
      for (int64_t r = 0; r < k; ++r) sum += static_cast<acc_t>(bias[(first_row + r) * b_stride]);
      pooled_bias[n] = static_cast<scalar_t>(sum / static_cast<acc_t>(k));
    } else {
      pooled_bias[n] = scalar_t(0);
    }
  }
}

// Thread (n, v) with n < groups = ceil(O / k): broadcasts grad_pooled_weight[n, v*VEC ..] / k to
// the k rows n*k .. n*k + k - 1 of grad_weight; the last group n == pooled exists only when
// O % k != 0 and writes zeros to the O - pooled*k tail rows, so grad_weight needs no separate
// memset. The thread with v == 0 does the same for the bias. Each grad_pooled_weight element is
// loaded once and divided once, then stored k times as full 16-byte, coalesced vectors.
// With segment_starts (model_backward), pooled row n is zero where segment_starts[n] ==
// segment_starts[n + 1] (no row of the batch has arg-max n) and is not read there: those rows of
// grad_pooled_weight were never written.
// VEC > 1 requires g_stride1 == 1, 16-byte aligned rows and in_features % VEC == 0.
template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kFoldBackwardThreads)
    fold_backward_kernel(const scalar_t* __restrict__ grad_pooled_weight, int64_t g_stride0,
                         int64_t g_stride1, const scalar_t* __restrict__ grad_pooled_bias,
                         int64_t gb_stride, scalar_t* __restrict__ grad_weight,
                         scalar_t* __restrict__ grad_bias,
                         const int64_t* __restrict__ segment_starts, int64_t pooled,
                         int64_t out_features, int64_t in_features, int64_t k, int64_t groups,
                         int64_t vecs_per_row) {
  using acc_t = opmath_t<scalar_t>;
  allow_dependent_launch();
  wait_for_previous_grid();
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kFoldBackwardThreads + threadIdx.x;
  if (item >= groups * vecs_per_row) return;
  const int64_t n = item / vecs_per_row;
  const int64_t v = item - n * vecs_per_row;
  const int64_t col = v * VEC;
  const int64_t first_row = n * k;
  const bool is_pooled = n < pooled;  // else the tail group: zeros
  // Read the pooled row, or know it is zero.
  const bool is_nonzero =
      is_pooled && (segment_starts == nullptr || segment_starts[n] != segment_starts[n + 1]);
  // k for a pooled group; O - pooled*k (in 1 .. k-1) for the tail group.
  const int64_t rows = is_pooled ? k : out_features - first_row;

  if (col < in_features) {
    AlignedVector<scalar_t, VEC> out;
    if (is_nonzero) {
      const AlignedVector<scalar_t, VEC> g =
          load_vector<scalar_t, VEC>(grad_pooled_weight + n * g_stride0 + col * g_stride1);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        out.val[j] = static_cast<scalar_t>(static_cast<acc_t>(g.val[j]) / static_cast<acc_t>(k));
      }
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) out.val[j] = scalar_t(0);
    }
    scalar_t* dst = grad_weight + first_row * in_features + col;
#pragma unroll kFoldBackwardStoreUnroll
    for (int64_t r = 0; r < rows; ++r) {
      store_vector<scalar_t, VEC, /*kStreaming=*/true>(dst + r * in_features, out);
    }
  }

  if (v == 0) {
    const scalar_t b =
        is_nonzero ? static_cast<scalar_t>(static_cast<acc_t>(grad_pooled_bias[n * gb_stride]) /
                                           static_cast<acc_t>(k))
                   : scalar_t(0);
    for (int64_t r = 0; r < rows; ++r) grad_bias[first_row + r] = b;
  }
}

template <typename scalar_t, int VEC>
void launch_fold(const Tensor& weight, const std::optional<Tensor>& bias, int64_t k,
                 Tensor& pooled_weight, Tensor& pooled_bias) {
  const int64_t pooled = pooled_weight.size(0);
  const int64_t in_features = weight.size(1);
  // At least one thread per pooled row, so that in_features == 0 still pools the bias.
  const int64_t vecs_per_row = std::max<int64_t>(ceil_div<int64_t>(in_features, VEC), 1);
  const bool has_bias = bias.has_value();
  fold_kernel<scalar_t, VEC>
      <<<grid_blocks(pooled * vecs_per_row, kFoldThreads, "pooled rows x 16-byte vectors"),
         kFoldThreads, 0,
         current_stream()>>>(
          weight.const_data_ptr<scalar_t>(), weight.stride(0), weight.stride(1),
          has_bias ? bias->const_data_ptr<scalar_t>() : nullptr, has_bias ? bias->stride(0) : 0,
          pooled_weight.mutable_data_ptr<scalar_t>(), pooled_bias.mutable_data_ptr<scalar_t>(),
          pooled, in_features, k, vecs_per_row);
  STD_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, int VEC>
void launch_fold_backward(const Tensor& grad_pooled_weight, const Tensor& grad_pooled_bias,
                          int64_t k, const int64_t* segment_starts, Tensor& grad_weight,
                          Tensor& grad_bias) {
  const int64_t pooled = grad_pooled_weight.size(0);
  const int64_t in_features = grad_pooled_weight.size(1);
  const int64_t out_features = grad_weight.size(0);
  const int64_t groups = ceil_div<int64_t>(out_features, k);  // pooled, + 1 if O % k != 0
  // At least one thread per group, so that in_features == 0 still writes the bias.
  const int64_t vecs_per_row = std::max<int64_t>(ceil_div<int64_t>(in_features, VEC), 1);
  // A programmatic dependent of the kernel before it (model_backward's segment reduction, or
  // whatever precedes the op): it waits for that grid before touching memory, and its launch
  // overlaps that grid's tail.
  cudaLaunchAttribute attribute{};
  const cudaLaunchConfig_t config = dependent_launch_config(
      grid_blocks(groups * vecs_per_row, kFoldBackwardThreads, "row groups x 16-byte vectors"),
      kFoldBackwardThreads,
      current_stream(), attribute,
      dependent_launch_enabled<fold_backward_kernel<scalar_t, VEC>>(grad_weight.get_device()));
  STD_CUDA_CHECK(cudaLaunchKernelEx(
      &config, fold_backward_kernel<scalar_t, VEC>, grad_pooled_weight.const_data_ptr<scalar_t>(),
      grad_pooled_weight.stride(0), grad_pooled_weight.stride(1),
      grad_pooled_bias.const_data_ptr<scalar_t>(), grad_pooled_bias.stride(0),
      grad_weight.mutable_data_ptr<scalar_t>(), grad_bias.mutable_data_ptr<scalar_t>(),
      segment_starts, pooled, out_features, in_features, k, groups, vecs_per_row));
}

}  // namespace

std::tuple<Tensor, Tensor> fold(const Tensor& weight, const std::optional<Tensor>& bias,
                                int64_t pool_kernel_size) {
  check_fold_inputs(weight, bias, pool_kernel_size);
  check_cuda_floating_dtype("fold", "weight", weight);
  const torch::stable::accelerator::DeviceGuard device_guard(weight.get_device_index());

  const int64_t k = pool_kernel_size;
  const int64_t pooled = weight.size(0) / k;  // >= 1: check_fold_inputs requires k <= O
  Tensor pooled_weight = aten::empty_like_device(weight, {pooled, weight.size(1)});
  Tensor pooled_bias = aten::empty_like_device(weight, {pooled});

  FPG_DISPATCH_CUDA_FLOATING_TYPES(weight.scalar_type(), "fused_pool_gelu.fold", [&] {
    constexpr int kVec = vector_width<scalar_t>();
    if (rows_are_vectorizable(weight, kVec) && rows_are_vectorizable(pooled_weight, kVec)) {
      launch_fold<scalar_t, kVec>(weight, bias, k, pooled_weight, pooled_bias);
    } else {
      launch_fold<scalar_t, 1>(weight, bias, k, pooled_weight, pooled_bias);
    }
  });
  return {pooled_weight, pooled_bias};
}

std::tuple<Tensor, Tensor> fold_backward_cuda(const Tensor& grad_pooled_weight,
                                                      const Tensor& grad_pooled_bias,
                                                      int64_t out_features,
                                                      int64_t pool_kernel_size) {
  check_fold_backward_inputs(grad_pooled_weight, grad_pooled_bias, out_features, pool_kernel_size);
  check_cuda_floating_dtype("fold_backward", "grad_pooled_weight", grad_pooled_weight);
  const torch::stable::accelerator::DeviceGuard device_guard(grad_pooled_weight.get_device_index());
  return fold_backward_of(grad_pooled_weight, grad_pooled_bias, out_features, pool_kernel_size,
                          nullptr);
}

std::tuple<Tensor, Tensor> fold_backward_of(const Tensor& grad_pooled_weight,
                                                    const Tensor& grad_pooled_bias,
                                                    int64_t out_features, int64_t pool_kernel_size,
                                                    const int64_t* segment_starts) {
  const int64_t k = pool_kernel_size;
  Tensor grad_weight =
      aten::empty_like_device(grad_pooled_weight, {out_features, grad_pooled_weight.size(1)});
  Tensor grad_bias = aten::empty_like_device(grad_pooled_weight, {out_features});
  if (out_features == 0) return {grad_weight, grad_bias};

  const auto dtype = grad_pooled_weight.scalar_type();
  FPG_DISPATCH_CUDA_FLOATING_TYPES(dtype, "fused_pool_gelu.fold_backward", [&] {
    constexpr int kVec = vector_width<scalar_t>();
    if (rows_are_vectorizable(grad_pooled_weight, kVec) &&
        rows_are_vectorizable(grad_weight, kVec)) {
      launch_fold_backward<scalar_t, kVec>(grad_pooled_weight, grad_pooled_bias, k, segment_starts,
                                           grad_weight, grad_bias);
    } else {
      launch_fold_backward<scalar_t, 1>(grad_pooled_weight, grad_pooled_bias, k, segment_starts,
                                        grad_weight, grad_bias);
    }
  });
  return {grad_weight, grad_bias};
}

}  // namespace cuda

STABLE_TORCH_LIBRARY_IMPL(fused_pool_gelu, CUDA, m) {
  m.impl("fold", TORCH_BOX(&cuda::fold));
  m.impl("fold_backward", TORCH_BOX(&cuda::fold_backward_cuda));
}

}  // namespace fused_pool_gelu
