"""Training-step benchmark: every impl in one process.

    python benchmarks/bench_train.py                   # B in {1,16,128,1024,4096}, K=O=8192
    python benchmarks/bench_train.py --skip-compile
    python benchmarks/bench_train.py --device cpu --batches 1 16 -K 512 -O 512 --skip-compile
    python benchmarks/bench_train.py --out r.json      # the rows as JSON too
    python benchmarks/bench_train.py --cuda-graph      # CUDA-graph replays of each step

One step = grads set to None (weight, bias, x), forward, out.sum().backward() producing the
gradients of weight, bias and x. Impls (each with its own copy of the parameters):
  ref_eager     Model
  ref_compile   torch.compile(Model) (forward and backward compiled by AOTAutograd)
  fold_eager    the fold inside autograd (view + mean every step), F.linear + gelu * s + max
  fold_compile  torch.compile of that function (fold included)
  ours_model    fused_pool_gelu.ModelNew (fold op + fused forward op, arg-max backward; it refolds
                every step: the step bumps the parameters' version counters, as a real step's
                parameter update does: fused_pool_gelu.measure.training_step)
Each row: median step time, rel err of the forward output vs float64, the rel errs of the three
gradients vs float64 gradients (grad_rel_err_fp64; arg-max ties or near-ties between float32 and
float64 move a whole row's gradient, so these may exceed the forward error even for the
reference), and peak memory of one step (CUDA):
    peak_mem_mb = (max_memory_allocated during the step - memory_allocated before it)
                  + bytes of the impl's parameters and of x
i.e. parameters + input + everything the step allocates (activations, grads, workspaces),
independent of what the harness holds (references, other inputs). peak_mem_total_mb is the raw
torch.cuda.max_memory_allocated() after reset_peak_memory_stats(), harness included. Both are an
eager step's, also with --cuda-graph, where the timed and checked step is a replay of one
captured as a CUDA graph (the grads set to None before the capture, so that the captured backward
writes them, in the graph's memory, instead of adding to them: docs/training.md, "CUDA graphs").
"""

from __future__ import annotations

import sys
import time

import torch

import common
from fused_pool_gelu.measure import ALLCLOSE_TOL, training_step

RUN_ORDER = ["ref_eager", "fold_eager", "ours_model", "fold_compile", "ref_compile"]
IMPLS = [i for i in common.IMPL_ORDER if i in RUN_ORDER]


class TrainImpl:
    """forward(x) -> out [B], differentiable in x and in the leaf tensors weight and bias."""

    def __init__(self, forward, weight, bias):
        self.forward, self.weight, self.bias = forward, weight, bias
        self.params = [p for p in (weight, bias) if p is not None]


def _module_impl(module, compiled=None):
    linear = module.matmul
    return TrainImpl(compiled if compiled is not None else module, linear.weight, linear.bias)


def build_ref_eager(ctx):
    return _module_impl(ctx.model_copy(requires_grad=True))


def build_ref_compile(ctx):
    model = ctx.model_copy(requires_grad=True)
    return _module_impl(model, torch.compile(model, **ctx.compile_kwargs))


def _fold_step_fn(ctx):
    folded_forward = ctx.folded_forward_fn()

    def fold_and_forward(x, weight, bias):
        pooled_weight, pooled_bias = ctx.torch_fold(weight, bias)
        return folded_forward(x, pooled_weight, pooled_bias)

    return fold_and_forward


def _leaf_params(ctx):
    linear = ctx.master.matmul
    weight = linear.weight.detach().clone().requires_grad_(True)
    bias = linear.bias.detach().clone().requires_grad_(True)
    return weight, bias


def build_fold_eager(ctx):
    fn = _fold_step_fn(ctx)
    weight, bias = _leaf_params(ctx)
    return TrainImpl(lambda x: fn(x, weight, bias), weight, bias)


def build_fold_compile(ctx):
    fn = torch.compile(_fold_step_fn(ctx), **ctx.compile_kwargs)
    weight, bias = _leaf_params(ctx)
    return TrainImpl(lambda x: fn(x, weight, bias), weight, bias)


def build_ours_model(ctx):
    import fused_pool_gelu

    model = fused_pool_gelu.ModelNew.from_model(ctx.master)
    for p in model.parameters():
        p.requires_grad_(True)
    return _module_impl(model)


BUILDERS = {
    "ref_eager": build_ref_eager,
    "ref_compile": build_ref_compile,
    "fold_eager": build_fold_eager,
    "fold_compile": build_fold_compile,
    "ours_model": build_ours_model,
}


def make_reference(ctx, model64, x):
    x64 = x.detach().double().requires_grad_(True)
    for p in model64.parameters():
        p.requires_grad_(True)
        p.grad = None
    out64 = model64(x64)
    out64.sum().backward()
    ref = {
        "out64": out64.detach(),
        "grad_weight": model64.matmul.weight.grad,
        "grad_bias": model64.matmul.bias.grad,
        "grad_x": x64.grad,
    }
    for p in model64.parameters():
        p.grad = None
    with torch.no_grad():
        ref["out_ref"] = ctx.master(x)
    return ref


def measure(ctx, impl, x, ref, time_us):
    device = ctx.device
    x_leaf = ctx.mark_batch_dynamic(x.detach().clone()).requires_grad_(True)
    tensors = impl.params + [x_leaf]
    step = training_step(impl.forward, x_leaf, impl.params)

    t0 = time.perf_counter()
    step()  # compiles (compile peers)
    common.synchronize(device)
    first_call_s = time.perf_counter() - t0
    step()
    for t in tensors:
        t.grad = None
    common.synchronize(device)

    row = {}
    if device.type == "cuda":
        resident = sum(t.numel() * t.element_size() for t in tensors)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = step()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        row["peak_mem_mb"] = round((peak - before + resident) / 2**20, 1)
        row["peak_mem_total_mb"] = round(peak / 2**20, 1)
    else:
        out = step()
    call = step
    if ctx.args.cuda_graph:
        del out
        call = common.cuda_graph_call(step)
        out = call()  # the replay's output and gradients are the ones checked
        torch.cuda.synchronize(device)
    row.update(common.error_metrics(out, ref["out64"]))
    tol = ALLCLOSE_TOL[ctx.args.dtype]
    row["allclose_ref"] = bool(
        torch.allclose(out.detach().to(ref["out_ref"].dtype), ref["out_ref"], atol=tol, rtol=tol)
    )
    row["grad_rel_err_fp64"] = {
        "weight": common.rel_err(impl.weight.grad, ref["grad_weight"]),
        "bias": common.rel_err(impl.bias.grad if impl.bias is not None else None, ref["grad_bias"]),
        "x": common.rel_err(x_leaf.grad, ref["grad_x"]),
    }
    del out
    row["median_us"] = time_us(call)
    for t in tensors:
        t.grad = None
    row["first_call_s"] = round(first_call_s, 3)
    return row


def main(argv=None) -> int:
    args = common.parse_args("train", IMPLS, default_deadline_s=160.0, argv=argv)
    return common.run_benchmark("train", args, BUILDERS, RUN_ORDER, make_reference, measure)


if __name__ == "__main__":
    sys.exit(main())
