"""Shared machinery of bench_forward.py, bench_train.py, plot.py and the profile_*.py scripts.

One process times every implementation ("impl") on the same weights and inputs:
  * CUDA: ``triton.testing.do_bench(fn, warmup, rep, return_mode="median")``, which flushes L2
    (256 MB memset) before every timed run, as KernelBench does. Without triton, an equivalent
    CUDA-event timer (same flush, same warm-up and repeat rule) is used and the results say so.
  * CPU: median of repeated ``time.perf_counter`` runs (for testing the scripts only).

Every impl is checked against a float64 run of the reference Model with the same weights
(``rel_err_fp64 = ||out - ref64|| / ||ref64||``, ``max_abs_err``; in training also each gradient's
``grad_rel_err_fp64``) and against the float32 Model (``allclose_ref`` with atol = rtol = 1e-4 in
float32): ``is_accurate`` says which rows count (ours unmarked, a peer eligible as the best one).
A speedup compares ours with the peers of the same run only.

Results are merged into ``benchmarks/results/<gpu>.json``:
    {"device", "date", "torch", "rows": [row, ...], "runs": {run_id: metadata}}
a row: {"impl", "mode", "B", "median_us", "rel_err_fp64", "max_abs_err", "peak_mem_mb" (train),
        ... plus K, O, k, scale, dtype, x, date, run_id, error}.
A new row replaces an old one with the same impl, mode, B and shape (K, O, k, scale, dtype, x); a
pair a run skipped (past its deadline) is written as such, so that no older run's row stands in.
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import gc
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, List, Optional

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"

# Display order (table columns, plot legend).
IMPL_ORDER = [
    "ref_eager", "ref_compile", "fold_eager", "fold_compile", "fold_tail", "ours_op", "ours_model"
]
PEERS = ("ref_eager", "ref_compile", "fold_eager", "fold_compile", "fold_tail")
OURS = ("ours_op", "ours_model")
COMPILED = ("ref_compile", "fold_compile")
# Float32 CUDA peers: left out of the default impls on the CPU and in half-type runs.
FLOAT32_CUDA_ONLY = ("fold_tail",)
MODES = ("forward", "train")

DEFAULT_BATCHES = [1, 16, 128, 1024, 4096]
# bench_grid.py's results file: <gpu>-grid.json, rendered by plot.py as a grid.
GRID_SUFFIX = "-grid"
DEFAULT_SHAPE = dict(K=8192, O=8192, k=16, scale=2.0, dtype="float32", x="rand", launch="eager")
# x's distribution (benchmark_x): torch.rand, KernelBench's inputs, or torch.randn. It moves the
# rows' arg-maxes (rand crowds them onto few columns), which ours' backward sees.
X_DISTRIBUTIONS = ("rand", "randn")
# How a timed call reaches the GPU: "eager" (the impl's Python and launches, each time), or
# "graph" (--cuda-graph: a CUDA-graph replay of the call or training step, the GPU's work alone,
# which a slow host cannot stretch). Part of a row's configuration: the two never replace each
# other, and each gets its own tables.
LAUNCHES = ("eager", "graph")

# A float32 row counts as "float32-accurate" (is_accurate) when its relative error against float64,
# and in training each gradient's, is at most this: above float32 GEMMs' ~3e-7 at the default shape
# (gradients ~1e-7), below single-pass TF32's ~1e-4.
ACCURATE_REL_ERR = 1e-5

# fused_pool_gelu.measure.ALLCLOSE_TOL (which the benchmarks check with), restated for plot.py's
# notes, which run without torch.
ALLCLOSE_TOL = {"float32": 1e-4, "float64": 1e-4, "bfloat16": 1e-2, "float16": 1e-2}

# The error field of a row a run did not measure (past its --deadline-s).
SKIPPED = "skipped"


def is_skipped(row: dict) -> bool:
    return (row.get("error") or "").startswith(SKIPPED)


# ----------------------------------------------------------------------------------------------
# Small utilities (no torch needed: plot.py uses them on a machine without a GPU)


def slug(name: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def log(message: str, start: Optional[float] = None) -> None:
    prefix = f"[{time.perf_counter() - start:7.1f}s] " if start is not None else ""
    print(prefix + message, flush=True)


def finite_or_none(value):
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def config_key(row: dict) -> tuple:
    """The configuration of a row's run: K, O, k, scale, dtype, x's distribution and the launch
    (rows from before those fields existed are x ~ rand, eager)."""
    return (row.get("K"), row.get("O"), row.get("k"), row.get("scale"), row.get("dtype"),
            row.get("x", DEFAULT_SHAPE["x"]), row.get("launch", DEFAULT_SHAPE["launch"]))


def row_key(row: dict) -> tuple:
    return (row["impl"], row["mode"], row["B"]) + config_key(row)


def impl_sort_key(name: str):
    return (IMPL_ORDER.index(name), name) if name in IMPL_ORDER else (len(IMPL_ORDER), name)


def is_accurate(row: dict, threshold: float = ACCURATE_REL_ERR) -> bool:
    """The row counts (ours unmarked, a peer eligible as the best one): measured; every output
    element close to the reference Model's in the same dtype (allclose_ref, ALLCLOSE_TOL: a single
    wrong row, which a batch-wide norm dilutes, fails it); and in float32 the output's relative
    error against float64 at most `threshold`, and in training each gradient's (weight, bias, x:
    a step that leaves one out fails)."""
    if row.get("median_us") is None or row.get("allclose_ref") is not True:
        return False
    if row.get("dtype", "float32") != "float32":
        return True
    errors = [row.get("rel_err_fp64")]
    if row.get("mode") == "train":
        grads = row.get("grad_rel_err_fp64") or {}
        errors += [grads.get(name) for name in ("weight", "bias", "x")]
    return all(err is not None and err <= threshold for err in errors)


# ----------------------------------------------------------------------------------------------
# Results file


# Field order of a row in the JSON file (other fields follow).
ROW_FIELDS = [
    "impl", "mode", "B", "median_us", "rel_err_fp64", "max_abs_err", "peak_mem_mb",
    "peak_mem_total_mb", "allclose_ref", "grad_rel_err_fp64", "first_call_s",
    "K", "O", "k", "scale", "dtype", "x", "launch", "date", "run_id", "error",
]


def normalize_row(row: dict) -> dict:
    """Canonical field order; the schema's fields present (None when not measured)."""
    row = dict(row)
    for key in ("median_us", "rel_err_fp64", "max_abs_err"):
        row.setdefault(key, None)
    if row.get("mode") == "train":
        row.setdefault("peak_mem_mb", None)
    ordered = {k: row[k] for k in ROW_FIELDS if k in row}
    ordered.update({k: v for k, v in row.items() if k not in ordered})
    return ordered


