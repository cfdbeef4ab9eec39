"""The transformers model holding the same weights as a native one: the oracle of tests,
`experiments.agree` and the side-by-side benchmarks."""

from __future__ import annotations

import contextlib
import time

import torch

from decodelab.models.config import to_hf_config
from decodelab.models.weights import to_hf_state


def hf_reference(model, attn_implementation: str = "eager"):
    """transformers' own `LlamaForCausalLM` / `Gemma3ForCausalLM` / ... with the native
    model's weights, dtype and device, in eval mode."""
    from transformers import AutoModelForCausalLM

    cfg = to_hf_config(model.cfg)
    cfg._attn_implementation = attn_implementation
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    state = to_hf_state(model.cfg, {k: v.detach().float().cpu() for k, v in model.state_dict().items()})
    hf.load_state_dict(state, strict=True)
    return hf.to(device=model.device, dtype=model.dtype).eval()


def hf_model_for(lm):
    """transformers' own model with the same weights (from the converted checkpoint when
    there is one, else built from the native weights), SDPA attention, on lm's device."""
    from transformers import AutoModelForCausalLM

    if lm.hf_dir is None:
        return hf_reference(lm.model, attn_implementation="sdpa")
    hf = AutoModelForCausalLM.from_pretrained(lm.hf_dir, dtype=lm.model.dtype, attn_implementation="sdpa")
    return hf.to(lm.model.device).eval()


def hf_cache_kwarg(hf) -> str:
    """The name transformers gives the cache argument and output (`cache` since it
    renamed `past_key_values` in 5.x)."""
    import inspect

    return "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"


@torch.no_grad()
def hf_steps(hf, prompt: list[int], steps: int, feed: list[int] | None = None, cache=None, timer=None):
    """transformers' model through its own cache (`cache`, else its default): a prefill,
    then `steps` one-token forwards feeding `feed` (teacher forcing) or the argmax, each
    inside `timer` when given; (logits [steps + 1, V] float32, the cache)."""
    kw = hf_cache_kwarg(hf)
    extra = {kw: cache} if cache is not None else {}
    o = hf(torch.tensor([prompt], device=hf.device), use_cache=True, logits_to_keep=1, **extra)
    out = [o.logits[0, -1]]
    for i in range(steps):
        tok = feed[i] if feed is not None else int(out[-1].argmax())
        with timer or contextlib.nullcontext():
            o = hf(torch.tensor([[tok]], device=hf.device), use_cache=True, **{kw: getattr(o, kw)})
        out.append(o.logits[0, -1])
    return torch.stack(out).float(), getattr(o, kw)


def hf_quantized_cache(hf, nbits: int, group_size: int, residual: int):
    """transformers' `QuantizedCache` (quanto backend) for `hf`."""
    from transformers import QuantizedCache

    return QuantizedCache(backend="quanto", config=hf.config, nbits=nbits, q_group_size=group_size,
                          residual_length=residual)


def hf_cache_bytes(cache) -> int:
    """Bytes a transformers cache holds: every tensor of every layer (for a QuantizedCache
    the packed data, scales, shifts and the residual)."""
    def tensors(t) -> list[torch.Tensor]:
        if t is None or type(t) is torch.Tensor:
            return [] if t is None else [t]
        return [x for n in t.__tensor_flatten__()[0] for x in tensors(getattr(t, n))]
    return sum(t.numel() * t.element_size() for layer in cache.layers
               for name in ("_quantized_keys", "_quantized_values", "keys", "values")
               for t in tensors(getattr(layer, name, None)))


class _Stamps:
    """A transformers streamer that stamps each generated token (`put` first gets the prompt)."""

    def __init__(self):
        self.t0, self.times, self.calls = time.perf_counter(), [], 0

    def put(self, value) -> None:
        self.calls += 1
        if self.calls > 1:
            self.times.append(time.perf_counter() - self.t0)

    def end(self) -> None:
        pass


