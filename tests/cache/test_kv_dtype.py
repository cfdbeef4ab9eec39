"""The dense and paged caches' `kv_dtype`: K/V stored as bfloat16, float16 or float8 e4m3 (a
scale per layer and kv head), attended in the model's dtype; the native kernel's reading of
each storage dtype against torch's attention over the same stored values; paged against
dense of the same dtype (the same stored values, read through the block table).

What is exact and what is bounded. Storing rounds K/V (to bf16, fp16 or e4m3), and the
kernel's reading of what is stored is exact (bf16 and fp16 widen exactly; e4m3 by moving
its exponent). So against a reference fed the same rounded values, only the float
summation order differs: outputs (averages of values of order 1) within 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from decodelab.cache.base import CacheLayout, reference_attention
from decodelab.cache.dense import FP8_HEADROOM, FP8_MAX, DenseCache, to_fp8
from decodelab.cache.paged import PagedCache
from decodelab.models import native
from decodelab.models.errors import SetupError

needs_native = pytest.mark.skipif(native.problem() is not None, reason=f"native kernels: {native.problem()}")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float8_e4m3": torch.float8_e4m3fn}
LIMIT = 1e-5


def layout(windows=(None, 7), D=16, Hkv=2):
    return CacheLayout(len(windows), Hkv, D, torch.float32, torch.device("cpu"), tuple(windows), D**-0.5)


@needs_native
@pytest.mark.parametrize("kind", list(DTYPES))
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("T", [1, 3])
def test_native_kernel_reads_each_storage_dtype_in_place(kind, window, T):
    g = torch.Generator().manual_seed(T)
    B, Hq, Hkv, S, D = 2, 6, 2, 40, 16
    q = torch.randn(B, Hq, T, D, generator=g)
    k, v = (3 * torch.randn(B, Hkv, S, D, generator=g) for _ in range(2))
    ks, vs = (torch.tensor([0.02, 0.05]), torch.tensor([0.03, 0.01])) if kind == "float8_e4m3" else (None, None)
    store = (lambda x, s: to_fp8(x, s)) if ks is not None else (lambda x, s: x.to(DTYPES[kind]))
    k8, v8 = store(k, ks), store(v, vs)
    kf, vf = k8.float(), v8.float()
    if ks is not None:
        kf, vf = kf * ks[None, :, None, None], vf * vs[None, :, None, None]
    pos = torch.tensor([[30 + t for t in range(T)], [6 + t for t in range(T)]])
    kpos = torch.arange(S)
    seen = kpos <= pos[..., None]
    if window is not None:
        seen &= kpos > pos[..., None] - window
    want = reference_attention(q, kf, vf, seen[:, None], 0.25)
    got = native.decode_attention(q, k8, v8, pos, 0.25, window, ks, vs)
    assert (got - want).abs().max().item() <= LIMIT


def test_e4m3_is_read_exactly_subnormals_and_signs_included():
    """Every one of the 254 finite e4m3 values (NaNs apart) through the kernel: one key
    slot holding the value, a query reading it, a value of ones: the score is the value."""
    if native.problem() is not None:
        pytest.skip(native.problem())
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    values = codes.view(torch.float8_e4m3fn).float()  # torch's decoding of each code
    D = 8
    for x in values.tolist():
        keys = torch.full((1, 1, 2, D), x).to(torch.float8_e4m3fn)
        keys[0, 0, 0] = 0  # slot 0 scores 0: slot 1's weight is sigmoid(D x)
        vals = torch.zeros(1, 1, 2, D, dtype=torch.float8_e4m3fn)
        vals[0, 0, 1] = torch.ones(D).to(torch.float8_e4m3fn)
        q = torch.ones(1, 1, 1, D)
        out = native.decode_attention(q, keys, vals, torch.tensor([[1]]), 1.0)[0, 0, 0, 0].item()
        assert out == pytest.approx(torch.sigmoid(torch.tensor(D * x, dtype=torch.float64)).item(), rel=1e-5, abs=1e-7)


def fed(cache, steps: int, g, T0: int = 12, Hq: int = 4):
    """A prefill of T0 tokens, then `steps` single tokens; every layer's outputs, and what was fed."""
    lay = cache.layout
    outs, fedkv = [], []
    for step in range(steps + 1):
        T = T0 if step == 0 else 1
        q, k, v = (torch.randn(1, h, T, lay.head_dim, generator=g) * s for h, s in ((Hq, 1), (lay.n_kv_heads, 2),
                                                                                      (lay.n_kv_heads, 2)))
        plan = cache.plan(cache.lengths[:, None] + torch.arange(T))
        outs.append(torch.cat([cache.attend(layer, q, k, v, plan) for layer in range(lay.n_layers)], 1))
        fedkv.append((q, k, v))
    return outs, fedkv


