"""Host time of the training step: what the CPU spends to issue each op and each part of a step.

    python benchmarks/profile_host.py                   # B in {128, 1024}
    python benchmarks/profile_host.py --batches 1024 --rounds 5

An eager step is as long as its GPU work only while the host issues the kernels ahead of the GPU;
on a slow host it is bound by the host instead. This script measures the host side alone: the
wall time of each call on the host (time.perf_counter around the call, no synchronization inside
the timed region; the device is synchronized every `--sync-every` calls so that the launch queue
never fills and blocks a call), median and minimum over `--calls` calls, for
  - the ops one by one (fold, forward_with_argmax, model_forward, model_backward, forward_backward,
    fold_backward) at B = 1024, and a plain `torch.add` of the pooled weight's size for scale;
  - the parts of bench_train.py's step for ours_model (measure.training_step): grads set to None,
    the parameters' version counters bumped (as a parameter update bumps them), ModelNew's forward
    (the fold included), out.sum(), and backward() (which includes the autograd engine's hand-off
    to its device thread and back; model_backward is a part of it).
The host's speed drifts between runs (up to ~1.8x on a shared machine): compare versions
interleaved in one session, round by round (`--rounds`).
Shape: the default, K = O = 8192, k = 16, scale 2.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import common
import fused_pool_gelu

_OPS = torch.ops.fused_pool_gelu


def host_us(fn, calls: int, sync_every: int):
    """(median, min) host microseconds of one call of fn."""
    times = []
    for i in range(calls):
        if i % sync_every == 0:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return round(statistics.median(times), 1), round(min(times), 1)


def step_parts(model, x, calls: int, sync_every: int):
    """Median host microseconds of each part of one eager training step."""
    params = list(model.parameters())
    tensors = params + [x]
    parts = {"grads None": [], "bump versions": [], "forward": [], "sum": [], "backward": [],
             "step": []}
    for i in range(calls):
        if i % sync_every == 0:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for t in tensors:
            t.grad = None
        t1 = time.perf_counter()
        torch.autograd.graph.increment_version(params)
        t2 = time.perf_counter()
        out = model(x)
        t3 = time.perf_counter()
        loss = out.sum()
        t4 = time.perf_counter()
        loss.backward()
        t5 = time.perf_counter()
        for key, value in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t0)):
            parts[key].append(value * 1e6)
    torch.cuda.synchronize()
    return {key: round(statistics.median(values), 1) for key, values in parts.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_host.py needs a CUDA GPU")

    torch.manual_seed(0)
    reference = fused_pool_gelu.Model(8192, 8192, 16, 2.0)
    model = fused_pool_gelu.ModelNew.from_model(reference).cuda()
    weight, bias = model.matmul.weight, model.matmul.bias
    x = common.benchmark_x(1024, 8192, "cuda")
    with torch.no_grad():
        pooled_weight, pooled_bias = _OPS.fold(weight, bias, 16)
        out, argmax, preactivation = _OPS.forward_with_argmax(x, pooled_weight, pooled_bias, 2.0)
    grad_out = torch.ones(1024, device="cuda")
    ops = {
        "torch.add (16 MB)": lambda: pooled_weight + 1,
        "fold": lambda: _OPS.fold(weight, bias, 16),
        "forward_with_argmax": lambda: _OPS.forward_with_argmax(
            x, pooled_weight, pooled_bias, 2.0
        ),
        "model_forward": lambda: _OPS.model_forward(x, weight, bias, 16, 2.0),
        "model_backward": lambda: _OPS.model_backward(
            grad_out, x, pooled_weight, argmax, preactivation, 2.0, 8192, 16
        ),
        "forward_backward": lambda: _OPS.forward_backward(
            grad_out, None, x, pooled_weight, argmax, preactivation, 2.0
        ),
        "fold_backward": lambda: _OPS.fold_backward(pooled_weight, pooled_bias, 8192, 16),
    }
    for round_index in range(args.rounds):
        print(f"round {round_index + 1}: host us per call (median, min), B = 1024, no grad")
        with torch.no_grad():
            for name, fn in ops.items():
                print(f"  {name:22s} {host_us(fn, args.calls, args.sync_every)}")
        for batch in args.batches:
            xb = common.benchmark_x(batch, 8192, "cuda").requires_grad_(True)
            parts = step_parts(model, xb, args.calls, args.sync_every)
            print(f"  step parts, B = {batch}: {parts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
