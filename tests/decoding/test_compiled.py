"""The static decode step (decoding/compiled.py) against the plain decode step: same
greedy tokens and logits on the CPU, for dense, paged, sliding and int4 caches, in eager
mode and through torch.compile (backend=eager, and inductor). The CUDA-graph mode runs in experiments/gpu_check."""

from __future__ import annotations

import sys
from functools import partial

import pytest
import torch

from decodelab.cache.base import KVCache
from decodelab.cache.dense import DenseCache
from decodelab.cache.int4 import QuantizedCache
from decodelab.cache.paged import PagedCache
from decodelab.cache.sliding import SlidingCache
from decodelab.decoding import SamplingDecoder, generate, greedy, prefill
from decodelab.cache.kernels.paged import dense_as_pool
from decodelab.decoding.compiled import StaticDecoder, greedy_decode
from decodelab.models.errors import SetupError
from tests.conftest import cache_for, random_ids

PROMPTS = [random_ids(11, seed=1), random_ids(5, seed=2)]


@torch.no_grad()
def plain(model, cache, n: int):
    """Logits [B, n, V] of n plain greedy steps after the prefill."""
    last, out = prefill(model, cache, PROMPTS).argmax(-1), []
    for _ in range(n):
        logits = model(last[:, None], cache.lengths[:, None], cache)[:, -1]
        out.append(logits)
        last = logits.argmax(-1)
    return torch.stack(out, 1)


@torch.no_grad()
def static(model, cache, n: int, **kw):
    first = prefill(model, cache, PROMPTS).argmax(-1)
    dec, out = StaticDecoder(model, cache, **kw), []
    greedy_decode(lambda last: out.append(dec.step(last).clone()) or out[-1], first, n)
    return torch.stack(out, 1)


# sliding: a 6-token window with 2 sinks imposed on every layer, so that the rings wrap
FACTORIES = {"dense": None, "paged": partial(PagedCache, block_size=4),
             "sliding": partial(SlidingCache, window=6, sinks=2, rollback=3)}


@pytest.mark.parametrize("backend", list(FACTORIES))
@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_static_step_matches_plain_step(tiny_llama, backend, mode):
    model = tiny_llama.model
    factory = FACTORIES[backend]
    make = (lambda: cache_for(model, 2, 40)) if factory is None else (lambda: cache_for(model, 2, 40, factory))
    want = plain(model, make(), 8)
    kw = dict(mode=mode, backend="eager") if mode == "compile" else dict(mode=mode)
    got = static(model, make(), 8, **kw)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert (got - want).abs().max().item() < 1e-4


def test_a_step_compiled_before_the_first_forward_does_not_compile_again(monkeypatch):
    """A fresh model (its memos empty) compiled first, then prefilled eagerly (which fills
    them), then stepped with every guard evaluated: no second compile on the first real
    step (it would land in the first request's decode time instead of the compile time
    reported apart)."""
    from decodelab.decoding import compiled
    from decodelab.decoding.compiled import compiled_step

    monkeypatch.setattr(compiled, "SKIP_GUARD_EVAL", False)
    from decodelab.models.loading import random_model
    from tests.conftest import TINY

    model = random_model(TINY["llama"], seed=3, device="cpu").model  # fresh: nothing memoized yet
    cache = cache_for(model, 1, 40)
    dec = compiled_step(model, cache, backend="eager")
    first = prefill(model, cache, PROMPTS[:1]).argmax(-1)
    with torch._dynamo.config.patch(error_on_recompile=True):
        greedy_decode(dec.step, first, 3)


def test_compiled_steps_of_two_models_interleaved_stay_apart():
    """Compiled steps of one code object (two models, two capacities, and a second cache of
    the first model's shape) called in turn after their first (fully guarded) calls: each
    gives its own model's eager logits from its own cache, so the reduced guard evaluation
    of later calls still picks the right graph and reads the right tensors."""
    from decodelab.decoding.compiled import compiled_step
    from decodelab.models.loading import random_model
    from tests.conftest import TINY

    first, second = (random_model(TINY["llama"], seed=s, device="cpu").model for s in (5, 6))
    models, caps = [first, second, first], [40, 48, 40]
    want = [plain(m, cache_for(m, 2, c), 6) for m, c in zip(models, caps)]
    caches = [cache_for(m, 2, c) for m, c in zip(models, caps)]
    decs = [compiled_step(m, c, backend="eager") for m, c in zip(models, caches)]
    last = [prefill(m, c, PROMPTS).argmax(-1) for m, c in zip(models, caches)]
    got = [[], [], []]
    for _ in range(6):
        for i in (1, 0, 2):
            logits = decs[i].step(last[i]).clone()
            got[i].append(logits)
            last[i] = logits.argmax(-1)
    for i in (0, 1, 2):
        assert (torch.stack(got[i], 1) - want[i]).abs().max().item() < 1e-4, i
    assert not torch.allclose(want[0], want[1])  # the two models differ: a mix-up would show
    assert all(d.replay is not None for d in decs)  # later steps replayed their graphs, each its own inputs


