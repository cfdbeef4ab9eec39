"""The int4 backend: quantization against optimum-quanto, the full-precision residual,
rollback, agreement with dense on the tiny models, byte accounting, option checks."""

from __future__ import annotations

import functools

import pytest
import torch
from optimum.quanto import quantize_weight

from cache.base import CacheLayout
from cache.dense import DenseCache
from cache.int4 import QTYPES, Grouping, QuantizedCache, bf16_ratio, dequantize_into, quantize
from decoding import generate, greedy, prefill
from decoding.drafters import EarlyExit, ModelDrafter
from decoding.speculative import SpeculativeDecoder
from decoding.text import make_cache
from models.errors import SetupError
from tests.cache.test_contract import History, assert_close, build, check_all
from tests.conftest import random_ids

# small groups and residual so that the contract shapes (head_dim 8) really quantize
SMALL = dict(residual=4, group_size=32, flush=32)


def layout(n_layers=1, n_kv=2, head_dim=64, windows=None, dtype=torch.float32):
    return CacheLayout(n_layers, n_kv, head_dim, dtype, torch.device("cpu"), windows or (None,) * n_layers,
                       softmax_scale=head_dim**-0.5)


def fill(cache, k, v, positions, valid=None):
    """One forward through every layer with the same k, v [B, H, T, D]; returns outputs."""
    B, H, T, D = k.shape
    cache.prepare(positions, valid)
    q = torch.randn(B, 2 * H, T, D)
    return [cache.attend(layer, q, k, v, positions) for layer in range(cache.layout.n_layers)]


def columns(t: torch.Tensor, g: Grouping) -> torch.Tensor:
    """A store tensor back in quanto's layout [R or 1, C] (one group per column)."""
    return t.movedim(g.pdim, 0).reshape(t.shape[g.pdim], -1)


def dequantized(x: torch.Tensor, g: Grouping, scale_dtype=torch.float16) -> torch.Tensor:
    out = torch.empty_like(x)  # [H, N, D]
    dequantize_into(g.region(out, x.shape[1]), quantize(x, g, scale_dtype), g)
    return out


# -- the contract, with quantization really happening ------------------------------------
@pytest.mark.parametrize("windows", [(8, None), (None, 4)])
@pytest.mark.parametrize("q_len", [1, 5])
@pytest.mark.parametrize("key_axis", ["channel", "token"])  # token: windows start inside the residual
def test_contract_attention_while_quantizing(windows, q_len, key_axis):
    c = build("int4", windows, capacity=128, key_axis=key_axis, **SMALL)
    h = History(c)
    pos = torch.arange(70).expand(2, -1)
    valid = pos < torch.tensor([[45], [70]])  # mixed lengths, padding never stored
    check_all(h, h.step(pos, valid, seed=1), pos, valid)
    assert [c.quantized_tokens(b) for b in range(2)] == [32, 64]
    assert [c.quantized_tokens(b) + c.kr[0][b].shape[1] for b in range(2)] == [45, 70]  # no padding stored
    for s in range(3):
        nxt = c.lengths[:, None] + torch.arange(q_len)
        check_all(h, h.step(nxt, seed=2 + s), nxt)
    for layer in range(2):
        for row in range(2):
            pos_r, k, v = c.read(layer, row)
            assert pos_r.tolist() == list(range(int(c.lengths[row])))
            assert_close(c, k, torch.stack([h.kv[layer, row, int(p)][0] for p in pos_r], 1))
            assert_close(c, v, torch.stack([h.kv[layer, row, int(p)][1] for p in pos_r], 1))


