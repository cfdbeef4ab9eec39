"""`sliding`: a ring buffer of window + rollback slots per row for windowed layers.

A layer with a window w only ever attends to the w most recent positions (plus the
first `sinks` positions when sinks are imposed), so it keeps a ring of R = w + rollback
slots per row: position p >= sinks lives in slot sinks + (p - sinks) % R, and
positions below `sinks` in slots [0, sinks). The `rollback` extra slots keep the
window the next query needs after a speculative rollback of up to `rollback` tokens.
Layers without a window keep full storage and attend exactly as `dense` does.

On a model with its own windows (Gemma 3's local layers) results are exact. On a
model with none, the `window` option imposes one on every layer (StreamingLLM style,
with `sinks`): an approximation, declared by `approximate` and `label`.

Per forward, `plan` decides how the ring layers write:
- write first (every token valid and each row spanning <= rollback + 1 positions:
  decode and speculative verification): write the new K/V, then read the ring alone,
  which then still holds every key the earliest query needs;
- read first (prefill, chunks, padding): read from the old ring and the new K/V, then
  write; a chunk longer than the ring would otherwise overwrite keys its early queries need.
Either way attention gets exactly the keys `dense` would: positions [lo, hi) in order
(lo = min query - window + 1, hi = max query + 1, the first `sinks` positions before
them), gathered from the ring and the new K/V, with dense's mask or causal fast path.
Identical SDPA inputs make the result agree with dense bit for bit, not just to float
rounding. Positions a row does not hold are filled with whatever finite slot they map
to; the window masks them for every real query. Padding is never written to a ring,
since it would evict tokens the row still needs (it is read from the new K/V, so a
padding query sees its own key and stays finite, as in dense).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from decodelab.cache.base import CacheLayout, KVCache, attention_mask, extend, is_plain_causal, reference_attention
from decodelab.cache.dense import DenseCache, DensePlan
from decodelab.cache.static import StaticPlan
from decodelab.cache.tree import Tree, tree_visible
from decodelab.models.errors import SetupError, raise_if


# -- sizing (shared by the cache and the memory report) ---------------------------------
def imposed_windows(layout: CacheLayout, window: int | None) -> tuple[int | None, ...]:
    """Per-layer windows the backend applies: the model's own, or `window` on every
    layer of a model that has none."""
    if window is None or any(w is not None for w in layout.windows):
        return layout.windows
    return (window,) * layout.n_layers


def ring_size(window: int, rollback: int, sinks: int, capacity: int) -> int:
    """Ring slots R of a windowed layer: window + rollback, but never more than the
    positions a row can reach past its sinks (a ring that never wraps needs no more)."""
    return max(1, min(window + rollback, capacity - min(sinks, capacity)))


def layer_slots(windows: tuple[int | None, ...], capacity: int, rollback: int, sinks: int) -> list[int]:
    """K/V slots per row of each layer: the sinks plus the ring for windowed layers,
    `capacity` for full layers."""
    return [capacity if w is None else min(sinks, capacity) + ring_size(w, rollback, sinks, capacity)
            for w in windows]


def sliding_memory(layout: CacheLayout, context: int, rollback: int = 8, window: int | None = None,
                   sinks: int = 0) -> dict:
    """Stored vs dense K/V bytes of one row holding `context` tokens, from shapes alone:
    per-layer stored tokens, both byte counts and their ratio (stored / dense)."""
    tokens = layer_slots(imposed_windows(layout, window), context, rollback, sinks)
    per_layer_token = layout.bytes_per_token() // layout.n_layers  # K and V of one token, one layer
    stored, dense = sum(tokens) * per_layer_token, layout.n_layers * context * per_layer_token
    return {"context": context, "tokens_per_layer": tokens, "stored_bytes": stored, "dense_bytes": dense,
            "ratio": stored / dense}


def problems(layout: CacheLayout, rollback: int, window: int | None, sinks: int) -> list[str]:
    """Every reason these options cannot work on this layout (empty when they can)."""
    p = []
    if rollback < 0:
        p.append(f"rollback must be >= 0 tokens, got {rollback}")
    if window is not None and window < 1:
        p.append(f"window must be >= 1 token (or null: the model's own windows), got {window}")
    if sinks < 0:
        p.append(f"sinks must be >= 0, got {sinks}")
    if window is not None and sinks >= max(window, 1):
        p.append(f"sinks ({sinks}) must be fewer than the window ({window}): sinks sit inside it")
    own = sorted({w for w in layout.windows if w is not None})
    if window is not None and own:
        p.append(f"the model has its own sliding windows {own}; the `window` option imposes one only on "
                 "models without windows (it would change an exact model): drop it")
    if window is None and sinks > 0:
        p.append(f"sinks ({sinks}) need an imposed `window` on a model without windows; a model's own "
                 "windows are exact and get no sinks")
    return p


# -- masks and slots ---------------------------------------------------------------------
def window_mask(qpos: torch.Tensor, kpos: torch.Tensor, window: int | None, sinks: int = 0) -> torch.Tensor | None:
    """`attention_mask` [B, 1, T, S] (or None) plus attention sinks: keys at positions
    below `sinks` stay visible to every later query."""
    mask = attention_mask(qpos, kpos, window)
    if not sinks or mask is None:
        return mask
    sink = attention_mask(qpos, kpos.masked_fill(kpos >= sinks, -1), None)  # causal over sinks only
    return None if sink is None else mask | sink


def ring_slot(pos: torch.Tensor, ring: int, sinks: int) -> torch.Tensor:
    """Slot of each position: p below `sinks` in slot p, later ones around the ring."""
    return torch.where(pos < sinks, pos, sinks + (pos - sinks) % ring)


@dataclass(frozen=True)
class RingPlan:
    """How one ring size's layers write in a forward."""

    rows: torch.Tensor  # [N] row of the forward of each token written (device)
    cols: torch.Tensor  # [N] its index t in the forward (device)
    slots: torch.Tensor  # [N] its slot (device)
    dst: torch.Tensor  # [N] the cache row it is written to (device)
    was_empty: bool  # the forward's rows held nothing in the ring before this forward


