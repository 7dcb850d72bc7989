"""Debug knobs: the environment variables that pick the CUDA forward's path, for tests and
benchmarks.

    FUSED_POOL_GELU_CERTIFIED        unset or "": the certified path where it is faster; "1":
                                     wherever it applies; "0": never (the 3xTF32 GEMM instead)
    FUSED_POOL_GELU_FORCE_MMA_SYNC   "1": the portable mma.sync GEMM on Hopper too

The extension reads them once per process (csrc/debug_knobs.h). ``set_debug_knobs`` sets some
and has the extension read them again; ``debug_knobs`` does so for a block and restores them after:

    with debug_knobs(FUSED_POOL_GELU_CERTIFIED="0"):
        out = torch.ops.fused_pool_gelu.forward(x, weight, bias, 2.0)
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

from . import _C

KNOBS = ("FUSED_POOL_GELU_CERTIFIED", "FUSED_POOL_GELU_FORCE_MMA_SYNC")


def reload() -> None:
    """Has the extension read the knobs from the environment again."""
    _C._reload_debug_knobs()


def set_debug_knobs(**values: Optional[str]) -> None:
    """Sets the named knobs (None unsets one) and reloads; the others are left as they are."""
    unknown = sorted(set(values) - set(KNOBS))
    if unknown:
        raise ValueError(f"fused_pool_gelu debug knobs: unknown {unknown}; known: {list(KNOBS)}")
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    reload()


@contextlib.contextmanager
def debug_knobs(**values: Optional[str]) -> Iterator[None]:
    """set_debug_knobs(**values) for the block, then the named knobs as they were."""
    saved = {name: os.environ.get(name) for name in values}
    set_debug_knobs(**values)
    try:
        yield
    finally:
        set_debug_knobs(**saved)