def hf_generate_timed(hf, ids: list[int], new_tokens: int, eos: tuple = ()) -> tuple[list[int], list[float]]:
    """transformers' greedy `generate()` on `ids` (EOS ignored when `eos` is empty): the
    new tokens and, per token, the seconds since the call (the device synchronized)."""
    x = torch.tensor([ids], device=hf.device)
    stamps = _Stamps()
    with torch.no_grad():
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, do_sample=False,
                          min_new_tokens=None if eos else new_tokens, streamer=stamps, pad_token_id=0,
                          eos_token_id=list(eos) or None)
    if hf.device.type == "cuda":
        torch.cuda.synchronize(hf.device)
    return out[0, len(ids):].tolist(), stamps.times


def hf_generate_batch(hf, prompts: list[list[int]], max_new_tokens: int | list[int], eos: tuple = (),
                      **options) -> dict:
    """transformers' own continuous batching (paged cache + scheduler), greedy, on `prompts`.

    Drives transformers' `ContinuousBatchingManager` the way `hf.generate_batch` does (same manager set-up through
    `continuous_batching_context_manager`, warmup, workload hints, stop), but submits each request itself with
    `add_request`, so `max_new_tokens` may be one value for all requests or a list with one per request (replayed
    traces: each request its own reply length), which `generate_batch` cannot take. EOS is ignored when `eos` is
    empty (else `eos` ends a request, the EOS token kept, as in `generate`). `options` are
    `ContinuousBatchingConfig` fields (`page_size`, `num_blocks`, `max_batch_tokens`, `scheduler_type`, ...);
    `num_blocks` defaults to what the run needs (per request ceil((prompt + its max_new) / page_size)), since
    transformers would otherwise size the cache to ~90% of free device memory (of host RAM on the CPU: 20+ s).

    Returns {"tokens": [B][n_b] generated ids in the order of `prompts` (prompt excluded), "wall_s": seconds of
    the whole call (manager set-up, warmup and tear-down included), "gen_s": seconds from the first request
    submitted to the caller receiving the last request's result (the generation itself, without the manager's
    start and stop), "ttft_s": [B] seconds from the call's start to each request's first token, "token_times":
    [B][n_b] seconds from the call's start to each token}. The times come from `GenerationOutput.timestamps`
    (`record_timestamps=True`): absolute `time.perf_counter()` stamps taken when the scheduler thread receives
    each token, made relative here."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    news = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * len(prompts)
    if len(news) != len(prompts):
        raise ValueError(f"hf_generate_batch: {len(news)} max_new_tokens for {len(prompts)} prompts")
    if not prompts:
        return {"tokens": [], "wall_s": 0.0, "gen_s": 0.0, "ttft_s": [], "token_times": []}
    page = options.get("page_size", ContinuousBatchingConfig.page_size)
    options.setdefault("num_blocks", sum(-(-(len(p) + n) // page) for p, n in zip(prompts, news)))  # of `page` tokens
    eos_id = list(eos) or -1  # -1: no EOS
    # greedy; max_new_tokens is only the default for requests submitted without one (generate_batch's hints use it)
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(news), eos_token_id=eos_id)
    hints = WorkloadHints(max_prompt_length=max(len(p) for p in prompts), max_generated_length=max(news),
                          num_requests=len(prompts))
    ids = [f"req_{i}" for i in range(len(prompts))]
    results = {}
    t0 = time.perf_counter()
    with torch.no_grad(), hf.continuous_batching_context_manager(
            generation_config=gen, continuous_batching_config=ContinuousBatchingConfig(**options), block=True,
            timeout=5, warmup=True, workload_hints=hints) as manager:
        order = list(zip(ids, prompts, news))
        if getattr(manager, "_use_prefix_sharing", False):  # as `add_requests`: prompts sorted, for prefix hits
            order.sort(key=lambda x: x[1], reverse=True)
        g0 = time.perf_counter()
        for rid, p, n in order:
            if manager.add_request(list(p), request_id=rid, max_new_tokens=n, record_timestamps=True,
                                   eos_token_id=eos_id) is None:
                break  # refused (logged by transformers): reported below as missing
        while len(results) < len(prompts):  # as `generate_batch`: finished results only, until all or the loop dies
            r = manager.get_result(timeout=1)
            if r is not None:
                if r.is_finished():
                    results[r.request_id] = r
            elif not manager.is_running():
                break
        g1 = time.perf_counter()
    if hf.device.type == "cuda":
        torch.cuda.synchronize(hf.device)
    wall = time.perf_counter() - t0
    res = [results.get(i) for i in ids]
    if any(r is None or r.error or r.prompt_ids != list(p) for r, p in zip(res, prompts)):
        raise RuntimeError(f"hf_generate_batch: {sum(r is not None for r in res)} of {len(prompts)} requests came "
                           f"back, errors: {[r.error for r in res if r is not None and r.error]}")
    times = [[s - t0 for s in r.timestamps] for r in res]
    return {"tokens": [list(r.generated_tokens) for r in res], "wall_s": wall, "gen_s": g1 - g0,
            "ttft_s": [t[0] if t else None for t in times], "token_times": times}


def llama_cpp_available() -> bool:
    """Whether llama-cpp-python (the optional llama.cpp anchor, README) is installed."""
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


#: llama.cpp's KV cache types (`-ctk` / `-ctv`) -> bytes per element (ggml's blocks of 32: q8_0 34 bytes, q4_0 18)
LLAMA_CPP_KV = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}


def llama_cpp_model(gguf, n_ctx: int, threads: int, kv: str | None = None):
    """llama.cpp (llama-cpp-python's `Llama`) on the GGUF file `gguf` as it is shipped
    (its own quantized weights), `threads` threads for decode and prompt alike, a context of
    `n_ctx` tokens, default batch sizes (a prompt of up to 512 tokens in one batch);
    `system` names it with the file's weight type (llama.cpp's description of the model).
    `kv` (one of LLAMA_CPP_KV): K and V stored as that type, with flash attention (which a
    quantized V needs; `-fa -ctk kv -ctv kv`), `system` naming it; None: llama.cpp's defaults."""
    import llama_cpp

    kw = {}
    if kv is not None:
        t = getattr(llama_cpp, f"GGML_TYPE_{kv.upper()}")
        kw = dict(type_k=t, type_v=t, flash_attn=True)
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                          verbose=False, **kw)
    # "llama 256M Q4_1" -> "llama.cpp Q4_1"; "gemma3 270M Q4_K - Medium" -> "llama.cpp Q4_K - Medium"
    llm.system = f"llama.cpp {llm._model.desc().split(maxsplit=2)[-1]}" + (f", {kv} KV" if kv else "")
    return llm


