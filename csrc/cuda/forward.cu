// The CUDA forward: forward_with_argmax, prepare_weight and the certified path's diagnostic.
// out[b] = max_n scale * gelu(x[b] . weight[n] + bias[n]), with the arg-max n and the
// pre-activation there (torch.max semantics: first index on ties, NaN wins).
//
// This file validates, asks forward_plan.h which path serves the call, and launches it:
//   split-K    a GEMM into a float32 workspace [splits, rows, N] (gemv.cu, gemm_sm80.cu,
//              gemm_sm90a.cu), then the epilogue (epilogue.cu); in slices of rows when the
//              workspace would pass kMaxWorkspaceFloats;
//   half GEMM  float16 / bfloat16 operands: their significands' products fit float32's 24 bits,
//              so z is cuBLAS's tensor-core GEMM with float32 accumulation and a float32 result
//              (aten::mm with out_dtype, the GEMM nn.Linear runs, its result kept in float32
//              instead of rounded to the half type before the GELU), then the same epilogue;
//   certified  float32 on sm_90a where it pays: certified.cu.
// No float atomics and a fixed summation order: bitwise reproducible run to run (the half path as
// cuBLAS is: on one GPU model, with PyTorch's per-stream workspaces). Allocation goes through
// PyTorch's allocator only and nothing synchronizes with the host, so the op is CUDA-graph
// capturable.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "checks.h"
#include "cuda/common.cuh"
#include "cuda/forward_launch.h"
#include "cuda/forward_plan.h"
#include "cuda/kernels.h"
#include "debug_knobs.h"
#include "prepared_weight.h"

