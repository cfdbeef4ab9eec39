"""Drafters for speculative decoding. Each one proposes gamma tokens per row and the
distributions q they were drawn from, then rolls its own state back to what the target
accepted.

- `ModelDrafter`: a draft model with its own cache (any backend); also the truncated
  self-draft (the target's first K layers + final norm + head) and the quantized
  self-draft (the target with optimum-quanto int8/int4 weights). With `compile=True` its
  one-token draft steps run a compiled step (decoding/compiled.py), compiled in `begin`.
- `PromptLookupDrafter`: n-gram match against the prompt and the text so far; its
  proposals are deterministic, so q is one-hot.
"""

from __future__ import annotations

import torch

from decodelab.cache.base import CacheLayout, planned_bytes
from decodelab.cache.dense import DenseCache
from decodelab.decoding.runner import model_runner
from decodelab.decoding.sampling import SamplingParams, logits_to_probs, sample
from decodelab.decoding.text import make_cache
from decodelab.models.errors import SetupError
from decodelab.models.quantize import WeightOptions


class EarlyExit(torch.nn.Module):
    """The target's first `n_layers` layers + its final norm and head (weights shared)."""

    def __init__(self, model, n_layers: int):
        super().__init__()
        self.model, self.n_layers = model, n_layers
        c = model.cfg
        self.cfg = c.with_(n_layers=n_layers, windows=c.windows[:n_layers])

    @property
    def device(self):
        return self.model.device

    @property
    def dtype(self):
        return self.model.dtype

    def forward(self, ids, positions, cache, **kw):
        return self.model(ids, positions, cache, n_layers=self.n_layers, **kw)


