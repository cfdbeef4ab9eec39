"""The int4 backend: quantization against optimum-quanto, the position-only visibility
rule (one-pass prefill == token by token == chunks == speculative-style rollbacks),
rollback, agreement with dense on the tiny models, byte accounting, option checks."""

from __future__ import annotations

import functools

import pytest
import torch
from optimum import quanto
from optimum.quanto import quantize_weight

from decodelab.cache.base import CacheLayout
from decodelab.cache.dense import DenseCache
from decodelab.cache.int4 import QuantizedCache, bf16_ratio, worst_context
from decodelab.cache.int4_codec import QTYPES, Grouping, dequantize_into, quantize
from decodelab.cache.kernels.int4 import int4_attention_reference
from decodelab.decoding import generate, greedy, prefill
from decodelab.decoding.drafters import EarlyExit, ModelDrafter
from decodelab.decoding.speculative import SpeculativeDecoder
from decodelab.decoding.text import make_cache
from decodelab.models.errors import SetupError
from tests.cache.conftest import History, assert_close, build, check_all
from tests.conftest import random_ids

# small groups and residual so that the contract shapes (head_dim 8) really quantize
SMALL = dict(residual=4, group_size=32, flush=32)


def layout(n_layers=1, n_kv=2, head_dim=64, windows=None, dtype=torch.float32):
    return CacheLayout(n_layers, n_kv, head_dim, dtype, torch.device("cpu"), windows or (None,) * n_layers,
                       softmax_scale=head_dim**-0.5)


def fill(cache, k, v, positions, valid=None):
    """One forward through every layer with the same k, v [B, H, T, D]; returns outputs."""
    B, H, T, D = k.shape
    plan = cache.plan(positions, valid)
    q = torch.randn(B, 2 * H, T, D)
    return [cache.attend(layer, q, k, v, plan) for layer in range(cache.layout.n_layers)]


