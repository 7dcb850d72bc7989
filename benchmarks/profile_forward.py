"""Where the forward's time goes: device time per kernel (torch.profiler), L2 flushed per call.

    python benchmarks/profile_forward.py                # B in {1, 16, 32, 64, 128, 1024, 4096}
    python benchmarks/profile_forward.py --batches 1024 --out /tmp/profile.json
    python benchmarks/profile_forward.py --paths certified --prepared both --batches 1024 4096
    python benchmarks/profile_forward.py --paths 3xtf32 --batches 513 --shapes 1024x512 8192x128
    python benchmarks/profile_forward.py --dtype bfloat16 --batches 512 1024 4096

For each batch size and each path (--paths; "default": what the op picks on this GPU, wgmma on an
sm_90a build on Hopper: the certified path from 513 rows, 257 with --prepared, on weights large
enough (docs/design.md), 3xTF32 elsewhere;
"mma_sync": the portable kernel, FUSED_POOL_GELU_FORCE_MMA_SYNC=1; "certified" / "3xtf32": the
certified single pass forced on / off, FUSED_POOL_GELU_CERTIFIED=1 / 0), prints every kernel the op
launches with its own time / device time (common.kernel_device_times: on sm_90+ the kernels after
the GEMM are programmatic dependent launches, which start while the one before runs and wait for it;
their device time holds the wait, their own time does not), the sum of the own times, and the call's
median (fused_pool_gelu.measure, as bench_forward.py). Data: the benchmarks' (bench_forward.py): the
folded weights of Model(K, 16 N, 16, 2.0) after torch.manual_seed(0), x ~ U(0, 1) seeded with B;
shape K = 8192, N = 512 by default (-K, -N), or several in one process (--shapes KxN ...). The
certified path's speed depends on the data (how many columns each row rescores): its rows also print
the candidates per row (`_certified_candidate_counts`). --dtype bfloat16 / float16 casts the weights
and x (the half path: cuBLAS's GEMM with a float32 result, then the epilogue; the path switches do
not apply to it, and there is no prepared weight).
"""

from __future__ import annotations

import argparse

import torch

import common
import fused_pool_gelu
from fused_pool_gelu._debug import KNOBS, debug_knobs
from fused_pool_gelu.measure import make_timer

# The debug knobs of each path (fused_pool_gelu._debug).
PATHS = {
    "default": {},
    "mma_sync": {"FUSED_POOL_GELU_FORCE_MMA_SYNC": "1"},
    "certified": {"FUSED_POOL_GELU_CERTIFIED": "1"},
    "3xtf32": {"FUSED_POOL_GELU_CERTIFIED": "0"},
}


POOL = 16  # the benchmarks' pooling window


def profile(x, weight, bias, calls, prepared_weight=None):
    """Returns ({kernel: {"device_us", "own_us"}}, median time of the whole call, us)."""

    def call():
        with torch.no_grad():
            fused_pool_gelu.forward(x, weight, bias, 2.0, prepared_weight)

    time_us, _ = make_timer(torch.device("cuda"), warmup_ms=100, rep_ms=500)
    return common.kernel_device_times(call, calls), time_us(call)


def candidate_counts(x, weight, bias):
    """The certified selection's candidates per row: mean and max over the rows it kept, and the
    rows it sent to whole rescoring."""
    counts = torch.ops.fused_pool_gelu._certified_candidate_counts(x, weight, bias, 2.0)
    kept = counts[counts >= 0].float()
    return {"mean": float(kept.mean()) if kept.numel() else None,
            "max": int(kept.max()) if kept.numel() else None,
            "whole_rows": int((counts < 0).sum())}


def short_name(name):
    for known in ("wgmma_splitk", "tf32x3_splitk", "simt_splitk", "argmax_epilogue",
                  "prepare_rows", "certified_pass1", "select_candidates", "rescore_kernel"):
        if known in name:
            return known
    return name[:40]


