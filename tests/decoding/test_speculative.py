"""Speculative decoding: lossless greedy for every drafter, draft = target accepts all,
rejection sampling reproduces the target distribution, ragged batches, bad setups."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from decodelab.decoding import generate, greedy
from decodelab.decoding.drafters import EarlyExit, ModelDrafter, PromptLookupDrafter
from decodelab.decoding.sampling import SamplingParams, logits_to_probs
from decodelab.decoding.speculative import (SpeculativeDecoder, SpeculativeStats, greedy_accept, leviathan_speedup,
                                            overlap, rejection_sample)
from decodelab.models.errors import SetupError
from decodelab.models.loading import random_model
from tests.conftest import TINY, cache_for, random_ids


def drafters(lm):
    other = random_model(lm.cfg, seed=11, device="cpu").model  # same shapes, other weights
    return {
        "self": ModelDrafter(lm.model, name="self"),
        "other-model": ModelDrafter(other, name="other"),
        "early-exit": ModelDrafter(EarlyExit(lm.model, 1), name="early-exit"),
        "prompt-lookup": PromptLookupDrafter(max_ngram=3),
    }


def repetitive_prompt(n: int = 24) -> list[int]:
    base = random_ids(6, seed=21)
    return (base * (n // 6 + 1))[:n]


@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_speculative_is_token_identical(tiny, gamma):
    m = tiny.model
    prompts = [repetitive_prompt(), random_ids(9, m.cfg.vocab_size, seed=2)]
    plain = generate(m, cache_for(m, 2, 100), greedy(), prompts, 24)
    for name, d in drafters(tiny).items():
        spec = SpeculativeDecoder(d, gamma=gamma)
        r = generate(m, cache_for(m, 2, 100), spec, prompts, 24)
        assert r.tokens == plain.tokens, f"{tiny.name} / {name}"
        assert all(len(t) == 24 for t in r.tokens)


def test_draft_equal_to_target_accepts_everything(tiny_llama):
    m = tiny_llama.model
    r = generate(m, cache_for(m, 1, 80), SpeculativeDecoder(ModelDrafter(m), gamma=4), [random_ids(7)], 40)
    s = r.stats
    assert s["acceptance_rate"] == 1.0 and s["acceptance_per_position"] == [1.0] * 4
    # 1 token from the prefill, then 7 calls of gamma + 1 = 5 tokens and an 8th call cut by
    # max_new_tokens to the 4 the output had left: statistics count what was emitted
    assert s["target_calls"] == 8 and s["emitted_tokens"] == 40
    assert s["tokens_per_target_call"] == pytest.approx(39 / 8)
    assert s["alpha"] == pytest.approx(1.0)


def test_alpha_counts_only_positions_on_the_produced_prefix():
    st = SpeculativeStats(4)
    overlaps = torch.tensor([[1.0, 0.0, 1.0, 1.0],  # 1 accepted: positions 0 and 1 count
                             [1.0, 1.0, 1.0, 1.0],  # all 4 accepted: all count
                             [0.5, 0.5, 0.5, 0.5]])  # frozen row: nothing counts
    st.record(torch.tensor([1, 4, 0]), torch.tensor([True, True, False]), 4, overlaps)
    st.kept([2, 5, 0])  # the output kept every token of the active rows
    s = st.summary()
    assert s["alpha"] == pytest.approx(5 / 6)  # not (3 + 4) / 8 over every position
    assert s["tokens_per_target_call"] == pytest.approx((2 + 5) / 2)
    assert s["acceptance_per_position"] == [1.0, 0.5, 0.5, 0.5]


def test_adaptive_gamma_grows_when_all_accepted(tiny_llama):
    m = tiny_llama.model
    spec = SpeculativeDecoder(ModelDrafter(m), gamma=2, adaptive=True, gamma_max=6)
    r = generate(m, cache_for(m, 1, 120), spec, [random_ids(7)], 60)
    assert spec.gamma == 6 and r.stats["mean_gamma"] > 2


def test_eos_inside_an_accepted_block_and_max_new_tokens(tiny_llama):
    m = tiny_llama.model
    ids = random_ids(8, seed=4)
    plain = generate(m, cache_for(m, 1, 60), greedy(), [ids], 20)
    eos = plain.tokens[0][6]
    spec = SpeculativeDecoder(ModelDrafter(m), gamma=4)
    r = generate(m, cache_for(m, 1, 60), spec, [ids], 20, eos_ids=[eos])
    assert r.tokens[0] == plain.tokens[0][: plain.tokens[0].index(eos) + 1] and r.finish_reasons == ["eos"]
    r = generate(m, cache_for(m, 1, 60), SpeculativeDecoder(ModelDrafter(m), gamma=4), [ids], 7)
    assert r.tokens[0] == plain.tokens[0][:7]


def test_batch_rows_get_what_they_get_alone(tiny_gemma):
    m = tiny_gemma.model
    prompts = [random_ids(n, seed=n) for n in (5, 30, 17)]
    d = lambda: ModelDrafter(EarlyExit(m, 2))  # noqa: E731
    batch = generate(m, cache_for(m, 3, 100), SpeculativeDecoder(d(), gamma=3, temperature=0.9, seed=1), prompts, 16)
    assert all(len(t) == 16 for t in batch.tokens)
    for b, p in enumerate(prompts):
        alone = generate(m, cache_for(m, 1, 100), SpeculativeDecoder(d(), gamma=3), [p], 16)
        plain = generate(m, cache_for(m, 1, 100), greedy(), [p], 16)
        assert alone.tokens[0] == plain.tokens[0]
    greedy_batch = generate(m, cache_for(m, 3, 100), SpeculativeDecoder(d(), gamma=3), prompts, 16)
    for b, p in enumerate(prompts):
        assert greedy_batch.tokens[b] == generate(m, cache_for(m, 1, 100), greedy(), [p], 16).tokens[0]


def test_same_seed_same_output(tiny_llama):
    m = tiny_llama.model
    run = lambda seed: generate(m, cache_for(m, 1, 80), SpeculativeDecoder(  # noqa: E731
        ModelDrafter(EarlyExit(m, 1)), gamma=3, temperature=1.0, seed=seed), [random_ids(6)], 30).tokens
    assert run(5) == run(5) and run(5) != run(6)


# -- the rejection sampler reproduces the target distribution ---------------------------
def chi2_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness-of-fit p-value of counts against probs (support of probs)."""
    keep = probs > 0
    c, pr = counts[keep].double(), probs[keep].double()
    return stats.chisquare(c, pr / pr.sum() * c.sum()).pvalue


