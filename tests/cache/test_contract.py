"""The KVCache contract, for every backend with a yaml in conf/cache/.

Each test keeps the full history of the K/V it wrote, so the reference is plain
attention over that history (causal, the window the backend applies, sinks), whatever
the backend stores. Lossy (quantized) backends are held to a relative tolerance.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from decodelab.cache.base import CacheLayout
from decodelab.models.loading import CONF_DIR

BACKENDS = sorted(p.stem for p in (CONF_DIR / "cache").glob("*.yaml"))
H_Q, H_KV, D = 4, 2, 8

# Options a backend's contract runs use instead of its yaml defaults, so that the short
# sequences here (<= 30 tokens, head_dim 8) really exercise it. int4: blocks of 4 tokens
# (per-token groups on both axes, so the flush needs no 32-token channel group), queries
# see their newest 4 positions exact and everything older dequantized.
CONTRACT_OPTIONS = {
    "int4": dict(residual=4, group_size=32, flush=4, key_axis="token", value_axis="token", rollback=4),
}


def build(name: str, windows=(8, None), batch: int = 2, capacity: int = 64, **overrides):
    spec = OmegaConf.load(Path(CONF_DIR) / "cache" / f"{name}.yaml")
    spec = OmegaConf.merge(spec, CONTRACT_OPTIONS.get(name, {}), overrides)
    layout = CacheLayout(len(windows), H_KV, D, torch.float32, torch.device("cpu"), tuple(windows),
                         softmax_scale=D**-0.5)
    return instantiate(spec)(layout, batch, capacity)


class History:
    """Everything written per (layer, row, position), and the plain reference over it."""

    def __init__(self, cache):
        self.cache, self.kv = cache, {}

    def step(self, positions: torch.Tensor, valid=None, seed: int = 0):
        """One forward over positions [B, T] through every layer; returns (q, out) per layer."""
        g = torch.Generator().manual_seed(seed)
        B, T = positions.shape
        valid = torch.ones(B, T, dtype=torch.bool) if valid is None else valid
        self.cache.prepare(positions, valid)
        results = []
        for layer in range(self.cache.layout.n_layers):
            q = torch.randn(B, H_Q, T, D, generator=g)
            k, v = torch.randn(B, H_KV, T, D, generator=g), torch.randn(B, H_KV, T, D, generator=g)
            for b in range(B):
                for t in range(T):
                    if valid[b, t]:
                        self.kv[layer, b, int(positions[b, t])] = (k[b, :, t], v[b, :, t])
            results.append((q, self.cache.attend(layer, q, k, v)))
        return results

    def forget_after(self, lengths):
        self.kv = {key: val for key, val in self.kv.items() if key[2] < lengths[key[1]]}

    def reference(self, layer: int, q: torch.Tensor, positions: torch.Tensor, valid=None) -> torch.Tensor:
        """Plain attention over the written history, per row and query."""
        window, sinks = self.cache.window(layer), self.cache.sink_tokens
        out = torch.zeros_like(q)
        for b in range(q.shape[0]):
            for t in range(q.shape[2]):
                if valid is not None and not valid[b, t]:
                    continue
                p = int(positions[b, t])
                keys = sorted(kp for (lay, row, kp) in self.kv if lay == layer and row == b and kp <= p
                              and (window is None or p - kp < window or kp < sinks))
                K = torch.stack([self.kv[layer, b, kp][0] for kp in keys], 1)  # [Hkv, N, D]
                V = torch.stack([self.kv[layer, b, kp][1] for kp in keys], 1)
                for h in range(H_Q):
                    w = torch.softmax(K[h // (H_Q // H_KV)] @ q[b, h, t] * D**-0.5, 0)
                    out[b, h, t] = w @ V[h // (H_Q // H_KV)]
        return out


def assert_close(cache, got, expect, valid=None):
    if valid is not None:
        got, expect = got.transpose(1, 2)[valid], expect.transpose(1, 2)[valid]
    if cache.lossy:
        rel = (got - expect).norm() / expect.norm()
        assert rel < 0.15, f"relative error {rel:.3f}"
    else:
        torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)


def check_all(h: History, results, positions, valid=None):
    for layer, (q, out) in enumerate(results):
        assert_close(h.cache, out, h.reference(layer, q, positions, valid), valid)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.mark.parametrize("windows", [(8, None), (None, None)])
def test_write_then_read_back(backend, windows):
    c = build(backend, windows)
    h = History(c)
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
    h = History(c)
    n = torch.tensor([[13], [23]])
    pos = torch.arange(23).expand(2, -1)
    valid = pos < n  # row 0 is padding after 13 tokens
    check_all(h, h.step(pos, valid, seed=1), pos, valid)
    assert c.lengths.tolist() == [13, 23]
    nxt = c.lengths[:, None] + torch.arange(q_len)
    check_all(h, h.step(nxt, seed=2), nxt)


def test_truncate_then_continue(backend):
    c = build(backend, (8, None))
    h = History(c)
    h.step(torch.arange(20).expand(2, -1), seed=3)
    back = 3 if c.rollback_limit >= 3 else int(c.rollback_limit)
    new = [20 - back, 20 - 1]
    c.truncate(new)
    h.forget_after(new)
    assert c.lengths.tolist() == new
    nxt = torch.tensor(new)[:, None] + torch.arange(2)
    check_all(h, h.step(nxt, seed=4), nxt)


def test_rollback_beyond_limit_is_refused(backend):
    c = build(backend, (8, None))
    if c.rollback_limit == float("inf"):
        pytest.skip("unbounded rollback")
    n = 30
    if c.rollback_limit >= n:
        pytest.skip(f"rollback_limit {c.rollback_limit} exceeds the {n} tokens written")
    History(c).step(torch.arange(n).expand(2, -1))
    back = min(int(c.rollback_limit) + 1, n)  # one past the limit, never below position 0
    with pytest.raises(ValueError, match="rollback"):
        c.truncate([n - back, n])
    assert c.lengths.tolist() == [n, n]  # a refused truncate changes nothing


def test_lossy_backend_really_approximates(backend):
    """A lossy backend's contract runs store approximations for real (with CONTRACT_OPTIONS),
    so the tolerance in `assert_close` is exercised, not vacuous; an exact one reads back bits."""
    c = build(backend, (None, None))
    h = History(c)
    h.step(torch.arange(21).expand(2, -1), seed=8)
    _, k, v = c.read(0, 0)
    want_k = torch.stack([h.kv[0, 0, p][0] for p in range(21)], 1)
    want_v = torch.stack([h.kv[0, 0, p][1] for p in range(21)], 1)
    assert torch.equal(k, want_k) == torch.equal(v, want_v) == (not c.lossy)


def test_reset_forgets_everything(backend):
    c = build(backend, (8, None))
    History(c).step(torch.arange(12).expand(2, -1), seed=5)
    c.reset()
    assert c.lengths.tolist() == [0, 0] and c.theoretical_bytes() == 0
    h = History(c)
    pos = torch.arange(6).expand(2, -1)
    check_all(h, h.step(pos, seed=6), pos)


def test_nbytes_and_formula(backend):
    c = build(backend, (8, None))
    History(c).step(torch.arange(10).expand(2, -1))
    per_token = 2 * 2 * H_KV * D * 4  # K and V, 2 layers, fp32
    assert c.theoretical_bytes() == 20 * per_token
    assert c.nbytes() > 0


def test_single_token_decode_loop(backend):
    """Prompt then 20 single-token steps: every step against the reference."""
    c = build(backend, (8, None), batch=1)
    h = History(c)
    h.step(torch.arange(5)[None], seed=7)
    for p in range(5, 25):
        pos = torch.tensor([[p]])
        check_all(h, h.step(pos, seed=p), pos)
