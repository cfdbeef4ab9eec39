"""The model runner: every forward of a model over its cache, eager or compiled.

`generate`, the serving engine and a draft model each run their forwards through one
`ModelRunner` (`model_runner` builds it): the prefill (`prefill`), and the forwards a
decoder's `step(runner, last, done, left)` asks for: one token a row (`decode`), a
speculative verify (`verify`, optionally with hidden states for a drafter that reads
them), a tree of drafts (`tree`). Compiled, `decode` and a verify of fixed size run the
static step (decoding/compiled.py) where every row takes part; the other forwards, trees
included, run the flat graphs below where the runner has them, else eagerly. The serving
engine's step runs through `execute` (a `StepPlan` in, a `StepOutput` out).

A forward over segments (decode rows, prefill chunks, a verify's gamma + 1 tokens, any
mix of them) runs eagerly or as one flat token batch through a compiled graph of a
bucketed size.

`ModelRunner.forward_segments(segments)` has `Transformer.forward_segments`'s contract
(one `Segment` per padded batch of distinct cache rows; logits per segment). Eager, it is
that method. Compiled (`compile=True`), the runner
- books every segment's plan on the cache first (`Transformer.plan_segments`: lengths,
  blocks, ring slots, int4 flushes; a refusal rolls back), as the eager forward does;
- packs every segment's valid tokens into one flat batch of N tokens, padded to the
  smallest bucket (powers of two from `MIN_BUCKET`) that holds it;
- runs `Transformer.flat_hidden` on it through torch.compile (public API: `dynamic=False`,
  one graph per bucket, compiled by `warm` before any request): embeddings, norms,
  projections, RoPE, MLPs per token, all fused by inductor; each layer's attention is one
  opaque call in the graph (`decodelab::flat_attend`, a torch custom op), which unpacks the
  segments and runs the cache's own `attend` with each segment's booked plan, so every
  backend (dense, paged, int4, sliding; trees and windows) serves through the same graph,
  bit for bit the eager attention;
- applies the head eagerly to the rows each segment asks logits for (one product, as
  the eager forward does).
A forward larger than the largest bucket runs eagerly (`eager_forwards` counts them, trees
included).
This is vLLM's piecewise compile: the scheduler's step in any shape, one graph per token
count, attention outside it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from decodelab.cache.static import register_attend_op
from decodelab.decoding import compiled
from decodelab.decoding.prefill import prefill, prompt_segment
from decodelab.models.errors import SetupError
from decodelab.models.handles import Handles
from decodelab.models.transformer import Packed, Segment

#: the smallest bucket: fewer tokens (a few decode rows) ride in one of this size, which
#: costs about what they cost (the weights are read once either way)
MIN_BUCKET = 8


#: the largest bucket: a longer forward (a prefill chunk of many tokens) is compute-bound,
#: where padding it to a power of two would cost up to twice its work and the fused
#: position-wise ops buy nothing: it runs eagerly (its products, like the eager ones, past
#: models.matmul's MAX_ROWS)
MAX_BUCKET = 64


def buckets_for(max_tokens: int) -> tuple[int, ...]:
    """Powers of two from `MIN_BUCKET` up to the first that holds `max_tokens`, at most
    `MAX_BUCKET`."""
    out, b = [], MIN_BUCKET
    while True:
        out.append(b)
        if b >= min(max_tokens, MAX_BUCKET):
            return tuple(out)
        b *= 2


class FlatBatch:
    """What a compiled flat forward's attention calls read: the cache, each segment's
    booked plan and how the segments' tokens sit in the flat batch (`Packed`). Reached by
    handle from inside the graph (models/handles.py)."""

    def __init__(self, cache):
        register_attend_op("flat_attend", _flat_attend_impl)
        self.cache = cache
        self.plans: list | None = None  # None: nothing booked (warm-up: attention gives zeros)
        self.packed: Packed | None = None
        self.attended: set[int] = set()
        self.handle = _BATCHES.add(self)


_BATCHES = Handles()


def _flat_attend_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                      handle: torch.Tensor) -> torch.Tensor:
    """q [N, Hq, D], k, v [N, Hkv, D] of a flat batch -> [N, Hq, D]: each segment's
    tokens unpacked to its [B, H, T, D] and attended by the cache through its plan
    (storing its K/V), packed back; zeros at the padding tokens."""
    b = _BATCHES.get(handle)
    if b is None:
        raise RuntimeError("a compiled flat forward ran after its runner was dropped")
    out = torch.zeros_like(q)
    if b.plans is None:
        return out
    if layer in b.attended:
        raise RuntimeError(f"layer {layer} attended twice in one booked forward: its K/V would be stored twice")
    b.attended.add(layer)
    parts, p = [], b.packed
    for s, plan in enumerate(b.plans):
        lo, hi = p.bounds[s], p.bounds[s + 1]
        qs, ks, vs = (p.unpack_own(t[lo:hi], s).transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        parts.append(p.pack_one(b.cache.attend(layer, qs, ks, vs, plan).transpose(1, 2), s))  # [N_s, Hq, D]
    out[:p.bounds[-1]] = torch.cat(parts)
    return out


@dataclass(frozen=True)
class Chunk:
    """A prefill chunk: these prompt tokens of the request in cache `row`, after what the
    row holds; `last`: they end its prompt (its row then samples its first token)."""

    row: int
    tokens: tuple[int, ...]
    last: bool


@dataclass(frozen=True)
class StepPlan:
    """What one serving-engine step runs, as the scheduler decides it (decoding/engine.py)
    and `ModelRunner.execute` runs it: a plain value, no request objects."""

    decode: tuple[tuple[int, int], ...] = ()  # (cache row, its last token) of every decoding request
    chunks: tuple[Chunk, ...] = ()
    left: int = 0  # the most tokens a decoding request may still emit (a speculative round drafts no further)


@dataclass(frozen=True)
class StepOutput:
    """What a step produced: tokens per decoding row (one, or a speculative round's
    accepted drafts and one more) and the first token of every row whose prompt ended."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    first: dict[int, int] = field(default_factory=dict)
    compiled: int = 0  # forwards through the compiled static step