def columns(t: torch.Tensor, g: Grouping) -> torch.Tensor:
    """A store tensor back in quanto's layout [R or 1, C] (one group per column)."""
    return t.movedim(g.packed_dim, 0).reshape(t.shape[g.packed_dim], -1)


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
    h = History(c, windows)
    pos = torch.arange(70).expand(2, -1)
    valid = pos < torch.tensor([[45], [70]])  # mixed lengths, padding never stored
    check_all(h, h.step(pos, valid, seed=1), pos, valid)
    assert [c.quantized_tokens(b) for b in range(2)] == [32, 64]  # V(44) = 32, V(69) = 64
    # exact from V(len - rollback) = 32 on: blocks [32, 64) of row 1 are held in both forms
    assert [c.exact_span(b) for b in range(2)] == [(32, 45), (32, 70)]
    assert [c.key_exact[0][b].shape[1] for b in range(2)] == [13, 38]  # no padding stored
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
    """Each group's scale and offset are its own (max - min) / (2^bits - 1) and min, and the
    fused unpack reads quanto's packing: the same values as quanto's own dequantize()."""
    torch.manual_seed(0)
    g = Grouping(axis, 32, nbits)
    x = torch.randn(2, 64, 64) * 3 + 1  # [H, N, D]
    s = quantize(x, g, torch.float32)
    cols = g.columns(x)  # [G, C]: one group per column
    lo = cols.amin(0, keepdim=True)  # [1, C]
    step = (cols.amax(0, keepdim=True) - lo) / (2**nbits - 1)  # [1, C]: 2^bits codes span [min, max]
    torch.testing.assert_close(columns(s.scale, g), step, rtol=1e-6, atol=0)
    assert torch.equal(columns(s.offset, g), lo)  # x ~= scale * code + offset: code 0 is the minimum
    ref = quantize_weight(cols, getattr(quanto, QTYPES[nbits]), -1, step, -lo, 32, optimized=False)
    assert torch.equal(ref._data._data, columns(s.data, g))  # quanto's bytes, stored as they are
    torch.testing.assert_close(g.columns(dequantized(x, g, torch.float32)), ref.dequantize(), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("axis", ["channel", "token"])
def test_round_trip_error_within_half_a_step(axis):
    torch.manual_seed(1)
    g = Grouping(axis, 64, 4)
    x = torch.randn(3, 128, 64) * torch.linspace(0.1, 5, 64)  # channels of different ranges
    s = quantize(x, g, torch.float16)
    cols = g.columns(x)  # [G, C]
    lo = cols.amin(0, keepdim=True)  # [1, C]
    step = (cols.amax(0, keepdim=True) - lo) / 15  # [1, C]: 16 codes span each group's [min, max]
    torch.testing.assert_close(columns(s.scale, g).float(), step, rtol=2**-11, atol=0)  # fp16 rounding
    err = g.columns((dequantized(x, g) - x).abs())  # [G, C]
    slack = 2**-10 * (lo.abs() + 15 * step) + 1e-6  # scales and shifts rounded to fp16
    assert bool((err <= step / 2 + slack).all())


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


# -- the visibility rule: a function of (query position, key position) only -------------
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_blocks_quantize_independently(axis):
    """A block's codes, scales and shifts depend on its own K/V only: quantizing blocks one
    by one gives the bytes of quantizing them together (so a block re-quantized after a
    rollback, from the same values, is bit-identical)."""
    torch.manual_seed(5)
    x = torch.randn(2, 96, 64) * torch.linspace(0.2, 3, 64)  # [H, N, D]
    g = Grouping(axis, 32, 4)
    whole = quantize(x, g, torch.float16)
    parts = [quantize(x[:, s:s + 32], g, torch.float16) for s in range(0, 96, 32)]
    for i, t in enumerate(whole.tensors()):
        assert torch.equal(t, torch.cat([p.tensors()[i] for p in parts], 1))


def test_quantized_prefix_is_the_rule():
    c = QuantizedCache(layout(), 1, 300, residual=8, group_size=32, flush=64)
    # block j seen quantized by query q iff (j + 1) * 64 + 8 <= q + 1
    for q in range(300):
        want = max([(j + 1) * 64 for j in range(5) if (j + 1) * 64 + 8 <= q + 1], default=0)
        assert c.quantized_prefix(q) == want
        assert int(c.quantized_prefix(torch.tensor(q))) == want
    assert c.quantized_prefix(70) == 0 and c.quantized_prefix(71) == 64


RULE = dict(residual=3, group_size=32, flush=32, rollback=6)  # forwards of up to 6 > residual


def rule_reference(c, K, V, Q, window):
    """Outputs [Hq, N, D] of queries 0..N-1 with the rule applied directly: key p is seen
    dequantized iff p < V(q) (the blocks quantized on their own), exact otherwise."""
    H, N, D = K.shape
    n = N // c.flush * c.flush
    deq = []
    for g, x in ((c.key_grouping, K), (c.value_grouping, V)):
        d = x.clone()
        dequantize_into(g.region(d, n), quantize(x[:, :n], g, c.scale_dtype), g)
        deq.append(d)
    out, grp = torch.empty_like(Q), Q.shape[0] // H
    for q in range(N):
        lo = 0 if window is None else max(0, q - window + 1)
        use = (torch.arange(lo, q + 1) < c.quantized_prefix(q))[None, :, None]
        k = torch.where(use, deq[0][:, lo:q + 1], K[:, lo:q + 1]).repeat_interleave(grp, 0)  # [Hq, n, D]
        v = torch.where(use, deq[1][:, lo:q + 1], V[:, lo:q + 1]).repeat_interleave(grp, 0)
        w = torch.softmax((k @ Q[:, q, :, None]).squeeze(-1) * c.layout.softmax_scale, -1)  # [Hq, n]
        out[:, q] = (w[:, None] @ v).squeeze(1)
    return out


def run_schedule(c, K, V, Q, pattern):
    """Write positions 0..N-1 by forwards of (t, keep): t positions, the first `keep` with
    the true K/V and the rest garbage (a rejected draft), then truncate to the kept ones.
    Returns {(layer, position): output} for every kept query (each layer gets the same K/V)."""
    H, N, D = K.shape
    g = torch.Generator().manual_seed(9)
    got, i = {}, 0
    while int(c.lengths[0]) < N:
        L = int(c.lengths[0])
        t, keep = pattern[i % len(pattern)]
        i, keep = i + 1, min(keep, N - L)
        k, v, q = (torch.randn(h, t, D, generator=g) for h in (H, H, Q.shape[0]))
        k[:, :keep], v[:, :keep], q[:, :keep] = K[:, L:L + keep], V[:, L:L + keep], Q[:, L:L + keep]
        pos = torch.arange(L, L + t)[None]
        plan = c.plan(pos)
        for layer in range(c.layout.n_layers):
            out = c.attend(layer, q[None], k[None], v[None], plan)
            got.update({(layer, L + j): out[0, :, j] for j in range(keep)})
        c.truncate([L + keep])
    return got


SCHEDULES = {"one pass": [(100, 100)], "token by token": [(1, 1)], "chunks of 7": [(7, 7)],
             "speculative": [(6, 2), (6, 1), (4, 4), (6, 6), (2, 1), (6, 3), (1, 1), (6, 5)]}


# 13: long forwards attend in query chunks (10 s with token keys in the default run on a 2-core Zen 3, session 53)
@pytest.mark.parametrize("attention_chunk", [256, pytest.param(13, marks=pytest.mark.slow)])
@pytest.mark.parametrize("key_axis", ["channel", "token"])
def test_visible_version_depends_only_on_positions(key_axis, attention_chunk):
    """However the positions are split into forwards (one pass, single tokens, chunks,
    verify forwards with rejected garbage rolled back), every query's output is the rule's
    (2e-4: the summation order differs, and a decode step on a CPU scores the quantized keys
    with the query rounded to int16, test_int4_native.py, which moves these outputs by less;
    reading a position's other version moves one by more than 1e-2), and the stores end
    bit-identical."""
    torch.manual_seed(6)
    N, windows = 100, (None, 8)
    K, V, Q = torch.randn(2, N, 64), torch.randn(2, N, 64), torch.randn(4, N, 64)
    build = lambda **kw: QuantizedCache(layout(n_layers=2, windows=windows), 1, N + 6,  # noqa: E731
                                        key_axis=key_axis, **{**RULE, **kw})
    want = [rule_reference(build(), K, V, Q, w) for w in windows]
    exact = build(residual=N + 1)  # V(q) = 0: nothing quantized
    assert (want[0] - rule_reference(exact, K, V, Q, None)).abs().max() > 1e-2  # quantization really bites
    caches = {}
    for name, pattern in SCHEDULES.items():
        c = caches[name] = build()
        c.attention_chunk = attention_chunk
        got = run_schedule(c, K, V, Q, pattern)
        for layer in range(len(windows)):
            out = torch.stack([got[layer, p] for p in range(N)], 1)
            torch.testing.assert_close(out, want[layer], rtol=0, atol=2e-4, msg=f"{name}, layer {layer}")
    ref = caches["one pass"]
    assert ref.quantized_tokens(0) == 96 and ref.exact_span(0) == (64, N)  # V(99) = 96, V(94) = 64
    for name, c in caches.items():  # (a last forward past N drops exact copies earlier: P0 is 64 or 96)
        p0 = c.exact_span(0)[0]
        assert c.quantized_tokens(0) == 96 and p0 in (64, 96), name
        for layer in range(2):
            for mine, theirs in zip(c.key_codes[layer][0].tensors() + c.value_codes[layer][0].tensors(),
                                    ref.key_codes[layer][0].tensors() + ref.value_codes[layer][0].tensors()):
                assert torch.equal(mine, theirs), name  # garbage-holding blocks were re-quantized
            assert torch.equal(c.key_exact[layer][0], K[:, p0:]) and torch.equal(c.value_exact[layer][0], V[:, p0:])


def test_long_forward_attends_in_query_chunks():
    """A mixed-length batch (padding, a windowed layer) in one forward: attending in chunks
    of 16 queries gives what one mask over every key gives, and reads fewer key slots."""
    torch.manual_seed(7)
    pos = torch.arange(70).expand(2, -1)
    valid = pos < torch.tensor([[45], [70]])
    k, v, q = torch.randn(2, 2, 70, 64), torch.randn(2, 2, 70, 64), torch.randn(2, 4, 70, 64)
    outs, slots = [], []
    for chunk in (256, 16):
        c = QuantizedCache(layout(n_layers=2, windows=(8, None)), 2, 80, residual=4, group_size=32, rollback=4)
        c.attention_chunk = chunk
        plan = c.plan(pos, valid)
        outs.append([c.attend(layer, q, k, v, plan) for layer in range(2)])
        slots.append(sum(view.slots * (view.query_to - view.query_from) for view in plan.views[None]))
        assert len(plan.views[None]) == (1 if chunk == 256 else 5)
    for layer in range(2):
        got, want = outs[1][layer].transpose(1, 2)[valid], outs[0][layer].transpose(1, 2)[valid]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert slots[1] < 0.7 * slots[0]  # 70 x (64 + 70) scores in one mask; per chunk only what it needs


# tiny_gemma: 11 s in the default run on a 2-core Zen 3 (session 53)
@pytest.mark.parametrize("name", ["tiny_llama", pytest.param("tiny_gemma", marks=pytest.mark.slow)])
def test_prefill_equals_token_by_token_on_the_tiny_models(name, request):
    """A one-pass prefill that quantizes as it goes (attending at once or in 16-query
    chunks), 16-token forwards and single tokens give the same logits at every position
    (float tolerance), while int4 visibly differs from dense."""
    m = request.getfixturevalue(name).model
    N = 80
    ids = torch.tensor([random_ids(N, m.cfg.vocab_size, seed=12)])
    int4 = functools.partial(QuantizedCache, residual=4, group_size=32, flush=32, rollback=8)
    chunked = functools.partial(type("Chunked", (QuantizedCache,), {"attention_chunk": 16}), residual=4,
                                group_size=32, flush=32, rollback=8)
    runs, stores = {}, {}
    with torch.inference_mode():
        for label, step, factory in (("one pass", N, int4), ("query chunks", N, chunked), ("chunks", 16, int4),
                                     ("tokens", 1, int4)):
            cache = stores[label] = make_cache(m, 1, N, factory)
            runs[label] = torch.cat([m(ids[:, s:s + step], torch.arange(s, s + step)[None], cache)[0]
                                     for s in range(0, N, step)])  # [N, V]
            assert cache.quantized_tokens(0) == 64  # V(79): blocks quantized inside the prefill
        dense = m(ids, torch.arange(N)[None], make_cache(m, 1, N, DenseCache))[0]
    one = runs["one pass"]
    d_dense = (dense - one).abs().max().item()
    assert d_dense > 1e-3  # quantization really changes the logits ...
    assert (dense[:35] - one[:35]).abs().max() <= 1e-5  # ... and only where V(q) > 0 (q >= 35)
    for label in ("query chunks", "chunks", "tokens"):
        same = all(torch.equal(x, y) for layer in range(m.cfg.n_layers) for s in ("key_codes", "value_codes")
                   for x, y in zip(getattr(stores[label], s)[layer][0].tensors(),
                                   getattr(stores["one pass"], s)[layer][0].tensors()))
        d = (runs[label] - one).abs().max(-1).values  # [N]
        print(f"{name}: {label} vs one pass: max |logit diff| {d.max():.2e}, quantized stores "
              f"{'bit-identical' if same else 'differ'}; dense logits differ from int4 by up to {d_dense:.2e}")
        assert d[:35].max() <= 1e-5  # nothing quantized visible yet: float rounding only
        if same:  # the same K/V reached the quantizer: the rule makes the logits equal
            assert d.max() <= 1e-5
        else:  # a batched forward's K/V differ from single-token ones by float rounding (dense:
            # ~1e-6), and a code or an fp16 scale may round the other way: one quantization step
            assert d.max() <= 1e-2


def test_rollback_then_continue():
    """Rolling back within the residual leaves the quantized store alone: the row then
    equals one that never held the rolled-back tokens, and its newest tokens equal dense's."""
    lay = layout(n_layers=2)
    k, v = torch.randn(1, 2, 64, 64), torch.randn(1, 2, 64, 64)
    a, b, d = (QuantizedCache(lay, 1, 64, residual=8, group_size=32), QuantizedCache(lay, 1, 64, residual=8,
               group_size=32), DenseCache(lay, 1, 64))
    for c in (a, d):
        fill(c, k[:, :, :60], v[:, :, :60], torch.arange(60)[None])
    stored = a.key_codes[0][0].data.clone()
    a.truncate([55])
    d.truncate([55])
    assert a.lengths.tolist() == [55] and torch.equal(a.key_codes[0][0].data, stored)
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
    c = QuantizedCache(layout(), 1, 100, residual=4, group_size=32, rollback=8)
    fill(c, torch.randn(1, 2, 60, 64), torch.randn(1, 2, 60, 64), torch.arange(60)[None])
    assert c.rollback_limit == 8 and c.quantized_tokens(0) == 32 and c.exact_span(0) == (32, 60)  # V(52) = 32
    with pytest.raises(SetupError, match="rollback_limit of 8"):
        c.truncate([51])
    assert c.lengths.tolist() == [60]
    # rollbacks after rollbacks and shorter forwards: fine while the query at the new length
    # finds its exact keys (V(n) >= P0 = 32, i.e. n >= 35), refused below
    for n in (52, 45, 38):
        c.truncate([n])
        fill(c, torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64), torch.tensor([[n]]))
    assert c.lengths.tolist() == [39] and c.exact_span(0) == (32, 39)
    with pytest.raises(SetupError, match=r"full-precision keys of positions \[0, 32\)"):
        c.truncate([34])  # a query at 34 sees [0, 32) exact, but only quantized copies are left
    c.truncate([35])
    assert c.lengths.tolist() == [35] and c.quantized_tokens(0) == 32


