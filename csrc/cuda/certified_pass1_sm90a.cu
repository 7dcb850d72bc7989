// ------------------------------------------------------------------------------------------------
// The certified first pass: rounded_partial[s, b, n] = the tensor core's sum of h_x[b, i] h_w[n, i]
// over split s, times 2^-(e_x[s, b] + e_w[n]), rounded to bfloat16 (store_certified_partial): h_w
// the weight's fp16 copy scaled by 2^e_w per row, h_x x's fp16 copy made here, in registers, scaled
// by 2^e_x per row and split (certified.cuh says why fp16, and how the scales are chosen).
// The pass is bound by its L2 reads: with the weight in fp16 it reads 32 KB per 1 M multiply-adds
// (TF32: 48), at twice TF32's rate. x is converted here, not by a kernel before, whose DRAM read of
// x would overlap nothing (research/README.md, "The certified path: pass 1").
//
// CTA tile kBlockM (x rows: 128 or 64) x kBlockN (weight rows: 256 or 128) x 64 (K) (Pass1Tile),
// 384 threads:
//   warp 0, lane 0: the TMA producer (two float32 x boxes of 16 or 8 KB and one fp16 weight box
//     of 32 or 16 KB per stage, all 128-byte swizzled, completing on the stage's full barrier);
//     warps 1-3 idle;
//   warpgroups 1 and 2: the consumers; at 128 x rows, x rows [64 c, 64 c + 64) x all kBlockN weight
//     rows, at 64 all x rows x weight rows [c kBlockN / 2, (c + 1) kBlockN / 2). Per K step of 16
//     each thread loads its A fragment (rows g and g + 8 of its warp's 16, K positions 2 t,
//     2 t + 1, 2 t + 8, 2 t + 9: the m16n8k16 layout; the columns at those positions are the weight
//     copy's, prepared_copy_group) from the float32 stage, converts it to fp16 (4 registers), and
//     issues one m64n{kWgColumns}k16 wgmma with A from registers and the weight from shared memory
//     (K-major: a 128-byte row is 64 halves, K step kk starts 32 kk bytes into it). The consumers
//     whose rows' norms this CTA owes also sum the squares of the scaled x values and of their fp16
//     residuals.
// The tensor core accumulates the whole split (no float32 flush: up to 128 accumulator floats per
// thread leave no room for a second set); the bound models that chain (certified_bound).
// ------------------------------------------------------------------------------------------------
// Compiled for sm_90a alone (setup.py).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/certified.cuh"
#include "cuda/common.cuh"
#include "cuda/forward_launch.h"
#include "cuda/wgmma.cuh"

namespace fused_pool_gelu {
namespace cuda {
namespace forward_gemm {

#if FPG_WGMMA_DEVICE_CODE

// The certified pass's store (same accumulator layout as store_partial's): each value times its
// row's and its column's inverse scales (powers of two whose product is a normal float: exact
// unless the result is subnormal; column n0 + c's at column_inverse_scale[c], in shared memory),
// rounded to nearest bfloat16 (certified.cuh's step 6 bounds that rounding), into
// p.rounded_partial: half the bytes of float32 partials, whose store is bound by its bytes. A
// thread's bfloat16 pair of one 8-column group is 4 bytes, which stored alone would leave each
// quad writing half 32-byte sectors; so the lanes of each pair (t, t ^ 1) trade one word per two
// groups 2J, 2J + 1: the even lane keeps its group-2J word and takes its neighbour's (columns
// 16 J + 2 t .. + 3), the odd lane keeps its group-(2J + 1) word and takes its neighbour's
// (columns 16 J + 8 + 2 (t - 1) .. + 3), and the quad's four 8-byte stores cover the 16 columns'
// 32 bytes. Where N is not a multiple of 4 (rows not 8-byte aligned) each value is stored alone.
template <int kAccum>
__device__ __forceinline__ void store_certified_partial(const GemmParams& p,
                                                        const float (&acc)[kAccum], int split,
                                                        int64_t row0, int64_t n0, int lane,
                                                        const float (&row_inverse_scale)[2],
                                                        const float* column_inverse_scale) {
  static_assert(kAccum % 8 == 0, "8-column groups in pairs");
  const int g = lane >> 2;
  const int t = lane & 3;
  const bool odd = (t & 1) != 0;
  __nv_bfloat16* out = p.rounded_partial + split * p.split_stride;
  const bool packed = (p.n % 4) == 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t m = row0 + g + 8 * h;
    const bool row_inside = m < p.rows;
#pragma unroll
    for (int pair = 0; pair < kAccum / 8; ++pair) {
      uint32_t word[2];
      __nv_bfloat162 values[2];
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int j = 2 * pair + q;
        const float2 column_scale =
            *reinterpret_cast<const float2*>(column_inverse_scale + 8 * j + 2 * t);
        const float v0 = acc[4 * j + 2 * h] * (row_inverse_scale[h] * column_scale.x);
        const float v1 = acc[4 * j + 2 * h + 1] * (row_inverse_scale[h] * column_scale.y);
        values[q] = __floats2bfloat162_rn(v0, v1);
        word[q] = *reinterpret_cast<const uint32_t*>(&values[q]);
      }
      if (packed) {
        // Warp-uniform branch: every lane takes part in the shuffle, rows past the end included.
        const uint32_t received = __shfl_xor_sync(0xffffffffu, odd ? word[0] : word[1], 1);
        const int64_t col = n0 + 16 * pair + 2 * t + (odd ? 6 : 0);
        if (row_inside && col < p.n) {
          *reinterpret_cast<uint2*>(out + m * p.n + col) =
              odd ? make_uint2(received, word[1]) : make_uint2(word[0], received);
        }
      } else if (row_inside) {
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const int64_t col = n0 + 8 * (2 * pair + q) + 2 * t;
          if (col < p.n) out[m * p.n + col] = values[q].x;
          if (col + 1 < p.n) out[m * p.n + col + 1] = values[q].y;
        }
      }
    }
  }
}

