// sm_90a building blocks of gemm_sm90a.cu and certified_pass1_sm90a.cu: the warp-specialized
// kernels' shared layout constants, wgmma, mbarrier and TMA wrappers, and the partial stores of a
// wgmma accumulator. Only sm_90a has wgmma: the helpers exist in device code compiled for it
// (FPG_WGMMA_DEVICE_CODE); the kernels trap elsewhere, which no launch reaches (forward_plan.h's
// wgmma_serves).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cuda/gemm_common.cuh"

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
// 4 stages of {weight big 16 KB, weight small 16 KB, x 18 KB} = 200 KB (+1 KB to align).
constexpr int kWgStages = 4;
// Tiles in flight behind the one the producer splits. Each producer step first releases (splits)
// tile kt - lookahead, then waits for the stage of tile kt - kWgStages to be empty and issues tile
// kt. Releasing first keeps a tile's hand-over independent of the consumers' progress on older
// tiles (releasing after the refill would make the split of tile j + 1 wait for the consumers to
// finish tile j - 1, while they already want it during tile j). No deadlock while lookahead <=
// kWgStages - 1: consumers free tile kt - kWgStages once they hold tile kt - kWgStages + 1,
// released by then. 2: look-ahead 3 is slower at every batch (research/README.md, "The
// float32-accurate GEMM (3xTF32)").
constexpr int kWgLookahead = 2;
constexpr int kWgMmaK = 8;
constexpr int kWgKSteps = kWgBlockK / kWgMmaK;  // 4
constexpr int kWgAccum = kWgBlockN / 2;          // 64 m64n128 accumulator floats per thread

constexpr int kWgWeightTileBytes = kWgBlockN * kWgBlockK * 4;         // 16 KB, swizzled
constexpr int kWgXLd = kWgBlockK + 4;                                 // padded x row, floats
constexpr int kWgXTileBytes = kWgBlockM * kWgXLd * 4;                 // 18 KB
constexpr int kWgBigOffset = 0;                                       // kWgStages big halves
constexpr int kWgSmallOffset = kWgStages * kWgWeightTileBytes;        // kWgStages small halves
constexpr int kWgXOffset = 2 * kWgStages * kWgWeightTileBytes;        // kWgStages x tiles
constexpr int kWgBarrierOffset = kWgXOffset + kWgStages * kWgXTileBytes;  // full[S], empty[S]
constexpr int kWgSwizzleAlign = 1024;
constexpr int kWgSmemBytes = kWgBarrierOffset + 2 * kWgStages * 8 + kWgSwizzleAlign;

// Producer thread i moves 16-byte chunk i % 8 of tile rows i / 8 + 16 r, r < 8 (x and weight).
constexpr int kWgChunksPerRow = kWgBlockK / 4;                            // 8
constexpr int kWgProducerRowStep = kWgProducerThreads / kWgChunksPerRow;  // 16
constexpr int kWgProducerRows = kWgBlockM / kWgProducerRowStep;           // 8 rows per thread

static_assert(kWgConsumerWarps * 16 == kWgBlockM, "16 x rows per consumer warp");
static_assert(kWgProducerThreads + 32 * kWgConsumerWarps == kWgThreads, "warp roles");
// Registers per thread at launch: 65536 / kWgThreads, rounded down to setmaxnreg's multiple of 8.
constexpr int kWgLaunchRegisters = 65536 / kWgThreads / 8 * 8;
static_assert(kWgProducerThreads * kWgProducerRegisters +
                      32 * kWgConsumerWarps * kWgConsumerRegisters <=
                  kWgThreads * kWgLaunchRegisters,
              "setmaxnreg must stay within the launch's registers");
static_assert(kWgBlockM == kWgBlockN, "the producer walks x and weight tiles with the same rows");
static_assert(kWgBlockK * 4 == 128, "one 128-byte swizzle row per tile row");
static_assert(kWgWeightTileBytes % kWgSwizzleAlign == 0, "swizzled tiles stay 1024-byte aligned");
static_assert(kWgLookahead >= 1 && kWgLookahead <= kWgStages - 1, "producer look-ahead");

#if FPG_WGMMA_DEVICE_CODE

// Byte offset of 16-byte chunk `chunk` of row `row` in a 128-byte-swizzled tile.
__device__ __forceinline__ uint32_t swizzle128(int row, int chunk) {
  return static_cast<uint32_t>(row * 128 + ((chunk ^ (row & 7)) << 4));
}

// Shared-memory matrix descriptor (PTX ISA "Matrix Descriptor Format"): start address >> 4 in bits
// 0-13, leading byte offset >> 4 in bits 16-29 (unused by swizzled K-major layouts: 1), stride
// byte offset >> 4 in bits 32-45 (1024: the next group of 8 rows), swizzle mode in bits 62-63
// (1: 128 B).
// For any K-major tile of 128-byte rows in the 128-byte swizzle: the weight tiles, and pass 1's x
// tiles.
__device__ __forceinline__ uint64_t swizzled_tile_descriptor(uint32_t address) {
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
// Named barrier 1 over the two consumer warpgroups (barrier 0 is __syncthreads').
__device__ __forceinline__ void consumer_barrier() {
  asm volatile("bar.sync 1, %0;" ::"n"(32 * kWgConsumerWarps) : "memory");
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

// TMA (PTX ISA: cp.async.bulk.tensor, mbarrier expect_tx).
// Barrier inits visible to the async proxy (the TMA unit) before it completes on them.
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t barrier, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(barrier),
               "r"(bytes)
               : "memory");
}
// Box (coordinates: K, row) of a 2-D tensor map into shared memory, completing on `barrier` (this
// CTA's shared memory is its own rank's part of the cluster window).
__device__ __forceinline__ void tma_load(uint32_t destination, const CUtensorMap* map, int32_t k,
                                         int32_t row, uint32_t barrier) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(destination),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(k), "r"(row), "r"(barrier)
      : "memory");
}
// tma_load with an L2 eviction priority (a createpolicy value, l2_evict_last_policy).
__device__ __forceinline__ void tma_load(uint32_t destination, const CUtensorMap* map, int32_t k,
                                         int32_t row, uint32_t barrier, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(destination),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(k), "r"(row), "r"(barrier), "l"(policy)
      : "memory");
}
// An L2 policy that evicts the lines it loads after the others (createpolicy).
__device__ __forceinline__ uint64_t l2_evict_last_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
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

// Stores one consumer warp's share of an m64nN wgmma accumulator as split `split`'s partial sums:
// value 4 j + e of this thread is row g (+8 for e >= 2) of the warp's 16 rows starting at `row0`,
// column n0 + 8 j + 2 t (+1 for odd e), g = lane / 4, t = lane % 4; rows and columns past the
// launch's clipped.
template <int kAccum>
__device__ __forceinline__ void store_partial(const GemmParams& p, const float (&acc)[kAccum],
                                              int split, int64_t row0, int64_t n0, int lane) {
  const int g = lane >> 2;
  const int t = lane & 3;
  float* out = p.partial + split * p.split_stride;
  const bool even_n = (p.n % 2) == 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t m = row0 + g + 8 * h;
    if (m >= p.rows) continue;
    float* out_row = out + m * p.n;
#pragma unroll
    for (int j = 0; j < kAccum / 4; ++j) {
      store_partial_pair(out_row, n0 + 8 * j + 2 * t, p.n, even_n, acc[4 * j + 2 * h],
                         acc[4 * j + 2 * h + 1]);
    }
  }
}

#endif  // FPG_WGMMA_DEVICE_CODE

}  // namespace forward_gemm
}  // namespace cuda
}  // namespace fused_pool_gelu
