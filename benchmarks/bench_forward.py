"""Forward (inference) benchmark: every impl in one process, under torch.no_grad().

    python benchmarks/bench_forward.py                 # B in {1,16,128,1024,4096}, K=O=8192
    python benchmarks/bench_forward.py --skip-compile  # no torch.compile peers (fast)
    python benchmarks/bench_forward.py --device cpu --batches 1 16 -K 512 -O 512 --skip-compile
    python benchmarks/bench_forward.py --out r.json    # the rows as JSON too
    python benchmarks/bench_forward.py --cuda-graph    # CUDA-graph replays (no host time)

Impls (weights from torch.manual_seed(seed); Model(K, O, k, s), the same for all):
  ref_eager     Model (nn.Linear -> AvgPool1d -> gelu -> * s -> max)
  ref_compile   torch.compile(Model)
  fold_eager    F.linear on pre-folded pooled weights + gelu * s + max (PyTorch ops)
  fold_compile  torch.compile of that function
  fold_tail     cuBLAS addmm on the pooled weights + one Triton kernel for gelu * s + row max
                (the "fold + tiny CUDA tail kernel" peer; CUDA only)
  ours_op       torch.ops.fused_pool_gelu.forward on pre-folded weights (fused_pool_gelu.fold)
                and the pooled weight's prepare_weight copy, both made once
  ours_model    fused_pool_gelu.ModelNew (eager; the fold and its prepared copy are cached
                under no_grad)
Each row: median time (us), rel err and max abs err vs a float64 Model run of the same weights,
allclose (atol = rtol = 1e-4 in float32) vs the float32 Model, and on CUDA call_mem_mb: the memory
one call allocates beyond what is resident (an eager call's, also with --cuda-graph). With
--cuda-graph the timed and checked call is a replay of the impl's call captured as a CUDA graph:
rows of their own (launch "graph"), with their own tables.
"""

from __future__ import annotations

import sys
import time

import torch

import common
from fused_pool_gelu.measure import ALLCLOSE_TOL

RUN_ORDER = [
    "ref_eager", "fold_eager", "fold_tail", "ours_op", "ours_model", "fold_compile", "ref_compile"
]
IMPLS = [i for i in common.IMPL_ORDER if i in RUN_ORDER]


def build_ref_eager(ctx):
    model = ctx.model_copy(requires_grad=False)
    return model


def build_ref_compile(ctx):
    model = ctx.model_copy(requires_grad=False)
    return torch.compile(model, **ctx.compile_kwargs)


def build_fold_eager(ctx):
    pooled_weight, pooled_bias = ctx.pooled_for_peers()
    fn = ctx.folded_forward_fn()
    return lambda x: fn(x, pooled_weight, pooled_bias)


def build_fold_compile(ctx):
    pooled_weight, pooled_bias = ctx.pooled_for_peers()
    fn = torch.compile(ctx.folded_forward_fn(), **ctx.compile_kwargs)
    return lambda x: fn(x, pooled_weight, pooled_bias)


# fold_tail's columns per step of a row's loop: the default shape's N (one step per row there);
# narrower rows take the next power of two above N, so that no lanes idle.
TAIL_MAX_BLOCK = 512


def _triton_tail_kernel():
    """gelu(z) * scale and its row max in one Triton kernel: one program per row."""
    import triton
    import triton.language as tl

    @triton.jit
    def tail(z_ptr, out_ptr, n, stride, scale, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        for start in range(0, n, BLOCK):
            mask = start + cols < n
            z = tl.load(z_ptr + row * stride + start + cols, mask=mask, other=0.0)
            v = 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476)) * scale
            best = tl.maximum(best, tl.where(mask, v, float("-inf")))
        tl.store(out_ptr + row, tl.max(best, axis=0))

    return tail


def build_fold_tail(ctx):
    if ctx.device.type != "cuda" or ctx.dtype != torch.float32:
        raise RuntimeError("fold_tail is a float32 CUDA peer")
    pooled_weight, pooled_bias = ctx.pooled_for_peers()
    import triton

    tail, scale = _triton_tail_kernel(), float(ctx.scale)
    block = min(TAIL_MAX_BLOCK, triton.next_power_of_2(max(ctx.N, 1)))

    def fn(x):
        z = torch.addmm(pooled_bias, x, pooled_weight.t())
        out = torch.empty(x.shape[0], device=x.device, dtype=torch.float32)
        tail[(x.shape[0],)](z, out, z.shape[1], z.stride(0), scale, BLOCK=block)
        return out

    return fn


def build_ours_op(ctx):
    import fused_pool_gelu

    pooled_weight, pooled_bias = ctx.pooled_for_ours()
    prepared_weight = fused_pool_gelu.prepare_weight(pooled_weight)
    op, scale = torch.ops.fused_pool_gelu.forward, ctx.scale
    return lambda x: op(x, pooled_weight, pooled_bias, scale, prepared_weight)


def build_ours_model(ctx):
    import fused_pool_gelu

    return fused_pool_gelu.ModelNew.from_model(ctx.master)


BUILDERS = {
    "ref_eager": build_ref_eager,
    "ref_compile": build_ref_compile,
    "fold_eager": build_fold_eager,
    "fold_compile": build_fold_compile,
    "fold_tail": build_fold_tail,
    "ours_op": build_ours_op,
    "ours_model": build_ours_model,
}


def make_reference(ctx, model64, x):
    return {"out64": model64(x.double()), "out_ref": ctx.master(x)}


def measure(ctx, fn, x, ref, time_us):
    x = ctx.mark_batch_dynamic(x)
    t0 = time.perf_counter()
    fn(x)  # compiles (compile peers), folds and caches (ours_model)
    common.synchronize(ctx.device)
    first_call_s = time.perf_counter() - t0
    call = lambda: fn(x)  # noqa: E731
    if ctx.args.cuda_graph:
        call = common.cuda_graph_call(call)
    out = call()  # the steady-state path, the one timed, is the one checked
    common.synchronize(ctx.device)
    row = common.error_metrics(out, ref["out64"])
    tol = ALLCLOSE_TOL[ctx.args.dtype]
    row["allclose_ref"] = bool(
        torch.allclose(out.to(ref["out_ref"].dtype), ref["out_ref"], atol=tol, rtol=tol)
    )
    del out
    if ctx.device.type == "cuda":
        # What one call allocates on top of what is resident (inputs, weights, caches): the
        # [B, O] product of the unfused peers, our split-K workspace and outputs.
        before = torch.cuda.memory_allocated(ctx.device)
        torch.cuda.reset_peak_memory_stats(ctx.device)
        fn(x)
        torch.cuda.synchronize(ctx.device)
        peak = torch.cuda.max_memory_allocated(ctx.device)
        row["call_mem_mb"] = round((peak - before) / 2**20, 1)
    row["median_us"] = time_us(call)
    row["first_call_s"] = round(first_call_s, 3)
    return row


def main(argv=None) -> int:
    args = common.parse_args("forward", IMPLS, default_deadline_s=220.0, argv=argv)
    with torch.no_grad():
        return common.run_benchmark("forward", args, BUILDERS, RUN_ORDER, make_reference, measure)


if __name__ == "__main__":
    sys.exit(main())
