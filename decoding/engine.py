"""Continuous batching: requests arrive, wait in a queue, are admitted while the KV budget
allows, decode together and leave when done; a finished request's cache row serves the
next one at once.

The engine is the scheduler: admission, the KV budget, preemption, chunking and prefix
mapping decide each step, which it hands to the model runner as a plain value
(`StepPlan`: the decoding rows with their last tokens, the prefill chunks' token ids, the
output left); the runner (decoding/runner.py, `ModelRunner.execute`) runs it, samples, and
returns a plain value (`StepOutput`: tokens per row), which the engine applies to the
requests (`_apply`: output, EOS and length, finished rows released, prefixes offered).

An engine step is one forward over segments (`Transformer.forward_segments`) built from
the step (the exceptions are at the end of this paragraph):
- the decode rows: each decoding request feeds its last token (one row per request; the
  run of rows from the first decoding row to the last, so a dense cache reads it in place,
  the idle rows inside it riding along as padding);
- the prefilling requests' next prompt chunks (THE prefill's padding and positions,
  `prompt_segment`; a chunk of 64 tokens or more in a segment of its own, shorter ones
  together), within the step's token budget (`token_budget` minus the decode rows, with
  policy `decode-first`), so a long prompt is spread over several steps and never stalls
  the decoding requests for long. With `policy: prefill-first` a step that has prefill
  work runs it with the whole budget and no decode (vLLM's classic scheduler);
  `chunked_prefill: false` feeds a prompt in one go.
The norms, projections, MLP and head run once over all the step's tokens (the weights are
read once: a chunk riding in a decode step costs its tokens' compute, not another pass
over the weights), and each segment attends on its own (the cache plans each, and each
layer attends every segment through its own plan), so a decode row never computes a chunk's queries. A
step without decode rows (`prefill-first`) runs its chunks the same way, all of them in
one forward (one read of the weights: on a 2-core CPU the ShareGPT prefill of 32 requests
took 8.5-8.8 s against 9.9-10.7 s with a forward per chunk). A speculative decoder's
verify is a segment of that same forward: the decoding rows' gamma + 1 tokens beside the
chunks (the runner's `verify` inside `execute`); its drafts run before it, in the drafter. A
tree decoder's verify is a forward of its own (its plan is a tree): a step's chunks run
just before it.

The KV budget (`kv_budget_mb`, default: what the cache can hold, `budget_bytes`) is
charged what the running requests hold (`held_bytes`: a paged prefix block shared by
several requests counts once) plus, before a step, what the step adds (`row_bytes`
growth); admission also keeps room for `headroom` more tokens of every decoding request,
so that a request it admits is not preempted again a few steps later (thrashing). Every
backend is charged per token it holds (dense as if it allocated its rows
as they grow: the most favourable accounting for dense). A request is
admitted (FCFS, one free row, its prompt's bytes within the budget) and, when the next
step would exceed the budget, the most recently admitted request is preempted: its row is
released and it goes back to the head of the queue with what it generated; when
readmitted it prefills prompt + output again (recompute, vLLM's default) and continues,
so its output is unchanged (greedy: token-identical up to the float rounding of a prefill
against decode steps). A paged cache with prefix caching maps the cached blocks of a
common prompt prefix (a system prompt) into the new row instead of computing them, and a
request that has computed nothing yet maps again, before each step, what got cached since
(`_map_cached_prefixes`: a burst of requests behind one system prompt shares it).

A request that can never run (longer than a row or than the whole budget, bad token ids)
is rejected on arrival with its reason; the others are served.

`compile=True` runs a decode step in which every cache row decodes through the compiled
static step (decoding/compiled.py; any backend with a `static_plan`, int4's host plan
included), compiled once before the first request; other steps stay eager. With a
speculative decoder of a fixed gamma it compiles the verify of gamma + 1 tokens
(`compiled_verify`: a round in which every row verifies and no prefill chunk shares the
forward) and a draft model's one-token steps (a tree decoder's trees have no static step:
they run eagerly, or flat with `compile_flat`). With `compile_flat=True` too, every other
forward (some rows decode, prefill chunks beside decode rows, a shorter last verify) runs
through the compiled model runner's flat token batches (decoding/runner.py: one graph per
bucket of up to 64 tokens, each backend's own attention inside it); longer forwards stay
eager. Both off by default: the compiles run before the first request (what they cost and
buy: experiments/results/engine-compile). Every step runs through one `ModelRunner`
(`model_runner`, `execute`): the decoder's forwards are the runner's (`decode`, `verify`,
`tree`), and a draft model runs its forwards through a runner of its own.

Speculative decoders run inside the engine: each step is one draft-and-verify round over
the decoding rows (the others frozen; the verify shares the step's forward with the
prefill chunks of other rows), each request keeping its own accepted drafts; a
drafter starts an admitted request's row over (`admit`: a draft model prefills its own
cache row). A draft model's cache is charged to the KV budget beside the target's (the
decoder's `held_bytes` / `row_bytes`; the default budget is what both caches can hold).

Why the static `generate` (decoding/generate.py) is not a thin call into the engine: it
serves what the engine does not (stop strings and streaming text; chunked prefill of a
whole static batch in one forward), and its prefill of a static batch is one padded
forward where the engine runs each long chunk as a segment of its own, so their logits
differ by float summation order. Its greedy output is the engine's "all requests at
t = 0" output (tests/decoding/test_engine.py checks it token for token).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from decodelab.decoding.generate import _length, new_tokens_problems
from decodelab.decoding.prefill import token_id_problems
from decodelab.decoding.runner import Chunk, StepOutput, StepPlan, model_runner
from decodelab.models.errors import PoolExhausted, SetupError, raise_if

POLICIES = ("decode-first", "prefill-first")


@dataclass
class Request:
    """One request: a prompt of token ids, how many tokens it may generate, when it arrives."""

    prompt: list[int]
    max_new_tokens: int
    arrival_s: float = 0.0  # seconds after the engine starts
    id: int | str | None = None


@dataclass
class RequestResult:
    """What the engine did with one request; times in seconds since the engine started."""

    id: int | str | None
    prompt_len: int
    arrival_s: float
    tokens: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # one per generated token
    finish_reason: str | None = None  # eos | length | rejected
    error: str | None = None  # why a rejected request was rejected
    admitted_s: float | None = None  # first admission (queue wait = admitted - arrival)
    preemptions: int = 0
    prefix_reused: int = 0  # prompt tokens a prefix cache supplied (first admission)

    @property
    def ttft_s(self) -> float | None:
        """Arrival -> first token (queue wait + prefill + first sampling)."""
        return self.token_times[0] - self.arrival_s if self.token_times else None

    @property
    def queue_s(self) -> float | None:
        return None if self.admitted_s is None else self.admitted_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (last - first) / (n - 1)."""
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    def itl_s(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def e2e_s(self) -> float | None:
        return self.token_times[-1] - self.arrival_s if self.token_times else None


@dataclass
class _Running:
    """A request that holds a cache row."""

    idx: int  # index in the request list
    req: Request
    res: RequestResult
    row: int
    feed: list[int]  # prompt (+ output so far, after a preemption) to prefill
    fed: int = 0  # tokens of `feed` in the cache
    order: int = 0  # admission counter: the latest admitted is preempted first
    mapped: int = 0  # tokens of `feed` a prefix cache supplied (all `fed` ones: nothing computed yet)

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.feed)