#endif  // FPG_WGMMA_DEVICE_CODE

static_assert(kPass1BlockK == 64, "fp16 weight row: 128 bytes, one swizzle row");
constexpr int kPass1XBoxK = 32;   // float32 x row: 128 bytes, one swizzle row
constexpr int kPass1MmaK = 16;
// x's scale per row and split: the first tile's largest |x| goes to [2^10, 2^11), leaving a factor
// 32 below fp16's largest finite value (65504) for the split's later tiles; a larger value
// overflows to infinity and the row is rescored whole (certified.cuh).
constexpr int kPass1XScaleTarget = 10;
// 128 x 56 + 256 x 224 = 64512 <= 384 x 168 (see kWgProducerRegisters): the consumers hold up to
// 128 accumulator floats and 16 A registers.
constexpr int kPass1ProducerRegisters = 56;
constexpr int kPass1ConsumerRegisters = 224;
static_assert(kPass1BlockK * 2 == 128 && kPass1XBoxK * 4 == 128,
              "one 128-byte swizzle row per tile row");
static_assert(kWgProducerThreads * kPass1ProducerRegisters +
                      32 * kWgConsumerWarps * kPass1ConsumerRegisters <=
                  kWgThreads * kWgLaunchRegisters,
              "setmaxnreg within the launch's registers");

