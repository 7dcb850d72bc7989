// forward_backward on CUDA: the arg-max backward of forward_with_argmax (docs/design.md, "The
// backward: only the arg-max carries gradient"). No GEMM, only O(B*K + N*K) memory traffic:
//
//   dz[b]          = grad_out[b] * scale * gelu'(preactivation[b]) + grad_preactivation[b]
//                    (each term only when given; fp32, scale rounded to float first)
//   grad_x[b, :]   = dz[b] * weight[argmax[b], :]                         a gather
//   grad_weight[n] = sum over rows b with argmax[b] == n, in increasing b, of dz[b] * x[b, :]
//   grad_bias[n]   = sum over the same rows of dz[b]
//
// Determinism: no float atomics. The rows are grouped by arg-max with a stable counting sort of our
// own (group_rows: one block, no host sync, in the launch that gathers grad_x), and every sum runs
// in the fixed order of summation_order.h, the CPU backward's too: pieces of a segment's rows
// within tiles of kSegmentTileRows sorted rows (segment_tiles_kernel), then the pieces
// (segment_pieces_kernel).
// Every product dz*x is rounded to float before it is added (no FMA contraction). So given the
// same dz the result is bit for bit the CPU's (dz itself may differ from a CPU's in the last bits,
// through erf and exp).
//
// Arg-max values outside [0, N) can only come from a caller passing garbage, and checking them on
// the host would need a device-to-host sync. The kernels never read out of bounds instead: such a
// row gets NaN in grad_x (loud, not silently zero) and contributes nothing to grad_weight and
// grad_bias (the grouping leaves it out of every segment).
#include <cub/block/block_discontinuity.cuh>
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>

#include "checks.h"
#include "cuda/common.cuh"
#include "cuda/fold_backward.h"
#include "summation_order.h"

namespace fused_pool_gelu {
namespace cuda {
namespace {

constexpr int kWarpSize = 32;

// 16-byte weight loads each lane issues before its first store: 4 x 16 B x 1024 resident threads
// (2 blocks of kGatherThreads per SM) = 64 KB in flight per SM, more than what DRAM latency needs
// (~23 KB per SM for 4.3 TB/s at ~0.7 us), and dz (an erf and an exp) is evaluated once per 4
// vectors instead of once per vector. More would leave lanes idle at small K.
constexpr int kGatherVectorsPerLane = 4;

// Segment reduction, first kernel (segment_tiles_kernel): a block sums one tile of kSegmentTileRows
// sorted rows over kSegmentThreads columns (one per thread: scalar loads, a warp reads 128
// contiguous bytes of a row, a block 1 KB), with all of a thread's loads in flight at once (32
// registers). Fixed tiles, not segments, are the unit of work: every block has the same few rows,
// and a segment of n rows is n / 32 blocks side by side instead of one chain of n dependent adds
// per column (research/README.md, "Backward and training step").
constexpr int kSegmentThreads = 256;
static_assert(kSegmentTileRows + 2 <= kSegmentThreads, "one thread stages each row of a tile");

// Segment reduction, second kernel (segment_pieces_kernel): adds the pieces of each segment that
// spans tiles, kPieceBatch piece loads in flight at a time (a segment of all 4096 rows has 128
// pieces); for forward_backward, blocks of kZeroSegments segments also zero the empty ones.
constexpr int kPieceBatch = 16;
constexpr int kZeroSegments = 32;
static_assert(kZeroSegments + 1 <= kSegmentThreads, "one thread stages each segment start");

// Grouping rows by arg-max (group_rows): one block of kGroupThreads threads sorts tiles of
// kGroupTileRows rows. 512 x 8: the kernel's shared memory (cub's block radix sort of 4096 32-bit
// key-value pairs, mostly) is 18.5 KB on sm_90 and 19.5 KB on sm_80 (cuobjdump), within the 48 KB
// static limit, and 4096 rows cover every batch of the benchmark (B <= 4096) in one tile.
constexpr int kGroupThreads = 512;
constexpr int kGroupItemsPerThread = 8;
constexpr int kGroupTileRows = kGroupThreads * kGroupItemsPerThread;
// Batches up to kGroupThreads * kGroupSmallItemsPerThread rows are sorted as a tile of that size:
// the sort's cost follows the tile, not the batch: a small batch takes a small tile.
constexpr int kGroupSmallItemsPerThread = 2;

// grad_x runs in the grouping's launch (group_rows_and_grad_x_kernel), so at its block size: 16
// warps, each owning one row b and a run of kWarpSize * kGatherVectorsPerLane 16-byte vectors.
constexpr int kGatherThreads = kGroupThreads;

// The 1-D inputs that define dz[b]; the optional ones are nullptr when None. Any strides: an
// upstream gradient of out.sum() arrives as an expanded (stride 0) tensor.
template <typename scalar_t>
struct DzInputs {
  const scalar_t* grad_out;
  int64_t grad_out_stride;
  const scalar_t* grad_preactivation;
  int64_t grad_preactivation_stride;
  const scalar_t* preactivation;
  int64_t preactivation_stride;
  float scale;
};

// dz[b] in float, evaluated as (g * s) * gelu'(z) + gp. __fmul_rn / __fadd_rn forbid FMA
// contraction, so gather_grad_x and write_position, which both evaluate it, get the same bits.
template <typename scalar_t>
__device__ __forceinline__ float row_dz(const DzInputs<scalar_t>& in, int64_t b) {
  float dz = 0.0f;
  if (in.grad_out != nullptr) {
    const float z = static_cast<float>(in.preactivation[b * in.preactivation_stride]);
    const float g = static_cast<float>(in.grad_out[b * in.grad_out_stride]);
    dz = __fmul_rn(__fmul_rn(g, in.scale), gelu_grad(z));
  }
  if (in.grad_preactivation != nullptr) {
    dz = __fadd_rn(dz, static_cast<float>(in.grad_preactivation[b * in.grad_preactivation_stride]));
  }
  return dz;
}

// Block `block` of the gather grad_x[b, :] = dz[b] * weight[argmax[b], :]. Warp w covers row b =
// w / warps_per_row and the vectors (w % warps_per_row) * kWarpSize * kGatherVectorsPerLane + u *
// kWarpSize + lane, so every load and store instruction of a warp touches 512 contiguous bytes. A
// row whose arg-max is out of [0, pooled) is written as NaN and its weight row is never read.
// VEC > 1 requires w_stride1 == 1, 16-byte aligned weight rows and in_features % VEC == 0.
template <typename scalar_t, int VEC>
__device__ __forceinline__ void gather_grad_x(
    int64_t block, const DzInputs<scalar_t>& dz_in, const int64_t* __restrict__ argmax,
    int64_t argmax_stride, const scalar_t* __restrict__ weight, int64_t w_stride0,
    int64_t w_stride1, scalar_t* __restrict__ grad_x, int64_t batch, int64_t pooled,
    int64_t in_features, int64_t warps_per_row) {
  constexpr int kVectorsPerWarp = kWarpSize * kGatherVectorsPerLane;
  const int64_t warp = (block * kGatherThreads + threadIdx.x) / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x % kWarpSize);
  if (warp >= batch * warps_per_row) return;
  const int64_t b = warp / warps_per_row;
  const int64_t first_vec = (warp - b * warps_per_row) * kVectorsPerWarp + lane;
  scalar_t* out_row = grad_x + b * in_features;