# -- quantization ------------------------------------------------------------------------
@pytest.mark.parametrize("axis", ["channel", "token"])
@pytest.mark.parametrize("nbits", [4, 2])
def test_dequantize_matches_quanto(axis, nbits):
    """The fused unpack reads quanto's packing: the same values as quanto's own dequantize()."""
    torch.manual_seed(0)
    g = Grouping(axis, 32, nbits)
    x = torch.randn(2, 64, 64) * 3 + 1  # [H, N, D]
    s = quantize(x, g, torch.float32)
    ref = quantize_weight(g.columns(x), QTYPES[nbits], -1, columns(s.scale, g), -columns(s.offset, g), 32,
                          optimized=False)
    assert torch.equal(ref._data._data, columns(s.data, g))  # quanto's bytes, stored as they are
    torch.testing.assert_close(g.columns(dequantized(x, g, torch.float32)), ref.dequantize(), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("axis", ["channel", "token"])
def test_round_trip_error_within_half_a_step(axis):
    torch.manual_seed(1)
    g = Grouping(axis, 64, 4)
    x = torch.randn(3, 128, 64) * torch.linspace(0.1, 5, 64)  # channels of different ranges
    s = quantize(x, g, torch.float16)
    err = g.columns((dequantized(x, g) - x).abs())  # [G, C]
    scale, offset = columns(s.scale, g).float(), columns(s.offset, g).float()  # [1, C]
    slack = 2**-10 * (offset.abs() + 15 * scale) + 1e-6  # scales and shifts rounded to fp16
    assert bool((err <= scale / 2 + slack).all())


def test_qint2_coarser_than_qint4():
    torch.manual_seed(2)
    x = torch.randn(3, 128, 64)
    errs = {b: (dequantized(x, Grouping("channel", 64, b)) - x).abs().mean().item() for b in (4, 2)}
    assert errs[2] > 3 * errs[4]  # 3 levels a step vs 15


@pytest.mark.parametrize("nbits, bound", [(4, 0.1), (2, 0.6)])  # relative error, Gaussian data
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("axes", [("channel", "token"), ("token", "channel"), ("channel", "channel"),
                                  ("token", "token")])
def test_every_option_round_trips(nbits, bound, group_size, axes):
    c = QuantizedCache(layout(), 1, 300, nbits=nbits, group_size=group_size, residual=8, key_axis=axes[0],
                       value_axis=axes[1])
    k, v = torch.randn(1, 2, 200, 64), torch.randn(1, 2, 200, 64)
    fill(c, k, v, torch.arange(200)[None])
    q = c.quantized_tokens(0)
    assert q == 200 - 8 - (200 - 8) % group_size
    _, rk, rv = c.read(0, 0)
    for got, want in ((rk, k[0]), (rv, v[0])):
        assert (got[:, :q] - want[:, :q]).norm() / want[:, :q].norm() < bound
        assert torch.equal(got[:, q:], want[:, q:])


# -- the residual and rollback -----------------------------------------------------------
def test_last_residual_tokens_exact_after_long_prefill():
    c = QuantizedCache(layout(n_layers=2), 1, 200, residual=16, group_size=32)
    k, v = torch.randn(1, 2, 150, 64), torch.randn(1, 2, 150, 64)
    fill(c, k, v, torch.arange(150)[None])
    q = c.quantized_tokens(0)
    assert q == 128 and 150 - q >= 16  # whole blocks quantized, the newest kept exact
    for layer in range(2):
        pos, rk, rv = c.read(layer, 0)
        assert torch.equal(rk[:, q:], k[0, :, q:]) and torch.equal(rv[:, q:], v[0, :, q:])
        assert not torch.equal(rk[:, :q], k[0, :, :q])  # the rest really is quantized


def test_prefill_attends_new_tokens_in_full_precision():
    """A forward's queries see its own tokens exactly: a prefill equals dense's."""
    lay = layout(n_layers=1)
    k, v = torch.randn(1, 2, 100, 64), torch.randn(1, 2, 100, 64)
    torch.manual_seed(3)
    got = fill(QuantizedCache(lay, 1, 100, residual=4, group_size=32), k, v, torch.arange(100)[None])
    torch.manual_seed(3)
    want = fill(DenseCache(lay, 1, 100), k, v, torch.arange(100)[None])
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)


