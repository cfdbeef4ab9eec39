"""`dense`: one preallocated [B, Hkv, capacity, D] buffer per layer, written by position.

Slot p of a row holds position p, so rollback is just a shorter length: stale slots are
never read because attention is causal by position. Windowed layers read only the
slots inside their window (exact Gemma 3), but all layers keep full storage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from decodelab.cache.base import (CacheLayout, KVCache, Plan, StaticView, attention_mask, extend, is_plain_causal,
                                  reference_attention)
from decodelab.cache.kernels.paged import dense_as_pool
from decodelab.cache.static import StaticPlan
from decodelab.cache.tree import Tree, tree_visible


@dataclass(frozen=True)
class Span:
    """The slots [lo, hi) of every row that one window's layers read in a forward."""

    lo: int
    hi: int
    mask: torch.Tensor | None  # [B, 1, T, hi - lo] on the device, True = attend; None: all (or causal)
    causal: bool  # the square lower triangle over exactly the new tokens (SDPA's is_causal)


@dataclass(frozen=True)
class DensePlan(Plan):
    """A dense forward: where it writes and, per window, which slots it reads."""

    contiguous: int | None  # every row writes slots [contiguous, contiguous + T); None: scattered
    dev_rows: torch.Tensor  # [B, 1] the cache rows, on the device
    rows_slice: slice | None  # the forward's rows as a slice of the buffers; None: not consecutive
    dev_positions: torch.Tensor  # [B, T] positions on the device
    spans: dict  # window -> Span, for every window of the layers this backend attends densely