  const int64_t n = argmax[b * argmax_stride];
  if (n < 0 || n >= pooled) {
    AlignedVector<scalar_t, VEC> nan_vec;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      nan_vec.val[j] = static_cast<scalar_t>(std::numeric_limits<float>::quiet_NaN());
    }
#pragma unroll
    for (int u = 0; u < kGatherVectorsPerLane; ++u) {
      const int64_t col = (first_vec + u * kWarpSize) * VEC;
      if (col < in_features) store_vector<scalar_t, VEC>(out_row + col, nan_vec);
    }
    return;
  }

  const scalar_t* w_row = weight + n * w_stride0;
  AlignedVector<scalar_t, VEC> w[kGatherVectorsPerLane];
#pragma unroll
  for (int u = 0; u < kGatherVectorsPerLane; ++u) {
    const int64_t col = (first_vec + u * kWarpSize) * VEC;
    if (col < in_features) w[u] = load_vector<scalar_t, VEC>(w_row + col * w_stride1);
  }
  const float dz = row_dz(dz_in, b);  // overlaps the loads above
#pragma unroll
  for (int u = 0; u < kGatherVectorsPerLane; ++u) {
    const int64_t col = (first_vec + u * kWarpSize) * VEC;
    if (col < in_features) {
      AlignedVector<scalar_t, VEC> out;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        out.val[j] = static_cast<scalar_t>(dz * static_cast<float>(w[u].val[j]));
      }
      store_vector<scalar_t, VEC>(out_row + col, out);
    }
  }
}

// True between two sorted keys that differ: a run of equal arg-maxes ends between them.
struct KeysDiffer {
  __device__ bool operator()(uint32_t a, uint32_t b) const { return a != b; }
};

struct MaxPosition {
  __device__ int operator()(int a, int b) const { return a > b ? a : b; }
};

template <int kItems>
using TileSort = cub::BlockRadixSort<uint32_t, kGroupThreads, kItems, uint32_t>;
using RunFlags = cub::BlockDiscontinuity<uint32_t, kGroupThreads>;
using PositionScan = cub::BlockScan<int, kGroupThreads>;
using CountScan = cub::BlockScan<int64_t, kGroupThreads>;

// group_rows' shared memory: one phase at a time.
union GroupTemp {
  typename TileSort<kGroupItemsPerThread>::TempStorage sort;
  typename TileSort<kGroupSmallItemsPerThread>::TempStorage small_sort;
  typename RunFlags::TempStorage flags;
  typename PositionScan::TempStorage positions;
  typename CountScan::TempStorage counts;
  uint32_t sorted_keys[kGroupTileRows];  // one-tile path, after the sort
};

template <int kItems>
__device__ __forceinline__ auto& sort_storage(GroupTemp& temp) {
  if constexpr (kItems == kGroupItemsPerThread) {
    return temp.sort;
  } else {
    static_assert(kItems == kGroupSmallItemsPerThread, "one storage per sort size");
    return temp.small_sort;
  }
}

// The arrays group_rows writes (see there; allocated in pooled_gradients).
struct Grouping {
  int64_t* segment_starts;
  int64_t* cursor;
  int64_t* order;
  int64_t* sorted_segment;
  float* sorted_dz;
};

// group_rows' arguments (see there).
template <typename scalar_t>
struct GroupRowsArgs {
  DzInputs<scalar_t> dz_in;
  const int64_t* argmax;
  int64_t argmax_stride;
  int64_t batch;
  int64_t pooled;
  int key_bits;
  Grouping out;
};