def test_rollback_limit_is_the_rollback_option():
    assert QuantizedCache(layout(), 1, 10).rollback_limit == 16  # the default
    assert QuantizedCache(layout(), 1, 10, rollback=0).rollback_limit == 0
    with pytest.raises(SetupError, match="rollback must be an integer >= 0"):
        QuantizedCache(layout(), 1, 10, rollback=-1)


def test_positions_must_continue_each_row():
    c = QuantizedCache(layout(), 1, 100, residual=8, group_size=32)
    fill(c, torch.randn(1, 2, 5, 64), torch.randn(1, 2, 5, 64), torch.arange(5)[None])
    with pytest.raises(SetupError, match="in order"):
        c.plan(torch.tensor([[7]]))
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


@pytest.mark.slow  # 4.9 s in the default run on a 2-core Zen 3 (session 50)
def test_speculative_decoding_is_token_identical_to_int4_greedy(tiny_gemma):
    """Target and draft on int4: token-identical to plain greedy on int4, whether the
    residual covers everything (then also to dense) or quantization runs through 100
    tokens of mostly rejected drafts (then not dense's tokens any more)."""
    m = tiny_gemma.model
    prompts = [random_ids(30, m.cfg.vocab_size, seed=1), random_ids(45, m.cfg.vocab_size, seed=2)]
    dense = generate(m, make_cache(m, 2, 200, DenseCache), greedy(), prompts, 100).tokens
    for residual in (256, 8):
        int4 = functools.partial(QuantizedCache, residual=residual, group_size=32, rollback=8)
        plain = generate(m, make_cache(m, 2, 200, int4), greedy(), prompts, 100).tokens
        spec = SpeculativeDecoder(ModelDrafter(EarlyExit(m, 1), cache=int4), gamma=4)
        cache = make_cache(m, 2, 200, int4)
        r = generate(m, cache, spec, prompts, 100)
        assert all(len(t) == 100 for t in r.tokens) and r.stats["acceptance_rate"] < 0.5
        assert r.tokens == plain
        assert (plain == dense) == (residual == 256)
        assert (min(cache.quantized_tokens(b) for b in range(2)) >= 96) == (residual == 8)


