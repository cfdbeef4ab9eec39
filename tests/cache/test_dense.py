"""The dense backend against the KVCache contract and DESIGN.md's worked numbers."""

from __future__ import annotations

import pytest
import torch

from decodelab.cache.base import CacheLayout, attention_mask, reference_attention
from decodelab.cache.dense import DenseCache
from decodelab.models.errors import SetupError


def layout(n_layers=2, n_kv=2, head_dim=2, windows=None, dtype=torch.float32):
    return CacheLayout(n_layers, n_kv, head_dim, dtype, torch.device("cpu"), windows or (None,) * n_layers,
                       softmax_scale=head_dim**-0.5)


def feed(cache, layer, n_q, k, v, plan):
    q = torch.randn(k.shape[0], n_q, k.shape[2], k.shape[3])
    return q, cache.attend(layer, q, k, v, plan)


def test_design_worked_bytes():
    # 2 layers, 2 KV heads, head_dim 2, fp32, prompt of 2 tokens -> 32 numbers, 128 bytes
    c = DenseCache(layout(), batch_size=1, capacity=8)
    c.plan(torch.arange(2)[None])
    assert c.theoretical_bytes() == 128
    c.plan(torch.tensor([[2]]))  # each new token adds 64 bytes
    assert c.theoretical_bytes() == 192
    assert c.nbytes() == 2 * 2 * 2 * 8 * 2 * 4  # K and V, layers, heads, capacity, dim, fp32
    assert layout(dtype=torch.bfloat16).bytes_per_token() == 32


def test_write_then_read_back():
    c = DenseCache(layout(n_layers=1), 2, 10)
    k, v = torch.randn(2, 2, 4, 2), torch.randn(2, 2, 4, 2)
    pos = torch.arange(3, 7).expand(2, -1)
    plan = c.plan(pos)
    feed(c, 0, 2, k, v, plan)
    torch.testing.assert_close(c.k[0][:, :, 3:7], k, rtol=0, atol=0)
    torch.testing.assert_close(c.v[0][:, :, 3:7], v, rtol=0, atol=0)
    assert c.lengths.tolist() == [7, 7]


def plain_attention(q, keys, values, qpos, kpos, window, scale):
    """Loop-per-query reference: softmax over allowed keys only (GQA by repetition)."""
    B, Hq, T, D = q.shape
    group = Hq // keys.shape[1]
    out = torch.zeros_like(q)
    for b in range(B):
        for t in range(T):
            ok = [j for j in range(kpos.shape[1]) if 0 <= kpos[b, j] <= qpos[b, t]
                  and (window is None or qpos[b, t] - kpos[b, j] < window)]
            for h in range(Hq):
                kk, vv = keys[b, h // group, ok], values[b, h // group, ok]
                w = torch.softmax(kk @ q[b, h, t] * scale, dim=0)
                out[b, h, t] = w @ vv
    return out


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("q_len", [1, 5])
def test_attention_matches_plain_reference(window, q_len):
    torch.manual_seed(0)
    lay = layout(n_layers=1, n_kv=2, head_dim=8, windows=(window,))
    c = DenseCache(lay, 2, 16)
    # row 0 has 6 tokens cached, row 1 has 9 (mixed lengths); then q_len new ones each
    hist_k, hist_v = torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    plan = c.plan(torch.arange(9).expand(2, -1), valid=torch.arange(9)[None] < torch.tensor([[6], [9]]))
    c.attend(0, torch.randn(2, 4, 9, 8), hist_k, hist_v, plan)
    assert c.lengths.tolist() == [6, 9]
    pos = c.lengths[:, None] + torch.arange(q_len)  # [B, T]
    k, v = torch.randn(2, 2, q_len, 8), torch.randn(2, 2, q_len, 8)
    plan = c.plan(pos)
    q, out = feed(c, 0, 4, k, v, plan)
    all_k, all_v = c.k[0], c.v[0]
    kpos = torch.arange(16).expand(2, -1)
    expect = plain_attention(q, all_k, all_v, pos, kpos, window, lay.softmax_scale)
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)


def test_attention_mask_window_semantics():
    # window w: the token itself and w - 1 before it
    m = attention_mask(torch.tensor([[5]]), torch.arange(8)[None], window=3)
    assert m[0, 0, 0].tolist() == [False, False, False, True, True, True, False, False]
    assert attention_mask(torch.tensor([[7]]), torch.arange(8)[None], None) is None


def test_softcap_gqa_attention_by_hand():
    """4 query heads [1, 0] over 2 KV heads (heads 0, 1 read KV head 0; 2, 3 read KV head 1),
    scale 1, softcap 1: scores [2, 0] are capped to [tanh 2, 0] = [0.96403, 0], whose
    softmax is [0.7239, 0.2761] (uncapped it would be [0.8808, 0.1192]); v = identity."""
    q = torch.tensor([1.0, 0.0]).expand(1, 4, 1, 2)  # [B, Hq, T, D]
    k = torch.tensor([[[2.0, 0.0], [0.0, 0.0]], [[0.0, 0.0], [2.0, 0.0]]])[None]  # [B, Hkv, S, D]
    v = torch.eye(2).expand(1, 2, 2, 2)  # [B, Hkv, S, D]
    out = reference_attention(q, k, v, None, 1.0, softcap=1.0)
    want = torch.tensor([[0.7239, 0.2761]] * 2 + [[0.2761, 0.7239]] * 2)[None, :, None]  # [B, Hq, T, D]
    torch.testing.assert_close(out, want, rtol=0, atol=1e-4)


def test_truncate_then_continue_overwrites():
    c = DenseCache(layout(n_layers=1), 1, 10)
    pos = torch.arange(6)[None]
    plan = c.plan(pos)
    feed(c, 0, 2, torch.randn(1, 2, 6, 2), torch.randn(1, 2, 6, 2), plan)
    c.truncate([4])
    assert c.lengths.tolist() == [4]
    new_k = torch.randn(1, 2, 1, 2)
    plan = c.plan(torch.tensor([[4]]))
    feed(c, 0, 2, new_k, new_k, plan)
    assert c.lengths.tolist() == [5]
    torch.testing.assert_close(c.k[0][:, :, 4:5], new_k, rtol=0, atol=0)


def test_truncate_forward_and_reset():
    c = DenseCache(layout(), 2, 10)
    c.plan(torch.arange(3).expand(2, -1))
    with pytest.raises(SetupError, match="roll back"):
        c.truncate([4, 1])
    c.reset()
    assert c.lengths.tolist() == [0, 0] and c.theoretical_bytes() == 0


def test_capacity_and_batch_errors():
    c = DenseCache(layout(), 1, 4)
    with pytest.raises(SetupError, match="does not fit"):
        c.plan(torch.arange(5)[None])
    with pytest.raises(SetupError, match="batch"):
        c.plan(torch.arange(2).expand(2, -1))
    with pytest.raises(SetupError) as e:
        DenseCache(layout(), 0, 0)
    assert len(e.value.reasons) == 2
