"""The sliding backend: exact against dense on a windowed model (decode, mixed batches,
chunked prefill, rollback), ring-only memory, the imposed-window approximation, options."""

from __future__ import annotations

import functools

import pytest
import torch

from decodelab.cache.base import CacheLayout, reference_attention
from decodelab.cache.dense import DenseCache
from decodelab.cache.sliding import SlidingCache, sliding_memory
from decodelab.decoding import generate, greedy, prefill
from decodelab.decoding.text import make_cache
from decodelab.models.errors import SetupError
from tests.cache.conftest import History, build, check_all
from tests.conftest import random_ids

ROLLBACK = 4
SLIDING = functools.partial(SlidingCache, rollback=ROLLBACK)
GEMMA3_270M = CacheLayout(18, 1, 256, torch.float32, torch.device("cpu"), ((512,) * 5 + (None,)) * 3,
                          softmax_scale=256**-0.5)


@torch.no_grad()
def decode(model, cache, logits: torch.Tensor, n: int) -> list[torch.Tensor]:
    """n greedy single-token steps after `logits` [B, V]; the logits [B, V] of each."""
    out = []
    for _ in range(n):
        tok = logits.argmax(-1)[:, None]  # [B, 1]
        logits = model(tok, cache.lengths[:, None], cache)[:, -1]
        out.append(logits)
    return out


def run(model, backend, prompts: list[list[int]], n: int, chunk: int | None = None, capacity: int = 96):
    """Prefill then n greedy steps; the logits [n + 1, B, V] of every step."""
    cache = make_cache(model, len(prompts), capacity, backend)
    first = prefill(model, cache, prompts, chunk_size=chunk)
    return torch.stack([first] + decode(model, cache, first, n))


def prompts(*lengths: int) -> list[list[int]]:
    return [random_ids(n, seed=i + 1) for i, n in enumerate(lengths)]


# -- exact on a windowed model (tiny Gemma 3: windows 16, 16, None) ----------------------
@pytest.mark.parametrize("lengths", [(40,), (40, 7, 25)])
def test_decode_logits_match_dense(tiny_gemma, lengths):
    got = run(tiny_gemma.model, SLIDING, prompts(*lengths), 30)
    want = run(tiny_gemma.model, DenseCache, prompts(*lengths), 30)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_generate_tokens_match_dense(tiny_gemma):
    m, ps = tiny_gemma.model, prompts(40, 7, 25)
    a = generate(m, make_cache(m, 3, 70, SLIDING), greedy(), ps, 30)
    b = generate(m, make_cache(m, 3, 70, DenseCache), greedy(), ps, 30)
    assert a.tokens == b.tokens and all(len(t) == 30 for t in a.tokens)
    assert "exact" in a.kv["kv_label"]


@pytest.mark.parametrize("chunk", [24, 7])
def test_chunked_prefill_matches_dense(tiny_gemma, chunk):
    # ring of 16 + 4 = 20 slots: chunk 24 is longer than the ring, 7 shorter
    ps = prompts(45, 9, 31)
    got = run(tiny_gemma.model, SLIDING, ps, 8, chunk=chunk)
    want = run(tiny_gemma.model, DenseCache, ps, 8)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lengths", [(60,), (60, 9, 31)])
def test_same_chunking_is_bit_equal_to_dense(tiny_gemma, lengths):
    """Fed the same way (chunks of 24, then 20 single steps), sliding hands attention
    exactly dense's keys, order and mask, so the logits are identical, not just close
    (summation order differs otherwise, and that drift grows past 1e-4 on Gemma 3 270M)."""
    ps = prompts(*lengths)
    got = run(tiny_gemma.model, SLIDING, ps, 20, chunk=24)
    want = run(tiny_gemma.model, DenseCache, ps, 20, chunk=24)
    assert torch.equal(got, want), (got - want).abs().max().item()


@torch.no_grad()
def rollback_run(model, backend) -> list[torch.Tensor]:
    """Prompt, 10 steps, a 5-token verify forward, roll back 4 (all rows), continue."""
    cache = make_cache(model, 2, 96, backend)
    logits = decode(model, cache, prefill(model, cache, prompts(40, 23)), 10)
    draft = torch.stack([torch.tensor(random_ids(5, seed=b + 7)) for b in range(2)])  # [B, 5]
    pos = cache.lengths[:, None] + torch.arange(5)  # [B, 5]
    verify = model(draft, pos, cache)  # [B, 5, V]
    cache.truncate(cache.lengths - ROLLBACK)
    return logits + [verify.flatten(0, 1)] + decode(model, cache, verify[:, 0], 12)


