"""The projections' matmul: oneDNN's packed path against `x @ W`, its fallbacks, the
packed copy's lifetime, and the model options `matmul` and `weights`."""

from __future__ import annotations

import copy

import pytest
import torch

from models import matmul
from models.errors import SetupError
from models.loading import load, random_model
from models.matmul import PackedWeight, impl_problems, project
from tests.conftest import TINY, cache_for, random_ids

needs_onednn = pytest.mark.skipif(not matmul.onednn_available(), reason="torch built without oneDNN")


def forward(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids]), torch.arange(len(ids))[None], cache_for(model, 1, len(ids)))


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9, 17, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_matches_reference(rows, bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(1, rows, 96, generator=g)  # [B, T, in]
    w = torch.randn(96, 200, generator=g)  # [in, out]
    b = torch.randn(200, generator=g) if bias else None
    ref = x @ w + (b if bias else 0)
    with torch.no_grad():
        y = project(x, w, b, "onednn", PackedWeight())
    assert y.shape == ref.shape == (1, rows, 200)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)


@needs_onednn
def test_packed_copy_follows_the_weight():
    w, x, packed = torch.randn(32, 48), torch.randn(4, 32), PackedWeight()
    with torch.no_grad():
        project(x, w, None, "onednn", packed)
        first = packed.packed
        project(x, w, None, "onednn", packed)
        assert packed.packed is first  # made once, reused
        w.mul_(2)  # an in-place change bumps the version: the copy is rebuilt
        torch.testing.assert_close(project(x, w, None, "onednn", packed), x @ w, rtol=1e-5, atol=1e-4)
    assert packed.packed is not first


def test_fallbacks_to_reference():
    w = torch.randn(16, 8, requires_grad=True)
    x = torch.randn(3, 16)
    packed = PackedWeight()
    y = project(x, w, None, "onednn", packed)  # autograd needs the reference
    assert y.grad_fn is not None and packed.packed is None
    with torch.no_grad():
        project(x[:1], w, None, "onednn", packed)  # one row: MKL's gemv
        project(x.double(), w.double(), None, "onednn", packed)  # fp32 only
        project(x, w, None, "reference", packed)
    assert packed.packed is None


@needs_onednn
@pytest.mark.parametrize("name", list(TINY))
def test_model_logits_agree_across_impls(name):
    ids = random_ids(40)
    ref = forward(random_model(TINY[name], device="cpu", matmul="reference").model, ids)
    fast = random_model(TINY[name], device="cpu", matmul="onednn").model
    assert fast.matmul == "onednn" and fast.layers[0].mlp.w_down.matmul == "onednn"
    torch.testing.assert_close(forward(fast, ids), ref, rtol=1e-4, atol=1e-4)
    assert fast.layers[0].mlp.w_down.packed.packed is not None  # the fast path really ran
    twin = copy.deepcopy(fast)  # packed copies are derived: a copy rebuilds its own
    assert twin.layers[0].mlp.w_down.packed.packed is None
    torch.testing.assert_close(forward(twin, ids), forward(fast, ids), rtol=0, atol=0)


def test_bad_options_are_refused_before_loading(monkeypatch):
    assert impl_problems("mkl") == ["matmul must be one of ['auto', 'reference', 'onednn'], got 'mkl'"]
    with pytest.raises(SetupError) as e:
        load("smollm2-135m", matmul="mkl", weights="int3")  # fails before the GGUF is touched
    assert len(e.value.reasons) == 2 and "weights must be one of" in str(e.value)
    monkeypatch.setattr(matmul, "onednn_available", lambda: False)
    assert "needs a torch built with oneDNN" in impl_problems("onednn")[0]
    assert random_model(TINY["llama"], device="cpu", matmul="auto").model.matmul == "reference"


def test_weights_option_quantizes_the_target():
    from optimum.quanto import QModuleMixin

    ids = random_ids(24)
    full = forward(random_model(TINY["llama"], device="cpu").model, ids)
    q8 = random_model(TINY["llama"], device="cpu", weights="int8").model
    assert isinstance(q8.layers[0].mlp.w_down, QModuleMixin)
    out = forward(q8, ids)
    assert not torch.equal(out, full)  # quantized for real
    assert (out - full).abs().max() < 0.05 * full.abs().max()
    assert (out.argmax(-1) == full.argmax(-1)).float().mean() > 0.9
