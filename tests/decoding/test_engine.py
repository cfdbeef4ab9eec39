"""The continuous-batching engine: every request's greedy output equals decoding it alone,
under chunked prefill, arrivals, a KV budget small enough to force preemptions and
prefix sharing; nothing lost or duplicated; bad requests are rejected, not crashed on."""

from __future__ import annotations

import functools

import pytest
import torch

from decodelab.cache.dense import DenseCache
from decodelab.cache.int4 import QuantizedCache
from decodelab.cache.paged import PagedCache
from decodelab.cache.sliding import SlidingCache
from decodelab.decoding import Request, generate, greedy, serve
from decodelab.decoding.decoders import SamplingDecoder
from decodelab.decoding.engine import POLICIES, Engine
from decodelab.decoding.runner import ModelRunner
from decodelab.decoding.speculative import SpeculativeDecoder
from decodelab.models.errors import SetupError
from tests.conftest import cache_for, random_ids

LENGTHS = (5, 33, 18, 40, 7, 25, 12, 30)
NEW = 16
# int4 with blocks of 8 tokens and 8 exact ones, so that these short requests quantize
INT4 = functools.partial(QuantizedCache, residual=8, flush=8, group_size=32, key_axis="token", value_axis="token",
                         rollback=0)
# sliding: exact on Gemma's own windows (rings of 16 + 8), full storage on Llama (no windows);
# sliding-imposed: a 12-token window with 2 sinks on every layer (an approximation: compared with itself alone)
SLIDING_IMPOSED = functools.partial(SlidingCache, window=12, sinks=2, rollback=4)
SERVING = {"dense": DenseCache, "paged": functools.partial(PagedCache, block_size=4), "int4": INT4,
           "sliding": SlidingCache, "sliding-imposed": SLIDING_IMPOSED}
OWN_REFERENCE = {"int4": INT4, "sliding-imposed": SLIDING_IMPOSED}  # not exact: each request vs itself alone
ON = {"llama": list(SERVING), "gemma3": [b for b in SERVING if b != "sliding-imposed"]}  # Gemma has windows


@pytest.fixture(scope="module")
def alone(tiny_models):
    """(name, backend) -> (prompts, each prompt's greedy tokens decoded alone by the static
    loop: on dense for the exact backends, on the backend itself for int4 (lossy) and an
    imposed window (an approximation))."""
    out = {}
    for name in ("llama", "gemma3"):
        m = tiny_models[name].model
        prompts = [random_ids(n, m.cfg.vocab_size, seed=n) for n in LENGTHS]
        for b in ON[name]:
            own = OWN_REFERENCE.get(b, DenseCache)
            out[name, b] = (prompts, [generate(m, cache_for(m, 1, 80, own), greedy(), [p], NEW).tokens[0]
                                      for p in prompts])
    return out


