"""Train ModelNew on a synthetic regression task; with --compare, train Model beside it and compare.

    python examples/train.py --device cpu --compare               # < 1 minute on 2 CPU cores
    python examples/train.py --device cpu --compare --amp         # bf16 autocast, looser --tol
    python examples/train.py --device cuda --compare --compile --steps 1000
    torchrun --nproc-per-node 2 examples/train.py --ddp --compare # DistributedDataParallel

The task: a fixed random teacher (a Model from another seed) labels random inputs, and the student
regresses its [B] outputs with MSE and SGD. ModelNew and Model start from the same seed, so they
hold the same parameters, see the same batches and should report the same losses step after step;
the script prints the largest relative difference and exits with status 1 if it passes --tol. A
non-finite loss stops the run with status 1.
Under --ddp every rank draws its own batches, and the printed losses are the mean over ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fused_pool_gelu
from fused_pool_gelu import Model, ModelNew

# Tolerance on the relative loss difference, per precision. float32: the models differ only in
# rounding (folded vs unfolded GEMM), ~1e-6. amp: both compute in bf16 but round in different
# places, ~4e-3 per output, which the MSE magnifies (6e-2 at worst over 200 default CPU steps).
DEFAULT_TOLERANCE = {"float32": 1e-4, "amp": 0.1}
PROGRESS_BAR_WIDTH = 20


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu or cuda (default: cuda when available)")
    add("--steps", type=int, default=200, help="optimizer steps (default: 200)")
    add("--batch", type=int, default=64, help="batch size per rank (default: 64)")
    add("--in-features", type=int, default=256, help="K (default: 256)")
    add("--out-features", type=int, default=512, help="O (default: 512)")
    add("--pool", type=int, default=16, help="pool kernel size k (default: 16)")
    add("--scale", type=float, default=2.0, help="scale factor (default: 2.0)")
    add("--lr", type=float, default=0.1, help="SGD learning rate (default: 0.1)")
    add("--seed", type=int, default=0, help="seed of the models and the data (default: 0)")
    add("--compare", action="store_true", help="also train Model and compare the losses")
    add("--compile", action="store_true", help="torch.compile the models")
    add("--amp", action="store_true",
        help="bf16 autocast for the forward passes (looser default --tol, see the source)")
    add("--ddp", action="store_true",
        help="DistributedDataParallel over torchrun's ranks (gloo on cpu, nccl on cuda)")
    add("--log-every", type=int, default=25, help="progress line every N steps (default: 25)")
    add("--tol", type=float, default=None,
        help="largest relative loss difference allowed with --compare (default: "
             f"{DEFAULT_TOLERANCE['float32']}; with --amp, {DEFAULT_TOLERANCE['amp']})")
    args = parser.parse_args(argv)
    for name in ("steps", "batch", "in_features", "out_features", "pool", "log_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.pool > args.out_features:
        parser.error(f"--pool must be <= --out-features ({args.out_features}), got {args.pool}")
    for name in ("scale", "lr"):
        if not math.isfinite(getattr(args, name)):
            parser.error(f"--{name} must be a finite number, got {getattr(args, name)}")
    if args.tol is None:
        args.tol = DEFAULT_TOLERANCE["amp" if args.amp else "float32"]
    return args


def setup_device(args):
    """(device, rank, world_size), initializing torch.distributed under --ddp."""
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("--device cuda: no CUDA GPU is available "
                     "(torch.cuda.is_available() is False)")
        if not fused_pool_gelu.build_info()["cuda_kernels"]:
            sys.exit("--device cuda: fused_pool_gelu was built without CUDA kernels; rebuild it "
                     "with a CUDA toolkit (FUSED_POOL_GELU_CUDA=1) or use --device cpu")
    elif device.type != "cpu":
        sys.exit(f"--device must be cpu or cuda, got {args.device}")
    if not args.ddp:
        return device, 0, 1
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        sys.exit("--ddp: launch with torchrun, e.g. "
                 "`torchrun --nproc-per-node 2 examples/train.py --ddp`; "
                 "got no RANK / WORLD_SIZE in the environment")
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device, dist.get_rank(), dist.get_world_size()


def build(cls, args, device):
    """A model of `cls` from args.seed: the same parameters for ModelNew and Model."""
    torch.manual_seed(args.seed)
    model = cls(args.in_features, args.out_features, args.pool, args.scale).to(device)
    if args.ddp:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    if args.compile:
        model = torch.compile(model)
    return model


class Trainer:
    """One model, its optimizer, and the time its steps took."""

    def __init__(self, name, model, args, device):
        self.name = name
        self.model = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
        self.device = device
        self.autocast = (
            (lambda: torch.autocast(device.type, dtype=torch.bfloat16))
            if args.amp
            else contextlib.nullcontext
        )
        self.first_step_s = 0.0
        self.later_steps_s = 0.0
        self.out_dtype = None

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self, step, x, target):
        """Loss before this step's update (a 0-d tensor)."""
        self._sync()
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        with self.autocast():
            out = self.model(x)
        self.out_dtype = out.dtype
        loss = F.mse_loss(out.float(), target)
        loss.backward()
        self.optimizer.step()
        self._sync()
        elapsed = time.perf_counter() - start
        if step == 0:
            self.first_step_s = elapsed  # warm-up (and compilation under --compile), reported apart
        else:
            self.later_steps_s += elapsed
        return loss.detach()


