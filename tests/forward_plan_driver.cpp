// Prints the plan csrc/cuda/forward_plan.h makes for each problem read from stdin, for
// tests/test_forward_plan.py (which compiles this file against the source tree's csrc/).
//
// argv: the device limits, as DeviceLimits's fields in order: sms, the SIMT GEMV's CTAs per SM for
// each batch tile (5 numbers), tc_gemv, tc, wgmma, epilogue_one_split CTAs per SM, smem_per_sm,
// spread_smem_max, dependent_launch (0 / 1).
// stdin, one problem per line: batch n k operands(f32 | half) prepared(0 / 1) scale
// unit_column_strides(0 / 1) certified_knob(auto | 1 | 0) force_mma_sync(0 / 1).
// stdout, one line per problem: key=value pairs (the path, then what that path plans for the first
// slice of rows).
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>

#include "cuda/forward_plan.h"

using namespace fused_pool_gelu;
using namespace fused_pool_gelu::cuda;

namespace {

const char* gemm_kind(GemmPlan::Kind kind) {
  switch (kind) {
    case GemmPlan::Kind::kRowwise: return "rowwise";
    case GemmPlan::Kind::kSimt: return "simt";
    case GemmPlan::Kind::kTcGemv: return "tc_gemv";
    case GemmPlan::Kind::kTc: return "tc";
  }
  return "?";
}

// The epilogue's plan with the workspace and the bias aligned for 16-byte loads where N % 4 == 0.
void print_epilogue(const DeviceLimits& limits, int64_t rows, int64_t n, int64_t splits,
                    bool slices_of_k) {
  const EpiloguePlan e = plan_epilogue(limits, rows, n, splits, slices_of_k, n % 4 == 0);
  std::cout << " epilogue_threads_per_row=" << e.threads_per_row
            << " epilogue_columns_per_load=" << e.columns_per_load
            << " epilogue_split_bound=" << e.split_bound;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 1 + 1 + fg::kNumSimtBatchTiles + 7) {
    std::fprintf(stderr, "usage: %s <%d device limits>\n", argv[0], fg::kNumSimtBatchTiles + 8);
    return 2;
  }
  DeviceLimits limits;
  int arg = 1;
  limits.sms = std::atoi(argv[arg++]);
  for (int i = 0; i < fg::kNumSimtBatchTiles; ++i) limits.simt_ctas_per_sm[i] = std::atoi(argv[arg++]);
  limits.tc_gemv_ctas_per_sm = std::atoi(argv[arg++]);
  limits.tc_ctas_per_sm = std::atoi(argv[arg++]);
  limits.wgmma_ctas_per_sm = std::atoi(argv[arg++]);
  limits.epilogue_one_split_ctas_per_sm = std::atoi(argv[arg++]);
  limits.smem_per_sm = std::atoi(argv[arg++]);
  limits.spread_smem_max = std::atoi(argv[arg++]);
  limits.dependent_launch = std::atoi(argv[arg++]) != 0;

  std::string line;
  while (std::getline(std::cin, line)) {
    if (line.empty()) continue;
    std::istringstream in(line);
    ForwardProblem p;
    std::string operands, certified;
    int prepared = 0, unit = 1, force = 0;
    in >> p.batch >> p.n >> p.k >> operands >> prepared >> p.scale >> unit >> certified >> force;
    if (!in) {
      std::fprintf(stderr, "cannot parse: %s\n", line.c_str());
      return 2;
    }
    p.operands = operands == "half" ? Operands::kHalf : Operands::kFloat32;
    p.prepared = prepared != 0;
    p.unit_column_strides = unit != 0;
    DebugKnobs knobs;
    knobs.certified = certified == "1"   ? CertifiedMode::kAlways
                      : certified == "0" ? CertifiedMode::kNever
                                         : CertifiedMode::kAuto;
    knobs.force_mma_sync = force != 0;

    const int64_t k_padded = padded_k(p.k);
    switch (plan_path(limits, knobs, p)) {
      case ForwardPath::kNoGemm:
        std::cout << "path=no_gemm";
        print_epilogue(limits, p.batch, p.n, 0, false);
        break;
      case ForwardPath::kHalfGemm: {
        const int64_t rows = rows_per_slice(p.batch, p.n);
        const int64_t splits = half_gemm_splits(limits, p, rows);
        std::cout << "path=half_gemm slice_rows=" << rows << " splits=" << splits;
        print_epilogue(limits, rows, p.n, splits, true);
        break;
      }
      case ForwardPath::kCertified: {
        const CertifiedPlan c = plan_certified(limits, p.batch, p.n, k_padded);
        std::cout << "path=certified fused_rows=" << c.fused_rows << " block_m=" << c.block_m
                  << " block_n=" << c.block_n << " splits=" << c.splits
                  << " k_per_split=" << c.k_per_split;
        break;
      }
      case ForwardPath::kSplitK: {
        const int64_t rows = rows_per_slice(p.batch, p.n);
        const bool rowwise = use_rowwise(limits, rows, p.n);
        const GemmPlan g = plan_gemm(limits, knobs, rowwise, rows, p.n, k_padded,
                                     workspace_split_cap(rows, p.n));
        std::cout << "path=split_k slice_rows=" << rows << " gemm=" << gemm_kind(g.kind);
        if (g.kind == GemmPlan::Kind::kTc) std::cout << " wgmma=" << g.tc.wgmma;
        if (g.kind == GemmPlan::Kind::kSimt) std::cout << " batch_tile=" << g.simt.batch_tile;
        std::cout << " splits=" << g.splits;
        print_epilogue(limits, rows, p.n, g.splits, false);
        break;
      }
    }
    std::cout << "\n";
  }
  return 0;
}
