// Can a half-type GEMM of our own, with the GELU and each row's arg-max fused into its epilogue,
// beat cuBLAS's GEMM plus the package's epilogue (the half path) at B >= 2048, N = 512, K = 8192?
// Not part of the package; research/README.md has what it measured (correct in every row, but
// its tensor pipe busy 61% of the time against cuBLAS's kernel's 83%) and where to start if this is
// taken up again.
//
// A bfloat16 / float16 TMA + wgmma GEMM whose epilogue takes each row's arg-max of
// scale * gelu(z + bias) over its 128-column tile (argmax_band.h's band, torch.max's rule), then a
// kernel that combines the tiles. CTA tile 128 x rows x 128 weight rows, K tiles of 64 (one
// 128-byte swizzle row of a half type), 384 threads: one producer thread issuing TMA boxes into a
// ring of stages, two consumer warpgroups on 64 x rows each with m64n128k16 wgmmas reading both
// operands from shared memory, one wgmma group in flight. Variants (half_gemm_row_max's
// `variant`): 0: 6 stages of 32 KB; 1: K tiles of 128 (two boxes), 3 stages; 2: 4 stages; 3: K
// tiles of 128, 2 stages; 4: 7 stages; 5 / 6: 6 / 7 stages in clusters of two n tiles, each CTA
// loading half of the shared x tile into both (multicast) and releasing a stage in both.
//
// x [rows, K] and the weight [n, K] contiguous, K a multiple of 8 (TMA's 16-byte row stride).
// Built by research/half_gemm_row_max.py (nvcc, sm_90a, csrc/ on the include path for
// argmax_band.h, the one package header it uses: the rule under test), which times it against
// cuBLAS and the package and checks the arg-max of every row.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <type_traits>

#include "argmax_band.h"

namespace fused_half_gemm {

constexpr int kBlockM = 128;
constexpr int kBlockK = 64;  // 128 bytes of a half type: one swizzle row
// One producer warpgroup and two consumer warpgroups, as the package's wgmma GEMMs.
constexpr int kConsumerWarps = 8;
constexpr int kThreads = 128 + 32 * kConsumerWarps;
constexpr int kRingBytes = 192 * 1024;

// Copies of the package's device helpers (its GEMMs' and epilogue's), so that this file builds
// on its own whatever the package's sources become.

// Exact (erf) GELU, as torch computes it.
__device__ __forceinline__ float gelu(float z) {
  return 0.5f * z * (1.f + erff(z * 0.70710678118654752440f));
}

// Does candidate a beat candidate b under torch.max's rule? NaN beats every number; between two
// NaNs, or two equal numbers, the smaller index wins.
__device__ __forceinline__ bool beats(float va, int64_t ia, float vb, int64_t ib) {
  const bool a_nan = isnan(va);
  const bool b_nan = isnan(vb);
  if (a_nan || b_nan) return a_nan && (!b_nan || ia < ib);
  return va > vb || (va == vb && ia < ib);
}

struct Candidate {
  float value;
  int64_t index;  // the column; the sentinel n (loses to every real column) when empty
  float z;

