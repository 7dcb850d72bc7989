// The Hopper (sm_90a) split-K GEMM of the forward: the same job, tiles and output as
// forward_gemm.cuh's tf32x3_splitk_kernel (partial[s, b, n] = the split-s part of x[b] . weight[n],
// 3xTF32 accuracy), on warpgroup MMA (wgmma) instead of mma.sync. On an H200 mma.sync TF32 tops
// out near 190 TFLOP/s, about half of what wgmma reaches, and 3xTF32 needs three MMAs per product.
//
// Only sm_90a has wgmma: the kernel body is compiled for that target alone (elsewhere it traps),
// and the host (forward.cu) launches it only on compute capability 9.0 devices of a build whose
// arch list holds 9.0a (FPG_WITH_SM90A, set by setup.py).
//
// CTA tile 128 (x rows) x 128 (weight rows) x 32 (K). 384 threads = 3 warpgroups, specialized:
//   warpgroup 0, the producer: cp.async loads of the x and weight tiles into a ring of stages,
//     the 3xTF32 split of each landed weight tile (below), then the stage's release;
//   warpgroups 1 and 2, the consumers: consumer c owns x rows [64 c, 64 c + 64) and all 128 weight
//     rows, one m64n128k8 wgmma per K step of 8.
// Stages are handed over with mbarriers (full: the 128 producer threads arrive; empty: the 256
// consumer threads arrive), so the two consumer warpgroups never wait for each other and the
// producer's loads and splits overlap their tensor-core work. The consumers need ~200 registers
// (two 64-float accumulators, two sets of A fragments): setmaxnreg moves registers from the
// producer (kWgProducerRegisters) to the consumers (kWgConsumerRegisters).
//
//   x (A operand, registers): the stage holds x rows padded to 36 floats (conflict-free ldmatrix);
//     each warp loads its 16 x 8 fragments with ldmatrix and splits them into TF32 big + small
//     halves in registers. The wgmma register layout of A for 32-bit types is exactly the
//     mma.m16n8k8 A fragment of forward_gemm.cuh, warp w of the warpgroup holding rows
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
#pragma once

#include <cuda.h>  // CUtensorMap (a plain struct: no driver library needed at link time)
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/forward_gemm.cuh"

