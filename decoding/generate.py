"""The one generation loop: owns stopping, streaming and timings for every decoder."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Generator

import torch

from decodelab.decoding.compiled import static_problems, wrapper_problems
from decodelab.decoding.prefill import token_id_problems
from decodelab.decoding.runner import model_runner
from decodelab.models.errors import SetupError, raise_if, shown

# on_token(row, token_id, text_delta): text_delta is "" without a tokenizer
TokenCallback = Callable[[int, int, str], None]


@dataclass(frozen=True)
class TokenEvent:
    """One generated token of one row, as the loop keeps it (`stream`, `stream_tokens`).
    A row's `text` pieces concatenate to its final text (`GenerationResult.text`): a piece
    holds back an incomplete UTF-8 character and a tail that may begin a stop string, and
    the row's last token releases the rest."""

    row: int  # the prompt's index in the batch
    token: int  # its id (the tokens of a stop string are kept; the text ends before it)
    text: str  # the row's new text: "" without a tokenizer, or while it is held back
    finish_reason: str | None = None  # eos | stop | length on the row's last token, else None

    @property
    def finished(self) -> bool:
        """Whether this is the row's last token."""
        return self.finish_reason is not None


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
    compiled_steps: int = 0  # the target's forwards that ran through a compiled step (static or flat)

    def ttft(self) -> list[float]:
        """Time to first token per row: tokenize + prefill + first sampling (the token
        times count from the request's start, which is before tokenizing when given)."""
        return [t[0] for t in self.token_times if t]

    def itl(self) -> list[float]:
        """Inter-token latencies (s) of all rows together."""
        return [b - a for t in self.token_times for a, b in zip(t, t[1:])]

    def summary(self) -> dict:
        """TTFT, ITL percentiles (ms), decode and total tokens/s, KV bytes."""
        itl = self.itl()
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


def percentile(seconds: list[float], q: float) -> float | None:
    """The q-th percentile (q in [0, 100]) of times in seconds (any order), IN MILLISECONDS,
    as `numpy.percentile(..., method="linear")` (and vLLM's benchmark_serving) computes it:
    ascending x[0..n-1], h = q/100 x (n - 1), x[floor h] + (h - floor h) x (x[floor h + 1] - x[floor h]);
    None for no values. E.g. [1, 2, 3, 4] s: q=50 -> h 1.5 -> 2500.0; q=99 -> h 2.97 -> 3970.0."""
    import numpy as np

    if len(seconds) == 0:
        return None
    return 1000 * float(np.percentile(seconds, q, method="linear"))




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
    """Why `compile=True` cannot serve this cache and decoder (empty when it can): a plain
    decoder's one-token step runs compiled over `cache`; a speculative decoder compiles its
    drafter's steps (their cache checked where it is built) and its verify where the cache
    plans a step of that many tokens (else the verify stays eager); a tree decoder's trees
    (of varying size) stay eager."""
    wrapper = [f"compile=true: {r}" for r in wrapper_problems(cache.layout.device)]  # whatever compiles here
    if getattr(decoder, "compiles_drafter", False):
        return wrapper
    if not getattr(decoder, "takes_compiled_step", False):
        return [f"compile=true: {type(decoder).__name__} declares no step that compiles (takes_compiled_step or "
                "compiles_drafter); use compile=false"]
    return wrapper + [f"compile=true: {r}" for r in static_problems(cache, "compile")]


def _length(ids) -> int:
    try:
        return len(ids)
    except TypeError:  # not a sequence: token_id_problems names it
        return 0


class _Rows:
    """Per-row output state: tokens, times, stopping and incremental detokenization; the
    tokens kept since the last `take` wait in `events`."""

    def __init__(self, n: int, max_new: int, eos: set[int], stop: tuple[str, ...], tokenizer, detokenize: bool,
                 t0: float):
        self.tokens = [[] for _ in range(n)]
        self.times = [[] for _ in range(n)]
        self.text = ["" for _ in range(n)]  # decoded so far (cut before a stop string)
        self.emitted = [0] * n  # characters of text already streamed
        self.reason: list[str | None] = [None] * n
        self.events: list[TokenEvent] = []
        self.max_new, self.eos, self.stop, self.tok, self.t0 = max_new, eos, stop, tokenizer, t0
        self.detokenize = tokenizer is not None and (detokenize or bool(stop))  # stop strings need the text

    def done(self) -> bool:
        return all(r is not None for r in self.reason)

    def take(self) -> list[TokenEvent]:
        """The events of the tokens kept since the last call, in order."""
        out, self.events = self.events, []
        return out

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
        """The event of token `t`: the row's new text, decoded from ALL its tokens (a
        character split over tokens, or merged across them, decodes whole), less what was
        streamed before; an incomplete UTF-8 sequence and a tail that may begin a stop
        string wait, until the row's last token releases everything."""
        delta = ""
        if self.detokenize:
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
        self.events.append(TokenEvent(row, t, delta, self.reason[row]))