@dataclass
class EngineResult:
    """Per-request results (in request order), the step timeline, and the run's counters."""

    requests: list[RequestResult]
    timeline: list[dict]  # per step: t, running, waiting, kv_bytes (budget counted), decode rows, prefill tokens
    kv_budget_bytes: int
    wall_s: float
    preemptions: int = 0
    steps: int = 0
    compiled_steps: int = 0  # steps through a compiled static step (`compile=True`): decode steps or verify rounds
    #: compiling at the start of the run, before any request's clock: the static step (compile=True), the
    #: flat graphs (compile_flat) and a draft model's one-token steps (compile=True, or the
    #: draft's own `compile`)
    compile_s: float = 0.0
    #: forwards through the compiled runner's flat token batches (`compile_flat=True`: every forward but the
    #: static step's and those larger than its largest bucket, a tree decoder's trees included)
    flat_forwards: int = 0


def engine_problems(cache, decoder, token_budget: int, policy: str, max_running: int | None = None,
                    kv_budget_mb: float | None = None) -> list[str]:
    """Every reason these engine options cannot serve with this cache and decoder."""
    p = []
    if not getattr(cache, "serves_row_subsets", False):
        p.append(f"the {type(cache).__name__} backend cannot serve continuous batching: "
                 f"{getattr(cache, 'row_subset_reason', 'it declares no row release')}")
    if not (callable(getattr(decoder, "admit", None)) and callable(getattr(decoder, "release", None))):
        p.append(f"decoder {decoder!r} cannot serve requests that come and go: it has no `admit(row, tokens)` / "
                 "`release(row)` (decoding/decoders.py)")
    if getattr(decoder, "hidden_layers", ()):
        p.append(f"decoder {decoder!r} drafts from the target's hidden states (hidden_layers), which the serving "
                 "engine does not hand over yet (its prefill chunks and verify rounds would have to): use generate")
    if not isinstance(token_budget, int) or isinstance(token_budget, bool) or token_budget < 1:
        p.append(f"token_budget must be an integer >= 1 (tokens per engine step), got {token_budget!r}")
    if policy not in POLICIES:
        p.append(f"policy must be one of {list(POLICIES)}, got {policy!r}")
    if max_running is not None and (not isinstance(max_running, int) or max_running < 1):
        p.append(f"max_running must be an integer >= 1, got {max_running!r}")
    if kv_budget_mb is not None and not kv_budget_mb > 0:
        p.append(f"kv_budget_mb must be > 0, got {kv_budget_mb!r}")
    elif kv_budget_mb is not None and kv_budget_mb * 2**20 > total_budget(cache, decoder):
        p.append(f"kv_budget_mb={kv_budget_mb} is more than the cache can hold "
                 f"({total_budget(cache, decoder) / 2**20:.2f} MiB, a draft's cache included): "
                 "build the cache larger (paged: num_blocks / memory_budget_mb; dense: batch x capacity) or lower "
                 "the budget")
    return p


