"""What any kernel can reach under the benchmarks' timer: the floors below the small-batch times.

    python benchmarks/floors.py
    python benchmarks/floors.py --batches 1 16 128 --out /tmp/floors.json
    python benchmarks/floors.py --own-mb 4 16 20 32 --programs-per-sm 1 2 4 8 16

The benchmarks time with triton.testing.do_bench (fused_pool_gelu.measure): a 256 MB buffer is
zeroed before every run, so each run starts with the L2 full of dirty lines and the op's operands
in DRAM. Under that timer this script measures, in one process:
  - the timer's own floor: one launch of a one-element kernel (`add_` on a 1-float tensor);
  - the cost of reading a buffer once: a Triton kernel that streams a float32 buffer of 1 to 32
    MB through every SM (4 programs per SM, 16 KB loads in flight each) into one max per program,
    and a line fitted through those times (fixed part + bytes / bandwidth);
  - the same read's own device time (torch.profiler, after the same flush, as profile_forward.py
    times kernels) against the bytes and the programs per SM: what a kernel of the forward, timed
    by its own time, can reach when it reads that much;
  - reading the pooled weight at other precisions: cuBLAS `x @ w.T` with float32 and bfloat16
    operands (the bfloat16 GEMM reads half the bytes and is not float32-accurate: it stands for
    any first pass that reads a bfloat16 copy of the weight), next to fused_pool_gelu's forward.
A forward that is float32-accurate must read every element of the pooled weight at some precision
at least once, so the read of its bytes bounds it from below at small batch.
Shape: the default pooled weight, K = 8192, N = O / k = 512, k = 16, scale 2.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

import common
import fused_pool_gelu
from fused_pool_gelu.measure import make_timer


@triton.jit
def _read_max_kernel(src, partial_max, numel, BLOCK: tl.constexpr):
    program = tl.program_id(0)
    acc = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(program * BLOCK, numel, tl.num_programs(0) * BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        acc = tl.maximum(acc, tl.load(src + offsets, mask=offsets < numel, other=float("-inf")))
    tl.store(partial_max + program, tl.max(acc, 0))


def read_once(buffer, partial_max):
    """One pass over buffer's bytes on every SM (partial_max: one float per program)."""
    _read_max_kernel[(partial_max.numel(),)](buffer, partial_max, buffer.numel(), BLOCK=4096,
                                             num_warps=8)


def read_own_us(device, mbs, programs_per_sm, calls=30):
    """{(MB, programs per SM): own device time of one read_once over that many MB, us}, each
    call after the timer's 256 MB flush (common.kernel_device_times)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    table = {}
    for mb in mbs:
        buffer = torch.rand(mb * 2**20 // 4, device=device)
        for per_sm in programs_per_sm:
            partial_max = torch.empty(per_sm * sms, device=device)
            times = common.kernel_device_times(lambda: read_once(buffer, partial_max), calls)
            table[(mb, per_sm)] = sum(t["own_us"] for t in times.values())
        del buffer
    return table


def fit_line(points):
    """Least-squares (fixed us, us per MB) through (MB, us) points."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum(
        (x - mean_x) ** 2 for x, _ in points)
    return mean_y - slope * mean_x, slope


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 128])
    p.add_argument("--read-mb", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--own-mb", type=int, nargs="+", default=[4, 16, 20, 32],
                   help="buffer sizes (MB) of the own-time table")
    p.add_argument("--programs-per-sm", type=int, nargs="+", default=[1, 2, 4, 8, 16],
                   help="the read's programs per SM in the own-time table")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)

    device = torch.device("cuda")
    time_us, timer = make_timer(device, warmup_ms=100, rep_ms=500)
    weight, bias = (t.detach() for t in common.folded_weights(8192, 8192, 16))
    weight_bf16 = weight.to(torch.bfloat16)
    scale = 2.0

    one = torch.zeros(1, device=device)
    floor_us = time_us(lambda: one.add_(1))
    partial_max = torch.empty(
        4 * torch.cuda.get_device_properties(device).multi_processor_count, device=device)
    reads = []
    for mb in args.read_mb:
        buffer = torch.rand(mb * 2**20 // 4, device=device)
        read_once(buffer, partial_max)
        torch.testing.assert_close(partial_max.max(), buffer.max(), rtol=0, atol=0)
        reads.append((mb, time_us(lambda: read_once(buffer, partial_max))))
        del buffer
    fixed_us, us_per_mb = fit_line(reads)
    own = read_own_us(device, args.own_mb, args.programs_per_sm)
    weight_mb = weight.numel() * weight.element_size() / 2**20

    rows = []
    for batch in args.batches:
        x = common.benchmark_x(batch, weight.shape[1], device)
        x_bf16 = x.to(torch.bfloat16)
        rows.append({
            "B": batch,
            "ours_forward_us": time_us(lambda: fused_pool_gelu.forward(x, weight, bias, scale)),
            "cublas_fp32_us": time_us(lambda: x @ weight.T),
            "cublas_bf16_us": time_us(lambda: x_bf16 @ weight_bf16.T),
        })

    print(f"{common.device_name(device)}, torch {torch.__version__}, {common.now_iso()}")
    print(f"timer: {timer}")
    print(f"one-element kernel: {floor_us:.2f} us")
    print("one read of a float32 buffer: " +
          ", ".join(f"{mb} MB {us:.2f}" for mb, us in reads) + " us")
    print(f"  fit: {fixed_us:.2f} us + {us_per_mb:.3f} us/MB ({1 / us_per_mb * 2**20 / 1e6:.2f} "
          f"TB/s); the pooled weight read once at 4 / 2 / 1 bytes per element ({weight_mb:.0f} / "
          f"{weight_mb / 2:.0f} / {weight_mb / 4:.0f} MB): " +
          " / ".join(f"{fixed_us + us_per_mb * weight_mb / d:.2f}" for d in (1, 2, 4)) + " us")
    print("one read's own device time (after the same flush), us, by MB and programs per SM:")
    print(f"{'MB':>5} " + " ".join(f"{per_sm:>7d}" for per_sm in args.programs_per_sm))
    for mb in args.own_mb:
        cells = " ".join(f"{own[(mb, per_sm)]:7.2f}" for per_sm in args.programs_per_sm)
        print(f"{mb:5d} {cells}")
    print(f"{'B':>5} {'ours forward':>13} {'cuBLAS fp32':>12} {'cuBLAS bf16':>12}  (us)")
    for row in rows:
        print(f"{row['B']:5d} {row['ours_forward_us']:13.2f} {row['cublas_fp32_us']:12.2f} "
              f"{row['cublas_bf16_us']:12.2f}")
    if args.out is not None:
        with open(args.out, "w") as f:
            json.dump({"device": common.device_name(device), "torch": torch.__version__,
                       "date": common.now_iso(), "git": common.git_revision(), "timer": timer,
                       "one_element_kernel_us": floor_us,
                       "read_float32_us": [{"MB": mb, "us": us} for mb, us in reads],
                       "read_fit": {"fixed_us": fixed_us, "us_per_MB": us_per_mb},
                       "read_own_us": [{"MB": mb, "programs_per_sm": per_sm, "us": us}
                                       for (mb, per_sm), us in own.items()],
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