def _tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * (counts / counts.sum() - p).abs().sum().item()


def test_rejection_sampler_matches_target_distribution():
    """V = 10, 200k draws: chi-square against p at significance 0.001 passes; random
    alternatives are rejected; total variation shrinks with the sample count."""
    g = torch.Generator().manual_seed(0)
    V, N = 10, 200_000
    p = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    draft = torch.multinomial(q.expand(N, -1), 1, replacement=True, generator=g)  # [N, 1]
    P = p.expand(N, 2, V).contiguous()  # position 0 verifies, position 1 is the bonus
    n, nxt = rejection_sample(P, q.expand(N, 1, V).contiguous(), draft, g)
    first = torch.where(n == 1, draft[:, 0], nxt)  # the token emitted at the first position
    counts = torch.bincount(first, minlength=V).double()
    assert chi2_p(counts, p) > 1e-3
    for seed in range(5):
        alt = torch.softmax(torch.randn(V, generator=torch.Generator().manual_seed(100 + seed)), -1).double()
        assert chi2_p(counts, alt) < 1e-3
    tv_small = _tv(torch.bincount(first[:2000], minlength=V).double(), p)
    assert _tv(counts, p) < tv_small and _tv(counts, p) < 0.01
    # acceptance rate equals sum_x min(p, q)
    assert n.float().mean().item() == pytest.approx(overlap(p, q).item(), abs=0.01)


def test_rejection_sampler_greedy_is_exact():
    p = torch.nn.functional.one_hot(torch.tensor([[3, 1, 4]]), 6).float()  # target argmaxes
    q = torch.nn.functional.one_hot(torch.tensor([[3, 2]]), 6).float()
    n, nxt = rejection_sample(p, q, torch.tensor([[3, 2]]))
    assert n.tolist() == [1] and nxt.tolist() == [1]


