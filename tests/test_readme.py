"""README.md's Python blocks run as written, and its relative links point to files that exist."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _python_blocks():
    return PYTHON_BLOCK.findall(README.read_text())


def test_readme_has_python_blocks():
    assert _python_blocks(), "README.md has no ```python block"


def test_readme_python_blocks_run(tmp_path):
    # One process for all blocks, in order: later blocks use what earlier ones define. Run from a
    # temporary directory so that the installed package is imported, not the source tree.
    script = tmp_path / "readme_blocks.py"
    script.write_text("\n\n".join(_python_blocks()))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"README.md's Python blocks failed:\n{result.stderr}"


def test_readme_relative_links_exist():
    missing = [
        target for target in LINK.findall(README.read_text())
        if not target.startswith(("http://", "https://", "#"))
        and not (ROOT / target.split("#")[0]).exists()
    ]
    assert not missing, f"README.md links to files that do not exist: {missing}"
