"""The `KVCache` contract, its layout, the per-forward attention plan, and the
bookkeeping every backend shares.

A cache is one object per model; storage layout and the attention that reads it live
together, because the layout decides the kernel. The cache holds only what persists
between forwards (storage, lengths, allocation, prefix index, quantization state); what
one forward needs is a value, its `Plan` (vLLM v1's attention metadata is the anchor).
Per forward the model calls:

`plan = cache.plan(positions, valid=None, rows=None)`, once, before the first layer:
- receives `positions` [B, T] (int, any device): the position of every new token, rows
  in the cache's batch order; and `valid` [B, T] (bool, or None for all True): False
  marks padding, which is never cached as a key of any valid query;
- with `rows` [b] (distinct cache rows), the forward covers only those rows: positions
  and valid are [b, T] and every later [B, ...] below reads [b, ...] (a serving engine
  prefills one request's row while the others wait). A backend that cannot run a
  forward over a subset refuses it (`refusal`);
- checks that the batch has `batch_size` rows and that every position fits `capacity`
  (else SetupError, and the cache is unchanged);
- does the host bookkeeping the forward needs, on the cache (`lengths` [B]: each row's
  last valid position + 1, a row with no valid token keeps its length; the blocks it
  allocates, the ring slots it advances, the int4 blocks due for quantization);
- returns an immutable `Plan` (a backend's subclass): the positions and the valid mask,
  and whatever the backend derived from them for its attention (write slots, key spans
  and masks per window, kernel arguments). Any number of plans can be in flight (the
  segments of one forward over several groups of rows, a draft and its target): each
  layer's attention reads only the plan it is handed.

`attend(layer, q, k, v, plan)`, once per attention layer, in layer order:
- receives the layer index, q [B, Hq, T, D] and the new k, v [B, Hkv, T, D] of the
  tokens `plan` announced (Hq a multiple of Hkv: grouped-query attention);
- stores k, v of the valid tokens at their positions (a backend may also write the
  padding's slots past a row's length; no valid query ever reads them);
- returns [B, Hq, T, D]: for each query at position q, softmax attention over the keys
  its row holds at positions p <= q (this forward's included), inside the layer's window
  `window(layer)` (q - p < w) plus the backend's `sink_tokens`; a padding query's output
  is finite and meaningless.

Between forwards, `read`, `truncate`, `reset` and `nbytes` serve decoders and experiments.
Whatever else a higher layer needs from a backend is a capability declared here, with a
default that works for every backend or refuses with the reason (`refusal`: a SetupError
naming the backend): `static_plan(tokens)` (the plan of a compiled decode step,
cache/static.py: fixed-shape buffers, or int4's host-side `HostPlan`; `attend` takes it
like any plan), `static_view()` (fixed-shape
storage as block pools and a table, for the paged kernels),
`fill_random(n_tokens, seed)` (random K/V for kernel checks and benchmarks),
`read_bytes(context)` (bytes one decode step reads), `release(row)` (forget one row
and free its storage for another sequence while the others keep theirs) and
`row_bytes(tokens)`, `held_bytes(rows)` and `budget_bytes()` (what one row of that many
tokens holds, what some rows hold now with shared storage counted once, and all rows at
most: a serving engine's KV budget counts them). Nothing outside `cache/` reads a
backend's private state or asks its type.

Before anything is allocated, `planned_bytes(factory, layout, batch_size, capacity)`
sizes the cache a factory would build (each backend's classmethod `planned_bytes`, from
its options alone), so a caller can refuse a cache that cannot fit.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

import torch

from decodelab.cache.tree import Tree, build_tree
from decodelab.models.errors import SetupError


@dataclass(frozen=True)
class CacheLayout:
    """What a cache must know of its model."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    windows: tuple[int | None, ...]  # per layer: sliding window or None
    softmax_scale: float
    softcap: float | None = None
    #: a decode-sized forward over a dense cache attends through the native kernel in eager
    #: code too, as the compiled step does (the model's `shared_kernels`: the same bits both ways)
    native_decode: bool = False

    @classmethod
    def of(cls, model) -> "CacheLayout":
        """The layout of a native `Transformer` (its dtype and device included)."""
        c = model.cfg
        return cls(c.n_layers, c.n_kv_heads, c.head_dim, model.dtype, model.device, c.windows,
                   c.softmax_scale, c.attn_softcap,
                   native_decode=getattr(getattr(model, "model", model), "shared_kernels", False))  # (a wrapper's own)

    def bytes_per_token(self) -> int:
        """K and V of one token over all layers: 2 x layers x kv_heads x head_dim x bytes."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * elem


@dataclass(frozen=True)
class Plan:
    """One forward's attention metadata, as a value: what `KVCache.plan` booked and every
    layer's `attend` reads. Backends extend it with what their attention derives from it
    (`extend`); nothing of it is stored on the cache."""

    positions: torch.Tensor  # [B, T] host: the slot (position) every new token is stored at
    valid: torch.Tensor  # [B, T] bool host: False marks padding
    rows: torch.Tensor | None  # [B] host: the cache row of each row of the forward; None: all, in order
    #: a tree of draft tokens (cache/tree.py): who sees whom and each token's own position;
    #: None: a plain forward, every token at its slot, causal
    tree: Tree | None = field(default=None, kw_only=True)

    def cache_rows(self, batch_size: int) -> torch.Tensor:
        """[B] the cache row of each row of the forward."""
        return torch.arange(batch_size) if self.rows is None else self.rows


def extend(plan: Plan, cls: type, **fields):
    """`plan` as an instance of its subclass `cls`, with `fields` added."""
    return cls(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}, **fields)


@dataclass
class StaticView:
    """A cache's storage at fixed shapes, for a decode step replayed as a CUDA graph
    (decoding/compiled.py): every layer's K and V as the heads-major block pools the paged
    kernels read (cache/kernels/paged.py), and the block table of every row on the device.
    The pools are views of the cache's own storage: writes into them land in the cache."""

    k: list[torch.Tensor]  # per layer [Hkv, N, bs, D]: key blocks
    v: list[torch.Tensor]  # per layer [Hkv, N, bs, D]: value blocks
    table: torch.Tensor  # [B, M] int32 on the device: block of row b's positions [i * bs, (i + 1) * bs)
    block_size: int  # bs
    host_table: torch.Tensor | None = None  # [B, M] the cache's table, edited in place by `plan`; None: fixed

    def refresh(self) -> None:
        """Host -> device: the block table as the cache's last `plan` left it (the blocks
        it allocated); nothing to do for a fixed table. Call it before every step."""
        if self.host_table is not None:
            self.table.copy_(self.host_table, non_blocking=True)