// Pass 1's shared memory for a tile of kBlockN weight rows. 256 where the batch fills the GPU with
// whole-K or long splits (the tensor core's work per byte of x read is twice 128's). 128 where the
// splits are many (the fused rows, certified.cu's select_rescore_kernel): to fill the SMs
// each CTA takes a split of its own and stores its 128 x kBlockN partials, so the partials weigh
// SMs x 128 x kBlockN bfloat16 whatever the split count, and every line of them first evicts one
// of the benchmarks' flushed dirty lines (~0.6 us per MB on the H200; research/README.md, "The
// certified path: pass 1").
// kBlockM: x rows per tile, 128, or 64 for the fused rows of at most 64 rows (forward_plan.h's
// kPass1SmallTileMaxBatch): one 64-row tile instead of a half-empty 128-row one, both consumer
// warpgroups on the same rows, each on half of the 128 weight rows (m64n64k16). At B = 128 two
// such tiles per column tile read a third more from L2 per CTA than one of 128 (x's tile for half
// the columns): slower there, for half the partials.
template <int kBlockM, int kBlockN>
struct Pass1Tile {
  static constexpr int kM = kBlockM;
  static constexpr int kN = kBlockN;
  static_assert(kBlockN == 128 || kBlockN == 256, "one m64n128k16 or m64n256k16 wgmma per K step");
  static_assert(kBlockM == 128 || (kBlockM == 64 && kBlockN == 128), "64 x 128 or 128-row tiles");
  static constexpr int kXBoxBytes = kBlockM * kPass1XBoxK * 4;
  static constexpr int kXTileBytes = 2 * kXBoxBytes;
  // Weight rows per consumer warpgroup: all of them at 128 x rows (each its 64 x rows), half at 64.
  static constexpr int kWgColumns = kBlockM == 128 ? kBlockN : kBlockN / 2;
  static constexpr int kAccum = kWgColumns / 2;  // floats per consumer thread
  static constexpr int kStageBytes = kXTileBytes + kBlockN * kPass1BlockK * 2;
  // A 192 KB ring whatever the tile: 3 x 64 KB at 128 x 256, 4 x 48 KB at 128 x 128, 6 x 32 KB at
  // 64 x 128.
  static constexpr int kRingBytes = 192 * 1024;
  static_assert(kRingBytes % kStageBytes == 0, "whole stages in the ring");
  static constexpr int kStages = kRingBytes / kStageBytes;
  static constexpr int kBarrierOffset = kStages * kStageBytes;
  // The tile's column inverse scales, copied from the prepared weight's trailers at the start:
  // read from global memory in the store, each would be a round trip between two stores that
  // ptxas cannot reorder (the stores may alias them), 64 in a chain per thread.
  static constexpr int kColumnScaleOffset = kBarrierOffset + 2 * kStages * 8;
  static constexpr int kSmemBytes = kColumnScaleOffset + kBlockN * 4 + kWgSwizzleAlign;
  static_assert(kSmemBytes <= 227 * 1024, "within an sm_90 CTA's shared memory");
  static_assert(kStageBytes % kWgSwizzleAlign == 0 && kXBoxBytes % kWgSwizzleAlign == 0,
                "swizzled tiles stay 1024-byte aligned");
  static_assert(kBlockN <= 32 * kWgConsumerWarps, "one column scale per consumer thread at most");
};
// The tiles pass 1 is compiled for (forward_plan.h's plan_certified picks one per call).
template <typename... Tiles>
struct Pass1TileList {
  static constexpr int kMaxSmemBytes = std::max({Tiles::kSmemBytes...});
  // Calls f(Tile{}) for each tile (below: each instance's shared memory, the launch).
  template <typename F>
  static void for_each(F&& f) {
    (f(Tiles{}), ...);
  }
};
using Pass1Tiles = Pass1TileList<Pass1Tile<64, 128>, Pass1Tile<128, 128>, Pass1Tile<128, 256>>;

#if FPG_WGMMA_DEVICE_CODE
// d += a * b on 64 x 256 x 16: a fp16 from registers (the m16n8k16 A fragment of each warp's 16
// rows), b fp16 through a shared-memory descriptor (K-major, 128-byte swizzle, no transpose): 128
// float32 accumulators per thread, value 4 j + e at row g (+8 for e >= 2) and column 8 j + 2 t +
// (e % 2) of the warp's 16 rows, as m64n128's.
#define FPG_ACC8(i)                                                                          \
  "+f"(d[(i)]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3]), "+f"(d[(i) + 4]),      \
      "+f"(d[(i) + 5]), "+f"(d[(i) + 6]), "+f"(d[(i) + 7])
#define FPG_ACC32(i) FPG_ACC8(i), FPG_ACC8((i) + 8), FPG_ACC8((i) + 16), FPG_ACC8((i) + 24)
__device__ __forceinline__ void wgmma_m64n256k16_f16_rs(float (&d)[128], const uint32_t* a,
                                                        uint64_t b_descriptor) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, "
      "%120, %121, %122, %123, %124, %125, %126, %127}, "
      "{%128, %129, %130, %131}, %132, p, 1, 1, 0;\n}\n"
      : FPG_ACC32(0), FPG_ACC32(32), FPG_ACC32(64), FPG_ACC32(96)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_descriptor), "r"(1));
}
// The same for 64 x 128 x 16: 64 accumulator floats per thread, value 4 j + e at row g (+8 for e
// >= 2) and column 8 j + 2 t + (e % 2).
__device__ __forceinline__ void wgmma_m64n128k16_f16_rs(float (&d)[64], const uint32_t* a,
                                                        uint64_t b_descriptor) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
      : FPG_ACC32(0), FPG_ACC32(32)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_descriptor), "r"(1));
}
// The same for 64 x 64 x 16: 32 accumulator floats per thread.
__device__ __forceinline__ void wgmma_m64n64k16_f16_rs(float (&d)[32], const uint32_t* a,
                                                       uint64_t b_descriptor) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : FPG_ACC32(0)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_descriptor), "r"(1));
}
#undef FPG_ACC32
#undef FPG_ACC8