class ModelDrafter:
    """Draft with a model whose vocabulary is the target's, through its own cache."""

    def __init__(self, model, cache=DenseCache, tokenizer=None, target_tokenizer=None, name: str = "draft",
                 compile: bool = False, gamma: int = 4):
        if cache is None:  # a conf/draft yaml's `cache: null` reached a builder as is: the default
            cache = DenseCache
        elif isinstance(cache, str):
            raise SetupError(f"draft {name}: cache {cache!r} is a conf/cache option name; build the drafter "
                             "through experiments.harness.build (which turns draft.cache into a cache factory) "
                             "or pass a factory (e.g. decodelab.cache.dense.DenseCache)")
        self.model, self.cache_factory, self.name = model, cache, name
        self.tokenizer, self.target_tokenizer = tokenizer, target_tokenizer
        self.compile = compile
        self.gamma = gamma  # its best measured lookahead: the decoder's gamma where none is given
        self.cache = self.runner = None
        self.lookahead = 1  # tokens the draft cache must roll back (the decoder's gamma, set before `begin`)
        self.compile_s = 0.0  # the last `begin`'s compile (compile=True), which `generate` reports apart

    def __repr__(self) -> str:
        return f"ModelDrafter({self.name})"

    def problems(self, target, batch_size: int, gamma: int) -> list[str]:
        if self.model.cfg.vocab_size != target.cfg.vocab_size:
            return [f"draft {self.name} has a vocabulary of {self.model.cfg.vocab_size} tokens, the target "
                    f"{target.cfg.vocab_size}: the draft must share the target's tokenizer"]
        if self.tokenizer is not None and self.target_tokenizer is not None and (
                self.tokenizer.vocab() != self.target_tokenizer.vocab()):
            return [f"draft {self.name}'s tokenizer maps tokens to other ids than the target's; "
                    "use a draft made for the target's tokenizer"]
        return []

    def begin(self, prompts: list[list[int]], capacity: int, compile: bool = False) -> None:
        """A draft cache as large as the target's, prefilled with the prompts (the shared prefill);
        one the draft model cannot hold is refused naming the draft, before any prefill. With
        `compile` (the drafter's own option, or the run's `compile`), the draft step is
        compiled first (once per shape in a process)."""
        try:  # make_cache checks before it allocates; its reasons are the draft's
            self.cache = make_cache(self.model, len(prompts), capacity, self.cache_factory)
            if self.cache.rollback_limit < self.lookahead:  # before any compile
                raise SetupError(f"its cache {type(self.cache).__name__} can roll back {self.cache.rollback_limit} "
                                 f"tokens but gamma {self.lookahead} needs {self.lookahead}; lower gamma or give the "
                                 "draft another cache (draft.cache)")
            self.runner = model_runner(self.model, self.cache, compile=self.compile or compile)
            self.compile_s = self.runner.compile_s
        except SetupError as e:
            raise SetupError([f"draft {self.name}: {r}" for r in e.reasons]) from None
        self.runner.prefill(prompts)
        self.pending = [[] for _ in prompts]  # accepted tokens the draft has not fed yet

    @torch.no_grad()
    def admit(self, row: int, tokens: list[int]) -> None:
        """Start row `row` over with `tokens` (a serving engine admitted a request there): the
        row is released and `tokens` prefilled into it (the shared prefill, that row only)."""
        self.cache.release(row)
        self.runner.prefill([tokens], rows=[row])
        self.pending[row] = []

    def release(self, row: int) -> None:
        """Empty row `row` (its request left): an idle row then drafts from position 0 and is
        rolled back each round, so it never nears the capacity."""
        self.cache.release(row)
        self.pending[row] = []

    def held_bytes(self, rows: list[int]) -> int:
        """K/V bytes the draft cache holds for these rows (0 before `begin`)."""
        return 0 if self.cache is None else self.cache.held_bytes(rows)

    def row_bytes(self, tokens: int) -> int:
        """K/V bytes the draft cache takes for one row of `tokens` tokens."""
        if self.cache is not None:
            return self.cache.row_bytes(tokens)
        return planned_bytes(self.cache_factory, CacheLayout.of(self.model), 1, max(1, tokens))

    def budget_bytes(self, batch_size: int, capacity: int) -> int:
        """The draft cache a target cache of these sizes gets (`begin` builds it as large)."""
        return planned_bytes(self.cache_factory, CacheLayout.of(self.model), batch_size, capacity)

    @torch.no_grad()
    def propose(self, last: torch.Tensor, gamma: int, params: SamplingParams, generator):
        """Feed pending tokens + last, then draft gamma tokens: ([B, G], q [B, G, V])."""
        feeds = [p + [int(t)] for p, t in zip(self.pending, last.tolist())]
        self._last_at = self.cache.lengths + torch.tensor([len(f) - 1 for f in feeds])  # [B] position of last
        one = all(len(f) == 1 for f in feeds)  # one token per row: the runner's step (compiled where it is)
        logits = self.runner.decode(last) if one else self._feed(feeds)  # [B, V]
        tokens, probs = [], []
        for i in range(gamma):
            q = logits_to_probs(logits, params)  # [B, V]
            x = q.argmax(-1) if params.greedy else sample(q, generator)
            tokens.append(x)
            probs.append(q)
            if i < gamma - 1:
                logits = self.runner.decode(x)
        self._draft = torch.stack(tokens, 1)  # [B, G]
        return self._draft, torch.stack(probs, 1)

    def _feed(self, feeds: list[list[int]]) -> torch.Tensor:
        """Run ragged token lists after each row's cached length; last logits [B, V]."""
        n = torch.tensor([len(f) for f in feeds])
        T = int(n.max())
        ids = torch.zeros(len(feeds), T, dtype=torch.long)
        for b, f in enumerate(feeds):
            ids[b, : len(f)] = torch.tensor(f)
        dev = self.model.device
        positions = (self.cache.lengths[:, None] + torch.arange(T)).to(dev)  # [B, T]
        valid = (torch.arange(T)[None] < n[:, None]).to(dev)  # [B, T]
        return self.runner.forward(ids.to(dev), positions, valid, (n - 1)[:, None].to(dev))[:, 0]

    def commit(self, n: torch.Tensor, nxt: torch.Tensor, active: torch.Tensor) -> None:
        """Roll back to what the target kept. The draft fed last, d_1..d_{G-1}; an active
        row keeps last + d_1..d_n (d_G, when all were accepted, is fed next round); a
        frozen row keeps what it had before last."""
        G = self._draft.shape[1]
        fed = torch.minimum(n, torch.full_like(n, G - 1))
        keep = torch.where(active, self._last_at + 1 + fed, self._last_at)
        self.cache.truncate(keep)
        self.pending = [[int(self._draft[b, G - 1])] if bool(active[b]) and int(n[b]) == G else []
                        for b in range(len(n))]


