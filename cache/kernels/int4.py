"""INT4 decode attention over what the int4 cache stores (cache/int4.py): per row, the
quantized store (quanto-packed codes, scales and offsets of positions [0, Qs); the codec
is cache/int4_codec.py) and the exact store (positions [exact_start, len) in the layout's
dtype). The cache hands them over through its public `kernel_rows(layer, plan)` and
`kernel_queries(plan)`.

The visibility rule is the cache's: a query at q sees positions below V(q) (`vis`)
dequantized and [V(q), q] exact, inside its window. Per row the keys read are
[dequant_from, dequant_to) from the quantized store and [exact_from, exact_to) from the
exact one (the cache's `View`);
the mask then picks, per query, exactly one version of every position. The reference
dequantizes into a scratch buffer and runs `reference_attention`; the Triton kernel
(int4_triton.py) unpacks the codes in registers, split-K over the quantized range.
Both cover the full rule (any number of queries), so the cache needs no fallback.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decodelab.cache.base import reference_attention
from decodelab.cache.int4_codec import Grouping, QStore, dequantize_into


@dataclass
class Int4Rows:
    """One layer of an int4 cache as the kernels read it, and each row's key spans."""

    key_codes: list[QStore]  # per row: quantized keys of positions [0, Qs) (Qs >= dequant_to)
    value_codes: list[QStore]
    key_exact: list[torch.Tensor]  # per row [Hkv, E, D]: exact keys of positions [exact_start, exact_start + E)
    value_exact: list[torch.Tensor]
    exact_start: list[int]  # per row: first position of the exact store
    key_grouping: Grouping  # how keys and values are grouped (axis, group size, bits)
    value_grouping: Grouping
    dequant_from: list[int]  # per row: dequantized positions [dequant_from, dequant_to) are read
    dequant_to: list[int]
    exact_from: list[int]  # per row: exact positions [exact_from, exact_to) are read (the last query + 1)
    exact_to: list[int]