// Sorted position p of row b (segment n, or `pooled` for none): everything a position holds.
template <typename scalar_t>
__device__ __forceinline__ void write_position(const GroupRowsArgs<scalar_t>& a, int64_t p,
                                               int64_t b, uint32_t n) {
  const bool in_segment = n != static_cast<uint32_t>(a.pooled);
  a.out.order[p] = b;
  a.out.sorted_segment[p] = in_segment ? static_cast<int64_t>(n) : -1;
  a.out.sorted_dz[p] = in_segment ? row_dz(a.dz_in, b) : 0.0f;
}

// The tile of rows tile .. tile + kGroupThreads * kItems - 1, sorted by key (blocked: item j of
// thread t is sorted position t * kItems + j of the tile); rows = tile-local row indices.
template <int kItems, typename scalar_t>
__device__ __forceinline__ void sort_tile(const GroupRowsArgs<scalar_t>& a, GroupTemp& temp,
                                          int64_t tile, uint32_t (&keys)[kItems],
                                          uint32_t (&rows)[kItems]) {
  const int first_item = static_cast<int>(threadIdx.x) * kItems;
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int64_t b = tile + first_item + j;
    const int64_t n = b < a.batch ? a.argmax[b * a.argmax_stride] : -1;
    keys[j] = n >= 0 && n < a.pooled ? static_cast<uint32_t>(n) : static_cast<uint32_t>(a.pooled);
    rows[j] = static_cast<uint32_t>(first_item + j);
  }
  TileSort<kItems>(sort_storage<kItems>(temp)).Sort(keys, rows, 0, a.key_bits);
  __syncthreads();  // temp is reused
}

// batch <= kGroupThreads * kItems: the sorted tile is the grouping.
template <int kItems, typename scalar_t>
__device__ __forceinline__ void group_one_tile(const GroupRowsArgs<scalar_t>& a, GroupTemp& temp) {
  constexpr int kTileRows = kGroupThreads * kItems;
  const int first_item = static_cast<int>(threadIdx.x) * kItems;
  uint32_t keys[kItems];
  uint32_t rows[kItems];
  sort_tile<kItems>(a, temp, 0, keys, rows);
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    temp.sorted_keys[first_item + j] = keys[j];
    if (first_item + j < a.batch) write_position(a, first_item + j, rows[j], keys[j]);
  }
  __syncthreads();
  for (int64_t n = threadIdx.x; n <= a.pooled; n += kGroupThreads) {
    int lo = 0;  // the first sorted position whose key is >= n, in [0, kTileRows]
    int hi = kTileRows;
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (temp.sorted_keys[mid] < n) lo = mid + 1; else hi = mid;
    }
    a.out.segment_starts[n] = lo;
  }
}

