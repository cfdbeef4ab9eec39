"""Logit agreement: teacher-force the same token sequence through a setup's cache and
through a reference, and compare the logits position by position.

A setup's cache is fed exactly as decoding feeds it (one prefill, then one token per
step), so what is measured is what a decoder would have seen. The dense reference runs
the whole sequence in one pass.
"""

from __future__ import annotations

import torch

from decodelab.decoding.prefill import prefill
from decodelab.decoding.text import make_cache


@torch.no_grad()
def forced_logits(model, factory, prompt: list[int], ref: list[int]) -> torch.Tensor:
    """Logits [N, V] predicting ref[0..N-1] (N = len(ref)): prefill `prompt` into a cache
    from `factory`, then feed ref[:-1] one token at a time."""
    cache = make_cache(model, 1, len(prompt) + len(ref), factory)
    out = [prefill(model, cache, [prompt])[0]]
    for t in ref[:-1]:
        pos = cache.lengths[:, None].to(model.device)  # [1, 1]
        out.append(model(torch.tensor([[t]], device=model.device), pos, cache)[0, -1])
    return torch.stack(out).float()


@torch.no_grad()
def dense_logits(model, prompt: list[int], ref: list[int]) -> torch.Tensor:
    """The dense reference in one pass: logits [N, V] at positions len(prompt)-1 ... ."""
    from decodelab.cache.dense import DenseCache

    ids = prompt + ref[:-1]
    cache = make_cache(model, 1, len(ids), DenseCache)
    pos = torch.arange(len(ids), device=model.device)[None]  # [1, T]
    logits = model(torch.tensor([ids], device=model.device), pos, cache)  # [1, T, V]
    return logits[0, len(prompt) - 1:].float()


@torch.no_grad()
def hf_logits(hf, prompt: list[int], ref: list[int]) -> torch.Tensor:
    """transformers' own model (the oracle) over the same sequence: logits [N, V]."""
    ids = torch.tensor([prompt + ref[:-1]], device=hf.device)
    return hf(ids).logits[0, len(prompt) - 1:].float()


def compare(ref_logits: torch.Tensor, logits: torch.Tensor, tokens: list[int] | None = None) -> dict:
    """Agreement of logits [N, V] with reference logits [N, V]: top-1 agreement, mean
    KL(ref || other), max |logit difference|; with the `tokens` [N] actually fed, the
    first position whose token differs from the reference's argmax (None: none does)."""
    lp, lq = ref_logits.log_softmax(-1), logits.log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)  # [N]
    out = {"top1": (ref_logits.argmax(-1) == logits.argmax(-1)).float().mean().item(), "kl": kl.mean().item(),
           "max_abs_dlogit": (ref_logits - logits).abs().max().item(), "positions": int(ref_logits.shape[0])}
    if tokens is not None:
        diff = (ref_logits.argmax(-1).cpu() != torch.tensor(tokens[: ref_logits.shape[0]])).nonzero()
        out["first_diff"] = int(diff[0, 0]) if len(diff) else None
    return out