def row_keys(rows: Int4Rows, b: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row b's key positions [S] and keys, values [Hkv, S, D]: dequantized [dequant_from,
    dequant_to), then exact [exact_from, exact_to)."""
    lo, qa = rows.dequant_from[b], rows.dequant_to[b]
    fs, hi, p0 = rows.exact_from[b], rows.exact_to[b], rows.exact_start[b]
    exact = (rows.key_exact[b], rows.value_exact[b])
    H, _, D = exact[0].shape
    out = []
    for g, store, full in ((rows.key_grouping, rows.key_codes[b], exact[0]),
                           (rows.value_grouping, rows.value_codes[b], exact[1])):
        buf = torch.empty(H, qa - lo + hi - fs, D, dtype=dtype, device=full.device)  # [H, S, D]
        if qa > lo:
            dequantize_into(g.region(buf, qa - lo), g.span(store, lo, qa), g)
        buf[:, qa - lo:].copy_(full[:, fs - p0:hi - p0])
        out.append(buf)
    dev = exact[0].device
    return torch.cat((torch.arange(lo, qa, device=dev), torch.arange(fs, hi, device=dev))), out[0], out[1]


def int4_attention_reference(
    q: torch.Tensor,  # [B, Hq, T, D]
    rows: Int4Rows,
    qpos: torch.Tensor,  # [B, T] int: query positions (padding queries: the row's last)
    vis: torch.Tensor,  # [B, T] int: V(q), the query's first exact position
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,  # kernel tuning (quantized-range splits); no effect on the result
    int16_query: bool = False,
) -> torch.Tensor:
    """Attention [B, Hq, T, D]: the query at q over positions p <= q inside its window,
    dequantized where p < V(q), exact where p >= V(q). A query that sees no key gets zeros.
    `int16_query`: the quantized keys' scores as the native kernel computes them
    (`int16_key_scores`), the rest as without it."""
    outs = []
    for b in range(q.shape[0]):
        kpos, k, v = row_keys(rows, b, q.dtype)  # [S], [Hkv, S, D]
        nq = rows.dequant_to[b] - rows.dequant_from[b]
        isq = torch.arange(kpos.shape[0], device=kpos.device) < nq  # [S]
        qp, vq = qpos[b].to(kpos.device)[:, None], vis[b].to(kpos.device)[:, None]  # [T, 1]
        mask = (kpos <= qp) & torch.where(isq, kpos < vq, kpos >= vq)  # [T, S]
        if window is not None:
            mask &= kpos > qp - window
        if int16_query and nq > 0 and softcap is None:
            group = q.shape[1] // k.shape[0]
            scores = (q[b] @ k.repeat_interleave(group, 0).transpose(-1, -2)) * scale  # [Hq, T, S]
            scores[..., :nq] = int16_key_scores(q[b], rows, b, scale)
            p = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
            out = (p @ v.repeat_interleave(group, 0))[None]
        else:
            out = reference_attention(q[b:b + 1], k[None], v[None], mask[None, None], scale, softcap)
        outs.append(out.masked_fill(~mask.any(-1)[None, None, :, None], 0.0))
    return torch.cat(outs)


def int16_key_scores(q: torch.Tensor, rows: Int4Rows, b: int, scale: float) -> torch.Tensor:
    """Row b's scores [Hq, T, dequant_to - dequant_from] of its quantized keys as the native
    kernel computes them: per key group (KG tokens of each channel) and query head, the query
    times `scale` times the group's scales, q' [D], is rounded to int16 against its largest,
    q16 = round(q' x 32767 / max|q'|) (half to even; 0 where q' is 0), and a key's score is
    max|q'| / 32767 x sum_d q16_d code_d (the integer sum exact) + sum_d (q_d scale) shift_d.
    Against the exact dot product each score moves by at most max|q'| / 65534 x sum_d code_d."""
    g, lo, hi = rows.key_grouping, rows.dequant_from[b], rows.dequant_to[b]
    st = g.span(rows.key_codes[b], lo, hi)  # data [Hkv, J, KG / 2, D], scale and offset [Hkv, J, 1, D]
    Hkv, J, _, D = st.data.shape
    Hq, T = q.shape[0], q.shape[1]
    codes = torch.empty(Hkv, hi - lo, D, dtype=torch.float32, device=q.device)
    dequantize_into(g.region(codes, hi - lo), QStore(st.data, torch.ones_like(st.scale), torch.zeros_like(st.offset)),
                    g)
    group = Hq // Hkv
    ks, ko = (t.float().squeeze(2).repeat_interleave(group, 0) for t in (st.scale, st.offset))  # [Hq, J, D]
    qv = q.float() * scale  # [Hq, T, D]
    qs = qv[:, :, None, :] * ks[:, None]  # [Hq, T, J, D]
    amax = qs.abs().amax(-1, keepdim=True)
    q16 = torch.round(qs * torch.where(amax > 0, 32767.0 / amax, torch.zeros_like(amax)))
    isum = torch.einsum("htjd,hjkd->htjk", q16.double(),
                        codes.view(Hkv, J, -1, D).repeat_interleave(group, 0).double())  # exact: integers
    qo = (qv[:, :, None, :] * ko[:, None]).sum(-1)  # [Hq, T, J]
    return (isum.float() * (amax / 32767.0) + qo[..., None]).reshape(Hq, T, hi - lo)


def int4_attention_triton(q, rows, qpos, vis, scale, window=None, softcap=None, num_splits=None) -> torch.Tensor:
    """The Triton kernel of `int4_attention_reference` (same arguments, same result, up to
    float rounding); `num_splits` None picks the quantized-range splits that fill the GPU."""
    from decodelab.cache.kernels import int4_triton  # triton is imported here, at first use

    return int4_triton.int4_attention(q, rows, qpos, vis, scale, window, softcap, num_splits)



def native_serves(key_grouping: Grouping, value_grouping: Grouping, head_dim: int, dtype: torch.dtype,
                  softcap: float | None) -> str | None:
    """Why decodelab's native CPU kernel cannot attend over int4 stores of this kind (None:
    it can): it reads 4-bit codes with the KIVI axes (keys per channel, values per token in
    groups of a multiple of 16 channels), fp32 exact stores, no logit softcap."""
    if key_grouping.bits != 4 or value_grouping.bits != 4:
        return f"the native int4 attention reads 4-bit codes, not {key_grouping.bits}-bit"
    if (key_grouping.axis, value_grouping.axis) != ("channel", "token"):
        return ("the native int4 attention reads the KIVI axes (key_axis=channel, value_axis=token), not "
                f"key_axis={key_grouping.axis}, value_axis={value_grouping.axis}")
    if key_grouping.size % 32:
        return f"the native int4 attention reads key groups of a multiple of 32 tokens, not {key_grouping.size}"
    if dtype != torch.float32 or softcap is not None or head_dim % 8 or value_grouping.size % 16:
        return "the native int4 attention serves float32 caches without a logit softcap, head size a multiple of 8"
    return None


def int4_attention_native(q, rows: Int4Rows, qpos, vis, scale, window=None, softcap=None,
                          num_splits=None) -> torch.Tensor:
    """decodelab's native CPU kernel of `int4_attention_reference` (same arguments; the same
    result as the reference with `int16_query=True`, up to float rounding; `native_serves`
    says which stores it takes): the packed codes attended in place, keys' scales folded into
    the query per group (rounded to int16 there, the codes summed against it in integers),
    values' into the softmax weights; work split by kv head and by chunk of the context,
    softmaxes merged."""
    from decodelab.models import native

    if softcap is not None:
        raise ValueError("the native int4 attention has no logit softcap; use the reference")
    return native.int4_decode_attention(q, _native_stores(rows), _native_spans(rows), qpos, vis, scale, window,
                                        rows.key_grouping.size, rows.value_grouping.size)


class NativeLayerCall:
    """One layer's attention in a compiled step booked ahead (cache/int4.py's
    `booked_layers`): fn(q, k, v) is one call of decodelab::int4_store_attend, which writes
    each row's fresh[b] new K/V into the slots its exact stores reserved for them and
    attends as `int4_attention_native` does, its stores, spans and options bound by
    `update` before the step. Kept from step to step: the per-row lists of codes, scales
    and shifts are rebuilt only when a store changed (a block quantized, a rollback)."""

    __slots__ = ("op", "args", "codes", "bound")

    def __init__(self, scale: float, window, key_group: int, value_group: int):
        from decodelab.models import native

        self.op = native.int4_store_attend()
        # fresh, key codes, scales, shifts, value codes, scales, shifts, exact keys, values, spans, qpos, vis
        self.args = [None] * 12 + [scale, window or 0, key_group, value_group]
        self.codes = ()
        self.bound = None  # (handle, slot) its stores were last bound to (`NativeHost.bind`); None: since changed

    def update(self, key_codes: list[QStore], value_codes: list[QStore], key_exact: list[torch.Tensor],
               value_exact: list[torch.Tensor], spans: list[int], fresh: list[int], qpos, vis) -> NativeLayerCall:
        """Bind this step's stores (per row, as `Int4Rows` holds them), spans (per row
        `_native_spans`' five, then the tokens the exact stores hold past their views' ends,
        the new ones included: decodelab::int4_store_attend), new tokens per row and the
        queries' positions and V(q) [B, T]."""
        codes, a = (*key_codes, *value_codes), self.args
        if len(codes) != len(self.codes) or any(x is not y for x, y in zip(codes, self.codes)):
            a[1:7] = _store_lists(key_codes, value_codes, key_exact, value_exact)[:6]
            self.codes = codes
        a[0], a[7], a[8], a[9], a[10], a[11] = fresh, key_exact, value_exact, spans, qpos, vis
        self.bound = None
        return self

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.op(q, k, v, *self.args)


class NativeHost:
    """The C++ side of a native int4 cache's compiled step (cache/static.py's `HostPlan`
    `host`): the op its graph calls per layer (decodelab::int4_host_attend,
    models/kernels/native_ops.cpp), how each booked step is handed to it, and how a plan's
    bindings are dropped with it."""

    @staticmethod
    def op():
        return torch.ops.decodelab.int4_host_attend

    @staticmethod
    def bind(handle: int, steps: list | None) -> None:
        """Hand a booked step's layers to int4_host_attend of HostPlan `handle`: each
        `NativeLayerCall`'s stores where they changed since it was last bound there, each
        window's step arguments (new tokens, spans, queries), and which layers it attends
        itself; the others (and every layer where `steps` is None) it hands to
        decodelab::host_attend, the Python path."""
        ops, armed, slots = torch.ops.decodelab, [], {}
        for layer, call in enumerate(steps or ()):
            if not isinstance(call, NativeLayerCall):
                armed.append(0)
                continue
            a = call.args
            slot = slots.setdefault(id(a[9]), (len(slots), a))[0]  # one per window: its spans list
            if call.bound != (handle, slot):
                ops.int4_host_layer(handle, layer, slot, *a[1:9], *a[12:16])
                call.bound = (handle, slot)
            armed.append(1)
        for slot, a in slots.values():
            ops.int4_host_step(handle, slot, a[0], a[9], a[10], a[11])
        ops.int4_host_arm(handle, armed)

    @staticmethod
    def drop(handle: int) -> None:
        torch.ops.decodelab.int4_host_drop(handle)


def _native_stores(rows: Int4Rows) -> list[list[torch.Tensor]]:
    """The stores as the native operators take them: per kind, one tensor per row."""
    return _store_lists(rows.key_codes, rows.value_codes, rows.key_exact, rows.value_exact)


def _store_lists(k: list[QStore], v: list[QStore], key_exact, value_exact) -> list[list[torch.Tensor]]:
    return [[s.data for s in k], [s.scale for s in k], [s.offset for s in k], [s.data for s in v],
            [s.scale for s in v], [s.offset for s in v], key_exact, value_exact]


def _native_spans(rows: Int4Rows) -> list[int]:
    """Per row (dequant_from, dequant_to, exact_from, exact_to, exact_start), flattened."""
    return [x for span in zip(rows.dequant_from, rows.dequant_to, rows.exact_from, rows.exact_to, rows.exact_start)
            for x in span]
