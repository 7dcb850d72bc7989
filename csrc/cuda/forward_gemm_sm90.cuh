// The Hopper (sm_90a) split-K GEMM of the forward: the same job, tiles and output as
// forward_gemm.cuh's tf32x3_splitk_kernel (partial[s, b, n] = the split-s part of x[b] . weight[n],
// 3xTF32 accuracy), on warpgroup MMA (wgmma) instead of mma.sync. On an H200 mma.sync TF32 tops
// out near 190 TFLOP/s, about half of what wgmma reaches, and 3xTF32 needs three MMAs per product.
//
// Only sm_90a has wgmma: the kernel body is compiled for that target alone (elsewhere it traps),
// and the host (forward.cu) launches it only on compute capability 9.0 devices of a build whose
// arch list holds 9.0a (FPG_WITH_SM90A, set by setup.py).
//
// CTA tile 128 (x rows) x 128 (weight rows) x 32 (K), 256 threads = 2 warpgroups, warpgroup g
// owning x rows [64 g, 64 g + 64) and all 128 weight rows: one m64n128k8 wgmma per K step of 8.
//   x (A operand, registers): staged in shared memory like the mma.sync kernel (rows padded to 36
//     floats: conflict-free ldmatrix), then each warp loads its 16 x 8 fragments with ldmatrix and
//     splits them into TF32 big + small halves in registers. The wgmma register layout of A for
//     32-bit types is exactly the mma.m16n8k8 A fragment of forward_gemm.cuh, warp w of the
//     warpgroup holding rows [16 w, 16 w + 16) (CUTLASS cute::GMMA::ALayout_64x8).
//   weight (B operand, shared memory): wgmma reads B only through a shared-memory descriptor, so the
//     split happens in shared memory: after a stage lands, every thread rewrites its part of the
//     tile as the big half in place and writes the small half into a second buffer of the same
//     layout. Both use the 128-byte swizzle wgmma expects for K-major operands: row r (128 bytes =
//     32 floats, one K tile) at r * 128, its 16-byte chunk c at chunk position c ^ (r % 8); 8-row
//     groups 1024 bytes apart (the descriptor's stride byte offset); tiles 1024-byte aligned. The
//     K step kk of 8 floats starts 32 kk bytes into each row: the descriptor start address moves by
//     that much and the hardware applies the swizzle to the full address.
//   accumulator: per thread 64 floats, value 4 j + e at row g (+8 for e >= 2) and column
//     8 j + 2 t + (e % 2) of its warp's 16 rows (g = lane / 4, t = lane % 4), as mma.m16n8k8's C.
//
// Per K tile the 12 wgmmas (4 K steps x {small x big, big x small, big x big}, small terms first)
// write a fresh accumulator, which is then added into `total` with plain fp32 adds: tensor cores
// accumulate with truncation, and flushing every 32 K keeps that bias at the level of fp32 (see
// tf32x3_splitk_kernel). Pipeline per K tile kt: issue tile kt's wgmmas; meanwhile issue the
// cp.async loads of tile kt + kStages - 1 and split the weight tile kt + 1; wait for the wgmmas,
// flush, barrier, load tile kt + 1's x fragments.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

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
constexpr int kWgWarpgroups = 2;
constexpr int kWgThreads = 128 * kWgWarpgroups;
// 4 stages of {x 18 KB, weight 16 KB} + 2 small-half weight buffers = 168 KB (+1 KB to align).
constexpr int kWgStages = 4;
constexpr int kWgMmaK = 8;
constexpr int kWgAccum = kWgBlockN / 2;  // 64 m64n128 accumulator floats per thread

constexpr int kWgWeightTileBytes = kWgBlockN * kWgBlockK * 4;          // 16 KB, swizzled
constexpr int kWgXLd = kWgBlockK + 4;                                  // padded x row, floats
constexpr int kWgXTileBytes = kWgBlockM * kWgXLd * 4;                  // 18 KB
constexpr int kWgWeightOffset = 0;                                     // kWgStages weight tiles
constexpr int kWgSmallOffset = kWgStages * kWgWeightTileBytes;         // 2 small-half tiles
constexpr int kWgXOffset = kWgSmallOffset + 2 * kWgWeightTileBytes;    // kWgStages x tiles
constexpr int kWgSwizzleAlign = 1024;
constexpr int kWgSmemBytes = kWgXOffset + kWgStages * kWgXTileBytes + kWgSwizzleAlign;

constexpr int kWgChunksPerRow = kWgBlockK / 4;                    // 16-byte chunks per tile row
constexpr int kWgLoadRowsPerPass = kWgThreads / kWgChunksPerRow;  // 32
constexpr int kWgLoadPasses = kWgBlockM / kWgLoadRowsPerPass;     // 4 (x and weight alike)

