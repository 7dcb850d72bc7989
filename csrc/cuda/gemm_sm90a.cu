// The Hopper (sm_90a) split-K GEMM of the forward: the same job, tiles and output as
// gemm_sm80.cu's tf32x3_splitk_kernel (partial[s, b, n] = the split-s part of x[b] . weight[n],
// 3xTF32 accuracy), on warpgroup MMA (wgmma) instead of mma.sync. On an H200 mma.sync TF32 tops
// out near 190 TFLOP/s, about half of what wgmma reaches, and 3xTF32 needs three MMAs per product.
//
//
// Compiled for sm_90a alone (setup.py), launched only on compute capability 9.0 devices where this
// code is what the driver loaded (configure_gemm_sm90a_kernels).
//
// The 3xTF32 kernel: CTA tile 128 (x rows) x 128 (weight rows) x 32 (K), 384 threads = 3
// warpgroups, specialized:
//   warpgroup 0, the producer: cp.async loads of the x and weight tiles into a kWgStages ring,
//     the 3xTF32 split of each landed weight tile (below), then the stage's release;
//   warpgroups 1 and 2, the consumers: consumer c owns x rows [64 c, 64 c + 64) and all 128 weight
//     rows, three m64n128k8 wgmmas (3xTF32) per K step of 8.
// Stages are handed over with mbarriers (full: the 128 producer threads arrive; empty: the 256
// consumer threads arrive), so the two consumer warpgroups never wait for each other and the
// producer's loads and splits overlap their tensor-core work. The consumers need ~200 registers
// (two 64-float accumulators, two sets of A fragments): setmaxnreg moves registers from the
// producer (kWgProducerRegisters) to the consumers (kWgConsumerRegisters).
//
//   x (A operand, registers): the stage holds x rows padded to 36 floats (conflict-free ldmatrix);
//     each warp loads its 16 x 8 fragments with ldmatrix and splits them into TF32 big + small
//     halves in registers. The wgmma register layout of A for 32-bit types is exactly the
//     mma.m16n8k8 A fragment of gemm_sm80.cu, warp w of the warpgroup holding rows
//     [16 w, 16 w + 16) (CUTLASS cute::GMMA::ALayout_64x8).
//   weight (B operand, shared memory): wgmma reads B only through a shared-memory descriptor, so
//     the split happens in shared memory: the producer rewrites each landed weight tile as its big
//     half in place and writes the small half into the stage's second weight buffer. Both use the
//     128-byte swizzle wgmma expects for K-major operands: row r (128 bytes = 32 floats, one K
//     tile) at r * 128, its 16-byte chunk c at chunk position c ^ (r % 8); 8-row groups 1024 bytes
//     apart (the descriptor's stride byte offset); tiles 1024-byte aligned. K step kk (8 floats)
//     starts 32 kk bytes into each row: the descriptor's start address moves by that much and the
//     hardware applies the swizzle to the full address.
//   accumulator: per thread 64 floats, value 4 j + e at row g (+8 for e >= 2) and column
//     8 j + 2 t + (e % 2) of its warp's 16 rows (g = lane / 4, t = lane % 4), as mma.m16n8k8's C.
//
// Per K tile the 12 wgmmas (4 K steps x {small x big, big x small, big x big}, small terms first)
// write a fresh accumulator, which is then added into `total` with plain fp32 adds: tensor cores
// accumulate with truncation, and flushing every 32 K keeps that bias at the level of fp32 (see
// tf32x3_splitk_kernel). While a tile's wgmmas run, the consumer waits for the next stage and
// loads its fragments into the second register set.

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/forward_launch.h"
#include "cuda/wgmma.cuh"

