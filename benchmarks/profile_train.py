"""Where a training step's time goes: device time per kernel (torch.profiler), L2 flushed per step.

    python benchmarks/profile_train.py                         # B in {128, 1024, 4096}
    python benchmarks/profile_train.py --batches 1024 --out /tmp/profile_train.json

One step as bench_train.py times it for ours_model: grads set to None, ModelNew forward (fold +
fused forward), out.sum().backward() into weight, bias and x. Prints every kernel the step launches
with its own time / device time (common.kernel_device_times: a programmatic dependent launch's
device time holds its wait for the kernel before it, its own time does not), the sum of the own
times, the step's median (fused_pool_gelu.measure, as bench_train.py) and the median of the same
step replayed as a CUDA graph (the step's GPU work without its host time; captured, ModelNew takes
its eager training path). The eager median is host-bound on a slow host, where it varies from run
to run: read this script for the kernels and the GPU work, bench_train.py for the step's time.
Shape: the default, K = O = 8192, k = 16, scale 2.
"""

from __future__ import annotations

import torch

import common
import fused_pool_gelu
from fused_pool_gelu.measure import capture_cuda_graph, make_timer, training_step


def profile(batch, in_features, out_features, pool, calls, x_distribution):
    """Returns ({kernel: {"device_us", "own_us"}}, median time of one step, median time of its
    CUDA-graph replay, us)."""
    # bench_train.py's data: the parameters of Model(K, O, k, 2.0) after torch.manual_seed(0)
    # (ModelNew's constructor draws the same), x from common.benchmark_x.
    torch.manual_seed(0)
    model = fused_pool_gelu.ModelNew(in_features, out_features, pool, 2.0).cuda()
    x = common.benchmark_x(batch, in_features, "cuda", distribution=x_distribution)
    x.requires_grad_()

    step = training_step(model, x, model.parameters())

    time_us, _ = make_timer(torch.device("cuda"), warmup_ms=100, rep_ms=500)
    kernels = common.kernel_device_times(step, calls)
    # step sets the grads to None inside the capture, so the replays write them, not add to them.
    graph, _ = capture_cuda_graph(step)
    return kernels, time_us(step), time_us(graph.replay)


def main():
    args = common.profile_args(__doc__.splitlines()[0])

    rows = []
    for batch in args.batches:
        kernels, median, graph_median = profile(batch, args.K, args.O, args.k, args.calls,
                                                args.x_distribution)
        total = sum(times["own_us"] for times in kernels.values())
        rows.append({"B": batch, "K": args.K, "O": args.O, "k": args.k,
                     "x": args.x_distribution, "kernels_us": kernels,
                     "own_sum_us": total, "median_us": median, "graph_median_us": graph_median})
        print(f"B={batch:5d}: median {median:7.1f} us, as a CUDA graph {graph_median:7.1f} us, "
              f"own sum {total:7.1f} us", flush=True)
        print("    own / device (us)", flush=True)
        for name, times in sorted(kernels.items(), key=lambda item: -item[1]["own_us"]):
            print(f"    {times['own_us']:7.1f} / {times['device_us']:7.1f}  {name[:100]}",
                  flush=True)
    common.write_profile(args.out, rows)


if __name__ == "__main__":
    main()
