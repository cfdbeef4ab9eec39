"""`paged`: a block pool per layer, per-row block tables, a free list, prefix sharing.

Position p of row b lives in block `table[b, p // block_size]` at offset
`p % block_size`; one block id names the same slot range in every layer's pool. Blocks
are allocated in `plan` for valid (non-padding) positions only, and go back to the
free list when a row is truncated below them or reset. A freed block keeps its prefix
hash, so a later prompt that starts with the same full blocks maps them instead of
recomputing them, until the free list hands the block out again (least recently freed
first). A block shared by several rows is copied before it is written (copy-on-write).

Attention is a pure-torch reference: `plan` builds, once per forward, the flat pool
indices that each layer writes and, per window, what that window can see, which every
layer of that window reads: gather those blocks into
contiguous [B, Hkv, S, D] keys and values, or, for one row whose visible blocks are
consecutive in the pool (the allocator prefers the block after a row's last one), read
them as a strided view with no copy, as dense does. For that view each layer's pool is
stored heads-major, [Hkv, N, bs, D], and exposed as the [N, Hkv, bs, D] block view.
With `impl: triton` (the default on CUDA, cache/kernels/dispatch.py) a decode-sized forward
skips that plan: the Triton kernel of cache/kernels/paged.py reads the blocks in place
through the block table; prefill always takes the reference.

`kv_dtype` stores K and V as bfloat16, float16 or float8 e4m3 (with a scale per layer and kv
head), as dense's does (cache/dense.py `StoredKV`): on a CPU a decode-sized forward then
reads the blocks in place through decodelab's native kernel (models/native.py
`paged_decode_attention`), prefills and trees gather the blocks and widen them; the Triton
kernel reads the model's dtype only, so on CUDA such a cache takes the reference.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import torch

from decodelab.cache.base import (CacheLayout, KVCache, Plan, StaticView, attention_mask, extend,
                                  is_plain_causal, reference_attention)
from decodelab.cache.dense import StoredKV, kv_dtype_problems, scale_bytes, storage_dtype, stored_token_bytes
from decodelab.cache.kernels.dispatch import DECODE_QUERIES, impl_problems, resolve_impl, split_count
from decodelab.cache.kernels.paged import paged_attention_triton
from decodelab.cache.static import StaticPlan
from decodelab.cache.tree import tree_visible
from decodelab.models.errors import PoolExhausted, SetupError, raise_if


class BlockAllocator:
    """Free list (least recently freed first), reference counts and prefix hashes of a
    pool of `n` blocks. No tensors: pure bookkeeping."""

    def __init__(self, n: int):
        self.refs = [0] * n  # rows (table entries) that map each block
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(n))
        self.by_hash: dict[int, int] = {}  # prefix chain hash -> block
        self.hash_of: dict[int, int] = {}  # block -> its prefix chain hash

    @property
    def in_use(self) -> int:
        return len(self.refs) - len(self.free)

    def take(self, prefer: int = -1) -> int:
        """A fresh block (refcount 1): `prefer` when it is free and caches no prefix, else
        the least recently freed one (a cached prefix it held is forgotten)."""
        if prefer in self.free and prefer not in self.hash_of:
            del self.free[prefer]
            self.refs[prefer] = 1
            return prefer
        blk, _ = self.free.popitem(last=False)
        self.forget(blk)
        self.refs[blk] = 1
        return blk

    def retain(self, blk: int) -> None:
        """One more table entry maps `blk` (revived from the free list if it was there)."""
        if self.refs[blk] == 0:
            del self.free[blk]
        self.refs[blk] += 1

    def release(self, blk: int) -> None:
        """One table entry fewer; at zero the block is free but keeps its hash."""
        self.refs[blk] -= 1
        if self.refs[blk] == 0:
            self.free[blk] = None

    def forget(self, blk: int) -> None:
        """Drop the block's prefix hash (its content is about to change)."""
        h = self.hash_of.pop(blk, None)
        if h is not None:
            del self.by_hash[h]

    def register(self, h: int, blk: int) -> None:
        """Offer `blk` as the block of prefix hash `h` (the first one offered wins)."""
        if h not in self.by_hash and blk not in self.hash_of:
            self.by_hash[h], self.hash_of[blk] = blk, h


