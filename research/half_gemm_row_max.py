"""Does a half-type GEMM with the GELU and row arg-max fused into its epilogue
(research/half_gemm_row_max.cu) beat cuBLAS's GEMM plus the package's epilogue?

Builds the .cu into a shared library (nvcc, sm_90a), then for each batch size: times cuBLAS's
GEMM alone (``torch.mm(x, w.t(), out_dtype=torch.float32)``, what the package's half path runs
before its epilogue), the package's op and each variant of the experiment with
``triton.testing.do_bench`` (L2 flushed, median), and checks every variant against the op: the
same arg-max in every row, the output's largest relative difference, and both outputs' error
against float64. Needs an H100 / H200-class GPU (sm_90a), nvcc, triton and the installed package.
What it measured: research/README.md.

    python research/half_gemm_row_max.py --batches 2048 4096 --variants 0 4 5
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import tempfile

import torch
import triton.testing

import fused_pool_gelu  # noqa: F401  (registers torch.ops.fused_pool_gelu)

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "half_gemm_row_max.cu")
VARIANTS = {
    0: "6 stages",
    1: "K tiles of 128, 3 stages",
    2: "4 stages",
    3: "K tiles of 128, 2 stages",
    4: "7 stages",
    5: "6 stages, clusters of 2",
    6: "7 stages, clusters of 2",
}
BLOCK_N = 128  # the experiment's column tile


def build(out_dir):
    library = os.path.join(out_dir, "libhalf_gemm_row_max.so")
    nvcc = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    # csrc/ for argmax_band.h, the package's band rule that the kernel's epilogue applies.
    subprocess.run(
        [nvcc, "-O3", "-std=c++20", "--expt-relaxed-constexpr",
         "-gencode=arch=compute_90a,code=sm_90a", "-shared",
         "-Xcompiler", "-fPIC", f"-I{os.path.join(HERE, '..', 'csrc')}", "-o", library, SOURCE],
        check=True,
    )
    lib = ctypes.CDLL(library)
    lib.half_gemm_row_max.restype = ctypes.c_int
    return lib


def fused(lib, x, w, b, scale, variant, parts):
    rows, k = x.shape
    out = torch.empty(rows, device=x.device, dtype=x.dtype)
    argmax = torch.empty(rows, device=x.device, dtype=torch.long)
    pre = torch.empty(rows, device=x.device, dtype=x.dtype)
    p = ctypes.c_void_p
    error = lib.half_gemm_row_max(
        p(x.data_ptr()), p(w.data_ptr()), p(b.data_ptr()), ctypes.c_float(scale), rows,
        w.shape[0], k, *(p(t.data_ptr()) for t in parts), p(out.data_ptr()),
        p(argmax.data_ptr()), p(pre.data_ptr()), int(x.dtype == torch.bfloat16), variant,
        p(torch.cuda.current_stream().cuda_stream))
    if error != 0:
        raise RuntimeError(f"half_gemm_row_max: variant {variant} failed, cudaError {error}")
    return out, argmax, pre


def median_us(fn):
    return 1e3 * triton.testing.do_bench(fn, warmup=100, rep=500, return_mode="median")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--variants", type=int, nargs="+", default=[0, 4, 5],
                        choices=sorted(VARIANTS))
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("-K", type=int, default=8192)
    parser.add_argument("-N", type=int, default=512, help="pooled features")
    args = parser.parse_args()
    if args.K % 8:
        parser.error(f"-K must be a multiple of 8 (the TMA row stride), got {args.K}")
    dtype = getattr(torch, args.dtype)
    scale = 2.0
    with tempfile.TemporaryDirectory() as out_dir:
        lib = build(out_dir)
        torch.manual_seed(0)
        w = ((torch.rand(args.N, args.K, device="cuda") * 2 - 1) * args.K ** -0.5).to(dtype)
        b = (torch.rand(args.N, device="cuda") * 0.2 - 0.1).to(dtype)
        names = [f"v{v} ({VARIANTS[v]})" for v in args.variants]
        print("| B | cuBLAS GEMM alone | op | " + " | ".join(names)
              + " | arg-max as the op | max rel diff of out | rel err vs float64 (op) |")
        print("|---" * (4 + len(names) + 2) + "|")
        for batch in args.batches:
            x = torch.rand(batch, args.K, device="cuda").to(dtype)
            tiles = -(-args.N // BLOCK_N)
            parts = (torch.empty(batch * tiles, device="cuda"),
                     torch.empty(batch * tiles, device="cuda", dtype=torch.int32),
                     torch.empty(batch * tiles, device="cuda"))
            ref_out, ref_argmax, _ = torch.ops.fused_pool_gelu.forward_with_argmax(x, w, b, scale)
            ref64 = (torch.nn.functional.gelu(x.double() @ w.double().t() + b.double())
                     * scale).max(1).values
            row = [str(batch),
                   f"{median_us(lambda: torch.mm(x, w.t(), out_dtype=torch.float32)):.1f}",
                   f"{median_us(lambda: torch.ops.fused_pool_gelu.forward(x, w, b, scale)):.1f}"]
            agree, rel_diff, errors = [], [], []
            for variant in args.variants:
                out, argmax, _ = fused(lib, x, w, b, scale, variant, parts)
                agree.append((argmax == ref_argmax).float().mean().item())
                rel_diff.append(((out.float() - ref_out.float()).abs()
                                 / ref_out.float().abs().clamp_min(1e-30)).max().item())
                errors.append(((out.double() - ref64).norm() / ref64.norm()).item())
                row.append(f"{median_us(lambda: fused(lib, x, w, b, scale, variant, parts)):.1f}")
            op_error = ((ref_out.double() - ref64).norm() / ref64.norm()).item()
            row += [f"{min(agree):.4f}", f"{max(rel_diff):.1e}",
                    f"{max(errors):.1e} ({op_error:.1e})"]
            print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
