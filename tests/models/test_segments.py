"""A forward over several segments of distinct cache rows (a serving engine's decode rows
and other rows' prefill chunks in one read of the weights) computes what the segments
compute one by one: the same logits, the same K/V stored; and a refused segment leaves
every row as it was."""

from __future__ import annotations

import functools

import pytest
import torch

from decodelab.cache.dense import DenseCache
from decodelab.cache.int4 import QuantizedCache
from decodelab.cache.paged import PagedCache
from decodelab.decoding.prefill import prefill
from decodelab.models.errors import PoolExhausted, SetupError
from decodelab.models.transformer import Segment
from tests.conftest import cache_for, random_ids

INT4 = functools.partial(QuantizedCache, residual=8, flush=8, group_size=32, key_axis="token", value_axis="token",
                         rollback=0)
BACKENDS = {"dense": DenseCache, "paged": functools.partial(PagedCache, block_size=4), "int4": INT4}


def started(model, backend, capacity: int = 64):
    """A 5-row cache: rows 0, 2 and 4 hold prompts of 21, 13 and 30 tokens; rows 1 and 3 are empty."""
    cache = cache_for(model, 5, capacity, BACKENDS[backend])
    V = model.cfg.vocab_size
    prefill(model, cache, [random_ids(21, V, 1), random_ids(13, V, 2), random_ids(30, V, 3)], rows=[0, 2, 4])
    return cache


def segments(model, cache) -> list[Segment]:
    """A decode segment over rows 0, 2, 4 (one token each for rows 0 and 4; row 2 rides
    along as padding) and a chunk segment: 9 prompt tokens for row 1, 6 for row 3."""
    V, L = model.cfg.vocab_size, cache.lengths
    dec_rows = [0, 2, 4]
    dec = Segment(torch.tensor([[7], [0], [9]]), L[dec_rows][:, None].clone(),
                  torch.tensor([[True], [False], [True]]), dec_rows, torch.zeros(3, 1, dtype=torch.long))
    ids = torch.zeros(2, 9, dtype=torch.long)
    ids[0] = torch.tensor(random_ids(9, V, 4))
    ids[1, :6] = torch.tensor(random_ids(6, V, 5))
    valid = torch.arange(9)[None, :] < torch.tensor([[9], [6]])
    chunk = Segment(ids, torch.arange(9).expand(2, -1).clone(), valid, [1, 3], torch.tensor([[8], [5]]))
    return [dec, chunk]


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("name", ["llama", "gemma3"])
@torch.no_grad()
def test_segments_equal_their_forwards_one_by_one(tiny_models, name, backend):
    m = tiny_models[name].model
    mixed, alone = started(m, backend), started(m, backend)
    together = m.forward_segments(segments(m, mixed), mixed)
    apart = [m(s.ids, s.positions, alone, s.valid, s.logit_index, rows=s.rows) for s in segments(m, alone)]
    for a, b, s in zip(together, apart, segments(m, alone)):
        assert a.shape == b.shape
        real = s.valid.gather(1, s.logit_index)  # a padding row's logits mean nothing
        torch.testing.assert_close(a[real], b[real], rtol=1e-5, atol=1e-5)
    assert mixed.lengths.tolist() == alone.lengths.tolist() == [22, 9, 13, 6, 31]
    # what they stored: the next forward over every row reads the same K/V
    nxt = torch.tensor([[3], [4], [5], [6], [8]])
    pos = mixed.lengths[:, None].clone()
    torch.testing.assert_close(m(nxt, pos, mixed), m(nxt, pos, alone), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_segments_without_logit_index_give_every_position(tiny_models):
    m = tiny_models["llama"].model
    mixed, alone = started(m, "dense"), started(m, "dense")
    segs = [Segment(s.ids, s.positions, s.valid, s.rows) for s in segments(m, mixed)]
    together = m.forward_segments(segs, mixed)
    apart = [m(s.ids, s.positions, alone, s.valid, rows=s.rows) for s in segs]
    assert [t.shape for t in together] == [(3, 1, 256), (2, 9, 256)]
    for a, b, s in zip(together, apart, segs):
        ok = s.valid[..., None]
        torch.testing.assert_close(torch.where(ok, a, 0), torch.where(ok, b, 0), rtol=1e-5, atol=1e-5)
        assert not bool(a[~s.valid].any())  # zeros at padding


@torch.no_grad()
def test_segments_must_name_distinct_rows(tiny_models):
    m = tiny_models["llama"].model
    cache = started(m, "dense")
    dec, chunk = segments(m, cache)
    before = cache.lengths.clone()
    with pytest.raises(SetupError, match="share cache rows"):
        m.forward_segments([dec, Segment(chunk.ids, chunk.positions, chunk.valid, [1, 2], chunk.logit_index)], cache)
    with pytest.raises(SetupError, match="names its cache rows"):
        m.forward_segments([dec, Segment(chunk.ids, chunk.positions, chunk.valid, None, chunk.logit_index)], cache)
    assert cache.lengths.tolist() == before.tolist()


@torch.no_grad()
def test_a_refused_segment_rolls_back_the_ones_before(tiny_models):
    """The paged pool has blocks for the decode rows but not for both chunks: the forward
    is refused (PoolExhausted) and the decode rows keep their lengths and blocks."""
    m = tiny_models["llama"].model
    cache = cache_for(m, 5, 64, functools.partial(PagedCache, block_size=4, num_blocks=20))
    V = m.cfg.vocab_size
    prefill(m, cache, [random_ids(20, V, 1), random_ids(13, V, 2), random_ids(28, V, 3)], rows=[0, 2, 4])
    before, free = cache.lengths.clone(), len(cache.alloc.free)
    assert free == 4  # 5 + 4 + 7 blocks held: the decode rows need 2 more, the chunks 3 + 2
    with pytest.raises(PoolExhausted):
        m.forward_segments(segments(m, cache), cache)
    assert cache.lengths.tolist() == before.tolist()
    assert len(cache.alloc.free) == free
