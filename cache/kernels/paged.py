"""Paged decode attention: queries over K/V read through a block table from the paged
cache's heads-major pools (cache/paged.py). The reference gathers every slot the table
can address and runs `reference_attention`; the Triton kernel (paged_triton.py) reads
the blocks in place, split-K over the key range for long contexts. Same signature.
"""

from __future__ import annotations

import torch

from decodelab.cache.base import reference_attention


def paged_attention_reference(
    q: torch.Tensor,  # [B, Hq, T, D] queries (T = 1, or gamma + 1 when verifying)
    k_pool: torch.Tensor,  # [Hkv, N, bs, D] one layer's keys, heads-major (any strides, rows of D contiguous)
    v_pool: torch.Tensor,  # [Hkv, N, bs, D]
    table: torch.Tensor,  # [B, M] int: block of positions [i * bs, (i + 1) * bs) of row b; -1: none
    qpos: torch.Tensor,  # [B, T] int: the queries' positions
    kv_len: torch.Tensor,  # [B] int: row b holds positions [0, kv_len[b])
    scale: float,
    window: int | None = None,  # a query at q sees keys p with q - p < window
    softcap: float | None = None,
    num_splits: int | None = None,  # kernel tuning (split-K); no effect on the result
) -> torch.Tensor:
    """Attention [B, Hq, T, D] of each query over its row's keys p <= q (and inside the
    window): causal within the new tokens too. A query that sees no key gets zeros."""
    bs, dev = k_pool.shape[2], q.device
    kpos = torch.arange(table.shape[1] * bs, device=dev)  # [S] every position the table addresses
    blocks = table.to(dev).long()[:, kpos // bs]  # [B, S]
    held = (blocks >= 0) & (kpos[None] < kv_len.to(dev)[:, None])  # [B, S]
    k, v = gather_rows(k_pool, table, bs), gather_rows(v_pool, table, bs)  # [B, Hkv, S, D]
    qp = qpos.to(dev)[..., None]  # [B, T, 1]
    mask = held[:, None, :] & (kpos <= qp)  # [B, T, S]
    if window is not None:
        mask &= kpos > qp - window
    out = reference_attention(q, k, v, mask[:, None], scale, softcap)
    return out.masked_fill(~mask.any(-1)[:, None, :, None], 0.0)


def gather_rows(pool: torch.Tensor, table: torch.Tensor, bs: int) -> torch.Tensor:
    """A pool [Hkv, N, bs, D] read through the block table [B, M] as row-major rows
    [B, Hkv, M * bs, D]: every position the table addresses (a position of no block, -1,
    reads block 0: past the row's length, where no query looks)."""
    dev = pool.device
    kpos = torch.arange(table.shape[1] * bs, device=dev)  # [S]
    blocks = table.to(dev).long()[:, kpos // bs].clamp(min=0)  # [B, S]
    heads = torch.arange(pool.shape[0], device=dev)[None, :, None]  # [1, Hkv, 1]
    return pool[heads, blocks[:, None], (kpos % bs)[None, None]]  # broadcast to [B, Hkv, S], D each


def dense_as_pool(t: torch.Tensor, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense cache layer [B, Hkv, S, D] (S a multiple of bs) as the kernels' heads-major
    pool [Hkv, N, bs, D], a strided view with no copy, and its block table [B, S / bs]:
    row b's positions [i * bs, (i + 1) * bs) are block b * Hkv * S / bs + i."""
    B, H, S, D = t.shape
    n = ((B - 1) * H + 1) * (S // bs)  # the last block of the last row ends the storage
    rows = torch.arange(B, device=t.device)[:, None] * (H * S // bs)
    table = (rows + torch.arange(S // bs, device=t.device)).to(torch.int32)  # [B, S / bs]
    return t.as_strided((H, n, bs, D), (S * D, bs * D, D, 1)), table


def paged_attention_triton(q, k_pool, v_pool, table, qpos, kv_len, scale, window=None, softcap=None,
                           num_splits=None) -> torch.Tensor:
    """The Triton kernel of `paged_attention_reference` (same arguments, same result);
    `num_splits` None picks a split-K count that fills the GPU."""
    from decodelab.cache.kernels import paged_triton  # triton is imported here, at first use

    return paged_triton.paged_attention(q, k_pool, v_pool, table, qpos, kv_len, scale, window, softcap, num_splits)
