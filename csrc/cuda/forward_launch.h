// The forward's kernels as forward.cu and certified.cu see them: parameter structs and one group
// of functions per translation unit. Each group's configure_* sets its kernels' shared-memory
// limits on a device and records their occupancy in DeviceLimits (a kernel's attributes belong to
// the translation unit that compiled it, so each unit configures its own); its launch_* runs them.
#pragma once

#include <cuda.h>  // CUtensorMap (a plain struct: no driver library needed at link time)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/forward_plan.h"

#ifndef FPG_WITH_SM90A
#define FPG_WITH_SM90A 0
#endif

namespace fused_pool_gelu {
namespace cuda {
namespace forward_gemm {

// What every split-K GEMM kernel of the forward gets (one launch covers `rows` rows of x).
struct GemmParams {
  const float* x;  // [rows, k], row stride ldx
  int64_t ldx;
  const float* w;  // [n, k], row stride ldw
  int64_t ldw;
  float* partial;  // partial[s * split_stride + row * n + col]
  // certified_pass1_kernel's partials instead, in bfloat16 (same layout; partial is null there)
  __nv_bfloat16* rounded_partial;
  int64_t split_stride;
  int64_t rows;  // rows of x in this launch
  int64_t n;
  int64_t k;            // padded K (multiple of 4; the GEMV also needs < 2^31 - 2 kSimtChunkK)
  int64_t k_per_split;  // a multiple of the kernel's planning granularity (its K step)
  // certified_pass1_kernel only (the others leave them null): the power of two that undoes the
  // scaling of each weight row's fp16 copy, w_inverse_scale[n * w_inverse_scale_stride] (the
  // prepared weight's trailers, prepared_weight.h); per x row and split (x_sumsq[row * splits + s],
  // this launch's rows) the exponent of the row's scale in that split and the sums of squares of
  // its scaled values and of their fp16 residuals, for the error bound of the selection
  // (certified.cuh).
  const float* w_inverse_scale;
  int64_t w_inverse_scale_stride;
  float* x_sumsq;
  float* x_residual_sumsq;
  int* x_scale_exponent;
  // certified_pass1_kernel: two ints it sets to 0 (the selection's rescore_ends; pass 1 runs before
  // the selection in every call, so no memset of its own is needed).
  int* zeroed_counters;
};

// The certified pass 1's tensor maps, both with the 128-byte swizzle: x in float32 (box 32 K x
// kBlockM rows: two per stage) and the weight's fp16 copy (box 64 K x kBlockN rows).
struct TmaMaps {
  CUtensorMap x;
  CUtensorMap w;
};

}  // namespace forward_gemm

namespace fg = forward_gemm;

// Float32 operands the GEMM kernels read directly: row-major rows with unit column stride, K
// zero-padded to a multiple of 4, row strides a multiple of 4 floats, 16-byte aligned data
// (forward.cu copies where a tensor is not so).
struct GemmOperands {
  const float* x;
  int64_t ldx;
  const float* w;
  int64_t ldw;
};

// The GEMM launch over x rows [row0, row0 + rows_per_launch) (clipped to the batch): grid limits
// split very large batches into several launches writing the same workspace.
inline fg::GemmParams gemm_params(const GemmOperands& ops, float* partial, int64_t batch,
                                  int64_t n, int64_t k_padded, int64_t k_per_split, int64_t row0,
                                  int64_t rows_per_launch) {
  fg::GemmParams p{};
  p.x = ops.x + row0 * ops.ldx;
  p.ldx = ops.ldx;
  p.w = ops.w;
  p.ldw = ops.ldw;
  p.partial = partial + row0 * n;
  p.split_stride = batch * n;
  p.rows = std::min(rows_per_launch, batch - row0);
  p.n = n;
  p.k = k_padded;
  p.k_per_split = k_per_split;
  return p;
}

// The grid of a 3xTF32 GEMM launch (both kernels share tiles and plan) over `batch` rows: n tiles
// fastest, so that the CTAs running together share x row tiles and the weight (N x K, the smaller
// operand at large B) stays in L2 while the batch is swept; then row tiles, then splits.
inline dim3 tf32x3_gemm_grid(const TcPlan& plan, int64_t batch, int64_t n) {
  FPG_CHECK(plan.splits <= kMaxGridYZ, "fused_pool_gelu.forward: internal error: ", plan.splits,
              " splits");
  // Row tiles go on grid y (at most 65535). A workspace slice holds at most kMaxWorkspaceFloats
  // partial sums, at least one per row, so its row tiles always fit there: one launch.
  static_assert(kMaxWorkspaceFloats <= kMaxGridYZ * fg::kTcBlockM, "slice row tiles fit grid y");
  FPG_CHECK(batch <= kMaxGridYZ * fg::kTcBlockM, "fused_pool_gelu.forward: internal error: ",
              batch, " rows in one tensor-core launch");
  return dim3(grid_blocks(n, fg::kTcBlockN, "weight rows"),
              static_cast<unsigned>(ceil_div(batch, int64_t{fg::kTcBlockM})),
              static_cast<unsigned>(plan.splits));
}

// gemv.cu: the row-parallel, SIMT split-K and 3xTF32 tensor-core GEMVs.
void configure_gemv_kernels(int device, int max_smem_optin, DeviceLimits& limits);
void launch_rowwise_gemv(const GemmOperands& ops, float* dot_products, int64_t batch, int64_t n,
                         int64_t k_padded, cudaStream_t stream);
void launch_simt_gemv(const SimtPlan& plan, const GemmOperands& ops, float* partial,
                      int64_t batch, int64_t n, int64_t k_padded, cudaStream_t stream);
void launch_tc_gemv(const SplitK& plan, const GemmOperands& ops, float* partial, int64_t batch,
                    int64_t n, int64_t k_padded, cudaStream_t stream);

// gemm_sm80.cu: the portable 3xTF32 mma.sync GEMM.
void configure_gemm_sm80_kernels(int max_smem_optin, DeviceLimits& limits);
void launch_tf32x3_gemm_sm80(const TcPlan& plan, const GemmOperands& ops, float* partial,
                             int64_t batch, int64_t n, int64_t k_padded, cudaStream_t stream);

// gemm_sm90a.cu and certified_pass1_sm90a.cu, compiled for sm_90a alone. A build without 9.0a in
// its arch list has neither: DeviceLimits::wgmma_ctas_per_sm stays 0 there, so no plan asks for
// their kernels, and the stubs below only keep the callers linking.
#if FPG_WITH_SM90A
// Sets limits.wgmma_ctas_per_sm where the device runs this build's sm_90a code.
void configure_gemm_sm90a_kernels(int device, int max_smem_optin, DeviceLimits& limits);
void launch_tf32x3_gemm_sm90a(const TcPlan& plan, const GemmOperands& ops, float* partial,
                              int64_t batch, int64_t n, int64_t k_padded, cudaStream_t stream);
int certified_pass1_max_smem_bytes();
void configure_certified_pass1_kernels();
// Pass 1 on block_m x block_n tiles, `splits` splits of K; `dependent`: a programmatic dependent
// of the kernel before it.
void launch_certified_pass1(int64_t block_m, int64_t block_n, int64_t splits, bool dependent,
                            cudaStream_t stream, const fg::GemmParams& gemm,
                            const fg::TmaMaps& maps);
#else
inline void configure_gemm_sm90a_kernels(int, int, DeviceLimits&) {}
inline void launch_tf32x3_gemm_sm90a(const TcPlan&, const GemmOperands&, float*, int64_t, int64_t,
                                     int64_t, cudaStream_t) {
  fail("fused_pool_gelu: internal error: an sm_90a kernel in a build without sm_90a");
}
inline void launch_certified_pass1(int64_t, int64_t, int64_t, bool, cudaStream_t,
                                   const fg::GemmParams&, const fg::TmaMaps&) {
  fail("fused_pool_gelu: internal error: an sm_90a kernel in a build without sm_90a");
}
#endif

// epilogue.cu: bias + GELU + scale + row max and arg-max over the split partials.
struct EpilogueParams {
  const float* partial;  // [splits, batch, n] (nullptr when splits == 0, i.e. K == 0)
  int64_t split_stride;  // batch * n
  int splits;
  const void* bias;  // [n] in the output's dtype (x's), contiguous, or nullptr
  float scale;
  int64_t batch;
  int64_t n;
};
// Sets the epilogue's occupancy, the spread dependents' shared memory (where
// limits.spread_smem_max > 0) and limits.dependent_launch.
void configure_epilogue_kernels(int device, DeviceLimits& limits);
// Whether p's loads may take 4 columns at once (plan_epilogue's vector_aligned).
bool epilogue_vector_aligned(const EpilogueParams& p, const Tensor& out);
void launch_epilogue(const EpiloguePlan& plan, const EpilogueParams& p, Tensor& out,
                     Tensor& argmax, Tensor& preactivation, const DeviceLimits& limits,
                     bool dependent_launch, cudaStream_t stream);

// certified.cu: the certified path (prepare_weight's copy, pass 1, selection, rescoring).
void configure_certified_kernels(DeviceLimits& limits);
struct CertifiedOutputs {
  float* out;
  int64_t* argmax;
  float* preactivation;
};
// The call's workspace: the selection's per-row candidate counts (-1: every column) are the
// `batch` ints at float offset counts_offset.
struct CertifiedWorkspace {
  Tensor workspace;
  int64_t counts_offset;
};
// `prepared`: prepare_weight's copy of the weight, or nullptr to make one in the call. The
// workspace is allocated on `like`'s device.
CertifiedWorkspace certified_forward(const DeviceLimits& limits, const CertifiedPlan& plan,
                                     const GemmOperands& ops, const uint8_t* prepared,
                                     const float* bias, float scale, int64_t batch, int64_t n,
                                     int64_t k_padded, const Tensor& like,
                                     const CertifiedOutputs& outputs, cudaStream_t stream);
// Writes prepare_weight's copy of w's n rows (prepared_bytes(n, k_padded) bytes at `prepared`).
void launch_prepare(const float* w, int64_t ldw, int64_t n, int64_t k_padded, uint8_t* prepared,
                    cudaStream_t stream);

}  // namespace cuda
}  // namespace fused_pool_gelu