def attention_mask(qpos: torch.Tensor, kpos: torch.Tensor, window: int | None) -> torch.Tensor | None:
    """Boolean mask [B, 1, T, S] (True = attend) for query positions [B, T] over key
    positions [B, S] (-1 marks an empty slot); None when every entry is True.
    Causal: k <= q; window w: q - k < w (the token itself and w - 1 before it)."""
    q, k = qpos[:, :, None], kpos[:, None, :]
    ok = (k <= q) & (k >= 0)
    if window is not None:
        ok &= k > q - window
    return None if bool(ok.all()) else ok[:, None]


def is_plain_causal(qpos: torch.Tensor, kpos: torch.Tensor, window: int | None) -> bool:
    """True when the mask is the square lower triangle (every row's queries are exactly
    its keys, in order, and no window cuts in): SDPA's `is_causal` fast path then applies."""
    T, S = qpos.shape[1], kpos.shape[1]
    return T == S and T > 1 and bool((qpos == kpos).all()) and (window is None or window >= S)


def reference_attention(q, k, v, mask, scale: float, softcap: float | None = None,
                        causal: bool = False) -> torch.Tensor:
    """Plain attention: q [B, Hq, T, D] over k, v [B, Hkv, S, D] (GQA), mask [B, 1, T, S]
    (or `causal` for the square lower triangle)."""
    if softcap is None:
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.tanh((q @ k.transpose(-1, -2)) * scale / softcap) * softcap  # [B, Hq, T, S]
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