#endif  // FPG_WGMMA_DEVICE_CODE

template <int kBlockM, int kBlockN>
__global__ void __launch_bounds__(kWgThreads, 1)
    certified_pass1_kernel(const GemmParams p, const __grid_constant__ TmaMaps maps) {
#if FPG_WGMMA_DEVICE_CODE
  using Tile = Pass1Tile<kBlockM, kBlockN>;
  allow_dependent_launch();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t smem_base =
      (shared_address(smem_raw) + (kWgSwizzleAlign - 1)) & ~uint32_t{kWgSwizzleAlign - 1};
  unsigned char* const smem = smem_raw + (smem_base - shared_address(smem_raw));
  const uint32_t full_barrier = smem_base + Tile::kBarrierOffset;
  const uint32_t empty_barrier = full_barrier + 8 * Tile::kStages;
  float* const column_inverse_scale = reinterpret_cast<float*>(smem + Tile::kColumnScaleOffset);

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kBlockN;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kBlockM;
  const int split = blockIdx.z;
  const int64_t k_begin = split * p.k_per_split;
  const int64_t k_end = k_begin + p.k_per_split < p.k ? k_begin + p.k_per_split : p.k;
  const int num_k_tiles =
      k_end > k_begin ? static_cast<int>((k_end - k_begin + kPass1BlockK - 1) / kPass1BlockK) : 0;

  // Full: the producer's expect_tx arrival plus the TMA bytes. Empty: one arrival per consumer
  // warp, after its wgmmas on the stage completed.
  if (tid == 0) {
    for (int s = 0; s < Tile::kStages; ++s) {
      mbarrier_init(full_barrier + 8 * s, 1);
      mbarrier_init(empty_barrier + 8 * s, kWgConsumerWarps);
    }
    fence_mbarrier_init();
  }
  __syncthreads();
  // The weight's fp16 copy may be the previous kernel's output (this one is its programmatic
  // dependent).
  wait_for_previous_grid();
  if (p.zeroed_counters != nullptr && tid < 2 && blockIdx.x == 0 && blockIdx.y == 0 &&
      blockIdx.z == 0) {
    p.zeroed_counters[tid] = 0;
  }

  if (warp < kWgProducerThreads / 32) {
    set_max_registers<false, kPass1ProducerRegisters>();
    if (warp == 0 && lane == 0) {
      // x's lines stay in L2 after the weight copy's and the partials': the rescoring reads x's
      // rows again.
      const uint64_t x_policy = l2_evict_last_policy();
      for (int kt = 0; kt < num_k_tiles; ++kt) {
        const int stage = kt % Tile::kStages;
        if (kt >= Tile::kStages) {
          mbarrier_wait(empty_barrier + 8 * stage, ((kt / Tile::kStages) - 1) & 1);
        }
        const uint32_t full = full_barrier + 8 * stage;
        const uint32_t x_tile = smem_base + stage * Tile::kStageBytes;
        mbarrier_arrive_expect_tx(full, Tile::kStageBytes);
        // Boxes past the tensor's rows or K are zero-filled and still count their full bytes.
        const int32_t k = static_cast<int32_t>(k_begin) + kt * kPass1BlockK;
        tma_load(x_tile, &maps.x, k, static_cast<int32_t>(m0), full, x_policy);
        tma_load(x_tile + Tile::kXBoxBytes, &maps.x, k + kPass1XBoxK, static_cast<int32_t>(m0),
                 full, x_policy);
        tma_load(x_tile + Tile::kXTileBytes, &maps.w, k, static_cast<int32_t>(n0), full);
      }
    }
    return;
  }

  // Consumers.
  set_max_registers<true, kPass1ConsumerRegisters>();
  if (tid - kWgProducerThreads < kBlockN) {
    const int64_t column = n0 + (tid - kWgProducerThreads);
    column_inverse_scale[tid - kWgProducerThreads] =
        column < p.n ? p.w_inverse_scale[column * p.w_inverse_scale_stride] : 0.f;
  }
  // 128 x rows: x rows [64 c, 64 c + 64), every weight row; 64: every x row, weight rows
  // [c kWgColumns, (c + 1) kWgColumns).
  const int consumer = warp / 4 - 1;
  const int column0 = kBlockM == 128 ? 0 : consumer * Tile::kWgColumns;
  const int warp_in_group = warp % 4;
  const int g = lane / 4;
  const int t = lane % 4;
  // This thread's two x rows within the tile; both are g mod 8, which the swizzle XORs in.
  const int tile_row = (kBlockM == 128 ? consumer * 64 : 0) + warp_in_group * 16 + g;
  // Each x row's norm sums belong to one CTA of its m tile: consumer c of n tile c mod n_tiles
  // (64 x rows: consumer 0 of n tile 0).
  const bool sums_rows =
      (kBlockM == 128 ? static_cast<int>(blockIdx.x) == consumer % static_cast<int>(gridDim.x)
                      : blockIdx.x == 0 && consumer == 0) &&
      p.x_sumsq != nullptr;

  // Byte offset, within a stage, of this thread's float2 for K positions 16 kk + 2 t + 8 q (+1) of
  // row tile_row + 8 h: the weight's copy holds those positions' columns in the order of
  // prepared_copy_group (prepared_weight.h), x box kk / 2, 16-byte chunk 2 (kk % 2) + q + 4 (t /
  // 2), swizzled by g: each half-warp's 8 chunks are distinct, no bank conflict.
  auto x_offset = [&](int kk, int h, int q) {
    const int chunk = 2 * (kk % 2) + q + 4 * (t / 2);
    return (kk / 2) * Tile::kXBoxBytes + (tile_row + 8 * h) * 128 + ((chunk ^ g) << 4) +
           8 * (t % 2);
  };
  auto load_fragment = [&](int stage, int kk, float2 (&v)[2][2]) {
    const unsigned char* stage_bytes = smem + stage * Tile::kStageBytes;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        v[h][q] = *reinterpret_cast<const float2*>(stage_bytes + x_offset(kk, h, q));
      }
    }
  };

  // x's scale for each of the two rows: 2^scale_exponent, from the split's first tile.
  float row_scale[2] = {1.f, 1.f};
  float row_inverse_scale[2] = {1.f, 1.f};
  int scale_exponent[2] = {0, 0};
  float squares[2] = {0.f, 0.f};
  float residual_squares[2] = {0.f, 0.f};

  // Converts tile kt's A fragments (4 K steps x 4 registers) and issues its wgmmas.
  float acc[Tile::kAccum];
