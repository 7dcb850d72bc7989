// The order in which the arg-max backward sums grad_weight and grad_bias, shared by the CPU
// (csrc/cpu/backward.cpp) and CUDA (csrc/cuda/backward.cu) implementations so that, given the same
// dz, they agree bit for bit.
//
// The rows b with argmax[b] == n form segment n. In sorted order (by arg-max, then increasing b;
// sorted position p) the rows are cut into tiles of kSegmentTileRows. A segment's rows within one
// tile are summed left to right from zero (a piece: 0 + dz[b0] x[b0] + dz[b1] x[b1] + ..., every
// product rounded to float before it is added), and the segment's pieces left to right from zero.
// Tiles, not segments, are the CUDA kernels' unit of work, so that a long segment is summed by
// many blocks side by side.
#pragma once

namespace fused_pool_gelu {

// 32: a tile's rows are one load each of a block's threads in flight at once (32 registers), and
// a segment of n rows is n / 32 tiles side by side (research/README.md, "Backward and training
// step").
constexpr int kSegmentTileRows = 32;

}  // namespace fused_pool_gelu
