"""The paged decode-attention kernel (Triton); its reference and signature are in
cache/kernels/paged.py. Imported only when the Triton path runs.

Grid (B * Hkv, splits). A program reads the keys of its split of the row's key range
straight from the pool: key position p sits in block table[b, p // bs] at offset
p % bs, i.e. at element ((h * N + block) * bs + p % bs) * D of the heads-major pool
[Hkv, N, bs, D]; a tile of BLOCK_N keys may span several, non-consecutive blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from decodelab.cache.kernels.common_triton import attend_tile, combine, dot_dtype, finish, partials
from decodelab.cache.kernels.dispatch import split_count


@triton.jit
def _paged_kernel(Q, K, V, TABLE, QPOS, KVLEN, OUT, ACC, M, L,
                  qk_scale, softcap, window, T, G: tl.constexpr, D: tl.constexpr, n_heads_kv, n_splits, ROWS,
                  stride_qb, stride_qh, stride_qt, stride_kh, stride_kn, stride_tb, stride_pb,
                  stride_ob, stride_oh, stride_ot,
                  BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, IEEE: tl.constexpr, DOT: tl.constexpr,
                  DIRECT: tl.constexpr):
    bh, split = tl.program_id(0), tl.program_id(1)
    b, h = bh // n_heads_kv, bh % n_heads_kv
    rows = tl.arange(0, BLOCK_M)
    t, g = rows // G, rows % G
    row_ok = rows < ROWS
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    qp = tl.load(QPOS + b * stride_pb + t, mask=row_ok, other=-1)  # [M] query positions
    kv_len = tl.load(KVLEN + b)
    # the row's key range [lo, hi): up to its last query, from its first query's window
    hi = tl.minimum(kv_len, tl.max(qp, 0) + 1)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(tl.min(tl.where(row_ok, qp, 2147483647), 0) - window + 1, 0)
    chunk = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), n_splits), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(start + chunk, hi)

    q_ptr = Q + b * stride_qb + (h * G + g)[:, None] * stride_qh + t[:, None] * stride_qt + offs_d[None, :]
    q = tl.load(q_ptr, mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT)  # [M, Dp]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    head = h.to(tl.int64) * stride_kh
    for n0 in range(start, end, BLOCK_N):
        p = n0 + tl.arange(0, BLOCK_N)  # [N] key positions
        k_ok = p < end
        blk = tl.load(TABLE + b * stride_tb + p // BS, mask=k_ok, other=0).to(tl.int64)
        k_ok = k_ok & (blk >= 0)
        at = head + blk * stride_kn + (p % BS) * D  # [N] element offsets of the key rows
        if D % 8 == 0:
            at = tl.multiple_of(at, 8)  # rows start 16-byte aligned: vector loads
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(K + at[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(DOT)
        v = tl.load(V + at[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(DOT)
        visible = k_ok[None, :] & (p[None, :] <= qp[:, None])  # causal
        if HAS_WINDOW:
            visible = visible & (p[None, :] > qp[:, None] - window)
        m_i, l_i, acc = attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, softcap, HAS_SOFTCAP, IEEE)
    finish(OUT, ACC, M, L, acc, m_i, l_i, b, h, split, rows, offs_d, G, D, stride_ob, stride_oh, stride_ot,
           n_heads_kv, n_splits, ROWS, DIRECT)


def paged_attention(q, k_pool, v_pool, table, qpos, kv_len, scale, window=None, softcap=None, num_splits=None):
    """See cache.kernels.paged.paged_attention_reference (same signature and result)."""
    B, Hq, T, D = q.shape
    Hkv, N, bs, _ = k_pool.shape
    assert k_pool.stride() == v_pool.stride() and k_pool.stride()[2:] == (D, 1), "key rows must be contiguous"
    assert q.stride(-1) == 1 and Hq % Hkv == 0
    G = Hq // Hkv
    rows = G * T
    if num_splits is None:
        num_splits = split_count(B * Hkv, table.shape[1] * bs, q.device)
    out = torch.empty(B, Hq, T, D, dtype=q.dtype, device=q.device)
    direct = num_splits == 1
    acc, m, l_s = partials(B, Hkv, 1 if direct else num_splits, rows, D, q.device)
    ieee, dot = dot_dtype(q)
    table, qpos, kv_len = table.contiguous(), qpos.contiguous(), kv_len.contiguous()
    _paged_kernel[(B * Hkv, num_splits)](
        q, k_pool, v_pool, table, qpos, kv_len, out, acc, m, l_s,
        float(scale), float(softcap or 0.0), int(window or 0), T, G, D, Hkv, num_splits, rows,
        q.stride(0), q.stride(1), q.stride(2), k_pool.stride(0), k_pool.stride(1), table.stride(0), qpos.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        BS=bs, BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_N=64 if D <= 128 else 32,
        BLOCK_D=max(16, triton.next_power_of_2(D)), HAS_WINDOW=window is not None, HAS_SOFTCAP=bool(softcap),
        IEEE=ieee, DOT=dot, DIRECT=direct, num_warps=8 if rows > 32 else 4)
    return out if direct else combine(out, acc, m, l_s, G)