class ModelRunner:
    """Runs a model's forwards over one cache (module docstring): `forward_segments`,
    eager or, with `compile`, as flat token batches of up to `max_tokens` tokens through
    one compiled graph per bucket (`backend`: torch.compile's)."""

    def __init__(self, model, cache, compile: bool = False, max_tokens: int = 256, backend: str = "inductor"):
        self.model, self.cache, self.compile = model, cache, compile
        #: the compiled static step of one token (`compiled_step`) or of a verify's gamma + 1
        #: (`compiled_verify`) that a forward in which every row decodes (verifies) runs
        #: through; None: none (`model_runner` builds it)
        self.static = None
        #: an engine step's verify forward, shared with its prefill chunks (`execute`); None outside one
        self.shared = None
        self.buckets = buckets_for(max_tokens) if compile else ()
        self.compiled_forwards = self.eager_forwards = self.static_steps = 0
        self.compile_s = 0.0  # seconds `model_runner` spent compiling
        self.fn = None
        if compile:
            options = compiled.inductor_patches(cache.layout.device) if backend == "inductor" else None  # refused first
            compiled.allow_recompiles()
            compiled.inductor_cache_dir()
            model.memoize_rope(cache.layout.device)  # memos filled before tracing: no guard on their state
            self.batch = FlatBatch(cache)
            dev = cache.layout.device
            self.bufs = {n: (torch.zeros(n, dtype=torch.long, device=dev), torch.zeros(n, dtype=torch.long, device=dev))
                         for n in self.buckets}
            self.fn = torch.compile(self._flat, backend=backend, options=options, dynamic=False, fullgraph=True)

    def _flat(self, ids: torch.Tensor, positions: torch.Tensor, handle: torch.Tensor) -> torch.Tensor:
        def attend(layer, q, k, v):
            return torch.ops.decodelab.flat_attend(q, k, v, layer, handle)
        return self.model.flat_hidden(ids, positions, attend)

    @torch.no_grad()
    def warm(self) -> dict[int, float]:
        """Compile every bucket now (nothing booked: the cache is not touched); the seconds
        each took."""
        took = {}
        for n in self.buckets:
            t = time.perf_counter()
            self.fn(*self.bufs[n], self.batch.handle)
            took[n] = time.perf_counter() - t
        return took

    @torch.no_grad()
    def forward_segments(self, segments: list[Segment], plans: list | None = None) -> list[torch.Tensor]:
        """Logits per segment, as `Transformer.forward_segments` returns them. `plans`: each
        segment's plan, booked by the caller (a tree's, `tree`); compiled only."""
        if not self.compile:
            if plans is not None:
                raise SetupError("booked plans run through a compiled runner's flat graphs; an eager runner plans "
                                 "its own forward (pass plans=None)")
            return self.model.forward_segments(segments, self.cache)
        valids = [s.valid if s.valid is not None else torch.ones(s.ids.shape, dtype=torch.bool, device=s.ids.device)
                  for s in segments]
        n = sum(int(v.sum()) for v in valids)
        bucket = next((b for b in self.buckets if b >= n), None)
        if bucket is None:
            if plans is not None:  # booked by the caller (who rolls them back): a graph must hold them
                raise SetupError(f"a forward of {n} tokens with its own plan is longer than the largest compiled "
                                 f"bucket ({self.buckets[-1]}); build the runner with max_tokens >= {n}")
            self.eager_forwards += 1
            return self.model.forward_segments(segments, self.cache)
        before = self.cache.lengths.clone()
        if plans is None and len(segments) == 1 and segments[0].rows is None:
            s = segments[0]
            plans = [self.cache.plan(s.positions, s.valid)]
        elif plans is None:
            plans = self.model.plan_segments(self.cache, segments)  # books them all (a refusal rolls back)
        try:
            packed = Packed([v.to(segments[0].ids.device) for v in valids])
            ids, pos = self.bufs[bucket]
            ids[n:], pos[n:] = 0, 0  # the padding
            ids[:n] = packed.pack([s.ids for s in segments])
            pos[:n] = packed.pack([s.positions for s in segments])
            b = self.batch
            b.plans, b.packed, b.attended = plans, packed, set()
            try:
                hidden = self.fn(ids, pos, b.handle)  # [bucket, dim]
            finally:
                attended, b.plans, b.packed = len(b.attended), None, None
            if attended != self.model.cfg.n_layers:
                raise SetupError(f"a compiled flat forward attended {attended} of {self.model.cfg.n_layers} "
                                 "layers: its graph does not call the cache's attention in every layer")
        except BaseException:  # booked but not (all) computed: the rows roll back to what they held
            self.cache.truncate(torch.minimum(self.cache.lengths, before))
            raise
        self.compiled_forwards += 1
        return self.model.segment_logits(hidden[:n], packed, segments, normed=True)

    # -- the forwards a decoder runs (`step(runner, last, done, left)`) ---------------------
    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], chunk_size: int | None = None, rows: list[int] | None = None,
                hidden_layers: tuple[int, ...] = ()):
        """THE prefill (decoding/prefill.py) of `prompts` into the runner's cache."""
        return prefill(self.model, self.cache, prompts, chunk_size, rows, hidden_layers)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor | None = None,
                logit_index: torch.Tensor | None = None, hidden_layers: tuple[int, ...] = ()):
        """The model's eager forward over the runner's cache (`Transformer.forward`): ids,
        positions [B, T] -> logits [B, T, V] ([B, K, V] at `logit_index` [B, K])."""
        extra = {"hidden_layers": hidden_layers} if hidden_layers else {}
        return self.model(ids, positions, self.cache, valid=valid, logit_index=logit_index, **extra)

    @torch.no_grad()
    def decode(self, last: torch.Tensor) -> torch.Tensor:
        """Every row's last token [B] at its next position: logits [B, V], through the
        compiled static step where there is one (its logits live in its buffer: read them
        before the next forward), else the flat graphs (`compile`) or the eager forward."""
        if self.static is not None and self.static.tokens == 1:
            self.static_steps += 1
            return self.static.step(last)
        positions = self.cache.lengths[:, None].to(self.model.device)  # [B, 1]
        if self.compile:
            return self.forward_segments([Segment(last[:, None], positions)])[0][:, -1]
        return self.forward(last[:, None], positions)[:, -1]

    @torch.no_grad()
    def verify(self, ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
               hidden_layers: tuple[int, ...] = ()):
        """A speculative verify: ids, positions, valid [B, T] (a frozen row all invalid) ->
        logits [B, T, V]; with `hidden_layers`, (logits, {layer: [B, T, dim]}) from the eager
        forward. Inside an engine step it shares the step's forward with its prefill chunks
        (`execute`); else it runs through the compiled static step where that step fits (every
        row verifies exactly its T tokens), else the flat graphs (`compile`) or the eager forward."""
        if self.shared is not None:
            if hidden_layers:
                raise SetupError("a drafter that reads the target's hidden states verifies through the model's own "
                                 "forward, not one shared with other work")
            return self.shared(ids, positions, valid)
        if hidden_layers:
            return self.forward(ids, positions, valid, hidden_layers=hidden_layers)
        s = self.static
        if s is not None and s.tokens == ids.shape[1] > 1 and bool(valid.all()):
            self.static_steps += 1
            return s.step(ids)
        rows = valid.any(1).nonzero().flatten().tolist() if self.compile else []
        if rows:  # flat graphs over the verifying rows only (a frozen row's attention is waste)
            logits = self.forward_segments([Segment(ids[rows], positions[rows], valid[rows], rows)])[0]
            full = logits.new_zeros(ids.shape[0], *logits.shape[1:])  # [B, T, V]: zeros at the frozen rows
            full[rows] = logits
            return full
        return self.forward(ids, positions, valid)

    @torch.no_grad()
    def tree(self, ids: torch.Tensor, positions: torch.Tensor, parents: torch.Tensor,
             rows: list[int] | None = None) -> torch.Tensor:
        """A tree of drafts: ids, positions, parents [b, T] of cache `rows` (None: all),
        each token attending to its ancestors (`cache.plan(parents=)`) -> logits [b, T, V];
        through the flat graphs (`compile`) where it fits a bucket, else eagerly."""
        if self.shared is not None:
            raise SetupError("a tree of drafts verifies in a forward of its own, not one shared with other work")
        dev, before = self.model.device, self.cache.lengths.clone()
        plan = self.cache.plan(positions, parents=parents, rows=rows)
        positions = positions.to(dev)
        try:
            if self.compile and ids.numel() <= self.buckets[-1]:
                return self.forward_segments([Segment(ids, positions, None, rows)], plans=[plan])[0]
            self.eager_forwards += self.compile
            return self.model(ids, positions, self.cache, plan=plan)
        except BaseException:  # booked but not computed: the rows roll back to what they held
            self.cache.truncate(torch.minimum(self.cache.lengths, before))
            raise

    # -- an engine step ---------------------------------------------------------------------
    #: a prefill chunk of at least this many tokens gets a segment of its own: its attention
    #: then pays no padding
    OWN_FORWARD = 64

    @torch.no_grad()
    def execute(self, step: StepPlan, decoder) -> StepOutput:
        """Run one engine step with `decoder` (its sampling, its speculative round): the
        decode rows and the chunks in one forward (`forward_segments`; each long chunk a
        segment of its own, the short ones together, as THE prefill places them), a
        speculative decoder's verify as one segment of it (the decoder's `verify` call runs
        this shared forward, `shared`); a step in which every row decodes (verifies) alone
        through the static step where there is one. A tree decoder verifies in a forward of
        its own (its plan is a tree): the step's chunks run just before it."""
        if step.decode and decoder.lookahead:
            if step.chunks and getattr(decoder, "verifies_tree", False):  # a tree verifies alone: the chunks first
                first = self._mixed(StepPlan(chunks=step.chunks), decoder).first
                out = self._speculate(StepPlan(step.decode, (), step.left), decoder)
                return StepOutput(out.tokens, first, out.compiled)
            return self._speculate(step, decoder)
        if step.chunks:
            return self._mixed(step, decoder)
        if step.decode:
            return self._decode(step, decoder)
        return StepOutput()

    def _decode(self, step: StepPlan, decoder) -> StepOutput:
        rows, B = [r for r, _ in step.decode], self.cache.batch_size
        if self.static is not None and len(rows) == B:  # every row decodes: the static step
            last = torch.zeros(B, dtype=torch.long)
            for r, t in step.decode:
                last[r] = t
            logits = self.decode(last.to(self.model.device))  # [B, V]
            return StepOutput({r: [t] for r, t in zip(rows, decoder.start(logits[rows]).tolist())}, {}, 1)
        seg, at = self._decode_segment(step.decode, self._decode_rows(rows))
        logits = self.forward_segments([seg])[0]  # [b, 1, V]
        return StepOutput({r: [t] for r, t in zip(rows, decoder.start(logits[[at[r] for r in rows], 0]).tolist())})

    def _mixed(self, step: StepPlan, decoder) -> StepOutput:
        rows, segments = [r for r, _ in step.decode], []
        if rows:
            seg, at = self._decode_segment(step.decode, self._decode_rows(rows, busy=[c.row for c in step.chunks]))
            segments.append(seg)
        groups = self._chunk_groups(step.chunks)
        segments += [self._chunk_segment(g) for g in groups]
        logits = self.forward_segments(segments)
        tokens = {}
        if rows:
            tokens = {r: [t] for r, t in zip(rows, decoder.start(logits[0][[at[r] for r in rows], 0]).tolist())}
        first = {}
        for g, lg in zip(groups, logits[len(segments) - len(groups):]):
            first |= self._first_tokens(g, lg[:, 0], decoder)
        return StepOutput(tokens, first)

    def _speculate(self, step: StepPlan, decoder) -> StepOutput:
        """One draft-and-verify round of the decoder over every cache row; the rows that
        are not decoding are frozen (their caches do not grow). With chunks, the verify is one
        forward with them (the decoding rows' gamma + 1 tokens as one segment); without, the
        runner's own `verify` (`tree`)."""
        B, dev = self.cache.batch_size, self.model.device
        last, done = torch.zeros(B, dtype=torch.long), [True] * B
        for r, t in step.decode:
            last[r], done[r] = t, False
        rows = sorted(r for r, _ in step.decode)
        groups = self._chunk_groups(step.chunks)
        prefilled = []

        def forward(ids, positions, valid):  # [B, G + 1] each: the decoding rows verify, the chunks prefill
            segments = [Segment(ids[rows], positions[rows], valid[rows], rows)]
            logits = self.forward_segments(segments + [self._chunk_segment(g) for g in groups])
            prefilled.extend(lg[:, 0] for lg in logits[1:])
            full = logits[0].new_zeros(B, *logits[0].shape[1:])  # [B, G + 1, V]: the frozen rows' are never read
            full[rows] = logits[0]
            return full

        before = self.static_steps
        self.shared = forward if groups else None  # the verify shares the step's forward with the chunks
        try:
            produced = decoder.step(self, last.to(dev), done=done, left=step.left)
        finally:
            self.shared = None
        first = {}
        for g, lg in zip(groups, prefilled):
            first |= self._first_tokens(g, lg, decoder)
        return StepOutput({r: produced[r] for r, _ in step.decode}, first, self.static_steps - before)

    def _decode_rows(self, rows: list[int], busy=()) -> list[int]:
        """The cache rows a decode forward runs over: the run of rows from the first decoding
        row to the last (a dense cache reads a run of rows in place; the idle rows inside it
        ride along as padding), or, where a row that is `busy` elsewhere in the forward
        sits inside that run, the decoding rows alone."""
        rows = sorted(rows)
        run = list(range(rows[0], rows[-1] + 1))
        return rows if set(run) & set(busy) else run

    def _decode_segment(self, decode, rows: list[int]) -> tuple[Segment, dict[int, int]]:
        """The decoding rows' last tokens at their next positions, over `rows` (the others:
        padding), and where each cache row sits in it."""
        dev = self.model.device
        at = {row: i for i, row in enumerate(rows)}
        last = torch.zeros(len(rows), 1, dtype=torch.long)
        valid = torch.zeros(len(rows), 1, dtype=torch.bool)
        for r, t in decode:
            last[at[r], 0], valid[at[r], 0] = t, True
        pos = self.cache.lengths[rows].clamp(max=self.cache.capacity - 1)[:, None].clone()  # [b, 1]
        first = torch.zeros(len(rows), 1, dtype=torch.long, device=dev)  # each row's logits at its one token
        return Segment(last.to(dev), pos.to(dev), valid.to(dev), rows, first), at

    def _chunk_groups(self, chunks) -> list[list[Chunk]]:
        """Each long chunk alone, the short ones together (right-padded)."""
        long = [[c] for c in chunks if len(c.tokens) >= self.OWN_FORWARD]
        short = [c for c in chunks if len(c.tokens) < self.OWN_FORWARD]
        return long + ([short] if short else [])

    def _chunk_segment(self, group: list[Chunk]) -> Segment:
        return prompt_segment(self.model, self.cache, [list(c.tokens) for c in group], [c.row for c in group])

    @staticmethod
    def _first_tokens(group: list[Chunk], logits: torch.Tensor, decoder) -> dict[int, int]:
        """The first token of each chunk's row whose prompt it ends (logits [b, V])."""
        done = [b for b, c in enumerate(group) if c.last]
        return {group[b].row: t for b, t in zip(done, decoder.start(logits[done]).tolist())} if done else {}