class PromptLookupDrafter:
    """Propose the tokens that followed the latest earlier occurrence of the last n-gram
    (n from `max_ngram` down to `min_ngram`) in the prompt and the text so far."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, gamma: int = 4):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.gamma = gamma  # its best measured lookahead: the decoder's gamma where none is given

    def __repr__(self) -> str:
        return f"PromptLookupDrafter(ngram {self.min_ngram}..{self.max_ngram})"

    def problems(self, target, batch_size: int, gamma: int) -> list[str]:
        p = []
        if not isinstance(self.min_ngram, int) or self.min_ngram < 1:
            p.append(f"prompt lookup min_ngram must be an integer >= 1, got {self.min_ngram}")
        if not isinstance(self.max_ngram, int) or self.max_ngram < max(1, self.min_ngram or 1):
            p.append(f"prompt lookup max_ngram must be >= min_ngram and >= 1, got {self.max_ngram}")
        self.vocab_size = target.cfg.vocab_size
        return p

    def begin(self, prompts: list[list[int]], capacity: int, compile: bool = False) -> None:
        """The prompts are the history it looks up in (it has no model step to compile)."""
        self.history = [list(p) for p in prompts]

    def admit(self, row: int, tokens: list[int]) -> None:
        """Start row `row` over with `tokens` (a serving engine admitted a request there)."""
        self.history[row] = list(tokens)

    def held_bytes(self, rows: list[int]) -> int:
        """Prompt lookup keeps token ids, no K/V."""
        return 0

    def row_bytes(self, tokens: int) -> int:
        return 0

    def budget_bytes(self, batch_size: int, capacity: int) -> int:
        return 0

    def release(self, row: int) -> None:
        """Forget row `row`'s text (its request left)."""
        self.history[row] = []

    def propose(self, last: torch.Tensor, gamma: int, params: SamplingParams, generator):
        """Deterministic proposals [B, G] and their one-hot q [B, G, V]."""
        rows = []
        for h, t in zip(self.history, last.tolist()):
            h.append(t)
            rows.append(self._lookup(h, gamma))
        self._draft = torch.tensor(rows, device=last.device)  # [B, G]
        q = torch.nn.functional.one_hot(self._draft, self.vocab_size).float()
        return self._draft, q

    def propose_tree(self, last: torch.Tensor, depth: int, width: int) -> list[list[list[int]]]:
        """Per row, up to `width` distinct continuations of `depth` tokens (a tree decoder's
        candidates, decoding/tree_speculative.py): what followed the matches of the longest
        n-gram first, latest match first, then shorter n-grams'."""
        out = []
        for h, t in zip(self.history, last.tolist()):
            h.append(t)
            out.append(self._lookups(h, depth, width))
        return out

    def _lookup(self, h: list[int], gamma: int) -> list[int]:
        return self._lookups(h, gamma, 1)[0]

    def _lookups(self, h: list[int], gamma: int, width: int) -> list[list[int]]:
        found = []
        for n in range(min(self.max_ngram, len(h) - 1), self.min_ngram - 1, -1):
            tail = h[-n:]
            for s in range(len(h) - n - 1, -1, -1):  # latest earlier occurrence first
                if h[s:s + n] == tail:
                    follow = h[s + n: s + n + gamma]
                    follow = follow + [follow[-1]] * (gamma - len(follow))
                    if follow not in found:
                        found.append(follow)
                        if len(found) == width:
                            return found
        return found or [[h[-1]] * gamma]  # no match: repeat the last token (verified like any draft)

    def commit(self, n: torch.Tensor, nxt: torch.Tensor, active: torch.Tensor) -> None:
        """The history keeps the accepted drafts; the next token arrives as `last`."""
        self.accept([self._draft[b, : int(n[b])].tolist() for b in range(len(self.history))], active)

    def accept(self, drafts: list[list[int]], active: torch.Tensor) -> None:
        """Each active row's history keeps its accepted drafts; a frozen row's drops the
        `last` it was given (it comes again next round)."""
        for b, h in enumerate(self.history):
            if bool(active[b]):
                h.extend(drafts[b])
            else:
                h.pop()