namespace fused_pool_gelu {
namespace cuda {
namespace forward_gemm {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FPG_WGMMA_DEVICE_CODE 1
#else
#define FPG_WGMMA_DEVICE_CODE 0
#endif

constexpr int kWgBlockM = kTcBlockM;  // 128 x rows: the host's split-K planner serves both kernels
constexpr int kWgBlockN = kTcBlockN;  // 128 weight rows: the N of one m64n128k8 wgmma
constexpr int kWgBlockK = kTcBlockK;  // 32 floats = 128 bytes: one swizzle row
constexpr int kWgThreads = 384;         // producer warpgroup + 2 consumer warpgroups
constexpr int kWgProducerThreads = 128;
constexpr int kWgConsumerWarps = 8;
// Per-thread registers after setmaxnreg: 128 x 88 + 256 x 208 = 64512 = 384 x 168, the launch's
// allocation, so the consumers' increase never waits. Chosen with ptxas -v: the consumers spill
// below 208 (accumulator, total, two A fragment sets), the producer (8 rows of 64-bit addresses
// for x and weight, unrolled) below 88.
constexpr int kWgProducerRegisters = 88;
constexpr int kWgConsumerRegisters = 208;
// The pipeline's geometry depends on the passes; see WgPipeline below. Producer look-ahead: tiles
// in flight behind the one the producer releases. Each producer step first releases (splits, for
// 3xTF32) tile kt - lookahead, then waits for the stage of tile kt - stages to be empty and issues
// tile kt. Releasing first keeps a tile's hand-over independent of the consumers' progress on
// older tiles (releasing after the refill made the split of tile j + 1 wait for the consumers to
// finish tile j - 1, while they already wanted it during tile j: 31% of the stall samples sat at
// the full barrier). No deadlock while lookahead <= stages - 1: consumers free tile kt - stages
// once they hold tile kt - stages + 1, released by then. (With the old order, stages - 1 hung.)
// Single pass: K tiles per tensor-core accumulation chain (8 x 32 = 256 products), between two
// flushes of the accumulator into float32 registers. Longer chains save drains of the tensor
// pipe but widen the certified bound (forward.cu): at 256 its accumulation term is ~2^-15 of
// ||x|| ||w||, next to the operands' 2^-9; without flushes it would be ~2 K 2^-23 (2^-9 at
// K = 8192), and the default shape would send ~8.7 columns per row to the rescoring, not ~3.6
// (benchmarks/simulate_certified.py).
constexpr int kWgFlushTiles = 8;
// Multicast (single pass, FUSED_POOL_GELU_MULTICAST=1): clusters of the kWgCluster CTAs of one m
// tile along n share its x tile: each loads a quarter of it with TMA, multicast to all of them,
// so each CTA reads 16 KB (its weight tile) + 4 KB from L2 per K tile instead of 32 KB.
constexpr int kWgCluster = 4;
constexpr int kWgXQuarterRows = kWgBlockM / kWgCluster;        // 32
constexpr int kWgXQuarterBytes = kWgXQuarterRows * kWgBlockK * 4;  // 4 KB, swizzled like weights
constexpr int kWgMmaK = 8;
constexpr int kWgKSteps = kWgBlockK / kWgMmaK;  // 4
constexpr int kWgAccum = kWgBlockN / 2;          // 64 m64n128 accumulator floats per thread

constexpr int kWgWeightTileBytes = kWgBlockN * kWgBlockK * 4;         // 16 KB, swizzled
constexpr int kWgXLd = kWgBlockK + 4;                                 // padded x row, floats
constexpr int kWgXTileBytes = kWgBlockM * kWgXLd * 4;                 // 18 KB
constexpr int kWgSwizzleAlign = 1024;

// Shared-memory ring of one kernel instantiation: kStages stages of {weight big half, weight small
// half (3xTF32 only), x tile}, then the full and empty barriers.
//   3xTF32: 4 stages x (16 + 16 + 18 KB) = 200 KB, look-ahead 2 (3 was measured slower: 85.6 us
//     against 78.2 at B = 1024, the producer then waits on the empty barrier every tile).
//   single pass: no small half, so 6 stages x (16 + 18 KB) = 204 KB fit, with look-ahead 4: the
//     first GPU run (4 stages, look-ahead 2) kept ~2.5 tiles in flight and ran at 36% of the
//     tensor pipe, bound by its loads' latency (Nsight Compute: L2 at 44%).
template <int kPasses>
struct WgPipeline {
  static constexpr int kStages = kPasses == 3 ? 4 : 6;
  static constexpr int kLookahead = kPasses == 3 ? 2 : 4;
  static constexpr int kWeightHalves = kPasses == 3 ? 2 : 1;
  static constexpr int kBigOffset = 0;                                   // kStages big halves
  static constexpr int kSmallOffset = kStages * kWgWeightTileBytes;      // kStages small halves
  static constexpr int kXOffset = kWeightHalves * kStages * kWgWeightTileBytes;  // x tiles
  static constexpr int kBarrierOffset = kXOffset + kStages * kWgXTileBytes;  // full[S], empty[S]
  static constexpr int kSmemBytes = kBarrierOffset + 2 * kStages * 8 + kWgSwizzleAlign;
  static_assert(kLookahead >= 1 && kLookahead <= kStages - 1, "producer look-ahead");
  static_assert(kSmemBytes <= 227 * 1024, "within an sm_90 CTA's shared memory");
};

// Producer thread i moves 16-byte chunk i % 8 of tile rows i / 8 + 16 r, r < 8 (x and weight).
constexpr int kWgChunksPerRow = kWgBlockK / 4;                            // 8
constexpr int kWgProducerRowStep = kWgProducerThreads / kWgChunksPerRow;  // 16
constexpr int kWgProducerRows = kWgBlockM / kWgProducerRowStep;           // 8 rows per thread

static_assert(kWgConsumerWarps * 16 == kWgBlockM, "16 x rows per consumer warp");
static_assert(kWgProducerThreads + 32 * kWgConsumerWarps == kWgThreads, "warp roles");
static_assert(kWgProducerThreads * kWgProducerRegisters +
                      32 * kWgConsumerWarps * kWgConsumerRegisters <=
                  kWgThreads * 168,
              "setmaxnreg must stay within the launch's registers (65536 / 384, rounded to 8)");
static_assert(kWgBlockM == kWgBlockN, "the producer walks x and weight tiles with the same rows");
static_assert(kWgBlockK * 4 == 128, "one 128-byte swizzle row per tile row");
static_assert(kWgWeightTileBytes % kWgSwizzleAlign == 0, "swizzled tiles stay 1024-byte aligned");

#if FPG_WGMMA_DEVICE_CODE

// Byte offset of 16-byte chunk `chunk` of row `row` in a 128-byte-swizzled tile.
__device__ __forceinline__ uint32_t swizzle128(int row, int chunk) {
  return static_cast<uint32_t>(row * 128 + ((chunk ^ (row & 7)) << 4));
}

// Shared-memory matrix descriptor (PTX ISA "Matrix Descriptor Format"): start address >> 4 in bits
// 0-13, leading byte offset >> 4 in bits 16-29 (unused by swizzled K-major layouts: 1), stride byte
// offset >> 4 in bits 32-45 (1024: the next group of 8 rows), swizzle mode in bits 62-63 (1: 128 B).
__device__ __forceinline__ uint64_t weight_descriptor(uint32_t address) {
  return static_cast<uint64_t>((address & 0x3FFFF) >> 4) | (uint64_t{1} << 16) |
         (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_wait_all() {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
// Waits until at most one committed wgmma group is still running.
__device__ __forceinline__ void wgmma_wait_one() {
  asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
}
// Generic-proxy writes to shared memory (st.shared, cp.async) become visible to the async proxy
// that wgmma reads through only after this fence (and a barrier with the reading threads).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// mbarriers in shared memory (PTX ISA "mbarrier"): arrive has release and try_wait acquire
// semantics at CTA scope, so data written before an arrive is visible after the matching wait.
__device__ __forceinline__ void mbarrier_init(uint32_t barrier, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(barrier), "r"(count) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint32_t barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(barrier) : "memory");
}
// Waits until the phase with this parity (0, 1, 0, ... for uses 0, 1, 2, ...) has completed.
__device__ __forceinline__ void mbarrier_wait(uint32_t barrier, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(barrier),
      "r"(parity)
      : "memory");
}

// Cluster pieces of the multicast producer (PTX ISA: cp.async.bulk.tensor, mbarrier, mapa).
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  return rank;
}
// Every thread of every CTA of the cluster: barrier inits visible cluster-wide before use, and no
// CTA leaving while the others may still write into its shared memory or arrive on its barriers.
__device__ __forceinline__ void cluster_sync() {
  __syncwarp();  // the .aligned forms need the whole warp converged
  asm volatile(
      "barrier.cluster.arrive.release.aligned;\n"
      "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t barrier, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(barrier),
               "r"(bytes)
               : "memory");
}
// Arrives on the barrier at the same shared-memory offset in cluster CTA `rank`.
__device__ __forceinline__ void mbarrier_arrive_in_cta(uint32_t barrier, uint32_t rank) {
  asm volatile(
      "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n}\n" ::"r"(barrier),
      "r"(rank)
      : "memory");
}
// mbarrier_wait with cluster-scope acquire: the arrivals came from other CTAs' consumers.
__device__ __forceinline__ void mbarrier_wait_cluster(uint32_t barrier, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT_CLUSTER:\n"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_CLUSTER;\n}\n" ::"r"(barrier),
      "r"(parity)
      : "memory");
}
// Box (coordinates: K, row) of a 2-D tensor map into shared memory, completing on `barrier`; the
// multicast form writes the same offset in every CTA of `cta_mask` and completes on each one's
// barrier at the same offset.
__device__ __forceinline__ void tma_load(uint32_t destination, const CUtensorMap* map, int32_t k,
                                         int32_t row, uint32_t barrier) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(destination),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(k), "r"(row), "r"(barrier)
      : "memory");
}
__device__ __forceinline__ void tma_load_multicast(uint32_t destination, const CUtensorMap* map,
                                                   int32_t k, int32_t row, uint32_t barrier,
                                                   uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(destination),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(k), "r"(row), "r"(barrier), "h"(cta_mask)
      : "memory");
}

