"""The capabilities every backend declares on the KVCache contract (cache/base.py):
`fill_random`, `read_bytes` and `static_view` (offered or refused with the reason), for
every backend with a yaml in conf/cache/."""

from __future__ import annotations

import pytest
import torch

from decodelab.cache.base import CacheLayout
from decodelab.cache.sliding import SlidingCache
from decodelab.models.errors import SetupError
from tests.cache.conftest import D, H_KV, History, build, check_all

N = 40  # tokens fill_random writes per row
WINDOWS = (8, None)  # layer 0 windowed, layer 1 full
REFUSALS = {"int4": "int4 grows per-row stores on the host", "sliding": "sliding plans its ring writes"}


def filled(backend: str, seed: int = 0):
    c = build(backend, WINDOWS)
    c.fill_random(N, seed=seed)
    return c


def test_fill_random_holds_n_tokens_per_row(backend):
    c = filled(backend)
    elem = getattr(c, "kv_dtype", torch.float32).itemsize  # the formula at the stored dtype (dense's kv_dtype)
    assert c.lengths.tolist() == [N, N] and c.theoretical_bytes() == 2 * N * 2 * 2 * H_KV * D * elem
    for row in range(2):
        pos, k, v = c.read(1, row)  # the full layer: every position
        assert pos.tolist() == list(range(N)) and k.shape == v.shape == (H_KV, N, D)
        pos, k, v = c.read(0, row)  # the windowed layer: all of them, or (sliding) the newest of its ring
        held = 8 + c.rollback_limit if backend == "sliding" else N
        assert pos.tolist() == list(range(N - held, N)) and k.shape == (H_KV, held, D)
        for t in (k, v):  # standard normal draws (int4: dequantized, still about unit scale)
            assert 0.7 < t.std().item() < 1.3 and abs(t.mean().item()) < 0.3


def test_fill_random_is_seeded(backend):
    _, k0, v0 = filled(backend, seed=1).read(1, 0)
    _, k1, v1 = filled(backend, seed=1).read(1, 0)
    _, k2, _ = filled(backend, seed=2).read(1, 0)
    assert torch.equal(k0, k1) and torch.equal(v0, v1) and not torch.equal(k0, k2)


def test_fill_random_leaves_a_cache_that_decodes(backend):
    """Bookkeeping consistent with the stored K/V: the next tokens attend over exactly
    what `read` returns (the contract's reference over that history)."""
    c = filled(backend, seed=3)
    h = History(c, WINDOWS)
    for layer in range(2):
        for row in range(2):
            pos, k, v = c.read(layer, row)
            h.kv.update({(layer, row, int(p)): (k[:, i], v[:, i]) for i, p in enumerate(pos)})
    for p in (N, N + 1):
        nxt = torch.full((2, 1), p)
        check_all(h, h.step(nxt, seed=p), nxt)


def test_fill_random_beyond_capacity_is_refused(backend):
    with pytest.raises(SetupError, match="capacity"):
        build(backend, WINDOWS, capacity=16).fill_random(17)


def stored(c, layer: int, x: torch.Tensor, kind: str = "k") -> torch.Tensor:
    """x [Hkv, ...] read from a cache's storage as `read` returns it: a dense cache's
    kv_dtype widened (fp8: times its scale per head)."""
    if not hasattr(c, "kv_dtype") or x.dtype == c.layout.dtype:
        return x
    scale = (c.k_scale if kind == "k" else c.v_scale)[layer] if c.fp8 else torch.ones(x.shape[0])
    return x.to(c.layout.dtype) * scale.view(-1, *[1] * (x.dim() - 1))


def test_read_bytes(backend):
    c = filled(backend)
    elem = getattr(c, "kv_dtype", torch.float32).itemsize
    if backend == "int4":  # int4 reads its codes, scales and shifts and the exact tokens held (not their buffers')
        held = sum(t.numel() * 4 for layer in c.key_exact + c.value_exact for t in layer)
        assert c.read_bytes(N) == c.nbytes() - sum(t.untyped_storage().nbytes() for layer in c.key_exact +
                                                   c.value_exact for t in layer) + held
        assert c.read_bytes(N) < 2 * (8 + N) * 2 * H_KV * D * 4
    else:  # the window caps layer 0 at 8 visible tokens: 2 rows x (8 + 40) tokens x K, V x Hkv x D x bytes
        assert c.read_bytes(N) == 2 * (8 + N) * 2 * H_KV * D * elem == 12288 * elem // 4


def test_static_view_addresses_what_read_returns_or_is_refused(backend):
    c = filled(backend, seed=4)
    if backend in REFUSALS:
        with pytest.raises(SetupError, match=REFUSALS[backend]) as e:
            c.static_view()
        assert type(c).__name__ in str(e.value)  # the refusal names the backend
        return
    view = c.static_view()
    view.refresh()
    bs = view.block_size
    assert view.table.dtype == torch.int32 and view.table.shape[0] == 2 and len(view.k) == len(view.v) == 2
    for layer in range(2):
        assert view.k[layer].shape[0] == H_KV and view.k[layer].shape[2:] == (bs, D)  # [Hkv, N, bs, D]
        for row in range(2):
            _, k, v = c.read(layer, row)
            for p in (0, 15, 16, N - 1):  # paged: blocks 0, 0, 1, 2
                blk = int(view.table[row, p // bs])
                assert torch.equal(stored(c, layer, view.k[layer][:, blk, p % bs]), k[:, p])
                assert torch.equal(stored(c, layer, view.v[layer][:, blk, p % bs], "v"), v[:, p])


def test_static_view_writes_land_in_the_cache(backend):
    if backend in REFUSALS:
        pytest.skip("no static view")
    c = filled(backend)
    c.plan(torch.full((2, 1), N))  # books position N (paged: allocates its block)
    view = c.static_view()
    view.refresh()
    bs, new = view.block_size, torch.randn(H_KV, D)
    view.k[1][:, int(view.table[1, N // bs]), N % bs] = new
    assert torch.equal(c.read(1, 1)[1][:, N], stored(c, 1, new.to(view.k[1].dtype)))  # rounded as stored


def test_sliding_without_rings_offers_the_dense_view():
    """A model with no windows and no imposed one: sliding stores every token like dense,
    and says so by offering dense's view."""
    layout = CacheLayout(2, H_KV, D, torch.float32, torch.device("cpu"), (None, None), D**-0.5)
    c = SlidingCache(layout, 2, 64)
    c.fill_random(N)
    view = c.static_view()
    assert view.block_size == 64 and view.table.tolist() == [[0], [2]]  # row b: block b x Hkv of each pool
    assert torch.equal(view.k[0][:, 2, :N], c.read(0, 1)[1])


def test_every_backend_plans_a_compiled_cpu_step(backend):
    """Every backend of conf/cache/ gives a compiled CPU step its plan (a fixed-shape
    `StaticPlan`, or int4's `HostPlan`), with the step's positions as a [B, T] buffer
    that the host refills; tests/decoding/test_compiled.py runs each against eager."""
    c = filled(backend)
    for tokens in (1, 3):
        p = c.static_plan(tokens)
        assert p.traced and p.pos.shape == (2, tokens)
        pos = c.lengths[:, None] + torch.arange(tokens)
        p.book(c, pos)  # the host side of one step: the cache books it, the buffer holds its positions
        assert torch.equal(p.pos, pos) and c.lengths.tolist() == [N + tokens] * 2
        c.truncate([N, N])