@pytest.mark.parametrize("kind", list(DTYPES))
def test_a_dense_cache_of_each_kv_dtype_equals_dense_fp32_fed_the_rounded_values(kind):
    """The prefill (converted, torch's attention) and the decode steps (the native kernel on a
    CPU) of a kv_dtype cache against a float32 dense cache fed K/V rounded as stored (fp8:
    with the scales the first forward set); the layers' windows (None, 7) apply."""
    lay = layout()
    cache = DenseCache(lay, 1, 40, kv_dtype=kind)
    assert cache.k[0].dtype == DTYPES[kind]
    outs, fedkv = fed(cache, 20, torch.Generator().manual_seed(1))
    ref = DenseCache(lay, 1, 40)
    fp8 = kind == "float8_e4m3"
    if fp8:  # the first forward set 4 x its largest |K| (|V|) per head / 448
        k0, v0 = fedkv[0][1], fedkv[0][2]
        torch.testing.assert_close(cache.k_scale[0], k0.abs().amax(dim=(0, 2, 3)) * FP8_HEADROOM / FP8_MAX)
        torch.testing.assert_close(cache.v_scale[1], v0.abs().amax(dim=(0, 2, 3)) * FP8_HEADROOM / FP8_MAX)
    for i, (q, k, v) in enumerate(fedkv):
        T = q.shape[2]
        plan = ref.plan(ref.lengths[:, None] + torch.arange(T))
        got = []
        for layer in range(lay.n_layers):
            if fp8:
                kr = to_fp8(k, cache.k_scale[layer]).float() * cache.k_scale[layer][None, :, None, None]
                vr = to_fp8(v, cache.v_scale[layer]).float() * cache.v_scale[layer][None, :, None, None]
            else:
                kr, vr = k.to(DTYPES[kind]).float(), v.to(DTYPES[kind]).float()
            got.append(ref.attend(layer, q, kr, vr, plan))
        assert (torch.cat(got, 1) - outs[i]).abs().max().item() <= LIMIT, i
    pos, k_read, _ = cache.read(0, 0)
    assert k_read.dtype == torch.float32 and len(pos) == 32


def test_bytes_follow_the_storage_dtype_and_fp8_saturates_and_resets():
    lay = layout()
    sizes = {kind: DenseCache(lay, 2, 64, kv_dtype=kind) for kind in ("auto", *DTYPES)}
    assert {k: c.nbytes() for k, c in sizes.items()} == {
        "auto": 2 * 2 * 2 * 2 * 64 * 16 * 4, "bfloat16": 2 * 2 * 2 * 2 * 64 * 16 * 2,
        "float16": 2 * 2 * 2 * 2 * 64 * 16 * 2, "float8_e4m3": 2 * 2 * 2 * 2 * 64 * 16}
    for kind, c in sizes.items():
        assert DenseCache.planned_bytes(lay, 2, 64, kv_dtype=kind) == c.nbytes() + (32 if kind == "float8_e4m3" else 0)
        assert c.read_bytes(10) == 2 * (10 + 7) * 2 * 2 * 16 * c.kv_dtype.itemsize  # layer 1 sees 7
    fp8 = sizes["float8_e4m3"]
    x = torch.ones(2, 2, 3, 16)
    plan = fp8.plan(torch.arange(3).expand(2, -1))
    fp8.attend(0, torch.ones(2, 4, 3, 16), x, x, plan)
    assert fp8.scaled[0] and not fp8.scaled[1]
    big = torch.full((2, 2, 1, 16), 100.0)  # 100 x the first forward's largest: saturates at 4x
    plan = fp8.plan(torch.full((2, 1), 3))
    fp8.attend(0, torch.ones(2, 4, 1, 16), big, big, plan)
    assert fp8.read(0, 0)[1][:, 3].max().item() == pytest.approx(FP8_HEADROOM)
    fp8.reset()
    assert not any(fp8.scaled) and torch.equal(fp8.k_scale[0], torch.ones(2))


def test_an_unknown_kv_dtype_is_refused_with_the_choices():
    with pytest.raises(SetupError, match="kv_dtype must be one of.*bfloat16.*float8_e4m3"):
        DenseCache(layout(), 1, 8, kv_dtype="int8")
    with pytest.raises(SetupError, match="kv_dtype must be one of"):
        DenseCache.planned_bytes(layout(), 1, 8, kv_dtype="fp8")