  __device__ __forceinline__ void take_if_better(const Candidate& o) {
    if (beats(o.value, o.index, value, index)) *this = o;
  }
  __device__ __forceinline__ Candidate shfl_xor(int mask) const {
    return Candidate{__shfl_xor_sync(0xffffffffu, value, mask),
                     static_cast<int64_t>(__shfl_xor_sync(
                         0xffffffffu, static_cast<long long>(index), mask)),
                     __shfl_xor_sync(0xffffffffu, z, mask)};
  }
};

template <int kBlockN, int kBoxes = 1, int kRing = kRingBytes>
struct Tile {
  static constexpr int kXBoxBytes = kBlockM * kBlockK * 2;
  static constexpr int kWBoxBytes = kBlockN * kBlockK * 2;
  static constexpr int kXBytes = kBoxes * kXBoxBytes;
  static constexpr int kWBytes = kBoxes * kWBoxBytes;
  static constexpr int kStageBytes = kXBytes + kWBytes;
  static constexpr int kStages = kRing / kStageBytes;
  static constexpr int kBarrierOffset = kStages * kStageBytes;
  static constexpr int kBiasOffset = kBarrierOffset + 2 * kStages * 8;
  static constexpr int kSmemBytes = kBiasOffset + kBlockN * 4 + 1024;
  static constexpr int kAccum = kBlockN / 2;
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

__device__ __forceinline__ uint32_t shared_address(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// Shared-memory matrix descriptor (PTX ISA "Matrix Descriptor Format") of a K-major tile of
// 128-byte rows in the 128-byte swizzle: start address >> 4, leading byte offset 1 (unused),
// stride byte offset 1024 >> 4 (the next group of 8 rows), swizzle mode 1 (128 B).
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
// Named barrier 1 over the two consumer warpgroups (barrier 0 is __syncthreads').
__device__ __forceinline__ void consumer_barrier() {
  asm volatile("bar.sync 1, %0;" ::"n"(32 * kConsumerWarps) : "memory");
}
// mbarriers in shared memory: arrive releases and try_wait acquires at CTA scope.
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
// Barrier inits visible to the async proxy (the TMA unit) before it completes on them.
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t barrier, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(barrier),
               "r"(bytes)
               : "memory");
}
// Box (coordinates: K, row) of a 2-D tensor map into shared memory, completing on `barrier`.
__device__ __forceinline__ void tma_load(uint32_t destination, const CUtensorMap* map, int32_t k,
                                         int32_t row, uint32_t barrier) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(destination),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(k), "r"(row), "r"(barrier)
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

// The cluster pieces the package's kernels do not use.
__device__ __forceinline__ void tma_load_multicast(uint32_t dst, const CUtensorMap* map, int32_t k,
                                                   int32_t row, uint32_t bar, uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(k), "r"(row), "r"(bar), "h"(mask)
      : "memory");
}
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// Arrival on the barrier at the same offset in CTA `rank` of the cluster.
__device__ __forceinline__ void mbarrier_arrive_remote(uint32_t b, uint32_t rank) {
  asm volatile(
      "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(b), "r"(rank)
      : "memory");
}
// The pipeline keeps one wgmma group in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

#define ACC8(i)                                                                               \
  "+f"(d[(i)]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3]), "+f"(d[(i) + 4]),       \
      "+f"(d[(i) + 5]), "+f"(d[(i) + 6]), "+f"(d[(i) + 7])
#define ACC32(i) ACC8(i), ACC8((i) + 8), ACC8((i) + 16), ACC8((i) + 24)
#define REGS64                                                                              \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                  \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "         \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "         \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
// d += a * b, both from shared memory (K-major, 128-byte swizzle).
template <typename T>
__device__ __forceinline__ void wgmma_ss(float (&d)[64], uint64_t a, uint64_t b) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " REGS64
                 ", %64, %65, 1, 1, 1, 0, 0;\n"
                 : ACC32(0), ACC32(32)
                 : "l"(a), "l"(b));
  } else {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " REGS64
                 ", %64, %65, 1, 1, 1, 0, 0;\n"
                 : ACC32(0), ACC32(32)
                 : "l"(a), "l"(b));
  }
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

struct Params {
  const void* bias;
  float scale;
  int rows, n, n_tiles;
  float* part_value;
  int* part_index;
  float* part_z;
};

