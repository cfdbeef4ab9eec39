"""The paged backend: same results as dense on the tiny models, prefix reuse, copy-on-write,
pool exhaustion, block bookkeeping and the waste figures (the contract suite covers the rest)."""

from __future__ import annotations

from collections import OrderedDict
from functools import partial

import pytest
import torch

from decodelab.cache.base import CacheLayout
from decodelab.cache.paged import PagedCache, chain_hashes, waste_report
from decodelab.decoding import generate, greedy, prefill
from decodelab.models.errors import SetupError
from tests.conftest import cache_for, random_ids


def paged(block_size: int = 4, **kw):
    return partial(PagedCache, block_size=block_size, **kw)


def layout(n_layers=2, n_kv=2, head_dim=4, windows=None):
    return CacheLayout(n_layers, n_kv, head_dim, torch.float32, torch.device("cpu"),
                       windows or (None,) * n_layers, softmax_scale=head_dim**-0.5)


def step(cache, positions: torch.Tensor, valid=None, seed: int = 0) -> list[torch.Tensor]:
    """One forward of random q/k/v through every layer; returns the outputs."""
    g = torch.Generator().manual_seed(seed)
    plan = cache.plan(positions, valid)
    lay, (B, T) = cache.layout, positions.shape
    outs = []
    for layer in range(lay.n_layers):
        q = torch.randn(B, 2 * lay.n_kv_heads, T, lay.head_dim, generator=g)
        k, v = (torch.randn(B, lay.n_kv_heads, T, lay.head_dim, generator=g) for _ in range(2))
        outs.append(cache.attend(layer, q, k, v, plan))
    return outs


@torch.inference_mode()
def decode(model, cache, prompts, n: int, chunk: int | None = None, rollback: list[int] | None = None):
    """Prefill then `n` greedy steps; with `rollback`, truncate to it halfway and go on.
    Returns the logits [steps, B, V] and the tokens [B, steps]."""
    logits = [prefill(model, cache, prompts, chunk)]
    for s in range(n):
        if rollback is not None and s == n // 2:
            cache.truncate(rollback)
        last = logits[-1].argmax(-1)  # [B]
        logits.append(model(last[:, None], cache.lengths[:, None], cache)[:, -1])
    out = torch.stack(logits)
    return out, out.argmax(-1).T.tolist()


def both(model, prompts, n: int, block_size: int, capacity: int = 80, **kw):
    dense = decode(model, cache_for(model, len(prompts), capacity), prompts, n, **kw)
    pc = cache_for(model, len(prompts), capacity, paged(block_size))
    return dense, decode(model, pc, prompts, n, **kw), pc


# -- same results as dense ---------------------------------------------------------
@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_length_batch_matches_dense(tiny, block_size):
    m = tiny.model
    prompts = [random_ids(n, m.cfg.vocab_size, seed=n) for n in (5, 37, 18)]  # past the window of 16
    (dl, dt), (pl, pt), _ = both(m, prompts, 12, block_size)
    torch.testing.assert_close(pl, dl, rtol=0, atol=1e-5)
    assert pt == dt
    gen = generate(m, cache_for(m, 3, 60, paged(block_size)), greedy(), prompts, 12)
    assert gen.tokens == generate(m, cache_for(m, 3, 60), greedy(), prompts, 12).tokens


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("chunk", [5, 16])
def test_chunked_prefill_matches_dense(tiny, block_size, chunk):
    m = tiny.model
    prompts = [random_ids(n, m.cfg.vocab_size, seed=n) for n in (41, 9)]
    (dl, dt), (pl, pt), _ = both(m, prompts, 4, block_size, chunk=chunk)
    torch.testing.assert_close(pl, dl, rtol=0, atol=1e-5)
    assert pt == dt


