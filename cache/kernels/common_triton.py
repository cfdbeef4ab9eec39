"""Triton pieces the decode kernels share: the online-softmax update of one key tile and
the split-K combine. Imported only when a Triton path runs (see cache/kernels/__init__).

Conventions. A program owns one (row b, KV head h) and all the query rows that share h:
query row r = t * G + g is query position t of query head h * G + g (GQA packing), so
BLOCK_M >= G * T rows go through one `tl.dot` per key tile. Scores live in the log2
domain (exp2). A split writes its partial state (acc [rows, D] unnormalized, running max
m and sum l per row) and `combine` merges the splits:
    out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s,   M = max_s m_s.
A query with no visible key at all gets zeros (never NaN).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def tanh(x):
    """tanh from exp2 (overflow-safe: large |x| gives +-1)."""
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)  # 2x log2(e)


@triton.jit
def attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, softcap,
                HAS_SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    """One key tile: q [M, Dp], k and v [N, Dp] (in the dot dtype), visible [M, N].
    Returns the updated (m_i [M], l_i [M], acc [M, Dp]); m_i and the scores in log2 units."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [M, N] fp32 exactly
    else:
        s = tl.dot(q, tl.trans(k))  # bf16 / fp16 operands, fp32 accumulation
    if HAS_SOFTCAP:  # softcap * tanh(s * scale / softcap), then to log2 units
        s = softcap * tanh(s * (qk_scale / softcap)) * 1.4426950408889634
    else:
        s = s * (qk_scale * 1.4426950408889634)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def finish(OUT, ACC, M, L, acc, m_i, l_i, b, h, split, rows, offs_d, G, D,
           stride_ob, stride_oh, stride_ot, n_heads_kv, n_splits, ROWS,
           DIRECT: tl.constexpr):
    """Write a program's result: the normalized output [B, Hq, T, D] (DIRECT: one split)
    or its partial state for `combine`: ACC [B*Hkv, S, ROWS, D], M and L [B*Hkv, S, ROWS]."""
    row_ok = rows < ROWS
    d_ok = offs_d < D
    if DIRECT:
        t, g = rows // G, rows % G
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        ptr = OUT + b * stride_ob + (h * G + g)[:, None] * stride_oh + t[:, None] * stride_ot + offs_d[None, :]
        tl.store(ptr, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        base = (((b * n_heads_kv + h) * n_splits + split) * ROWS + rows).to(tl.int64)  # [M]
        tl.store(ACC + base[:, None] * D + offs_d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(M + base, m_i, mask=row_ok)
        tl.store(L + base, l_i, mask=row_ok)


@triton.jit
def _combine_kernel(OUT, ACC, M, L, G: tl.constexpr, D: tl.constexpr, stride_ob, stride_oh, stride_ot, n_heads_kv,
                    n_splits, ROWS,
                    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (b, h, query row): merge the splits' partial states."""
    pid = tl.program_id(0)
    bh, r = pid // ROWS, pid % ROWS
    b, h = bh // n_heads_kv, bh % n_heads_kv
    t, g = r // G, r % G
    s = tl.arange(0, BLOCK_S)
    s_ok = s < n_splits
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    idx = ((bh * n_splits + s) * ROWS + r).to(tl.int64)  # [S]
    m = tl.load(M + idx, mask=s_ok, other=float("-inf"))
    l_s = tl.load(L + idx, mask=s_ok, other=0.0)
    top = tl.max(m, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(m - top)  # [S]; 0 for empty splits
    acc = tl.load(ACC + idx[:, None] * D + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    num = tl.sum(w[:, None] * acc, 0)  # [D]
    den = tl.sum(w * l_s, 0)
    out = num / tl.where(den > 0, den, 1.0)
    tl.store(OUT + b * stride_ob + (h * G + g) * stride_oh + t * stride_ot + offs_d, out.to(OUT.dtype.element_ty),
             mask=d_ok)


def partials(B: int, Hkv: int, splits: int, rows: int, D: int, device) -> tuple[torch.Tensor, ...]:
    """Scratch for split-K: acc [B*Hkv, S, rows, D] and m, l [B*Hkv, S, rows] (fp32)."""
    acc = torch.empty(B * Hkv, splits, rows, D, dtype=torch.float32, device=device)
    m = torch.empty(B * Hkv, splits, rows, dtype=torch.float32, device=device)
    return acc, m, torch.empty_like(m)


def combine(out: torch.Tensor, acc: torch.Tensor, m: torch.Tensor, l_s: torch.Tensor, G: int) -> torch.Tensor:
    """Merge the split partials into out [B, Hq, T, D] (written in place, returned)."""
    B, Hq, T, D = out.shape
    BHkv, S, ROWS, _ = acc.shape
    _combine_kernel[(BHkv * ROWS,)](out, acc, m, l_s, G, D, out.stride(0), out.stride(1), out.stride(2),
                                    BHkv // B, S, ROWS, BLOCK_S=max(2, triton.next_power_of_2(S)),
                                    BLOCK_D=triton.next_power_of_2(D))
    return out


def dot_dtype(q: torch.Tensor) -> tuple[bool, object]:
    """(IEEE, dtype the dot operands take): fp32 inputs and the interpreter (whose bf16 dot
    is wrong) compute exact fp32 dots; bf16 / fp16 on a GPU use the tensor cores."""
    from decodelab.cache.kernels.dispatch import interpreting

    ieee = q.dtype == torch.float32 or interpreting()
    return ieee, tl.float32 if ieee else (tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16)
