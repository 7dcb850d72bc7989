// How fast one SM reads 32 KB rows from L2 in the access patterns of the certified rescoring
// designs (benchmarks/NOTES.md, "l2_read_rate"). Standalone: no torch, no package build.
//
//   nvcc -O3 -arch=sm_90a -std=c++17 benchmarks/l2_read_rate.cu -o /tmp/l2_read_rate
//   /tmp/l2_read_rate
//
// Data: a weight of 512 rows and x of 4096 rows, K = 8192 floats (32 KB) each, zeros. Every
// pattern is timed twice: with its weight rows spread over the 512 (random), and "hot" (8 rows
// that every CTA reads, as when a few columns are most rows' candidates).
//   per_row_loads: the per-row rescoring's pattern: CTA b dots x row b with 4 weight rows,
//     256 threads, float4 loads into registers, unrolled 1/2/4, 1/2/4 CTAs per SM (set with
//     unused dynamic shared memory). Everything L2-resident (warm).
//   tile_stream: one CTA streams a tile's 8 x rows and 16 weight rows (24 rows) through a ring of
//     shared-memory stages of `kc` floats per row, filled by 16-byte cp.async from every thread
//     or by one 1-D bulk copy (cp.async.bulk) per row chunk; almost no compute. Warm.
//   tile_with_pairs: tile_stream with cp.async plus the tile kernels' work per chunk, one warp per
//     row dotting 1-9 (row, weight row) pairs from the stage, branch per pair; with and without
//     compute, warm and with x cold (L2 flushed, the weight re-read into L2, then one launch).
//   Last, per_row_loads at 1024 CTAs (B = 1024's grid), warm and cold x.
// Prints time per launch and GB/s per SM or per CTA.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(call)                                                                  \
  do {                                                                               \
    const cudaError_t status = (call);                                               \
    if (status != cudaSuccess) {                                                     \
      std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(status));     \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

constexpr int K = 8192;  // floats per row (32 KB)
constexpr int K4 = K / 4;
constexpr int kWeightRows = 512;
constexpr int kXRows = 4096;

template <int G, int UNROLL>
__global__ void __launch_bounds__(256)
    per_row_loads(const float* x, const float* w, const int* cols, float* out) {
  const float4* x_row = reinterpret_cast<const float4*>(x + (size_t)(blockIdx.x % kXRows) * K);
  const float4* w_rows[G];
  float acc[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    w_rows[g] = reinterpret_cast<const float4*>(w + (size_t)cols[blockIdx.x * G + g] * K);
    acc[g] = 0.f;
  }
#pragma unroll UNROLL
  for (int i = threadIdx.x; i < K4; i += 256) {
    const float4 a = __ldg(x_row + i);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float4 b = __ldg(w_rows[g] + i);
      acc[g] += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
    }
  }
  float sum = 0.f;
#pragma unroll
  for (int g = 0; g < G; ++g) sum += acc[g];
  if (sum == 12345.f) out[blockIdx.x] = sum;  // never true: keeps the loads
}

__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes,
                                          uint32_t barrier) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(dst),
      "l"(__cvta_generic_to_global(src)), "r"(bytes), "r"(barrier)
      : "memory");
}
__device__ __forceinline__ void barrier_init(uint32_t barrier, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(barrier), "r"(count) : "memory");
}
__device__ __forceinline__ void barrier_expect(uint32_t barrier, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(barrier),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void barrier_wait(uint32_t barrier, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(barrier),
      "r"(parity)
      : "memory");
}

