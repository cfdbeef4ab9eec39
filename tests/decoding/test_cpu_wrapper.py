"""Compiled CPU steps through inductor's C++ wrapper (decoding/compiled.py `cpu_wrapper`), the
default a user gets; the rest of the suite compiles with the Python wrapper (tests/conftest.py).
Here: the code inductor builds is the C++ wrapper's, its steps give the eager tokens on every
cache (int4 weights: the eager bits), the engine's flat batches too, and a wrapper that names
none is refused before anything compiles or runs, on every path that compiles."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from decodelab.cache.paged import PagedCache
from decodelab.decoding import compiled, greedy, prefill, serve
from decodelab.decoding.compiled import StaticDecoder, greedy_decode
from decodelab.decoding.runner import ModelRunner
from decodelab.models.errors import SetupError
from tests.conftest import cache_for, random_ids
from tests.decoding.test_compiled import INT4, INT4_PROMPTS, PROMPTS, _gen, plain
from tests.decoding.test_engine import requests

needs_native = pytest.mark.skipif(__import__("decodelab.models.native", fromlist=["problem"]).problem() is not None,
                                  reason="native kernels unavailable here")
#: what the module inductor writes for a graph holds with the C++ wrapper (it loads the built
#: entry through this class), and not with the Python wrapper
CPP_MARK = "CppWrapperCodeCache"


@contextlib.contextmanager
def output_code():
    """The code inductor logs for each graph it builds or takes from its cache while inside
    (torch's `output_code` log), as a list of messages."""
    got: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            got.append(record.getMessage())

    keep = Keep()
    logs = [logging.getLogger(f"torch._inductor.{m}.__output_code") for m in ("codecache", "graph")]
    torch._logging.set_logs(output_code=True)
    for log in logs:
        log.addHandler(keep)
    try:
        yield got
    finally:
        for log in logs:
            log.removeHandler(keep)
        torch._logging.set_logs()


def built_cpp(got: list[str]) -> bool:
    code = [m for m in got if m.startswith("Output code:")]
    return bool(code) and all(CPP_MARK in m for m in code)


@pytest.fixture
def cpp(monkeypatch):
    monkeypatch.setenv("DECODELAB_CPU_WRAPPER", "cpp")


def test_the_default_wrapper_is_cpp_and_only_on_a_cpu(monkeypatch):
    monkeypatch.delenv("DECODELAB_CPU_WRAPPER", raising=False)
    assert compiled.cpu_wrapper() == "cpp"  # this torch has both options (an older one: python)
    p = compiled.inductor_patches("cpu")
    assert p["cpp_wrapper"] is True and p["cpp_wrapper_build_separate"] is True
    assert p["size_asserts"] is False and p["alignment_asserts"] is False  # INDUCTOR_PATCHES kept
    assert "cpp_wrapper" not in compiled.inductor_patches("cuda")  # a CUDA step replays as a CUDA graph
    monkeypatch.setenv("DECODELAB_CPU_WRAPPER", "python")
    assert compiled.inductor_patches("cpu") == compiled.INDUCTOR_PATCHES


def test_the_python_wrapper_builds_no_cpp_entry(tiny_llama, monkeypatch):
    """The check the tests below rest on: the Python wrapper's code lacks the mark."""
    monkeypatch.setenv("DECODELAB_CPU_WRAPPER", "python")
    with output_code() as got:
        _gen(tiny_llama.model, None, greedy(), True, n=4)
    assert got and not any(CPP_MARK in m for m in got)


# paged: 6.3 s in the default run on a 2-core Zen 3 (session 53)
@pytest.mark.parametrize("backend", ["dense", pytest.param("paged", marks=pytest.mark.slow), "int4"])
def test_generate_through_the_cpp_wrapper_equals_eager(tiny_llama, backend, cpp):
    """Inductor's C++ wrapper runs the compiled step: greedy tokens equal to the eager loop's,
    and a second generate of the same shapes compiles nothing new."""
    model = tiny_llama.model
    factory, prompts = {"dense": (None, PROMPTS), "paged": (lambda *a, **k: PagedCache(*a, block_size=4, **k),
                                                            PROMPTS), "int4": (INT4, INT4_PROMPTS)}[backend]
    want = _gen(model, factory, greedy(), False, prompts, n=12, capacity=64)
    with output_code() as got:
        first = _gen(model, factory, greedy(), True, prompts, n=12, capacity=64)
    again = _gen(model, factory, greedy(), True, prompts, n=12, capacity=64)
    assert built_cpp(got)
    assert first.tokens == want.tokens == again.tokens
    assert first.compiled_steps > 0 and again.compile_s < first.compile_s / 5


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
    with output_code() as got:
        dec, out = StaticDecoder(model, cache, mode="compile"), []
        greedy_decode(lambda last: out.append(dec.step(last).clone()) or out[-1], first, 10)
    assert built_cpp(got)
    assert dec.guarded and dec.replay is not None  # the compiled graph ran (replayed), not an eager fallback
    got_logits = torch.stack(out, 1)
    assert torch.equal(got_logits, want), (got_logits - want).abs().max().item()


def test_the_engines_flat_batches_through_the_cpp_wrapper(tiny_llama, cpp):
    """The engine's compiled runner (flat token batches, decoding/runner.py) built with the
    C++ wrapper: every request's tokens are its greedy tokens alone."""
    m = tiny_llama.model
    prompts = [random_ids(n, m.cfg.vocab_size, seed=n) for n in (5, 18, 9)]
    expected = [_gen(m, None, greedy(), False, [p], n=16, capacity=64).tokens[0] for p in prompts]
    with output_code() as got:
        r = serve(m, cache_for(m, 3, 64), greedy(), requests(prompts), token_budget=16, compile=True,
                  compile_flat=True)
    assert built_cpp(got)
    assert [x.tokens for x in r.requests] == expected
    assert r.compiled_steps + r.flat_forwards == r.steps and r.flat_forwards > 0


def test_a_wrapper_that_names_none_is_refused_before_anything_runs(tiny_llama, monkeypatch):
    """Every path that compiles a CPU step refuses DECODELAB_CPU_WRAPPER=cxx, naming the
    wrappers there are, before it compiles or decodes: the static step, generate (plain and
    speculative, whose drafter and verify would compile), the engine and its flat runner."""
    from decodelab.decoding import generate
    from decodelab.decoding.drafters import prompt_lookup
    from decodelab.decoding.speculative import SpeculativeDecoder

    monkeypatch.setenv("DECODELAB_CPU_WRAPPER", "cxx")
    model = tiny_llama.model
    cache = cache_for(model, 2, 40)

    def generate_on(c, decoder):
        return generate(model, c, decoder, PROMPTS, 4, compile=True)
    builds = {"static step": lambda: StaticDecoder(model, cache, mode="compile"),
              "generate": lambda: generate_on(cache, greedy()),
              "speculative": lambda: generate_on(cache, SpeculativeDecoder(prompt_lookup(), gamma=3)),
              "engine": lambda: serve(model, cache, greedy(), requests([random_ids(5)]), compile=True),
              "flat runner": lambda: ModelRunner(model, cache, compile=True)}
    for name, build in builds.items():
        with pytest.raises(SetupError, match=r"DECODELAB_CPU_WRAPPER='cxx'.*\['cpp', 'python'\]"):
            build()
        assert int(cache.lengths.max()) == 0, name  # nothing prefilled or decoded
    assert StaticDecoder(model, cache, mode="eager")  # eager steps read no wrapper
