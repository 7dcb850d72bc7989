"""Which weight each prepared weight was made from, so that forward can refuse a stale or foreign
one instead of selecting columns on the wrong values.

A table keyed by the prepared tensor's storage, filled by ``ops.prepare_weight`` and read by
``ops.forward`` / ``ops.forward_with_argmax``. It lives in Python because the LibTorch stable ABI,
which the compiled kernels use, shows neither a tensor's storage identity nor its version counter;
the kernels check the prepared weight's layout (csrc/prepared_weight.cpp). A prepared weight
passed to ``torch.ops.fused_pool_gelu.*`` directly has its layout checked only.

A prepared weight is tied to its weight: forward checks that ``weight`` views the same storage
with the same offset, sizes and strides, and that its version counter has not moved since (an
in-place change, an optimizer step, load_state_dict). What it cannot see: writes that bypass the
version counter (through ``.data``, or another tensor over the same memory; any in-place edit of
an inference tensor, which has no version counter), and where a copy of a prepared weight came
from (a clone, a loaded one, the input copies of torch.compile's CUDA graphs and of opcheck):
those are trusted to match ``weight``.
"""

from __future__ import annotations

import threading

from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

# StorageImpl address of a prepared weight -> (weak reference to that storage, weak reference to
# the weight's storage, the weight's offset, shape, strides, version or None). The weak reference
# to the prepared storage keeps its StorageImpl (the key) from being freed and its address reused
# while the entry exists; neither keeps any memory alive.
_SOURCES: dict = {}
_LOCK = threading.Lock()


def _version(weight: Tensor):
    # An inference tensor (torch.inference_mode) has no version counter: its prepared weight is
    # held to the weight's identity only.
    return None if weight.is_inference() else weight._version


def record(prepared: Tensor, weight: Tensor) -> None:
    """Remembers that ``prepared`` was made from ``weight`` as it is now."""
    entry = (StorageWeakRef(prepared.untyped_storage()), StorageWeakRef(weight.untyped_storage()),
             weight.storage_offset(), weight.shape, weight.stride(), _version(weight))
    with _LOCK:
        # Entries of freed prepared weights go when the next one is recorded: the table stays as
        # large as the number of live prepared weights.
        for key in [key for key, value in _SOURCES.items() if value[0].expired()]:
            del _SOURCES[key]
        _SOURCES[prepared.untyped_storage()._cdata] = entry


def check(op: str, prepared: Tensor, weight: Tensor) -> None:
    """Raises, naming ``op``, if ``prepared`` was made from another weight tensor or ``weight``
    changed in place since. A prepared weight without a record (a copy) is trusted."""
    entry = _SOURCES.get(prepared.untyped_storage()._cdata)
    if entry is None:
        return
    _, weight_ref, offset, shape, stride, version = entry
    if (weight_ref.cdata != weight.untyped_storage()._cdata or offset != weight.storage_offset() or shape != weight.shape
            or stride != weight.stride()):
        raise RuntimeError(
            f"fused_pool_gelu.{op}: prepared_weight was made from another weight tensor (another "
            "storage, offset, shape or strides): call prepare_weight(weight) with this weight"
        )
    if version is not None and version != _version(weight):
        raise RuntimeError(
            f"fused_pool_gelu.{op}: prepared_weight is stale: weight was modified in place after "
            f"prepare_weight (version counter {version} then, {_version(weight)} now): call "
            "prepare_weight(weight) again"
        )
