"""The fixed-shape plan of a compiled (or captured) decode step, and the fixed-shape
attention the backends run on it.

A compiled step replays the same device work every step, so its plan cannot be the
host-built `Plan` of an eager forward (Python ints, key spans that grow with the
context). `KVCache.static_plan(tokens)` gives a `StaticPlan` instead (or, for a backend
whose attention must do host work every forward, int4, a `HostPlan`: see its class): device buffers of
fixed shape, refilled in place before every step (`load`: this step's positions, and the
host bookkeeping `cache.book` just did, such as a paged block table or a ring's slot
positions), from which the graph derives what it needs (`begin`: lengths, block slots).
Each backend's `attend(layer, q, k, v, plan)` takes it like any plan and attends over its
whole storage, masked by position: dense and sliding's full layers read their row-major
buffers (on a CPU, for fp32, through decodelab's native kernel over only the slots each
query sees), paged reads its block pools through the table (on a CPU the native kernel reads
them in place, decodelab::paged_decode_attention), sliding's ring layers read
their rings by the positions the slots hold. On CUDA the cache writes and the attention
stay outside torch.compile's graph (opaque calls a CUDA graph captures); on a CPU they are
traced with the model into one graph.
"""

from __future__ import annotations

import weakref

import torch

from decodelab.cache.base import StaticView, reference_attention
from decodelab.cache.kernels.dispatch import resolve_impl, split_count
from decodelab.cache.kernels.paged import paged_attention_reference, paged_attention_triton
from decodelab.models.errors import SetupError
from decodelab.models.handles import Handles

#: a dense buffer's compiled CPU step attends through decodelab's native kernel where it
#: serves (models/native.py: AVX2, fp32, head size a multiple of 8, no logit softcap):
#: it reads only the slots each query sees, where `grouped_attention` reads the whole
#: capacity (SmolLM2, 291 of 321 slots: 35 us a layer against 116, 2 Zen 3 cores)
NATIVE_ATTENTION = True


def native_attention_serves(layout) -> bool:
    """Whether a compiled CPU step over a cache of this layout attends its row-major
    buffers through decodelab::decode_attention."""
    if not (NATIVE_ATTENTION and layout.device.type == "cpu" and layout.dtype == torch.float32
            and layout.softcap is None and layout.head_dim % 8 == 0):
        return False
    from decodelab.models import native

    if native.problem():
        native.note_fallback("compiled decode steps' attention")
    return native.problem() is None


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seen: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """q [B, Hq, T, D] over keys, values [B, Hkv, S, D] (GQA: query head h reads kv head
    h // (Hq / Hkv)) where seen [B, T, S]: plain matmul, masked softmax (fp32), matmul,
    which inductor fuses. On a CPU, SDPA's flash kernel costs about 280 us a call for one
    query over 512 slots (SmolLM2, 2 AVX2 cores): most of a compiled decode step's
    attention time, for a few thousand multiply-adds."""
    B, Hq, T, D = q.shape
    Hkv, S = keys.shape[1], keys.shape[2]
    g = Hq // Hkv
    qg = q.reshape(B, Hkv, g * T, D)  # a kv head's g query heads, T positions each
    scores = (qg @ keys.transpose(-1, -2)).float() * scale  # [B, Hkv, g * T, S]
    mask = seen[:, None, None].expand(B, 1, g, T, S).reshape(B, 1, g * T, S)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).to(q.dtype)
    return (probs @ values).reshape(B, Hq, T, D)


def masked_attention(q, keys, values, seen: torch.Tensor, layout) -> torch.Tensor:
    """q [B, Hq, T, D] over keys, values [B, Hkv, S, D] where seen [B, T, S]: inductor's
    fused `grouped_attention` on a CPU, the reference (softcap) elsewhere."""
    if layout.softcap is None and q.device.type == "cpu":
        return grouped_attention(q, keys, values, seen, layout.softmax_scale)
    return reference_attention(q, keys, values, seen[:, None], layout.softmax_scale, layout.softcap)


