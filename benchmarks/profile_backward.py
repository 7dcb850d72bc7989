"""The arg-max backward alone, per kernel, over arg-max distributions (L2 flushed per call).

    python benchmarks/profile_backward.py                      # B in {128, 1024, 4096}
    python benchmarks/profile_backward.py --batches 1024 --out /tmp/profile_backward.json

Calls ops.forward_backward (grad_out = ones, as out.sum().backward() gives) on the benchmarks'
folded weights (common.folded_weights: Model(8192, 8192, 16, 2.0)) and x (common.benchmark_x:
the benchmarks' x ~ U(0, 1) for that batch), with three
arg-max vectors: "model" (the forward's own: on this data a few tens of distinct arg-maxes, one of
them taken by ~45% of the rows), "uniform" (random over the N pooled rows: many short segments)
and "one" (every row the same arg-max: one segment, the longest chain). The segment reduction's
time depends on that shape far more than on the bytes it moves (x once, grad_weight once), so a
change to it is measured on all three. Prints each kernel's own time (common.kernel_device_times).
"""

from __future__ import annotations

import torch

import common
import fused_pool_gelu  # noqa: F401  (registers torch.ops.fused_pool_gelu)


def short_name(kernel: str) -> str:
    """`void ns::(anonymous namespace)::segment_tiles_kernel<float>(...)` -> its bare name."""
    name = kernel.replace("(anonymous namespace)::", "")
    return name.split("(")[0].split("<")[0].split("::")[-1].replace("void ", "")


def main():
    args = common.profile_args(__doc__.splitlines()[0])

    ops = torch.ops.fused_pool_gelu
    pooled_weight, pooled_bias = common.folded_weights(args.K, args.O, args.k)
    pooled = pooled_weight.shape[0]
    rows = []
    for batch in args.batches:
        x = common.benchmark_x(batch, args.K, "cuda", distribution=args.x_distribution)
        _, model_argmax, preactivation = ops.forward_with_argmax(x, pooled_weight, pooled_bias, 2.0)
        argmaxes = {
            "model": model_argmax,
            "uniform": torch.randint(0, pooled, (batch,), device="cuda"),
            "one": torch.full((batch,), pooled // 2, device="cuda", dtype=torch.int64),
        }
        grad_out = torch.ones(batch, device="cuda")
        for name, argmax in argmaxes.items():
            def call():
                ops.forward_backward(grad_out, None, x, pooled_weight, argmax, preactivation, 2.0)

            kernels = common.kernel_device_times(call, args.calls)
            own = {short_name(kernel): times["own_us"] for kernel, times in kernels.items()}
            distinct = int(argmax.unique().numel())
            rows.append({"B": batch, "K": args.K, "N": pooled, "argmax": name,
                         "distinct_argmax": distinct, "kernels_us": kernels,
                         "own_sum_us": sum(own.values())})
            print(f"B={batch:5d} {name:8s} ({distinct:4d} distinct): "
                  + ", ".join(f"{kernel} {us:.1f}" for kernel, us in own.items()), flush=True)
    common.write_profile(args.out, rows)


if __name__ == "__main__":
    main()