@dataclass(frozen=True)
class RingRead:
    """Keys one (ring, window) pair's layers read in a forward: S keys per row,
    in position order, taken from a source [B, Hkv, N, D] (the ring, the new K/V, or
    their concatenation along dim 2)."""

    source: str  # "ring", "new" or "both"
    keys: int  # S
    start: int | None  # keys are source[:, :, start:start + S] (a view), or None: gather
    gather: torch.Tensor | None  # [B * Hkv * S] rows of the flattened source (device)
    mask: torch.Tensor | None  # [B, 1, T, S] (device), None: all True or causal
    causal: bool  # the square lower triangle over the new K/V (SDPA's is_causal)


@dataclass(frozen=True)
class SlidingPlan(DensePlan):
    """A sliding forward: dense's plan for the full layers, and per ring how it writes and
    per (ring, window) what it reads."""

    write_first: bool  # ring layers write the new K/V before reading (decode, verification)
    rings: dict  # ring size -> RingPlan
    ring_reads: dict  # (ring size, window) -> RingRead


class SlidingCache(DenseCache):
    """Ring buffers for windowed layers, dense storage (and attention) for full layers."""

    approximate: bool = False
    label: str = "sliding"
    serves_row_subsets = True  # a row is its own ring slots (and dense rows for full layers)

    @classmethod
    def planned_bytes(cls, layout: CacheLayout, batch_size: int, capacity: int, rollback: int = 8,
                      window: int | None = None, sinks: int = 0) -> int:
        """The buffers the constructor allocates: `layer_slots` per row and layer (sinks +
        ring for windowed layers, capacity for full ones), K and V, every row."""
        raise_if(problems(layout, rollback, window, sinks))
        slots = sum(layer_slots(imposed_windows(layout, window), capacity, rollback, sinks))
        return batch_size * slots * (layout.bytes_per_token() // layout.n_layers)

    def __init__(self, layout: CacheLayout, batch_size: int, capacity: int, rollback: int = 8,
                 window: int | None = None, sinks: int = 0):
        reasons = problems(layout, rollback, window, sinks)
        try:  # skips DenseCache.__init__: storage differs per layer (always in the model's dtype)
            KVCache.__init__(self, layout, batch_size, capacity)
        except SetupError as e:
            reasons = e.reasons + reasons
        raise_if(reasons)
        self._storage("auto")
        self.rollback, self.sink_tokens = rollback, sinks
        self._windows = imposed_windows(layout, window)  # per layer: applied window or None
        self._rings = [None if w is None else ring_size(w, rollback, sinks, capacity) for w in self._windows]
        self.rollback_limit = rollback if any(r is not None for r in self._rings) else math.inf
        self.approximate = self._windows != layout.windows
        self.label = self._describe(window)
        self._allocate(layer_slots(self._windows, capacity, rollback, sinks))
        # per ring size: position held by each slot of each row, -1 = empty
        self.slot_pos = {r: torch.full((batch_size, min(sinks, capacity) + r), -1, dtype=torch.long)
                         for r in set(self._rings) - {None}}  # [B, slots] each
        self._high = torch.zeros(batch_size, dtype=torch.long)  # [B] furthest length written

    def _allocate(self, slots: list[int]) -> None:
        lay, kw = self.layout, dict(dtype=self.layout.dtype, device=self.layout.device)
        self.k = [torch.zeros(self.batch_size, lay.n_kv_heads, s, lay.head_dim, **kw) for s in slots]  # [B, Hkv, S, D]
        self.v = [torch.zeros(self.batch_size, lay.n_kv_heads, s, lay.head_dim, **kw) for s in slots]

    def _describe(self, window: int | None) -> str:
        rings = sum(r is not None for r in self._rings)
        if self.approximate:
            return (f"sliding(window={window}, sinks={self.sink_tokens}, rollback={self.rollback}) "
                    "APPROXIMATE: the model has no windows")
        if not rings:
            return "sliding: the model has no windows and no `window` option; stores every token like dense"
        own = sorted({w for w in self._windows if w is not None})
        return (f"sliding(rollback={self.rollback}) exact: rings of window + rollback on {rings} of "
                f"{self.layout.n_layers} layers (windows {own}), full storage on the rest")

    def window(self, layer: int) -> int | None:
        """The window applied to a layer: the model's own, or the imposed one."""
        return self._windows[layer]

    # -- called by the model ---------------------------------------------------------
    def plan(self, positions: torch.Tensor, valid: torch.Tensor | None = None, rows=None,
             parents=None) -> SlidingPlan:
        """Book a forward: advance each ring's slot positions and plan its writes and the
        keys its layers read (dense's plan for the full layers)."""
        before = self.lengths
        base = super().plan(positions, valid, rows, parents)
        pos = base.positions  # [B, T]
        write_first, rings = self._book_rings(base, before)
        pairs = {(r, w) for r, w in zip(self._rings, self._windows) if r is not None}
        reads = {(r, w): self._read(pos, r, w, write_first, rings[r].was_empty, base.tree) for r, w in sorted(pairs)}
        return extend(base, SlidingPlan, write_first=write_first, rings=rings, ring_reads=reads)

    def book(self, positions: torch.Tensor) -> None:
        """The host bookkeeping alone (lengths, ring slot positions), for a compiled step."""
        before = self.lengths
        self._book_rings(KVCache.plan(self, positions), before)

    def _book_rings(self, base, before: torch.Tensor) -> tuple[bool, dict]:
        """Refuse a rewind past the rings, advance each ring's slot positions of the rows the
        forward feeds; whether its ring layers write first, and each ring's `RingPlan`."""
        pos, ok = base.positions, base.valid  # [B, T] each
        first = torch.where(ok, pos, self.capacity).min(1).values  # [B] a row replaces what it held from here
        last = torch.where(ok, pos, -1).max(1).values  # [B]
        fed = base.cache_rows(self.batch_size)  # [b] the cache rows of the forward
        self._refuse_rewind(first, before, fed)
        self._high = torch.maximum(self._high, self.lengths)
        span = int((pos.max(1).values - pos.min(1).values).max())
        write_first = bool(ok.all()) and span <= self.rollback
        return write_first, {r: self._ring_plan(sp, fed, r, pos, ok, first, last) for r, sp in self.slot_pos.items()}

    def _dense_windows(self) -> set:
        """Only the layers without a ring attend densely (window None)."""
        return {None} if any(r is None for r in self._rings) else set()

    def _refuse_rewind(self, first: torch.Tensor, before: torch.Tensor, fed: torch.Tensor) -> None:
        """A forward may start at most `rollback` below the furthest length a row has
        reached: older keys its queries would need are overwritten (lengths restored)."""
        if bool((self._high[fed] - first > self.rollback_limit).any()):
            self.lengths = before
            raise SetupError(f"a forward from positions {first.tolist()} rewrites more than rollback_limit "
                             f"({self.rollback_limit}) tokens below the furthest lengths written "
                             f"{self._high[fed].tolist()}: the ring has overwritten keys it would need")

    def _ring_plan(self, sp: torch.Tensor, fed: torch.Tensor, ring: int, pos, ok, first, last) -> RingPlan:
        """Update one ring's slot positions sp [B, slots] of the forward's rows `fed` [b]
        and plan its writes."""
        mine = sp[fed]  # [b, slots]
        mine.masked_fill_(mine >= first[:, None], -1)
        was_empty = bool((mine < 0).all())
        # the last R valid tokens of each row (plus its sinks) get distinct slots
        keep = ok & ((pos < self.sink_tokens) | (pos > last[:, None] - ring))  # [b, T]
        rows, cols = keep.nonzero(as_tuple=True)  # [N] each
        slots = ring_slot(pos[rows, cols], ring, self.sink_tokens)  # [N]
        mine[rows, slots] = pos[rows, cols]
        sp[fed] = mine
        dev = self.layout.device
        return RingPlan(rows.to(dev), cols.to(dev), slots.to(dev), fed[rows].to(dev), was_empty)

    def _read(self, q: torch.Tensor, ring: int, window: int, write_first: bool, was_empty: bool,
              tree: Tree | None = None) -> RingRead:
        """The keys a (ring, window) pair reads in a forward of queries at slots q [B, T]:
        dense's span [lo, hi) (after the sinks below lo), each position taken from the new
        K/V when this forward feeds it, else from its ring slot; dense's mask, or its causal
        fast path (a tree's queries: from their own positions, seeing their ancestors)."""
        B, T = q.shape
        first = int(q.min() if tree is None else tree.positions.min())
        lo, hi = max(0, first - window + 1), int(q.max()) + 1
        lead = min(self.sink_tokens, lo)  # sinks below the span
        kpos = torch.cat([torch.arange(lead), torch.arange(lo, hi)]).expand(B, -1)  # [B, S]
        S = kpos.shape[1]
        if tree is None and is_plain_causal(q, kpos, window):  # the keys are exactly the new tokens
            return RingRead("new", S, 0, None, None, True)
        mask = (window_mask(q, kpos, window, self.sink_tokens) if tree is None
                else tree_visible(tree, kpos, window, self.sink_tokens)[:, None])
        slots = ring_slot(kpos, ring, self.sink_tokens)  # [B, S]
        held = self.slot_pos[ring].shape[1]  # sinks + ring slots
        if write_first:  # the ring already holds the new tokens
            source, index, n = "ring", slots, held
        else:  # t of the new token at each key position, -1 = none
            fed = torch.full((B, S), -1, dtype=torch.long)
            fed.scatter_(1, q - lo + lead, torch.arange(T).expand(B, -1))
            if was_empty:  # nothing to read in the ring: unheld keys read any new one
                source, index, n = "new", fed.clamp(min=0), T
            else:
                source, index, n = "both", torch.where(fed >= 0, held + fed, slots), held + T
        start = int(index[0, 0])
        run = start + S <= n and bool((index == start + torch.arange(S)).all())
        gather = None
        if not run:  # rows of the source flattened to [B * Hkv * N, D], in [B, Hkv, S] order
            bh = torch.arange(B * self.layout.n_kv_heads).view(B, -1, 1)  # [B, Hkv, 1]
            gather = (bh * n + index[:, None]).reshape(-1).to(self.layout.device)
        dev_mask = None if mask is None else mask.to(self.layout.device)
        return RingRead(source, S, start if run else None, gather, dev_mask, False)

    def _ring_write(self, layer: int, plan: RingPlan, k: torch.Tensor, v: torch.Tensor) -> None:
        # [N] cache rows and slots around a slice: values laid out [N, Hkv, D]
        self.k[layer][plan.dst, :, plan.slots] = k[plan.rows, :, plan.cols]
        self.v[layer][plan.dst, :, plan.slots] = v[plan.rows, :, plan.cols]

    def _keys(self, r: RingRead, layer: int, new: torch.Tensor, ring: torch.Tensor) -> torch.Tensor:
        """The [B, Hkv, S, D] keys (or values) `r` reads from a layer's ring and new K/V."""
        if r.source == "both":
            src = torch.cat([ring, new], 2)  # [B, Hkv, slots + T, D]
        else:
            src = ring if r.source == "ring" else new
        if r.start is not None:
            return src[:, :, r.start:r.start + r.keys]
        B, H, _, D = src.shape
        return src.reshape(-1, D).index_select(0, r.gather).view(B, H, r.keys, D)

    def attend(self, layer, q, k, v, plan: SlidingPlan):
        """Store k, v [B, Hkv, T, D] and return attention of q [B, Hq, T, D] over the
        row's visible keys (ring layers: dense's span, gathered from the ring and k, v)."""
        ring = self._rings[layer]
        if isinstance(plan, StaticPlan):
            return plan.call(self._attend_static, layer, q, k, v, plan)
        if ring is None:
            return super().attend(layer, q, k, v, plan)
        writes, r = plan.rings[ring], plan.ring_reads[ring, self._windows[layer]]
        if plan.write_first:
            self._ring_write(layer, writes, k, v)
        keys = self._keys(r, layer, k, self._held(self.k[layer], 0, None, plan))  # the forward's rows' rings
        values = self._keys(r, layer, v, self._held(self.v[layer], 0, None, plan))
        out = reference_attention(q, keys, values, r.mask, self.layout.softmax_scale, self.layout.softcap,
                                  r.causal)
        if not plan.write_first:
            self._ring_write(layer, writes, k, v)
        return out

    def _attend_static(self, layer, q, k, v, plan: StaticPlan):
        """The compiled step: a ring layer over its ring, by the positions its slots hold; a
        full layer over its row-major buffer, as dense on a CPU."""
        ring = self._rings[layer]
        if ring is None:
            return plan.attend_rows(layer, q, k, v, self.k[layer], self.v[layer])
        return plan.attend_ring(ring, self._windows[layer], q, k, v, self.k[layer], self.v[layer])

    def _move_slots(self, row: int, src: list[int], dst: list[int]) -> None:
        """Copy positions src -> dst of a row: full layers by slot = position, ring layers
        between the ring slots of those positions (a tree spans at most rollback + 1
        slots, so they are distinct), whose slot positions now read dst."""
        s, d = torch.tensor(src), torch.tensor(dst)
        dev = self.layout.device
        for layer, ring in enumerate(self._rings):
            a, b = (s, d) if ring is None else (ring_slot(x, ring, self.sink_tokens) for x in (s, d))
            for t in (self.k[layer], self.v[layer]):  # [B, Hkv, slots, D]
                t[row, :, b.to(dev)] = t[row, :, a.to(dev)]
        for ring, sp in self.slot_pos.items():
            sp[row, ring_slot(d, ring, self.sink_tokens)] = d

    def read(self, layer, row):
        """Positions [N], k, v [Hkv, N, D] a row holds now (ring layers: the filled
        sinks and ring slots), in position order."""
        ring = self._rings[layer]
        if ring is None:
            return super().read(layer, row)
        sp = self.slot_pos[ring][row]  # [slots]
        filled = (sp >= 0).nonzero().flatten()  # [N]
        order = filled[sp[filled].argsort()]  # [N] slots in position order
        idx = order.to(self.layout.device)
        return sp[order], self.k[layer][row, :, idx], self.v[layer][row, :, idx]

    # -- called by decoders ------------------------------------------------------------
    def truncate(self, lengths) -> None:
        """Roll rows back to `lengths` [B]: at most `rollback` below the furthest length
        each row has reached since the last reset (older keys are overwritten)."""
        new = torch.as_tensor(lengths, dtype=torch.long).cpu().reshape(-1)
        if new.shape == self._high.shape and bool((self._high - new > self.rollback_limit).any()):
            raise SetupError(f"truncate to {new.tolist()} reaches {(self._high - new).max()} tokens below the "
                             f"furthest lengths written {self._high.tolist()}; this cache's rollback_limit is "
                             f"{self.rollback_limit}: the ring has overwritten the keys that would need")
        super().truncate(new)
        for sp in self.slot_pos.values():
            sp.masked_fill_(sp >= self.lengths[:, None], -1)

    def release(self, row: int) -> None:
        """Forget one row (its ring slots hold nothing; storage is kept for the next)."""
        super().release(row)
        self._high[row] = 0
        for sp in self.slot_pos.values():
            sp[row] = -1

    def row_bytes(self, tokens: int) -> int:
        """K/V bytes a row of `tokens` tokens holds: at most sinks + ring slots in a windowed
        layer, every token in a full one (`sliding_memory`'s stored bytes)."""
        per_layer_token = self.layout.bytes_per_token() // self.layout.n_layers
        return sum(min(tokens, t.shape[2]) for t in self.k) * per_layer_token

    def reset(self) -> None:
        """Forget every row (storage is kept for reuse)."""
        super().reset()
        self._high.zero_()
        for sp in self.slot_pos.values():
            sp.fill_(-1)

    # -- capabilities (cache/base.py) ------------------------------------------------
    def static_plan(self, tokens: int = 1, impl: str = "auto") -> StaticPlan:
        """The compiled step's plan: rings read by the positions their slots hold (the
        cache's own slot positions, which `plan` books before each step), full layers as
        dense. A step writes its tokens before attending, so it spans at most rollback + 1
        positions (older keys its first query needs would be overwritten)."""
        if all(r is None for r in self._rings):
            return super().static_plan(tokens, impl)
        if tokens > self.rollback + 1:
            raise self.refusal(f"run a compiled step of {tokens} tokens per row",
                               f"its rings keep rollback + 1 = {self.rollback + 1} positions beyond the window; "
                               f"build it with rollback >= {tokens - 1}")
        return StaticPlan(self.layout, self.batch_size, self.capacity, tokens, impl, rings=self.slot_pos,
                          sinks=self.sink_tokens)

    def static_view(self):
        """Dense's view when no layer has a ring (every layer is full storage); else refused."""
        if all(r is None for r in self._rings):
            return super().static_view()
        raise self.refusal("give a fixed-shape view for the static decode step",
                           "sliding plans its ring writes and reads on the host each step (which slot holds "
                           "which position moves with the window)")

    def fill_random(self, n_tokens: int, seed: int = 0) -> None:
        """Forget every row, then give each positions [0, n_tokens) and draw every layer's
        storage (no attention runs). Only what a ring can still hold is planned: the sinks,
        then the last ring + 1 positions, in chunks of 256 so that each ring read's mask
        stays [B, 1, 256, window + 256]; full layers hold every position, as in dense."""
        self.reset()
        ring = max((r for r in self._rings if r is not None), default=None)
        start = 0 if ring is None else max(0, n_tokens - ring - 1)
        start = 0 if start <= self.sink_tokens else start
        spans = [(0, self.sink_tokens)] if start and self.sink_tokens else []
        spans += [(s, min(s + 256, n_tokens)) for s in range(start, n_tokens, 256)]
        for lo, hi in spans:
            self.plan(torch.arange(lo, hi).expand(self.batch_size, -1))
        g = torch.Generator(device=self.layout.device).manual_seed(seed)
        for t in self.k + self.v:  # [B, Hkv, slots, D]
            t.normal_(generator=g)

    def memory_report(self) -> dict:
        """The shared report plus this setup's label (exact or APPROXIMATE)."""
        return {**super().memory_report(), "kv_label": self.label}