def llama_cpp_steps(llm, ids: list[int], steps: int, timer) -> list[int]:
    """llama.cpp's prefill of `ids` (its KV cache cleared first), then `steps` greedy
    one-token evals, each inside `timer` (the argmax of its logits outside); the steps + 1
    greedy tokens."""
    import numpy as np

    def argmax() -> int:
        return int(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).argmax())

    llm.reset()
    llm.eval(ids)
    out = [argmax()]
    for _ in range(steps):
        with timer:
            llm.eval(out[-1:])
        out.append(argmax())
    return out


def llama_cpp_generate_timed(llm, ids: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """llama.cpp's greedy decode of `new_tokens` after `ids` (its KV cache cleared first):
    the prompt in one `eval`, then one token per `eval`, each next token the argmax of the
    last logits (llama.cpp computes only those); the new tokens and, per token, the
    seconds since the call, as `hf_generate_timed` returns them."""
    import numpy as np

    def argmax() -> int:
        return int(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).argmax())

    t0 = time.perf_counter()
    llm.reset()
    llm.eval(ids)
    out, times = [argmax()], [time.perf_counter() - t0]
    for _ in range(new_tokens - 1):
        llm.eval([out[-1]])
        out.append(argmax())
        times.append(time.perf_counter() - t0)
    return out, times