static_assert(kWgBlockM == 64 * kWgWarpgroups, "one m64 wgmma row block per warpgroup");
static_assert(kWgBlockM == kWgBlockN, "the loader walks x and weight tiles with the same passes");
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
// Generic-proxy writes to shared memory (st.shared, cp.async) become visible to the async proxy
// that wgmma reads through only after this fence (and a barrier with the reading threads).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
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

__global__ void __launch_bounds__(kWgThreads, 1) tf32x3_wgmma_splitk_kernel(const TcParams p) {
#if FPG_WGMMA_DEVICE_CODE
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t smem_base =
      (shared_address(smem_raw) + (kWgSwizzleAlign - 1)) & ~uint32_t{kWgSwizzleAlign - 1};
  unsigned char* const smem = smem_raw + (smem_base - shared_address(smem_raw));

  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int warpgroup = warp / 4;
  const int warp_in_group = warp % 4;

  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kWgBlockN;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kWgBlockM;
  const int64_t split = blockIdx.z;
  const int64_t k_begin = split * p.k_per_split;
  const int64_t k_end = min(k_begin + p.k_per_split, p.k);
  const int num_k_tiles = static_cast<int>(ceil_div(k_end - k_begin, int64_t{kWgBlockK}));

  // Loader: thread -> tile rows load_row + 32 pass, chunk load_chunk (floats 4 load_chunk ...).
  const int load_row = tid / kWgChunksPerRow;
  const int load_chunk = tid % kWgChunksPerRow;
  const float* x_src[kWgLoadPasses];
  bool x_ok[kWgLoadPasses];
  const float* w_src[kWgLoadPasses];
  bool w_ok[kWgLoadPasses];
#pragma unroll
  for (int pass = 0; pass < kWgLoadPasses; ++pass) {
    const int row = load_row + pass * kWgLoadRowsPerPass;
    x_ok[pass] = m0 + row < p.m;
    x_src[pass] = p.x + (x_ok[pass] ? m0 + row : 0) * p.ldx + k_begin + 4 * load_chunk;
    w_ok[pass] = n0 + row < p.n;
    w_src[pass] = p.w + (w_ok[pass] ? n0 + row : 0) * p.ldw + k_begin + 4 * load_chunk;
  }

  auto load_tile = [&](int k_tile) {
    const int stage = k_tile % kWgStages;
    const int64_t k_off = static_cast<int64_t>(k_tile) * kWgBlockK;
    // The chunk holds floats [k, k + 4) with k and k_end multiples of 4: all in or all out.
    const bool k_ok = k_begin + k_off + 4 * load_chunk < k_end;
    const uint32_t x_tile = smem_base + kWgXOffset + stage * kWgXTileBytes;
    const uint32_t w_tile = smem_base + kWgWeightOffset + stage * kWgWeightTileBytes;
#pragma unroll
    for (int pass = 0; pass < kWgLoadPasses; ++pass) {
      const int row = load_row + pass * kWgLoadRowsPerPass;
      const bool xo = x_ok[pass] && k_ok;
      cp_async_16(x_tile + (row * kWgXLd + 4 * load_chunk) * 4, xo ? x_src[pass] + k_off : p.x,
                  xo ? 16 : 0);
      const bool wo = w_ok[pass] && k_ok;
      cp_async_16(w_tile + swizzle128(row, load_chunk), wo ? w_src[pass] + k_off : p.w,
                  wo ? 16 : 0);
    }
  };

  // Weight tile k_tile (landed) -> big half in place, small half into small buffer k_tile % 2.
  // Elementwise, so the swizzle does not matter: this thread takes the chunks it loaded.
  auto split_weight_tile = [&](int k_tile) {
    unsigned char* w_tile = smem + kWgWeightOffset + (k_tile % kWgStages) * kWgWeightTileBytes;
    unsigned char* small = smem + kWgSmallOffset + (k_tile % 2) * kWgWeightTileBytes;
#pragma unroll
    for (int pass = 0; pass < kWgLoadPasses; ++pass) {
      const uint32_t off = swizzle128(load_row + pass * kWgLoadRowsPerPass, load_chunk);
      uint4 v = *reinterpret_cast<const uint4*>(w_tile + off);
      uint4 s;
      split_tf32(v.x, v.x, s.x);
      split_tf32(v.y, v.y, s.y);
      split_tf32(v.z, v.z, s.z);
      split_tf32(v.w, v.w, s.w);
      *reinterpret_cast<uint4*>(w_tile + off) = v;
      *reinterpret_cast<uint4*>(small + off) = s;
    }
    fence_proxy_async_shared();
  };

  // This warp's A fragments (16 rows x 8 K per step) of x tile k_tile, split into big and small.
  // ldmatrix.x4 lane l points at row (l & 7) + 8 ((l >> 3) & 1), column 4 (l >> 4) of the 16 x 8
  // block: matrices = a0..a3 (see the mma.sync kernel's header comment).
  const uint32_t a_frag_off =
      ((warpgroup * 64 + warp_in_group * 16 + (lane & 7) + 8 * ((lane >> 3) & 1)) * kWgXLd +
       4 * (lane >> 4)) * 4;
  uint32_t a_big[kWgBlockK / kWgMmaK][4];
  uint32_t a_small[kWgBlockK / kWgMmaK][4];
  auto load_x_fragments = [&](int k_tile) {
    const uint32_t x_tile = smem_base + kWgXOffset + (k_tile % kWgStages) * kWgXTileBytes;
#pragma unroll
    for (int kk = 0; kk < kWgBlockK / kWgMmaK; ++kk) {
      uint32_t r[4];
      ldmatrix_x4(r, x_tile + a_frag_off + kk * kWgMmaK * 4);
#pragma unroll
      for (int e = 0; e < 4; ++e) split_tf32(r[e], a_big[kk][e], a_small[kk][e]);
    }
  };

  float acc[kWgAccum];
  float total[kWgAccum];
#pragma unroll
  for (int i = 0; i < kWgAccum; ++i) {
    acc[i] = 0.f;  // overwritten by the first wgmma of each K tile; zeroed so no read is undefined
    total[i] = 0.f;
  }

  // Prologue: tiles 0 .. kWgStages - 2, one commit per tile slot even when empty, so that the
  // group count stays "tile index + 1" and the waits below are exact.
#pragma unroll
  for (int s = 0; s < kWgStages - 1; ++s) {
    if (s < num_k_tiles) load_tile(s);
    cp_async_commit();
  }
  if (num_k_tiles > 0) {
    cp_async_wait<kWgStages - 2>();
    __syncthreads();  // tile 0 landed for every thread
    split_weight_tile(0);
    __syncthreads();  // tile 0's halves written and fenced by every thread
    load_x_fragments(0);
  }

  for (int kt = 0; kt < num_k_tiles; ++kt) {
    const uint32_t w_big = smem_base + kWgWeightOffset + (kt % kWgStages) * kWgWeightTileBytes;
    const uint32_t w_small = smem_base + kWgSmallOffset + (kt % 2) * kWgWeightTileBytes;
    wgmma_fence();  // acc and the A registers were last written by ordinary instructions
#pragma unroll
    for (int kk = 0; kk < kWgBlockK / kWgMmaK; ++kk) {
      wgmma_m64n128k8_tf32(acc, a_small[kk], weight_descriptor(w_big + 32 * kk), kk > 0);
      wgmma_m64n128k8_tf32(acc, a_big[kk], weight_descriptor(w_small + 32 * kk), true);
    }
#pragma unroll
    for (int kk = 0; kk < kWgBlockK / kWgMmaK; ++kk) {
      wgmma_m64n128k8_tf32(acc, a_big[kk], weight_descriptor(w_big + 32 * kk), true);
    }
    wgmma_commit();

    // While the tensor cores work: refill the stage of tile kt - 1 (its wgmmas finished before the
    // barrier that ended the last iteration) and split the weight tile kt + 1 into the small
    // buffer tile kt - 1 used.
    if (kt + kWgStages - 1 < num_k_tiles) load_tile(kt + kWgStages - 1);
    cp_async_commit();
    if (kt + 1 < num_k_tiles) {
      // Groups committed: kWgStages + kt; at most kWgStages - 2 pending => tile kt + 1 landed.
      cp_async_wait<kWgStages - 2>();
      __syncthreads();
      split_weight_tile(kt + 1);
    }

    wgmma_wait_all();
#pragma unroll
    for (int i = 0; i < kWgAccum; ++i) total[i] += acc[i];
    // Every warpgroup is done with tile kt (its stage may be refilled next iteration) and every
    // thread's half of weight tile kt + 1 is written and fenced.
    __syncthreads();
    if (kt + 1 < num_k_tiles) load_x_fragments(kt + 1);
  }
  cp_async_wait<0>();  // only empty groups can remain

  // Store: value 4 j + e of this thread is row g (+8 for e >= 2), column 8 j + 2 t (+1 for odd e).
  const int g = lane >> 2;
  const int t = lane & 3;
  float* out = p.partial + split * p.split_stride;
  const bool vec2 = (p.n % 2) == 0;  // then col even and col < N => col + 1 < N
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t m = m0 + warpgroup * 64 + warp_in_group * 16 + g + 8 * h;
    if (m >= p.m) continue;
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
#else
  __trap();  // launched only where the sm_90a code exists (see the host check in forward.cu)
#endif  // FPG_WGMMA_DEVICE_CODE
}

#undef FPG_WGMMA_DEVICE_CODE

}  // namespace forward_gemm
}  // namespace cuda
}  // namespace fused_pool_gelu
