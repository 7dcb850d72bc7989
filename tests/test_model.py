"""ModelNew as a drop-in replacement for Model: parameters, state_dict, outputs, training, the fold
cache, serialization and DistributedDataParallel."""

from __future__ import annotations

import copy
import io
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import fused_pool_gelu
from fused_pool_gelu import Model, ModelNew, _autograd, _fold_cache, ops

# (in_features, out_features, pool_kernel_size, scale_factor)
ARGS = [
    pytest.param((64, 64, 4, 2.0), id="64x64,k=4"),
    pytest.param((50, 30, 7, 2.0), id="O%k!=0"),
    pytest.param((32, 32, 32, -1.0), id="k=O"),
    pytest.param((3, 16, 1, 0.5), id="K=3,k=1"),
]


def _pair(args, device="cpu", dtype=torch.float32, seed=1234):
    torch.manual_seed(seed)
    model = Model(*args).to(device=device, dtype=dtype)
    torch.manual_seed(seed)
    new = ModelNew(*args).to(device=device, dtype=dtype)
    return model, new


@pytest.fixture
def fold_calls(monkeypatch):
    """Counts the calls that fold the weight on ModelNew's paths, at the ops that fold: ops.fold,
    the fold cache's own fold call, and the training node's _model_forward_with_argmax (which
    ops.model_forward reaches when it must fold), or, with the C++ node (which calls it from C++),
    ModelNew's call of that node after a parameter update (model_forward_and_fold)."""
    calls = []

    def counting(real):
        def count(*args, **kwargs):
            calls.append(args)
            return real(*args, **kwargs)
        return count

    patched = [(ops, "fold"), (_fold_cache, "_FOLD"), (_autograd, "_model_forward_with_argmax")]
    if _autograd.MODEL_FORWARD_NODE is not None:
        patched.append((_autograd, "model_forward_and_fold"))
    for module, attribute in patched:
        monkeypatch.setattr(module, attribute, counting(getattr(module, attribute)))
    return calls


# ----------------------------------------------------------------------------------------------
# Parameters and state


@pytest.mark.parametrize("args", ARGS)
def test_same_seed_gives_bitwise_equal_parameters(args):
    model, new = _pair(args)
    ref_params = dict(model.named_parameters())
    new_params = dict(new.named_parameters())
    assert list(ref_params) == list(new_params) == ["matmul.weight", "matmul.bias"]
    for name, p in ref_params.items():
        assert torch.equal(new_params[name], p), name


def test_same_seed_leaves_the_rng_in_the_same_state():
    torch.manual_seed(7)
    Model(40, 24, 4, 2.0)
    after_model = torch.rand(3)
    torch.manual_seed(7)
    ModelNew(40, 24, 4, 2.0)
    after_new = torch.rand(3)
    assert torch.equal(after_model, after_new)


def test_state_dicts_have_the_same_keys_and_shapes():
    model, new = _pair((40, 24, 4, 2.0))
    ref, ours = model.state_dict(), new.state_dict()
    assert list(ref) == list(ours)
    assert all(ref[k].shape == ours[k].shape for k in ref)


@pytest.mark.parametrize("direction", ["model_to_new", "new_to_model"])
def test_state_dict_loads_strictly_both_ways(direction):
    args = (40, 24, 4, 2.0)
    torch.manual_seed(1)
    source_model, source_new = Model(*args), ModelNew(*args)
    torch.manual_seed(2)
    target_model, target_new = Model(*args), ModelNew(*args)
    x = torch.randn(8, 40)
    if direction == "model_to_new":
        target_new.load_state_dict(source_model.state_dict(), strict=True)
        expected, got = source_model(x), target_new(x)
        source, target = source_model, target_new
    else:
        target_model.load_state_dict(source_new.state_dict(), strict=True)
        expected, got = source_new(x), target_model(x)
        source, target = source_new, target_model
    for (_, a), (_, b) in zip(source.named_parameters(), target.named_parameters()):
        assert torch.equal(a, b)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_from_model_copies_the_parameters():
    torch.manual_seed(3)
    model = Model(40, 26, 4, -2.0)
    new = ModelNew.from_model(model)
    assert new.pool_kernel_size == 4 and new.scale_factor == -2.0
    for (_, a), (_, b) in zip(model.named_parameters(), new.named_parameters()):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
    x = torch.randn(8, 40)
    torch.testing.assert_close(new(x), model(x), atol=1e-4, rtol=1e-4)


def test_from_model_is_independent_of_the_source():
    torch.manual_seed(3)
    model = Model(40, 24, 4, 2.0)
    new = ModelNew.from_model(model)
    before = new.matmul.weight.detach().clone()
    with torch.no_grad():
        model.matmul.weight.add_(1.0)
    assert torch.equal(new.matmul.weight, before)