@pytest.mark.parametrize("block_size", [4, 16])
def test_rollback_across_block_boundary_matches_dense(tiny, block_size):
    m = tiny.model
    prompts = [random_ids(n, m.cfg.vocab_size, seed=n) for n in (30, 21)]
    # after prefill + 5 steps rows hold 35 and 26 tokens; roll back across a block boundary
    back = [31, 15]
    (dl, dt), (pl, pt), pc = both(m, prompts, 10, block_size, rollback=back)
    torch.testing.assert_close(pl, dl, rtol=0, atol=1e-5)
    assert pt == dt
    assert pc.memory_report()["blocks_in_use"] == sum(-(-n // block_size) for n in pc.lengths.tolist())


# -- prefix caching ----------------------------------------------------------------
@pytest.mark.parametrize("block_size", [4, 16])
def test_prefix_hit_reuses_tokens_with_no_cache_logits(tiny, block_size):
    m = tiny.model
    shared = random_ids(35, m.cfg.vocab_size, seed=1)
    first = [shared + random_ids(6, m.cfg.vocab_size, seed=2)]
    second = [shared + random_ids(9, m.cfg.vocab_size, seed=3)]
    pc = cache_for(m, 1, 70, paged(block_size))
    generate(m, pc, greedy(), first, 3)
    r = generate(m, pc, greedy(), second, 8)  # generate resets the cache; the blocks survive
    assert r.kv["prefix_reused_tokens"] == 35 // block_size * block_size > 0
    assert r.tokens == generate(m, cache_for(m, 1, 70), greedy(), second, 8).tokens
    pc.reset()
    (dl, _), (pl, _) = decode(m, cache_for(m, 1, 70), second, 4), decode(m, pc, second, 4)
    assert pc.prefix_reused_tokens > 0
    torch.testing.assert_close(pl, dl, rtol=0, atol=1e-5)


def test_whole_prompt_cached_recomputes_last_position(tiny_llama):
    m = tiny_llama.model
    prompts = [random_ids(32, m.cfg.vocab_size, seed=4)] * 2  # exactly 8 blocks of 4, twice
    pc = cache_for(m, 2, 40, paged(4))
    decode(m, pc, prompts, 2)
    pc.reset()
    logits, _ = decode(m, pc, prompts, 2)  # both rows map the same 8 blocks
    assert pc.prefix_reused_tokens == 2 * 31  # the last position is computed again:
    assert pc.table[0, 7] != pc.table[1, 7] and pc.table[0, :7].tolist() == pc.table[1, :7].tolist()  # copied
    torch.testing.assert_close(logits, decode(m, cache_for(m, 2, 40), prompts, 2)[0], rtol=0, atol=1e-5)


def test_no_prefix_caching_reuses_nothing(tiny_llama):
    m = tiny_llama.model
    prompt = [random_ids(20, m.cfg.vocab_size, seed=5)]
    pc = cache_for(m, 1, 30, paged(4, prefix_caching=False))
    generate(m, pc, greedy(), prompt, 2)
    assert generate(m, pc, greedy(), prompt, 2).kv["prefix_reused_tokens"] == 0


def test_copy_on_write_keeps_the_other_sharer_intact():
    c = PagedCache(layout(), batch_size=2, capacity=32, block_size=4)
    prompt = list(range(10))
    step(c, torch.arange(10).expand(2, -1), seed=1)
    c.remember_prefix([prompt, prompt])
    c.reset()
    assert c.reuse_prefix([prompt + [1], prompt + [2]]) == [8, 8]  # two full blocks each
    assert c.table[0, :2].tolist() == c.table[1, :2].tolist()
    shared = int(c.table[0, 1])
    assert c.alloc.refs[shared] == 2
    before = [c.read(layer, 1) for layer in range(2)]
    old0 = [c.read(layer, 0)[1][:, :6].clone() for layer in range(2)]
    c.truncate([6, 8])  # row 0 rolls back into the shared block, then writes position 6
    step(c, torch.tensor([[6], [8]]), seed=2)
    assert int(c.table[0, 1]) != shared and int(c.table[1, 1]) == shared and c.alloc.refs[shared] == 1
    for layer in range(2):
        _, k1, v1 = c.read(layer, 1)
        torch.testing.assert_close(k1[:, :8], before[layer][1], rtol=0, atol=0)
        torch.testing.assert_close(v1[:, :8], before[layer][2], rtol=0, atol=0)
        torch.testing.assert_close(c.read(layer, 0)[1][:, :6], old0[layer], rtol=0, atol=0)


def test_chain_hash_depends_on_the_whole_prefix():
    a, b = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4), chain_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and len(b) == 2 and a[1] != b[1]  # same second block, different parent


def test_freed_blocks_stay_reusable_until_handed_out():
    c = PagedCache(layout(), batch_size=1, capacity=16, block_size=4, num_blocks=4)
    prompt = list(range(8))
    step(c, torch.arange(8)[None])
    c.remember_prefix([prompt])
    c.reset()
    assert len(c.alloc.by_hash) == 2
    step(c, torch.arange(16)[None])  # takes all four blocks: the cached ones are recycled
    assert len(c.alloc.by_hash) == 0
    c.reset()
    assert c.reuse_prefix([prompt + [9]]) == [0]


# -- pool bookkeeping and errors ---------------------------------------------------
def test_pool_exhaustion_raises_before_any_write():
    c = PagedCache(layout(), batch_size=2, capacity=16, block_size=4, num_blocks=5)
    step(c, torch.arange(6).expand(2, -1), seed=1)  # 2 blocks per row
    snapshot = [t.clone() for t in c.k + c.v]
    lengths, table, free = c.lengths.clone(), c.table.clone(), list(c.alloc.free)
    with pytest.raises(SetupError, match=r"needs 2 new blocks .* only 1 of 5 are free.*num_blocks"):
        step(c, torch.tensor([[6, 7, 8], [6, 7, 8]]), seed=2)  # positions 8: a third block per row
    assert c.lengths.tolist() == lengths.tolist() and torch.equal(c.table, table) and list(c.alloc.free) == free
    assert all(torch.equal(a, b) for a, b in zip(snapshot, c.k + c.v))
    step(c, torch.tensor([[6, 7, 8], [6, 7, 7]]), valid=torch.tensor([[1, 1, 1], [1, 1, 0]]).bool())
    assert c.lengths.tolist() == [9, 8]  # one new block fits


def test_bad_constructor_args_list_every_reason():
    with pytest.raises(SetupError) as e:
        PagedCache(layout(), 0, 64, block_size=0, num_blocks=0, memory_budget_mb=1)
    assert len(e.value.reasons) == 3  # batch size, both sizings, block size
    with pytest.raises(SetupError) as e:
        PagedCache(layout(), 1, 64, block_size=16, num_blocks=0)
    assert e.value.reasons == ["num_blocks must be >= 1, got 0 (a block is 2048 bytes)"]
    with pytest.raises(SetupError, match="cannot hold one row of capacity 64"):
        PagedCache(layout(), 1, 64, block_size=16, num_blocks=3)
    with pytest.raises(SetupError, match="cannot hold one row"):
        PagedCache(layout(), 1, 64, block_size=16, memory_budget_mb=2 / 1024)  # 2 KiB: 1 block of 2048 B


def test_pool_sizing_and_nbytes():
    lay = layout()  # block of 4 tokens: 2 (K, V) x 2 layers x 2 heads x 4 tokens x 4 dims x 4 B = 512 B
    assert PagedCache(lay, 3, 10, block_size=4).num_blocks == 9
    c = PagedCache(lay, 1, 10, block_size=4, memory_budget_mb=10 / 1024)  # 10 KiB
    assert c.num_blocks == 20 and c.nbytes() == 20 * 512 == 20 * c.block_bytes


def test_blocks_return_to_the_free_list_on_truncate_and_reset():
    c = PagedCache(layout(), batch_size=2, capacity=32, block_size=4)
    n = c.num_blocks
    step(c, torch.arange(10).expand(2, -1), valid=torch.arange(10)[None] < torch.tensor([[10], [3]]))
    assert c.alloc.in_use == 3 + 1 and len(c.alloc.free) == n - 4  # padding gets no block
    c.truncate([5, 3])
    assert c.alloc.in_use == 2 + 1 and c.table[0, 2:].eq(-1).all()
    c.truncate([4, 0])
    assert c.alloc.in_use == 1
    c.reset()
    assert c.alloc.in_use == 0 and len(c.alloc.free) == n and c.table.eq(-1).all()


def test_memory_report_counts_blocks_and_waste():
    c = PagedCache(layout(), batch_size=2, capacity=32, block_size=4)
    step(c, torch.arange(10).expand(2, -1), valid=torch.arange(10)[None] < torch.tensor([[10], [5]]))
    r = c.memory_report()
    assert r["blocks_in_use"] == 5 and r["kv_bytes_in_use"] == 5 * 512
    assert r["waste_fraction"] == pytest.approx((20 - 15) / 20) and r["kv_tokens"] == 15
    assert r["kv_bytes_allocated"] == c.nbytes() and r["prefix_reused_tokens"] == 0


def test_paged_waste_under_4_percent_vs_dense():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(100, 2001, (16,), generator=g).tolist()
    lengths[:2] = [100, 2000]
    w = waste_report(lengths, block_size=16)
    assert w["paged_waste_fraction"] < 0.04, w
    assert w["dense_waste_fraction"] > 0.3, w  # preallocating every row to the longest
    # the live cache reports the same figure
    c = PagedCache(layout(1, 1, 2), batch_size=16, capacity=2000, block_size=16)
    pos = torch.arange(2000).expand(16, -1)
    c.plan(pos, pos < torch.tensor(lengths)[:, None])
    assert c.memory_report()["waste_fraction"] == pytest.approx(w["paged_waste_fraction"])


@pytest.mark.parametrize("windows", [(None, None), (5, None)])
def test_consecutive_block_view_equals_gather(windows):
    """One row in consecutive blocks is read as a view; scrambled blocks are gathered."""
    view, gathered = (PagedCache(layout(windows=windows), 1, 40, block_size=4) for _ in range(2))
    gathered.alloc.free = OrderedDict.fromkeys(reversed(range(gathered.num_blocks)))  # descending ids
    for c in (view, gathered):
        step(c, torch.arange(13)[None], seed=1)
    outs = []
    for c in (view, gathered):
        outs.append([step(c, torch.tensor([[p]]), seed=p) for p in range(13, 22)])
        outs[-1].append(step(c, torch.arange(22, 25)[None], seed=9))
    reads = [c.plan(torch.tensor([[25]])).reads[None] for c in (view, gathered)]  # the next step's plans
    assert reads[0].gather is None and reads[1].gather is not None
    for a, b in zip(*outs):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-6)