def load_results(path: Path) -> dict:
    path = Path(path)
    if path.exists():
        with open(path) as f:
            return json.load(f)
    return {"rows": []}


def merge_rows(path: Path, rows: List[dict], header: dict, mode: str, run_meta: dict) -> dict:
    """Merge ``rows`` into the results file at ``path`` (atomic replace) and return the data."""
    path = Path(path)
    data = load_results(path)
    data.update(header)
    new_keys = {row_key(r) for r in rows}
    kept = [r for r in data.get("rows", []) if row_key(r) not in new_keys]
    merged = [normalize_row(r) for r in kept + rows]
    merged.sort(
        key=lambda r: (
            MODES.index(r["mode"]) if r["mode"] in MODES else 9,
            tuple(str(v) for v in config_key(r)),
            r["B"],
            impl_sort_key(r["impl"]),
        )
    )
    data["rows"] = merged
    # Metadata of every run that still has rows, keyed by run_id (rows carry their run_id).
    runs = data.get("runs") if isinstance(data.get("runs"), dict) else {}
    runs[run_meta["run_id"]] = dict(run_meta, mode=mode)
    live = {r.get("run_id") for r in merged}
    data["runs"] = {k: v for k, v in sorted(runs.items()) if k in live}
    ordered = {k: data[k] for k in ("device", "date", "torch") if k in data}
    ordered.update({k: v for k, v in data.items() if k not in ordered})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(ordered, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return ordered


# ----------------------------------------------------------------------------------------------
# Markdown tables


def _fmt_us(us: Optional[float]) -> str:
    if us is None:
        return "-"
    return f"{us:.0f}" if us >= 10000 else f"{us:.1f}"


def _index(rows: List[dict]) -> Dict[tuple, dict]:
    return {(r["impl"], r["B"]): r for r in rows}


def _metric_table(impls, batches, index, key, fmt):
    """Markdown rows of one metric: a line per B, a column per impl, '-' where missing."""
    lines = ["| B | " + " | ".join(impls) + " |", "|" + "---|" * (len(impls) + 1)]
    for b in batches:
        cells = [str(b)]
        for impl in impls:
            row = index.get((impl, b))
            value = None if row is None else row.get(key)
            cells.append("-" if value is None else fmt.format(value))
        lines.append("| " + " | ".join(cells) + " |")
    return lines



def markdown_tables(rows: List[dict], mode: str, threshold: float = ACCURATE_REL_ERR) -> str:
    """Time table (+ speedup of ours over the best peer: float32-accurate in float32), accuracy
    table and, for training, peak memory. ``rows``: one mode, one shape (K, O, k, scale, dtype)."""
    rows = [r for r in rows if r["mode"] == mode]
    if not rows:
        return ""
    impls = sorted({r["impl"] for r in rows}, key=impl_sort_key)
    batches = sorted({r["B"] for r in rows})
    index = _index(rows)
    ours = [i for i in impls if i in OURS]
    peers = [i for i in impls if i in PEERS]
    out = []

    def best_peer(b, run_id):
        """The fastest accurate peer at B measured in run `run_id`, or None."""
        cands = [index[(p, b)] for p in peers if (p, b) in index]
        cands = [r for r in cands if r.get("run_id") == run_id and is_accurate(r, threshold)]
        return min(cands, key=lambda r: r["median_us"]) if cands else None

    # --- time
    header = ["B"] + [f"{i} (us)" for i in impls]
    if ours and peers:
        # In float32 the best peer is the best float32-accurate one (is_accurate).
        accurate = "fp32 " if rows[0].get("dtype", "float32") == "float32" else ""
        header += [f"best {accurate}peer of the run (us)"] + [f"{i} speedup" for i in ours]
    out.append("| " + " | ".join(header) + " |")
    out.append("|" + "---|" * len(header))
    any_inexact = False
    for b in batches:
        cells = [str(b)]
        for impl in impls:
            r = index.get((impl, b))
            if r is None:
                cells.append("-")
            elif r.get("median_us") is None:
                cells.append("skipped" if is_skipped(r) else "error" if r.get("error") else "-")
            else:
                mark = ""
                if not is_accurate(r, threshold):
                    mark, any_inexact = "*", True
                cells.append(_fmt_us(r["median_us"]) + mark)
        if ours and peers:
            ours_rows = [index[(i, b)] for i in ours if (i, b) in index]
            shown = best_peer(b, ours_rows[0].get("run_id")) if ours_rows else None
            cells.append(f"{_fmt_us(shown['median_us'])} ({shown['impl']})" if shown else "-")
            for impl in ours:
                r = index.get((impl, b))
                best = None if r is None else best_peer(b, r.get("run_id"))
                if best is None or r is None or r.get("median_us") is None:
                    cells.append("-")
                else:
                    mark = "" if is_accurate(r, threshold) else "*"
                    cells.append(f"{best['median_us'] / r['median_us']:.2f}x{mark}")
        out.append("| " + " | ".join(cells) + " |")
    if any_inexact:
        out.append("")
        out.append(
            f"\\* not accurate (is_accurate: relative error vs float64 above {threshold:g}, an "
            "element outside allclose of the reference Model, or in training a gradient missing "
            f"or above {threshold:g}): excluded from the best peer."
        )
    run_ids = sorted({r.get("run_id") for r in rows if r.get("run_id")})
    if len(run_ids) > 1:
        out.append("")
        out.append(
            f"Rows from {len(run_ids)} runs ({', '.join(run_ids)}): a speedup compares ours with "
            "the peers of its own run, '-' where that run timed none."
        )

    # --- accuracy
    out.append("")
    out.append(
        "Relative error ||out - ref64|| / ||ref64|| against float64"
        + (" (forward output of the step)" if mode == "train" else "")
        + ":"
    )
    out.append("")
    out.extend(_metric_table(impls, batches, index, "rel_err_fp64", "{:.1e}"))

    # --- memory a forward call allocates beyond what is resident
    if mode == "forward" and any(r.get("call_mem_mb") is not None for r in rows):
        out.append("")
        out.append("Memory one call allocates beyond inputs, weights and caches (MB):")
        out.append("")
        out.extend(_metric_table(impls, batches, index, "call_mem_mb", "{:.1f}"))

    # --- peak memory (train)
    if mode == "train" and any(r.get("peak_mem_mb") is not None for r in rows):
        out.append("")
        out.append("Peak memory of one step (MB: parameters + input + all the step allocates):")
        out.append("")
        out.extend(_metric_table(impls, batches, index, "peak_mem_mb", "{:.0f}"))

    errors = [r for r in rows if r.get("error")]
    if errors:
        out.append("")
        for r in sorted(errors, key=lambda r: (impl_sort_key(r["impl"]), r["B"])):
            out.append(f"- {r['impl']} B={r['B']}: {r['error'].splitlines()[0][:200]}")
    return "\n".join(out)


def shape_text(row: dict) -> str:
    graph = row.get("launch", DEFAULT_SHAPE["launch"]) == "graph"
    return (
        f"K = {row.get('K')}, O = {row.get('O')}, k = {row.get('k')}, s = {row.get('scale')}, "
        f"{row.get('dtype')}, x ~ {row.get('x', DEFAULT_SHAPE['x'])}"
        + (", CUDA-graph replays" if graph else "")
    )


# ----------------------------------------------------------------------------------------------
# Everything below needs torch.


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def cpu_model() -> str:
    """The host CPU's model name (/proc/cpuinfo), or platform's word for it."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def default_results_path(device, suffix: str = "") -> Path:
    """benchmarks/results/<gpu><suffix>.json (suffix: GRID_SUFFIX for bench_grid.py's file)."""
    return RESULTS_DIR / f"{slug(device_name(device))}{suffix}.json"


def git_revision() -> Optional[str]:
    """The commit named by FUSED_POOL_GELU_GIT_REVISION when set (the GPU machine's copy of the
    tree carries stale git metadata, so the caller names the commit it copied); else the
    checkout's commit (+dirty), or None outside a git checkout."""
    override = os.environ.get("FUSED_POOL_GELU_GIT_REVISION")
    if override:
        return override
    try:
        rev = subprocess.run(
            ["git", "-C", str(BENCH_DIR), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=10,
        )
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(BENCH_DIR), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=10,
        )
        return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except Exception:
        return None


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def cuda_graph_call(fn: Callable[[], object]) -> Callable[[], object]:
    """fn captured as a CUDA graph (fused_pool_gelu.measure.capture_cuda_graph); returns a callable
    that replays the graph and returns the output tensor the capture made, which every replay
    overwrites."""
    from fused_pool_gelu.measure import capture_cuda_graph

    graph, out = capture_cuda_graph(fn)

    def replay():
        graph.replay()
        return out

    return replay


def kernel_device_times(fn: Callable[[], None], calls: int,
                        warmup: int = 5) -> Dict[str, Dict[str, float]]:
    """Per CUDA kernel that fn launches, its mean device time per call ("device_us") and the part
    of it after the kernel before it ended ("own_us"), over `calls` calls with L2 flushed before
    each one as do_bench does (torch.profiler; the flush's own kernel is left out: the first
    kernel of the profile is the first flush, and its launches are counted, so that fn's kernels
    of the same name, if any, make this raise instead of vanishing).

    On sm_90+ the forward's later kernels are programmatic dependent launches: they start while
    the kernel before them runs and wait for it, so their device time holds that wait; their own
    time does not, and the own times of one call add up to its device span."""
    import torch

    from fused_pool_gelu.measure import l2_flush_buffer

    flush = l2_flush_buffer()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                     and e.time_range.end > e.time_range.start),
                    key=lambda e: e.time_range.start)
    flush_name = events[0].name
    flushes = sum(e.name == flush_name for e in events)
    if flushes != calls:
        raise RuntimeError(f"kernel_device_times: {flushes} launches of the flush's kernel "
                           f"({flush_name}) for {calls} calls: fn launches it too")
    kernels: Dict[str, Dict[str, float]] = {}
    previous_end = float("-inf")
    for event in events:
        start, end = event.time_range.start, event.time_range.end
        own = end - max(start, previous_end)
        previous_end = max(previous_end, end)
        if event.name == flush_name:
            continue
        times = kernels.setdefault(event.name, {"device_us": 0.0, "own_us": 0.0})
        times["device_us"] += (end - start) / calls
        times["own_us"] += max(own, 0.0) / calls
    return kernels


