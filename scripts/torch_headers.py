"""Fetch other torch versions' C++ headers, for the model_forward autograd node of each.

    python scripts/torch_headers.py OUT_DIR 2.10.0 2.11.0 ...

For each version: `pip download --no-deps torch==<version>` from the configured index (any build
of it: the headers the node uses are the same in the CPU and CUDA builds), then its torch/include
tree to OUT_DIR/<major>.<minor>/include, with the version in OUT_DIR/<major>.<minor>/version, and
the wheel is deleted. A tree of that version already there is kept; one of another release of the
same minor version is replaced. setup.py builds a node against each tree named in
FUSED_POOL_GELU_TORCH_HEADERS (OUT_DIR/<major>.<minor> entries, ":"-separated); `make wheels`
fetches NODE_TORCH's and passes them.
"""

import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


def fetch(out_dir: Path, version: str) -> None:
    release = re.fullmatch(r"(\d+)\.(\d+)\.\d+", version)
    if release is None:
        sys.exit(f"torch_headers.py: a version must be a release like 2.14.1, got {version!r}")
    tree = out_dir / f"{release[1]}.{release[2]}"
    stamp = tree / "version"
    if stamp.exists() and stamp.read_text().strip() == version:
        print(f"torch {version}: headers already in {tree}")
        return
    shutil.rmtree(tree, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--only-binary", ":all:", "-d", tmp, f"torch=={version}"], check=True)
        (wheel,) = Path(tmp).glob("torch-*.whl")
        staging = Path(tmp) / "staging"
        with zipfile.ZipFile(wheel) as archive:
            members = [m for m in archive.namelist() if m.startswith("torch/include/")]
            archive.extractall(staging, members)
        tree.mkdir(parents=True)
        shutil.move(str(staging / "torch" / "include"), str(tree / "include"))
        stamp.write_text(version + "\n")
    print(f"torch {version}: {len(members)} headers in {tree}")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    for v in sys.argv[2:]:
        fetch(Path(sys.argv[1]), v)
