"""`int4`: KIVI-style quantized K/V (optimum-quanto qint4 / qint2) behind a full-precision
residual window, with a visibility rule that depends on positions only.

Blocks. Position p of a row lies in block j = p // F (F = `flush` tokens, a multiple of
a per-channel group). A block is quantized as a whole and from its own K/V only (the
codec, cache/int4_codec.py: keys per channel, values per token by default, the KIVI
axes), so re-quantizing the same values after a rollback gives the same bytes.

The visibility rule. A query at position q sees block j dequantized iff
    (j + 1) * F + residual <= q + 1,
and in full precision otherwise. Equivalently it sees [0, V(q)) dequantized and [V(q), q]
exact, with V(q) = max(0, floor((q + 1 - residual) / F)) * F (`quantized_prefix`): its
newest `residual` positions (itself included), plus up to F - 1 older ones, are always
exact. This is what one-token-at-a-time decoding does when a block is quantized as soon
as the row's length reaches (j + 1) * F + residual, before that token's attention.
Because V depends on the query's position alone, never on how a forward was split, a
verify forward over gamma + 1 positions, a long prefill, a chunked prefill and single
steps give every query the same version of every key. So greedy speculative decoding is
token-identical to plain greedy on this backend, and for the same K/V a one-pass prefill,
chunks and single tokens give the same attention outputs up to float summation order
and, for a single-token step on a CPU (the native kernel), the int16 rounding of the
query it scores the quantized keys with (cache/kernels/int4.py `int16_key_scores`; within
2e-4 of the rule in tests/cache/test_int4.py, where reading another version moves an output
by more than 1e-2). Inside a model, a batched forward's K/V can
differ from single-token ones by float rounding (~1e-6; dense shows it too, ~6e-7 in
the logits), and quantization, being discontinuous, may round one code or one fp16
scale the other way for such a value; the logits then differ by about that one step
(measured 4e-4 on tiny_gemma at 80 tokens, none on tiny_llama) - the same kind of
near-tie risk plain greedy already takes between two float-rounding-different runs.

Storage, per layer and row (the counts Qs = `quantized_len` and P0 = `exact_start` are
per row [B], the same in every layer; the codec is cache/int4_codec.py):
- the quantized store (`key_codes`, `value_codes`) holds blocks [0, Qs): quanto's packed
  codes, scales and shifts, one growing tensor each (never a list of blocks); scales and
  shifts in `scale_dtype` (fp16 by default: fp32 ones alone would cost 1/16 of a bf16
  cache at group 64);
- the exact store (`key_exact`, `value_exact`, [Hkv, len - P0, D]) holds positions
  [P0, len) in the layout's dtype, P0 <= Qs, both multiples of F. Blocks [P0, Qs) are
  held in both forms (counted by `nbytes`). Each is a view of a buffer with room for up to
  a sixteenth more tokens (`_exact_capacity`) that new tokens are written into in place, and a flush
  advances the view's start; only when the end reaches the buffer's are they copied into
  a fresh one (every 8 to 12 decode steps, instead of a copy of the whole store at
  every token).
Padding is never stored; rows may hold different lengths.

One forward (all of it planned once, in `plan`, the value every layer's `attend` reads):
1. store: append the row's new K/V to its exact store, then quantize the blocks its
   latest query sees quantized and the store lacks: Qs <- max(Qs, V(len - 1)).
2. attend: keys = [dequantized positions [dequant_from, dequant_to) ..., exact positions
   [exact_from, exact_to) ...] per row (a `View`: dequant_from is the window's first
   aligned group, dequant_to = V(last query), exact_from = the smallest V(q) of the
   queries, exact_to = last query + 1), with a per-query mask that picks exactly one version of every position:
   the dequantized one iff p < V(q). A forward of more than `attention_chunk` queries (a
   long prefill) does this per chunk of queries, so each chunk reads only the keys it
   needs. Nothing dequantized is kept between calls (no fp mirror: that would give the
   memory back). A decode-sized forward instead runs a kernel of cache/kernels/int4.py
   that reads the codes in place (the same rule): `impl: triton` (the default on CUDA) or
   `impl: native`, decodelab's CPU kernel (the default on a CPU where it serves: 4-bit, the
   KIVI axes, fp32).
3. drop the exact copies no future query can need: P0 <- max(P0, min(Qs, V(len - rollback))).

A compiled step (cache/static.py's `HostPlan`) does 1 and 3 for every layer when the step
is booked, before the graph runs (`booked_layers`: a decode step's due block never holds its
own tokens, and its query reads no exact key the drop removes; otherwise it declines and
each layer runs `attend`), so that each layer's call in the graph only writes its K/V into
the slots reserved for them and attends: with the native kernel, one C++ op
(decodelab::int4_host_attend), no Python. A step that only appends books without touching
any layer's stores: the new tokens are held past the exact views' ends (`_behind`) and the
views catch up when anything reads `key_exact` / `value_exact`. A decode step's plan is
computed in Python integers (`_one_token_plan`, the same value as the general `plan`).

Why step 3 is exact (the rule for keeping full precision). A later forward starts at the
row's length at that time, L'; its queries q >= L' need exact keys only at p >= V(q) >=
V(L'). After this forward a truncate may take the row back by at most `rollback` tokens
(`rollback_limit`), so L' >= len - rollback and, V being monotone, every future query
finds its exact keys in [P0, len). Rewritten positions (p >= L') are >= V(L') >= P0, so
they always lie in exact blocks; `truncate` drops quantized blocks that contain a
rewritten position (Qs <- min(Qs, floor(L' / F) * F)), and they are re-quantized,
bit-identically when the values are the same, when a query needs them. A further
rollback (after a rollback and a shorter forward) is accepted iff V(L') >= P0, i.e. iff
the query at the new length still finds every exact key it needs; otherwise `truncate`
refuses it and says why.

Memory: in steady state the exact store holds between residual + rollback - 1 and
residual + rollback + F - 2 tokens (defaults 112 + 16, F 64: 127..190 tokens, the
128..191 a 128-token residual held before; its buffer up to a sixteenth more, at most 192:
`nbytes` counts the buffer, `read_bytes` the tokens), the quantized store V(len - 1) tokens; the
blocks between V(len - rollback) and V(len - 1) (at most one with the defaults) are held
in both forms, and `nbytes` counts both.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from decodelab.cache.base import CacheLayout, KVCache, Plan, extend, is_plain_causal, reference_attention
from decodelab.cache.int4_codec import QTYPES, Grouping, QStore, dequantize_into, effective_group, quantize
from decodelab.cache.kernels.dispatch import DECODE_QUERIES, impl_problems, resolve_impl
from decodelab.cache.kernels.int4 import (Int4Rows, NativeHost, NativeLayerCall, int4_attention_native,
                                          int4_attention_triton, native_serves)
from decodelab.cache.static import HostPlan
from decodelab.cache.tree import Tree, tree_visible
from decodelab.models.errors import SetupError, raise_if

GROUP_SIZES = (32, 64, 128)
AXES = ("channel", "token")
SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def option_problems(layout: CacheLayout, nbits, group_size, residual, key_axis, value_axis, flush,
                    scale_dtype, rollback=0) -> list[str]:
    """Every reason these options cannot work for this layout."""
    p = []
    if nbits not in QTYPES:
        p.append(f"nbits must be one of {sorted(QTYPES)} (optimum-quanto qint2/qint4), got {nbits}")
    if group_size not in GROUP_SIZES:
        p.append(f"group_size must be one of {list(GROUP_SIZES)}, got {group_size}")
    for name, axis in (("key_axis", key_axis), ("value_axis", value_axis)):
        if axis not in AXES:
            p.append(f"{name} must be 'channel' (groups along tokens, per channel) or 'token' "
                     f"(groups along head_dim, per token), got {axis!r}")
        elif axis == "token" and group_size in GROUP_SIZES and layout.head_dim % effective_group(
                axis, group_size, layout.head_dim):
            p.append(f"{name}='token' needs group_size ({group_size}) to divide head_dim ({layout.head_dim})")
    if not isinstance(residual, int) or residual < 1:
        p.append(f"residual must be an integer >= 1 full-precision tokens, got {residual}")
    if not isinstance(rollback, int) or isinstance(rollback, bool) or rollback < 0:
        p.append(f"rollback must be an integer >= 0 tokens, got {rollback}")
    if not isinstance(flush, int) or flush < 1:
        p.append(f"flush must be an integer >= 1 tokens, got {flush}")
    elif "channel" in (key_axis, value_axis) and group_size in GROUP_SIZES and flush % group_size:
        p.append(f"flush ({flush}) must be a multiple of group_size ({group_size}): a per-channel group "
                 "spans group_size tokens of one flushed block")
    if scale_dtype not in SCALE_DTYPES:
        p.append(f"scale_dtype must be one of {list(SCALE_DTYPES)}, got {scale_dtype!r}")
    return p


@dataclass(frozen=True)
class View:
    """The keys that the queries in columns [query_from, query_to) of the current forward
    read, in one window's layers: per row, dequantized positions [dequant_from, dequant_to)
    then exact positions [exact_from, exact_to), in `slots` key slots."""

    query_from: int
    query_to: int
    dequant_from: list[int]  # [B] first dequantized position (a multiple of the group alignment)
    dequant_to: list[int]  # [B] end of the dequantized positions
    exact_from: list[int]  # [B] first exact position read
    exact_to: list[int]  # [B] end of the exact positions (the last query + 1)
    slots: int  # S key slots: dequantized then exact, -1 padded
    mask: torch.Tensor | None  # [B, 1, query_to - query_from, S] True = attend; None: every slot
    causal: bool  # the square lower triangle (SDPA's is_causal fast path)
    ragged: bool  # some slots stay empty (they must hold finite values)


@dataclass(frozen=True)
class Int4Plan(Plan):
    """One forward, per row: what `attend` stores, quantizes, reads and drops in every layer."""

    new_tokens: list[int]  # [B] valid new tokens
    exact_start: list[int]  # [B] first position of the exact store before this forward
    quantize_from: list[int]  # [B] quantize blocks [quantize_from, quantize_to) before the attention
    quantize_to: list[int]
    drop: list[int]  # [B] exact tokens dropped from the store's front after the attention
    views: dict  # window -> [View], one per chunk of query columns
    fed: list[int]  # [B] the cache row of each row of the forward (all rows, or `plan`'s `rows`)
    kernel_q: tuple | None  # (qpos [B, T], V(q) [B, T]) on the device for the kernel (int64 for the native
    # one, int32 for Triton); None: reference
    lengths: list[int]  # [B] each row's length once the forward is stored


class QuantizedCache(KVCache):
    """Quantized K/V with full-precision copies where any query, now or after a rollback
    of up to `rollback` tokens, sees a position exact (see the module docstring)."""

    lossy = True
    serves_row_subsets = True  # a row is its own stores: a forward plans only the rows it feeds
    #: a forward of more query columns attends in chunks of this many, each reading only the
    #: keys it needs: a long prefill then costs about the causal T^2 / 2 scores, not the
    #: T x 2T of one mask over every dequantized block and every exact token
    attention_chunk: int = 256

    def __init__(self, layout: CacheLayout, batch_size: int, capacity: int, nbits: int = 4,
                 group_size: int = 64, residual: int = 112, key_axis: str = "channel",
                 value_axis: str = "token", flush: int | None = None, scale_dtype: str = "float16",
                 rollback: int = 16, impl: str = "auto"):
        flush = group_size if flush is None else flush
        reasons = option_problems(layout, nbits, group_size, residual, key_axis, value_axis, flush, scale_dtype,
                                  rollback)
        reasons += [] if impl == "native" else impl_problems(impl, layout.device)
        try:
            super().__init__(layout, batch_size, capacity)
        except SetupError as e:
            reasons = e.reasons + reasons
        raise_if(reasons)
        self.rollback_limit = rollback
        self._options = (nbits, group_size, residual, key_axis, value_axis, flush, scale_dtype, rollback)
        self.residual, self.flush, self.nbits = residual, flush, nbits
        self.scale_dtype = SCALE_DTYPES[scale_dtype]
        D = layout.head_dim
        self.key_grouping = Grouping(key_axis, effective_group(key_axis, group_size, D), nbits)
        self.value_grouping = Grouping(value_axis, effective_group(value_axis, group_size, D), nbits)
        self.impl = self._resolve_impl(impl)  # 'reference', 'triton' or 'native' (cache/kernels/dispatch, int4)
        # a window starts dequantizing at a multiple of this many tokens
        self.align = max(self.key_grouping.tokens_per_index, self.value_grouping.tokens_per_index)
        self.reset()

    def native_problem(self) -> str | None:
        """Why decodelab's native CPU kernel cannot attend over this cache (None: it can)."""
        lay = self.layout
        if lay.device.type != "cpu":
            return f"the native int4 attention runs on a CPU, not {lay.device.type} (impl=triton runs on CUDA)"
        why = native_serves(self.key_grouping, self.value_grouping, lay.head_dim, lay.dtype, lay.softcap)
        if why is None:
            from decodelab.models import native

            why = native.problem()
        return why

    def _resolve_impl(self, impl: str) -> str:
        """auto: the Triton kernel on CUDA, decodelab's native kernel on a CPU where it serves
        these options (else the reference, said once on stderr when the kernels cannot be built);
        native: refused, with the reason, where it cannot serve."""
        if impl == "native":
            why = self.native_problem()
            raise_if([f"impl=native cannot attend over this cache: {why}; use impl=auto or impl=reference"]
                     if why else [])
            return "native"
        resolved = resolve_impl(impl, self.layout.device)
        if impl == "auto" and resolved == "reference" and self.layout.device.type == "cpu":
            why = self.native_problem()
            if why is None:
                return "native"
            from decodelab.models import native

            if native.problem():
                native.note_fallback("int4 KV attention")
        return resolved

    @classmethod
    def planned_bytes(cls, layout: CacheLayout, batch_size: int, capacity: int, nbits: int = 4,
                      group_size: int = 64, residual: int = 112, key_axis: str = "channel",
                      value_axis: str = "token", flush: int | None = None, scale_dtype: str = "float16",
                      rollback: int = 16, impl: str = "auto") -> int:
        """What the stores grow to when every row holds `capacity` tokens (nothing is
        allocated up front): per layer and row, V(capacity - 1) quantized tokens (nbits
        codes plus a scale and a shift per group, K and V) and at most residual + rollback
        + flush exact ones; plus, while a forward stores its tokens, one layer's K/V of a
        forward over the whole capacity in full precision (a long prefill is appended
        exact before its blocks are quantized)."""
        flush = group_size if flush is None else flush
        opts = (nbits, group_size, residual, key_axis, value_axis, flush, scale_dtype, rollback)
        raise_if(option_problems(layout, *opts))
        exact_token = layout.bytes_per_token() // layout.n_layers  # K and V of one token in one layer
        return batch_size * (cls._row_bytes(layout, capacity, *opts) + capacity * exact_token)

    @staticmethod
    def _row_bytes(layout: CacheLayout, tokens: int, nbits, group_size, residual, key_axis, value_axis, flush,
                   scale_dtype, rollback) -> int:
        """One row of `tokens` tokens, every layer: V(tokens - 1) quantized tokens (codes, a
        scale and a shift per group, K and V) and at most residual + rollback + flush exact ones."""
        H, D, L = layout.n_kv_heads, layout.head_dim, layout.n_layers
        exact_token = layout.bytes_per_token() // L  # K and V of one token in one layer
        scale = SCALE_DTYPES[scale_dtype].itemsize
        quantized_token = sum(H * D * nbits // 8 + 2 * (H * D // effective_group(axis, group_size, D)) * scale
                              for axis in (key_axis, value_axis))  # K and V: codes, scales, shifts
        quantized = max(0, (tokens - residual) // flush) * flush  # V(tokens - 1)
        exact = min(tokens, residual + rollback + flush)
        return L * (quantized * quantized_token + exact * exact_token)

    def __repr__(self) -> str:
        kg, vg = self.key_grouping, self.value_grouping
        return (f"QuantizedCache(qint{self.nbits}, group={kg.size}/{vg.size}, residual={self.residual}, "
                f"flush={self.flush}, rollback={self.rollback_limit}, key_axis={kg.axis}, value_axis={vg.axis})")

    def reset(self) -> None:
        """Forget every row: empty quantized and exact stores."""
        super().reset()
        L, B, H, D = self.layout.n_layers, self.batch_size, self.layout.n_kv_heads, self.layout.head_dim
        kw = dict(dtype=self.layout.dtype, device=self.layout.device)
        sd, dev = self.scale_dtype, self.layout.device
        kg, vg = self.key_grouping, self.value_grouping
        self.key_codes = [[kg.empty(H, D, sd, dev) for _ in range(B)] for _ in range(L)]  # [layer][row] QStore
        self.value_codes = [[vg.empty(H, D, sd, dev) for _ in range(B)] for _ in range(L)]
        self.key_exact = [[torch.empty(H, 0, D, **kw) for _ in range(B)] for _ in range(L)]  # [H, len - P0, D] each
        self.value_exact = [[torch.empty(H, 0, D, **kw) for _ in range(B)] for _ in range(L)]
        self._behind = None  # per row: tokens held past every exact view's end (`booked_layers`), or None
        self._room, self._behind_rows = [], []  # with it: per row the slots left past them; the rows bound
        self._all_valid = None
        self.quantized_len = torch.zeros(B, dtype=torch.long)  # [B] tokens in the quantized store (Qs)
        self.exact_start = torch.zeros(B, dtype=torch.long)  # [B] first position of the exact store (P0)
        self._native_calls = {}  # layer -> its NativeLayerCall in compiled steps (`booked_layers`)

    # -- the exact stores, as views that may lag behind (a compiled step's booking) ------
    @property
    def key_exact(self) -> list[list[torch.Tensor]]:
        """[layer][row] the exact keys [H, len - P0, D] (views of wider buffers)."""
        if self._behind is not None:
            self._catch_up()
        return self._key_exact

    @key_exact.setter
    def key_exact(self, stores) -> None:
        self._key_exact, self._behind = stores, None

    @property
    def value_exact(self) -> list[list[torch.Tensor]]:
        """[layer][row] the exact values, as `key_exact`."""
        if self._behind is not None:
            self._catch_up()
        return self._value_exact

    @value_exact.setter
    def value_exact(self, stores) -> None:
        self._value_exact, self._behind = stores, None

    def _catch_up(self) -> None:
        """Grow every exact view over the tokens its buffer holds past its end (`_behind`,
        left by the booked steps of `booked_layers`, which wrote them without new views)."""
        behind, self._behind = self._behind, None
        for stores in (self._key_exact, self._value_exact):
            for layer in stores:
                for row, n in enumerate(behind):
                    if n:
                        e = layer[row]
                        layer[row] = e._base.narrow(1, _buffer_start(e), e.shape[1] + n)

    def _room_behind(self, fed: list[int]) -> list[int] | None:
        """Per row of `fed`, the tokens every layer's exact buffers have room for past their
        views' ends, where every layer's views of the row hold the same tokens (else None)."""
        room = []
        for row in fed:
            free, size = None, self._key_exact[0][row].shape[1]
            for stores in (self._key_exact, self._value_exact):
                for layer in stores:
                    e = layer[row]
                    base = e._base
                    if base is None or e.shape[1] != size or e.stride(0) != base.stride(0):
                        return None
                    left = base.shape[1] - _buffer_start(e) - size
                    free = left if free is None else min(free, left)
            room.append(free)
        return room

    # -- the rule ------------------------------------------------------------------
    def quantized_prefix(self, q):
        """V(q): a query at position q sees positions [0, V(q)) dequantized and [V(q), q]
        exact; V(q) = max(0, floor((q + 1 - residual) / flush)) * flush. Int or tensor."""
        if isinstance(q, torch.Tensor):
            return torch.div(q + 1 - self.residual, self.flush, rounding_mode="floor").clamp(min=0) * self.flush
        return max(0, (q + 1 - self.residual) // self.flush) * self.flush

    # -- called by the model -------------------------------------------------------
    def plan(self, positions: torch.Tensor, valid: torch.Tensor | None = None, rows=None,
             parents=None) -> Int4Plan:
        """Book a forward (each row must continue at its length, right padding only) and
        plan it: what every layer stores, quantizes, reads (per window) and drops. A tree
        forward's queries read by their own positions (cache/tree.py)."""
        if valid is None and rows is None and parents is None and positions.shape[-1] == 1:
            one = self._one_token_plan(positions)
            if one is not None:
                return one
        before = self.lengths
        base = super().plan(positions, valid, rows, parents)
        r = base.cache_rows(self.batch_size)  # [b] the cache rows fed
        old = before[r]
        pos, ok = base.positions, base.valid  # [B, T]
        T = pos.shape[1]
        n = self.lengths[r] - old  # [B] new tokens per row
        prefix = torch.arange(T)[None, :] < n[:, None]  # [B, T]
        if not bool((ok == prefix).all()) or not bool(((pos == old[:, None] + torch.arange(T)) | ~ok).all()):
            self.lengths = before
            raise SetupError("the int4 cache stores each row's tokens in order: a forward must continue every "
                             f"row at its length {old.tolist()} (right padding only); truncate first to rewrite")
        L, qs, p0 = self.lengths[r], self.quantized_len[r], self.exact_start[r]  # [B] each
        qeff = torch.where(ok, pos, L[:, None] - 1)  # [B, T] slots; padding queries act as the row's last
        tree = base.tree
        vis = self.quantized_prefix(qeff if tree is None else tree.positions)  # [B, T] V(q) at each query's position
        # quantize what the latest query sees quantized (and anything only held quantized)
        q_to = torch.maximum(qs, self.quantized_prefix(L - 1))
        p0_new = torch.maximum(p0, torch.minimum(q_to, self.quantized_prefix(L - self.rollback_limit)))
        C = self.attention_chunk
        views = {w: [self._view(w, qeff[:, a:a + C], vis[:, a:a + C], a, p0, tree) for a in range(0, T, C)]
                 for w in set(self.layout.windows)}
        self.quantized_len, self.exact_start = self.quantized_len.clone(), self.exact_start.clone()
        self.quantized_len[r], self.exact_start[r] = q_to, p0_new  # what every layer holds once this forward is done
        # decode-sized and causal: one view, the kernel (a tree of drafts takes the reference)
        kernel = self.impl != "reference" and T <= min(DECODE_QUERIES, C) and tree is None
        dev = self.layout.device
        ix = torch.long if self.impl == "native" else torch.int32  # what the kernel reads: no conversion per layer
        kernel_q = (qeff.to(dev, ix), vis.to(dev, ix)) if kernel else None
        return extend(base, Int4Plan, new_tokens=n.tolist(), exact_start=p0.tolist(), quantize_from=qs.tolist(),
                      quantize_to=q_to.tolist(), drop=(p0_new - p0).tolist(), views=views, fed=r.tolist(),
                      kernel_q=kernel_q, lengths=L.tolist())

    def _one_token_plan(self, positions: torch.Tensor) -> Int4Plan | None:
        """`plan` of a forward of one token per row, every row, each at its length (a decode
        step), in Python integers: the same plan (tests/cache/test_int4.py compares them)
        without `plan`'s few dozen tensor operations (a compiled step books one every step,
        on the host between two graphs). None, having booked nothing, where it would differ
        in form: a query whose view needs a mask (a window, padded rows, a cache read before
        its exact start), or no quantized key yet (`plan` then checks the causal shortcut);
        `plan` books those, and refuses whatever it refuses."""
        pos = positions.detach().cpu()
        at = pos.reshape(-1).tolist()
        old = self.lengths.tolist()
        if len(at) != self.batch_size or at != old or max(at) >= self.capacity:
            return None
        V = self.quantized_prefix
        qs, p0 = self.quantized_len.tolist(), self.exact_start.tolist()
        vis = [V(q) for q in at]
        if any(v <= 0 or s > v for v, s in zip(vis, p0)):
            return None
        views = {}
        for w in set(self.layout.windows):
            lo = [0] * len(at) if w is None else [max(0, (q - w + 1) // self.align) * self.align for q in at]
            if w is not None and any(a <= q - w or a >= v for a, q, v in zip(lo, at, vis)):
                return None  # dequantized positions before the window (masked), or none in it
            # dequantized [lo, V(q)), exact [V(q), q + 1): every row the same number of slots
            views[w] = [View(0, 1, lo, vis, vis, [q + 1 for q in at], at[0] + 1 - lo[0], None, False, False)]
            if any(q + 1 - a != at[0] + 1 - lo[0] for a, q in zip(lo, at)):
                return None
        L = [q + 1 for q in at]
        q_to = [max(a, V(n - 1)) for a, n in zip(qs, L)]
        p0_new = [max(a, min(b, V(n - self.rollback_limit))) for a, b, n in zip(p0, q_to, L)]
        # new tensors where a count changed (never written in place: the next plan replaces them)
        self.lengths = torch.tensor(L)
        if q_to != qs:
            self.quantized_len = torch.tensor(q_to)
        if p0_new != p0:
            self.exact_start = torch.tensor(p0_new)
        kernel_q = None
        if self.impl != "reference" and min(DECODE_QUERIES, self.attention_chunk) >= 1:
            ix, dev = torch.long if self.impl == "native" else torch.int32, self.layout.device
            kernel_q = (torch.tensor([[q] for q in at], dtype=ix), torch.tensor([[v] for v in vis], dtype=ix))
            if dev.type != "cpu":
                kernel_q = tuple(t.to(dev) for t in kernel_q)
        B = len(at)
        if self._all_valid is None or self._all_valid.shape[0] != B:
            self._all_valid = torch.ones(B, 1, dtype=torch.bool)  # shared by these plans, read only
        return Int4Plan(pos, self._all_valid, None, new_tokens=[1] * B, exact_start=p0,
                        quantize_from=qs, quantize_to=q_to, drop=[b - a for a, b in zip(p0, p0_new)], views=views,
                        fed=list(range(B)), kernel_q=kernel_q, lengths=L)

    def _view(self, window, qeff, vis, a: int, exact_start: torch.Tensor, tree: Tree | None = None) -> View:
        """Key slots of every row for the queries at slots qeff [B, t] (columns a..a+t) in one
        window, and the mask that picks, per query, the dequantized version of positions
        below V(q) and the exact one from V(q) on (exactly one version of every visible
        position; a tree's queries see their ancestors among the forward's tokens)."""
        last = qeff.max(1).values  # [B] latest query slot of each row
        own = qeff if tree is None else tree.positions[:, a:a + qeff.shape[1]]  # [B, t] the queries' positions
        first = own.min(1).values  # [B] earliest query position of each row
        qa = torch.maximum(self.quantized_prefix(last), exact_start)  # below P0: only held quantized
        fs = torch.maximum(exact_start, vis.min(1).values)  # exact positions below fs: no query reads them
        hi = last + 1
        if window is None:
            lo = torch.zeros_like(qa)
        else:
            lo = torch.div(first - window + 1, self.align, rounding_mode="floor").clamp(min=0) * self.align
            fs = torch.maximum(fs, first - window + 1)
        lo, fs = torch.minimum(lo, qa), torch.minimum(fs, hi)
        nq, nf = qa - lo, hi - fs  # [B] dequantized and exact slots
        total = nq + nf
        S = max(int(total.max()), 1)
        slot = torch.arange(S)[None, :]  # [1, S]
        isq = slot < nq[:, None]  # [B, S]
        kpos = torch.where(isq, lo[:, None] + slot, fs[:, None] + slot - nq[:, None])
        kpos = torch.where(slot < total[:, None], kpos, -1)  # [B, S]
        causal = tree is None and not bool(nq.any()) and is_plain_causal(qeff, kpos, window)
        mask = None
        if not causal:
            q, k, v = qeff[:, :, None], kpos[:, None, :], vis[:, :, None]
            ok = (k >= 0) & torch.where(isq[:, None, :], k < v, k >= v)  # [B, t, S] one version of each
            if tree is None:
                ok &= (k <= q) & ((k > q - window) if window is not None else True)
            else:
                cols = Tree(own, tree.start, tree.ancestors[:, a:a + qeff.shape[1]])
                ok &= tree_visible(cols, kpos, window)
            mask = None if bool(ok.all()) else ok[:, None].to(self.layout.device)
        return View(a, a + qeff.shape[1], lo.tolist(), qa.tolist(), fs.tolist(), hi.tolist(), S, mask, causal,
                    bool((total < S).any()))

    def attend(self, layer, q, k, v, plan: Int4Plan):
        """Store the valid k, v [B, Hkv, T, D] and quantize the blocks now due; attend q
        [B, Hq, T, D] with the version of every key its position calls for; then drop the
        exact copies that no query can need any more. In a compiled step (a `HostPlan`)
        this runs as one opaque call inside the graph, on the plan booked before the step."""
        if isinstance(plan, HostPlan):
            return plan.attend(layer, q, k, v)
        self._store(layer, k, v, plan)
        out = self.attention(layer, q, plan)
        self._flush(layer, plan)
        return out

    def attention(self, layer: int, q: torch.Tensor, plan: Int4Plan, impl: str | None = None) -> torch.Tensor:
        """Attention [B, Hq, T, D] of the forward `plan`'s queries q [B, Hq, T, D] over what
        `layer` holds, each key in the version its position calls for: the read half of
        `attend`, repeatable, storing nothing. Valid once that forward's `attend` stored the
        layer's K/V (`attend` calls it in between). `impl`: 'reference' (dequantize into
        scratch buffers, then SDPA), 'triton' (cache/kernels/int4.py, CUDA) or 'native'
        (decodelab's CPU kernel over the codes in place); None: the plan's choice (a kernel
        for decode-sized forwards, the reference for longer ones and trees)."""
        if impl == "native":
            raise_if([f"impl=native: {why}"] if (why := self.native_problem()) else [])
        elif impl not in (None, self.impl):
            raise_if(impl_problems(impl, self.layout.device))
        views = plan.views[self.layout.windows[layer]]
        starts = self._exact_starts(layer, plan)
        kernel = (self.impl if plan.kernel_q is not None else "reference") if impl is None else \
            resolve_impl(impl, self.layout.device)
        if kernel != "reference" and plan.tree is not None:
            raise SetupError(f"the int4 {kernel} kernel attends causally: a tree of draft tokens takes impl=reference")
        run = {"triton": int4_attention_triton, "native": int4_attention_native}.get(kernel)
        lay, outs = self.layout, []
        for chunk, view in enumerate(views):  # one, unless the forward is long
            cols = slice(view.query_from, view.query_to)
            self._check_exact(layer, view, starts)
            # the native kernel only where codes are read: over exact keys alone the reference is dense's own SDPA
            # (bit-identical to a dense cache inside the residual window)
            if run is not None and (kernel != "native" or any(a < b for a, b in zip(view.dequant_from,
                                                                                     view.dequant_to))):
                qpos, vis = plan.kernel_q if plan.kernel_q is not None else self.kernel_queries(plan)
                outs.append(run(q[:, :, cols], self.kernel_rows(layer, plan, chunk, starts), qpos[:, cols],
                                vis[:, cols], lay.softmax_scale, lay.windows[layer], lay.softcap))
                continue
            keys, values = self._gather(layer, view, plan, starts)  # [B, Hkv, S, D] each
            outs.append(reference_attention(q[:, :, cols], keys, values, view.mask, lay.softmax_scale, lay.softcap,
                                            view.causal))
        return outs[0] if len(outs) == 1 else torch.cat(outs, 2)

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor, p: Int4Plan) -> None:
        """Append each row's valid new tokens k, v [B, H, T, D] to its exact store; quantize
        the blocks [quantize_from, quantize_to) (one quanto call, the same bytes as block by block)."""
        for b, (n, row) in enumerate(zip(p.new_tokens, p.fed)):
            for exact, x in ((self.key_exact, k), (self.value_exact, v)):
                if n:
                    exact[layer][row] = self._appended(exact[layer][row], x[b, :, :n])
        self._quantize_due(layer, p)

    def _quantize_due(self, layer: int, p: Int4Plan) -> None:
        """Quantize each row's blocks [quantize_from, quantize_to) from its exact store."""
        for b, row in enumerate(p.fed):
            start, q_from, q_to = p.exact_start[b], p.quantize_from[b], p.quantize_to[b]
            if q_to > q_from:
                for g, codes, exact in ((self.key_grouping, self.key_codes, self.key_exact),
                                        (self.value_grouping, self.value_codes, self.value_exact)):
                    new = exact[layer][row][:, q_from - start:q_to - start]  # [H, q_to - q_from, D]
                    codes[layer][row] = g.append(codes[layer][row], quantize(new, g, self.scale_dtype))

    def booked_layers(self, plan: Int4Plan) -> list | None:
        """A compiled step's host work for every layer at once, done before the step runs
        (cache/static.py's `HostPlan.book`): each layer's due blocks quantized, the slots of
        the new tokens reserved at the end of its exact stores, the exact copies no query
        needs dropped, and its attention's arguments bound, so that the step's call per layer
        only writes its K/V into those slots and attends: [n_layers] fn(q, k, v) -> out,
        decodelab::int4_store_attend where the native kernel attends (one native call),
        else a write and `attention`. The same stores, spans and kernel as `attend`'s, so
        the same result to the bit. None (every layer runs `attend`) where the order of the
        three matters: a tree, a forward whose due blocks hold its own tokens (longer than
        `residual`), or one whose queries read exact keys the drop removes."""
        rows = range(len(plan.fed))
        if plan.tree is not None or any(plan.quantize_to[b] > plan.lengths[b] - plan.new_tokens[b] for b in rows):
            return None
        kept = [plan.exact_start[b] + plan.drop[b] for b in rows]  # each row's exact store starts here after the drop
        if any(v.exact_to[b] > v.exact_from[b] and v.exact_from[b] < kept[b]
               for views in plan.views.values() for v in views for b in rows):
            return None
        lay = self.layout
        due, dropped, grown = any(a < b for a, b in zip(plan.quantize_from, plan.quantize_to)), any(plan.drop), \
            [(n, row) for n, row in zip(plan.new_tokens, plan.fed) if n]
        held = self._held_behind(plan) if not (due or dropped) else None
        if held is not None:
            return held
        for layer in range(lay.n_layers):
            if due:
                self._quantize_due(layer, plan)
            for exact in (self.key_exact[layer], self.value_exact[layer]):
                for n, row in grown:
                    exact[row] = self._reserved(exact[row], n)
            if dropped:
                self._flush(layer, plan)
        # per window the native kernel attends: its spans (the same in every layer; the views hold every token)
        spans = {w: self._spans(views[0], kept, [0] * len(kept)) for w, views in plan.views.items()
                 if self._native_view(plan, views)}
        return [self._bound_call(layer, plan, spans[w]) if w in spans else partial(self._attend_booked, layer, plan)
                for layer, w in enumerate(lay.windows)]

    def _held_behind(self, plan: Int4Plan) -> list | None:
        """`booked_layers` of a step that only appends (nothing due, nothing dropped) and
        that the native kernel attends in every layer, where every exact buffer has room:
        the new tokens are held past the views' ends (`_behind`, per row, the same in every
        layer; the views grow over them when anything else reads the stores, `_catch_up`),
        so that booking the step touches no layer's stores: the calls keep their arguments
        but this step's spans (each row's tokens behind in the sixth) and queries. None
        where it cannot (the caller then books every layer)."""
        views = plan.views
        if not all(self._native_view(plan, v) for v in views.values()):
            return None
        fed, new = plan.fed, plan.new_tokens
        if self._behind is not None and fed != self._behind_rows:
            self._catch_up()  # other rows than the calls were bound to
        entering = self._behind is None
        room = self._room_behind(fed) if entering else [self._room[r] for r in fed]
        if room is None or any(n > r for n, r in zip(new, room)):
            return None
        if entering:
            self._behind, self._room, self._behind_rows = [0] * self.batch_size, [0] * self.batch_size, fed
        behind = self._behind
        for n, row, r in zip(new, fed, room):
            behind[row] += n
            self._room[row] = r - n
        spans = {w: self._spans(v[0], plan.exact_start, [behind[r] for r in fed]) for w, v in views.items()}
        steps = []
        for layer, w in enumerate(self.layout.windows):
            call = self._native_calls.get(layer)
            if entering or call is None:
                call = self._bound_call(layer, plan, spans[w])
            else:  # nothing read or changed the stores since the last booked step: the same views and codes
                a = call.args
                a[0], a[9], a[10], a[11] = new, spans[w], *plan.kernel_q
            steps.append(call)
        return steps

    def _native_view(self, plan: Int4Plan, views: list[View]) -> bool:
        """Whether the native kernel attends a window's queries of `plan` (one view that reads
        codes; over exact keys alone `attention` takes the reference, dense's own SDPA)."""
        v = views[0]
        return (self.impl == "native" and plan.kernel_q is not None and len(views) == 1
                and any(a < b for a, b in zip(v.dequant_from, v.dequant_to)))

    @staticmethod
    def _spans(view: View, starts: list[int], behind: list[int]) -> list[int]:
        """decodelab::int4_store_attend's spans: per row the view's dequantized and exact spans,
        the exact stores' first position and the tokens they hold past their views' ends."""
        return [x for s in zip(view.dequant_from, view.dequant_to, view.exact_from, view.exact_to, starts, behind)
                for x in s]

    def _bound_call(self, layer: int, plan: Int4Plan, spans: list[int]) -> NativeLayerCall:
        """The layer's `NativeLayerCall` (made once per layer), bound to its current stores of
        the rows `plan` feeds and to the step's spans and queries."""
        call, lay, fed = self._native_calls.get(layer), self.layout, plan.fed
        if call is None:
            call = self._native_calls[layer] = NativeLayerCall(lay.softmax_scale, lay.windows[layer],
                                                               self.key_grouping.size, self.value_grouping.size)
        kc, vc = self.key_codes[layer], self.value_codes[layer]
        ke, ve = self._key_exact[layer], self._value_exact[layer]  # current: the caller caught up or set `_behind`
        return call.update([kc[r] for r in fed], [vc[r] for r in fed], [ke[r] for r in fed], [ve[r] for r in fed],
                           spans, plan.new_tokens, *plan.kernel_q)

    def _attend_booked(self, layer: int, plan: Int4Plan, q, k, v) -> torch.Tensor:
        """A layer of a step `booked_layers` prepared, where no native call serves: the new
        K/V written into the reserved slots, then `attention`."""
        for b, (n, row) in enumerate(zip(plan.new_tokens, plan.fed)):
            for exact, x in ((self.key_exact, k), (self.value_exact, v)):
                e = exact[layer][row]
                e[:, e.shape[1] - n:].copy_(x[b, :, :n])
        return self.attention(layer, q, plan)

    def _exact_capacity(self, tokens: int) -> int:
        """Tokens a fresh exact buffer holds for a store of `tokens`: those, plus room for a
        sixteenth as many more (at least one), never past the most the store holds in steady
        state (residual + rollback + flush) nor the cache's capacity unless `tokens` is:
        in steady state a copy every 8 to 12 decode steps, and never more memory than the
        store's high point."""
        room = min(tokens + max(1, tokens // 16), self.residual + self.rollback_limit + self.flush, self.capacity)
        return max(tokens, room)

    def _appended(self, store: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The exact store [H, n, D] with x [H, k, D] after it (`_reserved`, then written)."""
        out = self._reserved(store, x.shape[1])
        out[:, store.shape[1]:].copy_(x)
        return out

    def _reserved(self, store: torch.Tensor, k: int) -> torch.Tensor:
        """The exact store [H, n, D] grown by k slots after it, not written: a view of the
        buffer the store is a view of (one of these buffers: `_reserved` makes them all)
        where it has room after the store's end, else the store copied into a fresh buffer
        (`_exact_capacity(n + k)` tokens)."""
        H, n, D = store.shape
        base = store._base
        if base is not None:
            a = _buffer_start(store)
            if a + n + k <= base.shape[1] and store.stride(0) == base.stride(0):
                return base.narrow(1, a, n + k)
        buf = torch.empty(H, self._exact_capacity(n + k), D, dtype=store.dtype, device=store.device)
        buf[:, :n] = store
        return buf[:, :n + k]

    def _flush(self, layer: int, p: Int4Plan) -> None:
        """Drop the exact copies of blocks no future query can need: the views start later;
        a buffer wider than `_exact_capacity` of what it keeps (after a long forward) is
        copied into a fresh one of that size (the wide one freed)."""
        for row, d in zip(p.fed, p.drop):
            if d:
                for exact in (self.key_exact, self.value_exact):
                    kept = exact[layer][row][:, d:]
                    if (kept if kept._base is None else kept._base).shape[1] > self._exact_capacity(kept.shape[1]):
                        kept = self._appended(kept[:, :0].clone(), kept)
                    exact[layer][row] = kept

    def _move_slots(self, row: int, src: list[int], dst: list[int]) -> None:
        """Copy positions src -> dst of a row inside its exact stores (a tree's tokens are
        exact: they lie within the residual window), every layer."""
        s, d = torch.tensor(src), torch.tensor(dst)
        if min(dst) < int(self.quantized_len[row]):
            raise SetupError(f"row {row}: the tree's slots from {min(dst)} are held quantized (the cache quantized "
                             f"{int(self.quantized_len[row])} tokens); a tree of draft tokens must fit in the "
                             "full-precision residual window (raise `residual`)")
        dev = self.layout.device
        for layer in range(self.layout.n_layers):
            for exact in (self.key_exact, self.value_exact):
                e = exact[layer][row]  # [H, len - P0, D]: positions [P0, len)
                p0 = int(self.lengths[row]) - e.shape[1]
                e[:, (d - p0).to(dev)] = e[:, (s - p0).to(dev)]

    # -- reading -------------------------------------------------------------------
    def _exact_starts(self, layer: int, plan: Int4Plan) -> list[int]:
        """Per row of the forward, the position the layer's exact store starts at now: it
        holds [start, length), so start = length - its size. That is the plan's P0 once the
        layer stored the forward's K/V, or the new P0 once it also dropped; anything else
        means the layer has not stored this forward (refused)."""
        starts = []
        for b, row in enumerate(plan.fed):
            start = plan.lengths[b] - self.key_exact[layer][row].shape[1]
            if start not in (plan.exact_start[b], int(self.exact_start[row])):
                raise SetupError(f"layer {layer} of the int4 cache holds no K/V of this planned forward: call "
                                 "plan(positions) and attend(layer, q, k, v, plan) before reading its attention")
            starts.append(start)
        return starts

    @staticmethod
    def _check_exact(layer: int, view: View, starts: list[int]) -> None:
        """Every exact position the view reads is still held (from `starts` on)."""
        for b, (lo, hi, start) in enumerate(zip(view.exact_from, view.exact_to, starts)):
            if hi > lo and lo < start:
                raise SetupError(f"layer {layer}, row {b}: the exact keys of positions [{lo}, {start}) this forward "
                                 "reads were dropped at the end of its attend (it spans more than rollback + 1 tokens)")

    def _gather(self, layer: int, view: View, plan: Int4Plan, starts: list[int]):
        """Scratch K and V buffers [B, H, S, D] of every row: dequantized blocks, then exact tokens."""
        B, H, D = len(plan.fed), self.layout.n_kv_heads, self.layout.head_dim
        new = torch.zeros if view.ragged else torch.empty  # masked slots must be finite (0 x nan = nan)
        kw = dict(dtype=self.layout.dtype, device=self.layout.device)
        kbuf, vbuf = new(B, H, view.slots, D, **kw), new(B, H, view.slots, D, **kw)
        for b, row in enumerate(plan.fed):
            lo, qa, fs, e, p0 = (view.dequant_from[b], view.dequant_to[b], view.exact_from[b], view.exact_to[b],
                                 starts[b])
            for g, codes, exact, buf in ((self.key_grouping, self.key_codes, self.key_exact, kbuf),
                                         (self.value_grouping, self.value_codes, self.value_exact, vbuf)):
                if qa > lo:
                    dequantize_into(g.region(buf[b], qa - lo), g.span(codes[layer][row], lo, qa), g)
                if e > fs:
                    buf[b, :, qa - lo:qa - lo + e - fs].copy_(exact[layer][row][:, fs - p0:e - p0])
        return kbuf, vbuf

    def kernel_rows(self, layer: int, plan: Int4Plan, chunk: int = 0, starts: list[int] | None = None) -> Int4Rows:
        """One layer's stores and the key spans that chunk `chunk` of the forward `plan`'s
        queries reads (a single chunk unless the forward is longer than `attention_chunk`),
        as the int4 kernels take them (cache/kernels/int4.py). Valid once the layer's
        `attend` ran (`starts`: its `_exact_starts`, checked, when the caller has them)."""
        view, rows = plan.views[self.layout.windows[layer]][chunk], plan.fed
        if starts is None:
            starts = self._exact_starts(layer, plan)
            self._check_exact(layer, view, starts)
        pick = lambda stores: [stores[layer][r] for r in rows]  # noqa: E731
        return Int4Rows(pick(self.key_codes), pick(self.value_codes), pick(self.key_exact),
                        pick(self.value_exact), starts, self.key_grouping,
                        self.value_grouping, view.dequant_from, view.dequant_to, view.exact_from, view.exact_to)

    def kernel_queries(self, plan: Int4Plan) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward's query positions [B, T] (a padding query acts as its row's last, as
        in the plan) and their V(q) [B, T], int32 on the cache's device: the kernels' qpos, vis."""
        qeff = torch.where(plan.valid, plan.positions, self.lengths[plan.fed][:, None] - 1)  # [B, T]
        dev = self.layout.device
        return qeff.to(dev, torch.int32), self.quantized_prefix(qeff).to(dev, torch.int32)

    def read(self, layer, row):
        """positions [N], k and v [Hkv, N, D]: the quantized blocks dequantized, then the
        exact tokens (what the row holds; a query at position q sees `quantized_prefix(q)`)."""
        n, H, D = int(self.lengths[row]), self.layout.n_kv_heads, self.layout.head_dim
        qs, p0 = int(self.quantized_len[row]), int(self.exact_start[row])
        out = []
        for g, codes, exact in ((self.key_grouping, self.key_codes, self.key_exact),
                                (self.value_grouping, self.value_codes, self.value_exact)):
            buf = torch.empty(H, n, D, dtype=self.layout.dtype, device=self.layout.device)  # [H, N, D]
            if qs:
                dequantize_into(g.region(buf, qs), g.span(codes[layer][row], 0, qs), g)
            buf[:, qs:].copy_(exact[layer][row][:, qs - p0:n - p0])
            out.append(buf)
        return torch.arange(n), out[0], out[1]

    def quantized_tokens(self, row: int, layer: int = 0) -> int:
        """How many of a row's oldest tokens the quantized store holds (Qs)."""
        return self.key_grouping.tokens(self.key_codes[layer][row])

    def exact_span(self, row: int) -> tuple[int, int]:
        """Positions [P0, len) the row holds in full precision."""
        return int(self.exact_start[row]), int(self.lengths[row])

    # -- called by decoders --------------------------------------------------------
    def truncate(self, lengths) -> None:
        """Roll rows back: the exact stores shrink, quantized blocks holding a dropped
        position are dropped (re-quantized from the new values when a query needs them)."""
        new = torch.as_tensor(lengths, dtype=torch.long).cpu().reshape(-1)
        raise_if(self._truncate_problems(new))
        super().truncate(new)
        self.quantized_len = self.quantized_len.clone()  # (a plan may hold the one it left)
        for b, n in enumerate(new.tolist()):
            qs, p0 = int(self.quantized_len[b]), int(self.exact_start[b])
            keep = min(qs, n // self.flush * self.flush)
            for layer in range(self.layout.n_layers):
                if keep < qs:
                    self.key_codes[layer][b] = self.key_grouping.cut(self.key_codes[layer][b], keep)
                    self.value_codes[layer][b] = self.value_grouping.cut(self.value_codes[layer][b], keep)
                self.key_exact[layer][b] = self.key_exact[layer][b][:, :n - p0]
                self.value_exact[layer][b] = self.value_exact[layer][b][:, :n - p0]
            self.quantized_len[b] = keep

    def _truncate_problems(self, new: torch.Tensor) -> list[str]:
        """Every reason a truncate is refused (the base checks and the exact-key floor)."""
        if new.shape[0] != self.batch_size:
            return [f"truncate to {new.tolist()} gives {new.shape[0]} rows for a batch of {self.batch_size}"]
        p = []
        if bool((new > self.lengths).any()) or bool((new < 0).any()):
            p.append(f"truncate to {new.tolist()} is invalid for lengths {self.lengths.tolist()}: "
                     "each row can only roll back, never forward")
            return p
        back = self.lengths - new
        if bool((back > self.rollback_limit).any()):
            p.append(f"rolling back {int(back.max())} tokens exceeds this cache's rollback_limit of "
                     f"{self.rollback_limit} (its `rollback` option)")
        for b, n in enumerate(new.tolist()):
            v, p0 = self.quantized_prefix(n), int(self.exact_start[b])
            if v < p0 and back[b] <= self.rollback_limit:
                p.append(f"row {b}: rollback to {n} would need the full-precision keys of positions [{v}, {p0}), "
                         "already dropped (only quantized now): after an earlier rollback and a shorter forward, "
                         f"a row can only go back to where a query sees [0, {p0}) quantized")
        return p

    def nbytes(self) -> int:
        """Bytes really allocated: packed codes, scales, shifts and the exact stores
        (blocks held in both forms counted twice)."""
        stores = [t for layer in self.key_codes + self.value_codes for s in layer for t in s.tensors()]
        exact = [t for layer in self.key_exact + self.value_exact for t in layer]
        return sum(t.untyped_storage().nbytes() for t in stores + exact)

    # -- capabilities (cache/base.py) ----------------------------------------------
    def release(self, row: int) -> None:
        """Forget one row: its quantized and exact stores are emptied (freed)."""
        super().release(row)
        H, D, sd, dev = self.layout.n_kv_heads, self.layout.head_dim, self.scale_dtype, self.layout.device
        for layer in range(self.layout.n_layers):
            self.key_codes[layer][row] = self.key_grouping.empty(H, D, sd, dev)
            self.value_codes[layer][row] = self.value_grouping.empty(H, D, sd, dev)
            self.key_exact[layer][row] = self.key_exact[layer][row][:, :0].clone()
            self.value_exact[layer][row] = self.value_exact[layer][row][:, :0].clone()
        self._native_calls = {}  # (they may hold the row's freed stores)
        self.quantized_len, self.exact_start = self.quantized_len.clone(), self.exact_start.clone()
        self.quantized_len[row] = self.exact_start[row] = 0

    def row_bytes(self, tokens: int) -> int:
        """What a row of `tokens` tokens holds at most: V(tokens - 1) quantized tokens and up to
        residual + rollback + flush exact ones, every layer (`planned_bytes` of one row, without
        the transient full-precision copy of a forward)."""
        return self._row_bytes(self.layout, tokens, *self._options)

    def budget_bytes(self) -> int:
        """Every row at full capacity (the stores grow; nothing is allocated up front)."""
        return self.batch_size * self.row_bytes(self.capacity)

    def fill_random(self, n_tokens: int, seed: int = 0) -> None:
        """Forget every row, then make each hold positions [0, n_tokens) of random K/V as a
        one-pass prefill leaves them: quantized [0, V(n - 1)), exact from
        P0 = min(Qs, V(n - rollback)); no attention runs. Per layer one draw [Hkv, n, D] is
        quantized once and copied to every row (a long context then costs one quanto call
        per layer and kind, not one per row)."""
        self.reset()
        KVCache.plan(self, torch.arange(n_tokens).expand(self.batch_size, -1))  # lengths, capacity check
        lay, B = self.layout, self.batch_size
        qs = self.quantized_prefix(n_tokens - 1)
        p0 = max(0, min(qs, self.quantized_prefix(n_tokens - self.rollback_limit)))
        g = torch.Generator(device=lay.device).manual_seed(seed)
        for layer in range(lay.n_layers):
            for grouping, codes, exact in ((self.key_grouping, self.key_codes, self.key_exact),
                                           (self.value_grouping, self.value_codes, self.value_exact)):
                x = torch.randn(lay.n_kv_heads, n_tokens, lay.head_dim, generator=g, device=lay.device).to(lay.dtype)
                q = quantize(x[:, :qs], grouping, self.scale_dtype) if qs else None  # [H, Qs, D] packed
                for b in range(B):
                    if q is not None:
                        codes[layer][b] = QStore(*(t.clone() for t in q.tensors()))
                    exact[layer][b] = self._appended(x[:, :0].clone(), x[:, p0:])  # [H, n - P0, D]
        self.quantized_len, self.exact_start = torch.full((B,), qs), torch.full((B,), p0)

    def read_bytes(self, context: int) -> int:
        """Bytes a decode step reads: the quantized stores as they are and the exact tokens
        held (not the rest of their buffers; the stores hold `context`)."""
        stores = [t for layer in self.key_codes + self.value_codes for s in layer for t in s.tensors()]
        exact = [t for layer in self.key_exact + self.value_exact for t in layer]
        return sum(t.untyped_storage().nbytes() for t in stores) + sum(t.numel() * t.element_size() for t in exact)

    def static_plan(self, tokens: int = 1, impl: str = "auto") -> HostPlan:
        """The compiled CPU step's plan: the model compiled, each layer's int4 attention one
        opaque host call in the graph on the eager plan booked before the step
        (cache/static.py's `HostPlan`). On CUDA refused: a captured graph replays no host work."""
        if self.layout.device.type != "cpu":
            raise self.refusal(f"run a static decode step on {self.layout.device.type} (eager or compiled)",
                               "its attention plans and quantizes on the host every forward, which a captured "
                               "CUDA graph would not replay; decode with compile=false (its Triton kernel "
                               "decodes there)")
        if self.impl == "native":  # its layers through decodelab::int4_host_attend (cache/static.py)
            return HostPlan(self, tokens, host=NativeHost)
        return HostPlan(self, tokens)

    def static_view(self):
        """Refused: int4's storage has no fixed shape."""
        raise self.refusal("give a fixed-shape view for the static decode step",
                           "int4 grows per-row stores on the host each forward (quantized blocks and exact "
                           "tokens appended per row), so its storage has no fixed shape")


def _buffer_start(store: torch.Tensor) -> int:
    """The slot of the buffer [H, capacity, D] (its `_base`) that an exact store's first token is in."""
    return (store.storage_offset() - store._base.storage_offset()) // store.shape[2]


def bf16_ratio(layout: CacheLayout, context: int, **options) -> float:
    """Bytes a one-row cache with these options allocates at `context` tokens, over the
    bytes of a dense bf16 cache of the same context (2 x layers x heads x tokens x D x 2)."""
    cache = QuantizedCache(layout, 1, context, **options)
    cache.fill_random(context)
    dense = 2 * layout.n_layers * layout.n_kv_heads * context * layout.head_dim * 2
    return cache.nbytes() / dense


def worst_context(cache: QuantizedCache, near: int) -> int:
    """The context in (near - flush, near] at which a row written in one forward holds the
    most full-precision tokens (the memory high point of a flush period)."""
    return max(range(max(1, near - cache.flush + 1), near + 1),
               key=lambda n: n - int(cache.quantized_prefix(torch.tensor(n - cache.rollback_limit))))