def engine_compile_problems(cache, decoder, compile, compile_flat=False) -> list[str]:
    """`compile`: a bool; where true, a cache with a compiled step (its `static_plan`) of the
    tokens a step feeds per row: one, or a speculative decoder's fixed gamma + 1
    (`verify_tokens`; adaptive gamma and drafters that read hidden states verify eagerly);
    a tree decoder's trees have no static step (eager, or the flat graphs with compile_flat).
    `compile_flat`: a bool, true only with `compile`."""
    if not isinstance(compile_flat, bool) or (compile_flat and compile is not True):
        return [f"compile_flat must be true or false, and true only with compile=True (the runner's flat batches "
                f"serve the forwards the compiled static step does not), got {compile_flat!r} (compile={compile!r})"]
    if not isinstance(compile, bool):
        return [f"compile must be true or false, got {compile!r}"]
    if not compile:
        return []
    from decodelab.decoding.compiled import static_problems, wrapper_problems

    wrapper = [f"compile=True: {r}" for r in wrapper_problems(cache.layout.device)]  # whatever compiles here
    if wrapper:
        return wrapper
    tokens = 1
    if getattr(decoder, "verifies_tree", False):  # trees vary in size: eager, or the flat graphs (compile_flat)
        return []
    if decoder.lookahead:
        tokens = getattr(decoder, "verify_tokens", None)
        if not tokens:
            why = ("its drafter reads the target's hidden states, which a compiled verify does not return: run it "
                   "with compile=False" if getattr(decoder, "hidden_layers", ()) else
                   "it verifies a varying number of tokens (adaptive gamma): give it a fixed gamma "
                   "(decoder.adaptive=false) or run it with compile=False")
            return [f"compile=True in the engine compiles steps of a fixed number of tokens; {decoder!r}: {why}"]
    return [f"compile=True: {r}" for r in static_problems(cache, "compile", tokens)]