template <typename T, int kBlockN, int kBoxes, int kRing, bool kCluster>
__global__ void __launch_bounds__(kThreads, 1)
    gemm_row_max_kernel(const Params p, const __grid_constant__ CUtensorMap map_x,
                        const __grid_constant__ CUtensorMap map_w, int num_k_tiles) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using TileT = Tile<kBlockN, kBoxes, kRing>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t base = (shared_address(smem_raw) + 1023) & ~1023u;
  unsigned char* smem = smem_raw + (base - shared_address(smem_raw));
  const uint32_t full = base + TileT::kBarrierOffset;
  const uint32_t empty = full + 8 * TileT::kStages;
  float* bias_s = reinterpret_cast<float*>(smem + TileT::kBiasOffset);
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int n0 = blockIdx.x * kBlockN;
  const int m0 = blockIdx.y * kBlockM;
  if (tid == 0) {
    for (int s = 0; s < TileT::kStages; ++s) {
      mbarrier_init(full + 8 * s, 1);
      mbarrier_init(empty + 8 * s, (kCluster ? 2 : 1) * kConsumerWarps);
    }
    fence_mbarrier_init();
  }
  __syncthreads();
  const uint32_t rank = kCluster ? cluster_rank() : 0;
  if constexpr (kCluster) cluster_sync();  // the peer's barriers exist before any remote use
  if (warp < 4) {
    set_max_registers<false, 56>();
    if (warp == 0 && lane == 0) {
      for (int kt = 0; kt < num_k_tiles; ++kt) {
        const int stage = kt % TileT::kStages;
        if (kt >= TileT::kStages) mbarrier_wait(empty + 8 * stage, ((kt / TileT::kStages) - 1) & 1);
        const uint32_t f = full + 8 * stage;
        const uint32_t dst = base + stage * TileT::kStageBytes;
        mbarrier_arrive_expect_tx(f, TileT::kStageBytes);
        for (int box = 0; box < kBoxes; ++box) {
          const int k = (kt * kBoxes + box) * kBlockK;
          if constexpr (kCluster) {
            // Each CTA of the pair loads half of the shared x tile into both.
            tma_load_multicast(dst + box * TileT::kXBoxBytes + rank * (TileT::kXBoxBytes / 2),
                               &map_x, k, m0 + 64 * static_cast<int>(rank), f, 0x3);
          } else {
            tma_load(dst + box * TileT::kXBoxBytes, &map_x, k, m0, f);
          }
          tma_load(dst + TileT::kXBytes + box * TileT::kWBoxBytes, &map_w, k, n0, f);
        }
      }
    }
    if constexpr (kCluster) cluster_sync();
    return;
  }
  set_max_registers<true, 224>();
  const int ctid = tid - 128;
  if (ctid < kBlockN) {
    const int col = n0 + ctid;
    float b = 0.f;
    if (p.bias != nullptr && col < p.n) {
      b = static_cast<float>(static_cast<const T*>(p.bias)[col]);
    }
    bias_s[ctid] = b;
  }
  const int consumer = warp / 4 - 1;
  const int warp_in_group = warp % 4;
  float acc[TileT::kAccum];
