"""FoldedModel (fused_pool_gelu/folded.py): a trained block as an inference-only module of pooled
buffers, with ModelNew's results."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from fused_pool_gelu import FoldedModel, Model, ModelNew

K, O, POOL, SCALE = 64, 50, 4, 2.0  # O % k = 2 tail rows, dropped by the fold


def _trained(device):
    torch.manual_seed(0)
    model = ModelNew(K, O, POOL, SCALE).to(device)
    # A step of training, so that the parameters are not the initial ones.
    x = torch.rand(8, K, device=device)
    model(x).sum().backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    return model


def _expected(model, x):
    with torch.no_grad():
        return model(x)


def test_from_model_new_gives_model_news_bits(device):
    model = _trained(device)
    folded = FoldedModel.from_model(model)
    x = torch.rand(9, K, device=device)
    torch.testing.assert_close(folded(x), _expected(model, x), atol=0, rtol=0)


def test_from_model_and_from_state_dict_give_the_same_module(device):
    model = _trained(device)
    reference = Model(K, O, POOL, SCALE).to(device)
    reference.load_state_dict(model.state_dict())
    x = torch.rand(5, K, device=device)
    expected = _expected(model, x)
    for folded in (FoldedModel.from_model(reference),
                   FoldedModel.from_state_dict(model.state_dict(), POOL, SCALE)):
        torch.testing.assert_close(folded(x), expected, atol=0, rtol=0)


def test_its_buffers_are_the_pooled_tensors_and_no_parameters(device):
    model = _trained(device)
    folded = FoldedModel.from_model(model)
    assert list(folded.parameters()) == []
    assert folded.pooled_weight.shape == (O // POOL, K)
    assert folded.pooled_bias.shape == (O // POOL,)
    assert set(folded.state_dict()) == {"pooled_weight", "pooled_bias"}
    # k times less weight memory than the Linear's (O // k rows instead of O).
    assert folded.pooled_weight.numel() * POOL <= model.matmul.weight.numel()
    on_cuda_f32 = folded.pooled_weight.is_cuda and folded.pooled_weight.dtype == torch.float32
    assert (folded.prepared_weight is not None) == on_cuda_f32


def test_state_dict_round_trip_through_a_file(device):
    folded = FoldedModel.from_model(_trained(device))
    buffer = io.BytesIO()
    torch.save(folded.state_dict(), buffer)
    buffer.seek(0)
    torch.manual_seed(1)
    other = FoldedModel(torch.rand(O // POOL, K, device=device),
                        torch.rand(O // POOL, device=device), SCALE)
    other.load_state_dict(torch.load(buffer, weights_only=True))
    x = torch.rand(4, K, device=device)
    torch.testing.assert_close(other(x), folded(x), atol=0, rtol=0)


def test_dtype_conversion_remakes_what_it_needs(device):
    # To another dtype of the device (float64 on the CPU; CUDA computes in float32 and the halves)
    # and back: the prepared copy only for CUDA float32.
    model = _trained(device)
    other = torch.float64 if device == "cpu" else torch.float16
    tol = 1e-6 if other == torch.float64 else 1e-2
    folded = FoldedModel.from_model(model).to(other)
    assert folded.pooled_weight.dtype == other and folded.prepared_weight is None
    x = torch.rand(4, K, device=device)
    # Folded in float32 then converted, against ModelNew folding in the other dtype.
    torch.testing.assert_close(folded(x.to(other)), _expected(copy.deepcopy(model).to(other),
                                                              x.to(other)), atol=tol, rtol=tol)
    back = folded.float()
    assert back.pooled_weight.dtype == torch.float32
    assert (back.prepared_weight is not None) == back.pooled_weight.is_cuda
    torch.testing.assert_close(back(x), _expected(model, x), atol=tol, rtol=tol)


@pytest.mark.cuda
def test_moving_to_cuda_and_back(make_inputs):
    model = _trained("cpu")
    folded = FoldedModel.from_model(model).to("cuda")
    assert folded.prepared_weight is not None and folded.prepared_weight.is_cuda
    x = torch.rand(300, K)
    torch.testing.assert_close(folded(x.cuda()).cpu(), _expected(model, x), atol=1e-5, rtol=1e-5)
    assert folded.cpu().prepared_weight is None


def test_an_in_place_edit_needs_prepare_on_cuda_and_nothing_on_the_cpu(device):
    folded = FoldedModel.from_model(_trained(device))
    with torch.no_grad():
        folded.pooled_weight.mul_(0.5)
    x = torch.rand(3, K, device=device)
    if folded.prepared_weight is not None:
        with pytest.raises(RuntimeError, match="prepared_weight"):
            folded(x)
    folded.prepare()
    expected = FoldedModel(folded.pooled_weight, folded.pooled_bias, SCALE)(x)
    torch.testing.assert_close(folded(x), expected, atol=0, rtol=0)


def test_compile_and_export_give_its_results(device):
    folded = FoldedModel.from_model(_trained(device))
    x = torch.rand(6, K, device=device)
    expected = folded(x)
    compiled = torch.compile(folded, fullgraph=True)
    torch.testing.assert_close(compiled(x), expected, atol=0, rtol=0)
    exported = torch.export.export(folded, (x,))
    torch.testing.assert_close(exported.module()(x), expected, atol=0, rtol=0)


@pytest.mark.cuda
@pytest.mark.graphs
def test_a_cuda_graph_replay_gives_its_results(capture_graph):
    folded = FoldedModel.from_model(_trained("cuda"))
    x = torch.rand(300, K, device="cuda")
    expected = folded(x)
    with torch.no_grad():
        graph, out = capture_graph(lambda: folded(x))
    graph.replay()
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_what_the_fold_cannot_express_is_refused_by_name():
    model = ModelNew(K, O, POOL, SCALE)
    model.matmul.register_forward_pre_hook(lambda module, args: None)
    with pytest.raises(ValueError, match="FoldedModel.from_model: the model's matmul must be a "
                                         "plain nn.Linear"):
        FoldedModel.from_model(model)
    with pytest.raises(TypeError, match="model must be a fused_pool_gelu.Model or ModelNew, got "
                                        "Linear"):
        FoldedModel.from_model(torch.nn.Linear(4, 4))
    with pytest.raises(KeyError, match="state_dict must hold 'matmul.weight'"):
        FoldedModel.from_state_dict({}, POOL, SCALE)
    with pytest.raises(TypeError, match="scale_factor must be a real number"):
        FoldedModel(torch.rand(3, K), torch.rand(3), torch.tensor(2.0))