def shape(text):
    """'KxN' -> (K, N), both positive."""
    try:
        k, n = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is KxN, e.g. 8192x512, got '{text}'") from None
    if k <= 0 or n <= 0:
        raise argparse.ArgumentTypeError(f"K and N must be positive, got '{text}'")
    return k, n


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", nargs="+", choices=sorted(PATHS), default=None,
                        help="default: default and mma_sync in float32, default in a half dtype")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 32, 64, 128, 1024, 4096])
    parser.add_argument("-K", type=int, default=8192)
    parser.add_argument("-N", type=int, default=512)
    parser.add_argument("--shapes", type=shape, nargs="+", default=None, metavar="KxN",
                        help="several (K, N) shapes, in this order (instead of -K and -N)")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--prepared", choices=["no", "yes", "both"], default="no",
                        help="pass the weight's prepare_weight copy (made once) to every call")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="the operands' dtype (the weights and x cast to it)")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    if args.dtype != "float32" and args.prepared != "no":
        parser.error(f"--prepared {args.prepared}: prepare_weight takes float32 weights, "
                     f"got --dtype {args.dtype}")
    if args.paths is None:
        args.paths = ["default", "mma_sync"] if args.dtype == "float32" else ["default"]
    elif args.dtype != "float32" and args.paths != ["default"]:
        parser.error(f"--paths {' '.join(args.paths)}: the path switches select float32 "
                     f"kernels; a half dtype ({args.dtype}) takes the half path only (default)")
    dtype = getattr(torch, args.dtype)

    prepared_options = {"no": [False], "yes": [True], "both": [False, True]}[args.prepared]
    rows = []
    for k, n in args.shapes or [(args.K, args.N)]:
        if args.shapes:
            print(f"K = {k}, N = {n}", flush=True)
        weight, bias = (t.to(dtype) for t in common.folded_weights(k, n * POOL, POOL))
        prepared_weight = (fused_pool_gelu.prepare_weight(weight) if args.prepared != "no"
                           else None)
        for path in args.paths:
            # Exactly this path's knobs: the others unset.
            with debug_knobs(**{**dict.fromkeys(KNOBS), **PATHS[path]}):
                for batch in args.batches:
                    x = common.benchmark_x(batch, k, "cuda").to(dtype)
                    for prepared in prepared_options:
                        rows.append(profile_row(path, x, weight, bias, args.calls,
                                                prepared_weight if prepared else None))
    common.write_profile(args.out, rows)


def profile_row(path, x, weight, bias, calls, prepared_weight):
    """Profiles one call's configuration, prints its line and returns its row."""
    kernels, median = profile(x, weight, bias, calls, prepared_weight)
    total = sum(times["own_us"] for times in kernels.values())
    batch, k = x.shape
    prepared = prepared_weight is not None
    row = {"path": path, "B": batch, "K": k, "N": weight.shape[0], "prepared": prepared,
           "dtype": str(x.dtype).removeprefix("torch."), "kernels_us": kernels,
           "own_sum_us": total, "median_us": median}
    parts = ", ".join(f"{short_name(name)} {t['own_us']:.1f}/{t['device_us']:.1f}"
                      for name, t in kernels.items() if t["device_us"] > 0)
    label = path + ("+prep" if prepared else "") + ("" if row["dtype"] == "float32" else
                                                    "+" + row["dtype"])
    line = (f"{label:16s} B={batch:5d}: median {median:7.1f} us, own sum {total:7.1f} us"
            f"  (own/device: {parts})")
    if path == "certified" and x.dtype == torch.float32:
        counts = row["candidates"] = candidate_counts(x, weight, bias)
        mean = "-" if counts["mean"] is None else f"{counts['mean']:.2f}"
        line += (f"; candidates per row {mean} mean, {counts['max']} max,"
                 f" {counts['whole_rows']} rows whole")
    print(line, flush=True)
    return row


if __name__ == "__main__":
    main()