def test_rollback_then_continue_matches_dense(tiny_gemma):
    got, want = rollback_run(tiny_gemma.model, SLIDING), rollback_run(tiny_gemma.model, DenseCache)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_truncate_beyond_rollback_refused(tiny_gemma):
    m = tiny_gemma.model
    cache = make_cache(m, 1, 64, SLIDING)
    prefill(m, cache, prompts(30))
    with pytest.raises(SetupError, match="rollback_limit"):
        cache.truncate([30 - ROLLBACK - 1])
    cache.truncate([28])  # two rollbacks add up: 30 -> 28 -> 25 is 5 below the furthest
    with pytest.raises(SetupError, match="rollback_limit"):
        cache.truncate([25])
    assert cache.lengths.tolist() == [28]


def test_refeeding_positions_without_truncate_matches_dense(tiny_gemma):
    """A forward from a position a row already holds replaces what it held from there
    (as dense overwrites), within the rollback; further back is refused."""
    m, out = tiny_gemma.model, []
    for backend in (SLIDING, DenseCache):
        cache = make_cache(m, 1, 64, backend)
        prefill(m, cache, prompts(30))
        again = torch.tensor([random_ids(10, seed=9)])  # [1, 10] tokens at positions 26..35
        with torch.no_grad():
            out.append(m(again, torch.arange(26, 36)[None], cache))
        out.append(torch.stack(decode(m, cache, out[-1][:, -1], 5)))
    torch.testing.assert_close(out[0], out[2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[1], out[3], rtol=1e-5, atol=1e-5)
    cache = make_cache(m, 1, 64, SLIDING)
    prefill(m, cache, prompts(30))
    with pytest.raises(SetupError, match="rollback_limit"), torch.no_grad():
        m(again, torch.arange(25, 35)[None], cache)
    assert cache.lengths.tolist() == [30]


def test_padding_queries_stay_finite_with_softcap():
    """Padding far past a short row sees no real key in its window; with softcap (plain
    softmax over -inf) it must still come out finite, or NaN would reach real tokens."""
    layout = CacheLayout(1, 2, 8, torch.float32, torch.device("cpu"), (4,), softmax_scale=0.35, softcap=30.0)
    c = SlidingCache(layout, 2, 64, rollback=2)
    pos = torch.arange(23).expand(2, -1)
    plan = c.plan(pos, pos < torch.tensor([[5], [23]]))
    q, k = torch.randn(2, 4, 23, 8), torch.randn(2, 2, 23, 8)
    assert bool(torch.isfinite(c.attend(0, q, k, k, plan)).all())
    assert c.read(0, 0)[0].tolist() == list(range(5))  # padding never written


# -- memory ---------------------------------------------------------------------------------
def test_local_layers_store_window_plus_rollback(tiny_gemma):
    m = tiny_gemma.model
    cache = make_cache(m, 2, 96, SLIDING)
    assert [tuple(k.shape) for k in cache.k] == [(2, 1, 20, 32), (2, 1, 20, 32), (2, 1, 96, 32)]
    per_slot = 2 * 1 * 32 * 4  # K and V, 1 KV head, head_dim 32, fp32
    assert cache.nbytes() == 2 * (20 + 20 + 96) * per_slot
    plan = sliding_memory(cache.layout, 96, rollback=ROLLBACK)
    assert plan["tokens_per_layer"] == [20, 20, 96] and 2 * plan["stored_bytes"] == cache.nbytes()
    dense = make_cache(m, 2, 96, DenseCache)
    assert 2 * plan["dense_bytes"] == dense.nbytes()


def test_read_returns_ring_content_in_position_order(tiny_gemma):
    m = tiny_gemma.model
    cache = make_cache(m, 1, 64, SLIDING)
    prefill(m, cache, prompts(40))
    pos, k, v = cache.read(0, 0)
    assert pos.tolist() == list(range(20, 40)) and k.shape == (1, 20, 32) and v.shape == (1, 20, 32)
    assert cache.read(2, 0)[0].tolist() == list(range(40))
    cache.truncate([37])
    assert cache.read(0, 0)[0].tolist() == list(range(20, 37))


def test_gemma3_270m_memory_at_4k():
    plan = sliding_memory(GEMMA3_270M, 4096, rollback=8)
    assert plan["tokens_per_layer"] == ([520] * 5 + [4096]) * 3
    assert plan["dense_bytes"] == 18 * 4096 * 2 * 256 * 4  # 151 MB
    assert plan["stored_bytes"] == (15 * 520 + 3 * 4096) * 2 * 256 * 4
    assert plan["ratio"] == pytest.approx((15 * 520 + 3 * 4096) / (18 * 4096))  # 0.272
    print(f"\nGemma 3 270M at 4096 tokens: sliding {plan['stored_bytes']:,} B vs dense "
          f"{plan['dense_bytes']:,} B, ratio {plan['ratio']:.4f} ({1 / plan['ratio']:.2f}x smaller)")


# -- imposed window (a model without windows) ----------------------------------------------
class PlainWindowCache(DenseCache):
    """Reference: every token stored; each query sees its window plus the first `sinks`."""

    def __init__(self, layout, batch_size, capacity, window: int, sinks: int):
        super().__init__(layout, batch_size, capacity)
        self.w, self.sinks = window, sinks

    def attend(self, layer, q, k, v, plan):
        self._write(layer, k, v, plan)
        qp = plan.positions[:, :, None]  # [B, T, 1]
        kp = torch.arange(int(plan.positions.max()) + 1)[None, None]  # [1, 1, S]
        ok = (kp <= qp) & ((qp - kp < self.w) | (kp < self.sinks))  # [B, T, S]
        n = kp.shape[-1]
        return reference_attention(q, self.k[layer][:, :, :n], self.v[layer][:, :, :n], ok[:, None],
                                   self.layout.softmax_scale, self.layout.softcap)


def test_imposed_window_matches_plain_reference(tiny_llama):
    m, ps = tiny_llama.model, prompts(30, 11)
    got = run(m, functools.partial(SLIDING, window=12, sinks=4), ps, 20, chunk=16)
    want = run(m, functools.partial(PlainWindowCache, window=12, sinks=4), ps, 20)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    full = run(m, DenseCache, ps, 20)
    assert (got - full).abs().max() > 1e-3  # a real approximation, not dense in disguise


def test_imposed_window_is_labelled_approximate(tiny_llama):
    cache = make_cache(tiny_llama.model, 1, 64, functools.partial(SLIDING, window=12, sinks=4))
    assert cache.approximate and "APPROXIMATE" in cache.label and "window=12" in cache.label
    assert cache.window(0) == 12 and cache.sink_tokens == 4
    assert [k.shape[2] for k in cache.k] == [4 + 12 + ROLLBACK] * 2
    assert cache.memory_report()["kv_label"] == cache.label


def test_no_windows_no_option_is_dense(tiny_llama):
    m, ps = tiny_llama.model, prompts(30, 11)
    cache = make_cache(m, 2, 96, SLIDING)
    assert not cache.approximate and "like dense" in cache.label and cache.window(0) is None
    assert cache.rollback_limit == float("inf")
    torch.testing.assert_close(run(m, SLIDING, ps, 10), run(m, DenseCache, ps, 10), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_len", [1, 5])
def test_imposed_window_with_sinks_against_contract_reference(q_len):
    c = build("sliding", (None, None), window=6, sinks=2, rollback=3)
    h = History(c, (6, 6), sinks=2)  # the window and sinks imposed on both layers
    pos = torch.arange(23).expand(2, -1)
    valid = pos < torch.tensor([[13], [23]])
    check_all(h, h.step(pos, valid, seed=1), pos, valid)
    for s in range(3):
        nxt = c.lengths[:, None] + torch.arange(q_len)
        check_all(h, h.step(nxt, seed=2 + s), nxt)
    assert c.read(0, 0)[0].tolist()[:2] == [0, 1]  # the sinks stay


# -- options ------------------------------------------------------------------------------
def lay(windows) -> CacheLayout:
    return CacheLayout(len(windows), 2, 8, torch.float32, torch.device("cpu"), tuple(windows), softmax_scale=0.35)


def test_bad_options_listed_together():
    with pytest.raises(SetupError) as e:
        SlidingCache(lay((None, None)), 0, 64, rollback=-1, window=0, sinks=-1)
    text = "\n".join(e.value.reasons)
    assert len(e.value.reasons) == 4 and all(w in text for w in ("batch_size", "rollback", "window", "sinks"))
    with pytest.raises(SetupError, match="fewer than the window"):
        SlidingCache(lay((None, None)), 1, 64, window=4, sinks=4)


def test_window_option_refused_on_a_windowed_model():
    with pytest.raises(SetupError) as e:
        SlidingCache(lay((8, None)), 1, 64, window=4)
    assert len(e.value.reasons) == 1 and "own sliding windows [8]" in e.value.reasons[0]
    with pytest.raises(SetupError, match="sinks .* need an imposed `window`"):
        SlidingCache(lay((8, None)), 1, 64, sinks=2)