def total_budget(cache, decoder) -> int:
    """K/V bytes the target cache and the decoder's own (a draft model's) can hold at most."""
    return cache.budget_bytes() + decoder.budget_bytes(cache.batch_size, cache.capacity)


class Engine:
    """Serves `Request`s over one model and one cache whose rows are the running slots."""

    def __init__(self, model, cache, decoder, token_budget: int = 256, policy: str = "decode-first",
                 chunked_prefill: bool = True, kv_budget_mb: float | None = None, max_running: int | None = None,
                 eos_ids=(), headroom: int = 16, compile: bool = False, compile_flat: bool = False):
        bad_headroom = [] if isinstance(headroom, int) and headroom >= 0 else [
            f"headroom must be an integer >= 0 tokens, got {headroom!r}"]
        raise_if(engine_problems(cache, decoder, token_budget, policy, max_running, kv_budget_mb)
                 + bad_headroom + decoder.problems(model, cache)
                 + engine_compile_problems(cache, decoder, compile, compile_flat))
        self.compile, self.compile_flat, self.runner = compile, compile_flat, None
        self.model, self.cache, self.decoder = model, cache, decoder
        self.token_budget, self.policy, self.chunked = token_budget, policy, chunked_prefill
        self.max_running = min(max_running or cache.batch_size, cache.batch_size)
        # default: what the cache can hold (dense: every row at capacity; paged: its pool; int4: rows at capacity)
        self.kv_budget = total_budget(cache, decoder) if kv_budget_mb is None else int(kv_budget_mb * 2**20)
        self.eos, self.headroom = set(eos_ids), headroom  # tokens per decoding row kept free at admission

    # -- checks --------------------------------------------------------------------
    def rejection(self, req: Request) -> str | None:
        """Why a request can never run here (None: it can)."""
        p = token_id_problems([req.prompt], self.model.cfg.vocab_size)
        n = req.max_new_tokens
        p += new_tokens_problems(n)
        if not p:  # sizes are read only for valid ids and a valid count
            need = len(req.prompt) + n + self.decoder.lookahead  # a verify writes past the output
            if need > min(self.cache.capacity, self.model.cfg.max_seq_len):
                p.append(f"prompt ({len(req.prompt)}) + max_new_tokens ({n}) = {need} tokens exceeds a cache row "
                         f"({self.cache.capacity}) or the model's context ({self.model.cfg.max_seq_len})")
            elif self._row_bytes(need) > self.kv_budget:
                p.append(f"prompt + max_new_tokens = {need} tokens takes {self._row_bytes(need)} bytes of KV (a "
                         f"draft's included), more than the whole KV budget of {self.kv_budget} bytes")
        return "; ".join(p) or None

    # -- the loop ------------------------------------------------------------------
    @torch.no_grad()
    def run(self, requests: list[Request]) -> EngineResult:
        """Serve every request: each joins the queue when the wall clock (seconds since
        this call) passes its arrival; an idle engine sleeps until the next arrival."""
        results = [RequestResult(r.id if r.id is not None else i, _length(r.prompt), float(r.arrival_s))
                   for i, r in enumerate(requests)]
        pending = deque(sorted(range(len(requests)), key=lambda i: requests[i].arrival_s))
        self.cache.reset()
        # one placeholder token per row: each request's row is filled when it is admitted (`admit`);
        # with compile, a draft model's one-token steps are compiled too (its `begin`: a draft cache
        # that cannot compile is refused there, before the target's step compiles)
        self.decoder.begin(self.model.device, [[0]] * self.cache.batch_size, self.cache.capacity,
                           **({"compile": True} if self.compile and self.decoder.lookahead else {}))
        compile_s = getattr(self.decoder, "compile_s", 0.0)
        if self.runner is None:  # compiled now (on the emptied cache), not in a request
            # with compile_flat, the forwards the static step does not serve run as flat batches of a step's tokens
            flat = self.token_budget + self.cache.batch_size * self.decoder.lookahead if self.compile_flat else 0
            runner = model_runner(self.model, self.cache, self.decoder, compile=self.compile, flat_tokens=flat)
            self.runner = runner  # only once every compile succeeded: a failed one is tried again next run
            compile_s += runner.compile_s
        flat_before = self.runner.compiled_forwards
        self.waiting: deque[int] = deque()
        self.running: dict[int, _Running] = {}  # row -> running request
        self._order, timeline, preempted, steps, self._compiled_steps = 0, [], 0, 0, 0
        t0 = time.perf_counter()
        clock = lambda: time.perf_counter() - t0  # noqa: E731
        while pending or self.waiting or self.running:
            while pending and (requests[pending[0]].arrival_s <= clock() or not (self.waiting or self.running)):
                i = pending.popleft()
                if requests[i].arrival_s > clock():
                    time.sleep(requests[i].arrival_s - clock())
                self._arrive(i, requests[i], results[i], clock)
            self._admit(requests, results, clock)
            if not self.running:
                continue
            self._map_cached_prefixes()
            preempted += self._fit_budget()
            decode, chunks = self._plan()
            try:  # the runner runs the plain value the scheduler made of them
                out = self.runner.execute(self._step(decode, chunks), self.decoder)
            except PoolExhausted:  # the cache refused the forward, unchanged: make room, plan again
                if len(self.running) < 2 or self.decoder.lookahead:  # a drafter has moved on: not recoverable
                    raise
                for r, _ in chunks:  # a refused prefill may have mapped a cached prefix: start it over
                    if r.row in self.running and r.fed < len(r.feed) and int(self.cache.lengths[r.row]) != r.fed:
                        self.cache.release(r.row)
                        r.fed = 0
                self._preempt(max(self.running.values(), key=lambda r: r.order))
                preempted += 1
                continue
            self._compiled_steps += out.compiled
            self._apply(decode, chunks, out, clock)
            steps += 1
            timeline.append({"t": clock(), "running": len(self.running), "waiting": len(self.waiting),
                             "kv_bytes": self._used(), "decode_rows": len(decode),
                             "prefill_tokens": sum(c for _, c in chunks)})
        return EngineResult(results, timeline, self.kv_budget, clock(), preempted, steps, self._compiled_steps,
                            compile_s, self.runner.compiled_forwards - flat_before)

    def _arrive(self, i: int, req: Request, res: RequestResult, clock) -> None:
        why = self.rejection(req)
        if why is None:
            self.waiting.append(i)
        else:
            res.finish_reason, res.error = "rejected", why

    def _row_bytes(self, tokens: int) -> int:
        """K/V bytes one row of `tokens` tokens takes: the target's and a draft's."""
        return self.cache.row_bytes(tokens) + self.decoder.row_bytes(tokens)

    def _used(self, extra: dict[int, int] | None = None, target_only: bool = False) -> int:
        """KV bytes the running requests hold (shared storage once, `held_bytes`; a draft
        model's cache too, unless `target_only`), plus the rest of each prefilling request's
        prompt in the target's cache (reserved when it was admitted; a draft model prefilled
        all of it at admission, so it holds it already) and what `extra` more tokens per
        decoding row would add to both (`row_bytes` growth: an upper bound)."""
        c, d = self.cache, (lambda n: 0) if target_only else self.decoder.row_bytes
        prefilling = {r.row: len(r.feed) + 1 - r.fed for r in self.running.values() if r.prefilling}
        grow = 0
        for row, n in (prefilling | (extra or {})).items():
            have = int(c.lengths[row])
            grow += c.row_bytes(have + n) - c.row_bytes(have)
            if row not in prefilling or row in (extra or {}):
                grow += d(have + n) - d(have)
        rows = list(self.running)
        return c.held_bytes(rows) + (0 if target_only else self.decoder.held_bytes(rows)) + grow

    def _over(self, extra: dict[int, int], target_grow: int = 0, draft_grow: int = 0) -> bool:
        """Whether the running requests, `extra` more tokens per decoding row and the given
        growth overrun the KV budget, or the target's own cache (a draft model's budget
        must not let the target's pool run out)."""
        total = self._used(extra) + target_grow + draft_grow > self.kv_budget
        return total or self._used(extra, target_only=True) + target_grow > self.cache.budget_bytes()

    def _admit(self, requests, results, clock) -> None:
        """FCFS: admit the queue's head while a row is free and its prompt fits the budget."""
        free = [row for row in range(self.cache.batch_size) if row not in self.running]
        while self.waiting and free and len(self.running) < self.max_running:
            i = self.waiting[0]
            req, res = requests[i], results[i]
            feed = list(req.prompt) + res.tokens  # after a preemption: recompute prompt + output
            row = free[0]
            reused = self.cache.reuse_prefix([feed], [row])[0]  # maps a cached prefix: charged once
            # its prompt, reserved (a draft model prefills all of it: no prefix of its own reused)
            target_grow = self.cache.row_bytes(len(feed) + 1) - self.cache.row_bytes(reused)
            if self.running and self._over(self._step_growth(self.headroom), target_grow,
                                           self.decoder.row_bytes(len(feed) + 1)):
                self.cache.release(row)
                return
            self.waiting.popleft()
            free.pop(0)
            self.decoder.admit(row, feed)  # a drafter starts the row's sequence (its draft cache: prefilled)
            if res.admitted_s is None:
                res.admitted_s, res.prefix_reused = clock(), reused
            self._order += 1
            self.running[row] = _Running(i, req, res, row, feed, reused, self._order, reused)

    def _map_cached_prefixes(self) -> None:
        """A prefilling request that has computed nothing yet (its row holds only mapped
        blocks, if any) maps its prompt's blocks again (`reuse_prefix`), taking those cached
        since: in a burst behind one system prompt, the requests admitted while the first
        was still prefilling it then compute only their own tokens."""
        for r in self.running.values():
            if r.prefilling and r.fed == r.mapped and int(self.cache.lengths[r.row]) == r.fed:
                reused = self.cache.reuse_prefix([r.feed], [r.row])[0]  # releases the row, then maps
                if reused != r.fed:
                    r.fed = r.mapped = reused
                    if r.res.preemptions == 0:  # counted for the first admission, as `_admit` counts it
                        r.res.prefix_reused = reused

    def _step_growth(self, steps: int, decode: list[_Running] | None = None) -> dict[int, int]:
        """Tokens `steps` decode steps add per decoding row (a speculative round: up to its
        lookahead). Admission keeps room for `headroom` tokens of every decoding row, so that
        the request it admits is not preempted again a few steps later (thrashing)."""
        rows = decode if decode is not None else [r for r in self.running.values() if not r.prefilling]
        return {r.row: max(steps, self.decoder.lookahead) for r in rows}

    def _fit_budget(self) -> int:
        """Preempt the latest admitted requests until the next step's growth fits the budget."""
        n = 0
        while len(self.running) > 1:
            decode, _ = self._plan()
            if not self._over(self._step_growth(1, decode)):
                break
            self._preempt(max(self.running.values(), key=lambda r: r.order))
            n += 1
        return n

    def _preempt(self, r: _Running) -> None:
        """Release the row; back to the head of the queue, output kept (recompute later)."""
        self.cache.release(r.row)
        self.decoder.release(r.row)
        del self.running[r.row]
        r.res.preemptions += 1
        self.waiting.appendleft(r.idx)

    def _plan(self) -> tuple[list[_Running], list[tuple[_Running, int]]]:
        """This step's decode rows and prefill chunks (request, tokens) under the token budget."""
        decode = [r for r in self.running.values() if not r.prefilling]
        prefill = sorted((r for r in self.running.values() if r.prefilling), key=lambda r: r.order)
        if self.policy == "prefill-first" and prefill:
            decode, left = [], self.token_budget
        else:
            left = self.token_budget - len(decode)
        chunks = []
        for r in prefill:
            n = len(r.feed) - r.fed
            take = n if not self.chunked else min(n, left)
            if take <= 0 or (not self.chunked and chunks and take > left):
                break
            chunks.append((r, take))
            left -= take
        if not decode and not chunks and prefill:  # a budget below one prompt chunk still progresses
            chunks = [(prefill[0], len(prefill[0].feed) - prefill[0].fed if not self.chunked else 1)]
        return decode, chunks

    def _step(self, decode: list[_Running], chunks: list[tuple[_Running, int]]) -> StepPlan:
        """This step as the plain value the runner takes (`StepPlan`)."""
        feeds = tuple(Chunk(r.row, tuple(r.feed[r.fed:r.fed + c]), r.fed + c == len(r.feed)) for r, c in chunks)
        return StepPlan(tuple((r.row, r.res.tokens[-1]) for r in decode), feeds,
                        max((r.req.max_new_tokens - len(r.res.tokens) for r in decode), default=0))

    def _apply(self, decode: list[_Running], chunks: list[tuple[_Running, int]], out: StepOutput, clock) -> None:
        """What the step produced, into the requests: each decoding request's new tokens
        (a speculative decoder hears how many its output kept), then each chunk's tokens
        counted as cached, its row offering the prompt blocks it holds so far (a request
        admitted meanwhile maps them, `_map_cached_prefixes`), and a request whose prompt
        is done emits its first token."""
        if decode:
            kept = self._emit(decode, [out.tokens[r.row] for r in decode], clock)
            if self.decoder.lookahead:
                per_row = [0] * self.cache.batch_size
                for r, n in zip(decode, kept):
                    per_row[r.row] = n
                self.decoder.output_kept(per_row)
        done = []
        for r, c in chunks:
            r.fed += c
            self.cache.remember_prefix([r.feed[:r.fed]], [r.row])
            if not r.prefilling:
                done.append(r)
        if done:
            self._emit(done, [[out.first[r.row]] for r in done], clock)

    def _emit(self, rs: list[_Running], tokens: list[list[int]], clock) -> list[int]:
        """Append each request's new tokens (stopping at EOS or max_new_tokens: a finished
        request's row is released at once); how many each kept."""
        now, kept = clock(), []
        for r, produced in zip(rs, tokens):
            before = len(r.res.tokens)
            for t in produced:
                r.res.tokens.append(t)
                r.res.token_times.append(now)
                if t in self.eos or len(r.res.tokens) >= r.req.max_new_tokens:
                    r.res.finish_reason = "eos" if t in self.eos else "length"
                    self.cache.release(r.row)
                    self.decoder.release(r.row)
                    del self.running[r.row]
                    break
            kept.append(len(r.res.tokens) - before)
        return kept


def serve(model, cache, decoder, requests: list[Request], **options) -> EngineResult:
    """Build an `Engine` with `options` and serve `requests` (see the module docstring)."""
    if not requests:
        raise SetupError("no requests to serve: give at least one Request")
    return Engine(model, cache, decoder, **options).run(requests)
