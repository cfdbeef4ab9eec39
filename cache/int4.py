"""`int4`: KIVI-style quantized K/V (optimum-quanto qint4 / qint2) behind a full-precision
residual window, with a visibility rule that depends on positions only.

Blocks. Position p of a row lies in block j = p // F (F = `flush` tokens). A block is
quantized as a whole and from its own K/V only: a per-channel group is `group_size`
consecutive tokens (F is a multiple of it, blocks start at multiples of F), a per-token
group lies inside one token. Groups of `group_size` elements share a scale and a shift
(affine, MaxOptimizer): keys per channel, values per token (the KIVI axes), both
configurable. So a block's codes, scales and shifts are a pure function of its K/V
values: re-quantizing the same values after a rollback gives the same bytes.

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
(within 1e-5, tests/cache/test_int4.py). Inside a model, a batched forward's K/V can
differ from single-token ones by float rounding (~1e-6; dense shows it too, ~6e-7 in
the logits), and quantization, being discontinuous, may round one code or one fp16
scale the other way for such a value; the logits then differ by about that one step
(measured 4e-4 on tiny_gemma at 80 tokens, none on tiny_llama) - the same kind of
near-tie risk plain greedy already takes between two float-rounding-different runs.

Storage, per layer and row (the counts Qs and P0 are per row, the same in every layer):
- the quantized store holds blocks [0, Qs): quanto's packed codes, scales and shifts,
  one growing tensor each (never a list of blocks); scales and shifts in `scale_dtype`
  (fp16 by default: fp32 ones alone would cost 1/16 of a bf16 cache at group 64);
- the exact store holds positions [P0, len) in the layout's dtype, P0 <= Qs, both
  multiples of F. Blocks [P0, Qs) are held in both forms (counted by `nbytes`).
Padding is never stored; rows may hold different lengths.

One forward (all of it planned once, in `prepare`):
1. store: append the row's new K/V to its exact store, then quantize the blocks its
   latest query sees quantized and the store lacks: Qs <- max(Qs, V(len - 1)).
2. attend: keys = [dequantized blocks [lo, Qa) ..., exact positions [fs, q_last] ...] per
   row (lo: the window's first aligned group; Qa = V(q_last); fs = the smallest V(q) of
   the queries), with a per-query mask that picks exactly one version of every position:
   the dequantized one iff p < V(q). A forward of more than `attention_chunk` queries (a
   long prefill) does this per chunk of queries, so each chunk reads only the keys it
   needs. Nothing dequantized is kept between calls (no fp mirror: that would give the
   memory back). With `impl: triton` (the default on CUDA) a decode-sized forward instead
   runs cache/kernels/int4.py, which unpacks the codes in registers (the same rule).
3. drop the exact copies no future query can need: P0 <- max(P0, min(Qs, V(len - rollback))).

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
128..191 a 128-token residual held before), the quantized store V(len - 1) tokens; the
blocks between V(len - rollback) and V(len - 1) (at most one with the defaults) are held
in both forms, and `nbytes` counts both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decodelab.cache.base import CacheLayout, KVCache, is_plain_causal, reference_attention
from decodelab.cache.kernels.dispatch import DECODE_QUERIES, impl_problems, resolve_impl
from decodelab.cache.kernels.int4 import cache_rows, int4_attention_triton, kernel_queries
from decodelab.models.errors import SetupError, raise_if

QTYPES = {4: "qint4", 2: "qint2"}  # nbits -> optimum-quanto qtype (imported on first use: 2.5 s)
GROUP_SIZES = (32, 64, 128)
AXES = ("channel", "token")
SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class QStore:
    """One row's quantized K or V in one layer: quanto's packed codes, scales and shifts,
    laid out so that unpacking yields [H, tokens, D] directly (see `Grouping`)."""

    data: torch.Tensor  # uint8, the group dims with the packed dim (R = group x bits / 8) at `pdim`
    scale: torch.Tensor  # same dims, 1 at `pdim`;  x ~= scale * q + offset
    offset: torch.Tensor  # quanto's shift, negated (the group minimum), so dequantizing is one addcmul

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.data, self.scale, self.offset


class Grouping:
    """How K or V of one row is cut into groups of `size` elements along `axis`.

    channel: a group is `size` consecutive tokens of one channel: data [H, N/G, R, D],
             scales [H, N/G, 1, D]; unpacked along dim 2 -> [H, N/G, G, D] = [H, N, D].
    token:   a group is `size` consecutive channels of one token: data [H, N, D/G, R],
             scales [H, N, D/G, 1]; unpacked along dim 3 -> [H, N, D/G, G] = [H, N, D].
    Dim 1 grows with tokens. quanto packs a group's G codes into R bytes: bits
    [b*i, b*(i+1)) of byte r hold code r + i*R.
    """

    def __init__(self, axis: str, size: int, bits: int):
        self.axis, self.size, self.bits = axis, size, bits
        self.pdim = 2 if axis == "channel" else 3  # where a group's codes lie
        self.per = size if axis == "channel" else 1  # tokens per index along dim 1

    def columns(self, x: torch.Tensor) -> torch.Tensor:
        """x [H, N, D] -> [G, C]: one group per column, columns in the order of `groups`."""
        H, N, D = x.shape
        G = self.size
        if self.axis == "channel":
            return x.reshape(H, N // G, G, D).permute(2, 0, 1, 3).reshape(G, -1)  # columns (h, j, d)
        return x.reshape(H, N, D // G, G).permute(3, 0, 1, 2).reshape(G, -1)  # columns (h, t, i)

    def groups(self, H: int, N: int, D: int) -> tuple[int, int, int]:
        return (H, N // self.size, D) if self.axis == "channel" else (H, N, D // self.size)

    def place(self, t: torch.Tensor, H: int, N: int, D: int) -> torch.Tensor:
        """quanto's [R or 1, C] -> the store layout (the packed dim moved to `pdim`)."""
        return t.reshape(t.shape[0], *self.groups(H, N, D)).movedim(0, self.pdim).contiguous()

    def empty(self, H: int, D: int, dtype: torch.dtype, device) -> QStore:
        R = self.size * self.bits // 8
        return QStore(self.place(torch.empty(R, 0, dtype=torch.uint8, device=device), H, 0, D),
                      self.place(torch.empty(1, 0, dtype=dtype, device=device), H, 0, D),
                      self.place(torch.empty(1, 0, dtype=dtype, device=device), H, 0, D))

    def tokens(self, s: QStore) -> int:
        return s.data.shape[1] * self.per

    def append(self, s: QStore, new: QStore) -> QStore:
        return QStore(*(torch.cat((a, b), 1) for a, b in zip(s.tensors(), new.tensors())))

    def span(self, s: QStore, t0: int, t1: int) -> QStore:
        """The groups of tokens [t0, t1) (both multiples of `per`), a view."""
        i, j = t0 // self.per, t1 // self.per
        return QStore(*(t[:, i:j] for t in s.tensors()))

    def cut(self, s: QStore, t1: int) -> QStore:
        """The groups of tokens [0, t1) in storage of their own (the rest is freed)."""
        return QStore(*(t[:, :t1 // self.per].clone() for t in s.tensors()))

    def region(self, row: torch.Tensor, n: int) -> torch.Tensor:
        """Tokens [0, n) of a buffer row [H, S, D], viewed as the unpacked groups."""
        G = self.size
        return row[:, :n].unflatten(1, (n // G, G)) if self.axis == "channel" else row[:, :n].unflatten(2, (-1, G))


def quantize(x: torch.Tensor, g: Grouping, scale_dtype: torch.dtype) -> QStore:
    """Quantize x [H, N, D] with optimum-quanto (MaxOptimizer, affine, `g.size` groups).
    Scales and shifts are rounded to `scale_dtype` first, so the codes match what is stored."""
    from optimum import quanto
    from optimum.quanto import MaxOptimizer, quantize_weight

    qtype = getattr(quanto, QTYPES[g.bits])
    m = g.columns(x).float()  # [G, C], codes computed in fp32 whatever the layout dtype
    scale, shift = MaxOptimizer()(m, qtype, -1, g.size)  # [1, C] each; x ~= scale * q - shift
    scale, shift = scale.to(scale_dtype), shift.to(scale_dtype)
    q = quantize_weight(m, qtype, -1, scale.float(), shift.float(), g.size, optimized=False)
    packed = q._data._data  # uint8 [R, C]: the bytes inside quanto's PackedTensor
    return QStore(*(g.place(t, *x.shape) for t in (packed, scale, -shift)))


def dequantize_into(out: torch.Tensor, s: QStore, g: Grouping) -> None:
    """out (float, the unpacked group layout; may be a view) <- scale * unpack(data) + offset."""
    mask = (1 << g.bits) - 1
    planes = [s.data & mask] + [(s.data >> b) & mask for b in range(g.bits, 8 - g.bits, g.bits)]
    codes = torch.cat(planes + [s.data >> (8 - g.bits)], g.pdim)  # the group's codes in order
    scale, offset = s.scale.to(out.dtype), s.offset.to(out.dtype)
    if g.pdim == out.dim() - 1:  # per-token scales broadcast innermost, where addcmul is slow
        torch.mul(codes, scale, out=out).add_(offset)
    else:
        torch.addcmul(offset, codes, scale, out=out)


def effective_group(axis: str, group_size: int, head_dim: int) -> int:
    """Per token, a group never spans heads: a group_size above head_dim means one group per head."""
    return min(group_size, head_dim) if axis == "token" else group_size


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


@dataclass
class View:
    """The keys that the queries in columns [a, b) of the current forward read, in one window's layers."""

    a: int
    b: int
    lo: list[int]  # per row: first dequantized position (a multiple of the group alignment)
    qa: list[int]  # per row: end of the dequantized positions
    fs: list[int]  # per row: first exact position read
    hi: list[int]  # per row: end of the exact positions (the last query + 1)
    S: int  # key slots: [dequantized lo..qa) then [exact fs..hi), -1 padded
    mask: torch.Tensor | None  # [B, 1, b - a, S] True = attend; None: every slot
    causal: bool  # the square lower triangle (SDPA's is_causal fast path)
    ragged: bool  # some slots stay empty (they must hold finite values)


@dataclass
class Plan:
    """One forward, per row: what `attend` stores, quantizes, reads and drops in every layer."""

    new: list[int]  # valid new tokens
    p0: list[int]  # first position of the exact store before this forward
    q_from: list[int]  # quantize blocks [q_from, q_to) before the attention
    q_to: list[int]
    drop: list[int]  # exact tokens dropped from the store's front after the attention
    views: dict  # window -> [View], one per chunk of query columns


class QuantizedCache(KVCache):
    """Quantized K/V with full-precision copies where any query, now or after a rollback
    of up to `rollback` tokens, sees a position exact (see the module docstring)."""

    lossy = True
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
                                  rollback) + impl_problems(impl, layout.device)
        try:
            super().__init__(layout, batch_size, capacity)
        except SetupError as e:
            reasons = e.reasons + reasons
        raise_if(reasons)
        self.rollback_limit, self.impl = rollback, resolve_impl(impl, layout.device)  # impl: cache/kernels/dispatch
        self.residual, self.flush, self.nbits = residual, flush, nbits
        self.scale_dtype = SCALE_DTYPES[scale_dtype]
        D = layout.head_dim
        self.kg = Grouping(key_axis, effective_group(key_axis, group_size, D), nbits)
        self.vg = Grouping(value_axis, effective_group(value_axis, group_size, D), nbits)
        self.align = max(self.kg.per, self.vg.per)  # a window starts dequantizing at a multiple
        self._plan: Plan | None = None
        self.reset()

    def __repr__(self) -> str:
        return (f"QuantizedCache(qint{self.nbits}, group={self.kg.size}/{self.vg.size}, residual={self.residual}, "
                f"flush={self.flush}, rollback={self.rollback_limit}, key_axis={self.kg.axis}, "
                f"value_axis={self.vg.axis})")

    def reset(self) -> None:
        """Forget every row: empty quantized and exact stores."""
        super().reset()
        L, B, H, D = self.layout.n_layers, self.batch_size, self.layout.n_kv_heads, self.layout.head_dim
        kw = dict(dtype=self.layout.dtype, device=self.layout.device)
        sd, dev = self.scale_dtype, self.layout.device
        self.kq = [[self.kg.empty(H, D, sd, dev) for _ in range(B)] for _ in range(L)]
        self.vq = [[self.vg.empty(H, D, sd, dev) for _ in range(B)] for _ in range(L)]
        self.kr = [[torch.empty(H, 0, D, **kw) for _ in range(B)] for _ in range(L)]  # [H, len - P0, D] each
        self.vr = [[torch.empty(H, 0, D, **kw) for _ in range(B)] for _ in range(L)]
        self.qs = torch.zeros(B, dtype=torch.long)  # [B] tokens in the quantized store (Qs)
        self.p0 = torch.zeros(B, dtype=torch.long)  # [B] first position of the exact store (P0)

    # -- the rule ------------------------------------------------------------------
    def quantized_prefix(self, q):
        """V(q): a query at position q sees positions [0, V(q)) dequantized and [V(q), q]
        exact; V(q) = max(0, floor((q + 1 - residual) / flush)) * flush. Int or tensor."""
        if isinstance(q, torch.Tensor):
            return torch.div(q + 1 - self.residual, self.flush, rounding_mode="floor").clamp(min=0) * self.flush
        return max(0, (q + 1 - self.residual) // self.flush) * self.flush

    # -- called by the model -------------------------------------------------------
    def prepare(self, positions: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Start a forward (each row must continue at its length, right padding only) and
        plan it: what every layer stores, quantizes, reads (per window) and drops."""
        old = self.lengths
        super().prepare(positions, valid)
        pos, ok = self._qpos, self._valid  # [B, T]
        T = pos.shape[1]
        n = self.lengths - old  # [B] new tokens per row
        prefix = torch.arange(T)[None, :] < n[:, None]  # [B, T]
        if not bool((ok == prefix).all()) or not bool(((pos == old[:, None] + torch.arange(T)) | ~ok).all()):
            self.lengths = old
            raise SetupError("the int4 cache stores each row's tokens in order: a forward must continue every "
                             f"row at its length {old.tolist()} (right padding only); truncate first to rewrite")
        L = self.lengths
        qeff = torch.where(ok, pos, L[:, None] - 1)  # [B, T] padding queries act as the row's last
        vis = self.quantized_prefix(qeff)  # [B, T] V(q)
        # quantize what the latest query sees quantized (and anything only held quantized)
        q_to = torch.maximum(self.qs, self.quantized_prefix(L - 1))
        p0_new = torch.maximum(self.p0, torch.minimum(q_to, self.quantized_prefix(L - self.rollback_limit)))
        C = self.attention_chunk
        views = {w: [self._view(w, qeff[:, a:a + C], vis[:, a:a + C], a) for a in range(0, T, C)]
                 for w in set(self.layout.windows)}
        self._plan = Plan(n.tolist(), self.p0.tolist(), self.qs.tolist(), q_to.tolist(), (p0_new - self.p0).tolist(),
                          views)
        self.qs, self.p0 = q_to, p0_new  # what every layer holds once this forward is done
        kernel = self.impl == "triton" and T <= min(DECODE_QUERIES, C)  # decode-sized: one view, the kernel
        self._kernel_q = kernel_queries(self) if kernel else None  # ([B, T] positions, their V(q))

    def _view(self, window, qeff, vis, a: int) -> View:
        """Key slots of every row for the queries qeff [B, t] (columns a..a+t) in one window,
        and the mask that picks, per query, the dequantized version of positions below V(q)
        and the exact one from V(q) on (exactly one version of every visible position)."""
        first, last = qeff.min(1).values, qeff.max(1).values  # [B] earliest and latest query of each row
        qa = torch.maximum(self.quantized_prefix(last), self.p0)  # below p0 positions are only held quantized
        fs = torch.maximum(self.p0, vis.min(1).values)  # exact positions below fs: no query here reads them
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
        causal = not bool(nq.any()) and is_plain_causal(qeff, kpos, window)
        mask = None
        if not causal:
            q, k, v = qeff[:, :, None], kpos[:, None, :], vis[:, :, None]
            ok = (k >= 0) & (k <= q) & torch.where(isq[:, None, :], k < v, k >= v)  # [B, t, S]
            if window is not None:
                ok &= k > q - window
            mask = None if bool(ok.all()) else ok[:, None].to(self.layout.device)
        return View(a, a + qeff.shape[1], lo.tolist(), qa.tolist(), fs.tolist(), hi.tolist(), S, mask, causal,
                    bool((total < S).any()))

    def attend(self, layer, q, k, v):
        """Store the valid k, v [B, Hkv, T, D] and quantize the blocks now due; attend q
        [B, Hq, T, D] with the version of every key its position calls for; then drop the
        exact copies that no query can need any more."""
        self._store(layer, k, v)
        outs = []
        for view in self._plan.views[self.layout.windows[layer]]:  # one, unless the forward is long
            if self._kernel_q is not None:
                outs.append(int4_attention_triton(q, cache_rows(self, layer, view), *self._kernel_q,
                                                  self.layout.softmax_scale, self.layout.windows[layer],
                                                  self.layout.softcap))
                continue
            kbuf, vbuf = self._gather(layer, view)
            outs.append(reference_attention(q[:, :, view.a:view.b], kbuf, vbuf, view.mask, self.layout.softmax_scale,
                                            self.layout.softcap, view.causal))
        self._flush(layer)
        return outs[0] if len(outs) == 1 else torch.cat(outs, 2)

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append each row's valid new tokens k, v [B, H, T, D] to its exact store; quantize
        the blocks [q_from, q_to) (one quanto call, the same bytes as block by block)."""
        p = self._plan
        for b, n in enumerate(p.new):
            for g, qs, rs, x in ((self.kg, self.kq, self.kr, k), (self.vg, self.vq, self.vr, v)):
                if n:
                    rs[layer][b] = torch.cat((rs[layer][b], x[b, :, :n]), 1)
                if p.q_to[b] > p.q_from[b]:
                    new = rs[layer][b][:, p.q_from[b] - p.p0[b]:p.q_to[b] - p.p0[b]]
                    qs[layer][b] = g.append(qs[layer][b], quantize(new, g, self.scale_dtype))

    def _flush(self, layer: int) -> None:
        """Drop the exact copies of blocks no future query can need (fresh storage: freed)."""
        for b, d in enumerate(self._plan.drop):
            if d:
                self.kr[layer][b] = self.kr[layer][b][:, d:].clone()
                self.vr[layer][b] = self.vr[layer][b][:, d:].clone()

    # -- reading -------------------------------------------------------------------
    def _gather(self, layer: int, view: View):
        """Scratch K and V buffers [B, H, S, D] of every row: dequantized blocks, then exact tokens."""
        B, H, D = self.batch_size, self.layout.n_kv_heads, self.layout.head_dim
        new = torch.zeros if view.ragged else torch.empty  # masked slots must be finite (0 x nan = nan)
        kw = dict(dtype=self.layout.dtype, device=self.layout.device)
        kbuf, vbuf = new(B, H, view.S, D, **kw), new(B, H, view.S, D, **kw)
        for b in range(B):
            lo, qa, fs, e, p0 = view.lo[b], view.qa[b], view.fs[b], view.hi[b], self._plan.p0[b]
            for g, qs, rs, buf in ((self.kg, self.kq, self.kr, kbuf), (self.vg, self.vq, self.vr, vbuf)):
                if qa > lo:
                    dequantize_into(g.region(buf[b], qa - lo), g.span(qs[layer][b], lo, qa), g)
                if e > fs:
                    buf[b, :, qa - lo:qa - lo + e - fs].copy_(rs[layer][b][:, fs - p0:e - p0])
        return kbuf, vbuf

    def read(self, layer, row):
        """positions [N], k and v [Hkv, N, D]: the quantized blocks dequantized, then the
        exact tokens (what the row holds; a query at position q sees `quantized_prefix(q)`)."""
        n, H, D = int(self.lengths[row]), self.layout.n_kv_heads, self.layout.head_dim
        qs, p0 = int(self.qs[row]), int(self.p0[row])
        out = []
        for g, qst, rs in ((self.kg, self.kq, self.kr), (self.vg, self.vq, self.vr)):
            buf = torch.empty(H, n, D, dtype=self.layout.dtype, device=self.layout.device)  # [H, N, D]
            if qs:
                dequantize_into(g.region(buf, qs), g.span(qst[layer][row], 0, qs), g)
            buf[:, qs:].copy_(rs[layer][row][:, qs - p0:n - p0])
            out.append(buf)
        return torch.arange(n), out[0], out[1]

    def quantized_tokens(self, row: int, layer: int = 0) -> int:
        """How many of a row's oldest tokens the quantized store holds (Qs)."""
        return self.kg.tokens(self.kq[layer][row])

    def exact_span(self, row: int) -> tuple[int, int]:
        """Positions [P0, len) the row holds in full precision."""
        return int(self.p0[row]), int(self.lengths[row])

    # -- called by decoders --------------------------------------------------------
    def truncate(self, lengths) -> None:
        """Roll rows back: the exact stores shrink, quantized blocks holding a dropped
        position are dropped (re-quantized from the new values when a query needs them)."""
        new = torch.as_tensor(lengths, dtype=torch.long).cpu().reshape(-1)
        raise_if(self._truncate_problems(new))
        super().truncate(new)
        for b, n in enumerate(new.tolist()):
            qs, p0 = int(self.qs[b]), int(self.p0[b])
            keep = min(qs, n // self.flush * self.flush)
            for layer in range(self.layout.n_layers):
                if keep < qs:
                    self.kq[layer][b] = self.kg.cut(self.kq[layer][b], keep)
                    self.vq[layer][b] = self.vg.cut(self.vq[layer][b], keep)
                self.kr[layer][b] = self.kr[layer][b][:, :n - p0]
                self.vr[layer][b] = self.vr[layer][b][:, :n - p0]
            self.qs[b] = keep

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
            v, p0 = self.quantized_prefix(n), int(self.p0[b])
            if v < p0 and back[b] <= self.rollback_limit:
                p.append(f"row {b}: rollback to {n} would need the full-precision keys of positions [{v}, {p0}), "
                         "already dropped (only quantized now): after an earlier rollback and a shorter forward, "
                         f"a row can only go back to where a query sees [0, {p0}) quantized")
        return p

    def nbytes(self) -> int:
        """Bytes really allocated: packed codes, scales, shifts and the exact stores
        (blocks held in both forms counted twice)."""
        stores = [t for layer in self.kq + self.vq for s in layer for t in s.tensors()]
        exact = [t for layer in self.kr + self.vr for t in layer]
        return sum(t.untyped_storage().nbytes() for t in stores + exact)


def fill_random(cache: QuantizedCache, tokens: int, seed: int = 0) -> None:
    """Store `tokens` random K/V positions in every row and layer (no attention computed)."""
    g = torch.Generator().manual_seed(seed)
    lay = cache.layout
    cache.prepare(torch.arange(tokens).expand(cache.batch_size, -1))
    shape = (cache.batch_size, lay.n_kv_heads, tokens, lay.head_dim)
    for layer in range(lay.n_layers):
        k, v = (torch.randn(shape, generator=g).to(lay.dtype).to(lay.device) for _ in range(2))
        cache._store(layer, k, v)
        cache._flush(layer)


def bf16_ratio(layout: CacheLayout, context: int, **options) -> float:
    """Bytes a one-row cache with these options allocates at `context` tokens, over the
    bytes of a dense bf16 cache of the same context (2 x layers x heads x tokens x D x 2)."""
    cache = QuantizedCache(layout, 1, context, **options)
    fill_random(cache, context)
    dense = 2 * layout.n_layers * layout.n_kv_heads * context * layout.head_dim * 2
    return cache.nbytes() / dense


def worst_context(cache: QuantizedCache, near: int) -> int:
    """The context in (near - flush, near] at which a row written in one forward holds the
    most full-precision tokens (the memory high point of a flush period)."""
    return max(range(max(1, near - cache.flush + 1), near + 1),
               key=lambda n: n - int(cache.quantized_prefix(torch.tensor(n - cache.rollback_limit))))