class DenseCache(KVCache):
    """One [B, Hkv, capacity, D] K and V buffer per layer; slot p holds position p."""

    serves_row_subsets = True  # a row is its own slice of every buffer

    def __init__(self, layout: CacheLayout, batch_size: int, capacity: int):
        super().__init__(layout, batch_size, capacity)
        shape = (batch_size, layout.n_kv_heads, capacity, layout.head_dim)
        kw = dict(dtype=layout.dtype, device=layout.device)
        self.k = [torch.zeros(shape, **kw) for _ in range(layout.n_layers)]  # [B, Hkv, S, D] each
        self.v = [torch.zeros(shape, **kw) for _ in range(layout.n_layers)]

    def plan(self, positions: torch.Tensor, valid: torch.Tensor | None = None, rows=None,
             parents=None) -> DensePlan:
        """Book the forward; plan its writes (one slice when every row continues at the same
        position) and, per window, the slots it reads and their mask."""
        base = super().plan(positions, valid, rows, parents)
        pos, sel, dev = base.positions, base.rows, self.layout.device
        start = int(pos[0, 0])
        same = bool((pos == start + torch.arange(pos.shape[1])).all())
        run = sel is None or bool((sel == sel[0] + torch.arange(len(sel))).all())
        rows_slice = slice(None) if sel is None else (slice(int(sel[0]), int(sel[0]) + len(sel)) if run else None)
        spans = {w: self._span(pos, w, base.tree) for w in self._dense_windows()}
        return extend(base, DensePlan, contiguous=start if same else None,
                      dev_rows=base.cache_rows(self.batch_size).to(dev)[:, None], rows_slice=rows_slice,
                      dev_positions=pos.to(dev), spans=spans)

    def book(self, positions: torch.Tensor) -> None:
        """The host bookkeeping alone (lengths), for a compiled step."""
        KVCache.plan(self, positions)

    def _dense_windows(self) -> set:
        """The windows of the layers this backend attends over its dense buffers."""
        return set(self.layout.windows)

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor, plan: DensePlan) -> None:
        if plan.contiguous is not None and plan.rows_slice is not None:
            s, r = plan.contiguous, plan.rows_slice
            self.k[layer][r, :, s:s + k.shape[2]] = k
            self.v[layer][r, :, s:s + v.shape[2]] = v
        else:  # [b, T] advanced index around a slice -> values laid out [b, T, Hkv, D]
            self.k[layer][plan.dev_rows, :, plan.dev_positions] = k.transpose(1, 2)
            self.v[layer][plan.dev_rows, :, plan.dev_positions] = v.transpose(1, 2)

    @staticmethod
    def _held(t: torch.Tensor, lo: int, hi: int, plan: DensePlan) -> torch.Tensor:
        """Slots [lo, hi) of the forward's rows of one buffer [B, Hkv, S, D] (a view, or a
        gather when the rows are not consecutive)."""
        if plan.rows_slice is not None:
            return t[plan.rows_slice, :, lo:hi]
        return t[:, :, lo:hi].index_select(0, plan.dev_rows[:, 0])

    def _span(self, q: torch.Tensor, window: int | None, tree: Tree | None = None) -> Span:
        """Slots [lo, hi) that queries at slots q [B, T] read in a window, their mask, and
        whether that mask is the plain causal triangle (a tree's queries read from their own
        positions, and see only their ancestors among the forward's tokens)."""
        first = int(q.min() if tree is None else tree.positions.min())
        lo = 0 if window is None else max(0, first - window + 1)
        hi = int(q.max()) + 1
        kpos = torch.arange(lo, hi).expand(q.shape[0], -1)  # [B, S]
        if tree is not None:
            return Span(lo, hi, tree_visible(tree, kpos, window)[:, None].to(self.layout.device), False)
        if is_plain_causal(q, kpos, window):
            return Span(lo, hi, None, True)
        mask = attention_mask(q, kpos, window)
        return Span(lo, hi, None if mask is None else mask.to(self.layout.device), False)

    def attend(self, layer, q, k, v, plan: DensePlan):
        """Write k, v [B, Hkv, T, D] at their positions; attend q [B, Hq, T, D] over the
        slots the plan reads in the layer's window (a compiled step's `StaticPlan`: over
        every slot, masked by position)."""
        if isinstance(plan, StaticPlan):
            return plan.call(self._attend_static, layer, q, k, v, plan)
        self._write(layer, k, v, plan)
        sp = plan.spans[self.layout.windows[layer]]
        keys, values = self._held(self.k[layer], sp.lo, sp.hi, plan), self._held(self.v[layer], sp.lo, sp.hi, plan)
        return reference_attention(q, keys, values, sp.mask, self.layout.softmax_scale, self.layout.softcap,
                                   sp.causal)

    def _attend_static(self, layer, q, k, v, plan: StaticPlan):
        """The compiled step: the row-major buffers in place on a CPU (traced with the model),
        the buffers read as block pools by the paged kernel on CUDA."""
        if plan.traced:
            return plan.attend_rows(layer, q, k, v, self.k[layer], self.v[layer])
        return plan.attend_pools(layer, q, k, v)

    def _move_slots(self, row: int, src: list[int], dst: list[int]) -> None:
        """Slots are positions: copy each layer's slots src -> dst of the row."""
        s, d = (torch.tensor(x, device=self.layout.device) for x in (src, dst))
        for t in self.k + self.v:  # [B, Hkv, S, D]
            t[row, :, d] = t[row, :, s]

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
        gcd(capacity, 64) slots."""
        bs = math.gcd(self.capacity, 64)
        k, table = zip(*(dense_as_pool(t, bs) for t in self.k))  # [Hkv, N, bs, D] each, [B, S / bs]
        v = [dense_as_pool(t, bs)[0] for t in self.v]
        return StaticView(list(k), v, table[0], bs)

    def fill_random(self, n_tokens: int, seed: int = 0) -> None:
        """Forget every row, then give each positions [0, n_tokens): `plan` books them
        and slots [0, n_tokens) of every layer are drawn directly (no attention runs)."""
        self.reset()
        KVCache.plan(self, torch.arange(n_tokens).expand(self.batch_size, -1))
        g = torch.Generator(device=self.layout.device).manual_seed(seed)
        for t in self.k + self.v:
            t[:, :, :n_tokens].normal_(generator=g)