// Moves this warpgroup's per-thread register allocation to kCount (all its warps must execute it).
template <bool kIncrease, int kCount>
__device__ __forceinline__ void set_max_registers() {
  if constexpr (kIncrease) {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kCount));
  } else {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kCount));
  }
}

// d (+)= a * b on 64 x 128 x 8: a from registers (TF32 bit patterns), b [128 rows][8] K-major
// through its descriptor; accumulate = false overwrites d.
__device__ __forceinline__ void wgmma_m64n128k8_tf32(float (&d)[kWgAccum], const uint32_t (&a)[4],
                                                     uint64_t b_descriptor, bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %68, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %69, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(static_cast<int>(accumulate)),
        "l"(b_descriptor));
}

#endif  // FPG_WGMMA_DEVICE_CODE

// The multicast kernel's tensor maps, fp32 with the 128-byte swizzle: x (box 32 K x 32 rows, a
// quarter tile) and the weight (box 32 K x 128 rows), over the same operands as GemmParams' x and
// w. Unused (zeros) by the other instantiations.
struct TmaMaps {
  CUtensorMap x;
  CUtensorMap w;
};

// kPasses = 3: 3xTF32 (float32-accurate); kPasses = 1: one TF32 wgmma per K step on the raw fp32
// operands (the tensor core reads their top 19 bits), no split: the certified first pass.
// kMulticast (single pass only): TMA loads, x shared by a cluster of kWgCluster CTAs along n (the
// grid's x dimension is then a multiple of kWgCluster, launched as clusters of that size).
template <int kPasses, bool kMulticast = false>
__global__ void __launch_bounds__(kWgThreads, 1)
    tf32x3_wgmma_splitk_kernel(const GemmParams p, const __grid_constant__ TmaMaps maps) {
  static_assert(kPasses == 1 || kPasses == 3, "3xTF32 or single-pass TF32");
  static_assert(!kMulticast || kPasses == 1, "multicast feeds the single pass only");
#if FPG_WGMMA_DEVICE_CODE
  using Pipe = WgPipeline<kPasses>;
  constexpr int kStages = Pipe::kStages;
  constexpr int kLookahead = Pipe::kLookahead;
  constexpr int kBigOffset = Pipe::kBigOffset;
  constexpr int kSmallOffset = Pipe::kSmallOffset;
  constexpr int kXOffset = Pipe::kXOffset;
  constexpr int kBarrierOffset = Pipe::kBarrierOffset;
  allow_dependent_launch();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t smem_base =
      (shared_address(smem_raw) + (kWgSwizzleAlign - 1)) & ~uint32_t{kWgSwizzleAlign - 1};
  unsigned char* const smem = smem_raw + (smem_base - shared_address(smem_raw));
  const uint32_t full_barrier = smem_base + kBarrierOffset;    // + 8 stage
  const uint32_t empty_barrier = full_barrier + 8 * kStages;   // + 8 stage

  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;

  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kWgBlockN;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kWgBlockM;
  const int64_t split = blockIdx.z;
  const int64_t k_begin = split * p.k_per_split;
  const int64_t k_end = min(k_begin + p.k_per_split, p.k);
  const int num_k_tiles = static_cast<int>(ceil_div(k_end - k_begin, int64_t{kWgBlockK}));

  // Full: the producer threads arrive (cp.async), or the one TMA-issuing thread with the bytes it
  // expects. Empty: every consumer thread, or with multicast every consumer warp of every CTA
  // whose shared memory the stage's loads fill.
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(full_barrier + 8 * s, kMulticast ? 1 : kWgProducerThreads);
      mbarrier_init(empty_barrier + 8 * s, (kMulticast ? kWgCluster * kWgConsumerWarps
                                                       : 32 * kWgConsumerWarps));
    }
    if constexpr (kMulticast) fence_mbarrier_init();
  }
  __syncthreads();
  if constexpr (kMulticast) cluster_sync();

  if (warp < kWgProducerThreads / 32) {
    // ---------------------------------------------------------------------------------------
    // Producer. Each thread splits exactly the weight chunks it loaded itself (the split is
    // elementwise), so waiting for its own cp.async groups is enough; no barrier among threads.
    set_max_registers<false, kWgProducerRegisters>();
    if constexpr (kMulticast) {
      if (tid == 0) {
        const uint32_t rank = cluster_rank();
        const int32_t x_row =
            static_cast<int32_t>(m0) + static_cast<int32_t>(rank) * kWgXQuarterRows;
        for (int kt = 0; kt < num_k_tiles; ++kt) {
          const int stage = kt % kStages;
          if (kt >= kStages) {
            // Every consumer of the cluster is done with tile kt - S in this stage.
            mbarrier_wait_cluster(empty_barrier + 8 * stage, ((kt / kStages) - 1) & 1);
          }
          const uint32_t full = full_barrier + 8 * stage;
          // Own weight tile, plus the 4 x tile quarters that the cluster's CTAs multicast here.
          mbarrier_arrive_expect_tx(full, kWgWeightTileBytes + kWgCluster * kWgXQuarterBytes);
          const int32_t k = static_cast<int32_t>(k_begin) + kt * kWgBlockK;
          tma_load(smem_base + kBigOffset + stage * kWgWeightTileBytes, &maps.w, k,
                   static_cast<int32_t>(n0), full);
          tma_load_multicast(
              smem_base + kXOffset + stage * kWgXTileBytes + rank * kWgXQuarterBytes, &maps.x,
              k, x_row, full, static_cast<uint16_t>((1u << kWgCluster) - 1));
        }
      }
      cluster_sync();
      return;
    }
    const int row0 = tid / kWgChunksPerRow;
    const int chunk = tid % kWgChunksPerRow;
    auto issue_tile = [&](int k_tile) {
      const int stage = k_tile % kStages;
      const int64_t k = k_begin + static_cast<int64_t>(k_tile) * kWgBlockK + 4 * chunk;
      // The chunk holds floats [k, k + 4) with k and k_end multiples of 4: all in or all out.
      const bool k_ok = k < k_end;
      const uint32_t x_tile = smem_base + kXOffset + stage * kWgXTileBytes;
      const uint32_t w_tile = smem_base + kBigOffset + stage * kWgWeightTileBytes;
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
      const int stage = k_tile % kStages;
      if constexpr (kPasses == 3) {
      unsigned char* big = smem + kBigOffset + stage * kWgWeightTileBytes;
      unsigned char* small = smem + kSmallOffset + stage * kWgWeightTileBytes;
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
      }
      fence_proxy_async_shared();  // the halves are read by wgmma (async proxy)
      mbarrier_arrive(full_barrier + 8 * stage);
    };
    for (int kt = 0; kt < num_k_tiles; ++kt) {
      if (kt >= kLookahead) {
        cp_async_wait<kLookahead - 1>();  // groups committed: kt => tile kt - lookahead landed
        release_tile(kt - kLookahead);
      }
      if (kt >= kStages) {
        // Stage kt % S held tile kt - S: wait until every consumer warp is done with it.
        mbarrier_wait(empty_barrier + 8 * (kt % kStages), ((kt / kStages) - 1) & 1);
      }
      issue_tile(kt);
    }
    cp_async_wait<0>();
    for (int kt = max(num_k_tiles - kLookahead, 0); kt < num_k_tiles; ++kt) release_tile(kt);
    return;
  }

  // -----------------------------------------------------------------------------------------
  // Consumers.
  set_max_registers<true, kWgConsumerRegisters>();
  const int warpgroup = warp / 4 - 1;  // consumer index: x rows [64 c, 64 c + 64)
  const int warp_in_group = warp % 4;
  // ldmatrix.x4 lane l points at row (l & 7) + 8 ((l >> 3) & 1), column 4 (l >> 4) of the 16 x 8
  // block: matrices = a0..a3 (see the mma.sync kernel's header comment). The padded x tile (rows
  // of kWgXLd floats) or, with TMA, the 128-byte-swizzled one (16-byte chunk c of row r at chunk
  // position c ^ (r % 8); r % 8 = l % 8 here).
  const int a_row = warpgroup * 64 + warp_in_group * 16 + (lane & 7) + 8 * ((lane >> 3) & 1);
  auto a_fragment_address = [&](uint32_t x_tile, int kk) -> uint32_t {
    if constexpr (kMulticast) {
      return x_tile + a_row * 128 + ((((lane >> 4) + 2 * kk) ^ (lane & 7)) << 4);
    } else {
      return x_tile + (a_row * kWgXLd + 4 * (lane >> 4) + kk * kWgMmaK) * 4;
    }
  };
  auto release_stage = [&](int stage) {
    if constexpr (kMulticast) {
      // One arrival per warp and CTA of the cluster, lane r on CTA r, after the warp's reads
      // (__syncwarp orders them before the release). One per thread (4 x 256 remote arrivals
      // per stage on each CTA's barrier) made the first multicast pass 1 four times slower.
      __syncwarp();
      if (lane < kWgCluster) mbarrier_arrive_in_cta(empty_barrier + 8 * stage, lane);
    } else {
      mbarrier_arrive(empty_barrier + 8 * stage);
    }
  };
  // Two sets of A fragments: the wgmmas of a tile read their registers until they complete, while
  // the next tile's are loaded.
  uint32_t a_big[2][kWgKSteps][4];
  uint32_t a_small[2][kWgKSteps][4];
  // Single pass: the sums of squares of this thread's two x rows (g and g + 8 of its warp's 16)
  // in the CTAs of n tile 0, and of weight row (c / 2), half c % 2 of each K tile, in the CTAs of
  // m tile 0 (c = consumer thread index): each row once per split.
  const bool sum_x_squares = kPasses == 1 && p.x_sumsq != nullptr && blockIdx.x == 0;
  const bool sum_w_squares = kPasses == 1 && p.w_sumsq != nullptr && blockIdx.y == 0;
  float x_squares[2] = {0.f, 0.f};
  float w_squares = 0.f;
  auto load_x_fragments = [&](int k_tile, int set) {
    const int stage = k_tile % kStages;
    mbarrier_wait(full_barrier + 8 * stage, (k_tile / kStages) & 1);
    const uint32_t x_tile = smem_base + kXOffset + stage * kWgXTileBytes;
#pragma unroll
    for (int kk = 0; kk < kWgKSteps; ++kk) {
      uint32_t r[4];
      ldmatrix_x4(r, a_fragment_address(x_tile, kk));
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if constexpr (kPasses == 3) {
          split_tf32(r[e], a_big[set][kk][e], a_small[set][kk][e]);
        } else {
          a_big[set][kk][e] = r[e];
          // a0, a2: row g; a1, a3: row g + 8 (the m16n8k8 A fragment).
          if (sum_x_squares) {
            const float v = __uint_as_float(r[e]);
            x_squares[e & 1] = fmaf(v, v, x_squares[e & 1]);
          }
        }
      }
    }
  };
  const int consumer = tid - kWgProducerThreads;
  auto add_w_squares = [&](int k_tile) {
    const unsigned char* tile = smem + kBigOffset + (k_tile % kStages) * kWgWeightTileBytes;
    const int row = consumer / 2;
#pragma unroll
    for (int c = 0; c < kWgChunksPerRow / 2; ++c) {
      const float4 v = *reinterpret_cast<const float4*>(
          tile + swizzle128(row, (consumer % 2) * (kWgChunksPerRow / 2) + c));
      w_squares = fmaf(v.x, v.x, fmaf(v.y, v.y, fmaf(v.z, v.z, fmaf(v.w, v.w, w_squares))));
    }
  };

  float acc[kWgAccum];
  float total[kWgAccum];