// Groups the rows by arg-max: for every n in [0, pooled), order[segment_starts[n] ..
// segment_starts[n + 1]) holds the rows b with argmax[b] == n in increasing b (stable); rows whose
// arg-max is out of [0, pooled) are in no segment and come last, at the sorted positions
// segment_starts[pooled] .. batch - 1. For every sorted position p < batch it also writes the
// row's segment (sorted_segment[p], -1 for a row in no segment) and dz (sorted_dz[p], 0 there), so
// that the segment reduction stages a tile of sorted rows with one round trip to memory.
// One block (the order within a segment is kept by barriers alone), key_bits = the bits of
// `pooled`, rows sorted by a stable block radix sort on their arg-max (key `pooled` for rows in no
// segment, sorted last):
//   batch <= kGroupTileRows (every benchmark batch): one tile (of 1024 rows up to 1024, else
//     4096), whose sorted order is the grouping; segment_starts[n] is the first sorted position
//     whose key is >= n (a binary search of the sorted keys in shared memory). No global memory
//     round trip but the loads of argmax and dz.
//   larger batches, three phases:
//   1. histogram: cursor[n] = the number of rows with arg-max n (integer atomics: a count does not
//      depend on the order of its increments);
//   2. exclusive scan of the counts: segment_starts, and cursor[n] = segment_starts[n];
//   3. tiles of kGroupTileRows consecutive rows, in increasing b: the tile sorted by arg-max, then
//      each row goes to cursor[n] + its rank among the tile's rows with arg-max n, and the last row
//      of each run of n advances cursor[n]. The cursors carry each segment's next position from
//      tile to tile, so positions within a segment increase with b; rows in no segment take the
//      positions from segment_starts[pooled] on, in increasing b, through one more cursor.
template <typename scalar_t>
__device__ __forceinline__ void group_rows(const GroupRowsArgs<scalar_t>& a) {
  __shared__ GroupTemp temp;
  if (a.batch <= kGroupThreads * kGroupSmallItemsPerThread) {
    group_one_tile<kGroupSmallItemsPerThread>(a, temp);
    return;
  }
  if (a.batch <= kGroupTileRows) {
    group_one_tile<kGroupItemsPerThread>(a, temp);
    return;
  }
  const int64_t batch = a.batch;
  const int64_t pooled = a.pooled;
  int64_t* cursor = a.out.cursor;
  const int first_item = static_cast<int>(threadIdx.x) * kGroupItemsPerThread;

  for (int64_t n = threadIdx.x; n <= pooled; n += kGroupThreads) cursor[n] = 0;
  __syncthreads();
  for (int64_t b = threadIdx.x; b < batch; b += kGroupThreads) {
    const int64_t n = a.argmax[b * a.argmax_stride];
    if (n >= 0 && n < pooled) atomicAdd(reinterpret_cast<unsigned long long*>(cursor + n), 1ull);
  }
  __syncthreads();

  int64_t rows_before = 0;  // rows in the segments before the current chunk
  for (int64_t chunk = 0; chunk < pooled; chunk += kGroupTileRows) {
    int64_t starts[kGroupItemsPerThread];
#pragma unroll
    for (int j = 0; j < kGroupItemsPerThread; ++j) {
      const int64_t n = chunk + first_item + j;
      starts[j] = n < pooled ? cursor[n] : 0;
    }
    int64_t chunk_rows;
    CountScan(temp.counts).ExclusiveSum(starts, starts, chunk_rows);
#pragma unroll
    for (int j = 0; j < kGroupItemsPerThread; ++j) {
      const int64_t n = chunk + first_item + j;
      if (n < pooled) {
        a.out.segment_starts[n] = rows_before + starts[j];
        cursor[n] = rows_before + starts[j];
      }
    }
    rows_before += chunk_rows;
    __syncthreads();  // temp.counts is reused by the next chunk
  }
  if (threadIdx.x == 0) {
    a.out.segment_starts[pooled] = rows_before;
    cursor[pooled] = rows_before;  // the rows in no segment follow the segments
  }
  __syncthreads();  // the cursors are set

  for (int64_t tile = 0; tile < batch; tile += kGroupTileRows) {
    uint32_t keys[kGroupItemsPerThread];
    uint32_t rows[kGroupItemsPerThread];
    sort_tile<kGroupItemsPerThread>(a, temp, tile, keys, rows);
    int heads[kGroupItemsPerThread];
    int tails[kGroupItemsPerThread];
    RunFlags(temp.flags).FlagHeadsAndTails(heads, tails, keys, KeysDiffer());
    __syncthreads();
    int run_start[kGroupItemsPerThread];  // sorted position of the first item of the item's run
#pragma unroll
    for (int j = 0; j < kGroupItemsPerThread; ++j) run_start[j] = heads[j] ? first_item + j : 0;
    PositionScan(temp.positions).InclusiveScan(run_start, run_start, MaxPosition());
#pragma unroll
    for (int j = 0; j < kGroupItemsPerThread; ++j) {
      if (tile + rows[j] < batch) {
        write_position(a, cursor[keys[j]] + (first_item + j - run_start[j]), tile + rows[j],
                       keys[j]);
      }
    }
    __syncthreads();  // every read of a cursor in this tile comes before its update
#pragma unroll
    for (int j = 0; j < kGroupItemsPerThread; ++j) {
      if (tails[j] && tile + rows[j] < batch) {
        cursor[keys[j]] += first_item + j - run_start[j] + 1;
      }
    }
    __syncthreads();  // the updates come before the next tile's reads; temp is reused
  }
}

// One launch, two independent jobs: block 0 groups the rows (group_rows), blocks 1 .. gather grad_x
// (gather_grad_x; none when in_features == 0). Launched one after the other, the grouping would run
// alone on one SM (~10 us at B = 1024) with the others idle, then the gather; here the gather
// fills the other SMs meanwhile, and block 0, the first one scheduled, starts at once. A
// second stream would overlap them too, at the price of an event fork and join on the host in
// every step. Both jobs read only the call's inputs, so neither waits for the other.
// Two blocks per SM (64 registers) for the gather's bytes in flight; ptxas then spills 112 bytes,
// all in the grouping's code (SASS), which runs in one block.
template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kGroupThreads, 2)
    group_rows_and_grad_x_kernel(DzInputs<scalar_t> dz_in, const int64_t* __restrict__ argmax,
                                 int64_t argmax_stride, int64_t batch, int64_t pooled,
                                 int key_bits, Grouping grouping,
                                 const scalar_t* __restrict__ weight, int64_t w_stride0,
                                 int64_t w_stride1, scalar_t* __restrict__ grad_x,
                                 int64_t in_features, int64_t warps_per_row) {
  allow_dependent_launch();
  wait_for_previous_grid();
  if (blockIdx.x == 0) {
    group_rows<scalar_t>(
        GroupRowsArgs<scalar_t>{dz_in, argmax, argmax_stride, batch, pooled, key_bits, grouping});
  } else {
    gather_grad_x<scalar_t, VEC>(static_cast<int64_t>(blockIdx.x) - 1, dz_in, argmax,
                                 argmax_stride, weight, w_stride0, w_stride1, grad_x, batch,
                                 pooled, in_features, warps_per_row);
  }
}

