"""`dense`: one preallocated [B, Hkv, capacity, D] buffer per layer, written by position.

Slot p of a row holds position p, so rollback is just a shorter length: stale slots are
never read because attention is causal by position. Windowed layers read only the
slots inside their window (exact Gemma 3), but all layers keep full storage.

`kv_dtype` stores K and V in another dtype than the model computes in: bfloat16 or
float16 (rounded to nearest), or float8_e4m3 with one scale per layer and kv head (vLLM's
e4m3 KV scheme; its scales are static, ours are set by the first forward that writes the
layer: 4 x its largest |K| (|V|) per head / 448, so values up to 4x the prompt's largest
still fit; larger ones saturate at +-448 x scale). Attention computes in the model's dtype:
on a CPU a decode-sized forward reads the stored K/V in place through decodelab's native
kernel (models/native.py: fp32 model, head size a multiple of 8, no softcap); elsewhere,
and for prefills and trees, the slots read are converted first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from decodelab.cache.base import (CacheLayout, KVCache, Plan, StaticView, attention_mask, extend, is_plain_causal,
                                  reference_attention)
from decodelab.cache.kernels.paged import dense_as_pool
from decodelab.cache.kernels.dispatch import DECODE_QUERIES
from decodelab.cache.static import FP8_MAX, StaticPlan, native_attention_serves, to_fp8
from decodelab.models.errors import raise_if
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


#: kv_dtype option -> storage dtype (auto: the model's)
KV_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
             "float8_e4m3": torch.float8_e4m3fn}
FP8_HEADROOM = 4.0  # a scale fits this many times the first forward's largest |K| (|V|) per head


def kv_dtype_problems(kv_dtype) -> list[str]:
    return [] if kv_dtype in KV_DTYPES else [f"kv_dtype must be one of {list(KV_DTYPES)}, got {kv_dtype!r}"]


def storage_dtype(layout: CacheLayout, kv_dtype: str) -> torch.dtype:
    return KV_DTYPES[kv_dtype] or layout.dtype


def stored_token_bytes(layout: CacheLayout, kv_dtype: str) -> int:
    """K and V of one token, every layer, at the storage dtype of the `kv_dtype` option."""
    elem = torch.empty((), dtype=storage_dtype(layout, kv_dtype)).element_size()
    return 2 * layout.n_layers * layout.n_kv_heads * layout.head_dim * elem


class StoredKV:
    """K/V held in a storage dtype of their own (`kv_dtype`), for the dense and paged
    backends: the storage dtype, fp8's scales per layer and kv head (set by the layer's
    first forward, reset with the cache), rounding what is written (`_stored`) and widening
    what torch's attention reads (`_readable`). A subclass calls `_storage` in its
    constructor, before it allocates anything."""

    def _storage(self, kv_dtype: str) -> None:
        """The storage dtype and, for fp8, each layer's K and V scales per kv head (ones until
        a forward sets them; updated in place: a compiled step reads them)."""
        lay = self.layout
        self.kv_dtype = storage_dtype(lay, kv_dtype)
        self.fp8 = self.kv_dtype == torch.float8_e4m3fn
        ones = lambda: torch.ones(lay.n_kv_heads, dtype=torch.float32, device=lay.device)  # noqa: E731
        self.k_scale = [ones() for _ in range(lay.n_layers)] if self.fp8 else None
        self.v_scale = [ones() for _ in range(lay.n_layers)] if self.fp8 else None
        self.scaled = [False] * lay.n_layers  # fp8: whether a forward set the layer's scales
        # K/V stored in another dtype, or a model whose eager and compiled steps share kernels: decode-sized
        # forwards read the buffers in place through the native kernel (the compiled step's)
        self.native_read = (self.kv_dtype != lay.dtype or lay.native_decode) and native_attention_serves(lay)
        self.lossy = self.kv_dtype not in (lay.dtype, torch.float32)  # fp32 holds any model dtype exactly

    def reset(self) -> None:
        """Forget every row (fp8: the next forward sets the scales again)."""
        super().reset()
        if getattr(self, "fp8", False):  # (a subclass may reset before _storage ran)
            for t in self.k_scale + self.v_scale:
                t.fill_(1.0)
            self.scaled = [False] * self.layout.n_layers

    def token_bytes(self) -> int:
        """K and V of one token, every layer, at the storage dtype."""
        lay = self.layout
        return 2 * lay.n_layers * lay.n_kv_heads * lay.head_dim * self.kv_dtype.itemsize

    # -- storage dtype --------------------------------------------------------------
    def _stored(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [B, Hkv, T, D] as stored: rounded to the storage dtype; fp8: divided by the
        layer's scale per head (set by the layer's first forward: FP8_HEADROOM x its largest
        |K|, |V| per head / FP8_MAX) and saturated."""
        if not self.fp8:
            return k.to(self.kv_dtype), v.to(self.kv_dtype)
        scales = (self.k_scale[layer], self.v_scale[layer])
        if not self.scaled[layer]:
            for x, scale in zip((k, v), scales):
                amax = x.detach().abs().amax(dim=(0, 2, 3)).float()  # [Hkv]
                scale.copy_(torch.where(amax > 0, amax * FP8_HEADROOM / FP8_MAX, torch.ones_like(amax)))
            self.scaled[layer] = True
        return tuple(to_fp8(x, s) for x, s in zip((k, v), scales))

    def _readable(self, layer: int, keys: torch.Tensor, values: torch.Tensor):
        """Stored keys and values (views of the buffers) in the model's dtype, for torch's attention."""
        if self.kv_dtype == self.layout.dtype:
            return keys, values
        dt = self.layout.dtype
        if not self.fp8:
            return keys.to(dt), values.to(dt)
        ks, vs = self.k_scale[layer][None, :, None, None], self.v_scale[layer][None, :, None, None]
        return (keys.to(dt) * ks).to(dt), (values.to(dt) * vs).to(dt)

    def _scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The layer's K and V scales per kv head (fp8), else (None, None): what the native
        kernels multiply what they read by."""
        return (self.k_scale[layer], self.v_scale[layer]) if self.fp8 else (None, None)

    def _compiled_dtype_refusal(self) -> None:
        """A compiled step off a CPU reads K/V in the model's dtype only: refused for another."""
        if self.kv_dtype != self.layout.dtype and self.layout.device.type != "cpu":
            raise self.refusal(f"run a compiled decode step on {self.layout.device.type} with kv_dtype "
                               f"{str(self.kv_dtype).removeprefix('torch.')}",
                               "its GPU kernels read K/V in the model's dtype; decode with compile=false")


