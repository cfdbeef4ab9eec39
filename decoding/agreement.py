"""Logit agreement: teacher-force the same token sequence through a setup's cache and
through a reference, and compare the logits position by position.

A setup's cache is fed exactly as decoding feeds it (one prefill, then one token per
step), so what is measured is what a decoder would have seen. The dense reference runs
the whole sequence in one pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
def verify_forced_logits(model, factory, prompt: list[int], seq: list[int], gamma: int) -> torch.Tensor:
    """Logits [N, V] predicting seq[0..N-1], fed as speculative verification feeds the
    target: prefill, then steps of the last kept token + gamma drafts (here the
    sequence's own next tokens), of which k = gamma, gamma-1, ..., 0 (cycling) are kept
    and the cache rolls the rest back, as after a rejection. The drafter cannot change
    these logits, only which tokens are verified."""
    cache = make_cache(model, 1, len(prompt) + len(seq) + gamma + 1, factory)
    out = [prefill(model, cache, [prompt])[0]]  # predicts seq[0]
    n, step = 0, 0  # seq[:n] is in the cache
    while len(out) < len(seq):
        feed = seq[n: n + gamma + 1]  # seq[n] is the token the last step produced
        L = int(cache.lengths[0])
        pos = torch.arange(L, L + len(feed), device=model.device)[None]  # [1, F]
        logits = model(torch.tensor([feed], device=model.device), pos, cache)[0]  # [F, V]: row i predicts seq[n+i+1]
        k = min(gamma - step % (gamma + 1), len(feed) - 1)  # drafts kept
        out.extend(logits[: k + 1])
        cache.truncate(torch.tensor([L + k + 1]))  # roll back the rejected drafts
        n, step = n + k + 1, step + 1
    return torch.stack(out[: len(seq)]).float()


def setup_logits(model, factory, decoder, prompt: list[int], seq: list[int]) -> torch.Tensor:
    """Teacher-forced logits [N, V] through a setup's cache, fed as its decoder feeds it
    (a decoder that verifies ahead: gamma + 1 tokens per step with rollbacks)."""
    gamma = decoder.lookahead - 1 if decoder.lookahead else 0
    if gamma:
        return verify_forced_logits(model, factory, prompt, seq, gamma)
    return forced_logits(model, factory, prompt, seq)


def first_diff(a: list[int], b: list[int]) -> int | None:
    """First position where two token lists differ (None: identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


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


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy continuation through its own cache: n ids (EOS ignored)."""
    from decodelab.models.reference import hf_steps

    return hf_steps(hf, prompt, n - 1)[0].argmax(-1).tolist()


def compare(ref_logits: torch.Tensor, logits: torch.Tensor, tokens: list[int] | None = None) -> dict:
    """Agreement of logits [N, V] with reference logits [N, V]: top-1 agreement, mean
    KL(ref || other), max |logit difference|; with the `tokens` [N] actually fed, the
    first position whose token differs from the reference's argmax (None: none does)."""
    ref_logits, logits = ref_logits.double(), logits.double().to(ref_logits.device)  # float64: a KL of ~1e-12 stays
    lp, lq = ref_logits.log_softmax(-1), logits.log_softmax(-1)
    p, q = lp.exp(), lq.exp()
    # KL = sum_x p log(p / q) - p + q (the added terms sum to 0); each term is >= 0 in exact
    # arithmetic, so clamping the terms keeps rounding from making the KL negative
    kl = (p * (lp - lq) - p + q).clamp_min(0).sum(-1)  # [N]
    out = {"top1": (ref_logits.argmax(-1) == logits.argmax(-1)).float().mean().item(), "kl": kl.mean().item(),
           "max_abs_dlogit": (ref_logits - logits).abs().max().item(), "positions": int(ref_logits.shape[0])}
    if tokens is not None:
        diff = (ref_logits.argmax(-1).cpu() != torch.tensor(tokens[: ref_logits.shape[0]])).nonzero()
        out["first_diff"] = int(diff[0, 0]) if len(diff) else None
    return out


def pool(rows: list[dict]) -> dict:
    """Per-prompt `compare` results pooled: the worst |dlogit|, KL and top-1 weighted by
    positions, the earliest first difference and how many prompts have one."""
    n = sum(r["positions"] for r in rows)
    diffs = [r["first_diff"] for r in rows if r.get("first_diff") is not None]
    return {"max_abs_dlogit": max(r["max_abs_dlogit"] for r in rows),
            "mean_kl": sum(r["kl"] * r["positions"] for r in rows) / n,
            "top1": sum(r["top1"] * r["positions"] for r in rows) / n, "positions": n,
            "first_diff": min(diffs) if diffs else None, "prompts_differing": len(diffs), "prompts": len(rows)}


@dataclass(frozen=True)
class Thresholds:
    """What a setup must meet against its reference; None: not judged."""

    max_abs_dlogit: float | None = None  # worst |logit difference|
    max_kl: float | None = None  # mean KL(reference || setup)
    min_top1: float | None = None  # share of positions with the reference's argmax
    free_identical: bool | None = None  # free-running output token-identical to the reference's

    def problems(self) -> list[str]:
        number = lambda v, lo, hi: isinstance(v, (int, float)) and not isinstance(v, bool) and lo <= v <= hi  # noqa: E731
        p = [f"agreement.{k} must be null (not judged) or a number >= 0, got {getattr(self, k)!r}"
             for k in ("max_abs_dlogit", "max_kl") if getattr(self, k) is not None and not number(getattr(self, k),
                                                                                                  0, math.inf)]
        if self.min_top1 is not None and not number(self.min_top1, 0, 1):
            p.append(f"agreement.min_top1 must be null (not judged) or a number in [0, 1], got {self.min_top1!r}")
        if self.free_identical not in (None, True, False):
            p.append(f"agreement.free_identical must be null, true or false, got {self.free_identical!r}")
        return p

    def failures(self, pooled: dict, judge_free: bool = True) -> list[str]:
        """Every threshold `pool`'s result exceeds (NaN exceeds all); the free-running check
        only when `judge_free` (not for sampled output, nor without free-running tokens)."""
        out = []
        if self.max_abs_dlogit is not None and not pooled["max_abs_dlogit"] <= self.max_abs_dlogit:
            out.append(f"max |dlogit| {pooled['max_abs_dlogit']:.3g} > {self.max_abs_dlogit:.3g}")
        if self.max_kl is not None and not pooled["mean_kl"] <= self.max_kl:
            out.append(f"mean KL {pooled['mean_kl']:.3g} > {self.max_kl:.3g}")
        if self.min_top1 is not None and not pooled["top1"] >= self.min_top1:
            out.append(f"top-1 {pooled['top1']:.4f} < {self.min_top1:.4f}")
        if self.free_identical and judge_free and pooled["prompts_differing"]:
            out.append(f"free-running output differs from the reference's at token {pooled['first_diff']} "
                       f"({pooled['prompts_differing']}/{pooled['prompts']} prompts)")
        return out
