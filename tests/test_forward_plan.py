"""The CUDA forward's plan (csrc/cuda/forward_plan.h), checked on the CPU.

forward_plan.h is plain C++: this test compiles it into tests/forward_plan_driver.cpp with the
system's C++ compiler and asks it which path, GEMM, tiles, splits and epilogue serve a shape on a
made-up device. The GPU tests check that the kernels the plan names are the ones that run.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "forward_plan_driver.cpp"

# DeviceLimits of an H100 SXM or H200 with an sm_90a build, as fused_pool_gelu._C._device_limits
# reads them there (132 SMs; resident CTAs per SM of each kernel, the SIMT GEMV's per batch tile 1,
# 2, 4, 8, 16), and of an A100-class device without the wgmma and tensor-core GEMV kernels (108
# SMs, 164 KB of shared memory per SM).
HOPPER = dict(sms=132, simt=(4, 3, 3, 2, 2), tc_gemv=1, tc=1, wgmma=1, epilogue=8,
              smem_per_sm=233472, spread_smem_max=116737, dependent_launch=1)
AMPERE = dict(sms=108, simt=(4, 3, 3, 2, 2), tc_gemv=0, tc=1, wgmma=0, epilogue=8,
              smem_per_sm=167936, spread_smem_max=83969, dependent_launch=0)

K, N = 8192, 512  # the default shape's pooled weight


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    if not (ROOT / "csrc" / "cuda" / "forward_plan.h").exists():
        pytest.skip("needs the source tree's csrc/ (run from a checkout or an unpacked sdist)")
    compiler = shlex.split(os.environ.get("CXX", "")) or [shutil.which("c++") or "g++"]
    binary = tmp_path_factory.mktemp("plan") / "forward_plan_driver"
    subprocess.run(
        compiler + ["-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", f"-I{ROOT / 'csrc'}",
                    str(DRIVER), "-o", str(binary)],
        check=True, capture_output=True, text=True,
    )
    return binary


def plan(driver, batch, n=N, k=K, *, operands="f32", prepared=False, scale=2.0,
         unit_strides=True, certified="auto", force_mma_sync=False, limits=HOPPER):
    args = [limits["sms"], *limits["simt"], limits["tc_gemv"], limits["tc"], limits["wgmma"],
            limits["epilogue"], limits["smem_per_sm"], limits["spread_smem_max"],
            limits["dependent_launch"]]
    line = (f"{batch} {n} {k} {operands} {int(prepared)} {scale} {int(unit_strides)} "
            f"{certified} {int(force_mma_sync)}\n")
    result = subprocess.run([str(driver), *map(str, args)], input=line, capture_output=True,
                            text=True, check=True)
    return dict(pair.split("=") for pair in result.stdout.split())


@pytest.mark.parametrize("batch", [1, 2, 3, 4])
def test_up_to_four_rows_take_the_row_parallel_gemv_without_splits(driver, batch):
    p = plan(driver, batch)
    assert (p["path"], p["gemm"], p["splits"]) == ("split_k", "rowwise", "1")
    assert p["epilogue_threads_per_row"] == "256"


def test_four_rows_of_a_narrow_weight_take_the_split_k_gemv(driver):
    # 64 rows make 16 row-parallel CTAs: too few for 132 SMs.
    p = plan(driver, 4, n=64)
    assert (p["gemm"], p["batch_tile"]) == ("simt", "4")


@pytest.mark.parametrize("batch, tile", [(5, "8"), (9, "16"), (16, "16")])
def test_five_to_sixteen_rows_take_the_simt_gemv(driver, batch, tile):
    p = plan(driver, batch)
    assert (p["gemm"], p["batch_tile"]) == ("simt", tile)
    assert int(p["splits"]) > 1


@pytest.mark.parametrize("batch", [17, 24, 32])
def test_17_to_32_rows_of_a_large_weight_take_the_tensor_core_gemv(driver, batch):
    assert plan(driver, batch)["gemm"] == "tc_gemv"


def test_17_to_32_rows_of_a_small_weight_keep_the_exact_simt_gemv(driver):
    # 2^21 floats (128 x 16384) is not more than kTcSmallBatchMinWeightFloats.
    assert plan(driver, 24, n=128, k=16384)["gemm"] == "simt"


def test_the_tensor_core_gemv_needs_a_wide_enough_grid(driver):
    # 512 x 4100: 16 row tiles x 6 splits = 96 CTAs < 75% of 132 SMs: the wgmma GEMM instead.
    p = plan(driver, 24, n=512, k=4100)
    assert (p["gemm"], p["wgmma"]) == ("tc", "1")


def test_without_the_hopper_kernels_small_batches_keep_the_simt_gemv(driver):
    assert plan(driver, 24, limits=AMPERE)["gemm"] == "simt"
    p = plan(driver, 128, prepared=True, limits=AMPERE)
    assert (p["path"], p["gemm"], p["wgmma"]) == ("split_k", "tc", "0")


@pytest.mark.parametrize("batch", [33, 64, 128, 132])
def test_33_rows_to_one_per_sm_take_the_fused_certified_rows_with_a_prepared_weight(driver, batch):
    p = plan(driver, batch, prepared=True)
    assert (p["path"], p["fused_rows"], p["block_n"]) == ("certified", "1", "128")
    assert p["block_m"] == ("64" if batch <= 64 else "128")
    # Splits of at least 4 K tiles that fill the GPU: one row tile x 4 column tiles x 32 splits
    # = 128 CTAs up to 128 rows; two row tiles x 4 x 16 at 132.
    assert p["splits"] == ("32" if batch <= 128 else "16")


@pytest.mark.parametrize("batch", [33, 128, 256])
def test_without_a_prepared_weight_the_3xtf32_gemm_serves_up_to_512_rows(driver, batch):
    p = plan(driver, batch)
    assert (p["path"], p["gemm"], p["wgmma"]) == ("split_k", "tc", "1")


@pytest.mark.parametrize("batch, prepared, path", [
    (256, True, "split_k"), (257, True, "certified"),
    (512, False, "split_k"), (513, False, "certified"),
])
def test_the_certified_path_starts_at_its_thresholds(driver, batch, prepared, path):
    assert plan(driver, batch, prepared=prepared)["path"] == path


def test_the_default_shape_at_1024_rows_takes_8_certified_splits(driver):
    p = plan(driver, 1024, prepared=True)
    assert (p["path"], p["fused_rows"], p["block_m"], p["block_n"], p["splits"]) == (
        "certified", "0", "128", "256", "8")


@pytest.mark.parametrize("n, k, batch, path", [
    (128, 8192, 4096, "split_k"),   # narrower than 256 columns: never
    (256, 8192, 1024, "certified"),  # 2^21 floats, B x N x K = 2^31: the large-work rule
    (256, 8192, 513, "split_k"),     # the same weight below 2^31 multiply-adds
    (512, 2048, 1024, "split_k"),    # 2^20 floats at N = 512: below kCertifiedMinWeightFloats
    (8192, 512, 1024, "split_k"),    # more columns than the selection serves
])
def test_narrow_or_small_weights_stay_on_3xtf32(driver, n, k, batch, path):
    assert plan(driver, batch, n=n, k=k)["path"] == path


def test_the_knobs_force_each_path(driver):
    assert plan(driver, 1024, prepared=True, certified="0")["path"] == "split_k"
    # Forced on, the certified path serves a batch it would not pay at (40 rows, no copy).
    assert plan(driver, 40, certified="1")["path"] == "certified"
    p = plan(driver, 1024, prepared=True, force_mma_sync=True)
    assert (p["path"], p["gemm"], p["wgmma"]) == ("split_k", "tc", "0")
    # Forced on, it still needs what it applies to: a finite non-zero scale, B > 32.
    assert plan(driver, 1024, certified="1", scale=0.0)["path"] == "split_k"
    assert plan(driver, 32, certified="1")["path"] == "split_k"


def test_no_in_features_needs_no_gemm(driver):
    p = plan(driver, 5, k=0)
    assert (p["path"], p["epilogue_split_bound"]) == ("no_gemm", "0")


@pytest.mark.parametrize("batch, slices", [(256, "1"), (1024, "4"), (2048, "2"), (4096, "1")])
def test_half_types_slice_k_while_their_tiles_fit_the_sms(driver, batch, slices):
    p = plan(driver, batch, operands="half")
    assert (p["path"], p["splits"]) == ("half_gemm", slices)


def test_half_types_keep_one_slice_for_strided_operands(driver):
    assert plan(driver, 1024, operands="half", unit_strides=False)["splits"] == "1"


def test_large_batches_go_in_slices_of_whole_tiles(driver):
    # 8192 x 1024 outputs pass the 2^22-float workspace: slices of 4096 rows (32 tiles of 128).
    p = plan(driver, 8192, n=1024, k=1024, certified="0")
    assert (p["path"], p["slice_rows"]) == ("split_k", "4096")


@pytest.mark.parametrize("batch, n, threads, columns", [
    (128, 512, "256", "1"),      # few rows, many splits: a CTA per row
    (8192, 512, "32", "4"),      # rows that fill the GPU: a warp per row, 16-byte loads
    (24, 4096, "1024", "1"),     # wide rows with few splits: 1024 threads per row
])
def test_the_epilogue_form_follows_rows_and_width(driver, batch, n, threads, columns):
    p = plan(driver, batch, n=n, certified="0")
    assert (p["epilogue_threads_per_row"], p["epilogue_columns_per_load"]) == (threads, columns)


def test_the_driver_refuses_a_wrong_limit_count(driver):
    result = subprocess.run([str(driver), "132"], input="", capture_output=True, text=True)
    assert result.returncode == 2 and "usage" in result.stderr


# ----------------------------------------------------------------------------------------------
# On a GPU: the kernels that run are the ones the plan names for this device's limits.

_GEMM_KERNEL = {"rowwise": "rowwise_gemv_kernel", "simt": "simt_splitk_kernel",
                "tc_gemv": "tf32x3_gemv_splitk_kernel"}


def _expected_kernels(p):
    """Substrings of the kernel names a call with plan p launches (conftest's kernels_run)."""
    if p["path"] == "certified":
        # "::" keeps rescore_kernel from matching select_rescore_kernel.
        rest = (["select_rescore_kernel"] if p["fused_rows"] == "1"
                else ["select_candidates_kernel", "::rescore_kernel"])
        return [f"certified_pass1_kernel<{p['block_m']}, {p['block_n']}>", *rest]
    epilogue = (f"argmax_epilogue_kernel<{p['epilogue_threads_per_row']}, "
                f"{p['epilogue_split_bound']}, ")
    if p["path"] != "split_k":
        return [epilogue]
    if p["gemm"] == "tc":
        gemm = "tf32x3_wgmma_splitk_kernel" if p["wgmma"] == "1" else "tf32x3_splitk_kernel"
    else:
        gemm = _GEMM_KERNEL[p["gemm"]]
    return [gemm, epilogue]


@pytest.mark.cuda
@pytest.mark.profiler
@pytest.mark.parametrize("batch, n, k, prepared, operands", [
    (1, 512, 8192, False, "f32"),
    (9, 512, 1000, False, "f32"),
    (24, 512, 8192, False, "f32"),
    (64, 512, 8192, True, "f32"),
    (128, 512, 8192, False, "f32"),
    (300, 512, 8192, True, "f32"),
    (600, 256, 4096, False, "f32"),
    (40, 2048, 1024, False, "f32"),
    (700, 512, 4096, False, "half"),
    (9000, 256, 256, False, "f32"),
    (7, 300, 0, False, "f32"),
])
def test_the_kernels_that_run_are_the_ones_the_plan_names(
    driver, batch, n, k, prepared, operands, make_inputs, kernels_run
):
    import torch

    import fused_pool_gelu

    limits = fused_pool_gelu._C._device_limits(torch.cuda.current_device())
    p = plan(driver, batch, n, k, operands=operands, prepared=prepared, limits=limits)
    dtype = torch.bfloat16 if operands == "half" else torch.float32
    if k > 0:
        x, weight, bias = make_inputs(batch, k, n, dtype, "cuda")
    else:  # no in_features: z is the bias
        x, weight = torch.empty(batch, 0, device="cuda"), torch.empty(n, 0, device="cuda")
        bias = torch.randn(n, device="cuda")
    prepared_weight = fused_pool_gelu.prepare_weight(weight) if prepared else None
    names = kernels_run(
        lambda: torch.ops.fused_pool_gelu.forward_with_argmax(x, weight, bias, 2.0,
                                                               prepared_weight)
    )
    for kernel in _expected_kernels(p):
        assert any(kernel in name for name in names), (p, kernel, sorted(names))
