"""The shape grid: the forward on folded weights at every K x N x B, ours against the peers.

    python benchmarks/bench_grid.py                           # the whole grid (one GPU call)
    python benchmarks/bench_grid.py --K 1024 4096             # a piece: rows merge into one file
    python benchmarks/bench_grid.py --K 8192 16384            # the other piece
    python benchmarks/bench_grid.py --device cpu --K 1024 --N 8 --batches 1 16 --skip-compile

Grid: K in {1024, 4096, 8192, 16384}, N = O / k in {8, 64, 512, 4096}, B in {1, 16, 128, 1024,
8192}, float32, k = 16, s = 2.0, x ~ torch.rand; plus the default shape (K = 8192, N = 512) in
bfloat16 at the default batches. Impls, as bench_forward.py defines them: ours_op (the forward
op with a prepared weight), fold_tail, fold_eager and fold_compile (compiled once per shape with
a dynamic batch dimension unless --compile-static), all on the folded weights of Model(K, O, k, s)
after torch.manual_seed(seed). Each shape is one common.run_benchmark run; shapes go from the
smallest weight to the largest, and every row is saved as it is measured.

The un-pooled [O, K] weight never reaches the device: it is folded there in slices of rows. The
float64 reference is the folded computation in float64 (the fold is an identity: the Model's
float64 output up to float64 rounding), and allclose_ref compares with it. A point whose
estimated device memory exceeds --memory-budget-gib, or that a run reaches past --deadline-s, is
written as skipped and named in the output. Results: benchmarks/results/<gpu>-grid.json, and the
.md (per-shape tables, the summary) and .png (speedup heatmap) that plot.py writes from it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import bench_forward
import common
import plot

GRID_K = [1024, 4096, 8192, 16384]
GRID_N = [8, 64, 512, 4096]
GRID_BATCHES = [1, 16, 128, 1024, 8192]
GRID_POOL, GRID_SCALE = 16, 2.0
DEFAULT_K, DEFAULT_N = 8192, 512  # the default shape, the one also run in bfloat16
DTYPES = ("float32", "bfloat16")

RUN_ORDER = ["ours_op", "fold_tail", "fold_eager", "fold_compile"]  # compiling last
IMPLS = [i for i in common.IMPL_ORDER if i in RUN_ORDER]

# do_bench's warm-up and repetition times (ms): a quarter and two fifths of bench_forward.py's
# 100 / 500, so that the grid's ~340 measurements and ~32 compiles fit one ~8-minute GPU call.
GRID_WARMUP_MS, GRID_REP_MS = 25.0, 200.0
# Stop starting new measurements this long after the start: leaves an 8-minute call time for
# the pair in flight (a compile of up to ~30 s) and the report.
GRID_DEADLINE_S = 420.0
# Rows of the un-pooled weight moved to the device and folded at a time: 2^26 floats (256 MiB).
FOLD_SLICE_FLOATS = 2**26


class GridContext(common.Context):
    """A shape's Context holding folded weights only: ours' (fused_pool_gelu.fold), the peers'
    (torch_fold) and float64 ones for the reference, folded on the device slice by slice."""

    def build_master(self):
        import fused_pool_gelu

        model = self.seeded_model()
        weight, bias = model.matmul.weight.detach(), model.matmul.bias.detach()
        rows = self.k * max(1, FOLD_SLICE_FLOATS // (self.k * self.K))
        ours, peers, ref64 = [], [], []
        for start in range(0, self.N * self.k, rows):
            w = weight[start:start + rows].to(self.device, self.dtype)
            b = bias[start:start + rows].to(self.device, self.dtype)
            ours.append(fused_pool_gelu.fold(w, b, self.k))
            peers.append(self.torch_fold(w, b))
            ref64.append(self.torch_fold(w.double(), b.double()))
        del model, weight, bias

        def joined(parts):
            return tuple(torch.cat(tensors).contiguous() for tensors in zip(*parts))

        self._ours, self._peers, self._ref64 = joined(ours), joined(peers), joined(ref64)
        return None  # no Model on the device

    def reference_model64(self):
        weight64, bias64 = self._ref64
        self._ref64 = None  # freed with the returned function, once the references are made
        folded_forward = self.folded_forward_fn()
        return lambda x64: folded_forward(x64, weight64, bias64)

    def pooled_for_peers(self):
        return self._peers

    def pooled_for_ours(self):
        return self._ours


def make_reference(ctx, model64, x):
    out64 = model64(x.double())
    # bench_forward.measure's allclose_ref then compares with float64 (the float32 Model is not
    # run: it needs the un-pooled weight).
    return {"out64": out64, "out_ref": out64}


def point_bytes(batch: int, K: int, N: int, dtype: str) -> int:
    """Device memory of one point, estimated: x and its float64 copy, the [B, N] products
    (a peer's in float32, the reference's in float64), the folded weights (ours, the peers',
    float64, ours' prepared 2-byte copy)."""
    size = torch.tensor([], dtype=common.torch_dtype(dtype)).element_size()
    return batch * K * (size + 8) + batch * N * (4 + 8) + N * K * (2 * size + 8 + 2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--K", type=int, nargs="+", default=GRID_K, help="in_features")
    p.add_argument("--N", type=int, nargs="+", default=GRID_N, help="pooled features O / k")
    p.add_argument("--batches", type=int, nargs="+", default=None,
                   help=f"B (default: {GRID_BATCHES}; bfloat16: {common.DEFAULT_BATCHES})")
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES),
                   help=f"bfloat16 runs the default shape only (K = {DEFAULT_K}, N = {DEFAULT_N})")
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=None,
                   help="default: all that apply (fold_tail: float32 on CUDA)")
    p.add_argument("--skip-compile", action="store_true", help="leave out fold_compile")
    p.add_argument("--compile-static", action="store_true",
                   help="compile fold_compile once per B instead of once with a dynamic batch")
    p.add_argument("--warmup", type=float, default=GRID_WARMUP_MS, help="ms per measurement")
    p.add_argument("--rep", type=float, default=GRID_REP_MS, help="ms per measurement")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline-s", type=float, default=GRID_DEADLINE_S,
                   help="start no measurement past this many seconds (0: no deadline); the "
                        "points left are written as skipped")
    p.add_argument("--memory-budget-gib", type=float, default=16.0,
                   help="skip points whose estimated device memory (point_bytes) exceeds this")
    p.add_argument("--out", type=Path, default=None,
                   help="results JSON to merge into (default: benchmarks/results/<gpu>-grid.json)")
    p.add_argument("--no-save", action="store_true", help="print only, write no results file")
    return p.parse_args(argv)