// Block (tile, chunk) of the segment reduction's first pass: sorted positions
// tile * R .. tile * R + rows - 1 (R = kSegmentTileRows), columns chunk * kSegmentThreads + t.
// Segment n is order[segment_starts[n] .. segment_starts[n + 1]): the rows b with argmax[b] == n
// in increasing b (group_rows). Each run of the tile's rows in one segment (a piece) is summed
// left to right from zero, acc += dz[b] * x[b, col] (each product rounded, no FMA), and goes to
//   pieces[tile][0]        when the segment has rows before the tile (it is the tile's first),
//   pieces[tile][1]        when it has rows after the tile but none before (the tile's last),
//   grad_weight[n] itself  when all of its rows are in this tile: the piece is the whole sum.
// grad_bias the same way from dz alone (thread 0 of chunk 0, bias_pieces). Rows in no segment (an
// arg-max out of range) are sorted last, so the tile's rows are its first `rows` positions and a
// block past them has nothing to do. The tile comes from group_rows' per-position arrays (row,
// segment, dz) in one round trip, then its x values in a second.
template <typename scalar_t>
__global__ void __launch_bounds__(kSegmentThreads)
    segment_tiles_kernel(const scalar_t* __restrict__ x, int64_t x_stride0, int64_t x_stride1,
                         const int64_t* __restrict__ order,
                         const int64_t* __restrict__ sorted_segment,
                         const float* __restrict__ sorted_dz, scalar_t* __restrict__ grad_weight,
                         scalar_t* __restrict__ grad_bias, float* __restrict__ pieces,
                         float* __restrict__ bias_pieces, int64_t batch, int64_t in_features,
                         int64_t chunks) {
  allow_dependent_launch();
  wait_for_previous_grid();
  __shared__ int64_t row_offset[kSegmentTileRows];  // b * x_stride0 of the tile's rows
  __shared__ float row_dz_tile[kSegmentTileRows];
  // The segments of the row before the tile, of its rows, and of the row after it (-1: none).
  __shared__ int64_t row_segment[kSegmentTileRows + 2];

  const int64_t tile = blockIdx.x / chunks;
  const int64_t chunk = blockIdx.x - tile * chunks;
  const int64_t tile_start = tile * kSegmentTileRows;
  const int t = static_cast<int>(threadIdx.x);
  bool in_tile = false;  // thread t stages a row of the tile that is in a segment
  if (t < kSegmentTileRows + 2) {
    const int64_t position = tile_start - 1 + t;
    int64_t segment = -1;
    if (position >= 0 && position < batch) {
      segment = sorted_segment[position];
      if (t >= 1 && t <= kSegmentTileRows) {
        row_offset[t - 1] = order[position] * x_stride0;
        row_dz_tile[t - 1] = sorted_dz[position];
        in_tile = segment >= 0;
      }
    }
    row_segment[t] = segment;
  }
  const int64_t col = chunk * kSegmentThreads + t;
  const bool has_col = col < in_features;
  const bool writes_bias = chunk == 0 && t == 0;
  const scalar_t* x_col = x + col * x_stride1;  // dereferenced only when has_col
  const int rows = __syncthreads_count(in_tile);  // and the tile is staged
  if (rows == 0) return;  // block-uniform

  // All loads before the first add, so that they overlap; the full tile (the common case) has no
  // per-load predicate, so ptxas issues them back to back.
  scalar_t vals[kSegmentTileRows];
  if (has_col) {
    if (rows == kSegmentTileRows) {
#pragma unroll
      for (int i = 0; i < kSegmentTileRows; ++i) vals[i] = x_col[row_offset[i]];
    } else {
#pragma unroll
      for (int i = 0; i < kSegmentTileRows; ++i) {
        if (i < rows) vals[i] = x_col[row_offset[i]];
      }
    }
  }

  // Stores the piece of rows first .. end - 1, all in segment row_segment[first + 1].
  auto store_piece = [&](int first, int end, float acc, float bias_acc) {
    const int64_t n = row_segment[first + 1];
    const bool from_before = first == 0 && row_segment[0] == n;
    const bool into_after = end == rows && row_segment[rows + 1] == n;
    if (from_before || into_after) {
      const int64_t slot = 2 * tile + (from_before ? 0 : 1);
      if (has_col) pieces[slot * in_features + col] = acc;
      if (writes_bias) bias_pieces[slot] = bias_acc;
    } else {
      if (has_col) grad_weight[n * in_features + col] = static_cast<scalar_t>(acc);
      if (writes_bias) grad_bias[n] = static_cast<scalar_t>(bias_acc);
    }
  };
  float acc = 0.0f;
  float bias_acc = 0.0f;
  if (row_segment[1] == row_segment[rows]) {
    // One segment over the whole tile (block-uniform; segments are contiguous in sorted order):
    // a tight chain of adds without boundary checks.
#pragma unroll
    for (int i = 0; i < kSegmentTileRows; ++i) {
      if (i < rows) {
        const float dz = row_dz_tile[i];
        if (has_col) acc = __fadd_rn(acc, __fmul_rn(dz, static_cast<float>(vals[i])));
        bias_acc = __fadd_rn(bias_acc, dz);
      }
    }
    store_piece(0, rows, acc, bias_acc);
    return;
  }
  int first = 0;
#pragma unroll
  for (int i = 0; i < kSegmentTileRows; ++i) {
    if (i < rows) {
      if (i > 0 && row_segment[i + 1] != row_segment[i]) {
        store_piece(first, i, acc, bias_acc);
        acc = 0.0f;
        bias_acc = 0.0f;
        first = i;
      }
      const float dz = row_dz_tile[i];
      if (has_col) acc = __fadd_rn(acc, __fmul_rn(dz, static_cast<float>(vals[i])));
      bias_acc = __fadd_rn(bias_acc, dz);
    }
  }
  store_piece(first, rows, acc, bias_acc);
}

