"""The int4 codec: quanto-packed codes, scales and shifts of K or V, and how they are cut
into groups. A leaf module: the int4 backend (cache/int4.py) and its kernels
(cache/kernels/int4.py) both import it, and it imports neither.

A store (`QStore`) holds one row's quantized K or V of one layer, tokens [0, N); a
`Grouping` says how groups of `size` elements lie (per channel along tokens, or per
token along head_dim) and does the store bookkeeping (empty, append, span, cut) and the
unpacked layout (`region`) that `dequantize_into` fills. `quantize` calls
optimum-quanto: groups of `size` elements share a scale and a shift (affine,
MaxOptimizer); a per-channel group is `size` consecutive tokens, a per-token group lies
inside one token. Every group is quantized from its own values only, so a block's codes,
scales and shifts are a pure function of its K/V: re-quantizing the same values gives
the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QTYPES = {4: "qint4", 2: "qint2"}  # nbits -> optimum-quanto qtype (imported on first use: 2.5 s)


@dataclass(frozen=True)
class QStore:
    """One row's quantized K or V in one layer: quanto's packed codes, scales and shifts,
    laid out so that unpacking yields [H, tokens, D] directly (see `Grouping`)."""

    data: torch.Tensor  # uint8, the group dims with the packed dim (R = group x bits / 8) at `packed_dim`
    scale: torch.Tensor  # same dims, 1 at `packed_dim`;  x ~= scale * q + offset
    offset: torch.Tensor  # quanto's shift, negated (the group minimum), so dequantizing is one addcmul

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """data, scale, offset (the order every store helper zips them in)."""
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
        self.packed_dim = 2 if axis == "channel" else 3  # where a group's codes lie
        self.tokens_per_index = size if axis == "channel" else 1  # tokens per index along dim 1

    def columns(self, x: torch.Tensor) -> torch.Tensor:
        """x [H, N, D] -> [G, C]: one group per column, columns in the order of `groups`."""
        H, N, D = x.shape
        G = self.size
        if self.axis == "channel":
            return x.reshape(H, N // G, G, D).permute(2, 0, 1, 3).reshape(G, -1)  # columns (h, j, d)
        return x.reshape(H, N, D // G, G).permute(3, 0, 1, 2).reshape(G, -1)  # columns (h, t, i)

    def groups(self, H: int, N: int, D: int) -> tuple[int, int, int]:
        """The group dims of N tokens: (H, N/G, D) per channel, (H, N, D/G) per token."""
        return (H, N // self.size, D) if self.axis == "channel" else (H, N, D // self.size)

    def place(self, t: torch.Tensor, H: int, N: int, D: int) -> torch.Tensor:
        """quanto's [R or 1, C] -> the store layout (the packed dim moved to `packed_dim`)."""
        return t.reshape(t.shape[0], *self.groups(H, N, D)).movedim(0, self.packed_dim).contiguous()

    def empty(self, H: int, D: int, dtype: torch.dtype, device) -> QStore:
        """A store of no tokens (scales and offsets in `dtype`)."""
        R = self.size * self.bits // 8  # bytes of one group's codes
        return QStore(self.place(torch.empty(R, 0, dtype=torch.uint8, device=device), H, 0, D),
                      self.place(torch.empty(1, 0, dtype=dtype, device=device), H, 0, D),
                      self.place(torch.empty(1, 0, dtype=dtype, device=device), H, 0, D))

    def tokens(self, s: QStore) -> int:
        """How many tokens the store holds."""
        return s.data.shape[1] * self.tokens_per_index

    def append(self, s: QStore, new: QStore) -> QStore:
        """The store followed by `new` (tokens appended along dim 1), in new storage."""
        return QStore(*(torch.cat((a, b), 1) for a, b in zip(s.tensors(), new.tensors())))

    def span(self, s: QStore, t0: int, t1: int) -> QStore:
        """The groups of tokens [t0, t1) (both multiples of `tokens_per_index`), a view."""
        i, j = t0 // self.tokens_per_index, t1 // self.tokens_per_index
        return QStore(*(t[:, i:j] for t in s.tensors()))

    def cut(self, s: QStore, t1: int) -> QStore:
        """The groups of tokens [0, t1) in storage of their own (the rest is freed)."""
        return QStore(*(t[:, :t1 // self.tokens_per_index].clone() for t in s.tensors()))

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
    codes = torch.cat(planes + [s.data >> (8 - g.bits)], g.packed_dim)  # the group's codes in order
    scale, offset = s.scale.to(out.dtype), s.offset.to(out.dtype)
    if g.packed_dim == out.dim() - 1:  # per-token scales broadcast innermost, where addcmul is slow
        torch.mul(codes, scale, out=out).add_(offset)
    else:
        torch.addcmul(offset, codes, scale, out=out)


def effective_group(axis: str, group_size: int, head_dim: int) -> int:
    """Per token, a group never spans heads: a group_size above head_dim means one group per head."""
    return min(group_size, head_dim) if axis == "token" else group_size