namespace fused_pool_gelu {
namespace cuda {
namespace {

// The device's limits for the planner, asked of the runtime once per device (which also raises
// the kernels' dynamic shared memory limits there; those are per device).
const DeviceLimits& device_limits(int device) {
  static std::mutex mutex;
  static std::vector<std::unique_ptr<DeviceLimits>> cache;
  std::lock_guard<std::mutex> lock(mutex);
  if (static_cast<int>(cache.size()) <= device) cache.resize(device + 1);
  if (!cache[device]) {
    auto limits = std::make_unique<DeviceLimits>();
    STD_CUDA_CHECK(cudaDeviceGetAttribute(&limits->sms, cudaDevAttrMultiProcessorCount, device));
    int max_smem_optin = 0;
    STD_CUDA_CHECK(
        cudaDeviceGetAttribute(&max_smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    STD_CUDA_CHECK(cudaDeviceGetAttribute(&limits->smem_per_sm,
                                          cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
    if (limits->smem_per_sm / 2 + 1 <= max_smem_optin) {
      limits->spread_smem_max = limits->smem_per_sm / 2 + 1;
    }
    configure_gemv_kernels(device, max_smem_optin, *limits);
    configure_gemm_sm80_kernels(max_smem_optin, *limits);
    configure_epilogue_kernels(device, *limits);
    configure_certified_kernels(*limits);
    int major = 0, minor = 0;
    STD_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    STD_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    if (major == 9 && minor == 0) configure_gemm_sm90a_kernels(device, max_smem_optin, *limits);
    cache[device] = std::move(limits);
  }
  return *cache[device];
}

// A float32 operand the GEMM kernels can read directly (GemmOperands' contract), and the copy
// that holds it when the tensor is not so.
struct Operand {
  std::optional<Tensor> storage;  // keeps a copy alive
  const float* data = nullptr;
  int64_t ld = 0;
};

bool has_kernel_layout(const Tensor& t) {
  const int64_t rows = t.size(0);
  const int64_t cols = t.size(1);
  if (t.scalar_type() != kFloat || cols % 4 != 0) return false;
  if (cols > 1 && t.stride(1) != 1) return false;
  if (rows > 1 && t.stride(0) % 4 != 0) return false;
  return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
}

// A float32 copy is made once here for a float16 / bfloat16 tensor (prepare_weight takes any
// floating weight; the forward's half operands go to cuBLAS instead), other strides, K not a
// multiple of 4 and misaligned data: contiguous, with K zero-padded to a multiple of 4 (zeros do
// not change the dot products).
Operand as_kernel_operand(const Tensor& t, int64_t k_padded) {
  if (has_kernel_layout(t)) {
    return Operand{t, t.const_data_ptr<float>(), t.size(0) > 1 ? t.stride(0) : k_padded};
  }
  const int64_t k = t.size(1);
  Tensor buffer = aten::empty_like_device(t, {t.size(0), k_padded}, kFloat);
  Tensor columns = aten::narrow(buffer, 1, 0, k);
  torch::stable::copy_(columns, t);
  if (k_padded > k) {
    Tensor padding = aten::narrow(buffer, 1, k, k_padded - k);
    aten::zero_(padding);
  }
  return Operand{buffer, buffer.const_data_ptr<float>(), k_padded};
}

GemmOperands gemm_operands(const Operand& x, const Operand& w) {
  return GemmOperands{x.data, x.ld, w.data, w.ld};
}

ForwardProblem forward_problem(const Tensor& x, const Tensor& weight, bool prepared,
                               double scale) {
  ForwardProblem p;
  p.batch = x.size(0);
  p.n = weight.size(0);
  p.k = x.size(1);
  p.operands = x.scalar_type() == kFloat && weight.scalar_type() == kFloat
                   ? Operands::kFloat32
               : is_reduced_float(x) ? Operands::kHalf
                                     : Operands::kOther;
  p.prepared = prepared;
  p.scale = scale;
  p.unit_column_strides = x.stride(1) == 1 && weight.stride(1) == 1;
  return p;
}

void launch_gemm(const GemmPlan& plan, const GemmOperands& ops, float* partial, int64_t rows,
                 int64_t n, int64_t k_padded, cudaStream_t stream) {
  switch (plan.kind) {
    case GemmPlan::Kind::kRowwise:
      launch_rowwise_gemv(ops, partial, rows, n, k_padded, stream);
      break;
    case GemmPlan::Kind::kSimt:
      launch_simt_gemv(plan.simt, ops, partial, rows, n, k_padded, stream);
      break;
    case GemmPlan::Kind::kTcGemv:
      launch_tc_gemv(plan.tc_gemv, ops, partial, rows, n, k_padded, stream);
      break;
    case GemmPlan::Kind::kTc:
      if (plan.tc.wgmma) {
        launch_tf32x3_gemm_sm90a(plan.tc, ops, partial, rows, n, k_padded, stream);
      } else {
        launch_tf32x3_gemm_sm80(plan.tc, ops, partial, rows, n, k_padded, stream);
      }
      break;
  }
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor> forward_with_argmax(
    const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias, double scale,
    const std::optional<Tensor>& prepared_weight) {
  check_forward_inputs(x, weight, bias);
  check_cuda_floating_dtype("forward", "x", x);
  // Checked whichever path runs (only the certified one reads it): a stale one fails every call.
  if (prepared_weight.has_value()) check_prepared_weight("forward", *prepared_weight, weight);
  const torch::stable::accelerator::DeviceGuard guard(x.get_device_index());

  const int64_t batch = x.size(0);
  const int64_t k = x.size(1);
  const int64_t n = weight.size(0);
  Tensor out = aten::empty_like_device(x, {batch});
  Tensor argmax = aten::empty_like_device(x, {batch}, kLong);
  Tensor preactivation = aten::empty_like_device(x, {batch});
  if (batch == 0) return {out, argmax, preactivation};

  cudaStream_t stream = current_stream();
  const DeviceLimits& limits = device_limits(x.get_device());
  const DebugKnobs knobs = debug_knobs();

  // Contiguous, in x's dtype: the epilogue widens a half-type bias itself (a conversion kernel
  // before it would cost 3.2 us per call), and the certified path takes float32 x only.
  // The epilogue reads the bias as its output type, x's: the same dtype (check_forward_inputs).
  const std::optional<Tensor> bias_contiguous =
      bias.has_value() ? std::optional<Tensor>(aten::contiguous(*bias)) : std::nullopt;

  // The GEMV kernel indexes inside a row with ints (fewer registers in its hot loop).
  FPG_CHECK(k <= kMaxInFeatures, "fused_pool_gelu.forward: in_features must be at most ",
              kMaxInFeatures, ", got ", k);
  const int64_t k_padded = padded_k(k);
  const ForwardProblem problem = forward_problem(x, weight, prepared_weight.has_value(), scale);
  const ForwardPath path = plan_path(limits, knobs, problem);
  const bool half_gemm = path == ForwardPath::kHalfGemm;
  const bool float_gemm = path == ForwardPath::kCertified || path == ForwardPath::kSplitK;
  const Operand x_op = float_gemm ? as_kernel_operand(x, k_padded) : Operand{};
  const Operand w_op = float_gemm ? as_kernel_operand(weight, k_padded) : Operand{};
  if (path == ForwardPath::kCertified) {
    const float* bias_data = bias_contiguous ? bias_contiguous->const_data_ptr<float>() : nullptr;
    const uint8_t* prepared =
        prepared_weight.has_value() ? prepared_weight->const_data_ptr<uint8_t>() : nullptr;
    certified_forward(limits, plan_certified(limits, batch, n, k_padded),
                      gemm_operands(x_op, w_op), prepared, bias_data, static_cast<float>(scale),
                      batch, n, k_padded, x,
                      CertifiedOutputs{out.mutable_data_ptr<float>(),
                                       argmax.mutable_data_ptr<int64_t>(),
                                       preactivation.mutable_data_ptr<float>()},
                      stream);
    return {out, argmax, preactivation};
  }
  // K == 0 needs no GEMM and no workspace (z = bias): one slice.
  const int64_t slice_rows = k > 0 ? rows_per_slice(batch, n) : batch;
  const bool rowwise = path == ForwardPath::kSplitK && use_rowwise(limits, slice_rows, n);

  std::optional<Tensor> workspace;  // split-K partial sums of the current slice, reused by the next
  for (int64_t row0 = 0; row0 < batch; row0 += slice_rows) {
    const int64_t rows = std::min(slice_rows, batch - row0);
    int64_t splits = 0;
    if (half_gemm) {
      // z from cuBLAS in float32, in slices of K where half_gemm_splits says so: [splits, rows, n],
      // the workspace's layout.
      const Tensor x_rows = rows == batch ? x : aten::narrow(x, 0, row0, rows);
      splits = half_gemm_splits(limits, problem, rows);
      if (splits == 1) {
        workspace = aten::mm(x_rows, aten::transposed(weight), kFloat);
      } else {
        const int64_t slice = k / splits;
        workspace = aten::bmm(
            aten::as_strided(x_rows, {splits, rows, slice}, {slice, x.stride(0), 1}),
            aten::as_strided(weight, {splits, slice, n}, {slice, 1, weight.stride(0)}), kFloat);
      }
    } else if (path == ForwardPath::kSplitK) {
      const GemmOperands ops{x_op.data + row0 * x_op.ld, x_op.ld, w_op.data, w_op.ld};
      const GemmPlan plan = plan_gemm(limits, knobs, rowwise, rows, n, k_padded,
                                      workspace_split_cap(slice_rows, n));
      splits = plan.splits;
      // Stream order makes reuse safe: this slice's GEMM starts after the last epilogue's end.
      if (!workspace || workspace->numel() < splits * rows * n) {
        workspace = aten::empty_like_device(x, {splits * rows * n}, kFloat);
      }
      launch_gemm(plan, ops, workspace->mutable_data_ptr<float>(), rows, n, k_padded, stream);
    }
    // The epilogue is the programmatic dependent of the GEMM before it where the device supports
    // it, cuBLAS's too: it waits for that grid's completion (griddepcontrol.wait) before reading z,
    // whatever the GEMM signals, so only its launch and set-up overlap the GEMM's tail.
    const bool pdl = limits.dependent_launch && splits > 0;
    EpilogueParams p{};
    p.partial = splits > 0 ? workspace->mutable_data_ptr<float>() : nullptr;
    p.split_stride = rows * n;
    p.splits = static_cast<int>(splits);
    p.bias = bias_contiguous ? bias_contiguous->const_data_ptr() : nullptr;
    p.scale = static_cast<float>(scale);  // torch multiplies a float32 tensor by a float32 scalar
    p.batch = rows;
    p.n = n;
    // (No narrow() views in the usual one-slice case: host time counts at B = 1.)
    auto rows_of = [&](const Tensor& t) {
      return rows == batch ? t : aten::narrow(t, 0, row0, rows);
    };
    Tensor out_slice = rows_of(out);
    Tensor argmax_slice = rows_of(argmax);
    Tensor preactivation_slice = rows_of(preactivation);
    const EpiloguePlan epilogue = plan_epilogue(limits, rows, n, splits, half_gemm,
                                                epilogue_vector_aligned(p, out));
    launch_epilogue(epilogue, p, out_slice, argmax_slice, preactivation_slice, limits, pdl,
                    stream);
  }
  return {out, argmax, preactivation};
}

namespace {

Tensor certified_candidate_counts_cuda(const Tensor& x, const Tensor& weight,
                                       const std::optional<Tensor>& bias, double scale) {
  check_forward_inputs(x, weight, bias);
  const torch::stable::accelerator::DeviceGuard guard(x.get_device_index());
  const int64_t batch = x.size(0);
  const int64_t n = weight.size(0);
  const int64_t k_padded = padded_k(x.size(1));
  const DeviceLimits& limits = device_limits(x.get_device());
  FPG_CHECK(certified_applies(limits, debug_knobs(), forward_problem(x, weight, false, scale)),
              "fused_pool_gelu._certified_candidate_counts: the certified path does not apply "
              "here (it needs an sm_90a build on a compute capability 9.0 GPU, "
              "FUSED_POOL_GELU_FORCE_MMA_SYNC unset, float32, ", kSimtMaxBatch + 1,
              " <= batch, one workspace slice, N <= ", certified::kMaxSelectColumns, ", 0 < K <= ",
              kCertifiedMaxInFeatures, " and a finite non-zero scale), got ", x.scalar_type(),
              " x and ", weight.scalar_type(), " weight, batch ", batch, ", N ", n, ", K ",
              x.size(1), ", scale ", scale);
  const std::optional<Tensor> bias_contiguous =  // float32, as x (certified_applies)
      bias.has_value() ? std::optional<Tensor>(aten::contiguous(*bias)) : std::nullopt;
  const Operand x_op = as_kernel_operand(x, k_padded);
  const Operand w_op = as_kernel_operand(weight, k_padded);
  // The forward's outputs are not returned: the counts are the selection's.
  Tensor out = aten::empty_like_device(x, {batch});
  Tensor argmax = aten::empty_like_device(x, {batch}, kLong);
  Tensor preactivation = aten::empty_like_device(x, {batch});
  const CertifiedWorkspace selection = certified_forward(
      limits, plan_certified(limits, batch, n, k_padded), gemm_operands(x_op, w_op), nullptr,
      bias_contiguous ? bias_contiguous->const_data_ptr<float>() : nullptr,
      static_cast<float>(scale), batch, n, k_padded, x,
      CertifiedOutputs{out.mutable_data_ptr<float>(), argmax.mutable_data_ptr<int64_t>(),
                       preactivation.mutable_data_ptr<float>()},
      current_stream());
  const Tensor counts =
      aten::view_as_dtype(aten::narrow(selection.workspace, 0, selection.counts_offset, batch), kInt);
  return torch::stable::clone(counts);
}

Tensor prepare_weight_cuda(const Tensor& weight) {
  check_prepare_weight_inputs(weight);
  const torch::stable::accelerator::DeviceGuard guard(weight.get_device_index());
  const int64_t n = weight.size(0);
  const int64_t k = weight.size(1);
  const int64_t k_padded = padded_k(k);
  Tensor prepared = aten::empty_like_device(weight, {prepared_bytes(n, k)}, kByte);
  // K == 0: no row to read; the kernel writes the trailers (norms 0, inverse scale 1).
  const Operand w_op = k > 0 && n > 0 ? as_kernel_operand(weight, k_padded) : Operand{};
  launch_prepare(w_op.data, w_op.ld, n, k_padded, prepared.mutable_data_ptr<uint8_t>(),
                 current_stream());
  return prepared;
}

// forward: forward_with_argmax without the outputs kept for backward.
Tensor forward_cuda(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                    double scale, const std::optional<Tensor>& prepared_weight) {
  return std::get<0>(forward_with_argmax(x, weight, bias, scale, prepared_weight));
}

}  // namespace

const DeviceLimits& device_limits_of(int device) {
  int devices = 0;
  STD_CUDA_CHECK(cudaGetDeviceCount(&devices));
  FPG_CHECK(0 <= device && device < devices,
            "fused_pool_gelu._device_limits: device must be in [0, ", devices, "), got ", device);
  const torch::stable::accelerator::DeviceGuard guard(device);
  return device_limits(device);
}

}  // namespace cuda

STABLE_TORCH_LIBRARY_IMPL(fused_pool_gelu, CUDA, m) {
  m.impl("forward_with_argmax", TORCH_BOX(&cuda::forward_with_argmax));
  m.impl("forward", TORCH_BOX(&cuda::forward_cuda));
  m.impl("prepare_weight", TORCH_BOX(&cuda::prepare_weight_cuda));
  m.impl("_certified_candidate_counts", TORCH_BOX(&cuda::certified_candidate_counts_cuda));
}

}  // namespace fused_pool_gelu