def test_greedy_accept_is_rejection_sampling_with_one_hot_distributions():
    g = torch.Generator().manual_seed(0)
    B, G, V = 4000, 5, 4  # small vocabulary: every accepted length 0..G occurs
    best = torch.randint(0, V, (B, G + 1), generator=g)
    draft = torch.where(torch.rand(B, G, generator=g) < 0.8, best[:, :G], torch.randint(0, V, (B, G), generator=g))
    one_hot = lambda t: torch.nn.functional.one_hot(t, V).float()  # noqa: E731
    n_ref, nxt_ref = rejection_sample(one_hot(best), one_hot(draft), draft, g)
    n, nxt = greedy_accept(best, draft)
    assert torch.equal(n, n_ref) and torch.equal(nxt, nxt_ref)
    assert set(n.tolist()) == set(range(G + 1))


def test_speculative_sampling_matches_plain_sampling_distribution():
    """Tiny model at temperature 1: the distribution of the 2nd and 3rd generated tokens
    from speculative decoding (draft: another model) matches plain sampling's exact
    distribution (computed from the model) by chi-square at 0.001."""
    cfg = dict(TINY["llama"], vocab_size=8)
    target = random_model(cfg, seed=0, device="cpu").model
    draft = random_model(cfg, seed=5, device="cpu").model
    with torch.no_grad():  # sharpen both, differently, so that p and q really differ
        target.embed.weight.mul_(8)
        draft.embed.weight.mul_(-8)
    prompt = [1, 2, 3]
    N = 3000
    spec = SpeculativeDecoder(ModelDrafter(draft), gamma=2, temperature=1.0, seed=0)
    r = generate(target, cache_for(target, N, 10), spec, [prompt] * N, 3)
    first, second = torch.tensor([t[0] for t in r.tokens]), torch.tensor([t[1] for t in r.tokens])
    with torch.inference_mode():  # exact P(x1) and P(x2 | x1) from the model
        p1 = logits_to_probs(target(torch.tensor([prompt]), torch.arange(3)[None], cache_for(target, 1, 3))[:, -1],
                             SamplingParams(1.0))[0]
        counts = torch.bincount(first, minlength=8).double()
        assert (counts[p1 == 0] == 0).all() and chi2_p(counts, p1) > 1e-3
        x1 = int(torch.bincount(first).argmax())
        seq = prompt + [x1]
        p2 = logits_to_probs(target(torch.tensor([seq]), torch.arange(4)[None], cache_for(target, 1, 4))[:, -1],
                             SamplingParams(1.0))[0]
        sel = second[first == x1]
        c2 = torch.bincount(sel, minlength=8).double()
        assert chi2_p(c2, p2) > 1e-3
    assert 0 < r.stats["acceptance_rate"] < 1


def test_leviathan_formula():
    assert leviathan_speedup(1.0, 4, 0.0) == 5.0
    assert leviathan_speedup(0.5, 2, 0.0) == pytest.approx(1.75)
    assert leviathan_speedup(0.8, 4, 0.1) == pytest.approx(2.4011428571)  # 0.67232 / 0.2 = 3.3616 tokens, / 1.4
    assert leviathan_speedup(0.5, 2, 0.1, verify_cost=2.0) == pytest.approx(1.75 / 2.2)  # verify = 2 steps


# -- bad setups ---------------------------------------------------------------------------
def test_bad_setups_are_refused_before_any_forward(tiny_llama):
    m = tiny_llama.model
    with pytest.raises(SetupError, match="gamma"):
        SpeculativeDecoder(ModelDrafter(m), gamma=0)
    small = random_model(dict(TINY["llama"], vocab_size=128), device="cpu").model
    with pytest.raises(SetupError, match="vocabulary"):
        generate(m, cache_for(m, 1, 40), SpeculativeDecoder(ModelDrafter(small), gamma=2), [[1, 2]], 4)
    with pytest.raises(SetupError, match="min_ngram"):
        generate(m, cache_for(m, 1, 40), SpeculativeDecoder(PromptLookupDrafter(max_ngram=2, min_ngram=0)), [[1]], 4)


def test_cache_with_too_little_rollback_is_refused(tiny_llama):
    from decodelab.cache.dense import DenseCache

    class ShortRollback(DenseCache):
        rollback_limit = 2

    m = tiny_llama.model
    with pytest.raises(SetupError, match="roll back 2 tokens but gamma 4"):
        generate(m, cache_for(m, 1, 40, ShortRollback), SpeculativeDecoder(ModelDrafter(m), gamma=4), [[1, 2]], 4)