# -- bytes -------------------------------------------------------------------------------
@pytest.mark.parametrize("rollback, exact", [(1, 8), (16, 40)])  # exact from min(Qs, V(40 - rollback))
@pytest.mark.parametrize("scale_dtype, scale_bytes", [("float16", 2), ("float32", 4)])
def test_nbytes_hand_count(scale_dtype, scale_bytes, rollback, exact):
    c = QuantizedCache(layout(), 1, 64, residual=8, group_size=32, scale_dtype=scale_dtype, rollback=rollback)
    fill(c, torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64), torch.arange(40)[None])
    assert c.quantized_tokens(0) == 32 and c.exact_span(0) == (40 - exact, 40)
    groups = 2 * 64 * (32 // 32)  # keys: heads x channels x token groups; values: heads x 32 tokens x 2
    codes = groups * 32 // 2  # 32 codes of 4 bits per group
    # the exact store: `exact` tokens (with rollback 16 block 0 in both forms) in a buffer with
    # room for a sixteenth more (it is appended in place), heads x D x fp32
    assert c.key_exact[0][0].shape[1] == exact
    full = 2 * (exact + max(1, exact // 16)) * 64 * 4
    per_kind = codes + 2 * groups * scale_bytes + full  # codes, scales, shifts, exact copies
    assert c.nbytes() == 2 * per_kind  # K and V
    assert c.theoretical_bytes() == 40 * 2 * 2 * 64 * 4


def test_exact_stores_are_appended_in_place_and_hold_every_token():
    """200 decode steps after a 100-token prefill: each step writes its token into the exact
    buffer (a new one only when its end is reached or a flush shrinks the store: not per
    token, and never more than a sixteenth larger than what it holds), the store always holds
    exactly positions [P0, len) as written, and a rollback followed by other tokens
    overwrites the dropped ones in place."""
    c = QuantizedCache(layout(), 1, 400, residual=20, group_size=32, rollback=8)
    g = torch.Generator().manual_seed(3)
    ks, vs = torch.randn(1, 2, 300, 64, generator=g), torch.randn(1, 2, 300, 64, generator=g)
    fill(c, ks[:, :, :100], vs[:, :, :100], torch.arange(100)[None])
    buffers = set()
    for t in range(100, 300):
        fill(c, ks[:, :, t:t + 1], vs[:, :, t:t + 1], torch.tensor([[t]]))
        p0, n = c.exact_span(0)
        assert torch.equal(c.key_exact[0][0], ks[0, :, p0:n]) and torch.equal(c.value_exact[0][0], vs[0, :, p0:n])
        buffers.add(c.key_exact[0][0].untyped_storage().data_ptr())
        held = c.key_exact[0][0].shape[1]
        assert held * 2 * 64 * 4 <= c.key_exact[0][0].untyped_storage().nbytes() <= (held + held // 16 + 1) * 2 * 64 * 4
    # a fresh buffer leaves room for >= 1 token (27: the fewest exact tokens held), and
    # a flush may make one: far fewer than one per token
    assert len(buffers) <= 200 // 2 + 1
    c.truncate([295])
    other = torch.randn(1, 2, 5, 64, generator=g)
    fill(c, other, other, torch.arange(295, 300)[None])
    p0, n = c.exact_span(0)
    assert torch.equal(c.key_exact[0][0][:, -5:], other[0]) and torch.equal(c.key_exact[0][0][:, :-5], ks[0, :, p0:295])


def test_memory_ratio_smollm2_layout_at_4k():
    """SmolLM2-135M's layout (30 layers, 3 KV heads, head_dim 64, fp32): everything counted."""
    lay = CacheLayout(30, 3, 64, torch.float32, torch.device("cpu"), (None,) * 30, softmax_scale=64**-0.5)
    at = worst_context(QuantizedCache(lay, 1, 4096), 4096)  # most exact tokens in (4032, 4096]
    ratio, worst = bf16_ratio(lay, 4096), bf16_ratio(lay, at)
    print(f"int4 KV bytes at 4096 tokens: {ratio:.3f}x a bf16 dense cache ({worst:.3f}x at {at}: the fp32 "
          "exact store then holds residual + rollback + flush - 2 tokens)")
    # the exact stores' buffers (appended in place) hold up to a sixteenth more than their
    # tokens, never more than the high point's residual + rollback + flush
    assert at == 4094 and ratio <= 0.35 and worst < 0.37


# -- options -----------------------------------------------------------------------------
def test_invalid_options_listed_together():
    with pytest.raises(SetupError) as e:
        QuantizedCache(layout(), 0, 10, nbits=3, group_size=48, residual=0, key_axis="row", scale_dtype="int8",
                       rollback=-2)
    assert len(e.value.reasons) == 7  # batch, nbits, group_size, key_axis, residual, rollback, scale_dtype
    assert "[2, 4]" in str(e.value) and "[32, 64, 128]" in str(e.value)
    with pytest.raises(SetupError) as e:
        QuantizedCache(layout(head_dim=96), 1, 10, group_size=64, flush=96)
    assert len(e.value.reasons) == 2  # 64 does not divide head_dim 96; flush 96 is not whole groups
    assert QuantizedCache(layout(head_dim=16), 1, 10).value_grouping.size == 16  # a group never spans heads


# -- what the cache offers kernels and benchmarks ----------------------------------------
def test_attention_repeats_attend_and_feeds_the_kernel_reference():
    """After `attend`, `attention` gives attend's output again (storing nothing twice), and
    the kernel inputs (`kernel_rows`, `kernel_queries`) give it through the kernels' reference."""
    torch.manual_seed(8)
    lay = layout(n_layers=2, windows=(16, None))
    c = QuantizedCache(lay, 2, 128, residual=8, group_size=32, rollback=4, impl="reference")
    pos = torch.arange(100).expand(2, -1)
    fill(c, torch.randn(2, 2, 100, 64), torch.randn(2, 2, 100, 64), pos, pos < torch.tensor([[70], [100]]))
    q, k, v = torch.randn(2, 4, 3, 64), torch.randn(2, 2, 3, 64), torch.randn(2, 2, 3, 64)
    plan = c.plan(c.lengths[:, None] + torch.arange(3))
    for layer in range(2):
        out = c.attend(layer, q, k, v, plan)
        assert torch.equal(c.attention(layer, q, plan, impl="reference"), out)
        rows = c.kernel_rows(layer, plan)
        assert rows.dequant_to == [64, 64] and rows.exact_to == [73, 103]  # V(72) = V(102) = 64
        via = int4_attention_reference(q, rows, *c.kernel_queries(plan), lay.softmax_scale, lay.windows[layer])
        torch.testing.assert_close(via, out, rtol=0, atol=1e-5)
    assert c.lengths.tolist() == [73, 103] and c.key_exact[0][1].shape[1] == 103 - c.exact_span(1)[0]


def test_attention_is_refused_without_its_keys(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    c = QuantizedCache(layout(), 1, 64, residual=4, group_size=32, rollback=0)
    q, k, v = torch.randn(1, 4, 40, 64), torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64)
    plan = c.plan(torch.arange(40)[None])
    with pytest.raises(SetupError, match="holds no K/V of this planned forward"):  # planned, not stored yet
        c.attention(0, q, plan)
    c.attend(0, q, k, v, plan)
    assert c.exact_span(0) == (32, 40)  # rollback 0: the forward's drop keeps what later queries need
    with pytest.raises(SetupError, match=r"positions \[0, 32\) this forward reads were dropped"):
        c.attention(0, q, plan)
    with pytest.raises(SetupError, match="impl=triton"):
        c.attention(0, q[:, :, -1:], plan, impl="triton")


def test_fill_random_leaves_what_a_one_pass_prefill_leaves():
    lay = layout(n_layers=2)
    a, b = (QuantizedCache(lay, 2, 200, residual=8, group_size=32, rollback=8) for _ in range(2))
    a.fill_random(150)
    fill(b, torch.randn(2, 2, 150, 64), torch.randn(2, 2, 150, 64), torch.arange(150).expand(2, -1))
    for row in range(2):
        assert a.quantized_tokens(row) == b.quantized_tokens(row) == 128  # V(149)
        assert a.exact_span(row) == b.exact_span(row) == (128, 150)  # P0 = min(Qs, V(142)) = 128
    assert a.nbytes() == b.nbytes()
    assert a.read_bytes(150) == a.nbytes() - 2 * 2 * 2 * 1 * 2 * 64 * 4  # not the buffers' free token (22 // 16)


def _plans_equal(a, b) -> None:
    """Two Int4Plans field by field (tensors by value)."""
    for f in ("positions", "valid", "kernel_q"):
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None) == (y is None), f
        if x is not None:
            for s, t in zip(x if isinstance(x, tuple) else (x,), y if isinstance(y, tuple) else (y,)):
                assert s.dtype == t.dtype and torch.equal(s, t), f
    for f in ("rows", "tree", "new_tokens", "exact_start", "quantize_from", "quantize_to", "drop", "fed", "lengths"):
        assert getattr(a, f) == getattr(b, f), f
    assert a.views.keys() == b.views.keys()
    for w in a.views:
        assert len(a.views[w]) == len(b.views[w]) == 1
        x, y = a.views[w][0], b.views[w][0]
        assert x.mask is None and y.mask is None and x == y, (w, x, y)


@pytest.mark.parametrize("impl", ["reference", "native"])
@pytest.mark.parametrize("windows, ragged, taken_at_least, declined_at_least", [
    ((None, 200), False, 140, 5),  # declines while nothing is quantized
    ((None, 40), False, 3, 100),  # a sliding window: only where it starts at a group's start
    ((None, 200), True, 0, 150),  # rows of different lengths: padded slots, masked
])
def test_one_token_plan_is_the_general_plan(impl, windows, ragged, taken_at_least, declined_at_least, monkeypatch):
    """A decode step's plan in Python integers (`_one_token_plan`) equals `plan`'s general
    path field by field, and leaves the same lengths and counts, over flushes, drops and
    rollbacks; where it declines (nothing quantized yet, a masked window, padded rows) it
    books nothing and the general path plans the step."""
    if impl == "native":
        from decodelab.models import native

        if native.problem():
            pytest.skip(native.problem())
    lay = layout(n_layers=2, head_dim=16, windows=windows)
    cache = QuantizedCache(lay, 2, 256, residual=4, group_size=32, flush=32, rollback=4, impl=impl)
    g = torch.Generator().manual_seed(0)
    T = 30
    valid = torch.ones(2, T, dtype=torch.bool)
    if ragged:
        valid[1, 20:] = False  # rows of 30 and 20 tokens
    fill(cache, torch.randn(2, 2, T, 16, generator=g), torch.randn(2, 2, T, 16, generator=g),
         torch.arange(T).expand(2, T), valid)
    general = QuantizedCache.plan
    taken = declined = 0
    for step in range(150):
        if step % 17 == 16:  # a rollback within the limit
            cache.truncate((cache.lengths - 3).tolist())
        pos = cache.lengths[:, None].clone()
        state = (cache.lengths, cache.quantized_len, cache.exact_start)
        fast = cache._one_token_plan(pos)
        after = (cache.lengths, cache.quantized_len, cache.exact_start)
        cache.lengths, cache.quantized_len, cache.exact_start = state
        full = general(cache, pos, torch.ones(2, 1, dtype=torch.bool))  # `valid` given: the general path
        if fast is None:
            declined += 1
            assert all(x is y for x, y in zip(state, after))  # booked nothing
        else:
            taken += 1
            _plans_equal(fast, full)
            assert all(torch.equal(x, y) for x, y in zip(after, (cache.lengths, cache.quantized_len,
                                                                  cache.exact_start)))
        k, v = torch.randn(2, 2, 1, 16, generator=g), torch.randn(2, 2, 1, 16, generator=g)
        q = torch.randn(2, 4, 1, 16, generator=g)
        for layer in range(2):
            cache.attend(layer, q, k, v, full)
    assert taken >= taken_at_least and declined >= declined_at_least, (taken, declined)
    monkeypatch.setattr(QuantizedCache, "_one_token_plan", lambda self, positions: pytest.fail("not asked"))
    cache.plan(cache.lengths[:, None].clone(), torch.ones(2, 1, dtype=torch.bool))  # valid given: never asked


@pytest.mark.parametrize("impl", ["reference", "native"])
@pytest.mark.parametrize("windows, ragged", [((None, 200), False), ((None, 40), False), ((None, 40), True)])
def test_booked_layers_are_attend_to_the_bit(impl, windows, ragged):
    """A compiled step's host work done for every layer when the step is booked
    (`booked_layers`: due blocks quantized, slots reserved, drops done first, then one call
    per layer) gives each layer's `attend` output to the bit and leaves the same stores,
    across flushes, drops, buffer growth, rollbacks, windows and rows of different lengths,
    also where it holds the new tokens past the exact views' ends (`_held_behind`) and the
    views catch up only when read; where the order matters (a forward longer than the
    residual) it declines."""
    if impl == "native":
        from decodelab.models import native

        if native.problem():
            pytest.skip(native.problem())
    lay = layout(n_layers=2, head_dim=16, windows=windows)
    caches = [QuantizedCache(lay, 2, 256, residual=4, group_size=32, flush=32, rollback=4, impl=impl)
              for _ in range(2)]
    g = torch.Generator().manual_seed(1)
    T = 30
    valid = torch.ones(2, T, dtype=torch.bool)
    if ragged:
        valid[1, 20:] = False
    k, v = torch.randn(2, 2, T, 16, generator=g), torch.randn(2, 2, T, 16, generator=g)
    for c in caches:
        fill(c, k, v, torch.arange(T).expand(2, T), valid)
    booked = natives = held = 0
    for step in range(120):
        if step % 23 == 22:
            for c in caches:
                c.truncate((c.lengths - 2).tolist())
        tokens = 2 if step % 11 == 5 else 1  # now and then a verify-sized forward
        pos = caches[0].lengths[:, None] + torch.arange(tokens)
        k, v = torch.randn(2, 2, tokens, 16, generator=g), torch.randn(2, 2, tokens, 16, generator=g)
        q = torch.randn(2, 4, tokens, 16, generator=g)
        a, b = (c.plan(pos) for c in caches)
        steps = caches[1].booked_layers(b)
        assert steps is not None
        booked += 1
        held += caches[1]._behind is not None  # booked without growing the views (`_held_behind`)
        natives += sum(not hasattr(s, "func") for s in steps)  # a native call, not a partial of _attend_booked
        for layer in range(2):
            assert torch.equal(caches[0].attend(layer, q, k, v, a), steps[layer](q, k, v))
    for layer in range(2):
        for row in range(2):
            for x, y in zip(caches[0].read(layer, row), caches[1].read(layer, row)):
                assert torch.equal(x, y)
            assert caches[0].key_exact[layer][row].shape == caches[1].key_exact[layer][row].shape
    assert natives > (100 if impl == "native" else -1) and (impl == "native" or natives == 0), natives
    # the views lag behind on most native steps where every layer reads codes (not the sliding layer's)
    assert held > (40 if impl == "native" and windows == (None, 200) else -1) and (impl == "native" or held == 0), held
    # residual + flush tokens: a block it quantizes holds some of its own tokens, stored only in its attend
    long = caches[1].plan(caches[1].lengths[:, None] + torch.arange(36))
    assert max(q - (n - 36) for q, n in zip(long.quantize_to, long.lengths)) > 0
    assert caches[1].booked_layers(long) is None
