"""The model runner (decoding/runner.py): a forward over segments as one flat token batch
through a compiled graph of a bucketed size computes what the eager `forward_segments`
computes, on every backend (each layer's attention is the cache's own, through the plans
booked before the graph runs), stores the same K/V, and rolls a refused forward back."""

from __future__ import annotations

import functools

import pytest
import torch

from decodelab.cache.paged import PagedCache
from decodelab.cache.sliding import SlidingCache
from decodelab.decoding.prefill import prefill
from decodelab.decoding.runner import ModelRunner, buckets_for
from decodelab.models.errors import PoolExhausted
from decodelab.models.transformer import Segment
from tests.conftest import cache_for, random_ids
from tests.models.test_segments import BACKENDS, segments

RUNS = {**BACKENDS, "sliding": SlidingCache, "sliding-imposed": functools.partial(SlidingCache, window=12, sinks=2)}


def started(model, backend: str):
    """test_segments' 5-row cache (rows 0, 2, 4 hold prompts; 1 and 3 empty) on `backend`."""
    cache = cache_for(model, 5, 64, RUNS[backend])
    V = model.cfg.vocab_size
    prefill(model, cache, [random_ids(21, V, 1), random_ids(13, V, 2), random_ids(30, V, 3)], rows=[0, 2, 4])
    return cache


def same_forward(m, backend: str, runner_of, atol: float) -> ModelRunner:
    """The runner's forward over a decode segment and a chunk segment against the eager one:
    the logits each segment asks for, the lengths, and the next forward over every row."""
    flat, eager = started(m, backend), started(m, backend)
    runner = runner_of(m, flat)
    got = runner.forward_segments(segments(m, flat))
    want = m.forward_segments(segments(m, eager), eager)
    for a, b, s in zip(got, want, segments(m, eager)):
        real = s.valid.gather(1, s.logit_index)  # a padding row's logits mean nothing
        assert a.shape == b.shape
        torch.testing.assert_close(a[real], b[real], rtol=0, atol=atol)
    assert flat.lengths.tolist() == eager.lengths.tolist() == [22, 9, 13, 6, 31]
    nxt, pos = torch.tensor([[3], [4], [5], [6], [8]]), eager.lengths[:, None].clone()
    torch.testing.assert_close(m(nxt, pos, flat), m(nxt, pos, eager), rtol=0, atol=atol)  # the same K/V stored
    return runner


def cases():
    return [(name, b) for name in ("llama", "gemma3", "qwen3") for b in RUNS
            if not (name == "gemma3" and b == "sliding-imposed")]  # Gemma has windows of its own


@pytest.mark.parametrize("name,backend", cases())
@torch.no_grad()
def test_a_flat_forward_is_the_eager_forward_bit_for_bit(tiny_models, name, backend):
    """Through dynamo's `eager` backend the graph runs the eager ops: equal to the bit."""
    m = tiny_models[name].model
    runner = same_forward(m, backend, lambda m, c: ModelRunner(m, c, compile=True, max_tokens=32, backend="eager"),
                          atol=0)
    assert runner.compiled_forwards == 1 and runner.eager_forwards == 0


@pytest.mark.parametrize("backend", ["paged", "int4"])
@torch.no_grad()
def test_a_flat_forward_through_inductor_agrees(tiny_models, backend):
    """inductor's fused graph: the same logits and K/V up to float summation order."""
    m = tiny_models["llama"].model
    runner = same_forward(m, backend, lambda m, c: ModelRunner(m, c, compile=True, max_tokens=32), atol=1e-5)
    assert runner.compiled_forwards == 1


def test_buckets_are_powers_of_two_up_to_the_largest_step():
    assert buckets_for(1) == (8,)
    assert buckets_for(8) == (8,)
    assert buckets_for(9) == (8, 16)
    assert buckets_for(300) == (8, 16, 32, 64)  # longer forwards run eagerly (MAX_BUCKET)


@torch.no_grad()
def test_a_forward_past_the_largest_bucket_runs_eagerly(tiny_models):
    m = tiny_models["llama"].model
    runner = same_forward(m, "dense", lambda m, c: ModelRunner(m, c, compile=True, max_tokens=8, backend="eager"),
                          atol=0)  # 17 tokens: past the one bucket of 8
    assert runner.compiled_forwards == 0 and runner.eager_forwards == 1
    cache = started(m, "dense")
    runner = ModelRunner(m, cache, compile=True, max_tokens=8, backend="eager")
    dec = segments(m, cache)[0]  # 2 valid tokens: bucket 8
    runner.forward_segments([dec])
    assert runner.compiled_forwards == 1