class StaticPlan:
    """One fixed-shape decode plan: T new tokens per row of every row of the cache, at
    device-side positions. Its tensors are allocated once and updated in place (`load` on
    the host side of a step, `begin` inside it), so a graph that reads them replays."""

    def __init__(self, layout, batch_size: int, capacity: int, tokens: int = 1, impl: str = "auto",
                 storage: StaticView | None = None, rings: dict | None = None, sinks: int = 0):
        dev = layout.device
        self.layout, self.tokens, self.storage = layout, tokens, storage
        self.traced = dev.type == "cpu"  # traced with the model (module docstring)
        self.pos = torch.zeros(batch_size, tokens, dtype=torch.long, device=dev)  # [B, T] each step's positions
        self.kv_len = torch.zeros(batch_size, dtype=torch.int32, device=dev)  # [B] once this step is written
        self.heads = torch.arange(layout.n_kv_heads, device=dev)[None, :]  # [1, Hkv]
        self.batch_rows = torch.arange(batch_size, device=dev)[:, None]  # [B, 1]
        self.kpos = torch.arange(capacity, device=dev)  # [S] every slot of a row-major buffer
        self.native = native_attention_serves(layout)
        self.attn = paged_attention_triton if resolve_impl(impl, dev) == "triton" else paged_attention_reference
        self.blk = torch.zeros(batch_size, tokens, dtype=torch.long, device=dev)  # [B, T] pool block of each token
        self.off = torch.zeros(batch_size, tokens, dtype=torch.long, device=dev)  # [B, T] its offset there
        self.splits = 1
        if storage is not None and storage.table is not None:
            keys = storage.table.shape[1] * storage.block_size  # positions the table addresses
            self.splits = split_count(batch_size * layout.n_kv_heads, keys, dev)
        # ring size -> (the cache's slot positions [B, slots] on the host, the graph's copy on the device)
        self.rings = {r: (sp, sp if sp.device == dev else sp.to(dev)) for r, sp in (rings or {}).items()}
        self.ring_slots = {r: torch.zeros(batch_size, tokens, dtype=torch.long, device=dev) for r in self.rings}
        self.sinks = sinks
        self._opaque = {}

    def book(self, cache, positions: torch.Tensor) -> None:
        """The host side of a step: the cache books it (`cache.book`: lengths, blocks, ring
        slots; no attention runs), then `load` copies what the graph reads."""
        cache.book(positions)
        self.load(positions)

    def load(self, positions: torch.Tensor) -> None:
        """Host -> device before a step, after `cache.book` booked it: its positions [B, T]
        and what that bookkeeping changed (the block table, ring slot positions)."""
        self.pos.copy_(positions, non_blocking=True)
        if self.storage is not None:
            self.storage.refresh()
        for host, dev in self.rings.values():
            if dev is not host:
                dev.copy_(host, non_blocking=True)

    def begin(self) -> None:
        """Per step, inside the graph: each row's length and the new tokens' storage slots."""
        self.call(self._begin)

    def _begin(self) -> None:
        pos = self.pos  # [B, T]
        self.kv_len.copy_(pos[:, -1] + 1)  # the new tokens are written before attention
        if self.storage is not None and self.storage.table is not None:
            bs = self.storage.block_size
            self.blk.copy_(self.storage.table.gather(1, pos // bs))  # [B, T]
            self.off.copy_(pos % bs)  # [B, T]
        for ring, slots in self.ring_slots.items():  # sinks in place, later positions around the ring
            slots.copy_(torch.where(pos < self.sinks, pos, self.sinks + (pos - self.sinks) % ring))

    def call(self, fn, *args):
        """fn(*args): traced with the model on a CPU; on CUDA an opaque call (bound once per
        function: `torch.compiler.disable` imports torch._dynamo, which nothing eager pays for)."""
        if self.traced:
            return fn(*args)
        if fn.__name__ not in self._opaque:
            self._opaque[fn.__name__] = torch.compiler.disable(fn)
        return self._opaque[fn.__name__](*args)

    # -- the attentions the backends run on it --------------------------------------------
    def attend_rows(self, layer: int, q, k, v, keys: torch.Tensor, values: torch.Tensor, scales=None):
        """Write k, v [B, Hkv, T, D] into row-major buffers [B, Hkv, S, D] (slot = position)
        and attend q over every slot at or before each query's position, inside the layer's
        window: the native kernel reads only those slots; the torch path reads every slot,
        masked. Buffers of another dtype (a dense cache's kv_dtype) store k, v rounded to it;
        `scales` (fp8: K's and V's [Hkv]) divide them first and multiply what is read."""
        k, v = _as_stored(k, v, keys.dtype, scales)
        at = (self.batch_rows[:, :, None], self.heads[..., None], self.pos[:, None])  # -> [B, Hkv, T]
        keys.index_put_(at, k)
        values.index_put_(at, v)
        lay, w, qpos = self.layout, self.layout.windows[layer], self.pos[..., None]  # [B, T, 1]
        if self.native:
            return torch.ops.decodelab.decode_attention(q, keys, values, self.pos, lay.softmax_scale, w or 0,
                                                        *(scales or ()))
        keys, values = _widened(keys, values, q.dtype, scales, 1)
        seen = self.kpos[:keys.shape[2]] <= qpos  # [B, T, S]
        if w is not None:
            seen = seen & (self.kpos[:keys.shape[2]] > qpos - w)
        return masked_attention(q, keys, values, seen, lay)

    def attend_pools(self, layer: int, q, k, v, scales=None):
        """Write k, v into the storage's block pools [Hkv, N, bs, D] at this step's slots and
        attend through the block table (the Triton kernel on CUDA, its torch reference).
        Pools of another dtype (a paged cache's kv_dtype) store k, v rounded to it, with
        `scales` as `attend_rows` takes them."""
        k_pool, v_pool = self.storage.k[layer], self.storage.v[layer]
        k, v = _as_stored(k, v, k_pool.dtype, scales)
        for pool, new in ((k_pool, k), (v_pool, v)):
            pool[self.heads[..., None], self.blk[:, None], self.off[:, None]] = new  # [B, Hkv, T] slots, D each
        lay = self.layout
        if self.native:  # a CPU: the native kernel reads the slots each query sees in place, through the table
            return torch.ops.decodelab.paged_decode_attention(q, k_pool, v_pool, self.storage.table, self.pos,
                                                              lay.softmax_scale, lay.windows[layer] or 0,
                                                              *(scales or (None, None)))
        k_pool, v_pool = _widened(k_pool, v_pool, q.dtype, scales, 0)
        return self.attn(q, k_pool, v_pool, self.storage.table, self.pos, self.kv_len, lay.softmax_scale,
                         lay.windows[layer], lay.softcap, self.splits)

    def attend_ring(self, ring: int, window: int, q, k, v, keys: torch.Tensor, values: torch.Tensor):
        """Write k, v into a ring [B, Hkv, slots, D] at the slots of this step's positions and
        attend over the slots whose held position is at or before the query's, inside the
        window or among the sinks (the slot positions, booked by `cache.plan`, already
        hold this step's)."""
        at = (self.batch_rows[:, :, None], self.heads[..., None], self.ring_slots[ring][:, None])  # [B, Hkv, T]
        keys.index_put_(at, k)
        values.index_put_(at, v)
        held, qpos = self.rings[ring][1][:, None, :], self.pos[..., None]  # [B, 1, slots], [B, T, 1]
        seen = (held >= 0) & (held <= qpos) & ((held > qpos - window) | (held < self.sinks))  # [B, T, slots]
        return masked_attention(q, keys, values, seen, self.layout)


FP8_MAX = 448.0  # the largest e4m3 (fn) value


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [B, Hkv, T, D] / scale [Hkv] as e4m3 (round to nearest), saturated at +-FP8_MAX."""
    return (x.float() / scale[None, :, None, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _as_stored(k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype, scales=None):
    """New k, v [B, Hkv, T, D] rounded to a storage dtype; `scales` (fp8: K's and V's [Hkv]):
    `to_fp8`."""
    if dtype == k.dtype:
        return k, v
    if scales is not None:
        return to_fp8(k, scales[0]), to_fp8(v, scales[1])
    return k.to(dtype), v.to(dtype)


def _widened(keys: torch.Tensor, values: torch.Tensor, dtype: torch.dtype, scales=None, head_dim: int = 1):
    """Stored keys and values in `dtype` (fp8: times their `scales` [Hkv] along `head_dim`)."""
    if keys.dtype == dtype:
        return keys, values
    if scales is None:
        return keys.to(dtype), values.to(dtype)
    at = [None] * keys.dim()
    at[head_dim] = slice(None)
    return tuple(x.to(dtype) * s[tuple(at)].to(dtype) for x, s in zip((keys, values), scales))


class HostPlan:
    """The plan of a compiled CPU step over a cache whose attention does host work every
    forward (int4: quantizing due blocks, per-row stores that grow, key spans planned in
    Python), so that its storage has no fixed shape. Everything else of the step (the
    projections, norms, RoPE, MLPs, the head) is compiled as one graph; each layer's
    attention is one opaque call in it (`decodelab::host_attend`, a torch custom op whose
    output has q's fixed shape), which runs the backend's eager `attend` with the eager
    plan booked before the step, or, where the backend can do every layer's host work
    when the step is booked (`cache.booked_layers`), the one call per layer that leaves.
    vLLM's compiled models leave attention out of the graph the same way (its
    `unified_attention` op). The per-step plan is the eager one, so the step's attention is
    the eager path's to the bit; only the graph's float fusion differs.

    On CUDA a captured graph would replay none of the host work: refused there (the
    backend says so in its `static_plan`)."""

    traced = True  # the model is traced into one graph with the host calls inside

    def __init__(self, cache, tokens: int = 1, host=None):
        register_attend_op("host_attend", _host_attend_impl)
        self.cache, self.tokens = cache, tokens
        # a backend's own attention op, which the graph then calls instead (no Python between the
        # graph and the kernel; it calls host_attend for what it is not given): `host.op()`, with
        # `host.bind(handle, layers)` handing it each booked step and `host.drop(handle)` at the end
        # (int4: cache/kernels/int4.py's NativeHost)
        self.host = host
        self.pos = torch.zeros(cache.batch_size, tokens, dtype=torch.long, device=cache.layout.device)  # [B, T]
        self.current = None  # the eager plan of the step about to run (`book`)
        self.layers = None
        self.attended: set[int] = set()
        # a graph input (models/handles.py): every step of the same shapes reuses one compiled
        # graph; held weakly, so a dropped step frees its cache
        self.handle = _HOST_PLANS.add(self)
        self.key = int(self.handle)
        self.op = host.op() if host is not None else None
        if host is not None:  # what the backend's op holds for this plan goes with it
            weakref.finalize(self, host.drop, self.key)

    def book(self, cache, positions: torch.Tensor) -> None:
        """Host side of a step: plan it on the cache (its eager plan, kept for the calls)."""
        if cache is not self.cache:
            raise SetupError("a HostPlan books steps on the cache it was made for (cache.static_plan of this cache)")
        self.current = cache.plan(positions)
        self.attended = set()  # the layers that attended on it: each once (a second pass would store twice)
        # the step's host work for all layers at once where the cache can, each layer's call then one
        # write and one kernel (int4's `booked_layers`); None: each layer runs the cache's `attend`
        self.layers = cache.booked_layers(self.current)
        if self.host is not None:
            self.host.bind(self.key, self.layers)
        self.pos.copy_(positions)

    def begin(self) -> None:
        """Nothing to derive on the device: the host plan holds it all."""

    def attend(self, layer: int, q, k, v):
        """The layer's attention through the opaque op (traced as one call)."""
        if self.op is not None:
            return self.op(q, k, v, layer, self.handle)
        return torch.ops.decodelab.host_attend(q, k, v, layer, self.handle)


#: the live HostPlans of the process, by handle (what the traced op carries)
_HOST_PLANS = Handles()
_REGISTERED: set[str] = set()
_LIBRARY = None  # the decodelab fragment the attention ops are defined in


def _host_attend_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                      handle: torch.Tensor) -> torch.Tensor:
    plan = _HOST_PLANS.get(handle)
    if plan is None or plan.current is None:
        raise RuntimeError("a compiled step's host attention ran without its booked plan (HostPlan.book before "
                           "every step; the step's HostPlan must be alive)")
    if layer in plan.attended:
        raise RuntimeError(f"layer {layer} attended twice on one booked step: its K/V would be stored twice; "
                           "book every step (HostPlan.book) before running it")
    plan.attended.add(layer)
    out = plan.cache.attend(layer, q, k, v, plan.current) if plan.layers is None else plan.layers[layer](q, k, v)
    # exactly the fake's layout (q's strides): the compiled graph reads the result by the
    # strides the fake promised, unchecked (decoding/compiled.py's INDUCTOR_PATCHES), and an
    # attention may return another layout (the softcap path, a chunked long step's cat)
    return out if out.stride() == q.stride() else torch.empty_like(q).copy_(out)


def register_attend_op(name: str, impl) -> None:
    """Register `decodelab::<name>(q, k, v, layer, handle) -> like q`, an attention a
    compiled graph calls as one opaque op (`impl` finds its host object by `handle`), once
    per process (on first use: nothing eager pays for it). Its fake implementation gives
    q's shape and dtype, all inductor needs. A plain library op (one dispatcher call to
    `impl`), without torch.library.custom_op's autograd and aliasing wrappers, which every
    layer of every step would pay for (experiments/README.md)."""
    global _LIBRARY
    if name in _REGISTERED:
        return
    if _LIBRARY is None:
        _LIBRARY = torch.library.Library("decodelab", "FRAGMENT")
    _LIBRARY.define(f"{name}(Tensor q, Tensor k, Tensor v, int layer, Tensor handle) -> Tensor")
    _LIBRARY.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"decodelab::{name}", lib=_LIBRARY)(
        lambda q, k, v, layer, handle: torch.empty_like(q))
    _REGISTERED.add(name)
