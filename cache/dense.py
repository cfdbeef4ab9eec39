"""`dense`: one preallocated [B, Hkv, capacity, D] buffer per layer, written by position.

Slot p of a row holds position p, so rollback is just a shorter length: stale slots are
never read because attention is causal by position. Windowed layers read only the
slots inside their window (exact Gemma 3), but all layers keep full storage.
"""

from __future__ import annotations

import torch

from decodelab.cache.base import CacheLayout, KVCache, attention_mask, is_plain_causal, reference_attention


class DenseCache(KVCache):
    def __init__(self, layout: CacheLayout, batch_size: int, capacity: int):
        super().__init__(layout, batch_size, capacity)
        shape = (batch_size, layout.n_kv_heads, capacity, layout.head_dim)
        kw = dict(dtype=layout.dtype, device=layout.device)
        self.k = [torch.zeros(shape, **kw) for _ in range(layout.n_layers)]  # [B, Hkv, S, D] each
        self.v = [torch.zeros(shape, **kw) for _ in range(layout.n_layers)]

    def prepare(self, positions: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        super().prepare(positions, valid)
        pos = self._qpos
        start = int(pos[0, 0])
        same = bool((pos == start + torch.arange(pos.shape[1])).all())
        self._contiguous = start if same else None  # all rows write one slice
        self._rows = torch.arange(self.batch_size, device=self.layout.device)[:, None]  # [B, 1]
        self._dev_pos = positions.to(self.layout.device)

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self._contiguous is not None:
            s = self._contiguous
            self.k[layer][:, :, s:s + k.shape[2]] = k
            self.v[layer][:, :, s:s + v.shape[2]] = v
        else:  # [B, T] advanced index around a slice -> values laid out [B, T, Hkv, D]
            self.k[layer][self._rows, :, self._dev_pos] = k.transpose(1, 2)
            self.v[layer][self._rows, :, self._dev_pos] = v.transpose(1, 2)

    def _span(self, window: int | None) -> tuple[int, int, torch.Tensor | None, bool]:
        """Slots [lo, hi) this forward reads for a window, their mask, and whether that
        mask is the plain causal triangle (memoized per forward)."""
        if window not in self._masks:
            q = self._qpos
            lo = 0 if window is None else max(0, int(q.min()) - window + 1)
            hi = int(q.max()) + 1
            kpos = torch.arange(lo, hi).expand(q.shape[0], -1)  # [B, S]
            if is_plain_causal(q, kpos, window):
                self._masks[window] = (lo, hi, None, True)
            else:
                mask = attention_mask(q, kpos, window)
                self._masks[window] = (lo, hi, None if mask is None else mask.to(self.layout.device), False)
        return self._masks[window]

    def attend(self, layer, q, k, v):
        self._write(layer, k, v)
        lo, hi, mask, causal = self._span(self.layout.windows[layer])
        keys, values = self.k[layer][:, :, lo:hi], self.v[layer][:, :, lo:hi]
        return reference_attention(q, keys, values, mask, self.layout.softmax_scale, self.layout.softcap, causal)

    def read(self, layer, row):
        n = int(self.lengths[row])
        return torch.arange(n), self.k[layer][row, :, :n], self.v[layer][row, :, :n]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
