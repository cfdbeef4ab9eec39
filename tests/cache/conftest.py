"""Helpers the cache tests share: every backend built from its yaml at the contract's
small shapes (`build`), the history of everything written with the plain attention
over it (`History`), and the comparisons (`assert_close`, `check_all`).

The reference is plain attention over the history, inside the windows and sinks the
TEST intends (given to `History`), never the ones the cache under test reports: a
backend that applies the wrong window fails."""

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
    """Backend `name` from its yaml (plus CONTRACT_OPTIONS and `overrides`) on a layout of
    len(windows) layers, H_KV heads of D dims, fp32 on the CPU."""
    spec = OmegaConf.load(Path(CONF_DIR) / "cache" / f"{name}.yaml")
    spec = OmegaConf.merge(spec, CONTRACT_OPTIONS.get(name, {}), overrides)
    layout = CacheLayout(len(windows), H_KV, D, torch.float32, torch.device("cpu"), tuple(windows),
                         softmax_scale=D**-0.5)
    return instantiate(spec)(layout, batch, capacity)


class History:
    """Everything written per (layer, row, position), and the plain reference over it
    with the windows (per layer, None = full) and sinks the test intends."""

    def __init__(self, cache, windows, sinks: int = 0):
        self.cache, self.kv = cache, {}
        self.windows, self.sinks = tuple(windows), sinks

    def step(self, positions: torch.Tensor, valid=None, seed: int = 0):
        """One forward over positions [B, T] through every layer; returns (q, out) per layer."""
        g = torch.Generator().manual_seed(seed)
        B, T = positions.shape
        valid = torch.ones(B, T, dtype=torch.bool) if valid is None else valid
        plan = self.cache.plan(positions, valid)
        results = []
        for layer in range(self.cache.layout.n_layers):
            q = torch.randn(B, H_Q, T, D, generator=g)
            k, v = torch.randn(B, H_KV, T, D, generator=g), torch.randn(B, H_KV, T, D, generator=g)
            for b in range(B):
                for t in range(T):
                    if valid[b, t]:
                        self.kv[layer, b, int(positions[b, t])] = (k[b, :, t], v[b, :, t])
            results.append((q, self.cache.attend(layer, q, k, v, plan)))
        return results

    def forget_after(self, lengths):
        self.kv = {key: val for key, val in self.kv.items() if key[2] < lengths[key[1]]}

    def reference(self, layer: int, q: torch.Tensor, positions: torch.Tensor, valid=None) -> torch.Tensor:
        """Plain attention over the written history, per row and query: keys p <= q with
        q - p < window, or p < sinks."""
        window, sinks = self.windows[layer], self.sinks
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
    """Exact backends to float rounding; lossy ones to 15% relative error."""
    if valid is not None:
        got, expect = got.transpose(1, 2)[valid], expect.transpose(1, 2)[valid]
    if cache.lossy:
        rel = (got - expect).norm() / expect.norm()
        assert rel < 0.15, f"relative error {rel:.3f}"
    else:
        torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)


def check_all(h: History, results, positions, valid=None):
    """Every layer's output of one `History.step` against the reference."""
    for layer, (q, out) in enumerate(results):
        assert_close(h.cache, out, h.reference(layer, q, positions, valid), valid)


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Every backend with a yaml in conf/cache/."""
    return request.param