def _stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def stream_tokens(model, cache, decoder, prompts: list[list[int]], max_new_tokens: int = 64, *,
                  eos_ids=(), stop=(), tokenizer=None, prefill_chunk: int | None = None,
                  t_start: float | None = None, tokenize_s: float = 0.0, compile: bool = False,
                  detokenize: bool = True) -> Generator[TokenEvent, None, GenerationResult]:
    """`generate` as an iterator: the inputs are checked now (SetupError, before any
    forward), then each step runs when the iterator is advanced and yields one
    `TokenEvent` per kept token, row by row; its return value (`StopIteration.value`,
    `result = yield from stream_tokens(...)`) is the `GenerationResult`. Leaving the loop
    early (`break`, `close()`) stops the generation there: no further forward runs.
    `detokenize` (with a `tokenizer`): each event carries the row's new text."""
    stop = (stop,) if isinstance(stop, str) else tuple(stop)  # one string is one stop string, not its letters
    check_inputs(model, cache, decoder, prompts, max_new_tokens, stop, tokenizer, compile)
    return _steps(model, cache, decoder, prompts, max_new_tokens, set(eos_ids), stop, tokenizer, prefill_chunk,
                  t_start, tokenize_s, compile, detokenize)


@torch.no_grad()
def _steps(model, cache, decoder, prompts, max_new_tokens, eos, stop, tokenizer, prefill_chunk, t_start, tokenize_s,
           compile, detokenize) -> Generator[TokenEvent, None, GenerationResult]:
    """The loop of `stream_tokens` (its inputs checked): prefill, then one decoder step
    per round until every row has stopped; the kept tokens' events after each round."""
    spec = getattr(decoder, "compiles_drafter", False)
    cache.reset()
    t_begin = time.perf_counter()
    # the drafter first: a draft cache that cannot compile is refused before the target's step compiles
    decoder.begin(model.device, prompts, cache.capacity, **({"compile": True} if compile and spec else {}))
    # every forward runs through the target's runner; with compile, its static step (a plain
    # decoder's one-token step, a speculative decoder's verify where it is fixed) is compiled now
    runner = model_runner(model, cache, decoder, compile=compile)
    compile_s = getattr(decoder, "compile_s", 0.0) + runner.compile_s  # a drafter's, compiled in `begin`
    t0 = (t_start if t_start is not None else t_begin) + compile_s  # token times leave every compile out
    rows = _Rows(len(prompts), max_new_tokens, eos, stop, tokenizer, detokenize, t0)
    t_prefill = time.perf_counter()
    layers = tuple(getattr(decoder, "hidden_layers", ()))  # a drafter that reads the target's states
    out = runner.prefill(prompts, prefill_chunk, hidden_layers=layers)
    sync(model.device)
    prefill_s = time.perf_counter() - t_prefill
    last = decoder.start(out[0], hidden=out[1]) if layers else decoder.start(out)  # [B]
    for b, t in enumerate(last.tolist()):
        rows.add(b, [t])
    yield from rows.take()
    while not rows.done():
        left = max(max_new_tokens - len(t) for t, r in zip(rows.tokens, rows.reason) if r is None)
        produced = decoder.step(runner, last, done=[r is not None for r in rows.reason], left=left)
        kept = [rows.add(b, toks) for b, toks in enumerate(produced)]
        getattr(decoder, "output_kept", lambda kept: None)(kept)  # stats count the output
        last = torch.tensor([p[-1] for p in produced], device=model.device)
        yield from rows.take()
    text = None
    if tokenizer is not None:
        text = [rows.text[b] if rows.reason[b] == "stop" else tokenizer.decode(rows.tokens[b])
                for b in range(len(prompts))]
    return GenerationResult(rows.tokens, text, rows.reason, [len(p) for p in prompts], rows.times,
                            prefill_s, tokenize_s, cache.memory_report(), decoder.stats, compile_s,
                            runner.static_steps + runner.compiled_forwards)


def generate(model, cache, decoder, prompts: list[list[int]], max_new_tokens: int = 64, *,
             eos_ids=(), stop=(), tokenizer=None, on_token: TokenCallback | None = None,
             prefill_chunk: int | None = None, t_start: float | None = None,
             tokenize_s: float = 0.0, compile: bool = False) -> GenerationResult:
    """Generate up to `max_new_tokens` per row after `prompts` [B][n_b] token ids.

    The cache is reset first. `eos_ids` end a row; `stop` strings (needs `tokenizer`)
    end a row at the text before them; `on_token(row, token_id, text)` streams tokens as
    they come (`stream_tokens` is this loop as an iterator of events).
    Every forward runs through one `ModelRunner` of the model and cache
    (decoding/runner.py, `model_runner`). `compile=True` gives it a compiled one-token step
    (decoding/compiled.py), compiled before the prefill (once per model, batch and cache
    capacity in a process); with a speculative decoder it compiles a draft model's
    one-token steps and the verify of gamma + 1 tokens (`compiled_verify`: a fixed gamma, a
    cache that plans it; a last shorter round and rounds with finished rows verify eagerly;
    a tree decoder's verifies stay eager). That time, and a drafter's own compile
    (`draft.compile`), is `compile_s`, and the token times leave it out (they count from
    `t_start` plus it)."""
    events = stream_tokens(model, cache, decoder, prompts, max_new_tokens, eos_ids=eos_ids, stop=stop,
                           tokenizer=tokenizer, prefill_chunk=prefill_chunk, t_start=t_start,
                           tokenize_s=tokenize_s, compile=compile, detokenize=on_token is not None)
    return drain(events, on_token)


def drain(events: Generator[TokenEvent, None, GenerationResult],
          on_token: TokenCallback | None = None) -> GenerationResult:
    """Run a `stream_tokens` iterator to its end, calling `on_token(row, token_id, text)`
    on each event; its `GenerationResult`."""
    while True:
        try:
            e = next(events)
        except StopIteration as done:
            return done.value
        if on_token is not None:
            on_token(e.row, e.token, e.text)
