"""The one generation loop: owns stopping, streaming and timings for every decoder."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from decodelab.decoding.compiled import compiled_step, static_problems
from decodelab.decoding.prefill import prefill, token_id_problems
from decodelab.models.errors import SetupError, raise_if, shown

# on_token(row, token_id, text_delta): text_delta is "" without a tokenizer
TokenCallback = Callable[[int, int, str], None]


@dataclass
class GenerationResult:
    """What one `generate` call produced, per row, with its timings."""

    tokens: list[list[int]]  # generated ids per row (prompt excluded)
    text: list[str] | None  # decoded generations (None without a tokenizer)
    finish_reasons: list[str]  # eos | stop | length
    prompt_lengths: list[int]
    token_times: list[list[float]]  # seconds since the start, one per generated token
    prefill_s: float
    tokenize_s: float = 0.0
    kv: dict = field(default_factory=dict)  # cache memory report (formula vs allocated)
    stats: dict = field(default_factory=dict)  # decoder statistics (speculative, ...)
    compile_s: float = 0.0  # compiling the decode step (compile=True), outside every token time

    def ttft(self) -> list[float]:
        """Time to first token per row: tokenize + prefill + first sampling (the token
        times count from the request's start, which is before tokenizing when given)."""
        return [t[0] for t in self.token_times if t]

    def itl(self) -> list[float]:
        """Inter-token latencies (s) of all rows together."""
        return [b - a for t in self.token_times for a, b in zip(t, t[1:])]

    def summary(self) -> dict:
        """TTFT, ITL percentiles (ms), decode and total tokens/s, KV bytes."""
        itl = sorted(self.itl())
        n_dec = sum(max(0, len(t) - 1) for t in self.tokens)
        dec_s = max((t[-1] for t in self.token_times if t), default=0.0) - min(
            (t[0] for t in self.token_times if t), default=0.0)
        return {
            "ttft_s": statistics.median(self.ttft()) if self.ttft() else None,
            "prefill_s": self.prefill_s, "tokenize_s": self.tokenize_s, "compile_s": self.compile_s,
            **{f"itl_p{q}_ms": percentile(itl, q) for q in (50, 95, 99)},
            "decode_tok_s": n_dec / dec_s if dec_s > 0 else None,
            "new_tokens": sum(len(t) for t in self.tokens), **self.kv, **self.stats,
        }


def percentile(sorted_s: list[float], q: float) -> float | None:
    """The q-th percentile (q in [0, 100]) of ascending times in seconds, IN MILLISECONDS:
    the value at index round(q/100 x (n - 1)), no interpolation; None for no values.
    E.g. [0.01, 0.02, 0.03, 0.04, 0.05]: q=50 -> 30.0, q=95 -> 50.0 (index 3.8 -> 4)."""
    if not sorted_s:
        return None
    i = min(len(sorted_s) - 1, max(0, round(q / 100 * (len(sorted_s) - 1))))
    return 1000 * sorted_s[i]




def sync(device) -> None:
    """Wait for the device's queued work before a clock is read (a GPU runs asynchronously:
    an unsynchronized clock times the launches, not the work); a no-op on a CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def check_inputs(model, cache, decoder, prompts, max_new_tokens: int, stop=(), tokenizer=None,
                 compile: bool = False) -> None:
    """Every problem with a generation request, raised together before any forward."""
    raise_if(argument_type_problems(model, cache, decoder))  # the checks below read these
    p = compile_problems(cache, decoder) if compile else []
    if not isinstance(prompts, list) or not prompts:
        raise SetupError("prompts must be a non-empty list of token-id lists")
    p += token_id_problems(prompts, model.cfg.vocab_size)
    count = new_tokens_problems(max_new_tokens)
    p += count
    if not count:
        longest = max(map(_length, prompts))
        # a decoder that verifies ahead writes up to `lookahead` positions past the output
        need = longest + max_new_tokens + getattr(decoder, "lookahead", 0)
        if need > model.cfg.max_seq_len:
            p.append(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) = {need} exceeds the "
                     f"model's context of {model.cfg.max_seq_len}; shorten the prompt or max_new_tokens")
        if need > cache.capacity:
            p.append(f"prompt + max_new_tokens (+ the decoder's lookahead) = {need} exceeds the cache capacity "
                     f"of {cache.capacity} per row; build the cache larger")
    if len(prompts) != cache.batch_size:
        p.append(f"{len(prompts)} prompts for a cache built for batch {cache.batch_size}")
    if stop and tokenizer is None:
        p.append("stop strings need a tokenizer to decode text")
    if any(not isinstance(s, str) or not s for s in stop):
        p.append(f"stop strings must be non-empty text, got {list(stop)!r}: an empty one would end every row "
                 "before its first token")
    p += decoder.problems(model, cache)
    raise_if(p)


def new_tokens_problems(n) -> list[str]:
    """Why `n` is not a count of tokens to generate (an int >= 1; a bool is not one)."""
    return [] if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else [
        f"max_new_tokens must be an integer >= 1, got {shown(n)}"]


def argument_type_problems(model, cache, decoder) -> list[str]:
    """What is not of the type `generate` takes: a model (`LoadedModel.model`), a built cache,
    a decoder object."""
    from decodelab.cache.base import KVCache
    from decodelab.decoding.decoders import decoder_type_problems

    p = []
    if not (hasattr(model, "cfg") and callable(model)):
        p.append(f"model must be a decodelab model (LoadedModel.model, from decodelab.models.loading.load), got "
                 f"a {type(model).__name__}" + ("; pass lm.model, or generate_text(lm, text) for text"
                                                 if hasattr(model, "model") else ""))
    if not isinstance(cache, KVCache):
        p.append(f"cache must be a built KV cache (make_cache(model, batch_size, capacity, factory)), got "
                 f"{shown(cache)}")
    return p + decoder_type_problems(decoder)


def compile_problems(cache, decoder) -> list[str]:
    """Why `compile=True` cannot serve this cache and decoder (empty when it can)."""
    p = [] if getattr(decoder, "takes_compiled_step", False) else [
        "compile=true compiles the one-token decode step of plain decoding (decoder=greedy or sampling); this "
        "decoder feeds several tokens per step (a speculative verify, which compiled runs slower on a CPU than "
        "eager oneDNN's): use compile=false, and compile a model drafter's steps with draft.compile=true"]
    return p + [f"compile=true: {r}" for r in static_problems(cache, "compile")]


def _length(ids) -> int:
    try:
        return len(ids)
    except TypeError:  # not a sequence: token_id_problems names it
        return 0


class _Rows:
    """Per-row output state: tokens, times, stopping and incremental detokenization."""

    def __init__(self, n: int, max_new: int, eos: set[int], stop: tuple[str, ...], tokenizer, on_token, t0):
        self.tokens = [[] for _ in range(n)]
        self.times = [[] for _ in range(n)]
        self.text = ["" for _ in range(n)]  # decoded so far (cut before a stop string)
        self.emitted = [0] * n  # characters of text already streamed
        self.reason: list[str | None] = [None] * n
        self.max_new, self.eos, self.stop, self.tok, self.on_token, self.t0 = max_new, eos, stop, tokenizer, on_token, t0

    def done(self) -> bool:
        return all(r is not None for r in self.reason)

    def add(self, row: int, produced: list[int]) -> int:
        """Append a row's new tokens, stopping at EOS, a stop string or max_new_tokens;
        return how many were kept."""
        now, before = time.perf_counter() - self.t0, len(self.tokens[row])
        for t in produced:
            if self.reason[row] is not None:
                break
            self.tokens[row].append(t)
            self.times[row].append(now)
            if t in self.eos:
                self.reason[row] = "eos"
            elif len(self.tokens[row]) >= self.max_new:
                self.reason[row] = "length"
            self._emit(row, t)
        return len(self.tokens[row]) - before

    def _emit(self, row: int, t: int) -> None:
        delta = ""
        if self.tok is not None and (self.on_token or self.stop):
            full = self.tok.decode(self.tokens[row])
            final = self.reason[row] is not None
            if final or not full.endswith("\ufffd"):  # else an incomplete UTF-8 sequence: wait
                cut = min((full.find(s) for s in self.stop if s in full), default=-1)
                if cut >= 0:  # the text ends before the stop string
                    full, self.reason[row], final = full[:cut], "stop", True
                # hold back a tail that may be the start of a stop string
                safe = len(full) if final else len(full) - _stop_prefix_len(full, self.stop)
                delta = full[self.emitted[row]:safe]
                self.text[row], self.emitted[row] = full, max(self.emitted[row], safe)
        if self.on_token:
            self.on_token(row, t, delta)


def _stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


@torch.no_grad()
def generate(model, cache, decoder, prompts: list[list[int]], max_new_tokens: int = 64, *,
             eos_ids=(), stop=(), tokenizer=None, on_token: TokenCallback | None = None,
             prefill_chunk: int | None = None, t_start: float | None = None,
             tokenize_s: float = 0.0, compile: bool = False) -> GenerationResult:
    """Generate up to `max_new_tokens` per row after `prompts` [B][n_b] token ids.

    The cache is reset first. `eos_ids` end a row; `stop` strings (needs `tokenizer`)
    end a row at the text before them; `on_token` streams tokens as they come.
    `compile=True` decodes with a compiled one-token step (decoding/compiled.py), compiled
    before the prefill (once per model, batch and cache capacity in a process); that time,
    and a drafter's own compile (`draft.compile`), is `compile_s`, and the token times
    leave it out (they count from `t_start` plus it)."""
    stop = (stop,) if isinstance(stop, str) else tuple(stop)  # one string is one stop string, not its letters
    check_inputs(model, cache, decoder, prompts, max_new_tokens, stop, tokenizer, compile)
    forward, compile_s = {}, 0.0
    if compile:
        t = time.perf_counter()
        forward = {"forward": compiled_step(model, cache).step}
        compile_s = time.perf_counter() - t
    t0 = t_start + compile_s if t_start is not None else time.perf_counter()
    cache.reset()
    decoder.begin(model.device, prompts, cache.capacity)
    begin_compile = getattr(decoder, "compile_s", 0.0)  # a drafter's compiled step, compiled in `begin`
    t0, compile_s = t0 + begin_compile, compile_s + begin_compile
    rows = _Rows(len(prompts), max_new_tokens, set(eos_ids), stop, tokenizer, on_token, t0)
    t_prefill = time.perf_counter()
    logits = prefill(model, cache, prompts, prefill_chunk)
    sync(model.device)
    prefill_s = time.perf_counter() - t_prefill
    last = decoder.start(logits)  # [B]
    for b, t in enumerate(last.tolist()):
        rows.add(b, [t])
    while not rows.done():
        left = max(max_new_tokens - len(t) for t, r in zip(rows.tokens, rows.reason) if r is None)
        produced = decoder.step(model, cache, last, done=[r is not None for r in rows.reason], left=left, **forward)
        kept = [rows.add(b, toks) for b, toks in enumerate(produced)]
        getattr(decoder, "output_kept", lambda kept: None)(kept)  # stats count the output
        last = torch.tensor([p[-1] for p in produced], device=model.device)
    text = None
    if tokenizer is not None:
        text = [rows.text[b] if rows.reason[b] == "stop" else tokenizer.decode(rows.tokens[b])
                for b in range(len(prompts))]
    return GenerationResult(rows.tokens, text, rows.reason, [len(p) for p in prompts], rows.times,
                            prefill_s, tokenize_s, cache.memory_report(), decoder.stats, compile_s)
