"""`dense`: one preallocated [B, Hkv, capacity, D] buffer per layer, written by position.

Slot p of a row holds position p, so rollback is just a shorter length: stale slots are
never read because attention is causal by position. Windowed layers read only the
slots inside their window (exact Gemma 3), but all layers keep full storage.
"""

from __future__ import annotations

import math

import torch

from decodelab.cache.base import (CacheLayout, KVCache, StaticView, attention_mask, is_plain_causal,
                                  reference_attention)
from decodelab.cache.kernels.paged import dense_as_pool


class DenseCache(KVCache):
    """One [B, Hkv, capacity, D] K and V buffer per layer; slot p holds position p."""

    serves_row_subsets = True  # a row is its own slice of every buffer
    FORWARD_STATE = KVCache.FORWARD_STATE + ("_contiguous", "_rows", "_slice", "_dev_pos")

    def __init__(self, layout: CacheLayout, batch_size: int, capacity: int):
        super().__init__(layout, batch_size, capacity)
        shape = (batch_size, layout.n_kv_heads, capacity, layout.head_dim)
        kw = dict(dtype=layout.dtype, device=layout.device)
        self.k = [torch.zeros(shape, **kw) for _ in range(layout.n_layers)]  # [B, Hkv, S, D] each
        self.v = [torch.zeros(shape, **kw) for _ in range(layout.n_layers)]

    def prepare(self, positions: torch.Tensor, valid: torch.Tensor | None = None, rows=None) -> None:
        super().prepare(positions, valid, rows)
        pos, sel = self._qpos, self._sel
        start = int(pos[0, 0])
        same = bool((pos == start + torch.arange(pos.shape[1])).all())
        self._contiguous = start if same else None  # all rows write one slice
        dev = self.layout.device
        self._rows = (torch.arange(self.batch_size) if sel is None else sel).to(dev)[:, None]  # [b, 1] cache rows
        # the forward's rows as a slice of the buffers (all rows, or a consecutive run), else None
        run = sel is None or bool((sel == sel[0] + torch.arange(len(sel))).all())
        self._slice = slice(None) if sel is None else (slice(int(sel[0]), int(sel[0]) + len(sel)) if run else None)
        self._dev_pos = positions.to(dev)

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self._contiguous is not None and self._slice is not None:
            s, r = self._contiguous, self._slice
            self.k[layer][r, :, s:s + k.shape[2]] = k
            self.v[layer][r, :, s:s + v.shape[2]] = v
        else:  # [b, T] advanced index around a slice -> values laid out [b, T, Hkv, D]
            self.k[layer][self._rows, :, self._dev_pos] = k.transpose(1, 2)
            self.v[layer][self._rows, :, self._dev_pos] = v.transpose(1, 2)

    def _held(self, t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Slots [lo, hi) of the forward's rows of one buffer [B, Hkv, S, D] (a view, or a
        gather when the rows are not consecutive)."""
        if self._slice is not None:
            return t[self._slice, :, lo:hi]
        return t[:, :, lo:hi].index_select(0, self._rows[:, 0])

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
        """Write k, v [B, Hkv, T, D] at their positions; attend q [B, Hq, T, D] over the
        slots this forward's window reads."""
        self._write(layer, k, v)
        lo, hi, mask, causal = self._span(self.layout.windows[layer])
        keys, values = self._held(self.k[layer], lo, hi), self._held(self.v[layer], lo, hi)
        return reference_attention(q, keys, values, mask, self.layout.softmax_scale, self.layout.softcap, causal)

    def read(self, layer, row):
        """Positions [n], k and v [Hkv, n, D]: the row's slots [0, n)."""
        n = int(self.lengths[row])
        return torch.arange(n), self.k[layer][row, :, :n], self.v[layer][row, :, :n]

    def nbytes(self) -> int:
        """The preallocated buffers: K and V, every layer, every row, the whole capacity."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    # -- capabilities (cache/base.py) ----------------------------------------------
    def static_view(self) -> StaticView:
        """Each layer's [B, Hkv, S, D] buffer read as a pool of blocks of its own rows (a
        strided view, no copy) with a fixed identity block table; blocks of
        gcd(capacity, 64) slots. The buffers themselves come along (`rows_k`, `rows_v`)."""
        bs = math.gcd(self.capacity, 64)
        k, table = zip(*(dense_as_pool(t, bs) for t in self.k))  # [Hkv, N, bs, D] each, [B, S / bs]
        v = [dense_as_pool(t, bs)[0] for t in self.v]
        return StaticView(list(k), v, table[0], bs, rows_k=list(self.k), rows_v=list(self.v))

    def fill_random(self, n_tokens: int, seed: int = 0) -> None:
        """Forget every row, then give each positions [0, n_tokens): `prepare` books them
        and slots [0, n_tokens) of every layer are drawn directly (no attention runs)."""
        self.reset()
        self.prepare(torch.arange(n_tokens).expand(self.batch_size, -1))
        g = torch.Generator(device=self.layout.device).manual_seed(seed)
        for t in self.k + self.v:
            t[:, :, :n_tokens].normal_(generator=g)