def profile_args(description: str, argv=None) -> argparse.Namespace:
    """The command line of the profile scripts that run the whole module (profile_train.py,
    profile_backward.py): batch sizes, the shape K, O, k, calls per measurement, x's
    distribution, --out."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--batches", type=int, nargs="+", default=[128, 1024, 4096])
    p.add_argument("-K", type=int, default=8192)
    p.add_argument("-O", type=int, default=8192)
    p.add_argument("-k", type=int, default=16)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--x-distribution", choices=X_DISTRIBUTIONS, default=DEFAULT_SHAPE["x"],
                   help="x ~ torch.rand (the benchmarks') or torch.randn (benchmark_x)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    return p.parse_args(argv)


def folded_weights(in_features: int, out_features: int, pool: int):
    """The benchmarks' weights on the GPU: Model(K, O, k, 2.0) after torch.manual_seed(0), folded
    (pooled weight [O / k, K], pooled bias [O / k])."""
    import torch

    import fused_pool_gelu

    torch.manual_seed(0)
    model = fused_pool_gelu.Model(in_features, out_features, pool, 2.0)
    return fused_pool_gelu.fold(model.matmul.weight.cuda(), model.matmul.bias.cuda(), pool)


def benchmark_x(batch: int, in_features: int, device, seed: int = 0, distribution: str = "rand"):
    """The benchmarks' x for batch B: torch.rand(B, K) (or torch.randn: X_DISTRIBUTIONS) in
    float32 on `device`, from that device's generator seeded with seed + B (so every batch has its
    own data, the same in every script)."""
    import torch

    if distribution not in X_DISTRIBUTIONS:
        raise ValueError(f"benchmark_x: distribution must be one of {X_DISTRIBUTIONS}, "
                         f"got {distribution!r}")
    gen = torch.Generator(device=device)
    gen.manual_seed(seed + batch)
    draw = torch.rand if distribution == "rand" else torch.randn
    return draw(batch, in_features, device=device, generator=gen, dtype=torch.float32)


def write_profile(path: Optional[str], rows: List[dict]) -> None:
    """The profile_*.py scripts' rows as JSON at path (nothing when path is None)."""
    if path is None:
        return
    import torch

    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "date": now_iso(), "git": git_revision(), "rows": rows}, f, indent=1)