def compiled_runner(model, cache, max_tokens: int, backend: str = "inductor") -> ModelRunner:
    """A compiled `ModelRunner` of flat batches up to `max_tokens` tokens, every bucket
    compiled now (`warm`; a damaged compile cache retried once in a fresh folder,
    `compile_retrying`), so that no request pays a compile."""

    def build() -> ModelRunner:
        r = ModelRunner(model, cache, compile=True, max_tokens=max_tokens, backend=backend)
        r.warm()
        return r
    return compiled.compile_retrying(build)


#: torch.compile's backend for every compiled step a runner builds (tests set dynamo's `eager`)
BACKEND = "inductor"


def model_runner(model, cache, decoder=None, compile: bool = False, flat_tokens: int = 0) -> ModelRunner:
    """The runner of `model` over `cache` that `generate`, the serving engine and a draft
    model run every forward through. Eager; with `compile`, its static step compiled now:
    for a `decoder` that looks ahead the verify of its fixed gamma + 1 tokens where the
    cache plans one (`compiled_verify`; else the verify runs eagerly), else a one-token
    step (`compiled_step`); a tree decoder's trees (of varying size) have no static step;
    with `flat_tokens`, flat graphs of up to that many tokens (`compiled_runner`) for every
    other forward, trees included (`compile` alone leaves trees eager: why, in
    experiments/results/fastpath-s40). `compile_s`: the seconds that took."""
    t = time.perf_counter()
    r = compiled_runner(model, cache, flat_tokens, BACKEND) if flat_tokens else ModelRunner(model, cache)
    if compile:
        lookahead = getattr(decoder, "lookahead", 0)
        r.static = (compiled.compiled_verify(model, cache, decoder, BACKEND) if lookahead else
                    compiled.compiled_step(model, cache, BACKEND))
    if r.static is not None or flat_tokens:  # something compiled (a verify the cache cannot plan: nothing)
        r.compile_s = time.perf_counter() - t
    return r