def batch(args, step, rank, device, teacher):
    """Inputs and the teacher's targets, the same for every model at this (step, rank)."""
    # Distinct primes keep the streams of different (seed, step, rank) apart.
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
    x = torch.rand(args.batch, args.in_features, generator=generator).to(device)
    with torch.no_grad():
        target = teacher(x)
    return x, target


def mean_over_ranks(value, args):
    if args.ddp:
        value = value.clone()
        dist.all_reduce(value)  # SUM: gloo has no AVG
        value /= dist.get_world_size()
    return value


def progress(step, args, losses, max_diff, trainers):
    """One line: step, a bar, the losses, the worst difference so far and the mean step times."""
    bar = "#" * round((step + 1) / args.steps * PROGRESS_BAR_WIDTH)
    line = f"step {step + 1:>{len(str(args.steps))}}/{args.steps} [{bar:<{PROGRESS_BAR_WIDTH}}]"
    line += f" loss {losses[0]:.6e}"
    if len(losses) > 1:
        line += f"  Model {losses[1]:.6e}  max rel diff {max_diff:.1e}"
    later_steps = max(step, 1)
    times = "  ".join(f"{t.name} {1e3 * t.later_steps_s / later_steps:.2f}" for t in trainers)
    return line + f"  ms/step: {times}"


def main(argv=None):
    args = parse_args(argv)
    device, rank, world_size = setup_device(args)
    try:
        return train(args, device, rank, world_size)
    finally:
        if args.ddp:
            # train()'s DDP models, whose reducers hold the process group, are gone by now: the
            # group's last references go here, not at interpreter exit, where a gloo rank tearing
            # its worker threads down can abort ("terminate called without an active exception").
            gc.collect()
            dist.destroy_process_group()


def train(args, device, rank, world_size):
    """The training loop and its report; the exit status (1 if --compare found the models apart)."""
    log = print if rank == 0 else (lambda *a, **k: None)
    flags = "".join(f" --{flag}" for flag in ("compile", "amp", "ddp") if getattr(args, flag))
    log(f"fused_pool_gelu {fused_pool_gelu.__version__} on {device}, torch {torch.__version__}: "
        f"K={args.in_features} O={args.out_features} k={args.pool} scale={args.scale} "
        f"batch={args.batch}x{world_size} steps={args.steps} lr={args.lr}{flags}")

    torch.manual_seed(args.seed + 1)  # the teacher: a fixed random target function
    teacher = Model(args.in_features, args.out_features, args.pool, args.scale).to(device)
    trainers = [Trainer("ModelNew", build(ModelNew, args, device), args, device)]
    if args.compare:
        trainers.append(Trainer("Model", build(Model, args, device), args, device))

    max_diff = 0.0
    for step in range(args.steps):
        x, target = batch(args, step, rank, device, teacher)
        step_losses = torch.stack([trainer.step(step, x, target) for trainer in trainers])
        if args.amp and step == 0:
            # Both follow autocast's dtype (bfloat16): Model through nn.Linear, ModelNew through
            # the autocast kernels of fused_pool_gelu's ops. The losses are computed in float32.
            log("--amp: output dtype " + ", ".join(f"{t.name} {t.out_dtype}" for t in trainers))
        if args.compare:
            # Per rank, then the worst over ranks, so that every rank takes the same exit status.
            # (clamp: a reference loss of exactly 0 must not divide by zero.)
            diff = (step_losses[0] - step_losses[1]).abs() / step_losses[1].abs().clamp_min(1e-30)
            diff = diff.reshape(1)
            if args.ddp:
                dist.all_reduce(diff, op=dist.ReduceOp.MAX)
            max_diff = max(max_diff, diff.item())
        losses = mean_over_ranks(step_losses, args).tolist()
        if not all(math.isfinite(loss) for loss in losses):
            # Every rank sees the same mean losses: all stop here.
            named = ", ".join(f"{t.name} {loss:g}" for t, loss in zip(trainers, losses))
            log(f"step {step + 1}: non-finite loss ({named}); stopping with status 1")
            return 1
        if step == 0:
            first_losses = losses
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            log(progress(step, args, losses, max_diff, trainers))

    for trainer, first, last in zip(trainers, first_losses, losses):
        times = f"first step {1e3 * trainer.first_step_s:.1f} ms"
        if args.steps > 1:
            times += f", then {1e3 * trainer.later_steps_s / (args.steps - 1):.2f} ms/step"
        log(f"{trainer.name:>8}: loss {first:.6e} -> {last:.6e}; {times}")
    status = 0
    if args.compare:
        agree = max_diff <= args.tol
        log(f"max relative loss difference ModelNew vs Model: {max_diff:.3e} "
            f"({'within' if agree else 'BEYOND'} --tol {args.tol:g})")
        status = 0 if agree else 1
    return status


if __name__ == "__main__":
    sys.exit(main())