#pragma unroll
  for (int i = 0; i < TileT::kAccum; ++i) acc[i] = 0.f;
  for (int kt = 0; kt < num_k_tiles; ++kt) {
    const int stage = kt % TileT::kStages;
    mbarrier_wait(full + 8 * stage, (kt / TileT::kStages) & 1);
    const uint32_t x_tile = base + stage * TileT::kStageBytes + consumer * 64 * 128;
    const uint32_t w_tile = base + stage * TileT::kStageBytes + TileT::kXBytes;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBoxes * kBlockK / 16; ++kk) {
      const int box = kk / (kBlockK / 16);
      const int step = kk % (kBlockK / 16);
      wgmma_ss<T>(acc, swizzled_tile_descriptor(x_tile + box * TileT::kXBoxBytes + 32 * step),
                  swizzled_tile_descriptor(w_tile + box * TileT::kWBoxBytes + 32 * step));
    }
    wgmma_commit();
    wgmma_wait<1>();
    if (kt > 0) {
      __syncwarp();
      if (lane == 0) {
        mbarrier_arrive(empty + 8 * ((kt - 1) % TileT::kStages));
        if constexpr (kCluster) mbarrier_arrive_remote(empty + 8 * ((kt - 1) % TileT::kStages), rank ^ 1);
      }
    }
  }
  wgmma_wait<0>();
  consumer_barrier();  // bias_s written

  const int g = lane / 4;
  const int t = lane % 4;
  const bool band_scale = p.scale > 0.f && p.scale <= 3.402823466e38f;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = m0 + consumer * 64 + warp_in_group * 16 + g + 8 * h;
    float z[TileT::kAccum / 2];
    float z_max = -INFINITY;
    bool finite = true;
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = 8 * j + 2 * t + e;
        const float v = acc[4 * j + 2 * h + e] + bias_s[c];
        z[2 * j + e] = v;
        if (n0 + c < p.n) {
          finite &= isfinite(v);
          z_max = v > z_max ? v : z_max;
        }
      }
    }
    z_max = fmaxf(z_max, __shfl_xor_sync(0xffffffffu, z_max, 1));
    z_max = fmaxf(z_max, __shfl_xor_sync(0xffffffffu, z_max, 2));
    finite = __shfl_xor_sync(0xffffffffu, static_cast<int>(finite), 1) && finite;
    finite = __shfl_xor_sync(0xffffffffu, static_cast<int>(finite), 2) && finite;
    Candidate best{-INFINITY, p.n, 0.f};
    auto consider = [&](int col, float zv) {
      const float v = isfinite(zv) ? gelu(zv) * p.scale : NAN;
      if (beats(v, col, best.value, best.index)) best = Candidate{v, col, zv};
    };
    const bool applies = band_scale && finite && z_max >= 0x1p-63f;
    if (applies) {
      const float threshold = fused_pool_gelu::argmax_band_threshold(z_max);
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = n0 + 8 * j + 2 * t + e;
          if (col < p.n && z[2 * j + e] >= threshold) consider(col, z[2 * j + e]);
        }
      }
    }
    best.take_if_better(best.shfl_xor(1));
    best.take_if_better(best.shfl_xor(2));
    const bool decided = applies && fused_pool_gelu::argmax_band_decided(best.value);
    if (!decided) {
      best = Candidate{-INFINITY, p.n, 0.f};
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = n0 + 8 * j + 2 * t + e;
          if (col < p.n) consider(col, z[2 * j + e]);
        }
      }
    }
    best.take_if_better(best.shfl_xor(1));
    best.take_if_better(best.shfl_xor(2));
    if (t == 0 && row < p.rows) {
      const int64_t i = static_cast<int64_t>(row) * p.n_tiles + blockIdx.x;
      p.part_value[i] = best.value;
      p.part_index[i] = static_cast<int>(best.index);
      p.part_z[i] = best.z;
    }
  }
  if constexpr (kCluster) cluster_sync();
#else
  __trap();  // sm_90a only
#endif
}

template <typename T>
__global__ void combine_kernel(const Params p, T* out, int64_t* argmax, T* preactivation) {
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= p.rows) return;
  Candidate best{-INFINITY, p.n, 0.f};
  for (int i = 0; i < p.n_tiles; ++i) {
    const int64_t j = static_cast<int64_t>(row) * p.n_tiles + i;
    best.take_if_better(Candidate{p.part_value[j], p.part_index[j], p.part_z[j]});
  }
  out[row] = static_cast<T>(best.value);
  argmax[row] = best.index;
  preactivation[row] = static_cast<T>(best.z);
}

CUtensorMap make_map(const void* data, int64_t ld, int64_t rows, int64_t cols, int box_rows,
                     bool bf16) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000,
                                                           cudaEnableDefault, &q);
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || f == nullptr) {
      std::fprintf(stderr, "half_gemm_row_max: no cuTensorMapEncodeTiled in the driver\n");
      std::abort();
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  CUtensorMap map{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld) * 2};
  const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t es[2] = {1, 1};
  CUresult r = encode(&map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                      2, const_cast<void*>(data), dims, strides, box, es,
                      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::fprintf(stderr, "half_gemm_row_max: cuTensorMapEncodeTiled failed (%d)\n",
                 static_cast<int>(r));
    std::abort();
  }
  return map;
}

