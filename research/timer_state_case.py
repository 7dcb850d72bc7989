"""Where does a kernel stall in the benchmarks' timer's state? Three calls of the forward (or of
floors.py's streaming read), each after the same 256 MB zero, for Nsight Compute to profile the
third.

    ncu --cache-control none --replay-mode application --clock-control none \
        --kernel-name regex:KERNEL --launch-skip 2 --launch-count 1 \
        python research/timer_state_case.py forward 128
    ncu ... --kernel-name regex:_read_max_kernel ... python research/timer_state_case.py read 20

KERNEL is a kernel's name as torch.profiler shows it (benchmarks/profile_forward.py prints them).
The benchmarks time with triton.testing.do_bench, which zeroes 256 MB before every run: each run
starts with the L2 full of dirty lines, and every line it loads first evicts one of them (a
write-back). Nsight Compute's default cache control flushes and invalidates the caches before each
kernel instead, a cleaner state that hides those write-backs. So this script zeroes the same
256 MB before each of its three calls, and the command above keeps the caches as they are
(--cache-control none) and reruns the whole process for every pass (--replay-mode application),
so that every pass sees the third call after the same zero (research/README.md, "Measuring").

`forward B`: fused_pool_gelu.forward on the benchmarks' data (the folded weights of
Model(K, 16 N, 16, 2.0) after torch.manual_seed(0), x ~ U(0, 1) seeded with B; -K, -N), on the
path the op picks unless FUSED_POOL_GELU_CERTIFIED / FUSED_POOL_GELU_FORCE_MMA_SYNC say otherwise;
--prepared passes the weight's prepare_weight copy (float32 only); --dtype bfloat16 / float16 runs
the model and x in that dtype (the half path: cuBLAS's GEMM, then the epilogue). `read MB`:
floors.py's streaming read of an MB-sized float32 buffer (--programs-per-sm, default 4 as in
floors.py's line).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import fused_pool_gelu

# The benchmarks' data and floors.py's read come from benchmarks/ (scripts, not a package).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import common  # noqa: E402
import floors  # noqa: E402

# The buffer triton.testing.do_bench zeroes before every run.
FLUSH_BYTES = 256 * 2**20


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["forward", "read"])
    p.add_argument("size", type=int, help="forward: the batch B; read: the buffer's MB")
    p.add_argument("-K", type=int, default=8192)
    p.add_argument("-N", type=int, default=512)
    p.add_argument("--prepared", action="store_true")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--programs-per-sm", type=int, default=4)
    args = p.parse_args(argv)
    if args.size < 1:
        p.error(f"size must be >= 1, got {args.size}")
    if args.prepared and args.dtype != "float32":
        p.error(f"--prepared is for float32 (the certified path), got --dtype {args.dtype}")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU: torch.cuda.is_available() is False")

    device = torch.device("cuda")
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    if args.what == "forward":
        dtype = getattr(torch, args.dtype)
        weight, bias = (t.detach().to(dtype)
                        for t in common.folded_weights(args.K, 16 * args.N, 16))
        prepared_weight = fused_pool_gelu.prepare_weight(weight) if args.prepared else None
        x = common.benchmark_x(args.size, args.K, device).to(dtype)

        def call():
            with torch.no_grad():
                fused_pool_gelu.forward(x, weight, bias, 2.0, prepared_weight)
    else:
        buffer = torch.rand(args.size * 2**20 // 4, device=device)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        partial_max = torch.empty(args.programs_per_sm * sms, device=device)

        def call():
            floors.read_once(buffer, partial_max)

    for _ in range(3):
        flush.zero_()
        call()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