// Block (zero_groups + tile, chunk) of the second pass: the segment whose rows start in tile t0 =
// tile and go on past it, if there is one (the tile's last segment; every segment that spans tiles
// has exactly one such block), over columns chunk * kSegmentThreads + t. Its sum, left to right:
// pieces[t0][1] (its rows in t0) + pieces[t0 + 1][0] + ... + pieces[t1][0] (the first segment of
// every later tile it reaches), kPieceBatch loads in flight. Segments inside one tile were written
// by segment_tiles_kernel. The spanning segments are summed side by side, one block each, not in
// turn by one block.
// With zero_empty_segments (forward_backward: every pooled row is an output), zero_groups more
// blocks come first (scheduled first, so that they overlap the sums instead of trailing them):
// block (g, chunk) writes zeros to the empty segments among g * kZeroSegments .. (g + 1) *
// kZeroSegments - 1. model_backward has none and leaves those rows unwritten (fold_backward_of
// reads no row of an empty segment).
template <typename scalar_t>
__global__ void __launch_bounds__(kSegmentThreads)
    segment_pieces_kernel(const int64_t* __restrict__ sorted_segment,
                          const int64_t* __restrict__ segment_starts,
                          const float* __restrict__ pieces, const float* __restrict__ bias_pieces,
                          scalar_t* __restrict__ grad_weight, scalar_t* __restrict__ grad_bias,
                          int64_t batch, int64_t pooled, int64_t in_features,
                          int64_t zero_groups, int64_t chunks) {
  allow_dependent_launch();
  wait_for_previous_grid();
  const int64_t group = blockIdx.x / chunks;
  const int64_t chunk = blockIdx.x - group * chunks;
  const int64_t col = chunk * kSegmentThreads + threadIdx.x;
  const bool has_col = col < in_features;
  const bool writes_bias = chunk == 0 && threadIdx.x == 0;
  if (group < zero_groups) {  // block-uniform
    __shared__ int64_t starts[kZeroSegments + 1];
    const int64_t first_segment = group * kZeroSegments;
    const int segments =
        static_cast<int>(std::min<int64_t>(pooled - first_segment, kZeroSegments));
    if (static_cast<int>(threadIdx.x) <= segments) {
      starts[threadIdx.x] = segment_starts[first_segment + threadIdx.x];  // index <= pooled
    }
    __syncthreads();
    for (int j = 0; j < segments; ++j) {
      if (starts[j] != starts[j + 1]) continue;
      const int64_t n = first_segment + j;
      if (has_col) grad_weight[n * in_features + col] = static_cast<scalar_t>(0.0f);
      if (writes_bias) grad_bias[n] = static_cast<scalar_t>(0.0f);
    }
    return;
  }
  const int64_t tile = group - zero_groups;
  const int64_t first = tile * kSegmentTileRows;  // the tile's first sorted position
  const int64_t last = first + kSegmentTileRows - 1;
  if (last + 1 >= batch) return;  // no later tile (block-uniform, as every test below)
  const int64_t n = sorted_segment[last];
  const int64_t before = tile > 0 ? sorted_segment[first - 1] : -1;
  if (n < 0 || sorted_segment[last + 1] != n) return;  // ends in this tile (or no segment)
  if (before == n) return;  // began in an earlier tile: summed by that tile's block
  const int64_t t0 = tile;
  const int64_t t1 = (segment_starts[n + 1] - 1) / kSegmentTileRows;
  float acc = has_col ? pieces[(2 * t0 + 1) * in_features + col] : 0.0f;
  float bias_acc = writes_bias ? bias_pieces[2 * t0 + 1] : 0.0f;
  for (int64_t t = t0 + 1; t <= t1; t += kPieceBatch) {
    float piece[kPieceBatch];
    float bias_piece[kPieceBatch];
    // Tiles past t1 clamped to t1 (loaded, not added), not skipped: with a predicate per load,
    // ptxas places each load after the previous add, one round trip per piece.
#pragma unroll
    for (int u = 0; u < kPieceBatch; ++u) {
      const int64_t piece_tile = t + u <= t1 ? t + u : t1;
      if (has_col) piece[u] = pieces[2 * piece_tile * in_features + col];
      if (writes_bias) bias_piece[u] = bias_pieces[2 * piece_tile];
    }
#pragma unroll
    for (int u = 0; u < kPieceBatch; ++u) {
      if (t + u <= t1) {
        if (has_col) acc = __fadd_rn(acc, piece[u]);
        if (writes_bias) bias_acc = __fadd_rn(bias_acc, bias_piece[u]);
      }
    }
  }
  if (has_col) grad_weight[n * in_features + col] = static_cast<scalar_t>(acc);
  if (writes_bias) grad_bias[n] = static_cast<scalar_t>(bias_acc);
}

template <typename scalar_t>
DzInputs<scalar_t> make_dz_inputs(const std::optional<Tensor>& grad_out,
                                  const std::optional<Tensor>& grad_preactivation,
                                  const Tensor& preactivation, double scale) {
  DzInputs<scalar_t> in;
  in.grad_out = grad_out.has_value() ? grad_out->const_data_ptr<scalar_t>() : nullptr;
  in.grad_out_stride = grad_out.has_value() ? grad_out->stride(0) : 0;
  in.grad_preactivation =
      grad_preactivation.has_value() ? grad_preactivation->const_data_ptr<scalar_t>() : nullptr;
  in.grad_preactivation_stride = grad_preactivation.has_value() ? grad_preactivation->stride(0) : 0;
  in.preactivation = preactivation.const_data_ptr<scalar_t>();
  in.preactivation_stride = preactivation.stride(0);
  in.scale = static_cast<float>(scale);
  return in;
}