def test_rollback_then_continue():
    """Rolling back within the residual leaves the quantized store alone: the row then
    equals one that never held the rolled-back tokens, and its newest tokens equal dense's."""
    lay = layout(n_layers=2)
    k, v = torch.randn(1, 2, 64, 64), torch.randn(1, 2, 64, 64)
    a, b, d = (QuantizedCache(lay, 1, 64, residual=8, group_size=32), QuantizedCache(lay, 1, 64, residual=8,
               group_size=32), DenseCache(lay, 1, 64))
    for c in (a, d):
        fill(c, k[:, :, :60], v[:, :, :60], torch.arange(60)[None])
    stored = a.kq[0][0].data.clone()
    a.truncate([55])
    d.truncate([55])
    assert a.lengths.tolist() == [55] and torch.equal(a.kq[0][0].data, stored)
    fill(b, k[:, :, :55], v[:, :, :55], torch.arange(55)[None])
    nk, nv = torch.randn(1, 2, 3, 64), torch.randn(1, 2, 3, 64)
    outs = []
    for c in (a, b, d):
        torch.manual_seed(4)
        outs.append(fill(c, nk, nv, torch.arange(55, 58)[None]))
    for layer in range(2):
        torch.testing.assert_close(outs[0][layer], outs[1][layer], rtol=0, atol=0)
        _, ak, av = a.read(layer, 0)
        _, dk, dv = d.read(layer, 0)
        q = a.quantized_tokens(0)
        assert torch.equal(ak[:, q:], dk[:, q:]) and torch.equal(av[:, q:], dv[:, q:])


def test_truncate_beyond_limit_is_refused():
    c = QuantizedCache(layout(), 1, 100, residual=8, group_size=32)
    fill(c, torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64), torch.arange(40)[None])
    assert c.rollback_limit == 8 and c.quantized_tokens(0) == 32
    with pytest.raises(SetupError, match="rollback_limit of 8"):
        c.truncate([31])
    c.truncate([32])  # a full residual's worth is fine
    fill(c, torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64), torch.tensor([[32]]))
    with pytest.raises(SetupError, match="quantized tokens"):  # after that rollback one exact token is left
        c.truncate([33 - 8])
    assert c.lengths.tolist() == [33]


def test_positions_must_continue_each_row():
    c = QuantizedCache(layout(), 1, 100, residual=8, group_size=32)
    fill(c, torch.randn(1, 2, 5, 64), torch.randn(1, 2, 5, 64), torch.arange(5)[None])
    with pytest.raises(SetupError, match="in order"):
        c.prepare(torch.tensor([[7]]))
    assert c.lengths.tolist() == [5]


# -- on the tiny models ------------------------------------------------------------------
@torch.inference_mode()
def teacher_forced(model, cache, prompt: list[int], forced: list[int]) -> torch.Tensor:
    """Logits [N, V] for the prompt's next token and after each forced token."""
    out = [prefill(model, cache, [prompt])[0]]
    for t in forced[:-1]:
        out.append(model(torch.tensor([[t]]), cache.lengths[:, None], cache)[0, -1])
    return torch.stack(out)


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_gemma"])
def test_top1_agreement_with_dense(name, request):
    m = request.getfixturevalue(name).model
    prompt = random_ids(40, m.cfg.vocab_size, seed=5)
    ref = generate(m, make_cache(m, 1, 200, DenseCache), greedy(), [prompt], 120).tokens[0]
    int4 = functools.partial(QuantizedCache, residual=8, group_size=32)  # 128 of 160 quantized at the end
    cache = make_cache(m, 1, 200, int4)
    got = teacher_forced(m, cache, prompt, ref).argmax(-1)
    dense = teacher_forced(m, make_cache(m, 1, 200, DenseCache), prompt, ref).argmax(-1)
    agree = (got == dense).float().mean().item()
    print(f"{name}: teacher-forced top-1 agreement int4 vs dense {agree:.3f} over {len(ref)} tokens, "
          f"{cache.quantized_tokens(0)} of {int(cache.lengths[0])} quantized")
    assert cache.quantized_tokens(0) >= 128 and agree >= 0.9


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_gemma"])
def test_residual_covering_the_sequence_equals_dense(name, request):
    m = request.getfixturevalue(name).model
    prompt = random_ids(40, m.cfg.vocab_size, seed=6)
    ref = generate(m, make_cache(m, 1, 100, DenseCache), greedy(), [prompt], 50)
    int4 = functools.partial(QuantizedCache, residual=128, group_size=32)
    cache = make_cache(m, 1, 100, int4)
    assert generate(m, cache, greedy(), [prompt], 50).tokens == ref.tokens
    assert cache.quantized_tokens(0) == 0
    got = teacher_forced(m, make_cache(m, 1, 100, int4), prompt, ref.tokens[0])
    want = teacher_forced(m, make_cache(m, 1, 100, DenseCache), prompt, ref.tokens[0])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_speculative_decoding_rolls_back_within_the_residual(tiny_gemma):
    """Target and draft on int4: with the residual covering everything, token-identical to
    plain dense greedy; while quantizing, every rollback (most drafts are rejected) is allowed."""
    m = tiny_gemma.model
    prompts = [random_ids(30, m.cfg.vocab_size, seed=1), random_ids(45, m.cfg.vocab_size, seed=2)]
    plain = generate(m, make_cache(m, 2, 200, DenseCache), greedy(), prompts, 100).tokens
    for residual in (256, 8):
        int4 = functools.partial(QuantizedCache, residual=residual, group_size=32)
        spec = SpeculativeDecoder(ModelDrafter(EarlyExit(m, 1), cache=int4), gamma=4)
        cache = make_cache(m, 2, 200, int4)
        r = generate(m, cache, spec, prompts, 100)
        assert all(len(t) == 100 for t in r.tokens) and r.stats["acceptance_rate"] < 0.5
        assert (r.tokens == plain) == (residual == 256)
        assert (min(cache.quantized_tokens(b) for b in range(2)) >= 96) == (residual == 8)