def scale_bytes(layout: CacheLayout, kv_dtype: str) -> int:
    """fp8's scales: one fp32 per layer, kv head, K and V (none for another dtype)."""
    return 2 * layout.n_layers * layout.n_kv_heads * 4 if kv_dtype == "float8_e4m3" else 0


class DenseCache(StoredKV, KVCache):
    """One [B, Hkv, capacity, D] K and V buffer per layer; slot p holds position p."""

    serves_row_subsets = True  # a row is its own slice of every buffer

    @classmethod
    def planned_bytes(cls, layout: CacheLayout, batch_size: int, capacity: int, kv_dtype: str = "auto",
                      **options) -> int:
        """The buffers at the storage dtype (fp8: plus one fp32 scale per layer, head, K and V);
        a subclass's other options do not change them."""
        raise_if(kv_dtype_problems(kv_dtype))
        return batch_size * capacity * stored_token_bytes(layout, kv_dtype) + scale_bytes(layout, kv_dtype)

    def __init__(self, layout: CacheLayout, batch_size: int, capacity: int, kv_dtype: str = "auto"):
        raise_if(kv_dtype_problems(kv_dtype))
        super().__init__(layout, batch_size, capacity)
        self._storage(kv_dtype)
        shape = (batch_size, layout.n_kv_heads, capacity, layout.head_dim)
        kw = dict(dtype=self.kv_dtype, device=layout.device)
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
        if self.kv_dtype != k.dtype:
            k, v = self._stored(layer, k, v)
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
        if self.native_read and plan.tree is None and q.shape[2] <= DECODE_QUERIES:
            return self._attend_native(layer, q, plan)
        sp = plan.spans[self.layout.windows[layer]]
        keys, values = self._held(self.k[layer], sp.lo, sp.hi, plan), self._held(self.v[layer], sp.lo, sp.hi, plan)
        keys, values = self._readable(layer, keys, values)
        return reference_attention(q, keys, values, sp.mask, self.layout.softmax_scale, self.layout.softcap,
                                   sp.causal)

    def _attend_native(self, layer: int, q: torch.Tensor, plan: DensePlan) -> torch.Tensor:
        """A decode-sized forward over K/V stored in another dtype (or of a model that shares
        its compiled step's kernels, `CacheLayout.native_decode`): decodelab's native kernel
        reads each query's slots in place (models/native.py `decode_attention`)."""
        from decodelab.models import native

        if plan.rows_slice is not None:
            rows = lambda t: t[plan.rows_slice]  # noqa: E731 (a view)
        else:  # rows picked out of the buffers, a copy: only the slots up to the latest query's
            hi = int(plan.positions.max()) + 1
            rows = lambda t: t[:, :, :hi].index_select(0, plan.dev_rows[:, 0])  # noqa: E731
        return native.decode_attention(q, rows(self.k[layer]), rows(self.v[layer]), plan.dev_positions,
                                       self.layout.softmax_scale, self.layout.windows[layer], *self._scales(layer))

    def _attend_static(self, layer, q, k, v, plan: StaticPlan):
        """The compiled step: the row-major buffers in place on a CPU (traced with the model),
        the buffers read as block pools by the paged kernel on CUDA."""
        if plan.traced:
            scales = self._scales(layer) if self.fp8 else None
            return plan.attend_rows(layer, q, k, v, self.k[layer], self.v[layer], scales)
        return plan.attend_pools(layer, q, k, v)

    def _move_slots(self, row: int, src: list[int], dst: list[int]) -> None:
        """Slots are positions: copy each layer's slots src -> dst of the row."""
        s, d = (torch.tensor(x, device=self.layout.device) for x in (src, dst))
        for t in self.k + self.v:  # [B, Hkv, S, D]
            t[row, :, d] = t[row, :, s]

    def read(self, layer, row):
        """Positions [n], k and v [Hkv, n, D]: the row's slots [0, n)."""
        n = int(self.lengths[row])
        k, v = self._readable(layer, self.k[layer][row:row + 1, :, :n], self.v[layer][row:row + 1, :, :n])
        return torch.arange(n), k[0], v[0]

    def nbytes(self) -> int:
        """The preallocated buffers: K and V, every layer, every row, the whole capacity."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    # -- capabilities (cache/base.py) ----------------------------------------------
    def static_view(self) -> StaticView:
        """Each layer's [B, Hkv, S, D] buffer read as a pool of blocks of its own rows (a
        strided view, no copy) with a fixed identity block table; blocks of
        gcd(capacity, 64) slots. Refused off a CPU for K/V stored in another dtype than
        the model's (the GPU kernels read the model's dtype)."""
        self._compiled_dtype_refusal()
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
            if t.dtype == torch.float8_e4m3fn:  # drawn in fp32, stored at scale 1
                t[:, :, :n_tokens] = torch.randn(t[:, :, :n_tokens].shape, generator=g, device=t.device).to(t.dtype)
            else:
                t[:, :, :n_tokens].normal_(generator=g)
        if self.fp8:
            self.scaled = [True] * self.layout.n_layers  # the scales (1) are those of what is held
