// The portable 3xTF32 split-K GEMM on mma.sync (sm_80 and later; on Hopper the wgmma GEMM of
// gemm_sm90a.cu serves instead unless FUSED_POOL_GELU_FORCE_MMA_SYNC is set): tensor cores with
// float32-class accuracy from the 3xTF32 split of every operand.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/forward_launch.h"
#include "cuda/gemm_common.cuh"

namespace fused_pool_gelu {
namespace cuda {
namespace forward_gemm {

// ------------------------------------------------------------------------------------------------
// Larger batch: 3xTF32 tensor-core split-K GEMM.
//
// CTA tile kTcBlockM (batch rows) x kTcBlockN (weight rows) x kTcBlockK, 8 warps as 2 (M) x 4 (N),
// warp tile 64 x 32 = 4 x 4 mma tiles of 16 x 8. Global -> shared with cp.async in a kTcStages
// ring (zero fill past M, N and the split's K range). Shared rows are padded to 36 floats: eight
// consecutive rows then start 16 bytes apart modulo 128, so ldmatrix phases (8 rows x 16 B) and
// the cp.async writes are free of bank conflicts.
//
// m16n8k8 TF32 fragments (g = lane / 4, t = lane % 4), PTX ISA "mma.m16n8k8" (.tf32):
//   A (16 x 8, row): a0 (g, t)  a1 (g + 8, t)  a2 (g, t + 4)  a3 (g + 8, t + 4)
//   B (8 x 8, col):  b0 (k = t, n = g)  b1 (k = t + 4, n = g)
//   C (16 x 8):      c0 (g, 2t)  c1 (g, 2t + 1)  c2 (g + 8, 2t)  c3 (g + 8, 2t + 1)
// ldmatrix.x4 delivers float (row t/4, col t%4) of matrix j in r[j] (see ldmatrix_x4), so
//   A: matrices (rows 0-7, k 0-3), (rows 8-15, k 0-3), (rows 0-7, k 4-7), (rows 8-15, k 4-7)
//      = a0..a3: lane l points at row (l & 7) + 8 ((l >> 3) & 1), column 4 (l >> 4);
//   B: matrices (n 0-7, k 0-3), (n 0-7, k 4-7), (n 8-15, k 0-3), (n 8-15, k 4-7)
//      = b0, b1 of n tile 2p and b0, b1 of n tile 2p + 1: lane l points at weight row
//      (l & 7) + 8 (l >> 4), column 4 ((l >> 3) & 1).
// ------------------------------------------------------------------------------------------------


static_assert(kTcFragsN % 2 == 0, "B fragments are loaded two n tiles per ldmatrix.x4");
static_assert(kTcBlockM % kTcLoadRowsPerPass == 0 && kTcBlockN % kTcLoadRowsPerPass == 0, "loader");
static_assert((kTcSmemLd * 4) % 16 == 0, "ldmatrix / cp.async rows must stay 16-byte aligned");


__global__ void __launch_bounds__(kTcThreads, 1) tf32x3_splitk_kernel(const GemmParams p) {
  extern __shared__ __align__(16) float smem[];  // kTcStages x {A [128][36], B [128][36]}
  allow_dependent_launch();

  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int warp_m = warp / kTcWarpsN;
  const int warp_n = warp % kTcWarpsN;

  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kTcBlockN;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kTcBlockM;
  const int64_t split = blockIdx.z;
  const int64_t k_begin = split * p.k_per_split;
  const int64_t k_end = min(k_begin + p.k_per_split, p.k);
  const int num_k_tiles = static_cast<int>(ceil_div(k_end - k_begin, int64_t{kTcBlockK}));

  // Loader: thread -> tile rows load_row + 32 pass, floats [load_col, load_col + 4).
  const int load_row = tid / kTcChunksPerRow;
  const int load_col = (tid % kTcChunksPerRow) * 4;
  const float* a_src[kTcLoadPassesA];
  bool a_ok[kTcLoadPassesA];
#pragma unroll
  for (int pass = 0; pass < kTcLoadPassesA; ++pass) {
    const int64_t m = m0 + load_row + pass * kTcLoadRowsPerPass;
    a_ok[pass] = m < p.rows;
    a_src[pass] = p.x + (a_ok[pass] ? m : 0) * p.ldx + k_begin + load_col;
  }
  const float* b_src[kTcLoadPassesB];
  bool b_ok[kTcLoadPassesB];
#pragma unroll
  for (int pass = 0; pass < kTcLoadPassesB; ++pass) {
    const int64_t n = n0 + load_row + pass * kTcLoadRowsPerPass;
    b_ok[pass] = n < p.n;
    b_src[pass] = p.w + (b_ok[pass] ? n : 0) * p.ldw + k_begin + load_col;
  }
  const uint32_t smem_base = shared_address(smem);
  constexpr uint32_t kStageBytes = kTcStageFloats * sizeof(float);
  constexpr uint32_t kPassBytes = kTcLoadRowsPerPass * kTcSmemLd * sizeof(float);
  const uint32_t a_dst = smem_base + (load_row * kTcSmemLd + load_col) * sizeof(float);
  const uint32_t b_dst = a_dst + kTcTileAFloats * sizeof(float);

  auto load_tile = [&](int stage, int k_tile) {
    const int64_t k_off = static_cast<int64_t>(k_tile) * kTcBlockK;
    // The chunk holds floats [k, k + 4) with k and k_end multiples of 4: all in or all out.
    const bool k_ok = k_begin + k_off + load_col < k_end;
    const uint32_t stage_off = stage * kStageBytes;
#pragma unroll
    for (int pass = 0; pass < kTcLoadPassesA; ++pass) {
      const bool ok = a_ok[pass] && k_ok;
      cp_async_16(a_dst + stage_off + pass * kPassBytes, ok ? a_src[pass] + k_off : p.x,
                  ok ? 16 : 0);
    }
#pragma unroll
    for (int pass = 0; pass < kTcLoadPassesB; ++pass) {
      const bool ok = b_ok[pass] && k_ok;
      cp_async_16(b_dst + stage_off + pass * kPassBytes, ok ? b_src[pass] + k_off : p.w,
                  ok ? 16 : 0);
    }
  };

  // ldmatrix row addresses of this lane (bytes from the stage base), see the header comment.
  const uint32_t a_frag_off =
      ((warp_m * kTcWarpTileM + (lane & 7) + 8 * ((lane >> 3) & 1)) * kTcSmemLd + 4 * (lane >> 4)) *
      sizeof(float);
  const uint32_t b_frag_off =
      (kTcTileAFloats +
       (warp_n * kTcWarpTileN + (lane & 7) + 8 * (lane >> 4)) * kTcSmemLd + 4 * ((lane >> 3) & 1)) *
      sizeof(float);
  constexpr uint32_t kFragRowsBytes = 16 * kTcSmemLd * sizeof(float);  // 16 rows down

  // Two-level accumulation: the mma chain of one K tile (12 mma per element) goes into `acc`, which
  // is then added into `total` (plain fp32 adds, round to nearest) and cleared. Tensor cores
  // accumulate with truncation (Fasi et al. 2021): one chain over K = 8192 (3072 mma) would bias
  // the sums by ~1e-4 relative in a CPU model of that, against ~6e-7 with a flush per K tile.
  float acc[kTcFragsM][kTcFragsN][4] = {};
  float total[kTcFragsM][kTcFragsN][4] = {};

  // Prologue: tiles 0 .. kTcStages - 2. One commit per tile slot, even when empty, so that the
  // group count stays "tile index + 1" and the wait below is exact.
#pragma unroll
  for (int s = 0; s < kTcStages - 1; ++s) {
    if (s < num_k_tiles) load_tile(s, s);
    cp_async_commit();
  }

  for (int kt = 0; kt < num_k_tiles; ++kt) {
    // Groups committed so far: kTcStages - 1 + kt. At most kTcStages - 2 pending => tile kt landed.
    cp_async_wait<kTcStages - 2>();
    // All threads' copies of tile kt are visible, and every warp is done with tile kt - 1, whose
    // stage ((kt - 1) % kTcStages) is refilled next.
    __syncthreads();
    {
      const int next = kt + kTcStages - 1;
      if (next < num_k_tiles) load_tile(next % kTcStages, next);
      cp_async_commit();
    }

    const uint32_t stage_base = smem_base + (kt % kTcStages) * kStageBytes;
#pragma unroll
    for (int kk = 0; kk < kTcBlockK / kTcMmaK; ++kk) {
      const uint32_t k_byte = kk * kTcMmaK * sizeof(float);
      uint32_t a_big[kTcFragsM][4], a_small[kTcFragsM][4];
      uint32_t b_big[kTcFragsN][2], b_small[kTcFragsN][2];
#pragma unroll
      for (int mt = 0; mt < kTcFragsM; ++mt) {
        uint32_t r[4];
        ldmatrix_x4(r, stage_base + a_frag_off + mt * kFragRowsBytes + k_byte);
#pragma unroll
        for (int e = 0; e < 4; ++e) split_tf32(r[e], a_big[mt][e], a_small[mt][e]);
      }
#pragma unroll
      for (int np = 0; np < kTcFragsN / 2; ++np) {
        uint32_t r[4];
        ldmatrix_x4(r, stage_base + b_frag_off + np * kFragRowsBytes + k_byte);
        split_tf32(r[0], b_big[2 * np][0], b_small[2 * np][0]);
        split_tf32(r[1], b_big[2 * np][1], b_small[2 * np][1]);
        split_tf32(r[2], b_big[2 * np + 1][0], b_small[2 * np + 1][0]);
        split_tf32(r[3], b_big[2 * np + 1][1], b_small[2 * np + 1][1]);
      }
      mma_3xtf32_grid(acc, a_big, a_small, b_big, b_small);
    }
    flush_into_total(total, acc);
  }
  cp_async_wait<0>();  // only empty groups can remain; drained for tidiness

  // Store the fp32 tile: c0, c1 at (g, 2t), (g, 2t + 1); c2, c3 eight rows down.
  const int g = lane >> 2;
  const int t = lane & 3;
  float* out = p.partial + split * p.split_stride;
  const bool even_n = (p.n % 2) == 0;
#pragma unroll
  for (int mt = 0; mt < kTcFragsM; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t m = m0 + warp_m * kTcWarpTileM + mt * kTcMmaM + g + 8 * h;
      if (m >= p.rows) continue;
      float* out_row = out + m * p.n;
#pragma unroll
      for (int nt = 0; nt < kTcFragsN; ++nt) {
        const int64_t col = n0 + warp_n * kTcWarpTileN + nt * kTcMmaN + 2 * t;
        store_partial_pair(out_row, col, p.n, even_n, total[mt][nt][2 * h],
                           total[mt][nt][2 * h + 1]);
      }
    }
  }
}

}  // namespace forward_gemm

void configure_gemm_sm80_kernels(int max_smem_optin, DeviceLimits& limits) {
  if (fg::kTcSmemBytes <= max_smem_optin) {
    set_max_dynamic_smem(fg::tf32x3_splitk_kernel, fg::kTcSmemBytes);
    limits.tc_ctas_per_sm =
        resident_ctas_per_sm(fg::tf32x3_splitk_kernel, fg::kTcThreads, fg::kTcSmemBytes);
  }
}

void launch_tf32x3_gemm_sm80(const TcPlan& plan, const GemmOperands& ops, float* partial,
                             int64_t batch, int64_t n, int64_t k_padded, cudaStream_t stream) {
  const dim3 grid = tf32x3_gemm_grid(plan, batch, n);
  const fg::GemmParams p =
      gemm_params(ops, partial, batch, n, k_padded, plan.k_per_split, 0, batch);
  fg::tf32x3_splitk_kernel<<<grid, fg::kTcThreads, fg::kTcSmemBytes, stream>>>(p);
  STD_CUDA_KERNEL_LAUNCH_CHECK();
}
}  // namespace cuda
}  // namespace fused_pool_gelu