def test_compiled_steps_that_differ_only_in_python_state_stay_apart():
    """Early exits after 1 and after 2 layers of one model, over caches of one shape: their
    graphs differ only in a Python int (no tensor shape tells them apart), the case the
    reduced guard evaluation of later calls must still get right."""
    from decodelab.decoding.compiled import compiled_step
    from decodelab.decoding.drafters import EarlyExit
    from decodelab.models.loading import random_model
    from tests.conftest import TINY

    core = random_model(TINY["llama"], seed=7, device="cpu").model
    exits = [EarlyExit(core, 1), EarlyExit(core, 2)]
    want = [plain(e, cache_for(e, 2, 40), 6) for e in exits]
    caches = [cache_for(e, 2, 40) for e in exits]
    decs = [compiled_step(e, c, backend="eager") for e, c in zip(exits, caches)]
    last = [prefill(e, c, PROMPTS).argmax(-1) for e, c in zip(exits, caches)]
    got = [[], []]
    for _ in range(6):
        for i in (1, 0):
            logits = decs[i].step(last[i]).clone()
            got[i].append(logits)
            last[i] = logits.argmax(-1)
    for i in (0, 1):
        assert (torch.stack(got[i], 1) - want[i]).abs().max().item() < 1e-4, i
    assert not torch.allclose(want[0], want[1])
    assert all(d.replay is not None for d in decs)


@pytest.mark.parametrize("backend", ["dense", "paged"])
def test_a_replayed_step_equals_the_step_through_dynamo(monkeypatch, backend):
    """After its first (guarded) call a compiled CPU step calls its graph directly on the
    inputs dynamo handed it: bit-identical logits to every step through dynamo with every
    guard evaluated (SKIP_GUARD_EVAL off), on a dense and a paged cache. A stance the
    caller sets (force_eager) is kept: the replay is not used under it."""
    from decodelab.decoding import compiled
    from decodelab.decoding.compiled import compiled_step
    from decodelab.models.loading import random_model
    from tests.conftest import TINY

    model = random_model(TINY["llama"], seed=8, device="cpu").model
    factory = None if backend == "dense" else partial(PagedCache, block_size=4)

    def run(skip: bool):
        monkeypatch.setattr(compiled, "SKIP_GUARD_EVAL", skip)
        # capacity 44: shapes no other test compiles with inductor (each would reuse the other's graph)
        cache = cache_for(model, 2, 44) if factory is None else cache_for(model, 2, 44, factory)
        dec = compiled_step(model, cache, backend="inductor")
        out = []
        greedy_decode(lambda last: out.append(dec.step(last).clone()) or out[-1],
                      prefill(model, cache, PROMPTS).argmax(-1), 6)
        return dec, torch.stack(out, 1)

    guarded, want = run(False)
    replayed, got = run(True)
    assert guarded.replay is None and replayed.replay is not None
    assert torch.equal(got, want)
    replayed.replay = (lambda *inputs: pytest.fail("replayed under force_eager"), ())
    with torch.compiler.set_stance("force_eager"):
        replayed.step(got[:, -1].argmax(-1))