#pragma unroll
  for (int i = 0; i < kWgAccum; ++i) {
    acc[i] = 0.f;  // overwritten by the first wgmma of each K tile; zeroed so no read is undefined
    total[i] = 0.f;
  }

  if constexpr (kPasses == 3) {
    // The loop body is written for register set kt % 2 at compile time (two tiles per
    // iteration): register arrays indexed by a run-time value would go to local memory.
    auto run_tile = [&](int kt, auto set_constant) {
      constexpr int kSet = decltype(set_constant)::value;
      const int stage = kt % kStages;
      const uint32_t w_big = smem_base + kBigOffset + stage * kWgWeightTileBytes;
      const uint32_t w_small = smem_base + kSmallOffset + stage * kWgWeightTileBytes;
      wgmma_fence();  // acc and the A registers were last written by ordinary instructions
#pragma unroll
      for (int kk = 0; kk < kWgKSteps; ++kk) {
        wgmma_m64n128k8_tf32(acc, a_small[kSet][kk], weight_descriptor(w_big + 32 * kk), kk > 0);
        wgmma_m64n128k8_tf32(acc, a_big[kSet][kk], weight_descriptor(w_small + 32 * kk), true);
      }
#pragma unroll
      for (int kk = 0; kk < kWgKSteps; ++kk) {
        wgmma_m64n128k8_tf32(acc, a_big[kSet][kk], weight_descriptor(w_big + 32 * kk), true);
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
  } else {
    // Single pass: the tensor pipe drains only once per kWgFlushTiles tiles, where the
    // accumulator is added into `total` (the error bound of the selection models the tensor
    // core's accumulation over one such group). Inside a group, tile kt's wgmmas are issued
    // before tile kt - 1's are waited for, and the A register set of tile kt - 1 is refilled with
    // tile kt + 1's fragments only after that wait.
    auto run_tile = [&](int kt, auto set_constant) {
      constexpr int kSet = decltype(set_constant)::value;
      const uint32_t w_big = smem_base + kBigOffset + (kt % kStages) * kWgWeightTileBytes;
      const bool group_start = kt % kWgFlushTiles == 0;
      const bool group_end = (kt + 1) % kWgFlushTiles == 0 || kt + 1 == num_k_tiles;
      wgmma_fence();  // the A registers (ldmatrix) and acc (the last flush) were written normally
#pragma unroll
      for (int kk = 0; kk < kWgKSteps; ++kk) {
        wgmma_m64n128k8_tf32(acc, a_big[kSet][kk], weight_descriptor(w_big + 32 * kk),
                             !(group_start && kk == 0));
      }
      wgmma_commit();
      if (sum_w_squares) add_w_squares(kt);
      // The flush reads acc right after the wait for all groups, in the same branch: ptxas
      // serializes every wgmma of the kernel (warning C7514) when a read of the accumulator
      // could follow a path that left a group in flight.
      if (group_end) {
        wgmma_wait_all();
#pragma unroll
        for (int i = 0; i < kWgAccum; ++i) total[i] += acc[i];
      } else {
        wgmma_wait_one();
      }
      if (kt > 0) release_stage((kt - 1) % kStages);
      if (kt + 1 < num_k_tiles) load_x_fragments(kt + 1, 1 - kSet);
    };
    if (num_k_tiles > 0) load_x_fragments(0, 0);
    // One accumulation chain per iteration, unrolled: no wgmma is in flight across the loop's back
    // edge. With two tiles per iteration, a chain's wgmmas were in flight there, and ptxas copied
    // the accumulator at the back edge behind an injected wait (info C7517), draining the pipe
    // every two tiles.
    static_assert(kWgFlushTiles % 2 == 0, "register sets alternate within a chain");
    for (int kt0 = 0; kt0 < num_k_tiles; kt0 += kWgFlushTiles) {
#pragma unroll
      for (int j = 0; j < kWgFlushTiles; j += 2) {
        if (kt0 + j < num_k_tiles) run_tile(kt0 + j, std::integral_constant<int, 0>{});
        if (kt0 + j + 1 < num_k_tiles) run_tile(kt0 + j + 1, std::integral_constant<int, 1>{});
      }
      // Nothing is in flight here (the chain's last tile waited for all): this tells ptxas so.
      wgmma_wait_all();
    }

    if (sum_x_squares) {
      // The 4 lanes of a quad (t = lane % 4) hold different columns of the same two rows.
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        x_squares[h] += __shfl_xor_sync(0xffffffffu, x_squares[h], 1);
        x_squares[h] += __shfl_xor_sync(0xffffffffu, x_squares[h], 2);
        const int64_t m = m0 + warpgroup * 64 + warp_in_group * 16 + (lane >> 2) + 8 * h;
        if ((lane & 3) == 0 && m < p.rows) p.x_sumsq[split * p.rows + m] = x_squares[h];
      }
    }
    if (sum_w_squares) {
      w_squares += __shfl_xor_sync(0xffffffffu, w_squares, 1);  // the two halves of the row
      const int64_t col = n0 + consumer / 2;
      if (consumer % 2 == 0 && col < p.n) p.w_sumsq[split * p.n + col] = w_squares;
    }
  }

  // Store: value 4 j + e of this thread is row g (+8 for e >= 2), column 8 j + 2 t (+1 for odd e).
  const int g = lane >> 2;
  const int t = lane & 3;
  float* out = p.partial + split * p.split_stride;
  const bool vec2 = (p.n % 2) == 0;  // then col even and col < N => col + 1 < N
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t m = m0 + warpgroup * 64 + warp_in_group * 16 + g + 8 * h;
    if (m >= p.rows) continue;
    float* out_row = out + m * p.n;
#pragma unroll
    for (int j = 0; j < kWgBlockN / 8; ++j) {
      const int64_t col = n0 + 8 * j + 2 * t;
      const float v0 = total[4 * j + 2 * h];
      const float v1 = total[4 * j + 2 * h + 1];
      if (vec2) {
        if (col < p.n) *reinterpret_cast<float2*>(out_row + col) = make_float2(v0, v1);
      } else {
        if (col < p.n) out_row[col] = v0;
        if (col + 1 < p.n) out_row[col + 1] = v1;
      }
    }
  }
  if constexpr (kMulticast) cluster_sync();
#else
  __trap();  // launched only where the sm_90a code exists (see the host check in forward.cu)
#endif  // FPG_WGMMA_DEVICE_CODE
}

#undef FPG_WGMMA_DEVICE_CODE

}  // namespace forward_gemm
}  // namespace cuda
}  // namespace fused_pool_gelu