// kBulk false: cp.async from all threads; true: one bulk copy per row chunk from warp 0.
template <int ROWS, int KC, int STAGES, bool kBulk>
__global__ void __launch_bounds__(256)
    tile_stream(const float* x, const float* w, const int* cols, float* out) {
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t barriers = base + STAGES * ROWS * KC * 4;
  __shared__ const float* sources[ROWS];
  if (threadIdx.x < ROWS) {
    sources[threadIdx.x] = threadIdx.x < 8
                               ? x + (size_t)(blockIdx.x * 8 + threadIdx.x) * K
                               : w + (size_t)cols[blockIdx.x * ROWS + threadIdx.x] * K;
  }
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) barrier_init(barriers + 8 * s, 1);
  }
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  __syncthreads();
  constexpr int kChunks = K / KC;
  constexpr int kPieces = KC / 4;
  auto issue = [&](int q) {
    if (q < kChunks) {
      const uint32_t stage = base + (q % STAGES) * ROWS * KC * 4;
      if (!kBulk) {
        for (int c = threadIdx.x; c < ROWS * kPieces; c += 256) {
          const int r = c / kPieces, piece = c % kPieces;
          cp_async_16(stage + (r * KC + piece * 4) * 4, sources[r] + q * KC + piece * 4);
        }
      } else if (threadIdx.x < 32) {
        if (threadIdx.x == 0) barrier_expect(barriers + 8 * (q % STAGES), ROWS * KC * 4);
        __syncwarp();
        for (int r = threadIdx.x; r < ROWS; r += 32) {
          bulk_load(stage + r * KC * 4, sources[r] + q * KC, KC * 4, barriers + 8 * (q % STAGES));
        }
      }
    }
    if (!kBulk) asm volatile("cp.async.commit_group;\n" ::: "memory");
  };
  for (int q = 0; q < STAGES - 1; ++q) issue(q);
  float sum = 0.f;
  for (int q = 0; q < kChunks; ++q) {
    if (!kBulk) {
      asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2) : "memory");
    } else {
      barrier_wait(barriers + 8 * (q % STAGES), (q / STAGES) & 1);
    }
    __syncthreads();
    issue(q + STAGES - 1);
    sum += reinterpret_cast<const float*>(smem + (q % STAGES) * ROWS * KC * 4)[threadIdx.x];
  }
  if (sum == 12345.f) out[blockIdx.x] = sum;
}

