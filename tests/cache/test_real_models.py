"""Backends against dense on the real checkpoints (slow): exact backends agree to float
rounding past Gemma 3's 512 window; int4 stays close on SmolLM2-135M."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from decodelab.cache.dense import DenseCache
from decodelab.cache.int4 import QuantizedCache
from decodelab.cache.paged import PagedCache
from decodelab.cache.sliding import SlidingCache
from decodelab.decoding.text import make_cache

pytestmark = pytest.mark.slow
TEXT = ("The committee met on Tuesday to review the budget, the schedule and the open questions "
        "about the new library building. ")


def chunked_logits(model, factory, ids: list[int], chunk: int) -> torch.Tensor:
    """All-position logits [T, V], fed in chunks, then the last 16 tokens one at a time."""
    cache = make_cache(model, 1, len(ids), factory)
    out, split = [], len(ids) - 16
    with torch.no_grad():
        for s in range(0, split, chunk):
            e = min(s + chunk, split)
            out.append(model(torch.tensor([ids[s:e]]), torch.arange(s, e)[None], cache)[0])
        for t in range(split, len(ids)):
            out.append(model(torch.tensor([[ids[t]]]), torch.tensor([[t]]), cache)[0])
    return torch.cat(out)


def test_gemma3_exact_backends_past_the_window(gemma3_270m):
    """Same token stream, same chunking (prefill chunks of 384, then 16 single steps)
    through each backend: paged and sliding agree with dense to <= 1e-4 over 1500
    tokens (past the 512 window of the local layers)."""
    ids = gemma3_270m.tokenizer.encode(TEXT * 120)[:1500]
    assert len(ids) == 1500
    m = gemma3_270m.model
    dense = chunked_logits(m, DenseCache, ids, 384)
    for name, factory in [("paged", partial(PagedCache, block_size=16)), ("sliding", partial(SlidingCache, rollback=8))]:
        diff = (chunked_logits(m, factory, ids, 384) - dense).abs().max().item()
        print(f"gemma3-270m {name} vs dense over 1500 tokens: max |dlogit| = {diff:.2e}")
        assert diff <= 1e-4, name


def test_smollm2_int4_stays_close_to_dense(smollm2):
    from decodelab.decoding.agreement import compare, forced_logits
    from decodelab.experiments.workloads import ShareGPT

    tok = smollm2.tokenizer
    reqs = ShareGPT(2, seed=1, min_prompt_tokens=200, max_prompt_tokens=400, min_reference_tokens=256)(smollm2)
    q = partial(QuantizedCache, nbits=4, group_size=64, residual=128)
    for r in reqs:
        prompt, ref = tok.encode(r.prompt, chat=True), tok.encode(r.reference)[:256]
        assert len(prompt) + len(ref) > 128 + 64 + 200  # hundreds of tokens really are quantized
        a = compare(forced_logits(smollm2.model, DenseCache, prompt, ref), forced_logits(smollm2.model, q, prompt, ref))
        print(f"int4 vs dense: top1 {a['top1']:.3f}, KL {a['kl']:.4f}")
        assert a["top1"] >= 0.9 and a["kl"] <= 0.05
