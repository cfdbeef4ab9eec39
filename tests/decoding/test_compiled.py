"""The static decode step (decoding/compiled.py) against the plain decode step: same
greedy tokens and logits on the CPU, for dense and paged caches, in eager mode and
through torch.compile (backend=eager). The CUDA-graph mode runs in experiments/gpu_check."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from decodelab.cache.int4 import QuantizedCache
from decodelab.cache.paged import PagedCache
from decodelab.cache.sliding import SlidingCache
from decodelab.decoding import prefill
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


@pytest.mark.parametrize("backend", ["dense", "paged"])
@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_static_step_matches_plain_step(tiny_llama, backend, mode):
    model = tiny_llama.model
    factory = {"dense": None, "paged": partial(PagedCache, block_size=4)}[backend]
    make = (lambda: cache_for(model, 2, 40)) if factory is None else (lambda: cache_for(model, 2, 40, factory))
    want = plain(model, make(), 8)
    kw = dict(mode=mode, backend="eager") if mode == "compile" else dict(mode=mode)
    got = static(model, make(), 8, **kw)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert (got - want).abs().max().item() < 1e-4


def test_dense_as_pool_addresses_each_rows_positions():
    t = torch.randn(3, 2, 16, 4)  # [B, Hkv, S, D]
    pool, table = dense_as_pool(t, 4)  # [Hkv, N, 4, D], [B, 4]
    for b, h, p in ((2, 1, 13), (0, 0, 0), (2, 1, 15), (1, 0, 6)):
        assert torch.equal(pool[h, table[b, p // 4], p % 4], t[b, h, p])


def test_unsupported_caches_and_modes_are_refused(tiny_llama, tiny_gemma):
    """The cache's own refusal (its `static_view`), not a list of types, says why."""
    model = tiny_llama.model
    with pytest.raises(SetupError, match="QuantizedCache backend cannot .* int4 grows per-row stores"):
        StaticDecoder(model, cache_for(model, 1, 32, partial(QuantizedCache, group_size=32)), mode="eager")
    gemma = tiny_gemma.model  # windowed layers: sliding keeps rings
    with pytest.raises(SetupError, match="SlidingCache backend cannot .* sliding plans its ring"):
        StaticDecoder(gemma, cache_for(gemma, 1, 32, SlidingCache), mode="eager")
    with pytest.raises(SetupError, match="CUDA"):
        StaticDecoder(model, cache_for(model, 1, 32), mode="graph")
    with pytest.raises(SetupError) as e:  # every reason at once
        StaticDecoder(model, cache_for(model, 1, 32, partial(QuantizedCache, group_size=32)), mode="fast")
    assert len(e.value.reasons) == 2
