"""`python -m fused_pool_gelu` (fused_pool_gelu/__main__.py): the check passes on a small CPU
shape, and bad arguments end in argparse's usage error naming the argument, not a traceback."""

from __future__ import annotations

import pytest

from fused_pool_gelu.__main__ import main

SMALL = ["--device", "cpu", "-B", "3", "-K", "24", "-O", "16", "-k", "4", "--no-timing"]


def test_the_check_passes_on_a_small_cpu_shape(capsys):
    assert main(SMALL) == 0
    out = capsys.readouterr().out
    assert "check passed: ModelNew matches Model (outputs and gradients)" in out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--pool", "0"], "argument --pool/-k: expected an integer >= 1, got 0"),
        (["-B", "-1"], "argument --batch/-B: expected an integer >= 0, got -1"),
        (["-K", "x"], "argument --in-features/-K: expected an integer >= 1, got 'x'"),
        (["-O", "0"], "argument --out-features/-O: expected an integer >= 1, got 0"),
        (["--device", "tpu"], "argument --device: expected cpu, cuda or cuda:N, got 'tpu'"),
        (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
        (["--scale", "nan"], "argument --scale: expected a finite number, got 'nan'"),
        (["--scale=-inf"], "argument --scale: expected a finite number, got '-inf'"),
        (["--rep", "0"], "argument --rep: expected a finite number > 0, got '0'"),
        (["--rep", "nan"], "argument --rep: expected a finite number > 0, got 'nan'"),
        (["--seed", str(-(2**63) - 1)],
         f"argument --seed: expected an integer in [-2**63, 2**64), got {-(2**63) - 1}"),
        (["--seed", str(2**64)],
         f"argument --seed: expected an integer in [-2**63, 2**64), got {2**64}"),
    ],
)
def test_bad_arguments_are_usage_errors_naming_the_argument(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_pool_wider_than_the_output_is_refused(capsys):
    assert main(["--device", "cpu", "-B", "2", "-K", "8", "-O", "8", "-k", "16"]) == 2
    assert "--pool (16) must be <= --out-features (8)" in capsys.readouterr().err


@pytest.mark.cuda
def test_a_cuda_index_past_the_devices_is_refused(capsys):
    import torch

    count = torch.cuda.device_count()
    argv = ["--device", f"cuda:{count}", "-B", "2", "-K", "8", "-O", "8", "-k", "4"]
    assert main(argv) == 2
    assert f"error: --device cuda:{count}, but this machine has {count} CUDA device" in (
        capsys.readouterr().err)


@pytest.mark.cuda
def test_the_check_runs_on_the_device_asked_for_and_leaves_the_current_one(capsys):
    import torch

    index = torch.cuda.device_count() - 1  # cuda:1 on a machine of two GPUs; cuda:0 on one
    before = torch.cuda.current_device()
    small = ["--device", f"cuda:{index}", "-B", "3", "-K", "24", "-O", "16", "-k", "4",
             "--rep", "5"]
    assert main(small) == 0
    assert "check passed" in capsys.readouterr().out
    assert torch.cuda.current_device() == before
