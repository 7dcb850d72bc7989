"""A small workload that runs every CUDA kernel once, for compute-sanitizer (scripts/sanitize.sh).

Shapes are small (the tools slow kernels down 10-100x) but odd, so that every tail path, the
small-batch (row-parallel, SIMT and tensor-core split-K GEMV) and the tensor-core forward paths,
the misaligned slow path and the backward (its ops on their own too) all run.
Every forward path runs: the default (on an sm_90a build on Hopper the certified path from 513
rows, 257 with the prepared weight that ModelNew keeps under no_grad, the 3xTF32 wgmma GEMM below),
each of those two forced for every batch (FUSED_POOL_GELU_CERTIFIED=1 / 0), and the portable
mma.sync GEMM (FUSED_POOL_GELU_FORCE_MMA_SYNC=1). The certified pass 1's two partial stores (packed
where N % 4 == 0, one value at a time elsewhere) and the selection's two kernels (four adjacent
columns per thread where N % 4 == 0 and B <= 8 x SMs, one column elsewhere) all run, and with
the certified path forced, its fused rows (33 <= B <= SMs: one CTA per row selects and rescores).
The float16 and bfloat16 forward (cuBLAS's GEMM, then the epilogue) runs on every case except
under racecheck and initcheck (SANITIZE_TOOL, set by sanitize.sh), where the half types run the
fold alone; the backward ops run in every dtype under every tool.
"""

import os

import torch

import fused_pool_gelu as fpg
from fused_pool_gelu._debug import KNOBS, set_debug_knobs

torch.manual_seed(0)
device = "cuda"
ops = torch.ops.fused_pool_gelu
half_types = (torch.bfloat16, torch.float16)
# The half-type forward's z comes from cuBLAS, which racecheck and initcheck cannot follow
# (scripts/sanitize.sh): under those two the half types run their fold and backward kernels only.
half_forward = os.environ.get("SANITIZE_TOOL") not in ("racecheck", "initcheck")
cases = [  # (batch, in_features, out_features, pool_kernel_size)
    (1, 257, 96, 16),      # small batch, K % 4 != 0 (padded slow path), O % k == 0
    (3, 64, 50, 7),        # O % k != 0: tail rows dropped
    (2, 1027, 2402, 4),    # row-parallel GEMV (B <= 4, 600 pooled rows): row and K tails
    (20, 4100, 1000, 1),   # tensor-core GEMV (17-32 rows, Hopper): 4 splits, batch, row, K tails
    (5, 300, 2100, 1),     # the epilogue's 1024-thread CTA per row (N >= 1024, 2 splits), N tail
    (300, 520, 1030, 4),   # tensor-core path with M, N, K tails
    (40, 520, 1030, 4),    # 33 rows to one per SM: the certified path's fused rows (pass 1
    (132, 256, 2048, 4),   # on 128-wide tiles, select_rescore_kernel), FUSED_POOL_GELU_CERTIFIED=1
    (896, 256, 512, 16),   # full tiles (the default takes the certified path; the 3xTF32 GEMM
                           # runs here with FUSED_POOL_GELU_CERTIFIED=0 below)
    (769, 96, 528, 16),    # the default's certified path (B >= 513), N and K tails
    (1100, 64, 1024, 4),   # past 8 x 132 rows: the certified selection's one-column kernel
]
paths = [
    {},
    {"FUSED_POOL_GELU_CERTIFIED": "1"},
    {"FUSED_POOL_GELU_CERTIFIED": "0"},
    {"FUSED_POOL_GELU_FORCE_MMA_SYNC": "1"},
]
for switches, (batch, k_in, o, k) in [(p, c) for p in paths for c in cases]:
    # Exactly this path's knobs, the others unset (fused_pool_gelu._debug).
    set_debug_knobs(**{**dict.fromkeys(KNOBS), **switches})
    model = fpg.ModelNew(k_in, o, k, 2.0).to(device)
    x = torch.rand(batch, k_in, device=device, requires_grad=True)
    out = model(x)
    out.sum().backward()
    with torch.no_grad():
        misaligned = torch.rand(batch, k_in + 1, device=device)[:, 1:]
        model(misaligned)
    for dtype in half_types:
        with torch.no_grad():
            half = model.to(dtype)
            if half_forward:
                half(x.detach().to(dtype))
            else:
                ops.fold(half.matmul.weight, half.matmul.bias, k)
        model.float()
# The backward ops on their own: forward_backward (empty groups zeroed) and model_backward, over
# more rows than the grouping's one-tile path takes (4096) and over fewer, some rows with an
# arg-max out of range (in no group), in every dtype.
for dtype, batch in [(d, b) for d in (torch.float32,) + half_types for b in (4500, 1000)]:
    x = torch.rand(batch, 40, device=device, dtype=dtype)
    pooled_weight = torch.rand(24, 40, device=device, dtype=dtype)
    argmax = torch.randint(-1, 25, (batch,), device=device)
    grad_out = torch.rand(batch, device=device, dtype=dtype)
    preactivation = torch.rand(batch, device=device, dtype=dtype)
    ops.forward_backward(grad_out, None, x, pooled_weight, argmax, preactivation, 2.0)
    ops.model_backward(grad_out, x, pooled_weight, argmax, preactivation, 2.0, 99, 4)
torch.cuda.synchronize()
print("sanitize case: ok")