def error_metrics(out, ref64) -> dict:
    """A row's rel_err_fp64 (||out - ref64|| / ||ref64||) and max_abs_err; None where not finite."""
    from fused_pool_gelu.measure import max_abs_error, relative_error

    return {"rel_err_fp64": finite_or_none(relative_error(out, ref64)),
            "max_abs_err": finite_or_none(max_abs_error(out, ref64))}


def rel_err(a, ref64) -> Optional[float]:
    """relative_error of a gradient; None where either is missing or the error is not finite."""
    if a is None or ref64 is None:
        return None
    from fused_pool_gelu.measure import relative_error

    return finite_or_none(relative_error(a, ref64))


# ----------------------------------------------------------------------------------------------
# Command line and the benchmark driver


def parse_args(mode: str, impl_choices: List[str], default_deadline_s: float, argv=None):
    from fused_pool_gelu.measure import DTYPES

    p = argparse.ArgumentParser(
        description=f"fused_pool_gelu {mode} benchmark: all impls timed in one process.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--batches", type=int, nargs="+", default=DEFAULT_BATCHES, help="batch sizes B")
    p.add_argument("--in-features", "-K", type=int, default=DEFAULT_SHAPE["K"])
    p.add_argument("--out-features", "-O", type=int, default=DEFAULT_SHAPE["O"])
    p.add_argument("--pool", "-k", type=int, default=DEFAULT_SHAPE["k"], help="pool kernel size")
    p.add_argument("--scale", type=float, default=DEFAULT_SHAPE["scale"])
    p.add_argument("--dtype", choices=DTYPES, default=DEFAULT_SHAPE["dtype"])
    p.add_argument("--x-distribution", choices=X_DISTRIBUTIONS, default=DEFAULT_SHAPE["x"],
                   help="x ~ torch.rand (KernelBench's inputs) or torch.randn")
    timed = "call" if mode == "forward" else "training step"
    p.add_argument("--cuda-graph", action="store_true",
                   help=f"time CUDA-graph replays of each impl's {timed} (captured once per B "
                        "after its warm-up calls; the outputs checked are the replay's): the "
                        "GPU's work without the host's Python and launches (CUDA only)")
    p.add_argument("--impls", nargs="+", choices=impl_choices, default=None,
                   help="subset of impls to run (default: all; on the CPU or in another dtype "
                        "than float32 all but " + ", ".join(FLOAT32_CUDA_ONLY) + ")")
    p.add_argument("--skip-compile", action="store_true",
                   help="leave out the torch.compile peers (" + ", ".join(COMPILED) + ")")
    p.add_argument("--compile-mode", default=None,
                   help="torch.compile mode for the compile peers "
                        '(e.g. "max-autotune-no-cudagraphs")')
    p.add_argument("--compile-dynamic", action="store_true",
                   help="compile once with a dynamic batch dim (default: dynamic=False, one "
                        "static compile per B, reusing one torch.compile object per impl)")
    p.add_argument("--warmup", type=float, default=100.0, help="warm-up time per measurement (ms)")
    p.add_argument("--rep", type=float, default=500.0,
                   help="timed repetition time per measurement (ms)")
    p.add_argument("--seed", type=int, default=0,
                   help="weights: torch.manual_seed(seed); x for batch B: seed + B")
    p.add_argument("--deadline-s", type=float, default=default_deadline_s,
                   help="skip (impl, B) pairs not started this many seconds after start; "
                        "results so far are saved (0: no deadline)")
    p.add_argument("--out", type=Path, default=None,
                   help="results JSON to merge into (default: benchmarks/results/<gpu>.json)")
    p.add_argument("--no-save", action="store_true", help="print only, write no results file")
    args = p.parse_args(argv)
    args.device = resolve_device(args.device)
    if args.cuda_graph and args.device.type != "cuda":
        p.error(f"--cuda-graph needs a CUDA device, got --device {args.device.type}")
    if args.cuda_graph and args.compile_mode in ("reduce-overhead", "max-autotune"):
        p.error(f"--cuda-graph captures every call itself; --compile-mode {args.compile_mode} "
                "would capture CUDA graphs inside that capture (use the default mode or "
                '"max-autotune-no-cudagraphs")')
    if args.impls is None:
        args.impls = default_impls(impl_choices, args.device.type, args.dtype)
    if args.skip_compile:
        args.impls = [i for i in args.impls if i not in COMPILED]
    return args