def grid_shapes(args):
    """(K, N, dtype, batches) in run order: float32 from the smallest weight up, then bfloat16."""
    shapes = []
    if "float32" in args.dtypes:
        batches = args.batches or GRID_BATCHES
        pairs = sorted(((K, N) for K in args.K for N in args.N), key=lambda s: (s[0] * s[1], s))
        shapes += [(K, N, "float32", batches) for K, N in pairs]
    if "bfloat16" in args.dtypes and DEFAULT_K in args.K and DEFAULT_N in args.N:
        shapes.append((DEFAULT_K, DEFAULT_N, "bfloat16", args.batches or common.DEFAULT_BATCHES))
    return shapes


def shape_args(args, K, N, dtype, batches):
    """The namespace common.run_benchmark takes, through common.parse_args (its defaults, its
    checks, its choice of impls for the device and dtype)."""
    argv = ["--device", str(args.device), "-K", str(K), "-O", str(N * GRID_POOL),
            "-k", str(GRID_POOL), "--scale", str(GRID_SCALE), "--dtype", dtype,
            "--batches", *map(str, batches), "--warmup", str(args.warmup), "--rep", str(args.rep),
            "--seed", str(args.seed), "--deadline-s", str(args.deadline_s)]
    argv += ["--impls", *args.impls] if args.impls else []
    argv += [] if args.compile_static else ["--compile-dynamic"]
    argv += ["--skip-compile"] if args.skip_compile else []
    argv += ["--no-save"] if args.no_save else ["--out", str(args.out)]
    return common.parse_args("forward", IMPLS, args.deadline_s, argv)


def write_skipped(args, K, N, dtype, batches, reason, run_meta):
    """Rows for points not measured, so that no older run's row stands in for them."""
    shape_ns = shape_args(args, K, N, dtype, batches)
    shape = {"K": K, "O": N * GRID_POOL, "k": GRID_POOL, "scale": GRID_SCALE, "dtype": dtype,
             "x": common.DEFAULT_SHAPE["x"], "launch": "eager"}
    rows = [dict(impl=impl, mode="forward", B=b, **shape, date=run_meta["run_id"],
                 run_id=run_meta["run_id"], median_us=None, error=f"{common.SKIPPED} ({reason})")
            for impl in shape_ns.impls for b in batches]
    common.log(f"K={K} N={N} {dtype} B={batches}: {common.SKIPPED} ({reason})")
    if not args.no_save:
        header = {"device": common.device_name(args.device), "date": run_meta["run_id"],
                  "torch": torch.__version__}
        common.merge_rows(args.out, rows, header, "forward", run_meta)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.device = common.resolve_device(args.device)
    args.out = args.out or common.default_results_path(args.device, common.GRID_SUFFIX)
    start = time.perf_counter()
    budget = args.memory_budget_gib * 2**30
    skip_meta = {"run_id": common.now_iso() + " (not run)", "argv": sys.argv[1:],
                 "git": common.git_revision(), "memory_budget_gib": args.memory_budget_gib}
    status = 0
    for K, N, dtype, batches in grid_shapes(args):
        over = [b for b in batches if point_bytes(b, K, N, dtype) > budget]
        if over:
            need = max(point_bytes(b, K, N, dtype) for b in over) / 2**30
            write_skipped(args, K, N, dtype, over, f"memory: {need:.1f} GiB estimated, over "
                          f"--memory-budget-gib {args.memory_budget_gib:g}", skip_meta)
            batches = [b for b in batches if b not in over]
        if not batches:
            continue
        if args.deadline_s and time.perf_counter() - start > args.deadline_s:
            write_skipped(args, K, N, dtype, batches,
                          f"past --deadline-s {args.deadline_s:g}", skip_meta)
            continue
        common.log(f"=== K={K} N={N} (O={N * GRID_POOL}) {dtype} B={batches}", start)
        with torch.no_grad():
            status |= common.run_benchmark(
                "forward", shape_args(args, K, N, dtype, batches), bench_forward.BUILDERS,
                RUN_ORDER, make_reference, bench_forward.measure, make_context=GridContext,
                deadline_from=start)
    if not args.no_save and args.out.exists():
        data = common.load_results(args.out)
        report = plot.write_grid_report(data, args.out)
        print(report)
    common.log("grid done", start)
    return status


if __name__ == "__main__":
    sys.exit(main())
