"""`int4`: KIVI-style quantized K/V (optimum-quanto qint4 / qint2) behind a full-precision
residual window of each row's newest tokens.

Per layer and row, a row's tokens are positions 0..len-1 in order:
- [0, Q) live in the quantized store: the packed bytes, scales and shifts that
  optimum-quanto produced, one growing tensor each (appended per flush, never a list of
  blocks). Groups of `group_size` elements share a scale and a shift (affine, MaxOptimizer):
  keys per channel (a group is G consecutive tokens of one channel), values per token
  (a group is G consecutive channels of one token head), the KIVI axes; both configurable.
- [Q, len) live in the residual: the newest tokens in the layout's dtype, exact size.
When the residual holds `residual + flush` tokens, its oldest whole `flush`-token blocks
are quantized, after the attention of the forward that wrote them. So the newest
`residual` tokens are always full precision, a forward's queries see its own new tokens
exactly, a long prompt keeps its last `residual` tokens exact (not transformers'
quantize-the-whole-prompt, its issue #35185), and a rollback of up to `residual` tokens
never touches quantized data (`rollback_limit = residual`). (Only a rollback that follows
an earlier rollback and a shorter forward could reach quantized tokens; `truncate` refuses
it and says so. Speculative decoding never does: it rolls back less than it verified.)
Padding is never stored; rows may hold different lengths.

Attention is the pure-torch reference: dequantize the row's groups a window can see into
a scratch buffer, then the residual, mask by position (`attention_mask`, the layer's
window), `reference_attention`. Nothing dequantized is kept between calls (no fp mirror:
that would give the memory back). Scales and shifts are stored in `scale_dtype` (fp16 by
default: fp32 ones alone would cost 1/16 of a bf16 cache at group 64).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from optimum.quanto import MaxOptimizer, qint2, qint4, quantize_weight

from cache.base import CacheLayout, KVCache, attention_mask, is_plain_causal, reference_attention
from models.errors import SetupError, raise_if

QTYPES = {4: qint4, 2: qint2}  # nbits -> optimum-quanto qtype
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

    def since(self, s: QStore, t0: int) -> QStore:
        """The groups of tokens [t0, end) (t0 a multiple of `per`)."""
        i = t0 // self.per
        return QStore(*(t[:, i:] for t in s.tensors()))

    def region(self, row: torch.Tensor, n: int) -> torch.Tensor:
        """Tokens [0, n) of a buffer row [H, S, D], viewed as the unpacked groups."""
        G = self.size
        return row[:, :n].unflatten(1, (n // G, G)) if self.axis == "channel" else row[:, :n].unflatten(2, (-1, G))


def quantize(x: torch.Tensor, g: Grouping, scale_dtype: torch.dtype) -> QStore:
    """Quantize x [H, N, D] with optimum-quanto (MaxOptimizer, affine, `g.size` groups).
    Scales and shifts are rounded to `scale_dtype` first, so the codes match what is stored."""
    qtype = QTYPES[g.bits]
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
                    scale_dtype) -> list[str]:
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
    if not isinstance(flush, int) or flush < 1:
        p.append(f"flush must be an integer >= 1 tokens, got {flush}")
    elif "channel" in (key_axis, value_axis) and group_size in GROUP_SIZES and flush % group_size:
        p.append(f"flush ({flush}) must be a multiple of group_size ({group_size}): a per-channel group "
                 "spans group_size tokens of one flushed block")
    if scale_dtype not in SCALE_DTYPES:
        p.append(f"scale_dtype must be one of {list(SCALE_DTYPES)}, got {scale_dtype!r}")
    return p


class QuantizedCache(KVCache):
    """Quantized K/V with a full-precision residual of each row's newest tokens."""

    lossy = True

    def __init__(self, layout: CacheLayout, batch_size: int, capacity: int, nbits: int = 4,
                 group_size: int = 64, residual: int = 128, key_axis: str = "channel",
                 value_axis: str = "token", flush: int | None = None, scale_dtype: str = "float16"):
        flush = group_size if flush is None else flush
        reasons = option_problems(layout, nbits, group_size, residual, key_axis, value_axis, flush, scale_dtype)
        try:
            super().__init__(layout, batch_size, capacity)
        except SetupError as e:
            reasons = e.reasons + reasons
        raise_if(reasons)
        self.rollback_limit = residual
        self.residual, self.flush, self.nbits = residual, flush, nbits
        self.scale_dtype = SCALE_DTYPES[scale_dtype]
        D = layout.head_dim
        self.kg = Grouping(key_axis, effective_group(key_axis, group_size, D), nbits)
        self.vg = Grouping(value_axis, effective_group(value_axis, group_size, D), nbits)
        self.align = max(self.kg.per, self.vg.per)  # a window starts dequantizing at a multiple
        self.reset()

    def __repr__(self) -> str:
        return (f"QuantizedCache(qint{self.nbits}, group={self.kg.size}/{self.vg.size}, residual={self.residual}, "
                f"flush={self.flush}, key_axis={self.kg.axis}, value_axis={self.vg.axis})")

    def reset(self) -> None:
        """Forget every row: empty quantized stores and residuals."""
        super().reset()
        L, B, H, D = self.layout.n_layers, self.batch_size, self.layout.n_kv_heads, self.layout.head_dim
        kw = dict(dtype=self.layout.dtype, device=self.layout.device)
        sd, dev = self.scale_dtype, self.layout.device
        self.kq = [[self.kg.empty(H, D, sd, dev) for _ in range(B)] for _ in range(L)]
        self.vq = [[self.vg.empty(H, D, sd, dev) for _ in range(B)] for _ in range(L)]
        self.kr = [[torch.empty(H, 0, D, **kw) for _ in range(B)] for _ in range(L)]  # [H, n, D] each
        self.vr = [[torch.empty(H, 0, D, **kw) for _ in range(B)] for _ in range(L)]

    # -- called by the model -------------------------------------------------------
    def prepare(self, positions: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Start a forward; each row must continue at its length (right padding only)."""
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
        self._new = n.tolist()
        self._ends = self.lengths.tolist()
        self._qeff = torch.where(ok, pos, self.lengths[:, None] - 1)  # [B, T] padding queries act as the last
        self._plans = {}

    def attend(self, layer, q, k, v, positions):
        """Store the valid k, v [B, Hkv, T, D]; attend q [B, Hq, T, D] over the row (new tokens
        exact); then quantize residual blocks that are due."""
        self._store(layer, k, v)
        kbuf, vbuf, mask, causal = self._gather(layer)
        out = reference_attention(q, kbuf, vbuf, mask, self.layout.softmax_scale, self.layout.softcap, causal)
        self._flush(layer)
        return out

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append each row's valid new tokens k, v [B, H, T, D] to its residual."""
        for b, n in enumerate(self._new):
            if n:
                self.kr[layer][b] = torch.cat((self.kr[layer][b], k[b, :, :n]), 1)
                self.vr[layer][b] = torch.cat((self.vr[layer][b], v[b, :, :n]), 1)

    def _flush(self, layer: int) -> None:
        """Quantize the oldest whole `flush` blocks of residuals that reached residual + flush."""
        for b in range(self.batch_size):
            n = self.kr[layer][b].shape[1]
            if n < self.residual + self.flush:
                continue
            m = (n - self.residual) // self.flush * self.flush
            for g, qs, rs in ((self.kg, self.kq, self.kr), (self.vg, self.vq, self.vr)):
                qs[layer][b] = g.append(qs[layer][b], quantize(rs[layer][b][:, :m], g, self.scale_dtype))
                rs[layer][b] = rs[layer][b][:, m:].clone()  # exact size: the old storage is freed

    # -- reading -------------------------------------------------------------------
    def _plan(self, window: int | None):
        """Per forward and window: first token each row reads, buffer length S, key positions
        [B, S] (-1 = empty), mask and plain-causal flag (memoized)."""
        if window not in self._plans:
            q = self._qeff
            lo = [0] * self.batch_size
            if window is not None:
                first = q.min(1).values.tolist()  # [B] earliest query of each row
                lo = [max(0, (f - window + 1) // self.align * self.align) for f in first]
            S = max(max(e - s for s, e in zip(lo, self._ends)), 1)
            kpos = torch.full((self.batch_size, S), -1, dtype=torch.long)  # [B, S]
            for b, (s, e) in enumerate(zip(lo, self._ends)):
                kpos[b, :e - s] = torch.arange(s, e)
            causal = is_plain_causal(q, kpos, window)
            mask = None if causal else attention_mask(q, kpos, window)
            self._plans[window] = (lo, S, None if mask is None else mask.to(self.layout.device), causal)
        return self._plans[window]

    def _gather(self, layer: int):
        """Scratch K and V buffers of every row (dequantized groups, then the residual)."""
        lo, S, mask, causal = self._plan(self.layout.windows[layer])
        B, H, D = self.batch_size, self.layout.n_kv_heads, self.layout.head_dim
        ragged = any(e - s != S for s, e in zip(lo, self._ends))  # padded slots must be finite
        new = torch.zeros if ragged else torch.empty
        kw = dict(dtype=self.layout.dtype, device=self.layout.device)
        kbuf, vbuf = new(B, H, S, D, **kw), new(B, H, S, D, **kw)  # [B, H, S, D] scratch
        for b in range(B):
            self._fill(self.kg, kbuf[b], self.kq[layer][b], self.kr[layer][b], lo[b])
            self._fill(self.vg, vbuf[b], self.vq[layer][b], self.vr[layer][b], lo[b])
        return kbuf, vbuf, mask, causal

    def _fill(self, g: Grouping, row: torch.Tensor, qs: QStore, resid: torch.Tensor, start: int) -> None:
        """Row buffer <- tokens [start, len): dequantized groups, then the residual."""
        n_q = max(0, g.tokens(qs) - start)
        if n_q:
            dequantize_into(g.region(row, n_q), g.since(qs, start) if start else qs, g)
        r0 = max(0, start - g.tokens(qs))
        row[:, n_q:n_q + resid.shape[1] - r0].copy_(resid[:, r0:] if r0 else resid)

    def read(self, layer, row):
        """positions [N], k and v [Hkv, N, D]: the quantized part dequantized, then the residual."""
        n, H, D = int(self.lengths[row]), self.layout.n_kv_heads, self.layout.head_dim
        out = []
        for g, qs, rs in ((self.kg, self.kq, self.kr), (self.vg, self.vq, self.vr)):
            buf = torch.empty(H, n, D, dtype=self.layout.dtype, device=self.layout.device)  # [H, N, D]
            self._fill(g, buf, qs[layer][row], rs[layer][row], 0)
            out.append(buf)
        return torch.arange(n), out[0], out[1]

    def quantized_tokens(self, row: int, layer: int = 0) -> int:
        """How many of a row's oldest tokens are quantized (the rest is full precision)."""
        return self.kg.tokens(self.kq[layer][row])

    # -- called by decoders --------------------------------------------------------
    def truncate(self, lengths) -> None:
        """Roll rows back within their full-precision residual (quantized data is never touched)."""
        new = torch.as_tensor(lengths, dtype=torch.long).cpu().reshape(-1)
        raise_if(self._truncate_problems(new))
        super().truncate(new)
        for b, n in enumerate(new.tolist()):
            keep = n - self.quantized_tokens(b)
            for layer in range(self.layout.n_layers):
                self.kr[layer][b] = self.kr[layer][b][:, :keep]
                self.vr[layer][b] = self.vr[layer][b][:, :keep]

    def _truncate_problems(self, new: torch.Tensor) -> list[str]:
        """Every reason a truncate is refused (the base checks and the quantized boundary)."""
        if new.shape[0] != self.batch_size:
            return [f"truncate to {new.tolist()} gives {new.shape[0]} rows for a batch of {self.batch_size}"]
        p = []
        if bool((new > self.lengths).any()) or bool((new < 0).any()):
            p.append(f"truncate to {new.tolist()} is invalid for lengths {self.lengths.tolist()}: "
                     "each row can only roll back, never forward")
        back = self.lengths - new
        if bool((back > self.rollback_limit).any()):
            p.append(f"rolling back {int(back.max())} tokens exceeds this cache's rollback_limit of "
                     f"{self.rollback_limit} (its full-precision residual)")
        for b, n in enumerate(new.tolist()):
            q = self.quantized_tokens(b)
            if 0 <= n < q <= int(self.lengths[b]) and back[b] <= self.rollback_limit:
                p.append(f"row {b}: rollback to {n} would reach its quantized tokens [0, {q}); after an earlier "
                         f"rollback only {int(self.lengths[b]) - q} full-precision tokens remain")
        return p

    def nbytes(self) -> int:
        """Bytes really allocated: packed codes, scales, shifts and the residual buffers."""
        stores = [t for layer in self.kq + self.vq for s in layer for t in s.tensors()]
        resid = [t for layer in self.kr + self.vr for t in layer]
        return sum(t.untyped_storage().nbytes() for t in stores + resid)


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
