"""THE prefill path: every setup (every cache, every decoder, target and draft) uses it."""

from __future__ import annotations

import torch


def pad_prompts(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T] and their lengths [B] (on `device`)."""
    lengths = torch.tensor([len(p) for p in prompts])
    ids = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p, dtype=torch.long)
    return ids.to(device), lengths


@torch.no_grad()
def prefill(model, cache, prompts: list[list[int]], chunk_size: int | None = None) -> torch.Tensor:
    """Run the prompts [B][n_b] through the model after what each row already holds
    (`cache.lengths`); return the logits [B, V] of each row's last prompt position.

    Rows are right-padded; padding is marked invalid, sits at later positions than any
    real token of its row, and is overwritten by the first decode step, so it never
    changes a result. With `chunk_size`, the prompt runs in chunks of that many
    positions (same logits as one pass, smaller peak memory). A backend with a prefix
    cache maps already-cached prompt blocks first; only the rest is computed."""
    fresh = bool((cache.lengths == 0).all())  # prompts start at position 0: a prefix cache applies
    reused = cache.reuse_prefix(prompts) if fresh else [0] * len(prompts)
    logits = _run(model, cache, [p[r:] for p, r in zip(prompts, reused)], chunk_size)
    if fresh:
        cache.remember_prefix(prompts)
    return logits


def _run(model, cache, prompts: list[list[int]], chunk_size: int | None) -> torch.Tensor:
    ids, n = pad_prompts(prompts, model.device)
    B, T = ids.shape
    offsets = torch.arange(T)
    positions = (cache.lengths[:, None] + offsets).to(model.device)  # [B, T]
    valid = (offsets[None, :] < n[:, None]).to(model.device)  # [B, T]
    step = chunk_size or T
    last = None
    for s in range(0, T, step):
        e = min(s + step, T)
        inside = (n - 1 >= s) & (n - 1 < e)  # [B] rows whose last token is in this chunk
        at = (n - 1 - s).clamp(0, e - s - 1)[:, None].to(model.device)  # [B, 1]
        logits = model(ids[:, s:e], positions[:, s:e], cache, valid=valid[:, s:e], logit_index=at)[:, 0]
        last = logits if last is None else torch.where(inside[:, None].to(model.device), logits, last)
    return last