def test_from_model_keeps_dtype_and_requires_grad():
    model = Model(16, 8, 2, 2.0).double()
    model.matmul.bias.requires_grad_(False)
    new = ModelNew.from_model(model)
    assert new.matmul.weight.dtype == torch.float64
    assert new.matmul.weight.requires_grad and not new.matmul.bias.requires_grad


@pytest.mark.parametrize("pool_kernel_size", [0, -1, 2.5, float("nan"), float("inf"), None, "2",
                                              True, (2, 2)])
def test_invalid_pool_kernel_size_is_rejected(pool_kernel_size):
    with pytest.raises(ValueError, match="pool_kernel_size must be a positive integer"):
        ModelNew(16, 8, pool_kernel_size, 2.0)


class _Index:
    """An integer type of its own: only __index__, as AvgPool1d accepts."""

    def __init__(self, value):
        self.value = value

    def __index__(self):
        return self.value


@pytest.mark.parametrize("integer", ["numpy.int64", "numpy.int32", "__index__"])
def test_an_integer_type_pool_kernel_size_is_taken_as_avg_pool1d_takes_it(integer):
    np = pytest.importorskip("numpy")
    make = {"numpy.int64": np.int64, "numpy.int32": np.int32, "__index__": _Index}[integer]
    torch.manual_seed(3)
    model = Model(24, 16, make(4), 2.0)
    new = ModelNew(24, 16, make(4), 2.0)
    new.load_state_dict(model.state_dict())
    copied = ModelNew.from_model(model)
    assert type(new.pool_kernel_size) is int and new.pool_kernel_size == 4
    assert type(copied.pool_kernel_size) is int and copied.pool_kernel_size == 4
    x = torch.rand(5, 24)
    torch.testing.assert_close(new(x), model(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(copied(x), model(x), atol=1e-5, rtol=1e-5)


def test_a_one_tuple_pool_kernel_size_is_taken_as_avg_pool1d_takes_it(device):
    torch.manual_seed(3)
    model = Model(24, 16, (4,), 2.0).to(device)
    new = ModelNew(24, 16, (4,), 2.0).to(device)
    new.load_state_dict(model.state_dict())
    assert new.pool_kernel_size == 4
    x = torch.rand(5, 24, device=device)
    torch.testing.assert_close(new(x), model(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("one_element", ["numpy array", "list of numpy.int64", "range"])
def test_a_one_element_iterable_pool_kernel_size_is_taken_as_avg_pool1d_takes_it(one_element):
    np = pytest.importorskip("numpy")
    make = {"numpy array": lambda: np.array([4]), "list of numpy.int64": lambda: [np.int64(4)],
            "range": lambda: range(4, 5)}[one_element]
    torch.manual_seed(3)
    model = Model(24, 16, make(), 2.0)
    new = ModelNew(24, 16, make(), 2.0)
    new.load_state_dict(model.state_dict())
    assert type(new.pool_kernel_size) is int and new.pool_kernel_size == 4
    assert ModelNew.from_model(model).pool_kernel_size == 4
    x = torch.rand(5, 24)
    torch.testing.assert_close(new(x), model(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pool_kernel_size", [0, 2.5, None, "2", True, 2**70])
def test_a_pool_kernel_size_set_after_construction_is_checked_at_the_call(pool_kernel_size):
    model = ModelNew(16, 8, 2, 2.0)
    model.pool_kernel_size = pool_kernel_size
    match = "below 2\\*\\*63" if pool_kernel_size == 2**70 else "must be a positive integer"
    for grad in (False, True):
        with torch.set_grad_enabled(grad), pytest.raises(ValueError, match=match):
            model(torch.rand(3, 16))


def test_a_pool_kernel_size_set_after_construction_takes_what_the_constructor_takes():
    model = ModelNew(16, 8, 2, 2.0)
    reference = Model(16, 8, 4, 2.0)
    reference.load_state_dict(model.state_dict())
    x = torch.rand(3, 16)
    model.pool_kernel_size = 4.0
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model(x), reference(x), atol=1e-5, rtol=1e-5)
    assert model.folded_parameters()[0].shape == (2, 16)


@pytest.mark.parametrize("scale_factor", [None, "2.0", [2.0], object()])
def test_a_scale_factor_that_is_not_a_number_is_refused_by_name(scale_factor):
    with pytest.raises(TypeError, match="ModelNew: scale_factor must be a real number or a tensor"):
        ModelNew(16, 8, 2, scale_factor)
    model = ModelNew(16, 8, 2, 2.0)
    model.scale_factor = scale_factor
    for grad in (False, True):
        with torch.set_grad_enabled(grad), pytest.raises(
            TypeError, match="ModelNew: scale_factor must be a real number or a tensor, got"
        ):
            model(torch.rand(3, 16))


def test_scale_factors_of_other_number_types_give_models_answer():
    np = pytest.importorskip("numpy")
    x = torch.rand(3, 16)
    for scale in (2, np.float32(1.5), np.int64(3), True):
        torch.manual_seed(0)
        model = ModelNew(16, 8, 2, scale)
        torch.manual_seed(0)
        reference = Model(16, 8, 2, scale)
        torch.testing.assert_close(model(x), reference(x), atol=1e-5, rtol=1e-5)


def test_an_iterable_pool_kernel_size_of_two_elements_is_rejected():
    np = pytest.importorskip("numpy")
    with pytest.raises(ValueError, match=r"pool_kernel_size must be a positive integer, got array"):
        ModelNew(16, 8, np.array([2, 2]), 2.0)


def test_from_model_rejects_what_model_accepts_but_cannot_run():
    # nn.AvgPool1d takes kernel_size 0 at construction and fails only in its first forward.
    with pytest.raises(ValueError, match="pool_kernel_size must be a positive integer, got 0"):
        ModelNew.from_model(Model(16, 8, 0, 2.0))


def test_from_model_names_what_it_expected():
    with pytest.raises(TypeError, match="model must be a fused_pool_gelu.Model, got Linear"):
        ModelNew.from_model(torch.nn.Linear(16, 8))


# ----------------------------------------------------------------------------------------------
# Forward


@pytest.mark.parametrize("batch", [1, 17])
@pytest.mark.parametrize("args", ARGS)
def test_forward_matches_model(args, batch, device, ref):
    model, new = _pair(args, device)
    x = torch.rand(batch, args[0], device=device)  # KernelBench draws x with torch.rand
    out = new(x)
    assert out.shape == (batch,) and out.dtype == torch.float32
    with torch.no_grad():
        expected = copy.deepcopy(model).double()(x.double())
    # Relative to the outputs' size: at k = O they are ~1e-3, where a fixed atol would hide a lot.
    tol = ref.tolerance(torch.float32)
    torch.testing.assert_close(
        out.double(), expected, atol=tol * float(expected.abs().max()), rtol=tol
    )


@pytest.mark.parametrize("args", ARGS)
def test_forward_matches_model_in_float64(args):
    model, new = _pair(args, "cpu", torch.float64)  # float64 is a CPU dtype
    x = torch.randn(9, args[0], dtype=torch.float64)
    torch.testing.assert_close(new(x), model(x), atol=1e-10, rtol=1e-10)


def test_forward_under_no_grad_equals_forward_with_grad(device):
    _, new = _pair((48, 40, 4, 2.0), device)
    x = torch.randn(12, 48, device=device)
    with_grad = new(x)
    with torch.no_grad():
        without = new(x)
    assert torch.equal(with_grad.detach(), without)


def test_forward_of_an_empty_batch_is_empty(device):
    _, new = _pair((48, 40, 4, 2.0), device)
    out = new(torch.randn(0, 48, device=device))
    assert out.shape == (0,)


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=str)
def test_autocast_output_matches_model_under_autocast(dtype, device):
    model, new = _pair((64, 48, 4, 2.0), device)
    x = torch.rand(16, 64, device=device)
    with torch.autocast(device, dtype=dtype):
        expected = model(x)
        out = new(x)
        with torch.no_grad():
            cached = new(x)
    assert out.dtype == expected.dtype == cached.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(cached.float(), expected.float(), atol=1e-2, rtol=1e-2)


# ----------------------------------------------------------------------------------------------
# Training side by side


@pytest.mark.parametrize(
    "optimizer",
    [
        pytest.param(lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9), id="SGD"),
        pytest.param(lambda p: torch.optim.Adam(p, lr=1e-2), id="Adam"),
    ],
)
def test_optimizer_steps_keep_model_new_equal_to_model(optimizer, device):
    args = (48, 40, 4, 2.0)
    model, new = _pair(args, device)
    opt_model, opt_new = optimizer(model.parameters()), optimizer(new.parameters())
    x_eval = torch.randn(16, 48, device=device)
    for _ in range(6):
        x = torch.randn(32, 48, device=device)
        target = torch.randn(32, device=device)
        losses = []
        for m, opt in ((model, opt_model), (new, opt_new)):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x), target)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], atol=1e-4, rtol=1e-4)
        for (_, a), (_, b) in zip(model.named_parameters(), new.named_parameters()):
            torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
        # Inference between steps goes through the fold cache: it must follow the update.
        with torch.no_grad():
            torch.testing.assert_close(new(x_eval), model(x_eval), atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------------------------
# The fold cache


def _new_and_input(device="cpu", args=(48, 40, 4, 2.0)):
    torch.manual_seed(11)
    new = ModelNew(*args).to(device)
    return new, torch.randn(10, args[0], device=device)


def _expected(new, x):
    """Model with new's current parameters, on x (fresh, no cache)."""
    model = Model(new.matmul.in_features, new.matmul.out_features, new.pool_kernel_size,
                  new.scale_factor)
    model = model.to(device=new.matmul.weight.device, dtype=new.matmul.weight.dtype)
    model.load_state_dict(new.state_dict())
    with torch.no_grad():
        return model(x.to(new.matmul.weight.dtype))


def test_no_grad_calls_reuse_the_cached_fold(fold_calls, device):
    new, x = _new_and_input(device)
    with torch.no_grad():
        first = new(x)
        second = new(x)
        third = new(x)
    assert len(fold_calls) == 1
    assert torch.equal(first, second) and torch.equal(first, third)


def test_parameters_without_requires_grad_use_the_cache_with_grad_enabled(fold_calls, device):
    new, x = _new_and_input(device)
    new.requires_grad_(False)
    new(x)
    new(x)
    assert len(fold_calls) == 1


def test_cache_refolds_after_in_place_edit_under_no_grad(fold_calls, device):
    new, x = _new_and_input(device)
    with torch.no_grad():
        new(x)
        new.matmul.weight.mul_(-1.5)
        edited = new(x)
    assert len(fold_calls) == 2
    torch.testing.assert_close(edited, _expected(new, x), atol=1e-5, rtol=1e-5)


def test_cache_refolds_after_in_place_edit_of_the_bias(fold_calls, device):
    new, x = _new_and_input(device)
    with torch.no_grad():
        before = new(x)
        new.matmul.bias.add_(0.5)
        after = new(x)
    assert len(fold_calls) == 2 and not torch.equal(before, after)
    torch.testing.assert_close(after, _expected(new, x), atol=1e-5, rtol=1e-5)


def test_cache_refolds_after_the_pool_kernel_size_changes(fold_calls, device):
    # pool_kernel_size is a plain attribute, like Model's avg_pool.kernel_size: the no-grad path
    # (cached) must follow it as the training path (folded every call) does.
    new, x = _new_and_input(device)
    with torch.no_grad():
        new(x)
        new.pool_kernel_size = 8
        out = new(x)
    assert len(fold_calls) == 2
    torch.testing.assert_close(out, _expected(new, x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new(x), out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("assign", [False, True], ids=["copy", "assign"])
def test_cache_refolds_after_load_state_dict(assign, fold_calls, device):
    new, x = _new_and_input(device)
    torch.manual_seed(99)
    other = Model(48, 40, 4, 2.0).to(device)
    with torch.no_grad():
        new(x)
        new.load_state_dict(other.state_dict(), assign=assign)
        out = new(x)
        expected = other(x)
    assert len(fold_calls) == 2
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "convert",
    [
        pytest.param(lambda m: m.double(), id="double"),
        pytest.param(lambda m: m.to(torch.float64), id="to_float64"),
    ],
)
def test_cache_refolds_after_dtype_conversion(convert, fold_calls):
    new, x = _new_and_input()  # float64 is a CPU dtype; test_cuda.py moves between devices
    with torch.no_grad():
        new(x)
        convert(new)
        out = new(x.to(new.matmul.weight.dtype))
    assert len(fold_calls) == 2
    assert out.dtype == new.matmul.weight.dtype
    torch.testing.assert_close(out, _expected(new, x), atol=1e-5, rtol=1e-5)


def test_cache_follows_a_dtype_round_trip_that_changes_the_values():
    # .half().float() rounds the parameters. nn.Module._apply swaps in new storage through
    # `param.data = ...`, which leaves the version counter alone, and the allocator often hands
    # back the address just freed: identity, pointer, version, dtype and device can then all match
    # the cached stamp. Many fresh models of several sizes (several allocator size classes) make
    # that coincidence near certain to occur at least once.
    sizes = [(48, 40), (64, 64), (96, 32), (32, 96), (128, 128), (40, 48), (200, 100)]
    for trial in range(700):
        in_features, out_features = sizes[trial % len(sizes)]
        torch.manual_seed(trial)
        new = ModelNew(in_features, out_features, 4, 2.0)
        x = torch.randn(10, in_features)
        with torch.no_grad():
            new(x)
            new.half().float()
            out = new(x)
            fresh = ops.forward(
                x, *ops.fold(new.matmul.weight, new.matmul.bias, 4), new.scale_factor
            )
        assert torch.equal(out, fresh), f"stale fold after .half().float() (trial {trial})"


def test_cache_refolds_after_replacing_a_parameter(fold_calls, device):
    new, x = _new_and_input(device)
    with torch.no_grad():
        new(x)
        new.matmul.weight = torch.nn.Parameter(torch.randn_like(new.matmul.weight) * 0.1)
        out = new(x)
    assert len(fold_calls) == 2
    torch.testing.assert_close(out, _expected(new, x), atol=1e-5, rtol=1e-5)


def test_cache_refolds_after_data_assignment_of_another_storage_at_the_same_address(fold_calls):
    # `weight.data = other` keeps the parameter object and its version counter, and the new data
    # may sit at the old data's address (an allocator hands a freed block back). Made certain
    # here: two storages over one buffer, the second written through itself (no version bump of
    # the parameter). The stamp's storage identity tells them apart.
    new, x = _new_and_input("cpu")
    weight = new.matmul.weight
    buffer = bytearray(weight.numel() * weight.element_size())
    first = torch.frombuffer(buffer, dtype=weight.dtype).view(weight.shape)
    second = torch.frombuffer(buffer, dtype=weight.dtype).view(weight.shape)
    with torch.no_grad():
        first.copy_(weight)
        weight.data = first
        new(x)
        second.copy_(torch.randn_like(second))
        weight.data = second
        assert weight.data_ptr() == first.data_ptr()
        out = new(x)
    assert len(fold_calls) == 2
    torch.testing.assert_close(out, _expected(new, x), atol=1e-5, rtol=1e-5)


def test_cache_refolds_after_data_assignments_whose_storage_was_freed():
    # The common form of the case above: the cached storage freed (`.data` replaced twice), and a
    # new one allocated where it was. Without the cache entry's weak references to the stamped
    # storages about half of these calls served the old fold on this CPU's allocator.
    for shape in [(40, 48), (64, 32)]:
        torch.manual_seed(7)
        new = ModelNew(shape[1], shape[0], 4, 2.0)
        x = torch.randn(6, shape[1])
        weight = new.matmul.weight
        for trial in range(40):
            with torch.no_grad():
                new(x)
                weight.data = torch.empty(0)
                weight.data = torch.randn(shape)
                out = new(x)
                fresh = ops.forward(x, *ops.fold(weight, new.matmul.bias, 4), new.scale_factor)
            assert torch.equal(out, fresh), f"stale fold after .data reassignment (trial {trial})"


def test_cache_refolds_after_data_assignment_of_a_view_of_the_same_storage(fold_calls):
    # Same storage, address and version counter: the shape and strides tell the views apart.
    new, x = _new_and_input("cpu", args=(40, 40, 4, 2.0))
    weight = new.matmul.weight
    with torch.no_grad():
        new(x)
        weight.data = weight.data.t()
        out = new(x)
    assert len(fold_calls) == 2
    torch.testing.assert_close(out, _expected(new, x), atol=1e-5, rtol=1e-5)


def test_cache_refolds_after_data_assignment_of_another_offset_of_the_same_storage(fold_calls):
    # Same storage, shape, strides and version counter, another offset into the storage: the
    # data pointer tells them apart.
    new, x = _new_and_input("cpu")
    weight = new.matmul.weight
    flat = torch.randn(2 * weight.numel())
    with torch.no_grad():
        weight.data = flat[: weight.numel()].view(weight.shape)
        new(x)
        weight.data = flat[weight.numel():].view(weight.shape)
        out = new(x)
    assert len(fold_calls) == 2
    torch.testing.assert_close(out, _expected(new, x), atol=1e-5, rtol=1e-5)


def test_cache_refolds_after_data_assignment_of_fewer_rows_of_the_same_storage(fold_calls):
    # Same storage, data pointer, strides and version counter, fewer rows (the bias sliced to
    # match): the shape tells them apart.
    new, x = _new_and_input("cpu", args=(40, 48, 4, 2.0))
    weight, bias = new.matmul.weight, new.matmul.bias
    with torch.no_grad():
        new(x)
        weight.data = weight.data[:12]
        bias.data = bias.data[:12]
        out = new(x)
    assert len(fold_calls) == 2
    assert out.shape == (x.shape[0],)
    fresh = ops.forward(x, *ops.fold(weight, bias, 4), new.scale_factor)
    assert torch.equal(out, fresh)


def test_load_state_dict_swapping_parameters_after_a_cached_call(device):
    # Under torch.__future__.set_swap_module_params_on_conversion(True) load_state_dict swaps
    # parameters (torch.utils.swap_tensors), which refuses tensors with weak references, as the
    # fold cache holds: Model loads, and so must ModelNew after a cached no-grad call.
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        new, x = _new_and_input(device)
        torch.manual_seed(12)
        other = ModelNew(48, 40, 4, 2.0).to(device)
        with torch.no_grad():
            new(x)
            new.load_state_dict(other.state_dict())
            assert torch.equal(new(x), other(x))
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


def test_invalidate_fold_forces_a_refold_after_a_data_edit(fold_calls, device):
    new, x = _new_and_input(device)
    with torch.no_grad():
        new(x)
        new.matmul.weight.data.mul_(-2.0)  # bypasses the version counter
        new.invalidate_fold()
        out = new(x)
    assert len(fold_calls) == 2
    torch.testing.assert_close(out, _expected(new, x), atol=1e-5, rtol=1e-5)


class _ModelNewWithMatmulProperty(ModelNew):
    """A subclass that keeps its Linear under another name and serves `matmul` as a property."""

    def __init__(self, *args):
        super().__init__(*args)
        self.inner = self._modules.pop("matmul")

    @property
    def matmul(self):
        return self.inner


def test_a_subclass_may_serve_matmul_as_a_property(device):
    model, _ = _pair((64, 48, 4, 2.0), device)
    torch.manual_seed(1234)
    new = _ModelNewWithMatmulProperty(64, 48, 4, 2.0).to(device)
    x = torch.rand(5, 64, device=device)
    with torch.no_grad():
        torch.testing.assert_close(new(x), model(x), atol=1e-5, rtol=1e-5)


class _Doubled(torch.nn.Module):
    def forward(self, tensor):
        return 2.0 * tensor


@pytest.mark.parametrize("names", [("weight",), ("bias",), ("weight", "bias")], ids="+".join)
def test_parametrized_parameters_are_the_ones_used(names, device, fold_calls):
    # torch.nn.utils.parametrize replaces a registered parameter by a property computed at each
    # access: ModelNew must read it (not the parameter dict, where it no longer is), with grad and
    # without, as Model does, and keep the fused path (fold_calls: not Model's computation).
    from torch.nn.utils import parametrize

    model, new = _pair((64, 48, 4, 2.0), device)
    for module in (model, new):
        for name in names:
            parametrize.register_parametrization(module.matmul, name, _Doubled())
    x = torch.rand(5, 64, device=device)
    with torch.no_grad():
        expected = model(x)
        torch.testing.assert_close(new(x), expected, atol=1e-5, rtol=1e-5)
    out = new(x)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    out.sum().backward()
    original = new.matmul.parametrizations[names[0]].original
    assert original.grad is not None and bool(original.grad.any())
    # Both calls fused, each folding once (a parametrized weight is a new tensor at each access,
    # never a cache hit): the no-grad one through the cache's fold, the training one in its node.
    assert len(fold_calls) == 2


class _LinearTimesTwo(torch.nn.Linear):
    """A Linear subclass with its own forward (as LoRA or quantized layers have)."""

    def forward(self, x):
        return 2.0 * super().forward(x)


def _spectral_norm(linear):
    torch.manual_seed(5)  # its power iteration's start vector
    torch.nn.utils.spectral_norm(linear)


def _prune(linear):
    from torch.nn.utils import prune

    prune.l1_unstructured(linear, "weight", amount=0.5)


def _forward_hook(linear):
    linear.register_forward_hook(lambda module, args, out: out - 0.25)


def _own_forward(linear):
    linear.__class__ = _LinearTimesTwo


@pytest.mark.parametrize("modify", [_spectral_norm, _prune, _forward_hook, _own_forward],
                         ids=["spectral_norm", "prune", "forward-hook", "own-forward"])
def test_a_matmul_that_runs_more_than_its_product_runs_models_computation(
    modify, fold_calls, device
):
    # What the fold cannot express (hooks on matmul, a subclass's forward) must not be skipped:
    # ModelNew then computes as Model does, the same bits, through two training steps.
    model, new = _pair((24, 16, 4, 2.0), device)
    for module in (model, new):
        modify(module.matmul)
    for step in range(2):
        x = torch.rand(6, 24, device=device)
        outs = []
        for module in (model, new):
            module.zero_grad()
            out = module(x)
            out.sum().backward()
            with torch.no_grad():
                for parameter in module.parameters():
                    parameter -= 0.1 * parameter.grad
            outs.append(out.detach())
        assert torch.equal(outs[1], outs[0]), step
    with torch.no_grad():
        assert torch.equal(new(x), model(x))
    assert not fold_calls


def test_a_global_module_hook_runs_models_computation(device):
    model, new = _pair((24, 16, 4, 2.0), device)
    x = torch.rand(6, 24, device=device)
    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, out: seen.append(type(module).__name__))
    try:
        with torch.no_grad():
            assert torch.equal(new(x), model(x))
    finally:
        handle.remove()
    assert seen.count("Linear") == 2  # matmul ran in both


def test_a_tensor_scale_factor_gets_models_gradient(device):
    model, new = _pair((24, 16, 4, 2.0), device)
    for module in (model, new):
        module.scale_factor = torch.nn.Parameter(torch.tensor(1.5, device=device))
    x = torch.rand(6, 24, device=device)
    for module in (model, new):
        module(x).sum().backward()
    assert new.scale_factor.grad is not None
    assert torch.equal(new.scale_factor.grad, model.scale_factor.grad)
    assert torch.equal(new.matmul.weight.grad, model.matmul.weight.grad)


def test_what_the_fold_cannot_see_through_warns_once_per_module_naming_it(device):
    # Model's computation is several to tens of times slower than the fused path: never silently.
    # The fused path and a tensor scale_factor (documented: Model computes its gradient) do not
    # warn.
    _, new = _pair((24, 16, 4, 2.0), device)
    _, other = _pair((24, 16, 4, 2.0), device)
    x = torch.rand(6, 24, device=device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        new(x)
        _, scaled = _pair((24, 16, 4, 2.0), device)
        scaled.scale_factor = torch.nn.Parameter(torch.tensor(1.5, device=device))
        scaled(x)
        assert not [w for w in caught if "fused_pool_gelu" in str(w.message)]
        new.matmul.register_forward_pre_hook(lambda module, args: None)
        other.matmul.__class__ = _LinearTimesTwo
        for _ in range(2):
            new(x)
            other(x)
    messages = [str(w.message) for w in caught if "fused_pool_gelu" in str(w.message)]
    assert len(messages) == 2, messages
    assert all(w.filename == __file__ for w in caught), [w.filename for w in caught]
    assert "matmul (Linear) runs more than x @ weight.T + bias: forward pre-hook" in messages[0]
    assert "<lambda>" in messages[0]
    assert "its own forward (_LinearTimesTwo.forward)" in messages[1]
    for message in messages:
        assert "runs Model's computation" in message and "slower" in message


def test_an_in_place_edit_of_the_folded_parameters_makes_the_next_call_refold(fold_calls, device):
    new, x = _new_and_input(device)
    with torch.no_grad():
        expected = new(x)
        pooled_weight, pooled_bias = new.folded_parameters()
        assert not pooled_weight.requires_grad
        pooled_weight.mul_(0)
        calls = len(fold_calls)
        assert torch.equal(new(x), expected)
    assert len(fold_calls) == calls + 1


def test_a_jit_trace_follows_weight_updates(device):
    model, new = _pair((24, 16, 4, 2.0), device)
    x = torch.rand(6, 24, device=device)
    with torch.no_grad():
        new(x)  # a warm cache: a trace of the cached path would hold the folded weight as constants
        traced = torch.jit.trace(new, x, check_trace=False)
        for module in (model, new):
            module.matmul.weight.mul_(-1.5)
        torch.testing.assert_close(traced(x), model(x), atol=1e-5, rtol=1e-5)


def test_grad_enabled_calls_reuse_the_fold_and_the_weight_gets_a_gradient(fold_calls, device):
    new, x = _new_and_input(device)
    new(x).sum().backward()
    new(x).sum().backward()
    assert len(fold_calls) == 1  # parameters unchanged between the calls (no optimizer step)
    assert new.matmul.weight.grad is not None and new.matmul.bias.grad is not None
    assert bool(new.matmul.weight.grad.any()) and bool(new.matmul.bias.grad.any())


def _training_step(module, x, grad_out):
    """Gradients of x, weight and bias from one step: grads set to None, forward, backward."""
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    module(x).backward(grad_out)
    return x.grad, module.matmul.weight.grad, module.matmul.bias.grad


@pytest.mark.parametrize("args", ARGS)
def test_training_step_gradients_match_model(args, device, exact_dtype):
    model, new = _pair(args, device, exact_dtype)
    x = torch.randn(24, args[0], device=device, dtype=exact_dtype)
    grad_out = torch.randn(24, device=device, dtype=exact_dtype)
    tol = 1e-10 if exact_dtype == torch.float64 else 1e-4
    for ours, expected in zip(_training_step(new, x, grad_out), _training_step(model, x, grad_out)):
        torch.testing.assert_close(ours, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("args", ARGS)
def test_training_step_equals_fold_then_forward_bit_for_bit(args, device):
    # The eager training path (ops.model_forward, one autograd node) against the ops one by one.
    _, new = _pair(args, device)
    x = torch.randn(24, args[0], device=device)
    grad_out = torch.randn(24, device=device)
    fused = _training_step(new, x, grad_out)
    weight = new.matmul.weight.detach().clone().requires_grad_(True)
    bias = new.matmul.bias.detach().clone().requires_grad_(True)
    x_leaf = x.clone().requires_grad_(True)
    ops.forward(x_leaf, *ops.fold(weight, bias, new.pool_kernel_size), new.scale_factor).backward(
        grad_out
    )
    for a, b in zip(fused, (x_leaf.grad, weight.grad, bias.grad)):
        # Bits, zeros made +0.0 (model_forward skips the zero preactivation gradient of the
        # separate ops' autograd, which only flips the sign of zeros).
        a, b = (torch.where(t == 0, torch.zeros_like(t), t).view(torch.int32) for t in (a, b))
        assert torch.equal(a, b)


def test_eager_training_records_one_autograd_node_for_the_block(device):
    new, x = _new_and_input(device)
    out = new(x)
    # Straight from the block's node to the parameters (x does not require grad: no edge).
    leaves = [fn.variable for fn, _ in out.grad_fn.next_functions if fn is not None]
    assert leaves == [new.matmul.weight, new.matmul.bias]


def _frozen_pair(device):
    torch.manual_seed(21)
    model = Model(48, 40, 4, 2.0).to(device).requires_grad_(False)
    return model, ModelNew.from_model(model)


def _input_gradient(module, x):
    x = x.clone().requires_grad_(True)
    module(x).sum().backward()
    return x.grad


def test_frozen_model_gives_input_gradients(device):
    model, new = _frozen_pair(device)
    x = torch.randn(12, 48, device=device)
    torch.testing.assert_close(
        _input_gradient(new, x), _input_gradient(model, x), atol=1e-4, rtol=1e-4
    )


def test_frozen_model_gives_input_gradients_after_an_inference_mode_call(device):
    # Inference first (the fold gets cached), then input gradients (saliency, adversarial
    # examples): the cached fold must still be usable by autograd.
    model, new = _frozen_pair(device)
    x = torch.randn(12, 48, device=device)
    with torch.inference_mode():
        new(x)
    torch.testing.assert_close(
        _input_gradient(new, x), _input_gradient(model, x), atol=1e-4, rtol=1e-4
    )


def test_folded_parameters_are_the_fold_of_the_current_weights(device):
    new, x = _new_and_input(device)
    with torch.no_grad():
        new(x)  # fills the cache
        new.matmul.weight.mul_(-1.5)
        new.matmul.bias.add_(0.25)
    pooled_weight, pooled_bias = new.folded_parameters()
    with torch.no_grad():
        expected_weight, expected_bias = ops.fold(new.matmul.weight, new.matmul.bias, 4)
    assert torch.equal(pooled_weight, expected_weight)
    assert torch.equal(pooled_bias, expected_bias)
    assert not pooled_weight.requires_grad


# ----------------------------------------------------------------------------------------------
# Serialization


def test_deepcopy_after_a_cached_forward_gives_an_equal_independent_model(device):
    new, x = _new_and_input(device)
    with torch.no_grad():
        expected = new(x)  # the cache now holds weak references
    clone = copy.deepcopy(new)
    with torch.no_grad():
        assert torch.equal(clone(x), expected)
        clone.matmul.weight.mul_(2.0)
        assert torch.equal(new(x), expected)
        torch.testing.assert_close(clone(x), _expected(clone, x), atol=1e-5, rtol=1e-5)


def test_pickle_round_trip_after_a_cached_forward(device):
    new, x = _new_and_input(device)
    with torch.no_grad():
        expected = new(x)
    restored = pickle.loads(pickle.dumps(new))
    with torch.no_grad():
        assert torch.equal(restored(x), expected)


def test_torch_save_and_load_of_the_whole_module():
    new, x = _new_and_input()
    with torch.no_grad():
        expected = new(x)
    buffer = io.BytesIO()
    torch.save(new, buffer)
    buffer.seek(0)
    restored = torch.load(buffer, weights_only=False)
    with torch.no_grad():
        assert torch.equal(restored(x), expected)


# ----------------------------------------------------------------------------------------------
# DistributedDataParallel (gloo, 2 CPU processes)


def test_ddp_gradients_equal_single_process_gradients(tmp_path):
    args, batch = (48, 40, 4, 2.0), 16
    worker = Path(__file__).with_name("_ddp_worker.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, str(worker), str(tmp_path)]
    command += [str(a) for a in args] + [str(batch)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr

    torch.manual_seed(0)
    model = ModelNew(*args)
    torch.manual_seed(1)
    x = torch.randn(batch, args[0])
    model(x).mean().backward()
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for name, p in model.named_parameters():
        for saved in ranks:
            torch.testing.assert_close(saved["grads"][name], p.grad, atol=1e-6, rtol=1e-5)
    # Each rank's loss is the mean over its own half of the batch.
    with torch.no_grad():
        halves = [model(h).mean() for h in x.chunk(2)]
    for saved, expected in zip(ranks, halves):
        torch.testing.assert_close(saved["loss"], expected, atol=1e-6, rtol=1e-6)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_an_ensemble_through_torch_func_vmap_matches_its_members(device):
    # torch.func.stack_module_state + functional_call under vmap: the parameters are functorch's
    # batched wrappers, with no storage for the fold cache's stamp (this raised "Cannot access
    # data pointer of Tensor that doesn't have storage"). ModelNew folds them uncached; the
    # per-sample fallback runs the ops member by member: the members' own bits and gradients.
    torch.manual_seed(0)
    x = torch.rand(4, 8, device=device)
    members = [ModelNew(8, 8, 2, 2.0).to(device) for _ in range(3)]
    params, buffers = torch.func.stack_module_state(members)
    base = copy.deepcopy(members[0]).to("meta")
    ensemble = torch.func.vmap(
        lambda p, b, t: torch.func.functional_call(base, (p, b), (t,)), in_dims=(0, 0, None)
    )
    with torch.no_grad():
        torch.testing.assert_close(ensemble(params, buffers, x),
                                   torch.stack([m(x) for m in members]), rtol=0, atol=0)
    out = ensemble(params, buffers, x)
    torch.testing.assert_close(out, torch.stack([m(x) for m in members]), rtol=0, atol=0)
    out.sum().backward()
    for member in members:
        member(x).sum().backward()
    for name, stacked in params.items():
        expected = torch.stack([dict(m.named_parameters())[name].grad for m in members])
        torch.testing.assert_close(stacked.grad, expected)