#pragma unroll
  for (int i = 0; i < Tile::kAccum; ++i) acc[i] = 0.f;
  auto process_tile = [&](int kt, uint32_t (&a)[kPass1BlockK / kPass1MmaK][4]) {
    const int stage = kt % Tile::kStages;
    mbarrier_wait(full_barrier + 8 * stage, (kt / Tile::kStages) & 1);
    if (kt == 0) {
      float largest[2] = {0.f, 0.f};
#pragma unroll
      for (int kk = 0; kk < kPass1BlockK / kPass1MmaK; ++kk) {
        float2 v[2][2];
        load_fragment(stage, kk, v);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          largest[h] = fmaxf(largest[h], fmaxf(fmaxf(fabsf(v[h][0].x), fabsf(v[h][0].y)),
                                               fmaxf(fabsf(v[h][1].x), fabsf(v[h][1].y))));
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // The row's 64 values of the tile are spread over the 4 lanes of its quad.
        largest[h] = fmaxf(largest[h], __shfl_xor_sync(0xffffffffu, largest[h], 1));
        largest[h] = fmaxf(largest[h], __shfl_xor_sync(0xffffffffu, largest[h], 2));
        const int e = certified::scale_exponent(largest[h], kPass1XScaleTarget);
        scale_exponent[h] = e;
        row_scale[h] = ldexpf(1.f, e);
        row_inverse_scale[h] = ldexpf(1.f, -e);
      }
    }
#pragma unroll
    for (int kk = 0; kk < kPass1BlockK / kPass1MmaK; ++kk) {
      float2 v[2][2];
      load_fragment(stage, kk, v);
      // a[0]: row g, K positions 2t, 2t+1; a[1]: row g+8; a[2], a[3]: the same rows, positions
      // + 8.
#pragma unroll
      for (int q = 0; q < 2; ++q) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float s0 = v[h][q].x * row_scale[h];
          const float s1 = v[h][q].y * row_scale[h];
          const uint32_t pair = certified::fp16_pair(s0, s1);
          a[kk][2 * q + h] = pair;
          if (sums_rows) {
            const float2 back = __half22float2(*reinterpret_cast<const __half2*>(&pair));
            const float r0 = s0 - back.x;
            const float r1 = s1 - back.y;
            squares[h] = fmaf(s0, s0, fmaf(s1, s1, squares[h]));
            residual_squares[h] = fmaf(r0, r0, fmaf(r1, r1, residual_squares[h]));
          }
        }
      }
    }
    const uint32_t w_tile =
        smem_base + stage * Tile::kStageBytes + Tile::kXTileBytes + column0 * 128;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kPass1BlockK / kPass1MmaK; ++kk) {
      if constexpr (Tile::kWgColumns == 256) {
        wgmma_m64n256k16_f16_rs(acc, a[kk], swizzled_tile_descriptor(w_tile + 32 * kk));
      } else if constexpr (Tile::kWgColumns == 128) {
        wgmma_m64n128k16_f16_rs(acc, a[kk], swizzled_tile_descriptor(w_tile + 32 * kk));
      } else {
        wgmma_m64n64k16_f16_rs(acc, a[kk], swizzled_tile_descriptor(w_tile + 32 * kk));
      }
    }
    wgmma_commit();
    // All of the tile's wgmmas, before the next tile's conversion writes their A registers; the
    // other consumer warpgroup keeps the tensor core busy meanwhile. Two A register sets with one
    // group in flight measured the same: the pass is bound by x's L2 reads, not this wait.
    wgmma_wait_all();
    __syncwarp();
    if (lane == 0) mbarrier_arrive(empty_barrier + 8 * stage);
  };
  uint32_t a[kPass1BlockK / kPass1MmaK][4];
  for (int kt = 0; kt < num_k_tiles; ++kt) process_tile(kt, a);

  const int64_t row0 = m0 + tile_row;
  consumer_barrier();  // the column scales written
  store_certified_partial(p, acc, split, row0 - g, n0 + column0, lane, row_inverse_scale,
                          column_inverse_scale + column0);
  if (sums_rows) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // The quad's 4 lanes hold the row's columns: their sums in a fixed order.
      squares[h] += __shfl_xor_sync(0xffffffffu, squares[h], 1);
      squares[h] += __shfl_xor_sync(0xffffffffu, squares[h], 2);
      residual_squares[h] += __shfl_xor_sync(0xffffffffu, residual_squares[h], 1);
      residual_squares[h] += __shfl_xor_sync(0xffffffffu, residual_squares[h], 2);
      const int64_t m = row0 + 8 * h;
      if (t == 0 && m < p.rows) {
        const int64_t index = m * gridDim.z + split;
        p.x_sumsq[index] = squares[h];
        p.x_residual_sumsq[index] = residual_squares[h];
        p.x_scale_exponent[index] = scale_exponent[h];
      }
    }
  }
