"""How tight is the certified forward's bound, and how many columns does each row send to the
rescoring, for a given shape, data and pass-1 operand format? A CPU model (numpy, torch) of the
certified path's pass 1 and selection (docs/design.md; csrc/cuda/certified.cu), no GPU needed.

    python research/simulate_certified.py                  # default shape, x ~ randn, 3 seeds
    python research/simulate_certified.py --x-dist rand -B 1024 -K 8192 -N 512 --splits 8
    python research/simulate_certified.py --x-dist rand --weights model   # the benchmarks' data
    python research/simulate_certified.py --x-dist rand --weights model --operands bf16
    python research/simulate_certified.py --x-dist rand --weights model -B 16 --splits 16 \
        --operands int8-weight
    python research/simulate_certified.py --x-dist rand --weights model --partials float32

--weights uniform draws the pooled weight like one nn.Linear(K, N) row set; --weights model draws
nn.Linear(K, N * k) (k = 16) and pools it as the fold does, which is what the benchmarks run.

Pass 1 is emulated as the bound models it: operands as the kernel's fp16 copies (each row scaled
by a power of two), float32 products and sums per split, each split's partial rounded to bfloat16
as the kernel stores it, with the bound's term for that storage ((2^-8 + gamma_{S+1}) sum |p^_s| +
gamma_{S+1} |bias| more; --partials float32 leaves both out), then split sums and bias in float32.
The other --operands are what-ifs (OPERANDS below); the bound takes the residual norms of
whichever format. The bound (with the rows' residual norms) and the interval GELU use the kernel's
constants (computed here in float64, which only makes them marginally tighter). Prints, per seed:
the largest |z~ - z64| / E (must stay below 1), the mean E relative to the spread of z, the
candidates per row (mean, quantiles, rows over the kernel's 64) and whether the float64 arg-max
was always a candidate. research/README.md lists what its runs found.
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch

X0 = -0.7517915246935645  # argmin of gelu
GELU_MIN = -0.16997120747990369
POOL = 16  # the default pooling window, for --weights model


def gamma(terms, u):
    return terms * u / (1 - terms * u)


def gelu(z):
    return 0.5 * z * (1 + torch.special.erf(torch.from_numpy(z) / math.sqrt(2)).numpy())


def tf32(a):
    return (a.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)


def fp16_scaled(a):
    """Each row scaled by a power of two (its largest |value| to [2^14, 2^15), exponent within
    +-63), rounded to nearest fp16, values below 2^-14 (scaled) flushed to 0, scaled back: the
    kernel's scaled fp16 copies, as float32."""
    largest = np.abs(a).max(axis=1, keepdims=True)
    exponent = np.where(largest > 0, 14 - np.floor(np.log2(np.where(largest > 0, largest, 1))), 0)
    scale = np.exp2(np.clip(exponent, -63, 63)).astype(np.float32)
    scaled = a * scale
    scaled = np.where(np.abs(scaled) < 2.0**-14, 0, scaled).astype(np.float32)
    return (scaled.astype(np.float16).astype(np.float32) / scale).astype(np.float32)


def bf16(a):
    """Rounded to nearest (ties to even) to bfloat16, as a float32 array (finite inputs)."""
    bits = a.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def int8_rows(a):
    """Each row scaled by its largest |value| / 127 and rounded to int8, scaled back, as float32:
    a 1-byte copy with 8 bits for every element, where fp8 keeps 4 significant bits."""
    largest = np.abs(a).max(axis=1, keepdims=True).astype(np.float64)
    scale = np.where(largest > 0, largest / 127, 1)
    return (np.rint(a / scale) * scale).astype(np.float32)


# Pass 1's (x, weight) operand formats: fp16 copies of both, each row scaled by a power of two
# (the kernel's: fp16 rounds to nearest where the tensor core truncates to TF32, at twice TF32's
# rate and half its bytes). What-ifs: TF32 for both (an earlier form of the kernel); bf16 for both
# (a faster tensor-core pass); a float32 x against a bf16 copy of the weight (a small-batch GEMV on
# CUDA cores, bound by reading the weight: half the bytes); TF32 x against a bf16 copy of the
# weight (a TF32 tensor-core pass reading the bf16 copy, whose values TF32 holds exactly); a
# float32 x against an int8 copy of the weight with a scale per row (a GEMV reading 1 byte per
# weight element).
OPERANDS = {
    "tf32": (tf32, tf32),
    "bf16": (bf16, bf16),
    "bf16-weight": (lambda a: a, bf16),
    "tf32-x-bf16-weight": (tf32, bf16),
    "fp16-scaled": (fp16_scaled, fp16_scaled),
    "int8-weight": (lambda a: a, int8_rows),
}