def default_impls(impl_choices: List[str], device_type: str, dtype: str) -> List[str]:
    """Every impl that applies: the float32 CUDA peers only on a CUDA device in float32."""
    float32_cuda = device_type == "cuda" and dtype == "float32"
    return [i for i in impl_choices if float32_cuda or i not in FLOAT32_CUDA_ONLY]


def resolve_device(name: Optional[str]):
    import torch

    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("--device cuda: no CUDA device is available")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


class Context:
    """Harness state shared by all impls of one run: shape, device, the reference weights."""

    def __init__(self, args, device):
        self.args = args
        self.device = device
        self.dtype = torch_dtype(args.dtype)
        self.K, self.O = args.in_features, args.out_features
        self.k, self.scale = args.pool, args.scale
        self.N = self.O // self.k
        self.compile_kwargs = {"dynamic": None if args.compile_dynamic else False}
        if args.compile_mode:
            self.compile_kwargs["mode"] = args.compile_mode
        self.master = self.build_master()

    def seeded_model(self):
        """Model(K, O, k, s) after torch.manual_seed(seed), on the CPU in float32: exactly the
        tests' Model(*args) after manual_seed, the same parameters in every script."""
        import torch

        import fused_pool_gelu

        torch.manual_seed(self.args.seed)
        return fused_pool_gelu.Model(self.K, self.O, self.k, self.scale)

    def build_master(self):
        """The reference Model on the run's device and dtype (every impl copies or folds it)."""
        return self.seeded_model().to(device=self.device, dtype=self.dtype)

    def reference_model64(self):
        """The float64 reference: a float64 copy of the Model (freed once the references of
        every B are made)."""
        import torch

        return copy.deepcopy(self.master).to(torch.float64)

    def pooled_for_peers(self):
        """The peers' folded weights: torch_fold of the Model's, contiguous."""
        linear = self.master.matmul
        pooled_weight, pooled_bias = self.torch_fold(linear.weight.detach(), linear.bias.detach())
        return pooled_weight.contiguous(), pooled_bias.contiguous()

    def pooled_for_ours(self):
        """Ours' folded weights: fused_pool_gelu.fold of the Model's."""
        import fused_pool_gelu

        linear = self.master.matmul
        return fused_pool_gelu.fold(linear.weight.detach(), linear.bias.detach(), self.k)

    def make_x(self, batch: int):
        """x [B, K] from benchmark_x (the run's distribution), in the run's dtype."""
        return benchmark_x(batch, self.K, self.device, self.args.seed,
                           self.args.x_distribution).to(self.dtype)

    def mark_batch_dynamic(self, x):
        if self.args.compile_dynamic and x.shape[0] > 1:
            import torch

            torch._dynamo.mark_dynamic(x, 0)
        return x

    def model_copy(self, requires_grad: bool):
        model = copy.deepcopy(self.master)
        for p in model.parameters():
            p.requires_grad_(requires_grad)
        return model

    def torch_fold(self, weight, bias):
        """Pooled weight and bias in plain PyTorch (view + mean: differentiable). Rows in groups
        of k; the weight's O % k tail rows are dropped, as AvgPool1d drops them."""
        k = self.k
        n = weight.shape[0] // k
        pooled_weight = weight[: n * k].view(n, k, weight.shape[1]).mean(dim=1)
        pooled_bias = bias[: n * k].view(n, k).mean(dim=1)
        return pooled_weight, pooled_bias

    def folded_forward_fn(self):
        """F.linear on pooled weights + gelu * s + max, as a plain function of (x, Wp, bp)."""
        import torch
        import torch.nn.functional as F

        scale = self.scale

        def folded_forward(x, pooled_weight, pooled_bias):
            y = F.gelu(F.linear(x, pooled_weight, pooled_bias)) * scale
            return torch.max(y, dim=1).values

        return folded_forward