def test_tokenizer_mismatch_is_refused(tiny_llama):
    class Tok:
        def __init__(self, v):
            self.v = v

        def vocab(self):
            return self.v

    m = tiny_llama.model
    d = ModelDrafter(m, tokenizer=Tok({"a": 0, "b": 1}), target_tokenizer=Tok({"a": 1, "b": 0}))
    with pytest.raises(SetupError, match="other ids"):
        generate(m, cache_for(m, 1, 40), SpeculativeDecoder(d), [[1, 2]], 4)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_self_draft_is_lossless(tiny_llama, weights):
    from decodelab.decoding.drafters import quantized_self

    m = tiny_llama.model
    prompts = [random_ids(10, seed=8)]
    plain = generate(m, cache_for(m, 1, 60), greedy(), prompts, 12)
    r = generate(m, cache_for(m, 1, 60), SpeculativeDecoder(quantized_self(tiny_llama, weights), gamma=3), prompts, 12)
    assert r.tokens == plain.tokens
    assert r.stats["acceptance_rate"] > 0.5  # a quantized copy mostly agrees with its source


@pytest.fixture
def eager_draft_compile(monkeypatch):
    """Drafters' compiled steps and the compiled verify through dynamo's `eager` backend: the
    same whole-graph trace (a graph break is an error) without inductor's C++ build
    (test_compiled.py runs that). Yields the compiled verifies generate built."""
    import decodelab.decoding.compiled as compiled
    import decodelab.decoding.runner as runner

    monkeypatch.setattr(runner, "BACKEND", "eager")  # every runner's: the target's and the drafters'
    made, real = [], compiled.compiled_verify
    monkeypatch.setattr(compiled, "compiled_verify", lambda *a: made.append(real(*a)) or made[-1])
    return made


# paged and int4: 33 s of the function's 50 in the default run on a 2-core Zen 3 (session 50)
@pytest.mark.parametrize("backend", ["dense", *(pytest.param(b, marks=pytest.mark.slow) for b in ("paged", "int4"))])
def test_compiled_draft_steps_draft_the_same_tokens(tiny, backend, eager_draft_compile):
    """compile=True drafters (quantized self-draft, early exit) on every tiny family: the
    output is the target's greedy output, the drafts are the uncompiled drafter's (the
    same acceptance, round by round), and the compile is reported apart."""
    from functools import partial

    from decodelab.cache.dense import DenseCache
    from decodelab.cache.paged import PagedCache
    from decodelab.decoding.drafters import early_exit, quantized_self
    from decodelab.models.quantize import WeightOptions

    m = tiny.model
    from decodelab.cache.int4 import QuantizedCache

    factory = {"dense": None, "paged": partial(PagedCache, block_size=4),  # int4: a HostPlan's compiled steps
               "int4": partial(QuantizedCache, group_size=32, residual=4)}[backend]
    cache = lambda: cache_for(m, 2, 80) if factory is None else cache_for(m, 2, 80, factory)  # noqa: E731
    prompts = [repetitive_prompt(), random_ids(9, m.cfg.vocab_size, seed=2)]
    plain = generate(m, cache(), greedy(), prompts, 20)
    draft_cache = factory or DenseCache  # the draft caches through the target's backend, as setups build it
    builders = {"early-exit": lambda c: early_exit(tiny, 1, cache=draft_cache, compile=c)}
    if not WeightOptions("int8").problems_for(m.cfg):  # a family whose shapes the int8 kernel takes
        builders["int8-self"] = lambda c: quantized_self(tiny, "int8", cache=draft_cache, compile=c)
    for name, build in builders.items():
        runs = [generate(m, cache(), SpeculativeDecoder(build(c), gamma=3), prompts, 20) for c in (False, True)]
        # the run's compile=True compiles an uncompiled drafter's steps and the verify of gamma + 1
        runs.append(generate(m, cache(), SpeculativeDecoder(build(False), gamma=3), prompts, 20, compile=True))
        assert runs[0].tokens == runs[1].tokens == runs[2].tokens == plain.tokens, name
        assert runs[1].stats["acceptance_per_position"] == runs[0].stats["acceptance_per_position"], name
        assert runs[2].stats["acceptance_per_position"] == runs[0].stats["acceptance_per_position"], name
        assert runs[1].compile_s > 0 and runs[2].compile_s > 0 and runs[0].compile_s == 0.0
        verify = eager_draft_compile[-1]  # this run's compiled verify: it verified the full rounds
        assert verify is not None and verify.tokens == 4 and runs[2].compiled_steps > 0


