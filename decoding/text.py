"""Text in, text out: tokenize (timed as part of TTFT), size a cache, generate."""

from __future__ import annotations

import time
from typing import Generator

import torch

from decodelab.cache.base import CacheLayout, KVCache, planned_bytes
from decodelab.cache.dense import DenseCache
from decodelab.cache.factory import CacheFactory
from decodelab.decoding.compiled import static_capacity
from decodelab.decoding.decoders import greedy
from decodelab.decoding.generate import (GenerationResult, TokenCallback, TokenEvent, drain, new_tokens_problems,
                                         stream_tokens)
from decodelab.models.errors import SetupError, raise_if, shown

GiB = 2**30


def free_bytes(device) -> int | None:
    """Memory a new allocation on `device` can still get, in bytes: on CUDA the driver's
    free memory plus what torch's allocator holds unused; on a CPU the available RAM
    (psutil, else MemAvailable in /proc/meminfo); None where it cannot be known."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    try:
        import psutil
    except ImportError:
        return _meminfo_available()
    return int(psutil.virtual_memory().available)


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            fields = dict(line.split(":", 1) for line in fh)
    except OSError:
        return None
    kib = fields.get("MemAvailable", "").split()
    return int(kib[0]) * 1024 if kib else None


def capacity_problems(model, batch_size: int, capacity: int, factory: CacheFactory = DenseCache,
                      fix: str = "lower max_new_tokens or shorten the prompt") -> list[str]:
    """Every reason a cache of `batch_size` rows x `capacity` tokens from `factory` cannot
    be built for `model`, found without allocating anything: the capacity against the
    model's context (`cfg.max_seq_len`), and the backend's `planned_bytes` against the
    free memory of the model's device (`free_bytes`). Entry points call it right after
    tokenizing (capacity = longest prompt + max_new_tokens + the decoder's lookahead);
    `make_cache` raises it. `fix`: the advice, in the options of the entry point that asks."""
    if not (isinstance(batch_size, int) and isinstance(capacity, int)) or batch_size < 1 or capacity < 1:
        return []  # the backend's constructor names these
    p = []
    context = getattr(model.cfg, "max_seq_len", None)
    if context and capacity > context:
        p.append(f"a cache of {capacity:,} tokens per row (prompt + max_new_tokens + the decoder's lookahead) "
                 f"exceeds the model's context of {context:,} tokens; {fix}")
    layout = CacheLayout.of(model)
    try:
        need = planned_bytes(factory, layout, batch_size, capacity)
    except SetupError as e:  # options the backend cannot size: the reasons its constructor gives
        return p + e.reasons
    free = free_bytes(layout.device)
    if free is not None and need > free:
        p.append(f"the KV cache ({batch_size} row(s) x {capacity:,} tokens) needs {need / GiB:.2f} GiB "
                 f"({need:,} bytes) but {free / GiB:.2f} GiB is free on {layout.device}; {fix}, lower the "
                 "batch, or use a smaller cache (int4, or paged with memory_budget_mb)")
    return p


def make_cache(model, batch_size: int, capacity: int, backend: CacheFactory = DenseCache,
               fix: str = "lower max_new_tokens or shorten the prompt") -> KVCache:
    """A cache of `backend` laid out for `model` (its dtype and device). Refused with a
    SetupError, before anything is allocated, for every `capacity_problems` reason (`fix`:
    the advice they give)."""
    raise_if(capacity_problems(model, batch_size, capacity, backend, fix))
    return backend(CacheLayout.of(model), batch_size, capacity)


def compiled_capacity(model, batch_size: int, need: int, factory: CacheFactory = DenseCache) -> int:
    """The capacity of a cache whose steps compile: `need` rounded up (`static_capacity`),
    so that nearby lengths share one compile, where the rounded cache passes every
    `capacity_problems` check (a fixed paged pool, a memory budget, free memory); else
    `need` itself."""
    rounded = static_capacity(need, model.cfg.max_seq_len)
    return rounded if rounded == need or not capacity_problems(model, batch_size, rounded, factory) else need


def text_problems(lm, prompts, decoder, cache, max_new_tokens) -> list[str]:
    """What `generate_text` cannot take, each with the type it expected, before tokenizing."""
    from decodelab.decoding.decoders import decoder_type_problems

    p = []
    if not (hasattr(lm, "model") and hasattr(lm, "tokenizer_dir")):
        p.append(f"generate_text takes a LoadedModel (decodelab.models.loading.load(...)), got a {type(lm).__name__}; "
                 "a bare model generates from token ids: decodelab.decoding.generate(model, cache, decoder, ids, n)")
    if not (isinstance(prompts, str) or isinstance(prompts, (list, tuple)) and prompts
            and all(isinstance(t, str) for t in prompts)):
        p.append(f"prompts must be a str or a non-empty list of str, got {shown(prompts)}; "
                 "token ids go to decodelab.decoding.generate")
    p += new_tokens_problems(max_new_tokens)
    p += decoder_type_problems(decoder) if decoder is not None else []
    if not callable(cache) or isinstance(cache, KVCache):
        p.append(f"cache must be a cache factory, called (layout, batch_size, capacity): a KVCache class such as "
                 f"DenseCache, functools.partial(PagedCache, block_size=32), or decodelab.cache.backend('paged') "
                 f"(a conf/cache option by name); got {shown(cache)}")
    return p


def generate_text(lm, prompts: str | list[str], *, decoder=None, cache: CacheFactory = DenseCache,
                  max_new_tokens: int = 64, chat: bool = False, stop=(),
                  on_token: TokenCallback | None = None, prefill_chunk: int | None = None,
                  compile: bool = False) -> GenerationResult:
    """Generate from text prompts with a `LoadedModel`; greedy and dense by default.
    `on_token(row, token_id, text)` streams each token as it comes (`stream` is the same
    as an iterator). `compile=True`: a compiled decode step (`generate`); then, and with a
    drafter that compiles, over a capacity rounded up so that nearby prompt lengths share
    one compile (`compiled_capacity`)."""
    events = stream(lm, prompts, decoder=decoder, cache=cache, max_new_tokens=max_new_tokens, chat=chat, stop=stop,
                    prefill_chunk=prefill_chunk, compile=compile, detokenize=on_token is not None)
    return drain(events, on_token)


def stream(lm, prompts: str | list[str], *, decoder=None, cache: CacheFactory = DenseCache,
           max_new_tokens: int = 64, chat: bool = False, stop=(), prefill_chunk: int | None = None,
           compile: bool = False, detokenize: bool = True) -> Generator[TokenEvent, None, GenerationResult]:
    """`generate_text` as an iterator, `for event in stream(lm, prompts, ...)`: one
    `TokenEvent(row, token, text, finish_reason)` per generated token of every row, as the
    steps produce them; each row's `text` pieces concatenate to its final text. The inputs
    are checked, the prompts tokenized and the cache built now (a SetupError before any
    forward); each step runs when the iterator is advanced, so leaving the loop early
    (`break`) stops the generation there. Its return value (`StopIteration.value`) is the
    `GenerationResult`, timings included. `detokenize=False`: events without text (no
    decoding per token)."""
    t0 = time.perf_counter()
    raise_if(text_problems(lm, prompts, decoder, cache, max_new_tokens))
    texts = [prompts] if isinstance(prompts, str) else list(prompts)
    ids = [lm.tokenizer.encode(t, chat=chat) for t in texts]
    tokenize_s = time.perf_counter() - t0
    decoder = decoder or greedy()
    capacity = max(len(x) for x in ids) + max_new_tokens + decoder.lookahead
    if compile or getattr(getattr(decoder, "drafter", None), "compile", False):  # a step compiles
        capacity = compiled_capacity(lm.model, len(ids), capacity, cache)
    kv = make_cache(lm.model, len(ids), capacity, cache)
    return stream_tokens(lm.model, kv, decoder, ids, max_new_tokens, eos_ids=lm.tokenizer.eos_ids, stop=stop,
                         tokenizer=lm.tokenizer, prefill_chunk=prefill_chunk, t_start=t0, tokenize_s=tokenize_s,
                         compile=compile, detokenize=detokenize)
