"""`planned_bytes`: every backend sizes itself from its options, without allocating, at
least as large as what it really holds at full capacity (issue 14: the memory check
before a cache is built)."""

from __future__ import annotations

import inspect
from functools import partial

import pytest

from decodelab.cache.base import CacheLayout, KVCache, planned_bytes
from decodelab.cache.dense import DenseCache
from decodelab.cache.int4 import QuantizedCache
from decodelab.cache.paged import PagedCache
from decodelab.cache.sliding import SlidingCache
from decodelab.models.errors import SetupError

FACTORIES = {
    "dense": DenseCache, "paged": PagedCache, "paged-32": partial(PagedCache, block_size=32),
    "sliding": SlidingCache, "sliding-rollback-4": partial(SlidingCache, rollback=4),
    "int4": QuantizedCache, "int4-small": partial(QuantizedCache, group_size=32, residual=32, rollback=8),
    "int2-token-keys": partial(QuantizedCache, nbits=2, key_axis="token"),
}


@pytest.mark.parametrize("name", list(FACTORIES))
@pytest.mark.parametrize("batch, capacity", [(1, 500), (2, 333), (1, 10)])
def test_planned_bytes_covers_a_full_cache(tiny, name, batch, capacity):
    factory = FACTORIES[name]
    layout = CacheLayout.of(tiny.model)
    planned = planned_bytes(factory, layout, batch, capacity)
    cache = factory(layout, batch, capacity)
    cache.fill_random(capacity)
    assert cache.nbytes() <= planned <= 3 * max(cache.nbytes(), batch * capacity * layout.bytes_per_token())
    if not cache.lossy:  # preallocated backends: exactly what the constructor allocates
        assert planned == cache.nbytes()


def test_a_paged_pool_is_sized_from_its_options(tiny_llama):
    layout = CacheLayout.of(tiny_llama.model)
    assert planned_bytes(partial(PagedCache, num_blocks=1000), layout, 1, 16) == 1000 * 16 * layout.bytes_per_token()
    with pytest.raises(SetupError, match="cannot hold one row"):
        planned_bytes(partial(PagedCache, num_blocks=1), layout, 1, 100)


def test_any_other_factory_is_sized_as_dense(tiny_llama):
    layout = CacheLayout.of(tiny_llama.model)
    assert planned_bytes(lambda *a: DenseCache(*a), layout, 3, 7) == 3 * 7 * layout.bytes_per_token()


@pytest.mark.parametrize("backend", [PagedCache, SlidingCache, QuantizedCache])
def test_planned_bytes_takes_the_constructors_options_and_defaults(backend):
    def options(f):
        return {k: v.default for k, v in list(inspect.signature(f).parameters.items())[4:]}

    assert options(backend.planned_bytes.__func__) == options(backend.__init__)
    assert backend.planned_bytes.__func__ is not KVCache.planned_bytes.__func__