# -- builders used by conf/draft/*.yaml (`target` is the target's LoadedModel) ----------
def early_exit(target, layers: int, cache=DenseCache, compile: bool = False, gamma: int = 4) -> ModelDrafter:
    """Truncated self-draft: the target's first `layers` layers + final norm + head."""
    from decodelab.models.errors import SetupError

    n = target.model.cfg.n_layers
    if not isinstance(layers, int) or not 1 <= layers < n:
        raise SetupError(f"early-exit draft layers must be in [1, {n - 1}] for this {n}-layer target, got {layers}")
    return ModelDrafter(EarlyExit(target.model, layers), cache, name=f"early-exit-{layers}", compile=compile,
                        gamma=gamma)


def quantized_self(target, weights: WeightOptions | dict | str = "int8", cache=DenseCache, compile: bool = False,
                   gamma: int | None = None) -> ModelDrafter:
    """The target with weight-only int8/int4 weights (quanto's quantizers, fast kernels:
    models/quantize.py) as its own draft; the target keeps its own precision, so greedy
    speculative output stays the target's. `weights`: the draft's `WeightOptions` (or a
    kind, `"int4"`, or a mapping of its fields); `gamma`: the decoder's lookahead where it
    sets none; None: `BEST_GAMMA` of these weights."""
    w = WeightOptions.of(weights, "draft.weights")
    draft = w.apply(target.model, key="draft.weights")
    return ModelDrafter(draft, cache, name=f"self-{w.kind}", compile=compile,
                        gamma=BEST_GAMMA.get(w.kind, 4) if gamma is None else gamma)


#: the quantized self-drafts' best measured lookahead, the decoder's gamma where none is given
#: (the sweeps behind it: experiments/results/spec-compiled-gamma and the main job's spec_gamma)
BEST_GAMMA = {"int8": 8, "int4": 4}

quantized_self.quantizes_target = True  # declared: setup refuses it for a target quantized already


def prompt_lookup(target=None, max_ngram: int = 3, min_ngram: int = 1, cache=None,
                  gamma: int = 4) -> PromptLookupDrafter:
    return PromptLookupDrafter(max_ngram=max_ngram, min_ngram=min_ngram, gamma=gamma)


def draft_model(target, model, cache=DenseCache, compile: bool = False, gamma: int = 4) -> ModelDrafter:
    """Another checkpoint as the draft (a LoadedModel, or a conf/model spec to load; Hydra
    hands over the loaded model); its tokenizer must be the target's."""
    from decodelab.models.loading import LoadedModel, instantiate_unwrapped

    lm = model if isinstance(model, LoadedModel) else instantiate_unwrapped(model)
    tok = lambda m: m.tokenizer if (m.tokenizer_dir or m.tokenizer_from) else None  # noqa: E731
    return ModelDrafter(lm.model, cache, tokenizer=tok(lm), target_tokenizer=tok(target), name=lm.name,
                        compile=compile, gamma=gamma)