namespace fused_pool_gelu {
namespace cuda {
namespace forward_gemm {

__global__ void __launch_bounds__(kWgThreads, 1) tf32x3_wgmma_splitk_kernel(const GemmParams p) {
#if FPG_WGMMA_DEVICE_CODE
  allow_dependent_launch();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t smem_base =
      (shared_address(smem_raw) + (kWgSwizzleAlign - 1)) & ~uint32_t{kWgSwizzleAlign - 1};
  unsigned char* const smem = smem_raw + (smem_base - shared_address(smem_raw));
  const uint32_t full_barrier = smem_base + kWgBarrierOffset;    // + 8 stage
  const uint32_t empty_barrier = full_barrier + 8 * kWgStages;   // + 8 stage

  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;

  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kWgBlockN;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kWgBlockM;
  const int64_t split = blockIdx.z;
  const int64_t k_begin = split * p.k_per_split;
  const int64_t k_end = min(k_begin + p.k_per_split, p.k);
  const int num_k_tiles = static_cast<int>(ceil_div(k_end - k_begin, int64_t{kWgBlockK}));

  if (tid == 0) {
    for (int s = 0; s < kWgStages; ++s) {
      mbarrier_init(full_barrier + 8 * s, kWgProducerThreads);
      mbarrier_init(empty_barrier + 8 * s, 32 * kWgConsumerWarps);
    }
  }
  __syncthreads();

  if (warp < kWgProducerThreads / 32) {
    // ---------------------------------------------------------------------------------------
    // Producer. Each thread splits exactly the weight chunks it loaded itself (the split is
    // elementwise), so waiting for its own cp.async groups is enough; no barrier among threads.
    set_max_registers<false, kWgProducerRegisters>();
    const int row0 = tid / kWgChunksPerRow;
    const int chunk = tid % kWgChunksPerRow;
    auto issue_tile = [&](int k_tile) {
      const int stage = k_tile % kWgStages;
      const int64_t k = k_begin + static_cast<int64_t>(k_tile) * kWgBlockK + 4 * chunk;
      // The chunk holds floats [k, k + 4) with k and k_end multiples of 4: all in or all out.
      const bool k_ok = k < k_end;
      const uint32_t x_tile = smem_base + kWgXOffset + stage * kWgXTileBytes;
      const uint32_t w_tile = smem_base + kWgBigOffset + stage * kWgWeightTileBytes;
#pragma unroll
      for (int i = 0; i < kWgProducerRows; ++i) {
        const int row = row0 + kWgProducerRowStep * i;
        const bool x_ok = k_ok && m0 + row < p.rows;
        cp_async_16(x_tile + (row * kWgXLd + 4 * chunk) * 4,
                    x_ok ? p.x + (m0 + row) * p.ldx + k : p.x, x_ok ? 16 : 0);
        const bool w_ok = k_ok && n0 + row < p.n;
        cp_async_16(w_tile + swizzle128(row, chunk), w_ok ? p.w + (n0 + row) * p.ldw + k : p.w,
                    w_ok ? 16 : 0);
      }
      cp_async_commit();
    };
    auto release_tile = [&](int k_tile) {
      const int stage = k_tile % kWgStages;
      unsigned char* big = smem + kWgBigOffset + stage * kWgWeightTileBytes;
      unsigned char* small = smem + kWgSmallOffset + stage * kWgWeightTileBytes;
#pragma unroll
      for (int i = 0; i < kWgProducerRows; ++i) {
        const uint32_t off = swizzle128(row0 + kWgProducerRowStep * i, chunk);
        uint4 v = *reinterpret_cast<const uint4*>(big + off);
        uint4 w;
        split_tf32(v.x, v.x, w.x);
        split_tf32(v.y, v.y, w.y);
        split_tf32(v.z, v.z, w.z);
        split_tf32(v.w, v.w, w.w);
        *reinterpret_cast<uint4*>(big + off) = v;
        *reinterpret_cast<uint4*>(small + off) = w;
      }
      fence_proxy_async_shared();  // the halves are read by wgmma (async proxy)
      mbarrier_arrive(full_barrier + 8 * stage);
    };
    // Past the last tile the steps commit empty cp.async groups, so that the wait below still
    // means "tile kt - lookahead landed": the last tiles are handed over one by one as they land,
    // not all after the last one (a CTA of 8 K tiles, B = 128 at K = 8192, spends a quarter of
    // its tiles in that tail).
    for (int kt = 0; kt < num_k_tiles + kWgLookahead; ++kt) {
      if (kt >= kWgLookahead) {
        cp_async_wait<kWgLookahead - 1>();  // groups committed: kt => tile kt - lookahead landed
        release_tile(kt - kWgLookahead);
      }
      if (kt < num_k_tiles) {
        if (kt >= kWgStages) {
          // Stage kt % S held tile kt - S: wait until every consumer warp is done with it.
          mbarrier_wait(empty_barrier + 8 * (kt % kWgStages), ((kt / kWgStages) - 1) & 1);
        }
        issue_tile(kt);
      } else {
        cp_async_commit();
      }
    }
    return;
  }

  // -----------------------------------------------------------------------------------------
  // Consumers.
  set_max_registers<true, kWgConsumerRegisters>();
  const int warpgroup = warp / 4 - 1;  // consumer index: x rows [64 c, 64 c + 64)
  const int warp_in_group = warp % 4;
  // ldmatrix.x4 lane l points at row (l & 7) + 8 ((l >> 3) & 1), column 4 (l >> 4) of the 16 x 8
  // block: matrices = a0..a3 (see the mma.sync kernel's header comment).
  const uint32_t a_frag_off =
      ((warpgroup * 64 + warp_in_group * 16 + (lane & 7) + 8 * ((lane >> 3) & 1)) * kWgXLd +
       4 * (lane >> 4)) * 4;
  // Two sets of A fragments: the wgmmas of a tile read their registers until they complete, while
  // the next tile's are loaded.
  uint32_t a_big[2][kWgKSteps][4];
  uint32_t a_small[2][kWgKSteps][4];
  auto load_x_fragments = [&](int k_tile, int set) {
    const int stage = k_tile % kWgStages;
    mbarrier_wait(full_barrier + 8 * stage, (k_tile / kWgStages) & 1);
    const uint32_t x_tile = smem_base + kWgXOffset + stage * kWgXTileBytes;
#pragma unroll
    for (int kk = 0; kk < kWgKSteps; ++kk) {
      uint32_t r[4];
      ldmatrix_x4(r, x_tile + a_frag_off + kk * kWgMmaK * 4);
#pragma unroll
      for (int e = 0; e < 4; ++e) split_tf32(r[e], a_big[set][kk][e], a_small[set][kk][e]);
    }
  };

  float acc[kWgAccum];
  float total[kWgAccum];
#pragma unroll
  for (int i = 0; i < kWgAccum; ++i) {
    acc[i] = 0.f;  // overwritten by the first wgmma of each K tile; zeroed so no read is undefined
    total[i] = 0.f;
  }

  // The loop body is written for register set kt % 2 at compile time (two tiles per iteration):
  // register arrays indexed by a run-time value would go to local memory.
  auto run_tile = [&](int kt, auto set_constant) {
    constexpr int kSet = decltype(set_constant)::value;
    const int stage = kt % kWgStages;
    const uint32_t w_big = smem_base + kWgBigOffset + stage * kWgWeightTileBytes;
    const uint32_t w_small = smem_base + kWgSmallOffset + stage * kWgWeightTileBytes;
    wgmma_fence();  // acc and the A registers were last written by ordinary instructions
#pragma unroll
    for (int kk = 0; kk < kWgKSteps; ++kk) {
      wgmma_m64n128k8_tf32(acc, a_small[kSet][kk], swizzled_tile_descriptor(w_big + 32 * kk),
                           kk > 0);
      wgmma_m64n128k8_tf32(acc, a_big[kSet][kk], swizzled_tile_descriptor(w_small + 32 * kk), true);
    }
#pragma unroll
    for (int kk = 0; kk < kWgKSteps; ++kk) {
      wgmma_m64n128k8_tf32(acc, a_big[kSet][kk], swizzled_tile_descriptor(w_big + 32 * kk), true);
    }
    wgmma_commit();
    if (kt + 1 < num_k_tiles) load_x_fragments(kt + 1, 1 - kSet);
    wgmma_wait_all();
    // Every consumer thread arrives: mbarrier.arrive releases only the arriving thread's own
    // earlier accesses (here its ldmatrix reads of the stage's x tile).
    mbarrier_arrive(empty_barrier + 8 * stage);
#pragma unroll
    for (int i = 0; i < kWgAccum; ++i) total[i] += acc[i];
  };

  if (num_k_tiles > 0) load_x_fragments(0, 0);
  for (int kt = 0; kt < num_k_tiles; kt += 2) {
    run_tile(kt, std::integral_constant<int, 0>{});
    if (kt + 1 < num_k_tiles) run_tile(kt + 1, std::integral_constant<int, 1>{});
  }

  store_partial(p, total, split, m0 + warpgroup * 64 + warp_in_group * 16, n0, lane);
#else
  __trap();  // launched only where the sm_90a code exists (configure_gemm_sm90a_kernels checks)
#endif  // FPG_WGMMA_DEVICE_CODE
}

}  // namespace forward_gemm

void configure_gemm_sm90a_kernels(int device, int max_smem_optin, DeviceLimits& limits) {
  if (std::max(fg::kWgSmemBytes, certified_pass1_max_smem_bytes()) > max_smem_optin) return;
  // The wgmma kernels run only where the driver loaded their sm_90a binary. This unit carries no
  // PTX, so where the driver will not load binaries (CUDA_FORCE_PTX_JIT=1: every module JIT
  // compiled from its PTX) there is no code for it at all: that answer is "not here", not an error.
  cudaFuncAttributes attributes{};
  const cudaError_t loaded = cudaFuncGetAttributes(&attributes, fg::tf32x3_wgmma_splitk_kernel);
  if (loaded == cudaErrorNoKernelImageForDevice || loaded == cudaErrorInvalidDeviceFunction) {
    (void)cudaGetLastError();  // clears the (non-sticky) error the query recorded
    return;
  }
  STD_CUDA_CHECK(loaded);
  if (attributes.binaryVersion != 90) return;  // only sm_90a code is ever in this unit
  set_max_dynamic_smem(fg::tf32x3_wgmma_splitk_kernel, fg::kWgSmemBytes);
  configure_certified_pass1_kernels();
  limits.wgmma_ctas_per_sm =
      resident_ctas_per_sm(fg::tf32x3_wgmma_splitk_kernel, fg::kWgThreads, fg::kWgSmemBytes);
}

void launch_tf32x3_gemm_sm90a(const TcPlan& plan, const GemmOperands& ops, float* partial,
                              int64_t batch, int64_t n, int64_t k_padded, cudaStream_t stream) {
  static_assert(fg::kWgBlockM == fg::kTcBlockM && fg::kWgBlockN == fg::kTcBlockN &&
                    fg::kWgBlockK == fg::kTcBlockK,
                "one split-K plan for both tensor-core kernels");
  const dim3 grid = tf32x3_gemm_grid(plan, batch, n);
  const fg::GemmParams p =
      gemm_params(ops, partial, batch, n, k_padded, plan.k_per_split, 0, batch);
  fg::tf32x3_wgmma_splitk_kernel<<<grid, fg::kWgThreads, fg::kWgSmemBytes, stream>>>(p);
  STD_CUDA_KERNEL_LAUNCH_CHECK();
}
}  // namespace cuda
}  // namespace fused_pool_gelu
