"""decodelab's native int4 decode attention (cache/kernels/int4.py `int4_attention_native`,
models/kernels/native_kernels.cpp `dl_int4_decode_attn`) against its torch reference over
the same stores, and the int4 cache's choice of it.

The bound. The kernel scores the quantized keys in integers: per key group and query head
the query, folded with the group's scales, is rounded to int16 against its largest
(`int16_key_scores` says how), and the codes are summed against it exactly. The reference
with `int16_query=True` does the same rounding in torch, so the two differ only by float
rounding: the kernel folds the value scales into the softmax weights where the reference
dequantizes each value to fp32 first, and both sum in fp32 in different orders (and over
different context chunks). Outputs are averages of values of order 1 (random K/V, |x| < 5),
so the two differ by a few ulp of the partial sums (2^-24 x ~5 x sqrt(context) < 1e-5 at 2k
tokens). We allow 1e-4, the bound the Triton kernels' fp32 tests use, and the measured
errors sit near 1e-5 or below. Against the exact reference (no rounding of the query) the
kernel is held to the bound the int16 rounding implies (test_the_int16_query_moves_...).
"""

from __future__ import annotations

import pytest
import torch

from decodelab.cache.base import CacheLayout
from decodelab.cache.int4 import QuantizedCache
from decodelab.cache.kernels.int4 import _native_spans as int4_native_spans
from decodelab.cache.kernels.int4 import _native_stores as int4_native_stores
from decodelab.cache.kernels.int4 import int4_attention_native, int4_attention_reference, row_keys
from decodelab.models import native
from decodelab.models.errors import SetupError

pytestmark = pytest.mark.skipif(native.problem() is not None, reason=f"native kernels: {native.problem()}")
LIMIT = 1e-4


@pytest.fixture(params=[0, 1], ids=["avx2", "avx512"])
def isa(request):
    """Each kernel check in both instruction sets: the AVX2 form, and the 512-bit one where
    the CPU has it (skipped elsewhere); the level in use restored after."""
    before = torch.ops.decodelab.isa(-1)
    if request.param > before:
        pytest.skip("this CPU has no AVX-512 (with VNNI): only the AVX2 path runs here")
    torch.ops.decodelab.isa(request.param)
    assert torch.ops.decodelab.isa(-1) == request.param
    yield request.param
    torch.ops.decodelab.isa(before)


def filled(Hq: int, Hkv: int, D: int, context: int, T: int = 1, window=None, back: int = 0, **options):
    """An int4 cache (2 rows) holding `context` random tokens, row 1 rolled back by `back`,
    with a forward of T new tokens per row planned and stored in layer 0; the queries, the
    plan and the layout."""
    layout = CacheLayout(1, Hkv, D, torch.float32, torch.device("cpu"), (window,), D**-0.5)
    opts = dict(residual=40, rollback=16) | options
    cache = QuantizedCache(layout, 2, context + T + 8, **opts)
    cache.fill_random(context, seed=context)
    if back:
        cache.truncate([context, context - back])
    g = torch.Generator().manual_seed(context + T)
    start = cache.lengths.clone()
    plan = cache.plan(start[:, None] + torch.arange(T))
    q, k, v = (torch.randn(2, h, T, D, generator=g) for h in (Hq, Hkv, Hkv))
    cache.attend(0, q, k, v, plan)
    return cache, plan, q, layout


def both(cache, plan, q, layout, threads: int | None = None):
    rows, (qpos, vis) = cache.kernel_rows(0, plan), cache.kernel_queries(plan)
    w = layout.windows[0]
    want = int4_attention_reference(q, rows, qpos, vis, layout.softmax_scale, w, int16_query=True)
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        got = int4_attention_native(q, rows, qpos, vis, layout.softmax_scale, w)
    finally:
        torch.set_num_threads(before)
    return got, want


# contexts around the boundaries with residual 40, group and flush 64: nothing quantized
# (1, 40, 103), the first block (104), one past it, a group boundary (128, 129), many
# blocks with a partial exact tail (1000, 2047)
@pytest.mark.parametrize("context", [1, 40, 103, 104, 105, 128, 129, 1000, 2047])
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 2), (9, 3), (8, 2), (8, 1)])
def test_native_equals_reference_over_the_boundaries(context, Hq, Hkv, isa):
    got, want = both(*filled(Hq, Hkv, 64, context))
    assert got.isfinite().all()
    assert (got - want).abs().max().item() <= LIMIT


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("window", [None, 37, 300])
@pytest.mark.parametrize("T", [1, 3, 9])
def test_native_windows_verify_forwards_and_ragged_rows(threads, window, T, isa):
    """T queries a row whose V(q) differ inside the forward (they cross a flush boundary),
    an unaligned window start, row 1 rolled back 5 tokens (another length, a shorter exact
    store); 1 and 3 threads (other context chunks)."""
    cache, plan, q, layout = filled(8, 2, 64, 612, T, window, back=5)  # V(q) steps at q = 615
    vis = cache.kernel_queries(plan)[1]
    if T > 3:
        assert len(set(vis[0].tolist())) > 1  # the forward crosses a block boundary
    got, want = both(cache, plan, q, layout, threads)
    assert (got - want).abs().max().item() <= LIMIT


