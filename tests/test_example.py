"""examples/train.py runs end to end on the CPU and ModelNew's losses agree with Model's.

Each test starts the script as a subprocess, as a user would, with few steps and small shapes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train.py"
SMALL = ["--device", "cpu", "--steps", "6", "--log-every", "3", "--batch", "16",
         "--in-features", "64", "--out-features", "100", "--pool", "8"]
TIMEOUT_S = 120


def _run(args, launcher=(), env_extra=None, cwd=None):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # a test runner under torchrun must not make the script think it is one
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, *launcher, str(SCRIPT), *args],
        capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=cwd,
    )


def _max_difference(stdout):
    match = re.search(r"max relative loss difference ModelNew vs Model: (\S+) \(within", stdout)
    assert match, f"no agreement line in:\n{stdout}"
    return float(match.group(1))


def test_compare_on_cpu_reaches_the_same_losses(tmp_path):
    result = _run([*SMALL, "--compare"], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"step 3/6 \[#+ *\] loss \S+  Model \S+", result.stdout), result.stdout
    assert "ModelNew: loss" in result.stdout and "ms/step" in result.stdout
    assert _max_difference(result.stdout) <= 1e-4


def test_ddp_over_two_gloo_ranks_agrees(tmp_path):
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    result = _run([*SMALL, "--compare", "--ddp"], launcher=launcher, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "batch=16x2" in result.stdout
    assert _max_difference(result.stdout) <= 1e-4


def test_ddp_without_torchrun_says_how_to_launch(tmp_path):
    result = _run([*SMALL, "--ddp"], cwd=tmp_path)
    assert result.returncode != 0
    assert "--ddp: launch with torchrun" in result.stderr


@pytest.mark.parametrize("flag", ["--scale", "--lr"])
def test_a_non_finite_argument_is_refused(flag, tmp_path):
    result = _run(["--device", "cpu", "--steps", "2", flag, "nan"], cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"{flag} must be a finite number, got nan" in result.stderr


def test_a_diverging_run_stops_with_a_failure_status(tmp_path):
    # A learning rate this large overflows the weights within a few steps: the losses go
    # non-finite, and NaN must not pass for a loss difference within --tol.
    result = _run(["--device", "cpu", "--compare", "--steps", "20", "--lr", "1e30",
                   "--in-features", "32", "--out-features", "64", "--batch", "8"], cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "non-finite loss" in result.stdout