template <typename T, int kBlockN, int kBoxes, int kRing, bool kCluster = false>
int run(const void* x, const void* w, const void* bias, float scale, int rows, int n, int k,
        float* part_value, int* part_index, float* part_z, void* out, int64_t* argmax,
        void* preactivation, cudaStream_t stream) {
  using TileT = Tile<kBlockN, kBoxes, kRing>;
  const bool bf16 = std::is_same_v<T, __nv_bfloat16>;
  const CUtensorMap mx = make_map(x, k, rows, k, kCluster ? kBlockM / 2 : kBlockM, bf16);
  const CUtensorMap mw = make_map(w, k, n, k, kBlockN, bf16);
  Params p{bias, scale, rows, n, (n + kBlockN - 1) / kBlockN, part_value, part_index, part_z};
  auto kernel = gemm_row_max_kernel<T, kBlockN, kBoxes, kRing, kCluster>;
  static const cudaError_t configured =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, TileT::kSmemBytes);
  if (configured != cudaSuccess) return static_cast<int>(configured);
  dim3 grid(p.n_tiles, (rows + kBlockM - 1) / kBlockM);
  const int k_tiles = (k + kBoxes * kBlockK - 1) / (kBoxes * kBlockK);
  if constexpr (kCluster) {
    cudaLaunchConfig_t config{};
    config.gridDim = grid;
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = TileT::kSmemBytes;
    config.stream = stream;
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeClusterDimension;
    attribute[0].val.clusterDim.x = 2;
    attribute[0].val.clusterDim.y = 1;
    attribute[0].val.clusterDim.z = 1;
    config.attrs = attribute;
    config.numAttrs = 1;
    cudaError_t e = cudaLaunchKernelEx(&config, kernel, p, mx, mw, k_tiles);
    if (e != cudaSuccess) return static_cast<int>(e);
  } else {
    kernel<<<grid, kThreads, TileT::kSmemBytes, stream>>>(p, mx, mw, k_tiles);
  }
  combine_kernel<T><<<(rows + 127) / 128, 128, 0, stream>>>(
      p, static_cast<T*>(out), argmax, static_cast<T*>(preactivation));
  return static_cast<int>(cudaGetLastError());
}

}  // namespace fused_half_gemm

// The variants of the header comment (template arguments: tile columns, 64-wide K boxes per stage,
// ring bytes, clusters of two).
template <typename T>
int dispatch(int variant, const void* x, const void* w, const void* bias, float scale, int rows,
             int n, int k, float* pv, int* pi, float* pz, void* out, int64_t* am, void* pre,
             cudaStream_t s) {
  using fused_half_gemm::run;
  switch (variant) {
    case 0: return run<T, 128, 1, 192 * 1024>(x, w, bias, scale, rows, n, k, pv, pi, pz, out, am, pre, s);
    case 1: return run<T, 128, 2, 192 * 1024>(x, w, bias, scale, rows, n, k, pv, pi, pz, out, am, pre, s);
    case 2: return run<T, 128, 1, 128 * 1024>(x, w, bias, scale, rows, n, k, pv, pi, pz, out, am, pre, s);
    case 3: return run<T, 128, 2, 128 * 1024>(x, w, bias, scale, rows, n, k, pv, pi, pz, out, am, pre, s);
    case 4: return run<T, 128, 1, 224 * 1024>(x, w, bias, scale, rows, n, k, pv, pi, pz, out, am, pre, s);
    case 5: return run<T, 128, 1, 192 * 1024, true>(x, w, bias, scale, rows, n, k, pv, pi, pz, out, am, pre, s);
    case 6: return run<T, 128, 1, 224 * 1024, true>(x, w, bias, scale, rows, n, k, pv, pi, pz, out, am, pre, s);
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}

// Returns a cudaError_t (0: launched). part_*: [rows, ceil(n / 128)] scratch for the tiles' winners.
extern "C" int half_gemm_row_max(const void* x, const void* w, const void* bias, float scale,
                                 int rows, int n, int k, float* part_value, int* part_index,
                                 float* part_z, void* out, int64_t* argmax, void* preactivation,
                                 int bf16, int variant, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  if (bf16) return dispatch<__nv_bfloat16>(variant, x, w, bias, scale, rows, n, k, part_value,
                                           part_index, part_z, out, argmax, preactivation, s);
  return dispatch<__half>(variant, x, w, bias, scale, rows, n, k, part_value, part_index, part_z,
                          out, argmax, preactivation, s);
}