#else
  __trap();
#endif  // FPG_WGMMA_DEVICE_CODE
}

}  // namespace forward_gemm

int certified_pass1_max_smem_bytes() { return fg::Pass1Tiles::kMaxSmemBytes; }

void configure_certified_pass1_kernels() {
  fg::Pass1Tiles::for_each([](auto tile) {
    using Tile = decltype(tile);
    set_max_dynamic_smem(fg::certified_pass1_kernel<Tile::kM, Tile::kN>, Tile::kSmemBytes);
  });
}

void launch_certified_pass1(int64_t block_m, int64_t block_n, int64_t splits, bool dependent,
                            cudaStream_t stream, const fg::GemmParams& gemm,
                            const fg::TmaMaps& maps) {
  cudaLaunchAttribute attribute{};
  cudaLaunchConfig_t config =
      dependent_launch_config(1, fg::kWgThreads, stream, attribute, dependent);
  config.gridDim = dim3(static_cast<unsigned>(ceil_div(gemm.n, block_n)),
                        static_cast<unsigned>(ceil_div(gemm.rows, block_m)),
                        static_cast<unsigned>(splits));
  bool launched = false;
  fg::Pass1Tiles::for_each([&](auto tile) {
    using Tile = decltype(tile);
    if (block_m != Tile::kM || block_n != Tile::kN) return;
    config.dynamicSmemBytes = Tile::kSmemBytes;
    STD_CUDA_CHECK(
        cudaLaunchKernelEx(&config, fg::certified_pass1_kernel<Tile::kM, Tile::kN>, gemm, maps));
    launched = true;
  });
  FPG_CHECK(launched, "fused_pool_gelu.forward: internal error: no pass-1 kernel for ", block_m,
              " x ", block_n, " tiles");
}
}  // namespace cuda
}  // namespace fused_pool_gelu