def configure_compile() -> None:
    import torch._dynamo

    # One static graph per batch size and impl: stay well under the recompile limit (default 8).
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
            break


def run_benchmark(
    mode: str,
    args,
    builders: Dict[str, Callable],
    run_order: List[str],
    make_reference: Callable,
    measure: Callable,
    make_context: Callable = Context,
    deadline_from: Optional[float] = None,
) -> int:
    """Time every impl of ``args.impls`` (in ``run_order``) at every B; merge into the results file.

    make_context(args, device) -> the run's Context (a subclass may hold folded weights only).
    deadline_from: the time.perf_counter() that args.deadline_s counts from (default: this call's
    start; a caller running several shapes passes its own start).
    builders[impl](ctx) -> impl object (built once per impl, reused across B; freed after).
    make_reference(ctx, model64, x) -> dict of references for one B (float64 run, float32 Model
    run).
    measure(ctx, impl_obj, x, ref, time_us) -> dict of row fields (median_us, errors, ...).
    A failing impl is reported in its rows and in the output, and the run goes on. Returns 1 when
    a row of ours failed or is not accurate (is_accurate), else 0: a peer's failure is the peer's.
    """
    import torch

    start = time.perf_counter()
    device = args.device  # resolved by parse_args
    import fused_pool_gelu

    info = fused_pool_gelu.build_info()
    dev_name = device_name(device)
    log(f"fused_pool_gelu {info.get('version')} on {dev_name}; torch {torch.__version__}; "
        f"CUDA kernels compiled in: {info.get('cuda_kernels')}", start)
    matmul_precision = torch.get_float32_matmul_precision()
    if device.type == "cuda":
        log(f"float32 matmul precision: {matmul_precision}"
            + (" (no TF32 in the peers' cuBLAS calls)" if matmul_precision == "highest" else
               " (TF32 allowed: float32 peers may fail the accuracy check)"), start)
    from fused_pool_gelu.measure import make_timer

    time_us, timer_desc = make_timer(device, args.warmup, args.rep)
    log(f"timer: {timer_desc}; warmup {args.warmup:g} ms, rep {args.rep:g} ms", start)
    configure_compile()

    out_path = None if args.no_save else (args.out or default_results_path(device))
    run_id = now_iso()
    shape = {"K": args.in_features, "O": args.out_features, "k": args.pool,
             "scale": args.scale, "dtype": args.dtype, "x": args.x_distribution,
             "launch": "graph" if args.cuda_graph else "eager"}
    header = {"device": dev_name, "date": run_id, "torch": torch.__version__}
    run_meta = {
        "run_id": run_id,
        "date": run_id,
        "timer": timer_desc,
        "warmup_ms": args.warmup,
        "rep_ms": args.rep,
        "seed": args.seed,
        "shape": shape,
        "batches": args.batches,
        "impls": args.impls,
        "compile": {"dynamic": not not args.compile_dynamic, "mode": args.compile_mode},
        "device": dev_name,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "float32_matmul_precision": matmul_precision,
        "python": platform.python_version(),
        "fused_pool_gelu": info,
        "git": git_revision(),
        "argv": sys.argv[1:],
        "accurate_rel_err": ACCURATE_REL_ERR,
        "cpu": cpu_model(),
        "cpu_threads": torch.get_num_threads(),
    }
    try:
        import triton

        run_meta["triton"] = triton.__version__
    except ImportError:
        run_meta["triton"] = None

    ctx = make_context(args, device)
    log(f"shape: B in {args.batches}, {shape_text(shape)}; seed {args.seed}", start)

    # References for every B, then the float64 model is freed.
    log("building float64 references ...", start)
    model64 = ctx.reference_model64()
    cases = {}
    for b in args.batches:
        x = ctx.make_x(b)
        cases[b] = (x, make_reference(ctx, model64, x))
    del model64
    free_memory(device)
    log("references done", start)

    rows: List[dict] = []
    failures = 0
    order = [i for i in run_order if i in args.impls]

    def save():
        if out_path is not None and rows:
            merge_rows(out_path, rows, header, mode, run_meta)

    def new_row(impl, b, **fields):
        return dict(impl=impl, mode=mode, B=b, **shape, date=run_id, run_id=run_id, **fields)

    deadline_origin = start if deadline_from is None else deadline_from

    def past_deadline():
        return args.deadline_s and time.perf_counter() - deadline_origin > args.deadline_s

    def skip(impl, batches):
        """Rows for the pairs not measured, so that no older run's row stands in for them."""
        reason = f"{SKIPPED} (past --deadline-s {args.deadline_s:g})"
        for b in batches:
            log(f"{impl} B={b}: {reason}", start)
            rows.append(new_row(impl, b, median_us=None, error=reason))
        save()

    for impl in order:
        if past_deadline():
            skip(impl, args.batches)
            continue
        impl_obj = None
        try:
            impl_obj = builders[impl](ctx)
        except Exception as error:  # noqa: BLE001 - report and continue
            msg = f"{type(error).__name__}: {error}"
            log(f"{impl}: could not build: {msg.splitlines()[0][:300]}", start)
            traceback.print_exc(limit=-4)
            for b in args.batches:
                rows.append(new_row(impl, b, median_us=None, error=msg[:1000]))
            failures += 1
            save()
            continue
        for i, b in enumerate(args.batches):
            if past_deadline():
                skip(impl, args.batches[i:])
                break
            x, ref = cases[b]
            row = new_row(impl, b)
            try:
                row.update(measure(ctx, impl_obj, x, ref, time_us))
                synchronize(device)
                row["error"] = None
                log(_progress(impl, b, row), start)
            except Exception as error:  # noqa: BLE001 - report and continue
                msg = f"{type(error).__name__}: {error}"
                row.update(median_us=None, error=msg[:1000])
                log(f"{impl} B={b}: FAILED: {msg.splitlines()[0][:300]}", start)
                traceback.print_exc(limit=-4)
                failures += 1
                free_memory(device)
            rows.append(row)
            save()  # after every row: a run killed by a time limit keeps what it measured
        del impl_obj
        if impl in COMPILED:
            torch._dynamo.reset()
        free_memory(device)

    print()
    print(f"## {mode}: {dev_name}, {run_id}, torch {torch.__version__}, {shape_text(shape)}")
    print()
    print(markdown_tables(rows, mode))
    print()
    if out_path is not None:
        log(f"results merged into {out_path}", start)
    if failures:
        log(f"WARNING: {failures} impl/batch measurement(s) failed; see the error rows above",
            start)
    ours_bad = [f"{r['impl']} B={r['B']}" for r in rows
                if r["impl"] in OURS and not is_skipped(r) and not is_accurate(r)]
    if ours_bad:
        log(f"ERROR: ours failed or is not accurate at {', '.join(ours_bad)}", start)
    log("done", start)
    return 1 if ours_bad else 0


def _progress(impl: str, b: int, row: dict) -> str:
    parts = [f"{impl} B={b}: {_fmt_us(row.get('median_us'))} us"]
    if row.get("rel_err_fp64") is not None:
        parts.append(f"rel_err {row['rel_err_fp64']:.1e}")
    if row.get("max_abs_err") is not None:
        parts.append(f"max_abs {row['max_abs_err']:.1e}")
    if row.get("allclose_ref") is not None:
        parts.append("allclose ok" if row["allclose_ref"] else "NOT allclose")
    if row.get("peak_mem_mb") is not None:
        parts.append(f"peak {row['peak_mem_mb']:.0f} MB")
    if row.get("grad_rel_err_fp64"):
        g = row["grad_rel_err_fp64"]
        parts.append("grad rel_err " + " ".join(
            f"{k}={'-' if v is None else format(v, '.1e')}" for k, v in g.items()))
    if row.get("first_call_s") is not None and row["first_call_s"] > 1.0:
        parts.append(f"(first call {row['first_call_s']:.1f} s)")
    return ", ".join(parts)
