"""The KVCache contract, for every backend with a yaml in conf/cache/.

Each test keeps the full history of the K/V it wrote, so the reference is plain
attention over that history (causal, inside the windows the test built the layout with),
whatever the backend stores. Lossy (quantized) backends are held to a relative tolerance.
"""

from __future__ import annotations

import pytest
import torch

from tests.cache.conftest import D, H_KV, History, assert_close, build, check_all

WINDOWS = (8, None)  # layer 0 windowed, layer 1 full: the windows the reference applies


@pytest.mark.parametrize("windows", [(8, None), (None, None)])
def test_write_then_read_back(backend, windows):
    c = build(backend, windows)
    h = History(c, windows)
    for s in range(0, 21, 7):
        h.step(torch.arange(s, s + 7).expand(2, -1), seed=s)
    assert c.lengths.tolist() == [21, 21]
    for layer in range(2):
        for row in range(2):
            pos, k, v = c.read(layer, row)
            assert len(pos) > 0 and int(pos[-1]) == 20 and bool((pos[1:] > pos[:-1]).all())
            want_k = torch.stack([h.kv[layer, row, int(p)][0] for p in pos], 1)
            want_v = torch.stack([h.kv[layer, row, int(p)][1] for p in pos], 1)
            assert_close(c, k, want_k)
            assert_close(c, v, want_v)


@pytest.mark.parametrize("windows", [(8, None), (None, 4)])
@pytest.mark.parametrize("q_len", [1, 5])
def test_attention_mixed_lengths_against_reference(backend, windows, q_len):
    c = build(backend, windows)
    h = History(c, windows)
    n = torch.tensor([[13], [23]])
    pos = torch.arange(23).expand(2, -1)
    valid = pos < n  # row 0 is padding after 13 tokens
    check_all(h, h.step(pos, valid, seed=1), pos, valid)
    assert c.lengths.tolist() == [13, 23]
    nxt = c.lengths[:, None] + torch.arange(q_len)
    check_all(h, h.step(nxt, seed=2), nxt)


def test_truncate_then_continue(backend):
    c = build(backend, WINDOWS)
    h = History(c, WINDOWS)
    h.step(torch.arange(20).expand(2, -1), seed=3)
    back = 3 if c.rollback_limit >= 3 else int(c.rollback_limit)
    new = [20 - back, 20 - 1]
    c.truncate(new)
    h.forget_after(new)
    assert c.lengths.tolist() == new
    nxt = torch.tensor(new)[:, None] + torch.arange(2)
    check_all(h, h.step(nxt, seed=4), nxt)


def test_rollback_beyond_limit_is_refused(backend):
    c = build(backend, WINDOWS)
    if c.rollback_limit == float("inf"):
        pytest.skip("unbounded rollback")
    n = 30
    if c.rollback_limit >= n:
        pytest.skip(f"rollback_limit {c.rollback_limit} exceeds the {n} tokens written")
    History(c, WINDOWS).step(torch.arange(n).expand(2, -1))
    back = min(int(c.rollback_limit) + 1, n)  # one past the limit, never below position 0
    with pytest.raises(ValueError, match="rollback"):
        c.truncate([n - back, n])
    assert c.lengths.tolist() == [n, n]  # a refused truncate changes nothing


def test_lossy_backend_really_approximates(backend):
    """A lossy backend's contract runs store approximations for real (with CONTRACT_OPTIONS),
    so the tolerance in `assert_close` is exercised, not vacuous; an exact one reads back bits."""
    c = build(backend, (None, None))
    h = History(c, (None, None))
    h.step(torch.arange(21).expand(2, -1), seed=8)
    _, k, v = c.read(0, 0)
    want_k = torch.stack([h.kv[0, 0, p][0] for p in range(21)], 1)
    want_v = torch.stack([h.kv[0, 0, p][1] for p in range(21)], 1)
    assert torch.equal(k, want_k) == torch.equal(v, want_v) == (not c.lossy)


def test_reset_forgets_everything(backend):
    c = build(backend, WINDOWS)
    History(c, WINDOWS).step(torch.arange(12).expand(2, -1), seed=5)
    c.reset()
    assert c.lengths.tolist() == [0, 0] and c.theoretical_bytes() == 0
    h = History(c, WINDOWS)
    pos = torch.arange(6).expand(2, -1)
    check_all(h, h.step(pos, seed=6), pos)


def test_nbytes_and_formula(backend):
    c = build(backend, WINDOWS)
    History(c, WINDOWS).step(torch.arange(10).expand(2, -1))
    per_token = 2 * 2 * H_KV * D * getattr(c, "kv_dtype", torch.float32).itemsize  # K and V, 2 layers, as stored
    assert c.theoretical_bytes() == 20 * per_token
    if c.lossy:  # quantized storage may hold fewer bytes than the formula's full precision
        assert c.nbytes() > 0
    else:  # exact K/V of every token held (10 fit the sliding ring of 8 + rollback) need the formula's bytes
        assert c.nbytes() >= c.theoretical_bytes()


def test_single_token_decode_loop(backend):
    """Prompt then 20 single-token steps: every step against the reference."""
    c = build(backend, WINDOWS, batch=1)
    h = History(c, WINDOWS)
    h.step(torch.arange(5)[None], seed=7)
    for p in range(5, 25):
        pos = torch.tensor([[p]])
        check_all(h, h.step(pos, seed=p), pos)
