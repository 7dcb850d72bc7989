"""Timers shared by `python -m fused_pool_gelu` and benchmarks/: medians, L2 flushed on CUDA.

On CUDA, triton.testing.do_bench (L2 flushed before each run, as KernelBench times); without
triton, the same procedure with torch's CUDA events. On the CPU, a median of wall-clock runs.
"""

from __future__ import annotations

import statistics
import time


def make_timer(device, warmup_ms: float, rep_ms: float):
    """Returns (time_us(fn) -> median microseconds, description of the timer)."""
    if device.type == "cuda":
        try:
            import triton
            from triton.testing import do_bench
        except ImportError:
            return (
                lambda fn: _cuda_event_bench(fn, warmup_ms, rep_ms) * 1e3,
                "CUDA events (triton missing; do_bench's rule: 256 MB L2 flush per run), median",
            )
        return (
            lambda fn: do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1e3,
            f"triton.testing.do_bench (triton {triton.__version__}, L2 flushed), median",
        )
    return (lambda fn: _cpu_bench(fn, warmup_ms, rep_ms) * 1e3, "time.perf_counter, median")


def capture_cuda_graph(fn):
    """fn captured into a CUDA graph after three calls on a side stream (torch.cuda.graphs' warm-up
    rule: lazy initialisations, cuBLAS workspaces and compilations happen outside the capture).
    Returns (graph, fn's outputs from the capture): every replay recomputes those tensors in
    place; they hold nothing until the first replay."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph, outputs


def l2_flush_buffer(device="cuda"):
    """The buffer triton.testing.do_bench zeroes before every run (256 MB, as KernelBench does):
    zeroing it leaves the L2 full of dirty lines. Every timer and profiler here flushes with it,
    so that they all measure the same state."""
    import torch

    return torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device=device)


def _cuda_event_bench(fn, warmup_ms: float, rep_ms: float) -> float:
    """triton.testing.do_bench's procedure with torch only; returns the median in ms."""
    import torch

    fn()
    torch.cuda.synchronize()
    cache = l2_flush_buffer()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        cache.zero_()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end) / 5, 1e-3)
    n_warmup, n_repeat = max(1, int(warmup_ms / estimate)), max(1, int(rep_ms / estimate))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_repeat)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_repeat)]
    for _ in range(n_warmup):
        fn()
    for i in range(n_repeat):
        cache.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def _cpu_bench(fn, warmup_ms: float, rep_ms: float, max_runs: int = 1000) -> float:
    """Median wall time in ms: warm up for warmup_ms (>= 1 run), then time >= 3 runs for rep_ms."""
    t_end = time.perf_counter() + warmup_ms / 1e3
    fn()
    while time.perf_counter() < t_end:
        fn()
    times = []
    t_end = time.perf_counter() + rep_ms / 1e3
    while len(times) < 3 or (time.perf_counter() < t_end and len(times) < max_runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3