def test_dense_as_pool_addresses_each_rows_positions():
    t = torch.randn(3, 2, 16, 4)  # [B, Hkv, S, D]
    pool, table = dense_as_pool(t, 4)  # [Hkv, N, 4, D], [B, 4]
    for b, h, p in ((2, 1, 13), (0, 0, 0), (2, 1, 15), (1, 0, 6)):
        assert torch.equal(pool[h, table[b, p // 4], p % 4], t[b, h, p])


# int4 with a 4-token residual and 32-token blocks: both rows quantize a block mid-decode
INT4 = partial(QuantizedCache, group_size=32, residual=4)
INT4_PROMPTS = [random_ids(30, seed=7), random_ids(20, seed=8)]


@pytest.mark.parametrize("mode", ["eager", "compile"])
@pytest.mark.parametrize("same_length", [False, True])
@torch.no_grad()
def test_static_int4_step_is_the_eager_int4_step(tiny_llama, mode, same_length, monkeypatch):
    """int4's compiled step (a `HostPlan`: the model traced, each layer's int4 attention one
    opaque host call, its host work done for every layer when the step is booked): the same
    tokens and logits as plain int4 decode steps, across a block quantized mid-decode in
    both rows; rows of one length take the integer decode plan, as every step of the
    static path books its layers ahead."""
    used = {"booked": 0, "one_token": 0}

    def counted(name, fn):
        def wrapper(*a, **k):
            out = fn(*a, **k)
            used[name] += out is not None
            return out
        return wrapper

    monkeypatch.setattr(QuantizedCache, "booked_layers", counted("booked", QuantizedCache.booked_layers))
    monkeypatch.setattr(QuantizedCache, "_one_token_plan", counted("one_token", QuantizedCache._one_token_plan))
    from decodelab.cache.kernels.int4 import NativeLayerCall

    python_calls = []  # the native layers run in decodelab::int4_host_attend, never through Python
    monkeypatch.setattr(NativeLayerCall, "__call__", lambda self, q, k, v: python_calls.append(1))
    model = tiny_llama.model
    prompts = [INT4_PROMPTS[0], random_ids(30, seed=8)] if same_length else INT4_PROMPTS
    runs = []
    for static_step in (False, True):
        cache = cache_for(model, 2, 96, INT4)
        last, out = prefill(model, cache, prompts).argmax(-1), []
        kw = dict(mode=mode, backend="eager") if mode == "compile" else dict(mode=mode)
        step = StaticDecoder(model, cache, **kw).step if static_step else (
            lambda t: model(t[:, None], cache.lengths[:, None], cache)[:, -1])
        for _ in range(24):
            logits = step(last).clone()
            out.append(logits)
            last = logits.argmax(-1)
        assert cache.quantized_len.tolist() == [32, 32]  # a block was quantized during the decode
        runs.append(torch.stack(out, 1))
    assert used["booked"] == 24 and not python_calls  # every static step; its native layers in C++
    # eager and static steps once a block is quantized (positions 35 on; before, nothing to dequantize)
    assert used["one_token"] == (2 * (24 - 5) if same_length else 0)
    assert torch.equal(runs[0].argmax(-1), runs[1].argmax(-1))
    assert (runs[0] - runs[1]).abs().max().item() < 1e-4


def test_unsupported_caches_and_modes_are_refused(tiny_llama, tiny_gemma):
    """The cache's own refusal (its `static_plan`), not a list of types, says why."""
    model = tiny_llama.model
    with pytest.raises(SetupError, match="NoStaticStorage backend cannot give a fixed-shape view .* declares no fixed"):
        StaticDecoder(model, cache_for(model, 1, 32, NoStaticStorage), mode="eager")
    gemma = tiny_gemma.model  # windowed layers: sliding keeps rings of window + rollback (2) slots
    with pytest.raises(SetupError, match="SlidingCache backend cannot run a compiled step of 4 tokens .* >= 3"):
        StaticDecoder(gemma, cache_for(gemma, 1, 32, partial(SlidingCache, rollback=2)), mode="eager", tokens=4)
    with pytest.raises(SetupError, match="CUDA"):
        StaticDecoder(model, cache_for(model, 1, 32), mode="graph")
    with pytest.raises(SetupError) as e:  # every reason at once
        StaticDecoder(model, cache_for(model, 1, 32, NoStaticStorage), mode="fast")
    assert len(e.value.reasons) == 2


class NoStaticStorage(DenseCache):
    """A backend that declares no fixed-shape storage (the base class's refusal)."""

    static_view = KVCache.static_view


# -- generate(compile=True) -------------------------------------------------------------------------
def _gen(model, factory, decoder, compile, prompts=PROMPTS, n=10, capacity=40):
    cache = cache_for(model, len(prompts), capacity) if factory is None else cache_for(model, len(prompts), capacity,
                                                                                       factory)
    return generate(model, cache, decoder, prompts, n, compile=compile)


@pytest.fixture
def eager_backend(monkeypatch):
    """generate's compiled step through dynamo's `eager` backend: the same whole-graph
    trace (a graph break is an error) without inductor's C++ build, for speed."""
    import decodelab.decoding.runner as runner

    monkeypatch.setattr(runner, "BACKEND", "eager")


@pytest.mark.parametrize("backend", ["dense", "paged", "sliding", "int4"])
def test_generate_compiled_equals_eager_every_family(tiny, backend, eager_backend):
    """Greedy and seeded sampling: token-identical with and without compile=True, on
    every tiny family (Gemma 3's windowed layers included: the dense buffers are masked
    by each layer's window; sliding keeps rings for them, and plain storage elsewhere)."""
    model = tiny.model
    factory = {"dense": None, "paged": partial(PagedCache, block_size=4), "sliding": SlidingCache,
               "int4": INT4}[backend]
    for make in (lambda: SamplingDecoder(temperature=0.0), lambda: SamplingDecoder(temperature=0.8, top_k=20, seed=3)):
        want = _gen(model, factory, make(), False)
        got = _gen(model, factory, make(), True)
        assert got.tokens == want.tokens
        assert got.compile_s > 0 and want.compile_s == 0.0
        assert got.summary()["compile_s"] == got.compile_s


def test_static_verify_step_matches_the_model_forward(tiny_llama):
    """A 4-token static step (`tokens=4`, the shape of a speculative verify) gives the
    logits of the model's own 4-token forward after the same prompt (causal within the
    new tokens), and stores the K/V the next step reads."""
    model = tiny_llama.model
    ids = torch.tensor([random_ids(4, seed=5), random_ids(4, seed=6)])
    want_cache, got_cache = cache_for(model, 2, 40), cache_for(model, 2, 40)
    prefill(model, want_cache, PROMPTS)
    want = model(ids, want_cache.lengths[:, None] + torch.arange(4), want_cache)
    prefill(model, got_cache, PROMPTS)
    got = StaticDecoder(model, got_cache, mode="eager", tokens=4).step(ids)
    assert (got - want).abs().max().item() < 1e-4
    assert torch.equal(got_cache.lengths, want_cache.lengths)
    nxt = torch.tensor([[3], [4]])
    a = model(nxt, want_cache.lengths[:, None], want_cache)
    b = model(nxt, got_cache.lengths[:, None], got_cache)
    assert (a - b).abs().max().item() < 1e-4


@pytest.mark.parametrize("backend", [*FACTORIES, "int4"])
def test_generate_compiled_with_inductor(tiny_llama, backend):
    """The real thing: inductor's CPU code, equal to the eager loop token for token, and a
    second generate of the same shapes reuses the compiled step (no new compile). int4:
    prompts long enough that a block is quantized while decoding."""
    model = tiny_llama.model
    factory, prompts = (INT4, INT4_PROMPTS) if backend == "int4" else (FACTORIES[backend], PROMPTS)
    want = _gen(model, factory, greedy(), False, prompts, n=12, capacity=64)
    first = _gen(model, factory, greedy(), True, prompts, n=12, capacity=64)
    again = _gen(model, factory, greedy(), True, prompts, n=12, capacity=64)
    assert first.tokens == want.tokens == again.tokens
    assert again.compile_s < first.compile_s / 5


def test_a_compiled_verify_through_inductor_equals_the_eager_one(tiny_llama, monkeypatch):
    """The real thing for a speculative verify: gamma + 1 = 4 tokens per row through
    inductor's CPU code (oneDNN's products as opaque calls, no size checks of their outputs),
    prompt lookup so that nothing else compiles; the tokens and acceptance equal the eager
    verify's, and full rounds did run compiled."""
    from decodelab.decoding.drafters import prompt_lookup
    from decodelab.decoding.speculative import SpeculativeDecoder

    import decodelab.decoding.compiled as compiled

    made, real = [], compiled.compiled_verify
    monkeypatch.setattr(compiled, "compiled_verify", lambda *a: made.append(real(*a)) or made[-1])
    model = tiny_llama.model
    prompts = [random_ids(6, seed=4) * 3, random_ids(9, seed=5)]  # a repetitive row: lookups that hit
    runs = [_gen(model, None, SpeculativeDecoder(prompt_lookup(), gamma=3), c, prompts, n=16, capacity=64)
            for c in (False, True)]
    assert runs[1].tokens == runs[0].tokens
    assert runs[1].stats["acceptance_per_position"] == runs[0].stats["acceptance_per_position"]
    assert made[-1].tokens == 4 and runs[1].compiled_steps > 0 and runs[1].compile_s > 0
    assert runs[0].compiled_steps == 0


def test_generate_compile_refusals(tiny_llama):
    """compile=True with a cache that has no fixed-shape plan, or a decoder that declares
    no step that compiles: refused before any forward, the fix named. A speculative
    decoder verifies eagerly where its target cache plans no compiled step, so that cache
    need not compile: prompt lookup (no model step to compile) on such a cache runs,
    token-identical to compile=False, and nothing is compiled."""
    from decodelab.decoding.drafters import PromptLookupDrafter
    from decodelab.decoding.speculative import SpeculativeDecoder

    model = tiny_llama.model
    int4 = NoStaticStorage
    cache = cache_for(model, 2, 40, int4)
    with pytest.raises(SetupError, match="compile=true: the NoStaticStorage backend cannot"):
        generate(model, cache, greedy(), PROMPTS, 4, compile=True)
    assert int(cache.lengths.max()) == 0  # nothing ran

    class OwnDecoder(SamplingDecoder):
        takes_compiled_step = False

    with pytest.raises(SetupError, match="OwnDecoder declares no step that compiles"):
        generate(model, cache_for(model, 2, 40), OwnDecoder(), PROMPTS, 4, compile=True)
    runs = [generate(model, cache_for(model, 2, 40, int4), SpeculativeDecoder(PromptLookupDrafter(), gamma=2),
                     PROMPTS, 8, compile=c) for c in (False, True)]
    assert runs[0].tokens == runs[1].tokens and runs[1].compile_s == 0.0


def test_compiled_capacity_rounds_only_where_the_rounded_cache_fits(tiny_llama):
    """A fixed paged pool that holds what the request needs but not the rounded capacity
    keeps the capacity the request needs (no refusal a compile-free run would not meet)."""
    from decodelab.decoding.text import compiled_capacity

    model = tiny_llama.model
    assert compiled_capacity(model, 1, 30) == 256
    small_pool = partial(PagedCache, block_size=4, num_blocks=10)  # 40 positions
    assert compiled_capacity(model, 1, 30, small_pool) == 30
    assert compiled_capacity(model, 1, 30, partial(PagedCache, block_size=4, num_blocks=64)) == 256


def test_static_capacity_rounds_up_within_the_model():
    from decodelab.decoding.compiled import static_capacity

    assert static_capacity(100, 8192) == 256
    assert static_capacity(256, 8192) == 256
    assert static_capacity(257, 8192) == 512
    assert static_capacity(300, 400) == 400  # never past the model's context
    assert static_capacity(450, 400) == 450  # (a request past it is refused elsewhere)


@pytest.mark.skipif(__import__("decodelab.models.native", fromlist=["problem"]).problem() is not None,
                    reason="native kernels unavailable here")
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_native_quantized_weights_compile_as_opaque_ops(tiny_llama, weights):
    """The native kernels are torch operators (decodelab::int8_mm / int4_mm) with fake
    impls: a compiled step calls them as opaque ops. The inductor step is one graph (a
    graph break is an error) and equals the eager loop token for token, at batch 1 and at
    a batch of more rows than the eager forward sends to the kernels (which a compiled
    step still sends to them; int8, whose kernel computes what the dequantized product does)."""
    from decodelab.models.quantize import WeightOptions

    # (fp32 many-row products: the eager 33-row steps must compute what the kernel does)
    opts = WeightOptions(weights, quantize_head=True, kernel="native", prefill_dtype="float32")
    model = opts.apply(tiny_llama.model)
    assert model.weight_quantization["kernels"] == [f"native-{weights}"]
    want = _gen(model, None, greedy(), False, n=12)
    got = _gen(model, None, greedy(), True, n=12)
    assert got.tokens == want.tokens and got.compile_s > 0
    if weights == "int8":  # (int4's kernel quantizes activations, its eager prefill-sized path does not)
        many = [random_ids(5 + i % 7, seed=10 + i) for i in range(33)]  # 33 rows > the kernel's 32
        want = _gen(model, None, greedy(), False, prompts=many, n=4)
        got = _gen(model, None, greedy(), True, prompts=many, n=4)
        assert got.tokens == want.tokens


@pytest.mark.skipif(__import__("decodelab.models.native", fromlist=["problem"]).problem() is not None,
                    reason="native kernels unavailable here")
@pytest.mark.parametrize("family,head", [("llama", False), ("llama", True), ("gemma", True)])
def test_int4_weights_compile_to_the_eager_bits(request, family, head):
    """int4 weights on the native kernel quantize their activations, so a last-bit
    difference before a product changes its codes: such a model shares its kernels
    (`Transformer.share_kernels`: norms, RoPE angles, dense decode attention) and its
    inductor-compiled step gives the eager step's logits to the bit, step after step (without
    sharing they differ: experiments/results/roofline-s47/README.md)."""
    from decodelab.models.quantize import WeightOptions

    tiny = request.getfixturevalue(f"tiny_{family}")
    model = WeightOptions("int4", quantize_head=head, kernel="native").apply(tiny.model)
    assert model.shared_kernels and model.weight_quantization["shared_kernels"]
    assert cache_for(model, 2, 40).layout.native_decode
    want = plain(model, cache_for(model, 2, 40), 10)
    cache = cache_for(model, 2, 40)
    first = prefill(model, cache, PROMPTS).argmax(-1)
    dec, out = StaticDecoder(model, cache, mode="compile"), []
    greedy_decode(lambda last: out.append(dec.step(last).clone()) or out[-1], first, 10)
    got = torch.stack(out, 1)
    assert dec.guarded and dec.replay is not None  # inductor's graph ran (replayed), not an eager fallback
    assert torch.equal(got, want), (got - want).abs().max().item()
    assert not tiny.model.shared_kernels  # the model it was quantized from keeps torch's norms and SDPA


def test_torchs_private_compile_internals_pass_their_probe():
    """The replay (a compiled CPU step called without dynamo, 15% of an int4 SmolLM2 step)
    rests on torch internals (`torch_private`): on a torch where their probe fails, every
    step goes through dynamo. This test is that failure, said loudly."""
    from decodelab.decoding import compiled

    assert compiled.torch_private() is not None, (
        f"torch {torch.__version__} changed the internals decoding/compiled.py's torch_private uses "
        "(inductor's compile_fx, dynamo's lookup_backend or its stance): compiled steps run through dynamo")


def test_without_torchs_internals_a_step_compiles_through_public_apis(tiny_llama, monkeypatch):
    """Where the probe fails, torch.compile's public options carry the inductor patches and
    every call goes through dynamo: the same tokens as the eager loop, nothing replayed."""
    from decodelab.decoding import compiled

    monkeypatch.setattr(compiled, "torch_private", lambda: None)
    model = tiny_llama.model
    want = plain(model, cache_for(model, 2, 40), 6)
    cache = cache_for(model, 2, 40)
    first = prefill(model, cache, PROMPTS).argmax(-1)
    dec, out = StaticDecoder(model, cache, mode="compile", backend="eager"), []
    greedy_decode(lambda last: out.append(dec.step(last).clone()) or out[-1], first, 6)
    assert dec.private is None and dec.replay is None
    assert torch.equal(torch.stack(out, 1).argmax(-1), want.argmax(-1))


def test_replayable_notes_only_graphs_it_can_replay():
    """The replay wrapper notes a graph (and its inputs) only during a guarded call and only
    where it returns one output from tensor inputs; a graph of two outputs runs through
    dynamo as before, never noted."""
    from decodelab.decoding import compiled

    private = compiled.torch_private()
    x, y = torch.randn(3), torch.randn(3)
    one = torch.compile(lambda: (x * 2 + y).sin(), backend=compiled.replayable("eager", private), fullgraph=True)
    two = torch.compile(lambda: (x * 2, y + 1), backend=compiled.replayable("eager", private), fullgraph=True)
    assert compiled.replayable("eager", private) is compiled.replayable("eager", private)  # dynamo's cache shared
    one(), two()  # compiled, not noted (no guarded call in progress)
    assert compiled._RAN == []
    compiled._NOTING = True
    try:
        want_one, want_two = one(), two()
        ran = list(compiled._RAN)
    finally:
        compiled._NOTING = False
        compiled._RAN.clear()
    assert len(ran) == 1  # the one-output graph only
    graph, inputs = ran[0]
    assert all(isinstance(t, torch.Tensor) for t in inputs)
    assert torch.equal(graph(*inputs)[0], want_one)
    x.add_(1)  # an input updated in place: the replay reads it, as dynamo's call would
    assert torch.equal(graph(*inputs)[0], one())
    assert torch.equal(two()[0], x * 2) and not torch.equal(want_two[0], x * 2)


def test_native_decode_attention_takes_empty_batches():
    from decodelab.models import native

    if native.problem() is not None:
        pytest.skip(f"native kernels: {native.problem()}")
    q, kv = torch.randn(0, 4, 1, 16), torch.randn(0, 2, 8, 16)
    assert native.decode_attention(q, kv, kv, torch.zeros(0, 1, dtype=torch.long), 0.25).shape == (0, 4, 1, 16)


@pytest.mark.parametrize("threads", [1, 3, 8])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("T", [1, 3])
def test_native_decode_attention_equals_masked_attention(threads, window, T):
    """decodelab::decode_attention (models/native.py) against plain masked attention over
    the whole buffer: GQA (4 query heads on 2 kv heads), two rows at different positions
    (one past the buffer's end: clamped), T queries per row each seeing up to itself, with
    and without a window; thread counts that split each row's slots into chunks
    whose softmaxes merge (1 to 4 chunks)."""
    from decodelab.cache.base import reference_attention
    from decodelab.models import native

    if native.problem() is not None:
        pytest.skip(f"native kernels: {native.problem()}")
    g = torch.Generator().manual_seed(T)
    B, Hq, Hkv, S, D = 2, 4, 2, 40, 16
    q, k, v = (torch.randn(*shape, generator=g) for shape in ((B, Hq, T, D), (B, Hkv, S, D), (B, Hkv, S, D)))
    pos = torch.tensor([[30 + t for t in range(T)], [6 + t for t in range(T)]])
    kpos = torch.arange(S)
    seen = kpos <= pos[..., None]  # [B, T, S]
    if window is not None:
        seen &= kpos > pos[..., None] - window
    want = reference_attention(q, k, v, seen[:, None], 0.25)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = native.decode_attention(q.transpose(2, 3).contiguous().transpose(2, 3), k, v, pos, 0.25, window)
        past = native.decode_attention(q[:, :, :1], k, v, torch.tensor([[S + 5], [S - 1]]), 0.25, window)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    last = reference_attention(q[:, :, :1], k, v, (kpos > S - 1 - window if window else kpos >= 0)[None, None, None],
                               0.25)  # row 1 at the last slot sees the window before it, or every slot
    torch.testing.assert_close(past[1], last[1], rtol=1e-5, atol=1e-5)
    if window is None:  # row 0 past the end: every slot (with a window: none of them, zeros)
        torch.testing.assert_close(past[0], last[0], rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(past[0], torch.zeros_like(past[0]))


def _fail_first_steps(monkeypatch, n: int, error):
    """StaticDecoder.step raising `error(folder)` on its first `n` calls (a damaged compile cache)."""
    import os

    calls, real = [], StaticDecoder.step

    def step(self, last):
        calls.append(os.environ["TORCHINDUCTOR_CACHE_DIR"])
        if len(calls) <= n:
            raise error(calls[-1])
        return real(self, last)
    monkeypatch.setattr(StaticDecoder, "step", step)
    return calls


def test_a_damaged_compile_cache_entry_is_named_and_compiled_again_in_a_fresh_folder(
        tiny_llama, tmp_path, monkeypatch, capsys):
    """A zero-byte `.so` in inductor's cache (a compile killed part way) fails the load with an
    ImportError naming it: the folder (ours, under DECODELAB_CACHE) is deleted and the step
    compiled once more, said on stderr; a user's TORCHINDUCTOR_CACHE_DIR is left alone."""
    from decodelab.decoding.compiled import compiled_step, inductor_cache_dir

    monkeypatch.setenv("DECODELAB_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    ours = tmp_path / "inductor"
    assert inductor_cache_dir() == str(ours)
    (ours / "ab").mkdir(parents=True)
    (ours / "ab" / "cab.main.so").write_bytes(b"")
    calls = _fail_first_steps(monkeypatch, 1, lambda d: ImportError(f"{d}/ab/cab.main.so: file too short"))
    cache = cache_for(tiny_llama.model, 1, 32)
    dec = compiled_step(tiny_llama.model, cache, backend="eager")
    err = capsys.readouterr().err
    assert f"torch's compile cache entry {ours}/ab/cab.main.so could not be loaded or rebuilt (ImportError" in err
    assert "deleted the compile cache folder and compiling again in a fresh one" in err
    assert calls == [str(ours), str(ours)] and not (ours / "ab").exists() and dec.step is not None

    user = tmp_path / "mine"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(user))
    (user / "ab").mkdir(parents=True)
    calls = _fail_first_steps(monkeypatch, 1, lambda d: OSError(f"{d}/ab/x.so: invalid ELF header"))
    compiled_step(tiny_llama.model, cache, backend="eager")
    err = capsys.readouterr().err
    assert f"compiling again in decodelab's own folder {ours} (delete {user}, the TORCHINDUCTOR_CACHE_DIR" in err
    assert calls == [str(user), str(ours)] and (user / "ab").is_dir()  # theirs: untouched


def test_a_compile_cache_failing_twice_is_refused_naming_the_folder_and_other_errors_pass(
        tiny_llama, tmp_path, monkeypatch):
    from decodelab.decoding.compiled import compiled_step

    monkeypatch.setenv("DECODELAB_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    cache = cache_for(tiny_llama.model, 1, 32)
    _fail_first_steps(monkeypatch, 2, lambda d: ImportError(f"{d}/q/c.main.so: file too short"))
    with pytest.raises(SetupError, match=rf"failed on {tmp_path}/inductor/q/c\.main\.so in torch's compile cache "
                                         rf"twice.*delete {tmp_path}/inductor \(rm -r"):
        compiled_step(tiny_llama.model, cache, backend="eager")
    _fail_first_steps(monkeypatch, 1, lambda d: ImportError("no module named nothing_here"))
    with pytest.raises(ImportError, match="nothing_here"):  # not the compile cache's: as it is
        compiled_step(tiny_llama.model, cache, backend="eager")


def test_damaged_artifact_reads_the_path_through_dynamos_wrapper():
    from decodelab.decoding.compiled import damaged_artifact

    inner = ImportError("/c/ind/r4/cr4.main.so: file too short")
    try:
        try:
            raise inner
        except ImportError as e:
            raise RuntimeError("backend='compile_noting' raised:\nImportError: ...") from e
    except RuntimeError as outer:
        assert damaged_artifact(outer, "/c/ind/") == ("/c/ind/r4/cr4.main.so", inner)
    assert damaged_artifact(ImportError("/elsewhere/x.so: file too short"), "/c/ind") is None
    assert damaged_artifact(ValueError("/c/ind/x.so"), "/c/ind") is None  # not a load or build error
    assert damaged_artifact(OSError("[Errno 13] Permission denied: '/c/ind/x.so'"), "/c/ind") is None  # not damage
    assert damaged_artifact(OSError("[Errno 28] No space left on device: '/c/ind/x'"), "/c/ind") is None


def test_a_real_compile_error_is_not_taken_for_a_damaged_cache(tmp_path):
    from decodelab.decoding.compiled import damaged_artifact

    class CppCompileError(RuntimeError):
        pass

    err = CppCompileError(f"C++ compile error\nCommand:\ng++ {tmp_path}/ab/c.main.cpp -o {tmp_path}/ab/c.main.so")
    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "k.so").write_bytes(b"\x7fELF")
    assert damaged_artifact(err, str(tmp_path)) is None  # every library sound: the compiler's own error
    (tmp_path / "ab" / "z.so").write_bytes(b"")
    assert damaged_artifact(err, str(tmp_path)) == (f"{tmp_path}/ab/c.main.cpp", err)  # rebuilding around damage


@pytest.mark.slow
def test_a_zeroed_compile_cache_is_rebuilt_with_the_same_tokens(tmp_path):
    """For real: compile=true once, every cached `.so` truncated to zero bytes, run again:
    the same text, the damage named, exit 0."""
    import os
    import subprocess

    env = {**os.environ, "DECODELAB_CACHE": str(tmp_path)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    cmd = [sys.executable, "-m", "decodelab.experiments.generate", "model=tiny-llama", "compile=true",
           "max_new_tokens=8", "prompt=hi", f"hydra.run.dir={tmp_path}/run"]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    sos = list((tmp_path / "inductor").rglob("*.so"))
    assert sos
    for f in sos:
        f.write_bytes(b"")
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "torch's compile cache entry" in again.stderr and again.stdout == first.stdout


@pytest.mark.parametrize("via", ["attend", "booked_layers"])
def test_host_attention_returns_the_layout_its_fake_promises(tiny_llama, via):
    """The compiled graph reads `decodelab::host_attend`'s result by the strides of its fake
    (q's), unchecked: an attention that returns another layout (a softcap path, a chunked
    step's cat) is copied into q's layout, values unchanged, whether the layer runs the
    cache's `attend` or the call its `booked_layers` left. A HostPlan books only its own cache."""
    from decodelab.cache.static import HostPlan

    model = tiny_llama.model
    cache = cache_for(model, 2, 96, INT4)
    other = cache_for(model, 2, 96, INT4)
    plan = cache.static_plan(3)
    assert isinstance(plan, HostPlan)
    with pytest.raises(SetupError, match="books steps on the cache it was made for"):
        plan.book(other, torch.zeros(2, 3, dtype=torch.long))
    want = torch.randn(2, 4, 3, 16)  # contiguous [B, Hq, T, D]: not q's layout
    # the backend's attention, stood in for
    if via == "attend":
        cache.booked_layers = lambda p: None
        cache.attend = lambda layer, q_, k_, v_, p: want
    else:
        cache.booked_layers = lambda p: [lambda q_, k_, v_: want] * cache.layout.n_layers
    plan.book(cache, torch.arange(3).expand(2, 3))
    q = torch.randn(2, 3, 4, 16).transpose(1, 2)  # [B, Hq, T, D] as the model makes it: strides of [B, T, Hq, D]
    k, v = torch.randn(2, 3, 2, 16).transpose(1, 2), torch.randn(2, 3, 2, 16).transpose(1, 2)
    out = plan.attend(0, q, k, v)
    assert out.stride() == q.stride() and torch.equal(out, want)
    assert plan.attend(1, q, k, v).shape == q.shape  # each layer once per booked step ...
    with pytest.raises(RuntimeError, match="layer 0 attended twice on one booked step"):
        plan.attend(0, q, k, v)  # ... a second pass without a new booking would store its K/V twice
    plan.book(cache, torch.arange(3, 6).expand(2, 3))
    assert plan.attend(0, q, k, v).shape == q.shape


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("T,groups", [(1, 1), (3, 2), (1, 8)])
def test_native_paged_attention_reads_the_blocks_in_place(threads, window, T, groups):
    """decodelab::paged_decode_attention over block pools through a table (shuffled blocks,
    -1 past each row's blocks) equals the row-major kernel over the same rows gathered
    (`gather_rows`), bit for bit: the same slots in the same order; GQA ratios 1, 2, 8.
    Block ids past the pool are refused."""
    from decodelab.cache.kernels.paged import gather_rows
    from decodelab.models import native

    if native.problem() is not None:
        pytest.skip(f"native kernels: {native.problem()}")
    g = torch.Generator().manual_seed(T + groups)
    B, Hkv, D, bs, N, M = 2, 2, 16, 4, 12, 6
    Hq = Hkv * groups
    q = torch.randn(B, Hq, T, D, generator=g)
    k_pool, v_pool = torch.randn(Hkv, N, bs, D, generator=g), torch.randn(Hkv, N, bs, D, generator=g)
    order = torch.randperm(N, generator=g)
    table = torch.full((B, M), -1, dtype=torch.int32)
    table[0, :5], table[1, :3] = order[:5].int(), order[5:8].int()  # 20 and 12 slots' blocks
    pos = torch.tensor([[17 + t for t in range(T)], [9 + t for t in range(T)]])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # both under the same threads: the same chunks, merged in the same order
    try:
        want = native.decode_attention(q, gather_rows(k_pool, table, bs).contiguous(),
                                       gather_rows(v_pool, table, bs).contiguous(), pos, 0.25, window)
        got = native.paged_decode_attention(q, k_pool, v_pool, table, pos, 0.25, window)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, want)
    table[1, 0] = N
    with pytest.raises(RuntimeError, match=r"block ids must lie in \[0, 12\)"):
        native.paged_decode_attention(q, k_pool, v_pool, table, pos, 0.25, window)
    empty = torch.zeros(Hkv, 0, bs, D)  # no block at all: refused, never read
    with pytest.raises(RuntimeError, match="shapes"):
        native.paged_decode_attention(q, empty, empty, torch.full((B, M), -1), pos, 0.25, window)


@torch.no_grad()
def test_int4_host_attend_is_the_booked_layers_call():
    """decodelab::int4_host_attend, the C++ op a native int4 HostPlan's graph calls: each layer
    bit-identical to the eager `attend` of a twin cache, in q's layout, step after step
    (booked steps that hold their tokens past the views included); a layer attended twice
    on one booking is refused; a layer it was given nothing for goes to the Python path."""
    from decodelab.cache.base import CacheLayout
    from decodelab.cache.static import HostPlan
    from decodelab.models import native

    if native.problem():
        pytest.skip(native.problem())
    lay = CacheLayout(2, 2, 16, torch.float32, torch.device("cpu"), (None, None), softmax_scale=0.25)
    caches = [QuantizedCache(lay, 1, 256, residual=4, group_size=32, flush=32, impl="native") for _ in range(2)]
    for c in caches:
        c.fill_random(100)
    plan = caches[1].static_plan(1)
    assert isinstance(plan, HostPlan) and plan.op is not None
    g = torch.Generator().manual_seed(3)
    held = 0
    for step in range(40):
        pos = caches[0].lengths[:, None].clone()
        eager = caches[0].plan(pos)
        plan.book(caches[1], pos)
        held += caches[1]._behind is not None
        q = torch.randn(1, 1, 4, 16, generator=g).transpose(1, 2)  # [B, Hq, T, D] with the model's strides
        k, v = (torch.randn(1, 1, 2, 16, generator=g).transpose(1, 2) for _ in range(2))
        for layer in range(2):
            out = plan.attend(layer, q, k, v)
            assert out.stride() == q.stride()
            assert torch.equal(out, caches[0].attend(layer, q, k, v, eager))
        with pytest.raises(RuntimeError, match="layer 1 attended twice on one booked step"):
            plan.attend(1, q, k, v)
    assert held > 20
    for x, y in zip(caches[0].read(1, 0), caches[1].read(1, 0)):
        assert torch.equal(x, y)
    plan.book(caches[1], caches[1].lengths[:, None].clone())
    torch.ops.decodelab.int4_host_arm(plan.key, [0, 1])  # layer 0 given nothing: the Python path attends it
    q = torch.randn(1, 4, 1, 16, generator=g)
    k, v = torch.randn(1, 2, 1, 16, generator=g), torch.randn(1, 2, 1, 16, generator=g)
    plan.attend(0, q, k, v)
    assert plan.attended == {0}
