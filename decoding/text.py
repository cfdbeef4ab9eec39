"""Text in, text out: tokenize (timed as part of TTFT), size a cache, generate."""

from __future__ import annotations

import time
from typing import Callable

from decodelab.cache.base import CacheLayout, KVCache
from decodelab.cache.dense import DenseCache
from decodelab.decoding.decoders import SamplingDecoder
from decodelab.decoding.generate import GenerationResult, TokenCallback, generate

CacheFactory = Callable[..., KVCache]  # (layout, batch_size, capacity) -> cache


def make_cache(model, batch_size: int, capacity: int, backend: CacheFactory = DenseCache) -> KVCache:
    """A cache of `backend` laid out for `model` (its dtype and device)."""
    return backend(CacheLayout.of(model), batch_size, capacity)


def generate_text(lm, prompts: str | list[str], *, decoder=None, cache: CacheFactory = DenseCache,
                  max_new_tokens: int = 64, chat: bool = False, stop=(),
                  on_token: TokenCallback | None = None, prefill_chunk: int | None = None) -> GenerationResult:
    """Generate from text prompts with a `LoadedModel`; greedy and dense by default."""
    t0 = time.perf_counter()
    texts = [prompts] if isinstance(prompts, str) else list(prompts)
    ids = [lm.tokenizer.encode(t, chat=chat) for t in texts]
    tokenize_s = time.perf_counter() - t0
    decoder = decoder or SamplingDecoder()
    capacity = max(len(x) for x in ids) + max_new_tokens + decoder.lookahead
    kv = make_cache(lm.model, len(ids), capacity, cache)
    return generate(lm.model, kv, decoder, ids, max_new_tokens,
                    eos_ids=lm.tokenizer.eos_ids, stop=stop, tokenizer=lm.tokenizer, on_token=on_token,
                    prefill_chunk=prefill_chunk, t_start=t0, tokenize_s=tokenize_s)