class KVCache:
    """Shared bookkeeping: per-row lengths, capacity checks, rollback, byte accounting.

    Subclasses implement `attend`, `nbytes` and their storage; they may extend
    `plan` (returning their own `Plan` subclass), `truncate` and `reset`.
    """

    #: how many tokens a row can roll back after a forward; a declared capability,
    #: checked when a setup is built (speculative decoding needs >= gamma)
    rollback_limit: float = math.inf
    #: True when stored K/V are approximations (quantized); exact backends must agree
    #: with dense to float rounding
    lossy: bool = False
    #: leading positions a windowed layer keeps visible (StreamingLLM attention sinks)
    sink_tokens: int = 0
    #: whether `plan(..., rows=...)` and `release(row)` work (a serving engine needs both),
    #: and, where not, why: a declared capability, checked when an engine is built
    serves_row_subsets: bool = False
    row_subset_reason: str = "its storage is planned for the whole batch at once"
    @classmethod
    def planned_bytes(cls, layout: CacheLayout, batch_size: int, capacity: int, **options) -> int:
        """K/V bytes a cache of these sizes and options holds at most (allocated up front,
        or grown to by `capacity` tokens in every row), computed without allocating: for
        the memory check before a cache is built. Default: the formula at full capacity,
        batch_size x capacity x bytes_per_token (2 x layers x kv_heads x head_dim x bytes);
        a backend that stores less, or more, overrides it. Options it cannot size raise
        the SetupError its constructor would."""
        return batch_size * capacity * layout.bytes_per_token()

    def __init__(self, layout: CacheLayout, batch_size: int, capacity: int):
        reasons = []
        if batch_size < 1:
            reasons.append(f"batch_size must be >= 1, got {batch_size}")
        if capacity < 1:
            reasons.append(f"capacity must be >= 1 token, got {capacity}")
        if reasons:
            raise SetupError(reasons)
        self.layout, self.batch_size, self.capacity = layout, batch_size, capacity
        self.lengths = torch.zeros(batch_size, dtype=torch.long)  # [B] tokens cached per row

    # -- called by the model -------------------------------------------------------
    def plan(self, positions: torch.Tensor, valid: torch.Tensor | None = None,
             rows: list[int] | torch.Tensor | None = None, parents=None) -> Plan:
        """Book a forward over positions [B, T] (or [b, T] of the cache `rows` [b]; `valid`
        False marks padding) and return its `Plan`. Each row's length becomes its last
        valid position + 1 (rows with none keep theirs). Backends extend the plan with what
        their attention reads and do their own bookkeeping (cache/base.py's docstring).
        With `parents` ([T] or [B, T]: each token's parent in the forward, -1 a root) the
        forward is a tree of draft tokens (cache/tree.py): `positions` are the tokens' depths
        past each row's length, they are stored at slots length + t, and each sees its
        ancestors; `keep_branch` then keeps one path."""
        pos = positions.detach().cpu()
        sel = self._selection(rows, pos.shape[0])
        tree = None
        if parents is not None:
            if valid is not None and not bool(valid.all()):
                raise SetupError("a tree forward has no padding: give each row the same tree (parents [T]) or "
                                 "one per row ([B, T]) with every token valid")
            tree = build_tree(parents, self.lengths if sel is None else self.lengths[sel], pos)
            pos = tree.start[:, None] + torch.arange(pos.shape[1])  # [B, T] slots: after what each row holds
        top = int(pos.max())
        if top >= self.capacity:
            raise SetupError(f"position {top} does not fit in a cache of {self.capacity} tokens per row; "
                             "build the cache with a larger capacity (prompt + max_new_tokens)")
        ok = torch.ones_like(pos, dtype=torch.bool) if valid is None else valid.detach().cpu()
        last = torch.where(ok, pos, -1).max(dim=1).values + 1  # [b]
        held = self.lengths if sel is None else self.lengths[sel]
        new = torch.where(last > 0, last, held)
        if sel is None:
            self.lengths = new
        else:
            self.lengths = self.lengths.clone()
            self.lengths[sel] = new
        return Plan(pos, ok, sel, tree=tree)

    def book(self, positions: torch.Tensor) -> None:
        """A forward's host bookkeeping alone (lengths, blocks, ring slots, ...), for a
        compiled step that attends through its own `static_plan`. Default: `plan`, whose
        value is dropped."""
        self.plan(positions)

    def _selection(self, rows, n: int) -> torch.Tensor | None:
        """`rows` as a [b] tensor of distinct cache rows for a forward of n rows (None: all
        rows, which n must equal); refused by backends that cannot serve a subset."""
        if rows is None:
            if n != self.batch_size:
                raise SetupError(f"batch of {n} rows for a cache built for {self.batch_size}; "
                                 "build the cache with the batch size you run")
            return None
        sel = torch.as_tensor(rows, dtype=torch.long).cpu().reshape(-1)
        if sel.numel() != n or sel.unique().numel() != n or bool(((sel < 0) | (sel >= self.batch_size)).any()):
            raise SetupError(f"rows {sel.tolist()} must name {n} distinct rows of the {self.batch_size} this "
                             "cache holds, one per row of the forward")
        if not self.serves_row_subsets:
            raise self.refusal("run a forward over a subset of its rows (continuous batching)",
                               self.row_subset_reason)
        return None if n == self.batch_size and bool((sel == torch.arange(n)).all()) else sel

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan) -> torch.Tensor:
        """Store the valid new k, v [B, Hkv, T, D] at the positions `plan` booked and return
        attention [B, Hq, T, D] of q [B, Hq, T, D] over the row's visible keys."""
        raise NotImplementedError

    def window(self, layer: int) -> int | None:
        """The window this backend applies to a layer: the model's own, unless the backend
        imposes one (an approximation it must label)."""
        return self.layout.windows[layer]

    def read(self, layer: int, row: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What a row holds now in one layer, in position order: positions [N],
        k [Hkv, N, D], v [Hkv, N, D] (dequantized where the backend quantizes)."""
        raise NotImplementedError

    # -- called by prefill: prefix caching (backends that share prompt blocks override) --
    def reuse_prefix(self, prompts: list[list[int]], rows: list[int] | None = None) -> list[int]:
        """Before prefill (rows empty): map cached prompt prefixes into each row (every row
        in order, or `rows`) and return how many tokens of each prompt are already cached
        (at most len - 1, so the last prompt position is always computed). Default: no
        prefix cache."""
        return [0] * len(prompts)

    def remember_prefix(self, prompts: list[list[int]], rows: list[int] | None = None) -> None:
        """After prefill: offer each row's prompt blocks for reuse. Default: nothing."""

    # -- called by decoders --------------------------------------------------------
    def keep_branch(self, row: int, start: int, branch: list[int], parents: list[int]) -> None:
        """After a tree forward stored its T tokens at slots [start, start + T) of `row`
        (`plan(..., parents=)`; `parents` [T]: that row's tree), keep the tokens `branch`
        (tree indices along one path from a root, root first) at slots start, start + 1,
        ... (their positions) and drop the rest: the row's length becomes start +
        len(branch), as if the branch had been decoded token by token (a rollback of
        T - len(branch) tokens). A branch that is not such a path is refused."""
        n, b, par = int(self.lengths[row]) - start, list(branch), [int(p) for p in parents]
        path = len(par) == n and all(0 <= t < n for t in b) and (not b or par[b[0]] == -1) and all(
            par[y] == x for x, y in zip(b, b[1:]))
        if not path:
            raise SetupError(f"branch {b} must be a path from a root of the tree forward (parents {par}) that row "
                             f"{row} holds from slot {start}: each token the child of the one before it")
        moves = [(start + t, start + i) for i, t in enumerate(b) if t != i]  # dst < src: in order, no clobbering
        if moves:
            self._move_slots(row, [m[0] for m in moves], [m[1] for m in moves])
        new = self.lengths.clone()
        new[row] = start + len(b)
        self.truncate(new)

    def _move_slots(self, row: int, src: list[int], dst: list[int]) -> None:
        """Copy the K/V of slots `src` of a row to slots `dst` (each dst < its src), every
        layer: a backend that can keep a branch of a tree implements it."""
        raise self.refusal("keep one branch of a tree of draft tokens", "it cannot move a row's K/V between slots")

    def truncate(self, lengths) -> None:
        """Roll rows back to `lengths` [B] (each <= its current length)."""
        new = torch.as_tensor(lengths, dtype=torch.long).cpu().reshape(-1)
        if new.shape[0] != self.batch_size or bool((new > self.lengths).any()) or bool((new < 0).any()):
            raise SetupError(f"truncate to {new.tolist()} is invalid for lengths {self.lengths.tolist()}: "
                             "each row can only roll back, never forward")
        if bool((self.lengths - new > self.rollback_limit).any()):
            raise SetupError(f"rolling back {(self.lengths - new).max()} tokens exceeds this cache's "
                             f"rollback_limit of {self.rollback_limit}")
        self.lengths = new

    def reset(self) -> None:
        """Forget every row (storage is kept for reuse)."""
        self.lengths = torch.zeros(self.batch_size, dtype=torch.long)

    def nbytes(self) -> int:
        """Bytes this cache really allocated."""
        raise NotImplementedError

    # -- capabilities: what decoders, experiments and kernels may ask of any backend ------
    def refusal(self, what: str, why: str) -> SetupError:
        """The error for a capability this backend lacks, naming it and saying why."""
        return SetupError(f"the {type(self).__name__} backend cannot {what}: {why}")

    def static_plan(self, tokens: int = 1, impl: str = "auto"):
        """The plan of a compiled decode step of `tokens` tokens per row, every row
        (cache/static.py): `attend` takes it like a `Plan`. Default: a fixed-shape
        `StaticPlan` over `static_view()`'s storage, attended whole, masked by position
        (refused where the backend has none); int4 overrides it with a `HostPlan`."""
        from decodelab.cache.static import StaticPlan

        return StaticPlan(self.layout, self.batch_size, self.capacity, tokens, impl, storage=self.static_view())

    def static_view(self) -> StaticView:
        """Its storage at fixed shapes, for the static (CUDA-graph) decode step: per-layer
        K/V block pools [Hkv, N, bs, D] and a [B, M] block table on the device. Default:
        refused (a backend whose storage shape changes on the host cannot offer one)."""
        raise self.refusal("give a fixed-shape view for the static decode step",
                           "it declares no fixed-shape storage")

    def fill_random(self, n_tokens: int, seed: int = 0) -> None:
        """Forget every row, then make each hold positions [0, n_tokens) of random K/V
        (standard normal, drawn on the cache's device from `seed`), with the bookkeeping a
        prefill of them leaves: for kernel checks and benchmarks, whose speed does not
        depend on the values. Default: one forward of random q, k, v through `plan`
        and `attend` (its attention is computed and dropped); backends with plain storage
        draw it directly instead."""
        self.reset()
        lay, g = self.layout, torch.Generator(device=self.layout.device).manual_seed(seed)
        plan = self.plan(torch.arange(n_tokens).expand(self.batch_size, -1))
        shape = (self.batch_size, lay.n_kv_heads, n_tokens, lay.head_dim)  # [B, Hkv, T, D]
        for layer in range(lay.n_layers):
            q, k, v = (torch.randn(shape, generator=g, device=lay.device).to(lay.dtype) for _ in range(3))
            self.attend(layer, q, k, v, plan)

    def release(self, row: int) -> None:
        """Forget one row and free its storage for the next sequence; the other rows keep
        theirs (a serving engine reuses the row for a new request). Refused by a backend
        that does not declare `serves_row_subsets`."""
        if not self.serves_row_subsets:
            raise self.refusal("release one row for a new sequence (continuous batching)", self.row_subset_reason)
        self.lengths = self.lengths.clone()
        self.lengths[row] = 0

    def token_bytes(self) -> int:
        """K and V of one token, every layer, as stored. Default: the layout's dtype
        (`bytes_per_token`); a backend that stores another dtype overrides it."""
        return self.layout.bytes_per_token()

    def row_bytes(self, tokens: int) -> int:
        """K/V bytes one row holding `tokens` tokens takes: what a serving engine's KV budget
        counts per request. Default: the formula, tokens x token_bytes."""
        return tokens * self.token_bytes()

    def held_bytes(self, rows: list[int]) -> int:
        """K/V bytes these rows hold now, storage shared between them counted once: what a
        serving engine's KV budget is charged. Default: `row_bytes` of each row's length."""
        return sum(self.row_bytes(int(self.lengths[r])) for r in rows)

    def budget_bytes(self) -> int:
        """The most K/V bytes this cache can hold, every row together: a serving engine's
        default KV budget. Default: what it allocated (`nbytes`); a backend whose storage
        grows overrides it."""
        return self.nbytes()

    def read_bytes(self, context: int) -> int:
        """K/V bytes one decode step reads when every row holds `context` tokens: each
        layer's visible tokens (at most its window), K and V, every row, in the
        stored dtype (2 x Hkv x D x bytes per token and layer, `token_bytes`). Backends that
        store K/V in another form override it."""
        lay = self.layout
        tokens = sum(min(context, self.window(layer) or context) for layer in range(lay.n_layers))
        return self.batch_size * tokens * self.token_bytes() // lay.n_layers

    def theoretical_bytes(self) -> int:
        """2 x layers x kv_heads x tokens x head_dim x bytes (as stored), tokens summed over rows."""
        return int(self.lengths.sum()) * self.token_bytes()

    def memory_report(self) -> dict:
        """Bytes allocated, bytes by the formula and tokens held (backends add their own)."""
        return {"kv_bytes_allocated": self.nbytes(), "kv_bytes_formula": self.theoretical_bytes(),
                "kv_tokens": int(self.lengths.sum())}


def planned_bytes(factory, layout: CacheLayout, batch_size: int, capacity: int) -> int:
    """The `planned_bytes` of the cache `factory(layout, batch_size, capacity)` would build,
    without building it. `factory` is a backend class or a `functools.partial` of one (what
    the cache configs instantiate); any other callable is sized as dense (every position of
    every row in the layout's dtype)."""
    func, args, options = factory, (), {}
    if isinstance(factory, functools.partial):
        func, args, options = factory.func, factory.args, factory.keywords
    if isinstance(func, type) and issubclass(func, KVCache):
        return func.planned_bytes(layout, batch_size, capacity, *args, **options)
    return KVCache.planned_bytes(layout, batch_size, capacity)
