"""The installed package: what is imported, what it says about its build, how it fails unbuilt."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

import fused_pool_gelu

REPO_ROOT = Path(__file__).resolve().parents[1]

# Every op has a kernel per device; _certified_candidate_counts is a CUDA diagnostic, and
# model_backward on the CUDA device has a kernel of its own.
CPU_KERNEL_OPS = ["fold", "fold_backward", "forward_with_argmax", "forward", "forward_backward",
                  "prepare_weight", "model_forward", "model_backward",
                  "_model_forward_with_argmax", "_model_forward_and_fold"]
CUDA_KERNEL_OPS = CPU_KERNEL_OPS + ["_certified_candidate_counts"]


def test_the_installed_package_is_imported_not_the_source_tree():
    package_dir = Path(fused_pool_gelu.__file__).resolve().parent
    # The venv of `make test` may live inside the checkout: compare with the source package.
    assert package_dir != (REPO_ROOT / "fused_pool_gelu").resolve(), (
        f"fused_pool_gelu was imported from the source tree ({package_dir}); run pytest from "
        "another directory so that the installed package is tested"
    )


def test_version_is_a_string_matching_the_installed_distribution():
    assert isinstance(fused_pool_gelu.__version__, str) and fused_pool_gelu.__version__
    assert importlib.metadata.version("fused_pool_gelu") == fused_pool_gelu.__version__


def test_build_info_has_its_documented_keys_and_types():
    info = fused_pool_gelu.build_info()
    expected = {
        "version": str,
        "torch": str,
        "torch_target": str,
        "cuda": str,
        "cuda_archs": str,
        "with_cuda": bool,
        "debug": bool,
        "torch_runtime": str,
        "cuda_kernels": bool,
        "model_forward_node": str,
        "cuda_available": bool,
        "device": str,
    }
    assert set(info) == set(expected)
    for key, kind in expected.items():
        assert isinstance(info[key], kind), f"build_info()[{key!r}] = {info[key]!r}"
    assert info["version"] == fused_pool_gelu.__version__
    assert info["torch_runtime"] == torch.__version__
    assert info["cuda_available"] == torch.cuda.is_available()


def _release(version: str) -> tuple:
    return tuple(int(part) for part in version.split("+")[0].split(".")[:2])


def test_build_info_says_the_running_torch_has_the_stable_abi_the_binary_targets():
    # The binary uses the LibTorch stable ABI of torch_target: it loads under that torch and every
    # later one, whatever torch it was compiled with (.ci/run tests it under another one).
    info = fused_pool_gelu.build_info()
    assert _release(info["torch_runtime"]) >= _release(info["torch_target"])
    assert _release(info["torch"]) >= _release(info["torch_target"])


def test_build_info_cuda_fields_are_consistent():
    info = fused_pool_gelu.build_info()
    # CUDA kernels are registered exactly when the binary was compiled with them.
    assert info["cuda_kernels"] == info["with_cuda"]
    if info["with_cuda"]:
        assert info["cuda"] and info["cuda_archs"]
    else:
        assert info["cuda"] == "" and info["cuda_archs"] == ""


@pytest.mark.parametrize("op", CPU_KERNEL_OPS)
def test_every_op_has_a_cpu_kernel(op):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"fused_pool_gelu::{op}", "CPU")


@pytest.mark.parametrize("op", CUDA_KERNEL_OPS)
def test_every_op_has_a_cuda_kernel_when_cuda_kernels_are_built(op):
    if not fused_pool_gelu.build_info()["cuda_kernels"]:
        pytest.skip("built without CUDA kernels")
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"fused_pool_gelu::{op}", "CUDA")


def test_forward_has_its_own_autograd_kernel_over_forward_with_argmax():
    # The autograd kernel (_autograd.py) calls the device kernel when no gradient is needed and
    # goes through forward_with_argmax's derivative when one is.
    for key in ("Autograd", "CPU"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key("fused_pool_gelu::forward", key)
    x = torch.rand(3, 5, requires_grad=True)
    weight = torch.rand(2, 5)
    assert torch.ops.fused_pool_gelu.forward(x, weight, None, 1.0).grad_fn is not None
    with torch.no_grad():
        assert torch.ops.fused_pool_gelu.forward(x, weight, None, 1.0).grad_fn is None


def test_public_api_is_exported():
    for name in fused_pool_gelu.__all__:
        assert hasattr(fused_pool_gelu, name), name
    assert fused_pool_gelu.fold is fused_pool_gelu.ops.fold
    assert fused_pool_gelu.forward is fused_pool_gelu.ops.forward
    assert fused_pool_gelu.forward_with_argmax is fused_pool_gelu.ops.forward_with_argmax


def test_import_without_the_compiled_extension_fails_with_build_instructions(tmp_path):
    installed = Path(fused_pool_gelu.__file__).resolve().parent
    copy = tmp_path / "fused_pool_gelu"
    copy.mkdir()
    for source in installed.glob("*.py"):
        shutil.copy(source, copy / source.name)
    assert not list(copy.glob("_C*")), "the copy must lack the compiled extension"

    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    code = (
        "import fused_pool_gelu, sys\n"
        "print('IMPORTED', fused_pool_gelu.__file__)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0, result.stdout
    assert "IMPORTED" not in result.stdout
    assert "ImportError" in result.stderr, result.stderr
    # The message names the missing module and the command that builds it.
    assert "fused_pool_gelu._C" in result.stderr, result.stderr
    assert "pip install --no-build-isolation ." in result.stderr, result.stderr
    # And it comes from the copy, not from the installed package.
    assert str(copy) in result.stderr, result.stderr


def test_the_source_distribution_holds_every_source_file(tmp_path):
    # setuptools puts the compiled sources in an sdist but not the headers they include: without
    # MANIFEST.in, `pip install <sdist>` fails to compile. (make test also builds its wheel from the
    # sdist.)
    if not (REPO_ROOT / "setup.py").exists():
        pytest.skip("needs the source tree beside the tests")
    pytest.importorskip("build", reason="needs the `build` package (make test installs it)")
    # From a copy without build products: setuptools also packs whatever an earlier build's
    # *.egg-info/SOURCES.txt lists, which would hide a file missing from MANIFEST.in.
    source = tmp_path / "source"
    shutil.copytree(REPO_ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "variants", "__pycache__",
        ".torch-headers"))
    command = [sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir",
               str(tmp_path), str(source)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    (sdist,) = tmp_path.glob("fused_pool_gelu-*.tar.gz")
    with tarfile.open(sdist) as archive:
        members = {Path(name).relative_to(Path(name).parts[0]).as_posix()
                   for name in archive.getnames() if len(Path(name).parts) > 1}
    sources = {path.relative_to(REPO_ROOT).as_posix()
               for path in (REPO_ROOT / "csrc").rglob("*") if path.is_file()}
    expected = sources | {"LICENSE", "README.md", "setup.py", "pyproject.toml"}
    assert not expected - members, sorted(expected - members)