# -- bytes -------------------------------------------------------------------------------
@pytest.mark.parametrize("scale_dtype, scale_bytes", [("float16", 2), ("float32", 4)])
def test_nbytes_hand_count(scale_dtype, scale_bytes):
    c = QuantizedCache(layout(), 1, 64, residual=8, group_size=32, scale_dtype=scale_dtype)
    fill(c, torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64), torch.arange(40)[None])
    assert c.quantized_tokens(0) == 32
    groups = 2 * 64 * (32 // 32)  # keys: heads x channels x token groups; values: heads x 32 tokens x 2
    codes = groups * 32 // 2  # 32 codes of 4 bits per group
    residual = 2 * 8 * 64 * 4  # heads x tokens x D x fp32
    per_kind = codes + 2 * groups * scale_bytes + residual  # codes, scales, shifts, residual
    assert c.nbytes() == 2 * per_kind  # K and V
    assert c.theoretical_bytes() == 40 * 2 * 2 * 64 * 4


def test_memory_ratio_smollm2_layout_at_4k():
    """SmolLM2-135M's layout (30 layers, 3 KV heads, head_dim 64, fp32): everything counted."""
    lay = CacheLayout(30, 3, 64, torch.float32, torch.device("cpu"), (None,) * 30, softmax_scale=64**-0.5)
    ratio, worst = bf16_ratio(lay, 4096), bf16_ratio(lay, 4095)  # right after / just before a flush
    print(f"int4 KV bytes at 4096 tokens: {ratio:.3f}x a bf16 dense cache ({worst:.3f}x at 4095: "
          "the fp32 residual then holds residual + flush - 1 tokens)")
    assert ratio <= 0.35 and worst < 0.37


# -- options -----------------------------------------------------------------------------
def test_invalid_options_listed_together():
    with pytest.raises(SetupError) as e:
        QuantizedCache(layout(), 0, 10, nbits=3, group_size=48, residual=0, key_axis="row", scale_dtype="int8")
    assert len(e.value.reasons) == 6  # batch, nbits, group_size, key_axis, residual, scale_dtype
    assert "[2, 4]" in str(e.value) and "[32, 64, 128]" in str(e.value)
    with pytest.raises(SetupError) as e:
        QuantizedCache(layout(head_dim=96), 1, 10, group_size=64, flush=96)
    assert len(e.value.reasons) == 2  # 64 does not divide head_dim 96; flush 96 is not whole groups
    assert QuantizedCache(layout(head_dim=16), 1, 10).vg.size == 16  # a group never spans heads