def chain_hashes(prompt: list[int], block_size: int) -> list[int]:
    """One hash per full block of the prompt: hash(parent hash, the block's token ids)."""
    hashes, h = [], 0
    for s in range(0, len(prompt) - block_size + 1, block_size):
        h = hash((h, tuple(int(t) for t in prompt[s:s + block_size])))
        hashes.append(h)
    return hashes


def waste_report(lengths: list[int], block_size: int = 16, bytes_per_token: int = 1) -> dict:
    """Slots allocated but unused for sequences of `lengths` tokens: paged (each row
    rounded up to whole blocks) against dense preallocation to the longest length."""
    tokens = sum(lengths)
    paged = sum(math.ceil(n / block_size) * block_size for n in lengths)
    dense = len(lengths) * max(lengths)
    return {"tokens": tokens, "paged_bytes": paged * bytes_per_token, "dense_bytes": dense * bytes_per_token,
            "paged_waste_fraction": (paged - tokens) / paged, "dense_waste_fraction": (dense - tokens) / dense}


def pool_size(block_bytes: int, block_size: int, batch_size: int, capacity: int, num_blocks: int | None,
              budget_mb: float | None) -> tuple[int, list[str]]:
    """Blocks in the pool (given, from the budget, or one full row per batch row), and
    every reason that sizing cannot work; `block_bytes` is K and V of one block, all layers."""
    bs, p = block_size, []
    if num_blocks is not None and budget_mb is not None:
        p.append(f"give num_blocks ({num_blocks}) or memory_budget_mb ({budget_mb}), not both")
    if bs < 1:
        return 0, p + [f"block_size must be >= 1 token, got {bs}"]
    row = math.ceil(max(capacity, 1) / bs)  # blocks one row of `capacity` tokens needs
    if num_blocks is None and budget_mb is not None:
        num_blocks = int(budget_mb * 2**20 // block_bytes)  # MiB
    if num_blocks is None:
        num_blocks = max(batch_size, 1) * row
    if num_blocks < 1:
        p.append(f"num_blocks must be >= 1, got {num_blocks} (a block is {block_bytes} bytes)")
    elif num_blocks < row:
        p.append(f"a pool of {num_blocks} blocks x {bs} tokens cannot hold one row of capacity {capacity} "
                 f"({row} blocks, {row * block_bytes} bytes); raise num_blocks / memory_budget_mb "
                 "or lower the capacity")
    return num_blocks, p


@dataclass(frozen=True)
class _Reads:
    """What one window's layers read in a forward."""

    gather: torch.Tensor | None  # [B * Hkv * S] rows of the flat pool [Hkv * N * bs, D], or
    run: tuple[int, int, int] | None  # (B == 1) first block, consecutive blocks, offset of slot 0
    keys: int  # S key slots per row
    mask: torch.Tensor | None  # [B, 1, T, S] True = attend; None = all
    causal: bool  # keys are exactly this forward's tokens, square lower triangle


@dataclass(frozen=True)
class PagedPlan(Plan):
    """A paged forward: the flat pool rows it writes and what each window reads (or the
    Triton kernel's arguments, for a decode-sized forward on CUDA)."""

    wdst: torch.Tensor  # [K] destination rows of the flat pool [Hkv * N * bs, D] (device)
    wsrc: torch.Tensor | None  # [K] rows of the new K/V [B * T * Hkv, D] they take; None: all, in order
    reads: dict  # window -> _Reads (empty when the kernel reads)
    kernel: tuple | None  # (table [B, M], qpos [B, T], lengths [B], splits) for the Triton kernel
    native: tuple | None  # (table [B, M], qpos [B, T]) for the native kernel (another storage dtype, CPU)


class PagedCache(StoredKV, KVCache):
    """Block-pool KV cache with prefix sharing and copy-on-write."""

    serves_row_subsets = True  # a row is its block table: released blocks return to the free list

    def __init__(self, layout: CacheLayout, batch_size: int, capacity: int, block_size: int = 16,
                 num_blocks: int | None = None, memory_budget_mb: float | None = None,
                 prefix_caching: bool = True, impl: str = "auto", kv_dtype: str = "auto"):
        reasons = impl_problems(impl, layout.device) + kv_dtype_problems(kv_dtype)
        try:
            super().__init__(layout, batch_size, capacity)
        except SetupError as e:
            reasons = e.reasons + reasons
        self.block_size = block_size
        ok = not kv_dtype_problems(kv_dtype)
        self.block_bytes = stored_token_bytes(layout, kv_dtype if ok else "auto") * block_size  # K, V, all layers
        n, more = pool_size(self.block_bytes, block_size, batch_size, capacity, num_blocks, memory_budget_mb)
        if ok and impl == "triton" and storage_dtype(layout, kv_dtype) != layout.dtype:
            more.append(f"impl=triton reads K/V in the model's dtype ({str(layout.dtype).removeprefix('torch.')}); "
                        f"kv_dtype={kv_dtype} needs impl=reference (or auto, which takes it)")
        raise_if(reasons + more)
        self._storage(kv_dtype)
        self.num_blocks, self.prefix_caching = n, prefix_caching
        self.impl = resolve_impl(impl, layout.device)  # decode attention: cache/kernels/dispatch.py
        if self.kv_dtype != layout.dtype:  # the Triton kernel reads the model's dtype only
            self.impl = "reference"
        shape = (layout.n_kv_heads, n, block_size, layout.head_dim)
        kw = dict(dtype=self.kv_dtype, device=layout.device)
        self._kh = [torch.zeros(shape, **kw) for _ in range(layout.n_layers)]  # [Hkv, N, bs, D] storage
        self._vh = [torch.zeros(shape, **kw) for _ in range(layout.n_layers)]
        self.k = [t.transpose(0, 1) for t in self._kh]  # [N, Hkv, bs, D] block views
        self.v = [t.transpose(0, 1) for t in self._vh]
        # [Hkv * N * bs, D] flat views for index copies (fp8: of its bytes, which torch's CPU index_copy_ takes)
        flat = lambda t: t.view(-1, layout.head_dim).view(torch.uint8 if self.fp8 else t.dtype)  # noqa: E731
        self._kflat = [flat(t) for t in self._kh]
        self._vflat = [flat(t) for t in self._vh]
        # [B, M] block of each row's positions [i * bs, (i + 1) * bs), -1: none; only ever edited in place
        self.table = torch.full((batch_size, math.ceil(capacity / block_size)), -1, dtype=torch.long)
        self.alloc = BlockAllocator(n)
        self.prefix_reused_tokens = 0

    @classmethod
    def planned_bytes(cls, layout: CacheLayout, batch_size: int, capacity: int, block_size: int = 16,
                      num_blocks: int | None = None, memory_budget_mb: float | None = None,
                      prefix_caching: bool = True, impl: str = "auto", kv_dtype: str = "auto") -> int:
        """The pool the constructor allocates: num_blocks x block_size x bytes per token at
        the storage dtype (num_blocks given, from the budget, or one full row per batch row);
        fp8: plus its scales."""
        raise_if(kv_dtype_problems(kv_dtype))
        block_bytes = stored_token_bytes(layout, kv_dtype) * block_size
        n, reasons = pool_size(block_bytes, block_size, batch_size, capacity, num_blocks, memory_budget_mb)
        raise_if(reasons)
        return n * block_bytes + scale_bytes(layout, kv_dtype)

    # -- called by the model -------------------------------------------------------
    def plan(self, positions: torch.Tensor, valid: torch.Tensor | None = None, rows=None,
             parents=None) -> PagedPlan:
        """Book a forward: give every valid position a private block slot (allocated, or
        copied where shared); plan its write indices and each window's reads. Raises
        PoolExhausted (a SetupError), with nothing changed, when the pool cannot supply
        the blocks."""
        base = self._book(positions, valid, rows, parents)
        srows = base.cache_rows(self.batch_size)  # [b] cache rows
        wdst, wsrc = self._write_index(base.positions, base.valid, srows)
        # kernel-sized and causal: a prefill or a tree of drafts takes the reference
        decode = base.positions.shape[1] <= DECODE_QUERIES and base.tree is None
        kernel = self._kernel_inputs(base.positions, srows) if self.impl == "triton" and decode else None
        native = (self.table[srows], base.positions) if self.native_read and decode else None
        reads = {} if kernel is not None or native is not None else {
            w: self._reads(base, srows, w) for w in set(self.layout.windows)}
        return extend(base, PagedPlan, wdst=wdst, wsrc=wsrc, reads=reads, kernel=kernel, native=native)

    def book(self, positions: torch.Tensor) -> None:
        """The host bookkeeping alone (lengths, blocks), for a compiled step."""
        self._book(positions)

    def _book(self, positions: torch.Tensor, valid=None, rows=None, parents=None) -> Plan:
        """Lengths, then a private block slot for every valid position (refused, with the
        lengths restored, when the pool cannot supply them); the base plan."""
        before = self.lengths
        base = super().plan(positions, valid, rows, parents)
        try:
            self._claim(*self._targets(base.positions, base.valid, base.cache_rows(self.batch_size)))
        except SetupError:
            self.lengths = before
            raise
        return base

    def _kernel_inputs(self, qpos: torch.Tensor, r: torch.Tensor) -> tuple:
        """The Triton kernel's per-forward arguments: block table [B, M], query positions
        [B, T] and lengths [B] on the device, and its split-K count for the longest row."""
        dev, hkv = self.layout.device, self.layout.n_kv_heads
        splits = split_count(len(r) * hkv, int(self.lengths[r].max()), dev)
        return (self.table[r].to(dev, torch.int32), qpos.to(dev, torch.int32),
                self.lengths[r].to(dev, torch.int32), splits)

    def _targets(self, pos: torch.Tensor, ok: torch.Tensor, srows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [K] and block indices [K] that a forward's valid positions pos [b, T] write."""
        M = self.table.shape[1]
        flat = srows[:, None] * M + pos // self.block_size  # [b, T]
        keys = flat[ok].unique()  # [K]
        return keys // M, keys % M

    def _claim(self, rows: torch.Tensor, idx: torch.Tensor) -> None:
        """Make each (row, block index) target [K] a block that row alone maps: allocate
        where there is none, copy where it is shared. Raises, changing nothing, when the
        free list is too short."""
        blocks = self.table[rows, idx].tolist()
        need = self._blocks_needed(blocks)
        if need > len(self.alloc.free):
            raise PoolExhausted(self._exhausted(need))
        new: dict[tuple[int, int], int] = {}
        copies = []
        for (b, i), blk in zip(zip(rows.tolist(), idx.tolist()), blocks):
            if blk >= 0 and self.alloc.refs[blk] == 1:  # the row's own block: its content changes,
                self.alloc.forget(blk)  # so the prefix hash it may carry no longer holds
                new[b, i] = blk
                continue
            prev = new[b, i - 1] if (b, i - 1) in new else (int(self.table[b, i - 1]) if i else -1)
            new[b, i] = self.alloc.take(prev + 1 if prev >= 0 else -1)  # keep rows consecutive
            if blk >= 0:  # copy-on-write: the other sharers keep `blk`
                copies.append((blk, new[b, i]))
                self.alloc.release(blk)
        self.table[rows, idx] = torch.tensor(list(new.values()), dtype=torch.long)
        if copies:
            self._copy_blocks(*zip(*copies))

    def _blocks_needed(self, blocks: list[int]) -> int:
        """Fresh blocks that claiming `blocks` takes (the last sharer of a block keeps it)."""
        need, copied = 0, {}
        for blk in blocks:
            if blk < 0:
                need += 1
            elif self.alloc.refs[blk] - copied.get(blk, 0) > 1:
                need += 1
                copied[blk] = copied.get(blk, 0) + 1
        return need

    def _exhausted(self, need: int) -> str:
        """Why the pool cannot serve this forward, with the numbers and the fixes."""
        a = self.alloc
        return (f"the paged KV pool is exhausted: this forward needs {need} new blocks of {self.block_size} "
                f"tokens but only {len(a.free)} of {self.num_blocks} are free ({a.in_use} in use, "
                f"{self.block_bytes} bytes each); build the cache with more num_blocks or a larger "
                f"memory_budget_mb, or run a smaller batch / shorter sequences")

    def _copy_blocks(self, src: tuple[int, ...], dst: tuple[int, ...]) -> None:
        """Copy blocks src -> dst in every layer's K and V pool."""
        s = torch.tensor(src, device=self.layout.device)
        d = torch.tensor(dst, device=self.layout.device)
        for pool in self.k + self.v:
            pool = pool.view(torch.uint8) if self.fp8 else pool  # fp8: its bytes (torch's CPU index_copy_)
            pool.index_copy_(0, d, pool.index_select(0, s))

    def _flat_rows(self, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Rows of the flat pool [Hkv * N * bs, D] for (block, offset) pairs [B, X]:
        (h * N + blk) * bs + off, heads inserted as dim 1 -> [B, Hkv, X]."""
        h = torch.arange(self.layout.n_kv_heads)[None, :, None]  # [1, Hkv, 1]
        return (h * self.num_blocks + blocks[:, None]) * self.block_size + offsets[:, None]

    def _write_index(self, pos: torch.Tensor, ok: torch.Tensor, srows: torch.Tensor):
        """Destination rows of the flat pool for every valid (b, t, head), in k.transpose(1, 2)'s
        [B, T, Hkv] order, and the source rows to pick when some positions are padding."""
        blocks = self.table[srows].gather(1, pos // self.block_size).clamp(min=0)  # [b, T]
        dst = self._flat_rows(blocks, pos % self.block_size).transpose(1, 2)  # [B, T, Hkv]
        dev = self.layout.device
        if bool(ok.all()):
            return dst.reshape(-1).to(dev), None
        src = torch.arange(dst.numel()).view(dst.shape)  # [B, T, Hkv]
        return dst[ok].reshape(-1).to(dev), src[ok].reshape(-1).to(dev)

    def _reads(self, plan: Plan, srows: torch.Tensor, window: int | None) -> _Reads:
        """What the window reads in a forward: per row, the key slots from its first visible
        position to its last valid query; slots that hold nothing get position -1 in the mask."""
        q, ok = plan.positions, plan.valid  # [B, T]
        lo, hi = self._visible(q, ok, srows, window, None if plan.tree is None else plan.tree.positions)
        S = int((hi - lo).max()) + 1
        kpos = lo[:, None] + torch.arange(S)  # [B, S]
        blocks = self.table[srows].gather(1, kpos.clamp(max=self.capacity - 1) // self.block_size)  # [b, S]
        held = (kpos <= hi[:, None]) & (blocks >= 0)
        kpos = torch.where(held, kpos, -1)
        run = self._run(srows, lo, hi) if bool(ok.all()) else None
        gather = None
        if run is None:
            offsets = torch.where(held, kpos % self.block_size, 0)
            gather = self._flat_rows(torch.where(held, blocks, 0), offsets).reshape(-1).to(self.layout.device)
        if plan.tree is not None:  # from their own positions, seeing their ancestors
            return _Reads(gather, run, S, tree_visible(plan.tree, kpos, window)[:, None].to(self.layout.device), False)
        causal = bool(ok.all()) and is_plain_causal(q, kpos, window)
        mask = None if causal else self._mask(q, kpos, window, ok)
        return _Reads(gather, run, S, mask, causal)

    def _visible(self, q: torch.Tensor, ok: torch.Tensor, srows: torch.Tensor, window: int | None,
                 own: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row [B], the first position the window shows any valid query (queries at
        slots q, reading from positions `own`, a tree's depths; None: q) and the last valid
        query's slot (a row with none: what it holds)."""
        hi = torch.where(ok, q, -1).max(1).values  # [B]
        first = torch.where(ok, q if own is None else own, self.capacity).min(1).values
        empty = hi < 0
        hi = torch.where(empty, (self.lengths[srows] - 1).clamp(min=0), hi)
        first = torch.where(empty, hi, first)
        lo = torch.zeros_like(hi) if window is None else (first - window + 1).clamp(min=0)
        return lo, hi

    def _run(self, srows: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> tuple[int, int, int] | None:
        """For one row whose visible blocks are consecutive pool blocks: (first block,
        blocks, offset of lo in the first), to read as a view; else None."""
        if len(srows) != 1:
            return None
        first, last = int(lo[0]) // self.block_size, int(hi[0]) // self.block_size
        ids = self.table[int(srows[0]), first:last + 1]  # [nb]
        if int(ids[0]) < 0 or not bool((ids[1:] - ids[:-1] == 1).all()):
            return None
        return int(ids[0]), last - first + 1, int(lo[0]) % self.block_size

    def _mask(self, q: torch.Tensor, kpos: torch.Tensor, window: int | None, ok: torch.Tensor):
        """attention_mask on real key positions; padding queries attend to every gathered
        slot (their outputs are never used; this keeps them finite)."""
        mask = attention_mask(q, kpos, window)  # [B, 1, T, S] or None
        if mask is not None and not bool(ok.all()):
            mask = mask | ~ok[:, None, :, None]
            mask = None if bool(mask.all()) else mask
        return None if mask is None else mask.to(self.layout.device)

    def attend(self, layer, q, k, v, plan: PagedPlan):
        """Write the valid new k, v [B, Hkv, T, D] into the rows' blocks, then attend q
        [B, Hq, T, D] over the gathered keys of the layer's window (a compiled step's
        `StaticPlan`: through the block table, every block a row maps)."""
        if isinstance(plan, StaticPlan):
            return plan.call(plan.attend_pools, layer, q, k, v, *((self._scales(layer),) if self.fp8 else ()))
        D = self.layout.head_dim
        k_new, v_new = self._stored(layer, k, v) if self.kv_dtype != k.dtype else (k, v)
        for flat, new in ((self._kflat[layer], k_new), (self._vflat[layer], v_new)):
            src = new.transpose(1, 2).reshape(-1, D).view(flat.dtype)  # [B * T * Hkv, D]
            if plan.wsrc is not None:
                src = src.index_select(0, plan.wsrc)
            flat.index_copy_(0, plan.wdst, src)
        scale, cap = self.layout.softmax_scale, self.layout.softcap
        if plan.native is not None:  # another storage dtype on a CPU: the native kernel reads it in place
            from decodelab.models import native

            table, qpos = plan.native
            return native.paged_decode_attention(q, self._kh[layer], self._vh[layer], table, qpos, scale,
                                                 self.layout.windows[layer], *self._scales(layer))
        if plan.kernel is not None:  # decode-sized: the kernel reads the blocks in place
            table, qpos, lengths, splits = plan.kernel
            return paged_attention_triton(q, self._kh[layer], self._vh[layer], table, qpos, lengths, scale,
                                          self.layout.windows[layer], cap, splits)
        r = plan.reads[self.layout.windows[layer]]
        if r.causal and not self.lossy:  # the keys are exactly the new tokens (as stored, when that is exact)
            return reference_attention(q, k, v, None, scale, cap, causal=True)
        keys, values = self._readable(layer, *self._keys(layer, r))
        return reference_attention(q, keys, values, r.mask, scale, cap, r.causal)

    def _keys(self, layer: int, r: _Reads) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, Hkv, S, D] the window reads: a view of consecutive blocks
        (one row), or a gather of each row's slots."""
        Hkv, D = self.layout.n_kv_heads, self.layout.head_dim
        if r.gather is None:
            a, nb, off = r.run  # [Hkv, nb, bs, D] -> [1, Hkv, S, D] without a copy
            return tuple(t[:, a:a + nb].reshape(Hkv, -1, D)[None, :, off:off + r.keys]
                         for t in (self._kh[layer], self._vh[layer]))
        shape = (r.gather.numel() // (Hkv * r.keys), Hkv, r.keys, D)
        return (self._kflat[layer].index_select(0, r.gather).view(self.kv_dtype).view(shape),
                self._vflat[layer].index_select(0, r.gather).view(self.kv_dtype).view(shape))

    def _move_slots(self, row: int, src: list[int], dst: list[int]) -> None:
        """Copy slots src -> dst of a row through its block table, every layer's pool."""
        s, d = torch.tensor(src), torch.tensor(dst)
        at = [self._flat_rows(self.table[row, x // self.block_size][None], (x % self.block_size)[None]).reshape(-1)
              .to(self.layout.device) for x in (s, d)]  # [Hkv * X] rows of the flat pool
        for flat in self._kflat + self._vflat:
            flat.index_copy_(0, at[1], flat.index_select(0, at[0]))

    def read(self, layer, row):
        """Positions [n], k and v [Hkv, n, D] of a row, gathered from its blocks."""
        n = int(self.lengths[row])
        blocks = self.table[row, :math.ceil(n / self.block_size)].to(self.layout.device)  # [nb]
        Hkv, D = self.layout.n_kv_heads, self.layout.head_dim
        k, v = (t[:, blocks].reshape(Hkv, -1, D)[:, :n] for t in (self._kh[layer], self._vh[layer]))
        k, v = self._readable(layer, k[None], v[None])
        return torch.arange(n), k[0], v[0]

    # -- called by prefill: prefix caching -----------------------------------------
    def reuse_prefix(self, prompts: list[list[int]], rows: list[int] | None = None) -> list[int]:
        """Map each prompt's cached full blocks (chain-hash hits) into its row (every row in
        order, or `rows`, which are emptied first); returns the tokens reused per prompt (at
        most len - 1: the last position is always computed). `prefix_reused_tokens` counts
        the tokens mapped beyond what each row held (a serving engine maps a waiting
        request's prompt again as more of it gets cached)."""
        rows = list(range(self.batch_size)) if rows is None else list(rows)
        held = [int(self.lengths[row]) for row in rows]
        for row in rows:
            self.release(row)
        reused = [self._map_prefix(b, p) if self.prefix_caching else 0 for b, p in zip(rows, prompts)]
        self.lengths = self.lengths.clone()
        self.lengths[rows] = torch.tensor(reused, dtype=torch.long)
        self.prefix_reused_tokens += sum(max(0, r - h) for r, h in zip(reused, held))
        return reused

    def _map_prefix(self, row: int, prompt: list[int]) -> int:
        """Map the cached full blocks the prompt starts with into `row`; tokens reused."""
        mapped = 0
        for i, h in enumerate(chain_hashes(prompt[:self.capacity], self.block_size)):
            blk = self.alloc.by_hash.get(h)
            if blk is None or mapped >= len(prompt) - 1:
                break
            self.alloc.retain(blk)
            self.table[row, i] = blk
            mapped += self.block_size
        return min(mapped, len(prompt) - 1)

    def remember_prefix(self, prompts: list[list[int]], rows: list[int] | None = None) -> None:
        """Register the full prompt blocks of rows (every row in order, or `rows`) that hold
        exactly their prompt from position 0 (a prefill that continued a non-empty row is
        not a prefix)."""
        if not self.prefix_caching:
            return
        for row, prompt in zip(range(self.batch_size) if rows is None else rows, prompts):
            if int(self.lengths[row]) != len(prompt):
                continue
            blocks = self.table[row].tolist()
            for h, blk in zip(chain_hashes(prompt[:self.capacity], self.block_size), blocks):
                if blk >= 0:
                    self.alloc.register(h, blk)

    # -- called by decoders --------------------------------------------------------
    def truncate(self, lengths) -> None:
        """Roll rows back; blocks wholly above a row's new length return to the free list."""
        super().truncate(lengths)
        self._free_from((self.lengths + self.block_size - 1) // self.block_size)

    def reset(self) -> None:
        """Forget every row; their blocks go to the free list and keep their prefix hashes."""
        super().reset()
        self._free_from(torch.zeros(self.batch_size, dtype=torch.long))
        self.prefix_reused_tokens = 0
        if self.fp8:  # the scales start over: blocks stored at the old ones must not be mapped as a prefix
            self.alloc.by_hash.clear()
            self.alloc.hash_of.clear()

    def release(self, row: int) -> None:
        """Forget one row: its blocks go to the free list (keeping their prefix hashes)."""
        keep = torch.full((self.batch_size,), self.table.shape[1], dtype=torch.long)
        keep[row] = 0
        self._free_from(keep)
        super().release(row)

    def row_bytes(self, tokens: int) -> int:
        """Whole blocks: ceil(tokens / block_size) x block_bytes (shared prefix blocks counted
        in full: an upper bound of what the row adds to the pool)."""
        return math.ceil(tokens / self.block_size) * self.block_bytes

    def held_bytes(self, rows: list[int]) -> int:
        """The distinct blocks these rows map (a shared prefix block counted once) x block_bytes."""
        t = self.table[list(rows)]
        return int(t[t >= 0].unique().numel()) * self.block_bytes

    def _free_from(self, keep: torch.Tensor) -> None:
        """Release each row's table entries from block index keep[b] [B] on."""
        drop = (torch.arange(self.table.shape[1])[None] >= keep[:, None]) & (self.table >= 0)  # [B, M]
        for blk in self.table[drop].tolist():
            self.alloc.release(blk)
        self.table[drop] = -1

    def nbytes(self) -> int:
        """The whole pool: K and V, every layer, every block (allocated up front)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    # -- capabilities (cache/base.py) ----------------------------------------------
    def static_view(self) -> StaticView:
        """The heads-major pools as they are and a device copy of the block table, which
        `refresh` updates from the host table after each `plan` allocated blocks."""
        self._compiled_dtype_refusal()
        table = self.table.to(self.layout.device, torch.int32)  # [B, M]
        return StaticView(list(self._kh), list(self._vh), table, self.block_size, self.table)

    def fill_random(self, n_tokens: int, seed: int = 0) -> None:
        """Forget every row, then give each positions [0, n_tokens): `plan` allocates
        their blocks and those blocks are drawn directly (no attention runs); blocks no row
        maps keep their content and any prefix they cache."""
        self.reset()
        self.plan(torch.arange(n_tokens).expand(self.batch_size, -1))
        blocks = self.table[self.table >= 0].unique().to(self.layout.device)  # [nb]
        g = torch.Generator(device=self.layout.device).manual_seed(seed)
        lay = self.layout
        for pool in self._kh + self._vh:  # [Hkv, N, bs, D]; fp8: drawn in fp32, stored at scale 1
            pool[:, blocks] = torch.randn(lay.n_kv_heads, len(blocks), self.block_size, lay.head_dim, generator=g,
                                          device=lay.device).to(pool.dtype)
        if self.fp8:
            self.scaled = [True] * lay.n_layers  # the scales (1) are those of what is held

    def memory_report(self) -> dict:
        """Base report plus blocks in use, their bytes, their unused share, prefix reuse."""
        in_use, bs = self.alloc.in_use, self.block_size
        fill = (self.lengths[:, None] - torch.arange(self.table.shape[1]) * bs).clamp(0, bs)  # [B, M]
        held = self.table >= 0
        used = torch.zeros(self.num_blocks, dtype=torch.long).scatter_reduce(
            0, self.table[held], fill[held], "amax")  # [N] live slots per block (shared: the max)
        slots = in_use * bs
        return {**super().memory_report(), "block_size": bs, "blocks_total": self.num_blocks,
                "blocks_in_use": in_use, "kv_bytes_in_use": in_use * self.block_bytes,
                "waste_fraction": (slots - int(used.sum())) / slots if slots else 0.0,
                "prefix_reused_tokens": self.prefix_reused_tokens}