@pytest.mark.parametrize("scale_dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("group_size,D", [(32, 64), (64, 64), (128, 128), (32, 32), (64, 128), (32, 96), (32, 16)])
def test_native_reads_every_scale_dtype_and_group(scale_dtype, group_size, D, isa):
    got, want = both(*filled(6, 2, D, 700, group_size=group_size, scale_dtype=scale_dtype))
    assert (got - want).abs().max().item() <= LIMIT


@pytest.mark.parametrize("outlier", [1.0, 300.0])
def test_the_int16_query_moves_scores_within_its_bound_and_the_reference_models_it(outlier, isa):
    """A query with one channel `outlier` times the rest (real keys' outlier channels make
    the folded query's largest channel dominate, so the others round coarsest): the kernel
    stays within LIMIT of the int16 reference, and within the rounding's bound of the exact
    one: each score moves by at most max|q'| / 65534 x sum_d code_d <= 15 D max|q'| / 65534
    =: delta, so each softmax weight by a factor within e^(+-2 delta) and the output by at
    most (e^(2 delta) - 1) max|v|."""
    cache, plan, q, layout = filled(8, 2, 64, 1500)
    q[:, :, :, 5] *= outlier
    rows, (qpos, vis) = cache.kernel_rows(0, plan), cache.kernel_queries(plan)
    scale = layout.softmax_scale
    got = int4_attention_native(q, rows, qpos, vis, scale)
    exact = int4_attention_reference(q, rows, qpos, vis, scale)
    modeled = int4_attention_reference(q, rows, qpos, vis, scale, int16_query=True)
    assert (got - modeled).abs().max().item() <= LIMIT
    bound = 0.0
    for b in range(q.shape[0]):
        st = rows.key_grouping.span(rows.key_codes[b], rows.dequant_from[b], rows.dequant_to[b])
        qmax = (q[b].abs().amax() * scale * st.scale.float().abs().amax()).item()  # >= every max|q'|
        delta = 15 * q.shape[-1] * qmax / 65534
        vmax = row_keys(rows, b, torch.float32)[2].abs().amax().item()
        bound = max(bound, (torch.tensor(2 * delta).exp().item() - 1) * vmax)
    moved = (got - exact).abs().max().item()
    assert moved <= bound + LIMIT
    if outlier > 1:  # coarse rounding: it shows against the exact reference, and the int16 one models it
        assert moved > 10 * (got - modeled).abs().max().item()


def test_the_cache_attends_natively_on_a_cpu_and_agrees_step_by_step():
    """impl=auto picks the native kernel on a CPU for the KIVI defaults; 300 decode steps
    (blocks quantized and exact copies dropped along the way) give the reference cache's
    outputs within the bound, and the prefill (longer than a decode) stays the reference."""
    layout = CacheLayout(2, 2, 64, torch.float32, torch.device("cpu"), (None, 50), 0.125)
    caches = [QuantizedCache(layout, 1, 400, residual=32, impl=i) for i in ("auto", "reference")]
    assert [c.impl for c in caches] == ["native", "reference"]
    g = torch.Generator().manual_seed(0)
    for step in range(300):
        T = 40 if step == 0 else 1
        q, k, v = (torch.randn(1, h, T, 64, generator=g) for h in (6, 2, 2))
        outs = []
        for c in caches:
            plan = c.plan(c.lengths[:, None] + torch.arange(T))
            assert (plan.kernel_q is not None) == (c.impl == "native" and T == 1)
            outs.append(torch.stack([c.attend(layer, q, k, v, plan) for layer in range(2)]))
        assert (outs[0] - outs[1]).abs().max().item() <= LIMIT, step
    assert int(caches[0].quantized_len[0]) > 128


def test_impl_native_is_refused_where_it_cannot_serve_and_auto_falls_back():
    layout = CacheLayout(1, 2, 64, torch.float32, torch.device("cpu"), (None,), 0.125)
    for opts, why in ((dict(key_axis="token"), "KIVI axes"), (dict(nbits=2), "4-bit")):
        with pytest.raises(SetupError, match=f"impl=native cannot attend.*{why}.*impl=auto or impl=reference"):
            QuantizedCache(layout, 1, 64, impl="native", **opts)
        assert QuantizedCache(layout, 1, 64, **opts).impl == "reference"
    bf16 = CacheLayout(1, 2, 64, torch.bfloat16, torch.device("cpu"), (None,), 0.125)
    with pytest.raises(SetupError, match="float32"):
        QuantizedCache(bf16, 1, 64, impl="native")
    assert QuantizedCache(bf16, 1, 64).impl == "reference"


def test_the_operator_checks_what_it_reads():
    cache, plan, q, layout = filled(4, 2, 64, 300)
    rows, (qpos, vis) = cache.kernel_rows(0, plan), cache.kernel_queries(plan)
    for kg in (16, 48):  # the keys are read in blocks of 16 byte rows: a group of a multiple of 32 tokens
        with pytest.raises(RuntimeError, match="a multiple of 32"):
            native.int4_decode_attention(q, int4_native_stores(rows), int4_native_spans(rows), qpos, vis,
                                         layout.softmax_scale, None, kg, rows.value_grouping.size)
    rows.dequant_to = [10**6, 10**6]  # past the quantized store
    with pytest.raises(RuntimeError, match="not held"):
        int4_attention_native(q, rows, qpos, vis, layout.softmax_scale)
    with pytest.raises(RuntimeError, match="q must be a float32"):
        int4_attention_native(q.double(), cache.kernel_rows(0, plan), qpos, vis, layout.softmax_scale)