def test_compiled_draft_on_a_cache_without_a_static_view_is_refused(tiny_llama, eager_draft_compile):
    from decodelab.cache.base import KVCache
    from decodelab.cache.dense import DenseCache
    from decodelab.decoding.drafters import quantized_self

    class NoStaticStorage(DenseCache):
        static_view = KVCache.static_view  # declares no fixed-shape storage

    m = tiny_llama.model
    d = quantized_self(tiny_llama, "int8", cache=NoStaticStorage, compile=True)
    with pytest.raises(SetupError, match="draft self-int8: the NoStaticStorage backend cannot give a fixed-shape"):
        generate(m, cache_for(m, 1, 40), SpeculativeDecoder(d, gamma=2), [random_ids(8, seed=3)], 4)
    d = quantized_self(tiny_llama, "int8", cache=NoStaticStorage)  # the run's compile=True compiles it
    with pytest.raises(SetupError, match="draft self-int8: the NoStaticStorage backend"):
        generate(m, cache_for(m, 1, 40), SpeculativeDecoder(d, gamma=2), [random_ids(8, seed=3)], 4, compile=True)
    assert eager_draft_compile == []  # refused before the target's verify compiled


def test_a_draft_cache_of_its_own(tiny_gemma, eager_draft_compile):
    """A draft caching through another backend than the target's (`draft.cache`): a dense,
    compiled draft beside a sliding-window target is still the target's greedy output; a
    draft cache that cannot roll back gamma tokens is refused naming the draft."""
    from functools import partial

    from decodelab.cache.dense import DenseCache
    from decodelab.cache.sliding import SlidingCache
    from decodelab.decoding.drafters import early_exit

    m = tiny_gemma.model
    sliding = partial(SlidingCache, rollback=4)
    prompts = [repetitive_prompt(), random_ids(30, m.cfg.vocab_size, seed=4)]  # past the window of 16
    plain = generate(m, cache_for(m, 2, 90, sliding), greedy(), prompts, 24)
    for compile in (False, True):
        d = early_exit(tiny_gemma, 2, cache=DenseCache, compile=compile)
        r = generate(m, cache_for(m, 2, 90, sliding), SpeculativeDecoder(d, gamma=3), prompts, 24)
        assert r.tokens == plain.tokens and type(d.cache) is DenseCache
        assert r.stats["acceptance_rate"] > 0
    short = early_exit(tiny_gemma, 2, cache=partial(SlidingCache, rollback=2))
    with pytest.raises(SetupError, match="draft early-exit-2: its cache SlidingCache can roll back 2 tokens but "
                                         "gamma 3 needs 3; lower gamma or give the draft another cache"):
        generate(m, cache_for(m, 1, 60), SpeculativeDecoder(short, gamma=3), [random_ids(8, seed=3)], 4)


def test_early_exit_layers_are_checked(tiny_llama):
    from decodelab.decoding.drafters import early_exit

    with pytest.raises(SetupError, match=r"\[1, 1\]"):
        early_exit(tiny_llama, layers=2)


def test_finished_rows_do_not_grow_or_exceed_rollback(tiny_llama):
    """A row that ended (EOS) is fed as padding: a cache whose rollback equals gamma
    keeps working while the other row goes on."""
    from decodelab.cache.dense import DenseCache

    class ExactRollback(DenseCache):
        rollback_limit = 3

    m = tiny_llama.model
    prompts = [random_ids(8, seed=4), random_ids(12, seed=9)]
    plain = generate(m, cache_for(m, 2, 80), greedy(), prompts, 20)
    eos = plain.tokens[0][2]
    r = generate(m, cache_for(m, 2, 80, ExactRollback), SpeculativeDecoder(ModelDrafter(EarlyExit(m, 1)), gamma=3),
                 prompts, 20, eos_ids=[eos])
    ref = generate(m, cache_for(m, 2, 80), greedy(), prompts, 20, eos_ids=[eos])
    assert r.tokens == ref.tokens and r.finish_reasons[0] == "eos"
