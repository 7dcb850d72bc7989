"""How `python -m fused_pool_gelu` and benchmarks/ measure: accuracy against the reference, the
training step they time, and the timers.

Accuracy: the relative error ||out - ref64|| / ||ref64|| against a float64 run of Model, the max
abs error, and the allclose tolerance against Model run in the same dtype. Timers: medians; on
CUDA triton.testing.do_bench (L2 flushed before each run, as KernelBench times), without triton
the same procedure with torch's CUDA events; on the CPU, a median of wall-clock runs.
torch is imported inside the functions that need it.
"""

from __future__ import annotations

import statistics
import time

DTYPES = ("float32", "float64", "bfloat16", "float16")

# The contract's tolerance (atol = rtol) against the reference Model run in the same dtype.
ALLCLOSE_TOL = {"float32": 1e-4, "float64": 1e-4, "bfloat16": 1e-2, "float16": 1e-2}


def relative_error(out, ref64) -> float:
    """||out - ref64|| / ||ref64|| (2-norms over all elements; ||out - ref64|| where ref64 is 0)."""
    diff = (out.detach().double() - ref64).norm().item()
    ref_norm = ref64.norm().item()
    return diff / ref_norm if ref_norm > 0 else diff


def max_abs_error(out, ref) -> float:
    """max |out - ref|, in float64 (0.0 for empty tensors)."""
    if out.numel() == 0:
        return 0.0
    return (out.detach().double() - ref.detach().double()).abs().max().item()


def training_step(forward, x, params):
    """The training step that __main__.py and the benchmarks time: the grads of params and x set
    to None, then forward(x).sum().backward(). Returns it as a function returning forward(x).

    A real step follows a parameter update, after which ModelNew folds again; these steps update
    nothing, so each one bumps the parameters' version counters first, as an optimizer's in-place
    update does (host work only): ModelNew's fold cache then refolds, as after a real update."""
    import torch

    params = list(params)
    tensors = params + [x]

    def step():
        for t in tensors:
            t.grad = None
        torch.autograd.graph.increment_version(params)
        out = forward(x)
        out.sum().backward()
        return out

    return step


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
