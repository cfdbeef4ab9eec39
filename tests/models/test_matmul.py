"""The projections' matmul: oneDNN's packed path against `x @ W`, its fallbacks, the
packed copy's lifetime, and the model options `matmul` and `weights`."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from decodelab.models import matmul
from decodelab.models.errors import SetupError
from decodelab.models.loading import load, random_model
from decodelab.models.matmul import PackedWeight, impl_problems, project
from tests.conftest import TINY, cache_for, random_ids

needs_onednn = pytest.mark.skipif(not matmul.onednn_available(), reason="torch built without oneDNN")


def forward(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids]), torch.arange(len(ids))[None], cache_for(model, 1, len(ids)))


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9, 17, 64, 65])
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


@needs_onednn
def test_batches_and_strided_inputs():
    w, b = torch.randn(40, 24), torch.randn(24)
    x = torch.randn(3, 5, 40)  # [B, T, in]: 15 rows
    xt = torch.randn(40, 2, 5).permute(1, 2, 0)  # [2, 5, 40], not contiguous
    with torch.no_grad():
        for inp in (x, xt, x[:, -1:]):
            torch.testing.assert_close(project(inp, w, b, "onednn", PackedWeight()), inp @ w + b, rtol=1e-5,
                                       atol=1e-4)


@needs_onednn
def test_models_built_under_inference_mode_run():
    with torch.inference_mode():  # inference tensors keep no version counter
        for name in ("llama", "llama3-rope-untied"):
            m = random_model(TINY[name], device="cpu", matmul="onednn").model
            out = m(torch.tensor([random_ids(6)]), torch.arange(6)[None], cache_for(m, 1, 6))
            assert out.shape == (1, 6, 256) and m.layers[0].attn.wqkv.packed.packed is not None


def test_fallbacks_to_reference():
    w = torch.randn(16, 8, requires_grad=True)
    x = torch.randn(3, 16)
    packed = PackedWeight()
    y = project(x, w, None, "onednn", packed)  # autograd needs the reference
    assert y.grad_fn is not None and packed.packed is None
    b = torch.zeros(8, requires_grad=True)
    project(x, w.detach(), b, "onednn", packed).sum().backward()  # a bias that wants a gradient too
    assert torch.equal(b.grad, torch.full((8,), 3.0)) and packed.packed is None
    with torch.no_grad():
        project(x[:1], w, None, "onednn", packed)  # one row: MKL's gemv
        project(x.double(), w.double(), None, "onednn", packed)  # fp32 only
        project(x, w, None, "reference", packed)
        project(torch.randn(matmul.MAX_ROWS + 1, 16), w, None, "onednn", packed)  # a prefill: MKL
    assert packed.packed is None


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("out_in", [False, True])
def test_a_traced_projection_calls_onednn_as_one_opaque_op(rows, out_in):
    """Under torch.compile (inductor) a multi-row product is one `decodelab::onednn_linear`
    call on the packed copy (made when the compiled code first runs), not inductor's own
    matmul; one row stays `x @ W`. The PackedWeight is made on the meta device, as a model
    built there (`load`, `random_model`) makes it: its handle still lives on the CPU (a
    meta handle would dispatch the op to its fake, which returns uninitialized memory)."""
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(48, 80, generator=g), torch.randn(rows, 48, generator=g)
    with torch.device("meta"):
        packed = PackedWeight()
    assert packed.handle.device.type == "cpu"
    held = w.t().contiguous() if out_in else None  # a tied head's [out, in] weight
    fn = torch.compile(lambda a: project(a.relu(), w, None, "onednn", packed, held) + 1, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(fn(x), x.relu() @ w + 1, rtol=1e-5, atol=1e-4)
        first = packed.packed
        torch.testing.assert_close(fn(x * 2), (x * 2).relu() @ w + 1, rtol=1e-5, atol=1e-4)
    assert (packed.packed is not None) == (rows > 1)
    assert packed.packed is first  # packed once: the compiled code hands the op the same weight each call


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_a_pickled_packed_weight_packs_afresh(protocol):
    w, x, packed = torch.randn(16, 8), torch.randn(3, 16), PackedWeight()
    with torch.no_grad():
        project(x, w, None, "onednn", packed)
    copy_ = pickle.loads(pickle.dumps(packed, protocol=protocol))
    assert copy_.packed is None and int(copy_.handle) != int(packed.handle)  # derived data, a handle of its own
    if matmul.onednn_available():
        with torch.no_grad():
            torch.testing.assert_close(project(x, w, None, "onednn", copy_), x @ w, rtol=1e-5, atol=1e-4)


@needs_onednn
def test_a_traced_projection_of_dropped_weights_says_so():
    packed = PackedWeight()
    handle = packed.handle
    del packed
    with pytest.raises(RuntimeError, match="weights were dropped"):
        torch.ops.decodelab.onednn_linear(torch.randn(3, 4), torch.randn(4, 5), None, False, handle)


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
    assert e.value.reasons == ["model.weights.kind must be one of ['none', 'int8', 'int4'], got 'int3'",
                               "model.matmul must be one of ['auto', 'reference', 'onednn'], got 'mkl'"]
    with pytest.raises(SetupError, match="serves float32 models on a CPU.*use model.matmul=auto"):
        random_model(TINY["llama"], device="cpu", dtype="bfloat16", matmul="onednn")
    assert random_model(TINY["llama"], device="cpu", dtype="bfloat16").model.matmul == "reference"  # auto
    monkeypatch.setattr(matmul, "onednn_available", lambda: False)
    assert "needs a torch built with oneDNN" in impl_problems("onednn")[0]
    assert random_model(TINY["llama"], device="cpu", matmul="auto").model.matmul == "reference"


def test_setup_check_covers_target_and_draft_model_options():
    from hydra import compose, initialize_config_dir

    from decodelab.experiments import harness
    from decodelab.models.loading import CONF_DIR

    def reasons(*overrides):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = compose(config_name="config", overrides=list(overrides))
        with pytest.raises(SetupError) as e:
            harness.check(cfg)
        return e.value.reasons

    r = reasons("model.matmul=mkl", "decoder=speculative", "draft=model", "draft.model.weights.kind=int3")
    assert any(x.startswith("model.matmul must be one of") for x in r)
    assert any(x.startswith("draft.model.weights.kind must be one of") for x in r)
    for quantized in ("model.weights.kind=int8", "weights=int8", "model.weights=int8"):  # field, preset, kind alone
        r = reasons("model=tiny-llama", quantized, "decoder=speculative", "draft=int4-self")
        assert any("the target is quantized already (model.weights.kind=int8)" in x for x in r)
    r = reasons("model=tiny-llama", "decoder=speculative", "draft=int4-self", "draft.weights.group_size=0",
                "draft.weights.kernel=fast")
    assert {x.split(" must")[0] for x in r} == {"draft.weights.group_size", "draft.weights.kernel"}


def test_weights_option_quantizes_the_target():
    from decodelab.models.quantize import QuantProj

    ids = random_ids(24)
    full = forward(random_model(TINY["llama"], device="cpu").model, ids)
    q8 = random_model(TINY["llama"], device="cpu", weights="int8").model
    assert isinstance(q8.layers[0].mlp.w_down, QuantProj)
    out = forward(q8, ids)
    assert not torch.equal(out, full)  # quantized for real
    assert (out - full).abs().max() < 0.05 * full.abs().max()
    assert (out.argmax(-1) == full.argmax(-1)).float().mean() > 0.9
    from decodelab.decoding.drafters import quantized_self

    with pytest.raises(SetupError, match="quantized already"):  # a self-draft of it would be itself
        quantized_self(random_model(TINY["llama"], device="cpu", weights="int8"), "int4")