def requests(prompts, spread: float = 0.0) -> list[Request]:
    """Half arrive at t = 0, the rest `spread` seconds apart after that."""
    return [Request(p, NEW, arrival_s=0.0 if i < len(prompts) // 2 else spread * i, id=f"r{i}")
            for i, p in enumerate(prompts)]


CASES = ([("llama", b, 6, "decode-first") for b in ON["llama"]]
         + [("gemma3", b, 256, "decode-first") for b in ON["gemma3"]]
         + [(n, "paged", 8, "prefill-first") for n in ("llama", "gemma3")])


@pytest.mark.parametrize("name,backend,token_budget,policy", CASES)
def test_engine_output_equals_each_request_alone(tiny_models, alone, name, backend, token_budget, policy):
    m = tiny_models[name].model
    prompts, expected = alone[name, backend]
    cache = cache_for(m, 3, 80, SERVING[backend])
    r = serve(m, cache, greedy(), requests(prompts, 0.005), token_budget=token_budget, policy=policy)
    assert [x.tokens for x in r.requests] == expected
    assert [x.id for x in r.requests] == [f"r{i}" for i in range(len(prompts))]
    assert all(x.finish_reason == "length" and len(x.token_times) == NEW for x in r.requests)
    assert all(x.ttft_s > 0 and x.queue_s >= 0 for x in r.requests)
    assert max(t["running"] for t in r.timeline) == 3  # the rows were shared, not run one by one
    if token_budget < max(LENGTHS):  # prompts in chunks beside decode rows: shared forwards (`ModelRunner._mixed`)
        assert policy == "prefill-first" or any(t["decode_rows"] and t["prefill_tokens"] for t in r.timeline)
    if policy == "prefill-first":
        assert not any(t["decode_rows"] and t["prefill_tokens"] for t in r.timeline)


@pytest.mark.parametrize("backend", list(SERVING))
def test_a_prefill_only_step_runs_every_chunk_in_one_forward(tiny_models, alone, backend, monkeypatch):
    """prefill-first: a step without decode rows runs its chunks as segments of one forward
    (one read of the weights), a long chunk a segment of its own; outputs unchanged."""
    m = tiny_models["llama"].model
    prompts, expected = alone["llama", backend]
    monkeypatch.setattr(ModelRunner, "OWN_FORWARD", 20)  # chunks of 25-40 tokens: segments of their own
    calls = []
    real = m.forward_segments

    def spy(segments, cache, n_layers=None):
        calls.append([s.ids.shape for s in segments])
        return real(segments, cache, n_layers)

    monkeypatch.setattr(m, "forward_segments", spy)
    cache = cache_for(m, 4, 80, SERVING[backend])
    r = serve(m, cache, greedy(), requests(prompts), token_budget=256, policy="prefill-first")
    assert [x.tokens for x in r.requests] == expected
    assert len(calls) == len(r.timeline)  # one forward per step
    prefill_only = [c for c, t in zip(calls, r.timeline) if t["prefill_tokens"] and not t["decode_rows"]]
    assert any(len(c) >= 3 for c in prefill_only), calls  # two long chunks alone, the short ones together
    assert not any(t["decode_rows"] and t["prefill_tokens"] for t in r.timeline)


@pytest.mark.parametrize("backend", list(SERVING))
def test_forced_preemption_keeps_every_output(tiny_models, alone, backend):
    """A budget of 1.5 rows of 60 tokens: requests are preempted, recomputed, and still
    produce exactly what they produce alone; none is lost or served twice."""
    m = tiny_models["llama"].model
    prompts, expected = alone["llama", backend]
    cache = cache_for(m, 3, 80, SERVING[backend])
    budget_mb = cache.row_bytes(60) * 1.5 / 2**20
    r = serve(m, cache, greedy(), requests(prompts), token_budget=16, kv_budget_mb=budget_mb)
    assert r.preemptions > 0 and sum(x.preemptions for x in r.requests) == r.preemptions
    assert [x.tokens for x in r.requests] == expected
    assert max(t["kv_bytes"] for t in r.timeline) <= r.kv_budget_bytes


def test_a_pool_smaller_than_the_batch_serves_by_preemption(tiny_models, alone):
    """A paged pool of 30 blocks for 4 rows of 80 tokens (the default budget is the pool):
    the engine charges the blocks each request holds, preempts before the pool runs out
    (the pool's own refusal, PoolExhausted, stays a safety net) and every output is kept."""
    m = tiny_models["llama"].model
    prompts, expected = alone["llama", "paged"]
    cache = cache_for(m, 4, 80, functools.partial(PagedCache, block_size=4, num_blocks=30))
    r = serve(m, cache, greedy(), requests(prompts), token_budget=64)
    assert [x.tokens for x in r.requests] == expected
    assert r.preemptions > 0


def test_prefix_sharing_maps_a_common_system_prompt(tiny_models):
    m = tiny_models["llama"].model
    system = random_ids(32, seed=99)
    prompts = [system + random_ids(n, seed=n) for n in (4, 9, 6, 11)]
    expected = [generate(m, cache_for(m, 1, 80), greedy(), [p], 8).tokens[0] for p in prompts]
    cache = cache_for(m, 2, 80, functools.partial(PagedCache, block_size=8))
    r = serve(m, cache, greedy(), [Request(p, 8, arrival_s=0.01 * i) for i, p in enumerate(prompts)],
              token_budget=64)
    assert [x.tokens for x in r.requests] == expected
    assert r.requests[0].prefix_reused == 0 and all(x.prefix_reused == 32 for x in r.requests[1:])


@pytest.mark.parametrize("policy", POLICIES)
def test_a_burst_maps_the_system_prompt_cached_while_it_waited(tiny_models, policy):
    """Requests admitted together while the first still prefills the common system prompt
    (a budget of 16 tokens per step): each maps the blocks cached since, before it
    computes anything."""
    m = tiny_models["llama"].model
    system = random_ids(32, seed=99)
    prompts = [system + random_ids(n, seed=n) for n in (4, 9, 6, 11)]
    expected = [generate(m, cache_for(m, 1, 80), greedy(), [p], 8).tokens[0] for p in prompts]
    cache = cache_for(m, 3, 80, functools.partial(PagedCache, block_size=8))
    r = serve(m, cache, greedy(), [Request(p, 8) for p in prompts], token_budget=16, policy=policy)
    assert [x.tokens for x in r.requests] == expected
    assert r.requests[0].prefix_reused == 0 and all(x.prefix_reused == 32 for x in r.requests[1:])
    assert sum(t["prefill_tokens"] for t in r.timeline) == sum(len(p) for p in prompts) - 3 * 32
    assert cache.prefix_reused_tokens == 3 * 32  # mapped again as more got cached: counted once


def test_chunked_prefill_spreads_a_long_prompt_over_steps(tiny_models):
    m = tiny_models["llama"].model
    reqs = [Request(random_ids(8, seed=1), 30), Request(random_ids(60, seed=2), 4, arrival_s=0.02)]
    cache = cache_for(m, 2, 80)
    chunked = serve(m, cache, greedy(), reqs, token_budget=9)
    whole = serve(m, cache, greedy(), reqs, token_budget=9, chunked_prefill=False)
    assert [x.tokens for x in chunked.requests] == [x.tokens for x in whole.requests]
    # every step stays in its budget, a decoding row taking one token of it (whether the first
    # request still decodes when the second arrives depends on the machine's speed)
    assert all(t["prefill_tokens"] + t["decode_rows"] <= 9 for t in chunked.timeline)
    assert sum(t["prefill_tokens"] > 0 for t in chunked.timeline) >= 1 + 60 // 9  # spread: 60 over >= 7 steps
    assert max(t["prefill_tokens"] for t in whole.timeline) == 60


def test_bad_requests_are_rejected_and_the_rest_served(tiny_models):
    m = tiny_models["llama"].model
    good = random_ids(10)
    reqs = [Request(good, 5), Request(random_ids(100), 5), Request([], 5), Request([1, 300], 5),
            Request(good, 0), Request([1.5, 2], 5), Request(good, 5, arrival_s=0.01)]
    r = serve(m, cache_for(m, 2, 64), greedy(), reqs)
    reasons = [x.finish_reason for x in r.requests]
    assert reasons == ["length", "rejected", "rejected", "rejected", "rejected", "rejected", "length"]
    assert "exceeds a cache row" in r.requests[1].error and "empty" in r.requests[2].error
    assert "outside the vocabulary" in r.requests[3].error and "max_new_tokens" in r.requests[4].error
    assert "not integers" in r.requests[5].error
    assert r.requests[0].tokens == r.requests[6].tokens and all(not x.tokens for x in r.requests[1:6])


def test_a_request_larger_than_the_budget_is_rejected(tiny_models):
    m = tiny_models["llama"].model
    cache = cache_for(m, 2, 64)
    r = serve(m, cache, greedy(), [Request(random_ids(40), 20), Request(random_ids(5), 5)],
              kv_budget_mb=cache.row_bytes(30) / 2**20)
    assert r.requests[0].finish_reason == "rejected" and "whole KV budget" in r.requests[0].error
    assert r.requests[1].finish_reason == "length"


@pytest.mark.parametrize("kw,msg", [(dict(token_budget=0), "token_budget must be an integer >= 1"),
                                    (dict(policy="lifo"), "policy must be one of"),
                                    (dict(kv_budget_mb=-1.0), "kv_budget_mb must be > 0"),
                                    (dict(kv_budget_mb=1e6), "more than the cache can hold")])
def test_bad_engine_options_are_refused(tiny_models, kw, msg):
    m = tiny_models["llama"].model
    with pytest.raises(SetupError, match=msg):
        Engine(m, cache_for(m, 2, 64), greedy(), **kw)


class WholeBatchCache(DenseCache):
    """A backend that declares it cannot serve a subset of its rows."""

    serves_row_subsets = False
    row_subset_reason = "its storage is planned for the whole batch at once"


def test_backends_that_cannot_release_a_row_refuse_with_the_reason(tiny_models):
    m = tiny_models["llama"].model
    with pytest.raises(SetupError, match="cannot serve continuous batching: .*planned for the whole batch"):
        Engine(m, cache_for(m, 2, 64, WholeBatchCache), greedy())
    with pytest.raises(SetupError, match="cannot release one row"):
        cache_for(m, 2, 64, WholeBatchCache).release(0)


def test_every_backend_serves():
    """Every backend of conf/cache declares that it serves continuous batching."""
    from decodelab.cache import backend, backend_names

    for name in backend_names():
        factory = backend(name)
        cls = factory.func if isinstance(factory, functools.partial) else factory
        assert cls.serves_row_subsets, name


def test_a_speculative_decoder_needs_a_cache_that_rolls_back(tiny_models):
    from decodelab.decoding.drafters import prompt_lookup

    m = tiny_models["llama"].model
    with pytest.raises(SetupError, match="roll back"):
        Engine(m, cache_for(m, 2, 64, functools.partial(INT4.func, **{**INT4.keywords, "rollback": 2})),
               SpeculativeDecoder(prompt_lookup(), gamma=4))


def test_sampling_in_the_engine_is_seeded(tiny_models):
    m = tiny_models["llama"].model
    reqs = [Request(random_ids(n, seed=n), 12) for n in (5, 9, 14)]
    a = serve(m, cache_for(m, 3, 64), SamplingDecoder(temperature=1.0, seed=3), reqs)
    b = serve(m, cache_for(m, 3, 64), SamplingDecoder(temperature=1.0, seed=3), reqs)
    assert [x.tokens for x in a.requests] == [x.tokens for x in b.requests]
    assert len({tuple(x.tokens) for x in a.requests}) == 3


@torch.no_grad()
def test_a_forward_over_a_subset_of_rows_equals_the_full_batch(tiny_models):
    """prepare(..., rows=) on dense (consecutive and scattered rows) and paged: the rows
    prefilled alone hold what a whole-batch prefill writes."""
    m = tiny_models["gemma3"].model
    prompts = [random_ids(n, seed=n) for n in (20, 20, 20)]
    ids = torch.tensor(prompts)
    pos = torch.arange(20).expand(3, -1)
    for backend in (SERVING[b] for b in ON["gemma3"]):  # int4 holds these 20 tokens exact and quantized alike
        full = cache_for(m, 3, 40, backend)
        ref = m(ids, pos, full)[:, -1]
        for rows in ([0, 1], [2, 0]):
            c = cache_for(m, 3, 40, backend)
            got = m(ids[rows], pos[rows], c, rows=rows)[:, -1]
            torch.testing.assert_close(got, ref[rows], rtol=0, atol=1e-5)
            assert c.lengths.tolist() == [20 if r in rows else 0 for r in range(3)]


def test_a_shared_prefix_is_charged_once(tiny_models):
    """Paged `held_bytes` counts a block two rows map once; the engine admits by it."""
    m = tiny_models["llama"].model
    c = cache_for(m, 2, 64, functools.partial(PagedCache, block_size=8))
    system = random_ids(32, seed=5)
    prompts = [system + [1, 2, 3], system + [4, 5]]  # 35 and 34 tokens
    generate(m, c, greedy(), prompts, 1)  # registers the prompt blocks
    generate(m, c, greedy(), prompts, 1)  # both rows map the 4 cached blocks of the system prompt
    assert c.held_bytes([0, 1]) == (4 + 1 + 1) * c.block_bytes  # 4 shared blocks, one own block each
    assert c.held_bytes([0]) == 5 * c.block_bytes
    d = cache_for(m, 2, 64)
    d.plan(torch.arange(10).expand(2, -1))
    assert d.held_bytes([0, 1]) == 2 * d.row_bytes(10) == 20 * d.layout.bytes_per_token()


@pytest.mark.parametrize("draft", ["prompt-lookup", "early-exit", "int8-self"])
@pytest.mark.parametrize("backend", ["dense", "paged", "int4", "sliding", "sliding-imposed"])
def test_speculative_in_the_engine_is_token_identical_to_greedy(tiny_models, alone, draft, backend):
    """Greedy speculative decoding inside the engine (arrivals, chunked prefill, a budget
    that preempts), with every kind of drafter (the int8 self-draft included) on every
    backend that holds sequences: every request's output is the target's greedy output
    alone (int4: its own, decoded alone)."""
    from decodelab.decoding.drafters import early_exit, prompt_lookup, quantized_self

    lm = tiny_models["llama"]
    prompts, expected = alone["llama", backend]
    # int4 keeps exact copies for a rollback of gamma (the visibility rule, so the reference, is unchanged)
    factory = functools.partial(INT4, rollback=3) if backend == "int4" else SERVING[backend]
    drafter = {"prompt-lookup": lambda: prompt_lookup(), "early-exit": lambda: early_exit(lm, 1, cache=factory),
               "int8-self": lambda: quantized_self(lm, "int8", cache=factory)}[draft]()
    decoder = SpeculativeDecoder(drafter, gamma=3)
    cache = cache_for(lm.model, 3, 80, factory)
    # room for about 1.3 rows of 60 tokens, target and draft caches together (an imposed window's
    # rows hold at most 18: room for 1.5 of them)
    row = (lambda n: cache.row_bytes(n) + decoder.row_bytes(n))  # noqa: E731
    budget = row(18) * 1.5 if backend == "sliding-imposed" else row(60) * 1.3
    shared, step = [], decoder.step  # rounds whose verify ran in one forward with other rows' prefill chunks
    decoder.step = lambda runner, *a, **k: shared.append(runner.shared is not None) or step(runner, *a, **k)
    r = serve(lm.model, cache, decoder, requests(prompts, 0.005), token_budget=16, kv_budget_mb=budget / 2**20)
    assert [x.tokens for x in r.requests] == expected
    assert any(shared) and not all(shared)  # some verifies shared their forward with prefill chunks, some ran alone
    assert max(t["kv_bytes"] for t in r.timeline) <= r.kv_budget_bytes  # the draft's bytes within the budget
    assert r.preemptions > 0 and decoder.stats["target_calls"] > 0
    assert decoder.stats["tokens_per_target_call"] > 1.0  # some drafts were accepted


def test_a_draft_models_cache_is_charged_to_the_kv_budget(tiny_models):
    """An early-exit draft caches its own rows: the engine's default budget is both caches'
    capacity, a request's size counts both, and every step's charge includes the draft's."""
    from decodelab.decoding.drafters import early_exit

    lm = tiny_models["llama"]
    cache = cache_for(lm.model, 2, 64)
    decoder = SpeculativeDecoder(early_exit(lm, 1), gamma=3)
    draft_row = decoder.row_bytes(40)
    c = lm.model.cfg  # the draft caches its one layer: 40 tokens x 1 layer x K, V x heads x head_dim x fp32
    assert draft_row == 40 * 1 * 2 * c.n_kv_heads * c.head_dim * 4
    assert Engine(lm.model, cache, decoder).kv_budget == cache.budget_bytes() + 2 * decoder.row_bytes(64)
    assert Engine(lm.model, cache, greedy()).kv_budget == cache.budget_bytes()
    eng = Engine(lm.model, cache, decoder, kv_budget_mb=(cache.row_bytes(40) + draft_row / 2) / 2**20)
    r = eng.run([Request(random_ids(30, seed=1), 6)])  # 30 + 6 + the lookahead: more than the budget
    assert r.requests[0].finish_reason == "rejected" and "a draft's included" in r.requests[0].error
    r = serve(lm.model, cache_for(lm.model, 2, 64), decoder, [Request(random_ids(20, seed=2), 8)])
    held = max(t["kv_bytes"] for t in r.timeline)  # after a step: the prompt and its first tokens, in both caches
    assert r.requests[0].tokens and held >= cache.row_bytes(21) + decoder.row_bytes(21)


def test_a_draft_budget_never_lets_the_target_pool_run_out(tiny_models):
    """A dense draft beside a small paged pool: the default budget (both caches) is larger
    than the pool, but each step still fits the pool itself (the engine preempts for it
    instead of running the pool dry inside a speculative round); the outputs stay greedy's."""
    from decodelab.decoding.drafters import early_exit

    lm = tiny_models["llama"]
    m = lm.model
    prompts = [random_ids(40, seed=i) for i in range(4)]
    cache = cache_for(m, 4, 80, functools.partial(PagedCache, block_size=4, num_blocks=40))
    r = serve(m, cache, SpeculativeDecoder(early_exit(lm, 1, cache=DenseCache), gamma=3),
              [Request(p, 30) for p in prompts])
    assert [x.tokens for x in r.requests] == [generate(m, cache_for(m, 1, 80), greedy(), [p], 30).tokens[0]
                                              for p in prompts]
    assert r.preemptions > 0


def test_a_prefilling_requests_draft_rows_are_charged_once(tiny_models):
    """A draft model prefills an admitted request's whole prompt at once: while the target
    still prefills it, the charge is the target's reserve plus what the draft holds."""
    from decodelab.decoding.drafters import early_exit

    lm = tiny_models["llama"]
    cache = cache_for(lm.model, 2, 64)
    decoder = SpeculativeDecoder(early_exit(lm, 1), gamma=3)
    eng = Engine(lm.model, cache, decoder)
    eng.run([])  # begins the decoder
    eng.waiting, eng.running, eng._order = __import__("collections").deque([0]), {}, 0
    req = Request(random_ids(40, seed=3), 4)
    from decodelab.decoding.engine import RequestResult

    eng._admit([req], [RequestResult(0, 40, 0.0)], lambda: 0.0)
    assert eng._used() == cache.row_bytes(41) + decoder.row_bytes(40)


def test_speculative_rows_near_capacity_are_released_with_their_request(tiny_models):
    """A draft model whose every draft is accepted (the target itself): a finished
    request's draft row is emptied with it, so the idle row never runs past the capacity."""
    from decodelab.decoding.drafters import ModelDrafter

    m = tiny_models["llama"].model
    decoder = SpeculativeDecoder(ModelDrafter(m), gamma=4)
    r = serve(m, cache_for(m, 2, 42), decoder, [Request(random_ids(20, seed=1), 17), Request(random_ids(5), 32)])
    assert [len(x.tokens) for x in r.requests] == [17, 32]
    expected = [generate(m, cache_for(m, 1, 42), greedy(), [x], n).tokens[0]
                for x, n in ((random_ids(20, seed=1), 17), (random_ids(5), 32))]
    assert [x.tokens for x in r.requests] == expected


@pytest.mark.slow  # 11.5 s in the default run on a 2-core Zen 3 (session 50)
@pytest.mark.parametrize("name,backend", [("llama", b) for b in ON["llama"]] + [("gemma3", "sliding")])
@pytest.mark.parametrize("flat", [False, True])
def test_a_compiled_engine_serves_the_same_tokens(tiny_models, alone, name, backend, flat, monkeypatch):
    """compile=True: a decode step in which every cache row decodes runs through the compiled
    static step; every other forward (some rows decode, prefill chunks, both) eagerly, or,
    with compile_flat=True, through the compiled runner's flat token batches
    (decoding/runner.py); every request's tokens are its greedy tokens alone, as the eager
    engine gives them, on every backend (int4: its host plan). Here through dynamo's `eager`
    backend (test_compiled.py and test_runner.py run inductor)."""
    eager_backend(monkeypatch)
    m = tiny_models[name].model
    prompts, expected = alone[name, backend]
    cache = cache_for(m, 3, 80, SERVING[backend])
    r = serve(m, cache, greedy(), requests(prompts, 0.005), token_budget=16, compile=True, compile_flat=flat)
    assert [x.tokens for x in r.requests] == expected
    assert 0 < r.compiled_steps < r.steps and r.compile_s > 0
    if flat:
        assert r.compiled_steps + r.flat_forwards == r.steps  # every forward compiled: static or flat
    else:
        assert r.flat_forwards == 0


def eager_backend(monkeypatch) -> None:
    """The engine's compiled steps, the drafters' and the runner's through dynamo's `eager`
    backend (no inductor compile: seconds, not minutes)."""
    import decodelab.decoding.runner as runner

    monkeypatch.setattr(runner, "BACKEND", "eager")


@pytest.mark.slow  # 8.8 s in the default run on a 2-core Zen 3 (session 50)
@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("draft", ["prompt-lookup", "int8-self"])
@pytest.mark.parametrize("backend", ["dense", "paged", "int4", "sliding", "sliding-imposed"])
def test_a_compiled_engine_serves_speculative_requests_as_alone(tiny_models, alone, draft, backend, flat,
                                                                monkeypatch):
    """compile=True with a speculative decoder of a fixed gamma: a round in which every row
    verifies (and no prefill chunk shares the forward) verifies through the compiled step of
    gamma + 1 tokens (`compiled_verify`), the int8 self-draft drafts through its compiled
    one-token step; every request's output is still its greedy output alone, on every
    backend. With compile_flat, every other verify (some rows, beside prefill chunks, a shorter
    last round) runs through the compiled runner's flat batches. Through dynamo's `eager`
    backend."""
    from decodelab.decoding.drafters import prompt_lookup, quantized_self

    eager_backend(monkeypatch)
    lm = tiny_models["llama"]
    prompts, expected = alone["llama", backend]
    factory = functools.partial(INT4, rollback=3) if backend == "int4" else SERVING[backend]
    drafter = prompt_lookup() if draft == "prompt-lookup" else quantized_self(lm, "int8", cache=factory)
    decoder = SpeculativeDecoder(drafter, gamma=3)
    assert decoder.verify_tokens == 4
    r = serve(lm.model, cache_for(lm.model, 3, 80, factory), decoder, requests(prompts, 0.005), token_budget=16,
              compile=True, compile_flat=flat)
    assert [x.tokens for x in r.requests] == expected
    assert 0 < r.compiled_steps < decoder.stats["target_calls"] and r.compile_s > 0  # some verifies compiled
    if flat:
        assert r.flat_forwards > 0 and r.compiled_steps + r.flat_forwards == r.steps  # and all the others flat
    else:
        assert r.flat_forwards == 0
    if draft == "int8-self":
        assert drafter.runner.static is not None  # the draft's one-token steps compiled too


@pytest.mark.parametrize("mode", ["eager", "compile", "compile_flat"])
@pytest.mark.parametrize("backend", list(SERVING))
def test_tree_decoding_in_the_engine_serves_each_request_as_alone(tiny_models, alone, backend, mode, monkeypatch):
    """The tree decoder (prompt lookup, width 2, depth 3) serving arrivals with chunked
    prefill: a step's chunks run in a forward of their own just before the tree's verify;
    every request's output is its greedy output alone, on every backend. compile=True
    alone leaves the trees eager (they have no static step); with compile_flat they verify
    through the runner's flat graphs (their plans booked by the runner, `tree`), the other
    forwards too. Through dynamo's `eager` backend."""
    from decodelab.decoding.drafters import prompt_lookup
    from decodelab.decoding.tree_speculative import TreeSpeculativeDecoder

    if mode != "eager":
        eager_backend(monkeypatch)
    m = tiny_models["llama"].model
    prompts, expected = alone["llama", backend]
    decoder = TreeSpeculativeDecoder(prompt_lookup(), depth=3, width=2)
    factory = SERVING[backend]
    if backend in ("int4", "sliding-imposed"):  # exact copies for a rollback of the tree's nodes
        factory = functools.partial(factory, rollback=decoder.rollback_needed)
    chunked, flat_trees = [], []  # steps whose chunks ran beside a tree round; trees through the flat graphs
    mixed, forward = ModelRunner._mixed, ModelRunner.forward_segments
    monkeypatch.setattr(ModelRunner, "_mixed", lambda self, step, dec: chunked.append(not step.decode) or
                        mixed(self, step, dec))
    monkeypatch.setattr(ModelRunner, "forward_segments", lambda self, segments, plans=None: flat_trees.append(
        plans is not None) or forward(self, segments, plans))
    r = serve(m, cache_for(m, 3, 80, factory), decoder, requests(prompts, 0.005), token_budget=16,
              compile=mode != "eager", compile_flat=mode == "compile_flat")
    assert [x.tokens for x in r.requests] == expected
    assert decoder.stats["acceptance_rate"] > 0 and any(chunked)  # drafts were kept; chunks ran beside tree rounds
    trees = sum(flat_trees)  # tree verifies through the flat graphs
    assert {"eager": r.flat_forwards == trees == 0, "compile": r.flat_forwards == trees == 0,
            "compile_flat": r.flat_forwards > trees > 0}[mode]


def test_compile_in_the_engine_is_refused_where_it_cannot_run(tiny_models):
    m = tiny_models["llama"].model
    from decodelab.decoding.drafters import prompt_lookup

    with pytest.raises(SetupError, match="compile=True in the engine compiles steps of a fixed number of tokens; "
                                         "SpeculativeDecoder.*adaptive=True"):
        Engine(m, cache_for(m, 2, 64), SpeculativeDecoder(prompt_lookup(), gamma=2, adaptive=True), compile=True)
    with pytest.raises(SetupError, match="compile must be true or false, got 'yes'"):
        Engine(m, cache_for(m, 2, 64), greedy(), compile="yes")
    with pytest.raises(SetupError, match=r"compile_flat must .* only with compile=True .* got True \(compile=False\)"):
        Engine(m, cache_for(m, 2, 64), greedy(), compile_flat=True)


def test_a_failed_compile_is_tried_again_on_the_next_run(tiny_models, alone, monkeypatch):
    """The engine keeps its runner only once every compile succeeded: a run whose compile
    failed leaves none, and the next run compiles (and serves compiled)."""
    import decodelab.decoding.compiled as compiled

    eager_backend(monkeypatch)
    works, calls = compiled.compiled_step, []

    def fails_once(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("interrupted compile")
        return works(*a, **k)

    monkeypatch.setattr(compiled, "compiled_step", fails_once)
    m = tiny_models["llama"].model
    prompts, expected = alone["llama", "dense"]
    engine = Engine(m, cache_for(m, 3, 80), greedy(), token_budget=16, compile=True)
    with pytest.raises(RuntimeError, match="interrupted compile"):
        engine.run(requests(prompts, 0.005))
    r = engine.run(requests(prompts, 0.005))
    assert [x.tokens for x in r.requests] == expected and r.compiled_steps > 0 and len(calls) == 2
