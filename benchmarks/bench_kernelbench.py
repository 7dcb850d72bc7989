"""ModelNew and the reference Model timed as KernelBench's evaluator times them, next to do_bench.

    python benchmarks/bench_kernelbench.py                    # level 2 #98: B = 1024, K = O = 8192
    python benchmarks/bench_kernelbench.py --device cpu -B 4 -K 64 -O 64 -k 4 --trials 5

KernelBench's procedure, as its scripts/eval_from_generations.py runs it (src/kernelbench/eval.py,
eval_kernel_against_ref with seed 42, 5 correctness trials, 100 performance trials, timing method
"cuda_event"; src/kernelbench/timing.py, time_execution_with_cuda_event):
  1. set_seed(42) (torch.manual_seed and torch.cuda.manual_seed), then Model(K, O, k, s) and, after
     set_seed(42) again, ModelNew(K, O, k, s), both on the CPU under no_grad (the same parameters),
     then moved to the device.
  2. Correctness: 5 trials under no_grad, x = torch.rand(B, K) from each trial's seed, Model and
     ModelNew allclose (atol = rtol = 1e-4).
  3. Timing with grad enabled (the parameters require grad; nothing wraps the calls in no_grad):
     x = torch.rand(B, K) after set_seed(42); 3 warm-up calls, each synchronized;
     torch.cuda.empty_cache(); 101 trials, the first discarded, each: synchronize; a 256 MB int64
     tensor allocated, filled and freed (the L2 flush); CUDA events recorded around one call;
     synchronize. Reported: mean, std, min and max of the 100, each rounded to 3 significant digits.
  4. The reference Model timed the same way; speedup = its mean / ModelNew's, flagged as an
     "excessive speedup" above 10x.
The same process also times both under no_grad, and both ways with triton.testing.do_bench's
median (fused_pool_gelu.measure.make_timer, the other benchmarks' timer). On the CPU (for testing
the script) a trial is wall-clock time without a flush. Results (each run replaces them), with the
device, torch, date and commit: benchmarks/results/<gpu>-kernelbench.json and .md.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import common
import fused_pool_gelu
from fused_pool_gelu.measure import ALLCLOSE_TOL, make_timer, relative_error

# KernelBench's constants (eval.py, timing.py, scripts/eval_from_generations.py).
KB_SEED = 42
KB_CORRECT_TRIALS = 5
KB_PERF_TRIALS = 100
KB_WARMUP_CALLS = 3
KB_DISCARD_FIRST = 1
KB_EXCESSIVE_SPEEDUP = 10.0
KB_FLUSH_SHAPE = (32, 1024, 1024)  # int64: 256 MB, written with fill_(42)
# Level 2 #98's get_inputs and get_init_inputs: x = torch.rand(1024, 8192);
# Model(8192, 8192, 16, 2.0).
KB_SHAPE = dict(B=1024, K=8192, O=8192, k=16, scale=2.0)
SUFFIX = "-kernelbench"


def set_seed(seed: int) -> None:
    """KernelBench's set_seed."""
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kernelbench_times_ms(model, x, device, trials: int):
    """time_execution_with_cuda_event: ms per trial, the first KB_DISCARD_FIRST left out."""
    for _ in range(KB_WARMUP_CALLS):
        model(x)
        synchronize(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    times = []
    out = None  # held until the next trial's call, as KernelBench's `_ = kernel_fn(*args)` is
    for trial in range(trials + KB_DISCARD_FIRST):
        synchronize(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            flush = torch.empty(KB_FLUSH_SHAPE, dtype=torch.int64, device=device)
            flush.fill_(42)
            del flush
            start.record()
            out = model(x)
            end.record()
            synchronize(device)
            elapsed_ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            out = model(x)
            elapsed_ms = (time.perf_counter() - t0) * 1e3
        if trial >= KB_DISCARD_FIRST:
            times.append(elapsed_ms)
    del out
    return times


def kernelbench_stats(times_ms):
    """get_timing_stats: mean, std (population), min, max in ms, each to 3 significant digits."""
    def rounded(v):
        return float(f"{v:.3g}")

    return {"mean": rounded(statistics.fmean(times_ms)),
            "std": rounded(statistics.pstdev(times_ms)),
            "min": rounded(min(times_ms)), "max": rounded(max(times_ms)),
            "num_trials": len(times_ms), "mean_unrounded": statistics.fmean(times_ms)}


def build_models(args, device):
    """Model and ModelNew as eval_kernel_against_ref builds them: the same seed, no_grad, CPU."""
    init_inputs = [args.in_features, args.out_features, args.pool, args.scale]
    set_seed(KB_SEED)
    with torch.no_grad():
        set_seed(KB_SEED)
        reference = fused_pool_gelu.Model(*init_inputs)
    with torch.no_grad():
        set_seed(KB_SEED)
        model_new = fused_pool_gelu.ModelNew(*init_inputs)
        reference = reference.to(device=device, dtype=torch.float32)
        model_new = model_new.to(device=device, dtype=torch.float32)
    return reference, model_new


def correctness_trials(reference, model_new, args, device):
    """run_and_check_correctness: how many of KB_CORRECT_TRIALS inputs pass allclose."""
    torch.manual_seed(KB_SEED)
    seeds = [torch.randint(0, 2**32 - 1, (1,)).item() for _ in range(KB_CORRECT_TRIALS)]
    tol = ALLCLOSE_TOL["float32"]
    passed = 0
    with torch.no_grad():
        for seed in seeds:
            set_seed(seed)
            x = torch.rand(args.batch, args.in_features).to(device)
            passed += bool(torch.allclose(reference(x), model_new(x), atol=tol, rtol=tol))
    return passed


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--batch", "-B", type=int, default=KB_SHAPE["B"])
    p.add_argument("--in-features", "-K", type=int, default=KB_SHAPE["K"])
    p.add_argument("--out-features", "-O", type=int, default=KB_SHAPE["O"])
    p.add_argument("--pool", "-k", type=int, default=KB_SHAPE["k"])
    p.add_argument("--scale", type=float, default=KB_SHAPE["scale"])
    p.add_argument("--trials", type=int, default=KB_PERF_TRIALS, help="KernelBench's trials")
    p.add_argument("--warmup", type=float, default=100.0, help="do_bench warm-up (ms)")
    p.add_argument("--rep", type=float, default=500.0, help="do_bench repetition time (ms)")
    p.add_argument("--out", type=Path, default=None,
                   help="results JSON (default: benchmarks/results/<gpu>-kernelbench.json)")
    p.add_argument("--no-save", action="store_true", help="print only, write no results file")
    args = p.parse_args(argv)
    args.device = common.resolve_device(args.device)
    return args


def reference64_output(reference, x):
    """The float64 reference: a float64 copy of Model on x."""
    with torch.no_grad():
        return copy.deepcopy(reference).to(torch.float64)(x.double())


def measure(args, start):
    """KernelBench's checks and timings, and do_bench's, in one process: (rows, correct trials,
    the do_bench timer's description)."""
    device = args.device
    reference, model_new = build_models(args, device)
    passed = correctness_trials(reference, model_new, args, device)
    common.log(f"correctness as KernelBench checks it: {passed} of {KB_CORRECT_TRIALS}", start)
    set_seed(KB_SEED)
    x = torch.rand(args.batch, args.in_features).to(device)
    out64 = reference64_output(reference, x)
    time_us, timer = make_timer(device, args.warmup, args.rep)
    rows = []
    # KernelBench's own measurements first (ModelNew, then Model, grad enabled), then the rest.
    for grad in ("enabled", "no_grad"):
        for impl, model in (("ModelNew", model_new), ("Model", reference)):
            with contextlib.nullcontext() if grad == "enabled" else torch.no_grad():
                stats = kernelbench_stats(kernelbench_times_ms(model, x, device, args.trials))
                median_us = time_us(lambda: model(x))  # noqa: B023 - called here, in the loop
                out = model(x)
            rows.append({"impl": impl, "grad": grad, "kernelbench_ms": stats,
                         "do_bench_median_us": median_us,
                         "rel_err_fp64": common.finite_or_none(relative_error(out, out64))})
            common.log(f"{impl}, grad {grad}: KernelBench mean {stats['mean']} ms, do_bench "
                       f"median {median_us:.1f} us, rel_err {_fmt_err(rows[-1]['rel_err_fp64'])}",
                       start)
            del out
    return rows, passed, timer


def _fmt_err(err) -> str:
    return "not finite" if err is None else f"{err:.1e}"


def speedups(rows):
    """Per grad mode: KernelBench's (its rounded means) and do_bench's, Model / ModelNew."""
    by = {(r["impl"], r["grad"]): r for r in rows}
    result = {}
    for grad in ("enabled", "no_grad"):
        ref, new = by[("Model", grad)], by[("ModelNew", grad)]
        result[grad] = {
            "kernelbench": ref["kernelbench_ms"]["mean"] / new["kernelbench_ms"]["mean"],
            "do_bench": ref["do_bench_median_us"] / new["do_bench_median_us"],
        }
    return result


def markdown(data) -> str:
    meta, rows = data["meta"], data["rows"]
    shape = meta["shape"]
    lines = [
        "<!-- generated by benchmarks/bench_kernelbench.py; rerun it, do not edit -->",
        f"**{data['device']}**, {data['date'][:10]}, torch {data['torch']}, git {meta['git']}: "
        "KernelBench's timing (benchmarks/bench_kernelbench.py)",
        "",
        f"B = {shape['B']}, K = {shape['K']}, O = {shape['O']}, k = {shape['k']}, "
        f"s = {shape['scale']}, float32, x = torch.rand after set_seed({KB_SEED}). KernelBench: "
        f"{meta['trials']} trials, {meta['kernelbench_timer']}; mean, std, min, max in ms to 3 "
        f"significant digits, as it reports them. do_bench: {meta['do_bench']}.",
        "",
        "| grad | impl | KernelBench mean (ms) | std | min | max | do_bench median (us) "
        "| rel. error vs float64 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        st = r["kernelbench_ms"]
        grad = "enabled (KernelBench's)" if r["grad"] == "enabled" else "off (no_grad)"
        lines.append(f"| {grad} | {r['impl']} | {st['mean']:g} | {st['std']:g} | {st['min']:g} "
                     f"| {st['max']:g} | {r['do_bench_median_us']:.1f} | "
                     f"{_fmt_err(r['rel_err_fp64'])} |")
    lines.append("")
    for grad, s in data["speedups"].items():
        flag = ("above" if s["kernelbench"] > KB_EXCESSIVE_SPEEDUP else "not above")
        mode = "grad enabled" if grad == "enabled" else "under no_grad"
        lines.append(f"- Speedup Model / ModelNew, {mode}: KernelBench "
                     f"{s['kernelbench']:.2f}x ({flag} its {KB_EXCESSIVE_SPEEDUP:g}x "
                     f"\"excessive speedup\" flag), do_bench {s['do_bench']:.2f}x.")
    lines.append(f"- Correctness as KernelBench checks it: {data['correct_trials']} of "
                 f"{KB_CORRECT_TRIALS} trials allclose (atol = rtol = "
                 f"{ALLCLOSE_TOL['float32']:g}).")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    rows, passed, timer = measure(args, start)
    date = common.now_iso()
    info = fused_pool_gelu.build_info()
    data = {
        "device": common.device_name(args.device), "date": date, "torch": torch.__version__,
        "meta": {
            "git": common.git_revision(), "torch_cuda": torch.version.cuda,
            "python": platform.python_version(), "fused_pool_gelu": info, "argv": sys.argv[1:],
            "shape": {"B": args.batch, "K": args.in_features, "O": args.out_features,
                      "k": args.pool, "scale": args.scale},
            "trials": args.trials, "do_bench": timer, "warmup_ms": args.warmup,
            "rep_ms": args.rep,
            "kernelbench_timer": ("CUDA events around each call after a 256 MB fill" if
                                  args.device.type == "cuda" else "wall clock, no flush (CPU)"),
        },
        "correct_trials": passed,
        "rows": rows,
        "speedups": speedups(rows),
    }
    md = markdown(data)
    print(md)
    if not args.no_save:
        path = args.out or common.default_results_path(args.device, SUFFIX)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1) + "\n")
        path.with_suffix(".md").write_text(md)
        common.log(f"wrote {path} and {path.with_suffix('.md').name}", start)
    ours_ok = passed == KB_CORRECT_TRIALS and all(
        r["rel_err_fp64"] is not None and r["rel_err_fp64"] <= common.ACCURATE_REL_ERR
        for r in rows if r["impl"] == "ModelNew")
    if not ours_ok:
        common.log("ERROR: ModelNew failed KernelBench's correctness check or is not accurate",
                   start)
    return 0 if ours_ok else 1


if __name__ == "__main__":
    sys.exit(main())