template <typename scalar_t, int VEC>
void launch_group_rows_and_grad_x(const DzInputs<scalar_t>& dz_in, const Tensor& argmax,
                                  int key_bits, const Grouping& grouping, const Tensor& weight,
                                  Tensor& grad_x, cudaStream_t stream) {
  const int64_t batch = grad_x.size(0);
  const int64_t in_features = grad_x.size(1);
  const int64_t warps_per_row =
      ceil_div<int64_t>(ceil_div<int64_t>(in_features, VEC), kWarpSize * kGatherVectorsPerLane);
  // warps_per_row == 0 when in_features == 0: block 0 alone. One block more than the gather needs.
  const int64_t gather_threads = batch * warps_per_row * kWarpSize;
  cudaLaunchAttribute attribute{};
  const cudaLaunchConfig_t config = dependent_launch_config(
      grid_blocks(gather_threads + kGatherThreads, kGatherThreads, "gather threads"),
      kGroupThreads, stream, attribute,
      dependent_launch_enabled<group_rows_and_grad_x_kernel<scalar_t, VEC>>(grad_x.get_device()));
  STD_CUDA_CHECK(cudaLaunchKernelEx(
      &config, group_rows_and_grad_x_kernel<scalar_t, VEC>, dz_in,
      argmax.const_data_ptr<int64_t>(), argmax.stride(0), batch, weight.size(0), key_bits,
      grouping, weight.const_data_ptr<scalar_t>(), weight.stride(0), weight.stride(1),
      grad_x.mutable_data_ptr<scalar_t>(), in_features, warps_per_row));
}

// The arg-max backward into the pooled gradient (forward_backward's outputs), for inputs already
// checked on the current device. The rows of grad_weight and the entries of grad_bias whose segment
// is empty get no sum: with zero_empty_segments (forward_backward) segment_pieces_kernel zeroes
// them, without (model_backward) they are left unwritten and `workspace` holds segment_starts (its
// first pooled + 1 entries) for the caller. op names the calling op in errors.
struct PooledGradients {
  Tensor grad_x, grad_weight, grad_bias;
  std::optional<Tensor> workspace;        // the grouping and the pieces; none for B = 0
  const int64_t* segment_starts = nullptr;  // into workspace; nullptr: every row was written
};

PooledGradients pooled_gradients(const std::optional<Tensor>& grad_out,
                                 const std::optional<Tensor>& grad_preactivation,
                                 const Tensor& x, const Tensor& weight,
                                 const Tensor& argmax, const Tensor& preactivation,
                                 double scale, bool zero_empty_segments, const char* op) {
  const int64_t batch = x.size(0);
  const int64_t in_features = x.size(1);
  const int64_t pooled = weight.size(0);  // >= 1 (check_forward_inputs)
  PooledGradients result{aten::empty_like_device(x, {batch, in_features}),
                         aten::empty_like_device(weight, {pooled, in_features}),
                         aten::empty_like_device(weight, {pooled}), std::nullopt};
  if (batch == 0) {
    aten::zero_(result.grad_weight);
    aten::zero_(result.grad_bias);
    return result;
  }
  Tensor& grad_x = result.grad_x;
  Tensor& grad_weight = result.grad_weight;
  Tensor& grad_bias = result.grad_bias;

  // Rows grouped by arg-max, increasing b within a group (group_rows): segment n is
  // order[segment_starts[n] .. segment_starts[n + 1]). One allocation (each costs host time in
  // every training step) holds the int64 arrays segment_starts [pooled + 1], the cursors
  // [pooled + 1], order [batch] and sorted_segment [batch], then the float arrays: the segment
  // reduction's pieces (segment_tiles_kernel: two per tile of sorted rows, each a row of
  // in_features floats, 8 MB at B = 4096, K = 8192), their bias pieces, and the grouping's
  // sorted_dz [batch].
  FPG_CHECK(pooled < int64_t{0xffffffff}, "fused_pool_gelu.", op,
              ": the pooled weight must have fewer than 2^32 - 1 rows on cuda, got shape ",
              sizes_text(weight));
  const int64_t grouping_ints = 2 * (pooled + 1) + 2 * batch;
  const int64_t piece_slots = 2 * ceil_div<int64_t>(batch, kSegmentTileRows);
  const int64_t floats = piece_slots * (in_features + 1) + batch;
  result.workspace =
      aten::empty_like_device(argmax, {grouping_ints + ceil_div<int64_t>(floats, 2)});
  Grouping grouping;
  grouping.segment_starts = result.workspace->mutable_data_ptr<int64_t>();
  grouping.cursor = grouping.segment_starts + pooled + 1;
  grouping.order = grouping.cursor + pooled + 1;
  grouping.sorted_segment = grouping.order + batch;
  const int64_t* segment_starts = grouping.segment_starts;
  if (!zero_empty_segments) result.segment_starts = segment_starts;
  int key_bits = 0;  // bits of `pooled`, the largest key
  while (key_bits < 32 && (pooled >> key_bits) != 0) ++key_bits;
  float* pieces = reinterpret_cast<float*>(grouping.segment_starts + grouping_ints);
  float* bias_pieces = pieces + piece_slots * in_features;
  grouping.sorted_dz = bias_pieces + piece_slots;

  // Each kernel a programmatic dependent of the one before (the first one of whatever kernel
  // precedes the op): each waits for the previous grid before touching memory, and its launch
  // overlaps that grid's tail instead of following it (where dependent_launch_enabled).
  const int device = x.get_device();
  const cudaStream_t stream = current_stream();
  FPG_DISPATCH_CUDA_FLOATING_TYPES(x.scalar_type(), "fused_pool_gelu.forward_backward", [&] {
    const DzInputs<scalar_t> dz_in =
        make_dz_inputs<scalar_t>(grad_out, grad_preactivation, preactivation, scale);

    constexpr int kVec = vector_width<scalar_t>();
    if (rows_are_vectorizable(weight, kVec) && rows_are_vectorizable(grad_x, kVec)) {
      launch_group_rows_and_grad_x<scalar_t, kVec>(dz_in, argmax, key_bits, grouping, weight,
                                                   grad_x, stream);
    } else {
      launch_group_rows_and_grad_x<scalar_t, 1>(dz_in, argmax, key_bits, grouping, weight, grad_x,
                                                stream);
    }

    // At least one chunk, so that in_features == 0 still writes grad_bias.
    const int64_t chunks = std::max<int64_t>(ceil_div<int64_t>(in_features, kSegmentThreads), 1);
    const int64_t tiles = ceil_div<int64_t>(batch, kSegmentTileRows);  // sorted rows <= batch
    cudaLaunchAttribute tiles_attribute{};
    const cudaLaunchConfig_t tiles_config =
        dependent_launch_config(grid_blocks(tiles * chunks, 1, "segment tiles x K chunks"),
                                kSegmentThreads, stream, tiles_attribute,
                                dependent_launch_enabled<segment_tiles_kernel<scalar_t>>(device));
    STD_CUDA_CHECK(cudaLaunchKernelEx(
        &tiles_config, segment_tiles_kernel<scalar_t>, x.const_data_ptr<scalar_t>(), x.stride(0),
        x.stride(1), static_cast<const int64_t*>(grouping.order),
        static_cast<const int64_t*>(grouping.sorted_segment),
        static_cast<const float*>(grouping.sorted_dz), grad_weight.mutable_data_ptr<scalar_t>(),
        grad_bias.mutable_data_ptr<scalar_t>(), pieces, bias_pieces, batch, in_features, chunks));
    const int64_t zero_groups =
        zero_empty_segments ? ceil_div<int64_t>(pooled, kZeroSegments) : 0;
    cudaLaunchAttribute pieces_attribute{};
    const cudaLaunchConfig_t pieces_config =
        dependent_launch_config(grid_blocks((tiles + zero_groups) * chunks, 1,
                                            "segment pieces x K chunks"),
                                kSegmentThreads, stream, pieces_attribute,
                                dependent_launch_enabled<segment_pieces_kernel<scalar_t>>(device));
    STD_CUDA_CHECK(cudaLaunchKernelEx(
        &pieces_config, segment_pieces_kernel<scalar_t>,
        static_cast<const int64_t*>(grouping.sorted_segment), segment_starts,
        static_cast<const float*>(pieces), static_cast<const float*>(bias_pieces),
        grad_weight.mutable_data_ptr<scalar_t>(), grad_bias.mutable_data_ptr<scalar_t>(), batch,
        pooled, in_features, zero_groups, chunks));
  });
  return result;
}