def simulate(batch, in_features, pooled, splits, scale, x_dist, weights, seed,
             operands="fp16-scaled", partials="bfloat16"):
    convert_x, convert_w = OPERANDS[operands]
    torch.manual_seed(seed)
    bound = 1 / math.sqrt(in_features)
    if x_dist == "randn":
        x = torch.randn(batch, in_features, dtype=torch.float64)
    else:
        x = torch.rand(batch, in_features, dtype=torch.float64)
    x = x.float().numpy()
    rows = pooled * (POOL if weights == "model" else 1)
    w = (torch.rand(rows, in_features) * 2 - 1) * bound
    b = (torch.rand(rows) * 2 - 1) * bound
    if weights == "model":
        w = w.view(pooled, POOL, in_features).mean(1)
        b = b.view(pooled, POOL).mean(1)
    w, b = w.float().numpy(), b.float().numpy()

    z_pass1 = np.zeros((batch, pooled), np.float32)
    partial_magnitudes = np.zeros((batch, pooled), np.float64)
    edges = np.linspace(0, in_features, splits + 1).astype(int)
    for lo, hi in zip(edges[:-1], edges[1:]):
        partial = (convert_x(x[:, lo:hi]) @ convert_w(w[:, lo:hi]).T).astype(np.float32)
        if partials == "bfloat16":
            partial = bf16(partial)
        z_pass1 += partial
        partial_magnitudes += np.abs(partial)
    z_pass1 += b
    z64 = x.astype(np.float64) @ w.astype(np.float64).T + b

    k, s = in_features, splits
    # One tensor-core chain per split (certified_pass1_kernel), then float32 sums.
    chain = math.ceil(k / s)
    g_sum = gamma(math.ceil(k / chain) + s + 2, 2.0**-24)
    g_tc = gamma(math.ceil(chain / 8), 10 * 2.0**-23)
    g = g_tc * (1 + g_sum) + g_sum
    slack = 1 + gamma(k + s, 2.0**-24) + 2.0**-22

    def norm(a):
        return np.sqrt((a.astype(np.float64) ** 2).sum(1)) * slack

    x_norm, w_norm = norm(x), norm(w)
    x_residual, w_residual = norm(x - convert_x(x)), norm(w - convert_w(w))
    product = np.outer(x_norm, w_norm)
    operand = np.outer(x_norm, w_residual) + np.outer(x_residual, w_norm + w_residual)
    # rescore_depth: the rescoring's FMA chain over k / 256 floats per thread, then 13 additions.
    rho = gamma(4 * math.ceil(k / 1024) + 13, 2.0**-24)
    e = (1 + g) * operand + g * product + g_sum * np.abs(b) + rho * (product + np.abs(b))
    if partials == "bfloat16":
        # The bound's storage term: the partials' rounding to bfloat16 and the float32 sum of the
        # rounded partials.
        g_stored = gamma(s + 1, 2.0**-24)
        e = e + (2.0**-8 + g_stored) * partial_magnitudes + g_stored * np.abs(b)

    a, c = z_pass1 - e, z_pass1 + e
    g_lo = np.where(c <= X0, gelu(c), np.where(a >= X0, gelu(a), GELU_MIN))
    g_hi = np.maximum(gelu(a), gelu(c))
    lo, hi = (scale * g_lo, scale * g_hi) if scale > 0 else (scale * g_hi, scale * g_lo)
    best_lower = lo.max(axis=1, keepdims=True)
    candidates = (hi >= best_lower).sum(axis=1)
    argmax64 = (gelu(z64) * scale).argmax(axis=1)
    covered = bool((hi[np.arange(batch), argmax64] >= best_lower[:, 0]).all())
    return {
        "max_err_over_bound": float((np.abs(z_pass1 - z64) / e).max()),
        "bound_over_std_z": float(e.mean() / z64.std()),
        "candidates_mean": float(candidates.mean()),
        "candidates_q50_q99_q999_max": np.quantile(candidates, [0.5, 0.99, 0.999, 1.0]).tolist(),
        "rows_over_64": int((candidates > 64).sum()),
        "argmax_always_candidate": covered,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-B", type=int, default=1024)
    parser.add_argument("-K", type=int, default=8192)
    parser.add_argument("-N", type=int, default=512)
    parser.add_argument("--splits", type=int, default=8)
    parser.add_argument("--scale", type=float, default=2.0)
    parser.add_argument("--x-dist", choices=["randn", "rand"], default="randn")
    parser.add_argument("--weights", choices=["uniform", "model"], default="uniform")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--operands", choices=sorted(OPERANDS), default="fp16-scaled",
                        help="pass 1's operand format (the kernel's is fp16-scaled; the others "
                             "are what-ifs)")
    parser.add_argument("--partials", choices=["float32", "bfloat16"], default="bfloat16",
                        help="how the split partials are stored (the kernel: bfloat16)")
    args = parser.parse_args()
    for seed in args.seeds:
        print(seed, simulate(args.B, args.K, args.N, args.splits, args.scale, args.x_dist,
                             args.weights, seed, args.operands, args.partials))


if __name__ == "__main__":
    main()
