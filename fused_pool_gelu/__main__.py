"""The main job: ``python -m fused_pool_gelu``.

Prints what was built, then checks ModelNew against Model (the KernelBench reference) on one
shape and times both: inference under torch.no_grad() and a training step (grads to None,
forward, out.sum().backward() for weight, bias and x). Default shape: B=1024, K=O=8192, k=16,
s=2.0, float32 on a GPU; B=128, K=O=2048 on the CPU (a few seconds on two cores).

The check: max abs error and torch.allclose(atol=rtol=1e-4 in float32) of ModelNew against
Model, and of the gradients of weight, bias and x; the relative error ||out - ref64|| / ||ref64||
of both against a float64 run of Model with the same weights. Exit status 1 when the check fails.

Timing: fused_pool_gelu.measure's timers, as benchmarks/ time: triton.testing.do_bench(...,
return_mode="median") on CUDA (L2 flushed before each run; a CUDA-event timer doing the same when
triton is missing), the median of repeated time.perf_counter() runs on the CPU. Needs torch only.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys

import torch

from fused_pool_gelu.measure import (
    ALLCLOSE_TOL,
    DTYPES,
    make_timer,
    max_abs_error,
    relative_error,
    training_step,
)

# In half precision many pooled features round to the same value, so the arg-max (and with it a
# whole row of the gradient) legitimately differs between implementations: gradients are
# compared for information only there.
GRADS_CHECKED = ("float32", "float64")
GPU_DEFAULTS = dict(batch=1024, in_features=8192, out_features=8192)
CPU_DEFAULTS = dict(batch=128, in_features=2048, out_features=2048)


def _integer_at_least(minimum, text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
    return value


def _positive_int(text):
    return _integer_at_least(1, text)


def _non_negative_int(text):
    return _integer_at_least(0, text)


def _finite_float(text, positive=False):
    what = "a finite number > 0" if positive else "a finite number"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    if not math.isfinite(value) or (positive and value <= 0):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def _repetition_ms(text):
    return _finite_float(text, positive=True)


def _seed(text):
    # torch.manual_seed's range (a negative seed is taken modulo 2**64).
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer in [-2**63, 2**64), got {text!r}")
    if not -(2**63) <= value < 2**64:
        raise argparse.ArgumentTypeError(f"expected an integer in [-2**63, 2**64), got {value}")
    return value


def _device_name(text):
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


def _parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m fused_pool_gelu",
        description="Build info, then ModelNew checked against Model and both timed.",
    )
    p.add_argument("--device", default=None, type=_device_name,
                   help="cuda, cuda:N or cpu (default: cuda when a GPU and the CUDA kernels are "
                        "present)")
    p.add_argument("--batch", "-B", type=_non_negative_int, default=None,
                   help=f"batch size (default {GPU_DEFAULTS['batch']} on a GPU, "
                        f"{CPU_DEFAULTS['batch']} on the CPU)")
    p.add_argument("--in-features", "-K", type=_positive_int, default=None,
                   help=f"default {GPU_DEFAULTS['in_features']} on a GPU, "
                        f"{CPU_DEFAULTS['in_features']} on the CPU")
    p.add_argument("--out-features", "-O", type=_positive_int, default=None,
                   help=f"default {GPU_DEFAULTS['out_features']} on a GPU, "
                        f"{CPU_DEFAULTS['out_features']} on the CPU")
    p.add_argument("--pool", "-k", type=_positive_int, default=16,
                   help="pool kernel size (default 16)")
    # Finite: the check compares with Model, which a non-finite scale turns into NaN / Inf outputs
    # and, through its dense backward, NaN gradients where ours has none (docs/input_classes.md).
    p.add_argument("--scale", type=_finite_float, default=2.0, help="scale factor (default 2.0)")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--seed", type=_seed, default=0,
                   help="torch.manual_seed for weights and x (default 0)")
    p.add_argument("--no-train", action="store_true",
                   help="skip the training-step check and timing")
    p.add_argument("--no-timing", action="store_true", help="check only")
    p.add_argument("--rep", type=_repetition_ms, default=None,
                   help="timed repetition time per measurement in ms "
                        "(default 300 on CUDA, 500 on the CPU)")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------


def _progress(message):
    print(f"  {message} ...", flush=True)


def _fmt_us(us):
    return f"{us / 1e3:9.2f} ms" if us >= 1e4 else f"{us:9.1f} us"


def _train_step(model, x):
    """The training step of a module: gradients of its parameters and x."""
    return training_step(model, x, model.parameters())


def _check_forward(model, new, x, tol):
    """Forward outputs of ModelNew against Model and both against float64. Returns failures."""
    print()
    print("Check (forward):")
    with torch.no_grad():
        ref = model(x)
        out = new(x)
    max_abs = max_abs_error(out, ref)
    close = bool(torch.allclose(out, ref, atol=tol, rtol=tol))
    _progress("building float64 reference")
    model64 = copy.deepcopy(model).to(torch.float64)
    with torch.no_grad():
        ref64 = model64(x.double())
    del model64
    rel_ref, rel_new = relative_error(ref, ref64), relative_error(out, ref64)
    print(f"  ModelNew vs Model: max abs error {max_abs:.2e}, "
          f"allclose(atol=rtol={tol:.0e}): {'yes' if close else 'NO'}")
    print(f"  relative error ||out - ref64|| / ||ref64|| against float64: "
          f"Model {rel_ref:.2e}, ModelNew {rel_new:.2e}")
    return [] if close else ["forward output not allclose to Model"]


def _check_train(model, new, x, tol, strict):
    """One training step of each; output and gradients of weight, bias, x. Returns failures."""
    print()
    print("Check (training step: output and gradients of weight, bias, x):")
    failures = []
    x_ref = x.detach().clone().requires_grad_(True)
    x_new = x.detach().clone().requires_grad_(True)
    out_ref = _train_step(model, x_ref)()
    out_new = _train_step(new, x_new)()
    close = bool(torch.allclose(out_new.detach(), out_ref.detach(), atol=tol, rtol=tol))
    print(f"  output       max abs error {max_abs_error(out_new, out_ref):.2e}, "
          f"allclose(atol=rtol={tol:.0e}): {'yes' if close else 'NO'}")
    if not close:
        failures.append("output of the training step not allclose to Model")
    pairs = [
        ("weight", new.matmul.weight.grad, model.matmul.weight.grad),
        ("bias", new.matmul.bias.grad, model.matmul.bias.grad),
        ("x", x_new.grad, x_ref.grad),
    ]
    for name, got, want in pairs:
        if got is None or want is None:
            print(f"  grad {name:<7} missing in {'ModelNew' if got is None else 'Model'}")
            failures.append(f"gradient of {name} missing")
            continue
        ok = bool(torch.allclose(got, want, atol=tol, rtol=tol))
        print(f"  grad {name:<7} max abs error {max_abs_error(got, want):.2e}, "
              f"allclose(atol=rtol={tol:.0e}): {'yes' if ok else 'NO'}")
        if not ok:
            failures.append(f"gradient of {name} not allclose to Model")
    for m in (model, new):
        m.zero_grad(set_to_none=True)
    if not strict and failures:
        print("  (half precision: arg-max ties move whole gradient rows; "
              "gradients not part of the check)")
        failures = [f for f in failures if not f.startswith("gradient")]
    return failures


def _timings(model, new, x, device, rep_ms, train):
    # A short warm-up: the main job times a few shapes once, not a sweep.
    time_us, timer = make_timer(device, warmup_ms=50.0, rep_ms=rep_ms)
    print()
    print(f"Timing ({timer}):")
    results = []
    with torch.no_grad():
        _progress("inference: Model")
        t_ref = time_us(lambda: model(x))
        _progress("inference: ModelNew")
        t_new = time_us(lambda: new(x))
    results.append(("inference (no_grad)", t_ref, t_new))
    if train:
        _progress("training step: Model")
        t_ref = time_us(_train_step(model, x.detach().clone().requires_grad_(True)))
        _progress("training step: ModelNew")
        t_new = time_us(_train_step(new, x.detach().clone().requires_grad_(True)))
        results.append(("training step", t_ref, t_new))
    print()
    print(f"  {'':<20} {'Model':>12} {'ModelNew':>12} {'speedup':>9}")
    for name, t_ref, t_new in results:
        print(f"  {name:<20} {_fmt_us(t_ref):>12} {_fmt_us(t_new):>12} {t_ref / t_new:8.2f}x")


def main(argv=None) -> int:
    args = _parse(argv)
    import fused_pool_gelu

    info = fused_pool_gelu.build_info()
    print(f"fused_pool_gelu {info['version']}")
    width = max(len(k) for k in info)
    for key, value in info.items():
        print(f"  {key:<{width}}  {value}")

    if args.device is None:
        use_cuda = torch.cuda.is_available() and info.get("cuda_kernels")
        if torch.cuda.is_available() and not info.get("cuda_kernels"):
            print("note: a GPU is present but the CUDA kernels are not compiled in; "
                  "running on the CPU")
        args.device = "cuda" if use_cuda else "cpu"
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device is available", file=sys.stderr)
        return 2
    if device.type == "cpu":
        return _check_and_time(args, device)
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        print(f"error: --device {args.device}, but this machine has {count} CUDA device"
              f"{'s' if count > 1 else ''} (cuda:0 to cuda:{count - 1})", file=sys.stderr)
        return 2
    # The timer's events, synchronize(), do_bench and its L2 flush buffer use the current device.
    with torch.cuda.device(device):
        return _check_and_time(args, device)


def _check_and_time(args, device) -> int:
    from fused_pool_gelu import Model, ModelNew

    defaults = GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.pool > args.out_features:
        print(f"error: --pool ({args.pool}) must be <= --out-features ({args.out_features}), so "
              "that at least one pooled feature exists", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    tol = ALLCLOSE_TOL[args.dtype]
    B, K, O, k, s = args.batch, args.in_features, args.out_features, args.pool, args.scale

    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"cpu ({torch.get_num_threads()} threads)"
    print()
    print(f"Shape: B={B}, K={K}, O={O}, k={k}, s={s}, {args.dtype}, x ~ torch.rand; on {where}")

    _progress(f"building Model (seed {args.seed}) and ModelNew.from_model")
    torch.manual_seed(args.seed)
    model = Model(K, O, k, s)
    x = torch.rand(B, K)
    model = model.to(device=device, dtype=dtype)
    new = ModelNew.from_model(model)
    x = x.to(device=device, dtype=dtype)

    try:
        failures = _check_forward(model, new, x, tol)
        if not args.no_train:
            failures += _check_train(model, new, x, tol, strict=args.dtype in GRADS_CHECKED)
        if not args.no_timing:
            default_rep_ms = 300.0 if device.type == "cuda" else 500.0
            rep_ms = args.rep if args.rep is not None else default_rep_ms
            _timings(model, new, x, device, rep_ms, train=not args.no_train)
    except Exception as error:  # a failing op is a failed check, reported in one line
        print()
        print(f"check FAILED: {type(error).__name__}: {error}")
        return 1

    print()
    if failures:
        print("check FAILED: " + "; ".join(failures))
        return 1
    grads_checked = not args.no_train and args.dtype in GRADS_CHECKED
    checked = "outputs and gradients" if grads_checked else "outputs"
    print(f"check passed: ModelNew matches Model ({checked})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
