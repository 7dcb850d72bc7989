"""ModelNew on every path a user takes: eager, grad enabled, compiled, exported, AOTInductor.

    python benchmarks/bench_paths.py                          # GPU, the default shape
    python benchmarks/bench_paths.py --device cpu -K 2048 -O 2048 --batches 1 16 256

Impls (each a ModelNew over the run's Model; inference under torch.no_grad() unless named):
  ours_model        eager ModelNew (its fold cached)
  ours_model_grad   eager ModelNew with grad enabled and parameters that require it, forward
                    only (how KernelBench's evaluator calls it)
  model_compile     torch.compile(ModelNew) (dynamic batch)
  model_max_autotune  the same with mode="max-autotune"
  model_freezing    the same with inductor's freezing
  model_export      torch.export.export(ModelNew) (dynamic batch), its .module()
  model_aoti        that exported program through AOTInductor (aoti_compile_and_package); CPU
                    only (loading such a package built for CUDA has crashed in torch's loader)
  ours_op           the op on weights folded once, with its prepared copy (bench_forward.py's)
  op_compile        torch.compile of that call: what any compiled call of the op costs, the floor
                    of the compiled ModelNew paths
  fold_compile      the peer: torch.compile of PyTorch on folded weights (bench_forward.py's)
Every row is checked against a float64 Model as in bench_forward.py; results go to
benchmarks/results/<device>-paths.json and .md (docs/performance.md, "Every path a user takes").
"""

from __future__ import annotations

import sys
import tempfile

import torch

import bench_forward
import common

PATHS_SUFFIX = "-paths"

RUN_ORDER = ["ours_model", "ours_op", "ours_model_grad", "op_compile", "model_compile",
             "model_max_autotune", "model_freezing", "model_export", "model_aoti", "fold_compile"]


def _model_new(ctx, requires_grad=False):
    import fused_pool_gelu

    model = fused_pool_gelu.ModelNew.from_model(ctx.master)
    for parameter in model.parameters():
        parameter.requires_grad_(requires_grad)
    return model


def build_ours_model_grad(ctx):
    model = _model_new(ctx, requires_grad=True)

    def call(x):
        with torch.enable_grad():
            return model(x)

    return call


def _compiled(ctx, **kwargs):
    return torch.compile(_model_new(ctx), dynamic=True, **kwargs)


def build_op_compile(ctx):
    op = bench_forward.build_ours_op(ctx)
    return torch.compile(op, dynamic=True)


def _exported(ctx):
    batch = torch.export.Dim("batch", min=1)
    x = ctx.make_x(2)
    with torch.no_grad():
        return torch.export.export(_model_new(ctx), (x,), dynamic_shapes={"x": {0: batch}})


def build_model_export(ctx):
    return _exported(ctx).module()


def build_model_aoti(ctx):
    if ctx.device.type != "cpu":
        raise RuntimeError("model_aoti: CPU only (a CUDA package of ModelNew's graph has crashed "
                           "at load in torch's AOTInductor; export FoldedModel for AOTI)")
    directory = tempfile.mkdtemp(prefix="fpg-aoti-")
    path = torch._inductor.aoti_compile_and_package(
        _exported(ctx), package_path=f"{directory}/model_new.pt2")
    return torch._inductor.aoti_load_package(path)


BUILDERS = {
    "ours_model": _model_new,
    "ours_op": bench_forward.build_ours_op,
    "op_compile": build_op_compile,
    "ours_model_grad": build_ours_model_grad,
    "model_compile": _compiled,
    "model_max_autotune": lambda ctx: _compiled(ctx, mode="max-autotune"),
    # inductor's freezing as a compile option: read when compiling, not patched around each call.
    "model_freezing": lambda ctx: _compiled(ctx, options={"freezing": True}),
    "model_export": build_model_export,
    "model_aoti": build_model_aoti,
    "fold_compile": bench_forward.build_fold_compile,
}


def main(argv=None) -> int:
    args = common.parse_args("forward", RUN_ORDER, default_deadline_s=420.0, argv=argv)
    if args.device.type != "cpu" and "--impls" not in (argv or sys.argv):
        args.impls = [impl for impl in args.impls if impl != "model_aoti"]
    if args.out is None and not args.no_save:
        args.out = common.default_results_path(args.device, PATHS_SUFFIX)
    with torch.no_grad():
        return common.run_benchmark("forward", args, BUILDERS, RUN_ORDER,
                                    bench_forward.make_reference, bench_forward.measure)


if __name__ == "__main__":
    sys.exit(main())
