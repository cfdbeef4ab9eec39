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

Per forward, `prepare` decides how the ring layers attend:
- write first (every token valid and each row spanning <= rollback + 1 positions:
  decode and speculative verification): write the new K/V, then attend over the ring
  alone, which then still holds every key the earliest query needs;
- concat (prefill, chunks, padding): attend over concat(old ring, new K/V), then write;
  a chunk longer than the ring would otherwise overwrite keys its early queries need.
Padding is never written to a ring, since it would evict tokens the row still needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cache.base import CacheLayout, KVCache, attention_mask, is_plain_causal, reference_attention
from cache.dense import DenseCache
from models.errors import SetupError, raise_if


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


@dataclass
class RingPlan:
    """How one ring size's layers write and read in the current forward."""

    rows: torch.Tensor  # [N] row of each token written (device)
    cols: torch.Tensor  # [N] its index t in the forward (device)
    slots: torch.Tensor  # [N] its slot (device)
    kpos: torch.Tensor  # [B, S] positions of the keys attention reads, -1 = none (CPU)
    read_ring: bool  # keys include the ring (False: concat mode over an empty ring)


class SlidingCache(DenseCache):
    """Ring buffers for windowed layers, dense storage (and attention) for full layers."""

    approximate: bool = False
    label: str = "sliding"

    def __init__(self, layout: CacheLayout, batch_size: int, capacity: int, rollback: int = 8,
                 window: int | None = None, sinks: int = 0):
        reasons = problems(layout, rollback, window, sinks)
        try:  # skips DenseCache.__init__: storage differs per layer
            KVCache.__init__(self, layout, batch_size, capacity)
        except SetupError as e:
            reasons = e.reasons + reasons
        raise_if(reasons)
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
    def prepare(self, positions: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Start a forward: plan each ring's writes and the keys its layers read."""
        before = self.lengths
        super().prepare(positions, valid)
        pos, ok = self._qpos, self._valid  # [B, T] each
        first = torch.where(ok, pos, self.capacity).min(1).values  # [B] a row replaces what it held from here
        last = torch.where(ok, pos, -1).max(1).values  # [B]
        self._refuse_rewind(first, before)
        self._high = torch.maximum(self._high, self.lengths)
        span = int((pos.max(1).values - pos.min(1).values).max())
        self._write_first = bool(ok.all()) and span <= self.rollback
        self._plans = {r: self._plan(sp, r, pos, ok, first, last) for r, sp in self.slot_pos.items()}

    def _refuse_rewind(self, first: torch.Tensor, before: torch.Tensor) -> None:
        """A forward may start at most `rollback` below the furthest length a row has
        reached: older keys its queries would need are overwritten (lengths restored)."""
        if bool((self._high - first > self.rollback_limit).any()):
            self.lengths = before
            raise SetupError(f"a forward from positions {first.tolist()} rewrites more than rollback_limit "
                             f"({self.rollback_limit}) tokens below the furthest lengths written "
                             f"{self._high.tolist()}: the ring has overwritten keys it would need")

    def _plan(self, sp: torch.Tensor, ring: int, pos, ok, first, last) -> RingPlan:
        """Update one ring's slot positions for this forward and plan its writes."""
        sp.masked_fill_(sp >= first[:, None], -1)
        old = None if self._write_first else sp.clone()  # [B, slots] before this forward
        # the last R valid tokens of each row (plus its sinks) get distinct slots
        keep = ok & ((pos < self.sink_tokens) | (pos > last[:, None] - ring))  # [B, T]
        rows, cols = keep.nonzero(as_tuple=True)  # [N] each
        slots = ring_slot(pos[rows, cols], ring, self.sink_tokens)  # [N]
        sp[rows, slots] = pos[rows, cols]
        if self._write_first:
            kpos, read_ring = sp.clone(), True
        else:  # padding keys get -1: real queries never see them
            new = torch.where(ok, pos, -1)  # [B, T]
            read_ring = bool((old >= 0).any())
            kpos = torch.cat([old, new], 1) if read_ring else new
        dev = self.layout.device
        return RingPlan(rows.to(dev), cols.to(dev), slots.to(dev), kpos, read_ring)

    def _ring_mask(self, ring: int, window: int) -> tuple[torch.Tensor | None, bool]:
        """Mask over a ring's keys for this forward and whether it is the plain causal
        triangle (memoized per ring and window)."""
        key = ("ring", ring, window)
        if key not in self._masks:
            plan, q = self._plans[ring], self._qpos
            if not plan.read_ring and bool(self._valid.all()) and is_plain_causal(q, plan.kpos, window):
                self._masks[key] = (None, True)
            else:
                mask = window_mask(q, plan.kpos, window, self.sink_tokens)
                if mask is not None and not self._write_first and not bool(self._valid.all()):
                    # padding queries see their own key, so their (ignored) outputs stay finite
                    T = q.shape[1]
                    mask[..., -T:] |= torch.eye(T, dtype=torch.bool)
                self._masks[key] = (None if mask is None else mask.to(self.layout.device), False)
        return self._masks[key]

    def _ring_write(self, layer: int, plan: RingPlan, k: torch.Tensor, v: torch.Tensor) -> None:
        # [N] rows and slots around a slice: values laid out [N, Hkv, D]
        self.k[layer][plan.rows, :, plan.slots] = k[plan.rows, :, plan.cols]
        self.v[layer][plan.rows, :, plan.slots] = v[plan.rows, :, plan.cols]

    def attend(self, layer, q, k, v, positions):
        """Store k, v [B, Hkv, T, D] and return attention of q [B, Hq, T, D] over the
        row's visible keys (ring layers: the ring and the new tokens)."""
        ring = self._rings[layer]
        if ring is None:
            return super().attend(layer, q, k, v, positions)
        plan = self._plans[ring]
        mask, causal = self._ring_mask(ring, self._windows[layer])
        if self._write_first:
            self._ring_write(layer, plan, k, v)
            keys, values = self.k[layer], self.v[layer]  # [B, Hkv, slots, D]
        elif plan.read_ring:
            keys, values = torch.cat([self.k[layer], k], 2), torch.cat([self.v[layer], v], 2)  # [B, Hkv, slots+T, D]
        else:
            keys, values = k, v
        out = reference_attention(q, keys, values, mask, self.layout.softmax_scale, self.layout.softcap, causal)
        if not self._write_first:
            self._ring_write(layer, plan, k, v)
        return out

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

    def reset(self) -> None:
        """Forget every row (storage is kept for reuse)."""
        super().reset()
        self._high.zero_()
        for sp in self.slot_pos.values():
            sp.fill_(-1)

    def memory_report(self) -> dict:
        """The shared report plus this setup's label (exact or APPROXIMATE)."""
        return {**super().memory_report(), "kv_label": self.label}
