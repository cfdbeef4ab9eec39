"""Compiled CPU steps through inductor's C++ wrapper (decoding/compiled.py `cpu_wrapper`), the
default a user gets; the rest of the suite compiles with the Python wrapper, which builds
faster (tests/conftest.py). Here: the options reach inductor, the C++ wrapper's steps give
the eager tokens on every cache (int4 weights: the eager bits), the engine's flat batches
too, and a wrapper that names none is refused before anything compiles."""

from __future__ import annotations

import pytest
import torch

from decodelab.cache.paged import PagedCache
from decodelab.decoding import compiled, greedy, prefill, serve
from decodelab.decoding.compiled import StaticDecoder, greedy_decode
from decodelab.models.errors import SetupError
from tests.conftest import cache_for, random_ids
from tests.decoding.test_compiled import INT4, INT4_PROMPTS, PROMPTS, _gen, plain
from tests.decoding.test_engine import requests

needs_native = pytest.mark.skipif(__import__("decodelab.models.native", fromlist=["problem"]).problem() is not None,
                                  reason="native kernels unavailable here")


@pytest.fixture
def cpp(monkeypatch):
    """Compiled CPU steps through the C++ wrapper; the options each replayable step handed
    inductor, in order (`seen`)."""
    monkeypatch.setenv("DECODELAB_CPU_WRAPPER", "cpp")
    seen, real = [], compiled.torch_private()
    if real is not None:
        spy = real._replace(inner_backend=lambda backend, patches: seen.append(patches) or
                            real.inner_backend(backend, patches))
        monkeypatch.setattr(compiled, "torch_private", lambda: spy)
        monkeypatch.setattr(compiled, "_REPLAYABLE", {})  # backends made anew, through the spy
    return seen


def test_the_default_wrapper_is_cpp_and_only_on_a_cpu(monkeypatch):
    monkeypatch.delenv("DECODELAB_CPU_WRAPPER", raising=False)
    assert compiled.cpu_wrapper() == "cpp"
    p = compiled.inductor_patches("cpu")
    assert p["cpp_wrapper"] is True and p["cpp_wrapper_build_separate"] is True
    assert p["size_asserts"] is False and p["alignment_asserts"] is False  # INDUCTOR_PATCHES kept
    assert "cpp_wrapper" not in compiled.inductor_patches("cuda")  # a CUDA step replays as a CUDA graph
    monkeypatch.setenv("DECODELAB_CPU_WRAPPER", "python")
    assert compiled.inductor_patches("cpu") == compiled.INDUCTOR_PATCHES


@pytest.mark.parametrize("backend", ["dense", "paged", "int4"])
def test_generate_through_the_cpp_wrapper_equals_eager(tiny_llama, backend, cpp):
    """Inductor's C++ wrapper runs the compiled step: greedy tokens equal to the eager loop's,
    and a second generate of the same shapes compiles nothing new."""
    model = tiny_llama.model
    factory, prompts = {"dense": (None, PROMPTS), "paged": (lambda *a, **k: PagedCache(*a, block_size=4, **k),
                                                            PROMPTS), "int4": (INT4, INT4_PROMPTS)}[backend]
    want = _gen(model, factory, greedy(), False, prompts, n=12, capacity=64)
    first = _gen(model, factory, greedy(), True, prompts, n=12, capacity=64)
    again = _gen(model, factory, greedy(), True, prompts, n=12, capacity=64)
    assert first.tokens == want.tokens == again.tokens
    assert first.compiled_steps > 0 and again.compile_s < first.compile_s / 5
    if compiled.torch_private() is not None:
        assert seen_cpp(cpp)


def seen_cpp(seen: list[dict]) -> bool:
    return bool(seen) and all(p.get("cpp_wrapper") is True for p in seen)


@needs_native
@torch.no_grad()
def test_int4_weights_through_the_cpp_wrapper_give_the_eager_bits(tiny_llama, cpp):
    """int4 layer weights and head on the native kernels (shared with eager code): the C++
    wrapper's step gives the eager step's logits to the bit, step after step."""
    from decodelab.models.quantize import WeightOptions

    model = WeightOptions("int4", quantize_head=True, kernel="native").apply(tiny_llama.model)
    want = plain(model, cache_for(model, 2, 40), 10)
    cache = cache_for(model, 2, 40)
    first = prefill(model, cache, PROMPTS).argmax(-1)
    dec, out = StaticDecoder(model, cache, mode="compile"), []
    greedy_decode(lambda last: out.append(dec.step(last).clone()) or out[-1], first, 10)
    got = torch.stack(out, 1)
    assert dec.guarded and dec.replay is not None  # the compiled graph ran (replayed), not an eager fallback
    assert torch.equal(got, want), (got - want).abs().max().item()
    if compiled.torch_private() is not None:
        assert seen_cpp(cpp)


def test_the_engines_flat_batches_through_the_cpp_wrapper(tiny_llama, cpp):
    """The engine's compiled runner (flat token batches, decoding/runner.py) built with the
    C++ wrapper: every request's tokens are its greedy tokens alone."""
    m = tiny_llama.model
    prompts = [random_ids(n, m.cfg.vocab_size, seed=n) for n in (5, 18, 9)]
    expected = [_gen(m, None, greedy(), False, [p], n=16, capacity=64).tokens[0] for p in prompts]
    r = serve(m, cache_for(m, 3, 64), greedy(), requests(prompts), token_budget=16, compile=True,
              compile_flat=True)
    assert [x.tokens for x in r.requests] == expected
    assert r.compiled_steps + r.flat_forwards == r.steps and r.flat_forwards > 0


def test_a_wrapper_that_names_none_is_refused_before_compiling(tiny_llama, monkeypatch):
    monkeypatch.setenv("DECODELAB_CPU_WRAPPER", "cxx")
    model = tiny_llama.model
    cache = cache_for(model, 2, 40)
    for build in (lambda: StaticDecoder(model, cache, mode="compile"),
                  lambda: _gen(model, None, greedy(), True)):
        with pytest.raises(SetupError, match=r"DECODELAB_CPU_WRAPPER='cxx'.*\['cpp', 'python'\]"):
            build()
    assert StaticDecoder(model, cache, mode="eager")  # eager steps read no wrapper
