"""Pure sampling math: logits -> probabilities -> tokens. Greedy is temperature 0."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from decodelab.models import native
from decodelab.models.errors import shown


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; top_k 0 = off; top_p 1 = off; min_p 0 = off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def problems(self) -> list[str]:
        """Every out-of-range value, each with its allowed range."""
        p = []
        ranges = {  # name: (the type it takes, whether a value is in range, the range in words)
            "temperature": ("a number", lambda t: not (math.isnan(t) or t < 0 or math.isinf(t)),
                            ">= 0 and finite (0 = greedy)"),
            "top_k": ("an integer", lambda k: k >= 0, ">= 0 (0 = off)"),
            "top_p": ("a number", lambda x: 0 < x <= 1, "in (0, 1] (1 = off)"),
            "min_p": ("a number", lambda x: 0 <= x <= 1, "in [0, 1] (0 = off)"),
        }
        for name, (kind, fits, allowed) in ranges.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int if kind == "an integer" else (int, float)):
                p.append(f"{name} must be {kind} {allowed}, got {shown(v)}")
            elif not fits(v):
                p.append(f"{name} must be {kind} {allowed}, got {v}")
        return p

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """probs [..., V] (float32) after temperature, top-k, top-p and min-p, in that order.
    Temperature 0 gives the one-hot distribution of the argmax."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(native.argmax(logits), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = _top_p(probs, params.top_p)
    if params.min_p > 0.0:
        # keep x with p(x) >= min_p * max p
        probs = probs.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), 0.0)
    return probs / probs.sum(-1, keepdim=True)


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest prefix of tokens (by descending p) whose mass reaches top_p."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
    sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)  # the first token is always kept
    return torch.zeros_like(probs).scatter(-1, order, sorted_p)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row: probs [B, V] -> ids [B]."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None):
    """Next token ids [B] from logits [B, V]; greedy takes the argmax without sampling."""
    if params.greedy:
        return native.argmax(logits)
    return sample(logits_to_probs(logits, params), generator)