std::tuple<Tensor, Tensor, Tensor> forward_backward_cuda(
    const std::optional<Tensor>& grad_out, const std::optional<Tensor>& grad_preactivation,
    const Tensor& x, const Tensor& weight, const Tensor& argmax,
    const Tensor& preactivation, double scale) {
  check_forward_backward_inputs(grad_out, grad_preactivation, x, weight, argmax, preactivation);
  check_cuda_floating_dtype("forward_backward", "x", x);
  const torch::stable::accelerator::DeviceGuard device_guard(x.get_device_index());
  PooledGradients grads = pooled_gradients(grad_out, grad_preactivation, x, weight, argmax,
                                           preactivation, scale, /*zero_empty_segments=*/true,
                                           "forward_backward");
  return {grads.grad_x, grads.grad_weight, grads.grad_bias};
}

// forward_backward, then fold_backward of its pooled gradient, without writing the pooled rows of
// empty segments (zeros, ~15 MB of the 16 MB at B = 1024 on the benchmarks' data, most of the
// pieces kernel's time) or reading them back: fold_backward_of knows them from the grouping.
std::tuple<Tensor, Tensor, Tensor> model_backward_cuda(
    const Tensor& grad_out, const Tensor& x, const Tensor& pooled_weight,
    const Tensor& argmax, const Tensor& preactivation, double scale, int64_t out_features,
    int64_t pool_kernel_size) {
  check_model_backward_inputs(grad_out, x, pooled_weight, argmax, preactivation, out_features,
                              pool_kernel_size);
  check_cuda_floating_dtype("model_backward", "x", x);
  const torch::stable::accelerator::DeviceGuard device_guard(x.get_device_index());
  PooledGradients grads = pooled_gradients(grad_out, std::nullopt, x, pooled_weight, argmax,
                                           preactivation, scale, /*zero_empty_segments=*/false,
                                           "model_backward");
  auto [grad_weight, grad_bias] = fold_backward_of(grads.grad_weight, grads.grad_bias, out_features,
                                                   pool_kernel_size, grads.segment_starts);
  return {grads.grad_x, grad_weight, grad_bias};
}

}  // namespace
}  // namespace cuda

STABLE_TORCH_LIBRARY_IMPL(fused_pool_gelu, CUDA, m) {
  m.impl("forward_backward", TORCH_BOX(&cuda::forward_backward_cuda));
  m.impl("model_backward", TORCH_BOX(&cuda::model_backward_cuda));
}

}  // namespace fused_pool_gelu
