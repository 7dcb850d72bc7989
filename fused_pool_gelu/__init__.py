"""fused_pool_gelu: Linear -> AvgPool1d -> GELU -> scale -> max, folded and fused.

    import fused_pool_gelu
    model = fused_pool_gelu.ModelNew(8192, 8192, 16, 2.0)   # drop-in for Model
    pooled_weight, pooled_bias = fused_pool_gelu.fold(weight, bias, 16)
    out = torch.ops.fused_pool_gelu.forward(x, pooled_weight, pooled_bias, 2.0)
"""

import torch  # loads libtorch before the extension that links against it

from ._version import __version__

try:
    from . import _C
except ImportError as error:  # pragma: no cover - exercised by tests/test_build.py in a subprocess
    raise ImportError(
        "fused_pool_gelu: the compiled extension fused_pool_gelu._C could not be loaded "
        f"({error}). It runs with torch 2.10 or later (the installed one: {torch.__version__}); "
        "if torch is recent enough, build it: from the source tree run "
        "`pip install --no-build-isolation .` (or `make test`, which builds and installs a "
        "wheel). If you are running from the source tree, run from another directory so that "
        "the installed package is imported."
    ) from error

# The ops' fake kernels, autograd formulas and autocast kernels register themselves on import.
from . import _autocast, _autograd, _fake  # noqa: F401
from . import ops
from .folded import FoldedModel
from .model import Model, ModelNew
from .ops import fold, forward, forward_with_argmax, prepare_weight

__all__ = [
    "__version__",
    "build_info",
    "FoldedModel",
    "fold",
    "forward",
    "forward_with_argmax",
    "Model",
    "ModelNew",
    "ops",
    "prepare_weight",
]


def build_info() -> dict:
    """What was compiled and what will run.

    Keys: version; torch (the torch the binary was compiled with), torch_target (the oldest torch
    whose stable ABI it uses: it runs with that torch and every later one), cuda / cuda_archs /
    with_cuda / debug as compiled into the binary; torch_runtime (the torch imported now);
    cuda_kernels (CUDA kernels registered); model_forward_node: which autograd node ModelNew's
    training step records, "C++ (<file>)" where the package holds one built for the running
    torch, else "Python" (same results, more host time per step);
    cuda_available and device (the GPU that would run them, if any).
    """
    compiled = _C.compiled_build_info()
    # The torch versions side by side: compiled with, the stable ABI's target, imported now.
    info = {"version": __version__, "torch": compiled.pop("torch"),
            "torch_target": compiled.pop("torch_target"), "torch_runtime": torch.__version__}
    info.update(compiled)
    info["cuda_kernels"] = torch._C._dispatch_has_kernel_for_dispatch_key(
        "fused_pool_gelu::forward_with_argmax", "CUDA"
    )
    node = _autograd.MODEL_FORWARD_NODE
    info["model_forward_node"] = f"C++ ({node.rsplit('/', 1)[-1]})" if node else "Python"
    info["cuda_available"] = torch.cuda.is_available()
    info["device"] = torch.cuda.get_device_name() if info["cuda_available"] else "cpu"
    return info
