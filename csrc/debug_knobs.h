// Debug knobs: environment variables that change which CUDA path the forward takes, for tests,
// benchmarks and debugging. They are the only run-time environment variables the library reads,
// read once (at the first forward on a GPU) and again only when reload_debug_knobs() is called
// (fused_pool_gelu._debug.debug_knobs does both: set the variables, then reload).
//
//   FUSED_POOL_GELU_CERTIFIED       unset or empty: the certified path where it is faster
//                                   (forward_plan.h's use_certified); 1: wherever it applies;
//                                   0: never (the 3xTF32 GEMM instead).
//   FUSED_POOL_GELU_FORCE_MMA_SYNC  1: the portable mma.sync GEMM on Hopper too (no wgmma, so no
//                                   certified path either); unset, empty or 0: off.
// Plain C++ (no torch): forward_plan.h and its CPU unit test include it.
#pragma once

namespace fused_pool_gelu {

enum class CertifiedMode { kAuto, kAlways, kNever };

struct DebugKnobs {
  CertifiedMode certified = CertifiedMode::kAuto;
  bool force_mma_sync = false;
};

// The knobs as last read (the first call reads them).
DebugKnobs debug_knobs();

// Reads the environment variables again.
void reload_debug_knobs();

}  // namespace fused_pool_gelu
