"""Decoders: given the last token of each row, produce the next tokens.

A decoder declares what it is as class attributes: `needs_drafter`, `lookahead`
(positions it writes past the output) and `lossless_at_temperature_0`. It has
`problems(model, cache)` (checked when a setup is built), `begin(device)`
(seeds its generator; called once per generation), `start(logits)` (the first token
from the prefill logits), `admit(row, tokens)` / `release(row)` (a serving engine starts a
new sequence in cache row `row`, after `begin`, and ends it) and
`step(runner, last, done, left) -> list[list[int]]`
(every forward through `runner`, the target's `ModelRunner`: `decode`, `verify`, `tree`;
tokens produced per row; plain decoding produces one, speculative decoding may produce
more; rows in `done` are frozen, and `left`, the most any row may still emit, lets a
decoder that looks ahead stop drafting where the output ends).
The loop owns stopping: after each step it calls `output_kept(kept)` with how many of
each row's produced tokens the output kept (fewer at EOS, a stop string or
max_new_tokens), so that statistics count what was emitted.
"""

from __future__ import annotations

import torch

from decodelab.decoding.sampling import SamplingParams, choose
from decodelab.models.errors import raise_if, shown


def decoder_type_problems(decoder) -> list[str]:
    """Why `decoder` is not a decoder object (empty when it is one)."""
    missing = [m for m in ("problems", "begin", "start", "step") if not callable(getattr(decoder, m, None))]
    if not missing:
        return []
    hint = (f"; a conf/decoder option by name: decodelab.experiments.harness.option('decoder', {decoder!r})"
            if isinstance(decoder, str) else "")
    return [f"decoder must be a decoder object (greedy(), SamplingDecoder(...), SpeculativeDecoder(drafter, ...)), "
            f"got {shown(decoder)[:-1]}, without {', '.join(missing)}){hint}"]


def runner_problems(runner) -> list[str]:
    """Why `runner` is not what a decoder's `step` runs its forwards through."""
    if all(callable(getattr(runner, m, None)) for m in ("decode", "verify", "tree")):
        return []
    return [f"a decoder's step takes the target's ModelRunner (decodelab.decoding.runner.model_runner(model, "
            f"cache)), got {shown(runner)}: generate() and the serving engine pass theirs"]


def not_begun(decoder, call: str) -> list[str]:
    """The call order of a decoder (`begin`, then `start` on the prefill's logits, then `step`),
    where `call` comes before its `begin`."""
    if getattr(decoder, "generator", None) is not None:
        return []
    return [f"{type(decoder).__name__}.{call} called before begin(device, prompts, capacity): call "
            "decoder.begin first, once per generation (generate() and the serving engine do), then "
            "decoder.start(logits) on the prefill's last logits, then decoder.step"]


class SamplingDecoder:
    """Plain autoregressive decoding: each step samples the next token from the model's
    distribution at `temperature` after top-k / top-p / min-p (0 = off for top_k and
    min_p, 1 = off for top_p), seeded by `seed`. The defaults sample from the model's own
    distribution (temperature 1, no truncation: vLLM's `SamplingParams()`, transformers'
    `do_sample=True` without top-k); temperature 0 is greedy (`greedy()`). They are
    conf/decoder/sampling.yaml's, so `decoder=sampling` on the command line is
    `SamplingDecoder()`."""

    #: what this decoder is, read by setup, bench and report (never its class name):
    needs_drafter = False  # built with a `drafter=` (the `draft` config group)
    lossless_at_temperature_0 = True  # greedy output is the target's own greedy output
    takes_compiled_step = True  # `step` decodes through the runner's compiled one-token step (compile=True)

    def __init__(self, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 min_p: float = 0.0, seed: int = 0):
        self.params = SamplingParams(temperature, top_k, top_p, min_p)
        self.seed = seed
        raise_if(self.params.problems())
        self.generator: torch.Generator | None = None

    def __repr__(self) -> str:
        return f"SamplingDecoder({self.params}, seed={self.seed})"

    def problems(self, model, cache) -> list[str]:
        return self.params.problems()

    @property
    def stats(self) -> dict:
        return {}

    lookahead = 0  # positions written past the output (speculative verification)

    def begin(self, device: torch.device, prompts: list[list[int]], capacity: int) -> None:
        """Fresh generator from the seed: the same seed gives the same output."""
        self.generator = torch.Generator(device=device).manual_seed(self.seed)

    def start(self, logits: torch.Tensor) -> torch.Tensor:
        """First tokens [B] from the last prompt logits [B, V]."""
        raise_if(not_begun(self, "start"))
        return choose(logits, self.params, self.generator)

    def admit(self, row: int, tokens: list[int]) -> None:
        """A serving engine starts a new sequence (`tokens` so far) in cache row `row`:
        nothing to do for plain decoding (it keeps no per-row state)."""

    def release(self, row: int) -> None:
        """A serving engine's request left cache row `row` (finished or preempted): nothing
        to do for plain decoding."""

    # -- the KV a decoder holds beside the target's cache (a serving engine charges it) ----
    def held_bytes(self, rows: list[int]) -> int:
        """K/V bytes the decoder's own caches hold for these rows: none for plain decoding."""
        return 0

    def row_bytes(self, tokens: int) -> int:
        """K/V bytes its own caches take for one row of `tokens` tokens: none here."""
        return 0

    def budget_bytes(self, batch_size: int, capacity: int) -> int:
        """The most K/V bytes its own caches hold for a target cache of these sizes: none here."""
        return 0

    @torch.no_grad()
    def step(self, runner, last: torch.Tensor, done: list[bool] | None = None,
             left: int | None = None) -> list[list[int]]:
        """Feed last [B] at each row's next position (`runner.decode`: the compiled step where
        the runner has one); one new token per row (`left`, the most tokens any row may still
        emit, matters only to decoders that look ahead)."""
        raise_if(not_begun(self, "step") + runner_problems(runner))
        return [[t] for t in choose(runner.decode(last), self.params, self.generator).tolist()]

    def output_kept(self, kept: list[int]) -> None:
        """How many of the last step's tokens each row's output kept: no statistics here."""


def greedy(*, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
           seed: int = 0) -> SamplingDecoder:
    """Greedy decoding: a `SamplingDecoder` at temperature 0, the argmax of each step's
    logits (top_k, top_p, min_p and seed cannot change an argmax). `greedy()` is
    conf/decoder/greedy.yaml (`decoder=greedy`, the command line's default decoder); it
    takes SamplingDecoder's options, keyword only, so that that config keeps them
    (`decoder.temperature=0.7` samples, as a sweep over temperature from greedy needs)."""
    return SamplingDecoder(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)


# what `greedy` builds, declared on it as on a class: setup and bench read these from a
# config's `_target_` before building it (experiments.harness.declared)
greedy.needs_drafter = SamplingDecoder.needs_drafter
greedy.lossless_at_temperature_0 = SamplingDecoder.lossless_at_temperature_0