@pytest.mark.parametrize("kind", list(DTYPES))
def test_a_paged_cache_of_each_kv_dtype_equals_dense_of_that_dtype(kind):
    """The same forwards into paged (blocks of 4, so every read crosses blocks) and dense of one
    kv_dtype: the same stored values (fp8: the same scales, set by the first forward), so the
    prefill (gathered, widened, torch's attention) and the decode steps (the native kernel
    through the block table on a CPU) agree to float summation order; the stored blocks
    read back as dense's slots; copy-on-write and slot moves copy the stored bytes."""
    lay = layout()
    dense, paged = DenseCache(lay, 1, 40, kv_dtype=kind), PagedCache(lay, 1, 40, block_size=4, kv_dtype=kind)
    assert paged.k[0].dtype == DTYPES[kind] and paged.lossy and paged.native_read == (native.problem() is None)
    got, _ = fed(paged, 20, torch.Generator().manual_seed(2))
    want, _ = fed(dense, 20, torch.Generator().manual_seed(2))
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a - b).abs().max().item() <= LIMIT, i
    if kind == "float8_e4m3":
        assert all(torch.equal(a, b) for a, b in zip(paged.k_scale + paged.v_scale, dense.k_scale + dense.v_scale))
    for layer in range(lay.n_layers):
        (pp, pk, pv), (dp, dk, dv) = paged.read(layer, 0), dense.read(layer, 0)
        assert torch.equal(pp, dp) and torch.equal(pk, dk) and torch.equal(pv, dv) and pk.dtype == torch.float32
    blocks = paged.table[0, :2].tolist()
    free = [b for b in range(paged.num_blocks) if b not in paged.table[0].tolist()][:2]
    paged._copy_blocks(tuple(blocks), tuple(free))  # copy-on-write's copy, byte for byte
    for pool in paged.k + paged.v:
        assert torch.equal(pool[free].view(torch.uint8), pool[blocks].view(torch.uint8))
    paged._move_slots(0, [1, 2], [30, 31])
    assert torch.equal(paged.read(1, 0)[1][:, 30:32], dense.read(1, 0)[1][:, 1:3])


def test_a_reset_fp8_paged_cache_maps_no_prefix_stored_at_the_old_scales():
    """reset sets fp8's scales over; blocks a prompt left behind were stored at the old ones,
    so the same prompt again computes them (bf16 keeps mapping them: no scales)."""
    lay = layout()
    for kind, reused in (("float8_e4m3", 0), ("bfloat16", 8)):
        c = PagedCache(lay, 1, 40, block_size=4, kv_dtype=kind)
        prompt = list(range(10))
        fed(c, 0, torch.Generator().manual_seed(3), T0=10)
        c.remember_prefix([prompt])
        c.reset()
        assert c.reuse_prefix([prompt]) == [reused], kind


def test_paged_kv_dtype_bytes_and_refusals():
    """The pool at the storage dtype (fp8's scales in planned_bytes, as dense's); an unknown
    kv_dtype and the Triton kernel (the model's dtype only) asked for another dtype refused."""
    lay = layout()
    for kind in ("auto", *DTYPES):
        c = PagedCache(lay, 2, 64, block_size=16, kv_dtype=kind)
        elem = c.kv_dtype.itemsize
        assert c.nbytes() == 2 * 2 * 2 * 2 * 64 * 16 * elem and c.block_bytes == 2 * 2 * 2 * 16 * 16 * elem
        assert PagedCache.planned_bytes(lay, 2, 64, kv_dtype=kind) == c.nbytes() + (32 if kind == "float8_e4m3" else 0)
        assert c.read_bytes(10) == 2 * (10 + 7) * 2 * 2 * 16 * elem
        assert c.impl == "reference"  # a CPU
    with pytest.raises(SetupError, match="kv_dtype must be one of"):
        PagedCache(lay, 1, 8, kv_dtype="fp8")
    with pytest.raises(SetupError, match="impl=triton reads K/V in the model's dtype.*bfloat16 needs impl=ref"):
        PagedCache(lay, 1, 8, kv_dtype="bfloat16", impl="triton")


@needs_native
@pytest.mark.parametrize("kind", ["bfloat16", "float8_e4m3"])
@pytest.mark.parametrize("backend", [DenseCache, PagedCache])
def test_the_compiled_cpu_step_over_a_kv_dtype_cache_equals_the_eager_one(kind, backend, tiny_llama):
    """The compiled static step (dynamo's eager backend: traced like inductor's, fast to build)
    writes and reads the stored dtype as the eager path does: the same logits to float rounding."""
    from decodelab.decoding.compiled import StaticDecoder
    from decodelab.decoding.prefill import prefill
    from decodelab.decoding.text import make_cache

    model = tiny_llama.model
    factory = lambda lay, b, c: backend(lay, b, c, kv_dtype=kind)  # noqa: E731
    prompt = list(range(3, 40))
    logits = []
    for compiled in (False, True):
        cache = make_cache(model, 1, 64, factory)
        dec = StaticDecoder(model, cache, mode="compile", backend="eager") if compiled else None
        tok = prefill(model, cache, [prompt]).argmax(-1)
        steps = []
        for _ in range(6):
            if compiled:
                out = dec.step(tok)
            else:
                out = model(tok[:, None], cache.lengths[:, None], cache)[:, -1]
            steps.append(out)
            tok = out.argmax(-1)
        logits.append(torch.stack(steps))
    assert (logits[0] - logits[1]).abs().max().item() <= 1e-4