// tile_stream (cp.async, 24 rows, 1 KB chunks, 5 stages) with the per-chunk work of a tile
// kernel: warp r dots x row r with its 1-9 weight slots (a branch per pair), like the rescoring.
template <bool kCompute>
__global__ void __launch_bounds__(256, 1)
    tile_with_pairs(const float* x, const float* w, const int* cols, int64_t k4, float* out) {
  constexpr int ROWS = 24, KC = 256, STAGES = 5, kPieces = KC / 4;
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  __shared__ int s_weight_row[ROWS - 8];
  __shared__ int s_slot[8][16];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x < ROWS - 8) s_weight_row[threadIdx.x] = cols[blockIdx.x * ROWS + threadIdx.x];
  const int pairs = 1 + (warp * 5 + blockIdx.x) % 9;
  if (lane < pairs) s_slot[warp][lane] = (lane * 3 + warp) % (ROWS - 8);
  __syncthreads();
  const int64_t chunks = (k4 + kPieces - 1) / kPieces;
  const int copy_piece = threadIdx.x % kPieces, copy_row0 = threadIdx.x / kPieces;
  auto issue = [&](int64_t q) {
    if (q < chunks) {
      const int64_t piece = q % chunks * kPieces + copy_piece;
      if (piece < k4) {
        const uint32_t stage = base + (uint32_t)(q % STAGES) * ROWS * KC * 4 + copy_piece * 16;
        for (int r = copy_row0; r < ROWS; r += 4) {
          const float* source = r < 8 ? x + (int64_t)(blockIdx.x * 8 + r) * K
                                      : w + (int64_t)s_weight_row[r - 8] * K;
          cp_async_16(stage + r * KC * 4, source + 4 * piece);
        }
      }
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  };
  for (int q = 0; q < STAGES - 1; ++q) issue(q);
  float acc[16];
#pragma unroll
  for (int j = 0; j < 16; ++j) acc[j] = 0.f;
  for (int64_t q = 0; q < chunks; ++q) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2) : "memory");
    __syncthreads();
    issue(q + STAGES - 1);
    const float4* stage = reinterpret_cast<const float4*>(smem + (q % STAGES) * ROWS * KC * 4);
    if (kCompute) {
      const float4 x0 = stage[warp * kPieces + lane], x1 = stage[warp * kPieces + lane + 32];
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        if (j < pairs) {
          const float4* w_row = stage + (8 + s_slot[warp][j]) * kPieces;
          const float4 b0 = w_row[lane], b1 = w_row[lane + 32];
          acc[j] = fmaf(x0.x, b0.x, acc[j]);
          acc[j] = fmaf(x0.y, b0.y, acc[j]);
          acc[j] = fmaf(x0.z, b0.z, acc[j]);
          acc[j] = fmaf(x0.w, b0.w, acc[j]);
          acc[j] = fmaf(x1.x, b1.x, acc[j]);
          acc[j] = fmaf(x1.y, b1.y, acc[j]);
          acc[j] = fmaf(x1.z, b1.z, acc[j]);
          acc[j] = fmaf(x1.w, b1.w, acc[j]);
        }
      }
    } else {
      acc[0] += reinterpret_cast<const float*>(stage)[threadIdx.x];
    }
  }
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < 16; ++j) sum += acc[j];
  if (sum == 12345.f) out[blockIdx.x] = sum;
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  float *x = nullptr, *w = nullptr, *out = nullptr;
  int* cols = nullptr;
  char* flush = nullptr;
  CHECK(cudaMalloc(&x, (size_t)kXRows * K * 4));
  CHECK(cudaMalloc(&w, (size_t)kWeightRows * K * 4));
  CHECK(cudaMalloc(&out, 1 << 20));
  CHECK(cudaMalloc(&cols, 64 << 20));
  CHECK(cudaMalloc(&flush, 256 << 20));
  CHECK(cudaMemset(x, 0, (size_t)kXRows * K * 4));
  CHECK(cudaMemset(w, 0, (size_t)kWeightRows * K * 4));
  std::vector<int> host_cols(16 << 20);
  cudaEvent_t begin, end;
  CHECK(cudaEventCreate(&begin));
  CHECK(cudaEventCreate(&end));
  auto time_warm = [&](auto launch) {  // us per launch, mean of 10 after 3 warm-ups
    for (int i = 0; i < 3; ++i) launch();
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaEventRecord(begin));
    for (int i = 0; i < 10; ++i) launch();
    CHECK(cudaEventRecord(end));
    CHECK(cudaEventSynchronize(end));
    CHECK(cudaGetLastError());
    float ms = 0.f;
    CHECK(cudaEventElapsedTime(&ms, begin, end));
    return ms * 100.f;
  };
  auto time_cold_x = [&](auto launch) {  // L2 flushed, the weight re-read; median of 7
    std::vector<float> times;
    for (int i = 0; i < 7; ++i) {
      CHECK(cudaMemset(flush, i, 256 << 20));
      CHECK(cudaMemcpy(flush, w, (size_t)kWeightRows * K * 4, cudaMemcpyDeviceToDevice));
      CHECK(cudaEventRecord(begin));
      launch();
      CHECK(cudaEventRecord(end));
      CHECK(cudaEventSynchronize(end));
      CHECK(cudaGetLastError());
      float ms = 0.f;
      CHECK(cudaEventElapsedTime(&ms, begin, end));
      times.push_back(ms * 1000.f);
    }
    std::sort(times.begin(), times.end());
    return times[3];
  };

  for (int hot = 0; hot < 2; ++hot) {
    uint32_t state = 12345;
    for (int& c : host_cols) {
      state = state * 1664525u + 1013904223u;
      c = static_cast<int>((state >> 8) % (hot ? 8 : kWeightRows));
    }
    CHECK(cudaMemcpy(cols, host_cols.data(), host_cols.size() * 4, cudaMemcpyHostToDevice));
    std::printf("== weight rows %s\n", hot ? "hot (8 rows read by every CTA)" : "spread over 512");

    for (int per_sm : {1, 2, 4}) {
      for (int unroll : {1, 2, 4}) {
        const int blocks = sms * per_sm;
        const size_t pad = per_sm == 1 ? 120 << 10 : per_sm == 2 ? 100 << 10 : 50 << 10;
        float us = 0.f;
        auto run = [&](auto kernel) {
          CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     200 << 10));
          us = time_warm([&] { kernel<<<blocks, 256, pad>>>(x, w, cols, out); });
        };
        if (unroll == 1) {
          run(per_row_loads<4, 1>);
        } else if (unroll == 2) {
          run(per_row_loads<4, 2>);
        } else {
          run(per_row_loads<4, 4>);
        }
        const double bytes = (double)blocks * 5 * K * 4;
        std::printf(
            "per_row_loads CTAs/SM=%d unroll=%d: %7.1f us %6.2f TB/s %5.1f GB/s per SM %5.1f per "
            "CTA\n",
            per_sm, unroll, us, bytes / us / 1e6, bytes / us / 1e3 / sms,
            bytes / us / 1e3 / blocks);
      }
    }

    auto tile = [&](auto kernel, const char* name, int rows, int kc, int stages, int per_sm) {
      const size_t smem = (size_t)stages * rows * kc * 4 + 8 * stages + 64;
      CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
      const int blocks = sms * per_sm;
      const float us = time_warm([&] { kernel<<<blocks, 256, smem>>>(x, w, cols, out); });
      const double bytes = (double)blocks * rows * K * 4;
      std::printf("%s rows=%d kc=%d stages=%d (%zu KB) CTAs/SM=%d: %7.1f us %6.2f TB/s "
                  "%5.1f GB/s per SM\n",
                  name, rows, kc, stages, smem >> 10, per_sm, us, bytes / us / 1e6,
                  bytes / us / 1e3 / sms);
    };
    tile(tile_stream<24, 256, 5, false>, "tile_stream cp.async", 24, 256, 5, 1);
    tile(tile_stream<24, 256, 8, false>, "tile_stream cp.async", 24, 256, 8, 1);
    tile(tile_stream<24, 512, 4, false>, "tile_stream cp.async", 24, 512, 4, 1);
    tile(tile_stream<24, 256, 4, false>, "tile_stream cp.async", 24, 256, 4, 2);
    tile(tile_stream<24, 256, 5, true>, "tile_stream bulk    ", 24, 256, 5, 1);
    tile(tile_stream<24, 256, 8, true>, "tile_stream bulk    ", 24, 256, 8, 1);
    tile(tile_stream<24, 1024, 2, true>, "tile_stream bulk    ", 24, 1024, 2, 1);
    tile(tile_stream<12, 2048, 2, true>, "tile_stream bulk    ", 12, 2048, 2, 1);
    tile(tile_stream<24, 256, 4, true>, "tile_stream bulk    ", 24, 256, 4, 2);

    auto pairs = [&](auto kernel, const char* name, bool cold, int blocks) {
      const size_t smem = (size_t)5 * 24 * 256 * 4;
      CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
      auto launch = [&] { kernel<<<blocks, 256, smem>>>(x, w, cols, (int64_t)K4, out); };
      const float us = cold ? time_cold_x(launch) : time_warm(launch);
      const double bytes = (double)blocks * 24 * K * 4;
      std::printf("%s %s CTAs=%d: %7.1f us %6.2f TB/s %5.1f GB/s per CTA\n", name,
                  cold ? "cold x" : "warm  ", blocks, us, bytes / us / 1e6,
                  bytes / us / 1e3 / blocks);
    };
    for (int blocks : {16, 128}) {
      for (bool cold : {false, true}) {
        pairs(tile_with_pairs<false>, "tile_with_pairs no compute", cold, blocks);
        pairs(tile_with_pairs<true>, "tile_with_pairs compute   ", cold, blocks);
      }
    }
    const int blocks = 1024;
    auto launch = [&] { per_row_loads<4, 2><<<blocks, 256, 50 << 10>>>(x, w, cols, out); };
    for (bool cold : {false, true}) {
      const float us = cold ? time_cold_x(launch) : time_warm(launch);
      std::printf("per_row_loads 1024 CTAs %s: %7.1f us\n", cold ? "cold x" : "warm  ", us);
    }
  }
  return 0;
}