@torch.no_grad()
def test_a_refused_flat_forward_rolls_back_and_runs_nothing(tiny_models):
    """The pool cannot hold both chunks: refused before the graph runs, every row as it was."""
    m = tiny_models["llama"].model
    cache = cache_for(m, 5, 64, functools.partial(PagedCache, block_size=4, num_blocks=20))
    V = m.cfg.vocab_size
    prefill(m, cache, [random_ids(20, V, 1), random_ids(13, V, 2), random_ids(28, V, 3)], rows=[0, 2, 4])
    before, free = cache.lengths.clone(), len(cache.alloc.free)
    runner = ModelRunner(m, cache, compile=True, max_tokens=32, backend="eager")
    with pytest.raises(PoolExhausted):
        runner.forward_segments(segments(m, cache))
    assert cache.lengths.tolist() == before.tolist() and len(cache.alloc.free) == free
    assert runner.compiled_forwards == 0
    # and it runs the next forward it can hold
    one = Segment(torch.tensor([[5]]), cache.lengths[[0]][:, None].clone(), None, [0])
    assert runner.forward_segments([one])[0].shape == (1, 1, V)


@torch.no_grad()
def test_the_eager_runner_is_the_models_forward(tiny_models):
    m = tiny_models["llama"].model
    runner = same_forward(m, "paged", lambda m, c: ModelRunner(m, c), atol=0)
    assert runner.buckets == () and runner.compiled_forwards == runner.eager_forwards == 0


@torch.no_grad()
def test_a_graph_that_fails_after_booking_rolls_the_rows_back(tiny_models):
    m = tiny_models["llama"].model
    cache = started(m, "paged")
    before = cache.lengths.clone()
    runner = ModelRunner(m, cache, compile=True, max_tokens=32, backend="eager")

    def fails(*args):
        raise RuntimeError("the graph failed")
    runner.fn = fails
    with pytest.raises(RuntimeError, match="the graph failed"):
        runner.forward_segments(segments(m, cache))
    assert cache.lengths.tolist() == before.tolist() and runner.batch.plans is None


@torch.no_grad()
def test_a_decoder_steps_through_a_runner_and_names_the_old_call(tiny_llama):
    """A decoder's step takes the target's runner: its `decode` gives the logits of the
    model's own one-token forward; the pre-runner call `step(model, cache, last)` is refused
    naming the fix, before any forward."""
    from decodelab.decoding import greedy, model_runner
    from decodelab.models.errors import SetupError

    m = tiny_llama.model
    cache, ref = cache_for(m, 2, 32), cache_for(m, 2, 32)
    runner = model_runner(m, cache)
    ps = [random_ids(5, m.cfg.vocab_size, 1), random_ids(5, m.cfg.vocab_size, 2)]
    last = runner.prefill(ps).argmax(-1)
    prefill(m, ref, ps)
    want = m(last[:, None], ref.lengths[:, None], ref)[:, -1]
    torch.testing.assert_close(runner.decode(last), want, atol=0, rtol=0)
    dec = greedy()
    dec.begin(m.device, ps, 32)
    with pytest.raises(SetupError, match="takes the target's ModelRunner .*model_runner\\(model, cache\\)"):
        dec.step(m, cache, last)
    assert cache.lengths.tolist() == [6, 6]  # nothing ran
    assert dec.step(runner, last) == [[t] for t in want.argmax(-1).tolist()]


@torch.no_grad()
def test_a_tree_whose_compiled_forward_fails_rolls_its_rows_back(tiny_llama):
    """A tree booked on the cache (`runner.tree`) whose flat graph fails leaves every row as
    it held; an eager runner refuses plans booked by its caller."""
    from decodelab.decoding import model_runner
    from decodelab.models.errors import SetupError

    m = tiny_llama.model
    cache = cache_for(m, 2, 48)
    runner = model_runner(m, cache)
    runner.prefill([random_ids(7, m.cfg.vocab_size, 1), random_ids(4, m.cfg.vocab_size, 2)])
    with pytest.raises(SetupError, match="booked plans run through a compiled runner"):
        runner.forward_segments([Segment(torch.zeros(2, 1, dtype=torch.long), cache.lengths[:, None])], plans=[None])
    flat = ModelRunner(m, cache, compile=True, max_tokens=8, backend="eager")

    def broken(*a):
        raise RuntimeError("graph failed")
    flat.fn = broken
    parents = torch.tensor([[-1, 0, 0], [-1, 0, 1]])  # two trees of 3 nodes
    positions = cache.lengths[:, None] + torch.tensor([[0, 1, 1], [0, 1, 2]])
    with pytest.raises(RuntimeError, match="graph failed"):
        flat.tree(torch.ones(2, 3, dtype=torch.long), positions, parents)
    assert cache.lengths.tolist() == [7, 4]
