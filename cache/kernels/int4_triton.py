"""The INT4 decode-attention kernel (Triton); its reference and signature are in
cache/kernels/int4.py. Imported only when the Triton path runs.

One launch per row (the int4 cache keeps per-row stores), grid (Hkv, S + 1): splits
0..S-1 share the row's quantized range [lo, qa) and unpack its codes in registers, split
S reads the exact range [fs, hi); one `combine` launch merges every row's splits.

Unpacking (cache/int4_codec.py, `Grouping`): a group of `group` codes lies in R = group x bits / 8
bytes, code i in byte i % R at bit (i // R) x bits; x = code x scale + offset.
- channel axis: codes [H, N/group, R, D], scales [H, N/group, 1, D]: position p is code
  p % group of group p // group, per channel d;
- token axis: codes [H, N, D/group, R], scales [H, N, D/group, 1]: channel d of position
  p is code d % group of group d // group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from decodelab.cache.kernels.common_triton import attend_tile, combine, dot_dtype, finish, partials
from decodelab.cache.kernels.dispatch import split_count


@triton.jit
def dequant_tile(DATA, SCALE, OFF, h, p, d, ok, s0, s1, s2, s3, c0, c1, c2, c3,
                 TOKEN: tl.constexpr, GROUP: tl.constexpr, R: tl.constexpr, BITS: tl.constexpr):
    """Keys or values [N, Dp] (fp32) of positions p [N] and channels d [Dp]; `ok` [N, Dp] masks loads."""
    pp = p.to(tl.int64)[:, None]  # [N, 1]
    dd = d[None, :]  # [1, Dp]
    if TOKEN:
        i = dd % GROUP  # code index inside the group
        byte_at = h * s0 + pp * s1 + (dd // GROUP) * s2 + (i % R) * s3
        scale_at = h * c0 + pp * c1 + (dd // GROUP) * c2
    else:
        i = pp % GROUP
        byte_at = h * s0 + (pp // GROUP) * s1 + (i % R) * s2 + dd * s3
        scale_at = h * c0 + (pp // GROUP) * c1 + dd * c3
    byte = tl.load(DATA + byte_at, mask=ok, other=0).to(tl.int32)
    code = (byte >> ((i // R) * BITS).to(tl.int32)) & ((1 << BITS) - 1)
    scale = tl.load(SCALE + scale_at, mask=ok, other=0.0).to(tl.float32)
    offset = tl.load(OFF + scale_at, mask=ok, other=0.0).to(tl.float32)
    return code.to(tl.float32) * scale + offset


@triton.jit
def _int4_kernel(Q, KD, KS, KO, VD, VS, VO, KR, VR, QPOS, VIS, OUT, ACC, M, L,
                 b, lo, qa, fs, hi, p0, qk_scale, softcap, window, T, G: tl.constexpr, D: tl.constexpr,
                 n_heads_kv, n_splits, ROWS,
                 stride_qb, stride_qh, stride_qt, stride_pb,
                 kd0, kd1, kd2, kd3, ks0, ks1, ks2, ks3, vd0, vd1, vd2, vd3, vs0, vs1, vs2, vs3,
                 kr0, kr1, vr0, vr1,
                 K_TOKEN: tl.constexpr, K_GROUP: tl.constexpr, K_R: tl.constexpr,
                 V_TOKEN: tl.constexpr, V_GROUP: tl.constexpr, V_R: tl.constexpr, BITS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, IEEE: tl.constexpr, DOT: tl.constexpr):
    h, split = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    t, g = rows // G, rows % G
    row_ok = rows < ROWS
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    qp = tl.load(QPOS + b * stride_pb + t, mask=row_ok, other=-1)  # [M] query positions
    vq = tl.load(VIS + b * stride_pb + t, mask=row_ok, other=0)  # [M] V(q): first exact position
    q_ptr = Q + b * stride_qb + (h * G + g)[:, None] * stride_qh + t[:, None] * stride_qt + offs_d[None, :]
    q = tl.load(q_ptr, mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hq = h.to(tl.int64)
    n_quant = n_splits - 1
    if split < n_quant:  # a share of the dequantized positions [lo, qa)
        chunk = tl.cdiv(tl.cdiv(tl.maximum(qa - lo, 0), n_quant), BLOCK_N) * BLOCK_N
        start = lo + split * chunk
        end = tl.minimum(start + chunk, qa)
        for n0 in range(start, end, BLOCK_N):
            p = n0 + tl.arange(0, BLOCK_N)
            k_ok = p < end
            ok = k_ok[:, None] & d_ok[None, :]
            k = dequant_tile(KD, KS, KO, hq, p, offs_d, ok, kd0, kd1, kd2, kd3, ks0, ks1, ks2, ks3,
                             K_TOKEN, K_GROUP, K_R, BITS).to(DOT)
            v = dequant_tile(VD, VS, VO, hq, p, offs_d, ok, vd0, vd1, vd2, vd3, vs0, vs1, vs2, vs3,
                             V_TOKEN, V_GROUP, V_R, BITS).to(DOT)
            visible = k_ok[None, :] & (p[None, :] < vq[:, None]) & (p[None, :] <= qp[:, None])
            if HAS_WINDOW:
                visible = visible & (p[None, :] > qp[:, None] - window)
            m_i, l_i, acc = attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, softcap, HAS_SOFTCAP, IEEE)
    else:  # the exact positions [fs, hi)
        for n0 in range(fs, hi, BLOCK_N):
            p = n0 + tl.arange(0, BLOCK_N)
            k_ok = p < hi
            ok = k_ok[:, None] & d_ok[None, :]
            at = (p - p0).to(tl.int64)  # [N] rows of the exact store
            k_at, v_at = hq * kr0 + at * kr1, hq * vr0 + at * vr1
            if D % 8 == 0:  # rows start 16-byte aligned: vector loads
                k_at, v_at = tl.multiple_of(k_at, 8), tl.multiple_of(v_at, 8)
            k = tl.load(KR + k_at[:, None] + offs_d[None, :], mask=ok, other=0.0).to(DOT)
            v = tl.load(VR + v_at[:, None] + offs_d[None, :], mask=ok, other=0.0).to(DOT)
            visible = k_ok[None, :] & (p[None, :] >= vq[:, None]) & (p[None, :] <= qp[:, None])
            if HAS_WINDOW:
                visible = visible & (p[None, :] > qp[:, None] - window)
            m_i, l_i, acc = attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, softcap, HAS_SOFTCAP, IEEE)
    finish(OUT, ACC, M, L, acc, m_i, l_i, b, h, split, rows, offs_d, G, D, 0, 0, 0,
           n_heads_kv, n_splits, ROWS, False)


def _strides(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.stride()) if t.numel() else (0,) * t.dim()


def int4_attention(q, rows, qpos, vis, scale, window=None, softcap=None, num_splits=None):
    """See cache.kernels.int4.int4_attention_reference (same signature and result)."""
    B, Hq, T, D = q.shape
    Hkv = rows.key_exact[0].shape[0]
    G = Hq // Hkv
    n_rows = G * T
    if num_splits is None:
        num_splits = split_count(Hkv, max(e - s for s, e in zip(rows.dequant_from, rows.dequant_to)), q.device)
    S = num_splits + 1  # + the exact split
    out = torch.empty(B, Hq, T, D, dtype=q.dtype, device=q.device)
    acc, m, l_s = partials(B, Hkv, S, n_rows, D, q.device)
    ieee, dot = dot_dtype(q)
    qpos, vis = qpos.contiguous(), vis.contiguous()
    kg, vg = rows.key_grouping, rows.value_grouping
    consts = dict(K_TOKEN=kg.axis == "token", K_GROUP=kg.size, K_R=kg.size * kg.bits // 8,
                  V_TOKEN=vg.axis == "token", V_GROUP=vg.size, V_R=vg.size * vg.bits // 8, BITS=kg.bits,
                  BLOCK_M=max(16, triton.next_power_of_2(n_rows)), BLOCK_N=64 if D <= 128 else 32,
                  BLOCK_D=max(16, triton.next_power_of_2(D)), HAS_WINDOW=window is not None,
                  HAS_SOFTCAP=bool(softcap), IEEE=ieee, DOT=dot, num_warps=8 if n_rows > 32 else 4, num_stages=2)
    for b in range(B):
        kc, vc = rows.key_codes[b], rows.value_codes[b]  # QStore: data, scale, offset
        ke, ve = rows.key_exact[b], rows.value_exact[b]  # [Hkv, E, D]
        assert ke.stride()[1:] == ve.stride()[1:] == (D, 1) and kc.scale.stride() == kc.offset.stride()
        assert vc.scale.stride() == vc.offset.stride()
        _int4_kernel[(Hkv, S)](
            q, kc.data, kc.scale, kc.offset, vc.data, vc.scale, vc.offset, ke, ve, qpos, vis, out, acc, m, l_s,
            b, rows.dequant_from[b], rows.dequant_to[b], rows.exact_from[b], rows.exact_to[b], rows.exact_start[b],
            float(scale), float(softcap or 0.0), int(window or 0), T, G, D, Hkv, S, n_rows,
            q.stride(0), q.stride(1), q.stride(2), qpos.stride(0),
            *_strides(kc.data), *_strides(kc.scale), *_strides(vc.data), *_strides(vc.scale),
            ke.stride(0), ke.stride(1), ve.stride(0), ve.stride(1), **consts)
    return combine(out, acc, m, l_s, G)
