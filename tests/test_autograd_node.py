"""model_forward's autograd node: the C++ one built for the running torch (csrc/autograd_node/),
or the Python one (_autograd.py) under a torch the package has no node for.

Where the C++ node runs, it is held to the Python node: the same values and gradients bit for bit,
and the same errors. Under a torch without a C++ node (CI tests a wheel under another torch) the
rest of the suite runs the Python node.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
import torch._dynamo.testing
from torch.autograd import forward_ad

import fused_pool_gelu
from fused_pool_gelu import _autograd

_OPS = torch.ops.fused_pool_gelu
CPP_NODE = _autograd.MODEL_FORWARD_NODE is not None
needs_cpp_node = pytest.mark.skipif(
    not CPP_NODE, reason=f"no C++ model_forward node for torch {torch.__version__} in this build")


def _node_files():
    package = Path(fused_pool_gelu.__file__).parent
    return sorted(p.name for p in package.glob("_model_forward_node_torch*.so"))


def test_build_info_names_the_node_that_model_forwards_autograd_key_runs():
    info = fused_pool_gelu.build_info()
    dump = torch._C._dispatch_dump("fused_pool_gelu::model_forward")
    autograd_line = next(line for line in dump.splitlines() if line.startswith("Autograd"))
    if CPP_NODE:
        name = _autograd.MODEL_FORWARD_NODE.rsplit("/", 1)[-1]
        assert info["model_forward_node"] == f"C++ ({name})"
        assert "model_forward_node.cpp" in autograd_line
    else:
        assert info["model_forward_node"] == "Python"
        assert "_autograd.py" in autograd_line


def test_every_build_holds_the_node_of_the_torch_it_was_built_with_and_runs_it_there():
    # setup.py builds it from the build torch's own headers, whatever else it is given. (Under
    # other torch versions .ci/run checks which node runs: C++ where the wheel has one for it.)
    built_with = fused_pool_gelu.build_info()["torch"]
    minor = re.match(r"(\d+)\.(\d+)", built_with)
    name = f"_model_forward_node_torch{minor[1]}_{minor[2]}.so"
    assert name in _node_files()
    if torch.__version__ == built_with:
        assert _autograd.MODEL_FORWARD_NODE is not None
        assert Path(_autograd.MODEL_FORWARD_NODE).name == name


def test_model_new_training_records_the_node_that_runs(device):
    model = fused_pool_gelu.ModelNew(64, 64, 4, 2.0).to(device)
    grad_fn = model(torch.randn(3, 64, device=device)).grad_fn
    if CPP_NODE:
        assert grad_fn.name().startswith("torch::autograd::CppNode<") and "ModelForward" in (
            grad_fn.name())
    else:
        assert grad_fn.name() == "_ModelForwardBackward"


class TestLoading:
    """_load_model_forward_node's choice under other torch versions (nothing is loaded: the node
    of this process is registered already, and load_library is replaced)."""

    @pytest.fixture
    def load_calls(self, monkeypatch):
        calls = []

        def load_library(path):
            calls.append(path)
            raise OSError(f"{path}: undefined symbol: _ZN3c10example")

        monkeypatch.setattr(torch.ops, "load_library", load_library)
        return calls

    def test_a_torch_without_a_node_gets_the_python_node(self, monkeypatch, load_calls):
        monkeypatch.setattr(torch, "__version__", "2.99.0+cpu")
        assert _autograd._load_model_forward_node() is None
        assert load_calls == []

    def test_a_prerelease_gets_the_python_node_unless_the_package_was_built_with_it(
            self, monkeypatch, load_calls):
        built_with = re.match(r"(\d+)\.(\d+)", fused_pool_gelu.build_info()["torch"])
        monkeypatch.setattr(torch, "__version__",
                            f"{built_with[1]}.{built_with[2]}.0a0+git0123abc")
        assert _autograd._load_model_forward_node() is None
        assert load_calls == []

    def test_a_node_that_fails_to_load_warns_and_gives_the_python_node(
            self, monkeypatch, load_calls):
        built_with = fused_pool_gelu.build_info()["torch"]
        monkeypatch.setattr(torch, "__version__", built_with)
        with pytest.warns(UserWarning, match=r"C\+\+ autograd node built for torch \d+\.\d+ "
                          r"\(_model_forward_node_torch\d+_\d+\.so\) did not load under torch .*"
                          r"undefined symbol.*training uses the Python node"):
            assert _autograd._load_model_forward_node() is None
        assert len(load_calls) == 1


def _python_node(x, weight, bias, k, scale, pooled_weight=None, pooled_bias=None):
    return _autograd._ModelForward.apply(x, weight, bias, k, scale, pooled_weight, pooled_bias,
                                         None)


def _cpp_node(x, weight, bias, k, scale, pooled_weight=None, pooled_bias=None):
    return _OPS.model_forward(x, weight, bias, k, scale, pooled_weight, pooled_bias)


def _python_node_and_fold(x, weight, bias, k, scale):
    return _autograd._model_forward_and_fold_python(x, weight, bias, k, scale)


def _cpp_node_and_fold(x, weight, bias, k, scale):
    return _OPS._model_forward_and_fold(x, weight, bias, k, scale)


def _run(node, x, weight, bias, k, scale, grads, fold_mode):
    """[out, the leaves' gradients], then, where the node returns the fold it made, that fold."""
    leaves = [t.detach().clone().requires_grad_(name in grads)
              for name, t in (("x", x), ("weight", weight), ("bias", bias)) if t is not None]
    x_, w_ = leaves[0], leaves[1]
    b_ = leaves[2] if bias is not None else None
    fold = fused_pool_gelu.fold(weight, bias, k) if fold_mode == "given-fold" else (None, None)
    made_fold = []
    if fold_mode == "returns-fold":
        out, *made_fold = node(x_, w_, b_, k, scale)
        assert not any(t.requires_grad for t in made_fold)
    else:
        out = node(x_, w_, b_, k, scale, *fold)
    generator = torch.Generator(out.device).manual_seed(1)
    grad_out = torch.randn(out.shape, generator=generator, device=out.device, dtype=out.dtype)
    out.backward(grad_out)
    return [out.detach()] + [t.grad for t in leaves] + made_fold


_DTYPES = {"cpu": (torch.float32, torch.float64), "cuda": (torch.float32, torch.bfloat16)}


@needs_cpp_node
@pytest.mark.parametrize("fold_mode", ["folds", "given-fold", "returns-fold"])
@pytest.mark.parametrize("grads", ["x weight bias", "weight", "x"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("shape", [(1, 33, 50, 4), (7, 64, 48, 16), (130, 17, 9, 9)],
                         ids=lambda s: "x".join(map(str, s)))
def test_the_cpp_node_gives_the_python_nodes_values_and_gradients_bit_for_bit(
        device, make_inputs, shape, with_bias, grads, fold_mode):
    # returns-fold: _model_forward_and_fold (ModelNew's call after a parameter update), whose fold
    # outputs must also be the fold's.
    batch, in_features, out_features, k = shape
    returns_fold = fold_mode == "returns-fold"
    for dtype in _DTYPES[device]:
        x, weight, bias = make_inputs(batch, in_features, out_features, dtype, device, with_bias)
        grads_ = grads.split()
        cpp = _run(_cpp_node_and_fold if returns_fold else _cpp_node, x, weight, bias, k, -1.5,
                   grads_, fold_mode)
        python = _run(_python_node_and_fold if returns_fold else _python_node, x, weight, bias,
                      k, -1.5, grads_, fold_mode)
        assert len(cpp) == len(python)
        if returns_fold:
            for got, want in zip(cpp[-2:], fused_pool_gelu.fold(weight, bias, k)):
                assert torch.equal(got, want)
        for got, want in zip(cpp, python):
            assert (got is None) == (want is None)
            if got is not None:
                assert got.dtype == want.dtype and torch.equal(got, want)


def _error(call):
    with pytest.raises(RuntimeError) as info:
        call()
    return str(info.value).split("\n")[0]


def _bad_calls(device, requires_grad=True):
    x = torch.randn(5, 12, device=device)
    weight = torch.randn(8, 12, device=device, requires_grad=requires_grad)
    bias = torch.randn(8, device=device, requires_grad=requires_grad)
    pooled_weight, pooled_bias = fused_pool_gelu.fold(weight.detach(), bias.detach(), 4)
    return {
        "x 3-D": (x[None], weight, bias, 4, None, None, None),
        "weight width": (x[:, :11], weight, bias, 4, None, None, None),
        "pooled_weight alone": (x, weight, bias, 4, pooled_weight, None, None),
        "pooled_bias alone": (x, weight, bias, 4, None, pooled_bias, None),
        "prepared without fold": (x, weight, bias, 4, None, None,
                                  torch.zeros(8, dtype=torch.uint8, device=device)),
        "k 0 with a fold": (x, weight, bias, 0, pooled_weight, pooled_bias, None),
        "k past out_features": (x, weight, bias, 9, pooled_weight, pooled_bias, None),
        "bias shape": (x, weight, bias[:7], 4, pooled_weight, pooled_bias, None),
        "pooled_weight rows": (x, weight, bias, 4, pooled_weight[:1], pooled_bias, None),
        "pooled_bias rows": (x, weight, bias, 4, pooled_weight, pooled_bias[:1], None),
        "pooled_weight dtype": (x, weight, bias, 4, pooled_weight.double(), pooled_bias, None),
        "pooled_bias dtype": (x, weight, bias, 4, pooled_weight, pooled_bias.double(), None),
    }


@needs_cpp_node
@pytest.mark.parametrize("requires_grad", [True, False], ids=["grad", "no-grad"])
@pytest.mark.parametrize("case", list(_bad_calls("cpu")))
def test_the_cpp_node_refuses_what_the_python_node_refuses_with_its_message(device, case,
                                                                           requires_grad):
    args = _bad_calls(device, requires_grad)[case]
    cpp = _error(lambda: _OPS.model_forward(*args[:3], args[3], 2.0, *args[4:]))
    python = _error(lambda: _autograd._model_forward_autograd_python(*args[:3], args[3], 2.0,
                                                                     *args[4:]))
    assert cpp == python
    assert cpp.startswith(("fused_pool_gelu.model_forward: ", "fused_pool_gelu.fold: "))


@pytest.mark.parametrize("node", ["cpp", "python"])
def test_the_fold_outputs_add_nothing_to_the_backward(device, node):
    # No gradient flows through the fold outputs: the backward must not materialize zero
    # gradients for them (two fold-sized allocations and fills per training step).
    if node == "cpp" and not CPP_NODE:
        pytest.skip(f"no C++ model_forward node for torch {torch.__version__} in this build")
    call = _cpp_node_and_fold if node == "cpp" else _python_node_and_fold
    x = torch.randn(3, 64, device=device, requires_grad=True)
    weight = torch.randn(128, 64, device=device, requires_grad=True)
    bias = torch.randn(128, device=device, requires_grad=True)
    out, pooled_weight, pooled_bias = call(x, weight, bias, 4, 2.0)
    assert pooled_weight.grad_fn is None and pooled_bias.grad_fn is None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out.sum().backward()
    assert not [e.name for e in prof.events() if e.name in ("aten::zeros", "aten::zeros_like")]
    assert weight.grad is not None and x.grad is not None and bias.grad is not None


_AND_FOLD_BAD_CALLS = ["x 3-D", "weight width", "k 0", "k past out_features", "bias shape"]


@needs_cpp_node
@pytest.mark.parametrize("requires_grad", [True, False], ids=["grad", "no-grad"])
@pytest.mark.parametrize("case", _AND_FOLD_BAD_CALLS)
def test_the_cpp_node_returning_the_fold_refuses_what_the_python_one_does(device, case,
                                                                          requires_grad):
    x = torch.randn(5, 12, device=device)
    weight = torch.randn(8, 12, device=device, requires_grad=requires_grad)
    bias = torch.randn(8, device=device, requires_grad=requires_grad)
    args = {"x 3-D": (x[None], weight, bias, 4),
            "weight width": (x[:, :11], weight, bias, 4),
            "k 0": (x, weight, bias, 0),
            "k past out_features": (x, weight, bias, 9),
            "bias shape": (x, weight, bias[:7], 4)}[case]
    cpp = _error(lambda: _OPS._model_forward_and_fold(*args, 2.0))
    python = _error(lambda: _autograd._model_forward_and_fold_python(*args, 2.0))
    assert cpp == python
    assert cpp.startswith(("fused_pool_gelu.model_forward: ", "fused_pool_gelu.fold: "))


@needs_cpp_node
@pytest.mark.parametrize("name", ["x", "weight", "bias"])
def test_the_cpp_node_refuses_a_forward_mode_tangent(device, name):
    tensors = {"x": torch.randn(3, 12, device=device),
               "weight": torch.randn(8, 12, device=device),
               "bias": torch.randn(8, device=device)}
    with forward_ad.dual_level():
        tensors[name] = forward_ad.make_dual(tensors[name], torch.ones_like(tensors[name]))
        for op in (_OPS.model_forward, _OPS._model_forward_and_fold):
            with pytest.raises(RuntimeError, match=rf"fused_pool_gelu\.model_forward: {name} "
                               "carries a forward-mode AD tangent"):
                op(tensors["x"], tensors["weight"], tensors["bias"], 4, 2.0)


@needs_cpp_node
def test_the_cpp_nodes_gradient_of_a_gradient_is_refused_clearly(device):
    x = torch.randn(4, 12, device=device, requires_grad=True)
    weight = torch.randn(8, 12, device=device, requires_grad=True)
    out = _OPS.model_forward(x, weight, None, 4, 2.0)
    (grad_weight,) = torch.autograd.grad(out.sum(), weight, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        grad_weight.sum().backward()


def test_without_a_gradient_no_node_is_recorded(device):
    x, weight, bias = (torch.randn(3, 12, device=device), torch.randn(8, 12, device=device),
                       torch.randn(8, device=device))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = _OPS.model_forward(x, weight, bias, 4, 2.0)
    assert out.grad_fn is None and not out.requires_grad
    weight.requires_grad_()
    with torch.no_grad():
        assert _OPS.model_forward(x, weight, bias, 4, 2.0).grad_fn is None


def test_a_compiled_call_keeps_the_batch_dynamic(device):
    # The node reads sizes symbolically: one graph serves every batch, backward included.
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    weight = torch.randn(8, 12, device=device, requires_grad=True)

    @torch.compile(backend=counter, dynamic=True)
    def loss(x, weight):
        return _OPS.model_forward(x, weight, None, 4, 2.0).sum()

    for batch in (3, 5, 9):
        x = torch.randn(batch, 12, device=device)
        loss(x, weight).backward()
        expected = torch.autograd.grad(_python_node(x, weight, None, 4, 2.0).sum(), weight)[0]
        assert torch.equal(weight.grad, expected)
        weight.grad = None
    assert counter.frame_count == 1


def test_an_export_with_a_dynamic_batch_runs_at_other_batches(device):
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(12, 8)

        def forward(self, x):
            return fused_pool_gelu.ops.model_forward(x, self.linear.weight, self.linear.bias, 4,
                                                     2.0)

    block = Block().to(device)
    batch = torch.export.Dim("batch", min=2)
    with torch.no_grad():
        exported = torch.export.export(block, (torch.randn(3, 12, device=device),),
                                       dynamic_shapes=({0: batch},))
        for size in (2, 7):
            x = torch.randn(size, 12, device=device)
            assert torch.equal(exported.module()(x), block(x))
