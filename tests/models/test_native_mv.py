"""The native kernels of the batch-1 decode roofline (models/kernels/native_kernels.cpp):
`f32_mv`, fp32 one-row products streamed from the weight's [in, out] rows, against float64
products; and the int4 kernel's AVX-512 VNNI path, bit-identical to its AVX2 path (and to
the many-row kernel's row) wherever the CPU has both."""

from __future__ import annotations

import collections
import os
import subprocess

import pytest
import torch

from decodelab.models import matmul, native
from decodelab.models.matmul import PackedWeight, project
from decodelab.models.quantize import QuantProj, WeightOptions

needs_native = pytest.mark.skipif(native.problem() is not None, reason=f"native kernels: {native.problem()}")
pytestmark = needs_native


@pytest.mark.parametrize("k,n", [(1, 8), (3, 16), (4, 8), (7, 24), (64, 256), (576, 960), (1537, 40)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_f32_mv_against_float64(k, n, bias, threads):
    """|error| within fp32 summation's bound: K products summed, each rounding at most
    2^-24 relative, so K x 2^-24 x sum |x_k w_kn| (+ the bias)."""
    g = torch.Generator().manual_seed(k * 1000 + n)
    x, w = torch.randn(1, k, generator=g), torch.randn(k, n, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = torch.ops.decodelab.f32_mv(x, w, b)
        again = torch.ops.decodelab.f32_mv(x, w, b)
    finally:
        torch.set_num_threads(before)
    ref = x.double() @ w.double() + (b.double() if bias else 0)
    bound = (k + 1) * 2.0**-24 * ((x.double().abs() @ w.double().abs()) + (b.double().abs() if bias else 0))
    assert y.shape == (1, n) and y.dtype == torch.float32
    assert ((y.double() - ref).abs() <= bound + 1e-30).all()
    assert torch.equal(y, again)  # the same split, the same sums


def test_project_takes_f32_mv_for_one_row_and_refuses_what_it_cannot_take():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 1, 96, generator=g), torch.randn(96, 200, generator=g)
    assert matmul.native_mv_ready()
    with torch.no_grad():
        y = project(x, w, None, "onednn", PackedWeight())
        ref = project(x, w, None, "reference", PackedWeight())  # x @ W: torch's own kernel
    assert torch.equal(y[0], torch.ops.decodelab.f32_mv(x[0], w)) and not torch.equal(y, ref)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)
    odd = torch.randn(96, 13, generator=g)  # outputs not a multiple of 8: torch's kernel serves
    with torch.no_grad():
        assert torch.equal(project(x, odd, None, "onednn", PackedWeight()), x @ odd)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        torch.ops.decodelab.f32_mv(x[0], odd)
    with pytest.raises(RuntimeError, match="one row"):
        torch.ops.decodelab.f32_mv(torch.randn(2, 96), w)


# (in, out, group) of the int4 one-row kernels' bit-identity checks
INT4_SHAPES = [(576, 960, 64), (576, 576, 32), (1536, 576, 128), (1536, 576, 64), (512, 64, 128), (64, 7, 32),
               (256, 8, 256), (576, 1030, 64)]


@pytest.mark.parametrize("k,n,group", INT4_SHAPES)
def test_int4_vnni_is_bit_identical_to_avx2(k, n, group):
    """The one-row int4 kernel with AVX-512 VNNI against the AVX2 one, and both against the
    many-row kernel's first row: equal to the bit (the same integer sums, the same float
    operations lane by lane, the shifts' share added in 8-lane fused multiply-adds alike)."""
    if torch.ops.decodelab.isa(-1) < 1:
        pytest.skip("this CPU has no AVX-512 VNNI: only the AVX2 path runs here")
    g = torch.Generator().manual_seed(k + n + group)
    p = QuantProj(torch.randn(k, n, generator=g), None, WeightOptions("int4", group, kernel="native"))
    x = torch.randn(3, k, generator=g)
    try:
        torch.ops.decodelab.isa(0)
        avx2, many = p(x[:1]), p(x)[:1]
        assert torch.ops.decodelab.isa(-1) == 0
    finally:
        torch.ops.decodelab.isa(1)
    vnni = p(x[:1])
    assert torch.ops.decodelab.isa(-1) == 1
    assert torch.equal(vnni, avx2) and torch.equal(vnni, many)


SIMDE = "/usr/include/simde/x86/avx512.h"  # Debian's libsimde-dev (.ci/run installs it where apt can)
# AVX-512 intrinsics SIMDe 0.7.4 does not emulate, written out lane by lane
_EMULATION = r"""
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
static inline simde__m512 emu_cvtepi32_ps(simde__m512i a) {
    int32_t i[16]; float f[16]; simde_mm512_storeu_si512((void*)i, a);
    for (int k = 0; k < 16; k++) f[k] = (float)i[k];
    return simde_mm512_loadu_ps(f);
}
static inline simde__m256 emu_extractf32x8_ps(simde__m512 a, int hi) {
    float f[16]; simde_mm512_storeu_ps(f, a); return simde_mm256_loadu_ps(f + 8 * hi);
}
#undef _mm512_cvtepi32_ps
#undef _mm512_extractf32x8_ps
#define _mm512_cvtepi32_ps emu_cvtepi32_ps
#define _mm512_extractf32x8_ps emu_extractf32x8_ps
#include "products.cpp"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <random>
#include <vector>
int main(int argc, char** argv) {  /* argv: in, out, group of each shape in turn */
    std::mt19937 rng(1);
    std::uniform_real_distribution<float> u(-1, 1);
    for (int a = 1; a + 2 < argc; a += 3) {
        int K = atoi(argv[a]), N = atoi(argv[a + 1]), g = atoi(argv[a + 2]), G = K / g, M = 3;
        std::vector<uint8_t> nib(N * K / 2);
        std::vector<float> sc(N * G), sh(N * G), x(M * K), avx2(N), vnni(N), many(M * N);
        for (auto& b : nib) b = rng() & 255;
        for (auto& v : sc) v = u(rng) * 0.1f;
        for (auto& v : sh) v = u(rng) * 0.1f;
        for (auto& v : x) v = u(rng) * 3;
        dl_isa(0);
        dl_int4_mm(x.data(), 1, K, nib.data(), sc.data(), sh.data(), g, avx2.data(), N);
        int isa = dl_isa(1);
        dl_int4_mm(x.data(), 1, K, nib.data(), sc.data(), sh.data(), g, vnni.data(), N);
        dl_int4_mm(x.data(), M, K, nib.data(), sc.data(), sh.data(), g, many.data(), N);
        printf("%d %d %d isa=%d vnni_equal=%d many_equal=%d\n", K, N, g, isa, !memcmp(avx2.data(), vnni.data(), 4 * N),
               !memcmp(avx2.data(), many.data(), 4 * N));
    }
    return 0;
}
"""


@pytest.mark.skipif(not os.path.isfile(SIMDE), reason=f"no SIMDe headers ({SIMDE}: Debian libsimde-dev)")
def test_int4_vnni_form_is_bit_identical_under_avx512_emulation(tmp_path):
    """The int4 products' VNNI form, compiled with SIMDe's portable AVX-512 intrinsics
    (DL_EMULATED_AVX512), on any CPU: bit-identical to the AVX2 form and to the many-row
    kernel's first row at the shapes of test_int4_vnni_is_bit_identical_to_avx2 (and a group
    of 96, straddling block pairs), so a CPU without AVX-512 (this CI's, often) still checks
    the code that AVX-512 CPUs run."""
    src = next(s for s in native.sources() if s.name == "native_kernels.cpp").read_text()
    end = src.index("/* -- the end of the int4 products")
    (tmp_path / "products.cpp").write_text(src[:end] + "}  /* extern \"C\" */\n")
    (tmp_path / "main.cpp").write_text(_EMULATION)
    exe = tmp_path / "emulated"
    subprocess.run(["g++", "-O1", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-DDL_EMULATED_AVX512", "main.cpp", "-o",
                    str(exe)], cwd=tmp_path, check=True, capture_output=True, timeout=300)
    shapes = INT4_SHAPES + [(192, 12, 96)]
    args = [str(v) for shape in shapes for v in shape]
    rows = subprocess.run([str(exe), *args], check=True, capture_output=True, text=True, timeout=60).stdout.splitlines()
    assert len(rows) == len(shapes)
    for row in rows:
        assert "isa=1 vnni_equal=1 many_equal=1" in row, row


def test_empty_products_are_empty():
    """No rows, or no outputs: an empty result, not an out-of-memory error."""
    assert torch.ops.decodelab.f32_mv(torch.randn(1, 16), torch.randn(16, 0)).shape == (1, 0)
    p = QuantProj(torch.randn(64, 16), None, WeightOptions("int4", 32, kernel="native"))
    assert torch.ops.decodelab.int4_mm(torch.randn(0, 64), p.codes, p.scales, p.shifts, 32).shape == (0, 16)
    p8 = QuantProj(torch.randn(64, 16), None, WeightOptions("int8", kernel="native"))
    assert torch.ops.decodelab.int8_mm(torch.randn(0, 64), p8.codes, p8.scales).shape == (0, 16)


@pytest.mark.parametrize("shape", [(1, 1, 576), (2, 3, 64), (70, 37), (5, 7)])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_against_float64(shape, offset):
    """decodelab::rms_norm (`Transformer.share_kernels`' norms): within a few fp32 roundings
    of the float64 norm of the same inputs (relative 1e-6 of the largest output; the n-term
    sum of squares rounds at most n x 2^-24 relative, halved by the square root), Llama's
    order w (x r) and Gemma's (x r)(1 + w); rows split over threads from 64 rows on give the
    same bits as one thread (each row's sum in one order)."""
    from decodelab.models.transformer import RMSNorm

    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g) * 3
    w = torch.randn(shape[-1], generator=g) * 0.2 + (0.0 if offset else 1.0)
    before, ys = torch.get_num_threads(), []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            ys.append(native.rms_norm(x, w, 1e-5, offset))
    finally:
        torch.set_num_threads(before)
    y = ys[0]
    assert torch.equal(ys[1], y)  # one order per row, whatever the threads
    xd = x.double()
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * (offset + w.double())
    n = shape[-1]
    assert y.shape == x.shape and y.dtype == torch.float32
    assert (y.double() - ref).abs().max().item() <= (n * 2.0**-24 + 4 * 2.0**-24) * ref.abs().max().item()
    norm = RMSNorm(n, 1e-5, offset)
    with torch.no_grad():
        norm.weight.copy_(w)
    torch.testing.assert_close(y, norm(x), rtol=1e-5, atol=1e-5)  # torch's own norm, another order
    norm.native = True
    assert torch.equal(norm(x), y)


def test_rms_norm_refuses_what_it_cannot_take():
    with pytest.raises(RuntimeError, match="float32"):
        native.rms_norm(torch.ones(2, 8, dtype=torch.float64), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match=r"the weight must be float32 \[8\]"):
        native.rms_norm(torch.ones(2, 8), torch.ones(7), 1e-5)


@pytest.mark.parametrize("positions", [[[0, 1, 2]], [[5], [8191]], [[100, 101, 102, 103]]])
def test_rope_cos_sin_against_torch(positions):
    """decodelab::rope_cos_sin: the angles rope_cos_sin computes (float32 products), their
    cosf / sinf within 2 ulp-ish (1e-6 absolute) of torch's cos and sin, in its shape
    [B, 1, T, D]; positions of any integer type."""
    from decodelab.models.transformer import rope_cos_sin

    inv = 1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64))
    pos = torch.tensor(positions)
    cos, sin = native.rope_cos_sin(inv, pos)
    want_cos, want_sin = rope_cos_sin(inv, pos, torch.float32)
    assert cos.shape == want_cos.shape == (len(positions), 1, len(positions[0]), 64)
    torch.testing.assert_close(cos, want_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, want_sin, rtol=0, atol=1e-6)
    assert torch.equal(native.rope_cos_sin(inv, pos.int())[0], cos)
    with pytest.raises(RuntimeError, match="positions must be integers"):
        native.rope_cos_sin(inv, pos.float())


@pytest.mark.parametrize("positions", [[[3, 4]], [[7]]])
def test_shared_kernel_ops_pass_torchs_operator_checks(positions):
    """The schema, the fake (meta) implementation and the real op agree (torch.library.opcheck),
    so inductor reads their outputs right."""
    x = torch.randn(2, 3, 16)
    torch.library.opcheck(torch.ops.decodelab.rms_norm.default, (x, torch.rand(16), 1e-5, 0.0),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.decodelab.rope_cos_sin.default, (torch.rand(8), torch.tensor(positions)),
                          test_utils=("test_schema", "test_faketensor"))


def test_a_model_shares_its_kernels_only_where_they_run():
    """share_kernels is refused for a model the native kernels cannot serve (bf16 here), naming
    what it needs; int8 weights (fp32 activations) and fp32 keep torch's norms."""
    from decodelab.models.errors import SetupError
    from decodelab.models.loading import random_model
    from tests.conftest import TINY

    lm = random_model(TINY["llama"])
    with pytest.raises(SetupError, match="float32 model and a CPU"):
        lm.model.to(torch.bfloat16).share_kernels()
    lm = random_model(TINY["llama"])
    assert not WeightOptions("int8", kernel="native").apply(lm.model).shared_kernels
    shared = WeightOptions("int4", kernel="native").apply(lm.model)
    assert shared.shared_kernels
    from decodelab.cache.base import CacheLayout
    from decodelab.decoding.drafters import EarlyExit

    # an early-exit self-draft's cache attends as its model does (the wrapper's own model's flag)
    assert CacheLayout.of(shared).native_decode and CacheLayout.of(EarlyExit(shared, 1)).native_decode
    assert not CacheLayout.of(lm.model).native_decode


@pytest.mark.parametrize("rows", [1, 3, 33])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_int4_mm_normed_is_the_product_of_the_norm(rows, offset):
    """decodelab::int4_mm_normed (a shared-kernels model's norm fused into the int4 product
    that reads it) gives int4_mm of rms_norm's output to the bit, and passes opcheck."""
    q = QuantProj(torch.randn(64, 96), None, WeightOptions("int4", 32, kernel="native"))
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 64, generator=g) * 2, torch.randn(64, generator=g) * 0.2 + 1 - offset
    ops = torch.ops.decodelab
    got = ops.int4_mm_normed(x, q.codes, q.scales, q.shifts, q.group_size, w, 1e-6, offset)
    want = ops.int4_mm(native.rms_norm(x, w, 1e-6, offset), q.codes, q.scales, q.shifts, q.group_size)
    assert torch.equal(got, want)
    torch.library.opcheck(ops.int4_mm_normed.default, (x, q.codes, q.scales, q.shifts, q.group_size, w, 1e-6, offset),
                          test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(RuntimeError, match=r"norm's weight must be float32 \[64\]"):
        ops.int4_mm_normed(x, q.codes, q.scales, q.shifts, q.group_size, w[:10], 1e-6, offset)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("rows", [(1, 1), (2, 5)])
def test_a_fused_int4_block_is_its_steps_to_the_bit(monkeypatch, tiny_models, family, rows):
    """A shared-kernels int4 model's Llama-style blocks run as two operators around their
    attention (`Block.fuses`: int4_qkv_rope, int4_block_out); their logits and the K/V they
    store are those of the steps one by one (`Block.fuse = False`) to the bit, for a prefill
    and the decode step after it (qwen2: a qkv bias)."""
    from decodelab.models.transformer import Block
    from tests.conftest import cache_for

    model = WeightOptions("int4", kernel="native").apply(tiny_models[family].model)
    B, T = rows
    assert all(b.fuses(torch.zeros(B, T, model.cfg.dim)) for b in model.layers)
    ids = torch.randint(0, model.cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(T))
    pos = torch.arange(T).expand(B, T)
    outs = {}
    for fuse in (True, False):
        monkeypatch.setattr(Block, "fuse", fuse)
        cache = cache_for(model, B, 16)
        with torch.no_grad(), torch.profiler.profile() as prof:
            first = model(ids, pos, cache)
            step = model(first[:, -1:].argmax(-1), torch.full((B, 1), T), cache)
        calls = collections.Counter(e.name for e in prof.events() if e.name.startswith("decodelab::int4"))
        outs[fuse] = first, step, cache.k[0].clone(), cache.v[0].clone(), calls
    for a, b in zip(outs[True][:4], outs[False][:4]):
        assert torch.equal(a, b), (a - b).abs().max().item()
    n = model.cfg.n_layers  # 2 forwards: per block the two operators, and their 4 products as int4_mm events
    assert outs[True][4] == {"decodelab::int4_qkv_rope": 2 * n, "decodelab::int4_block_out": 2 * n,
                             "decodelab::int4_mm": 2 * 4 * n}
    assert outs[False][4] == {"decodelab::int4_mm_normed": 2 * 2 * n, "decodelab::int4_mm": 2 * 2 * n}
    with torch.enable_grad():  # the operators have no autograd: a forward that wants gradients takes the steps
        assert not model.layers[0].fuses(torch.zeros(B, T, model.cfg.dim, requires_grad=True))


# rows x 128 SiLU inputs: 1 and 7 under ATen's grain (int4_block_out's own SiLU loop where ATen runs
# its AVX2 kernels; elsewhere ATen's call, which this then checks), 256 and 300 at or over it (ATen's
# SiLU, split among threads); gate values spread past exp's overflow and underflow (|x| > 88)
@pytest.mark.parametrize("rows", [1, 7, 256, 300])
def test_int4_block_out_is_its_steps_to_the_bit(rows):
    """decodelab::int4_block_out gives the steps one by one to the bit: wo, the residual add,
    rms_norm, gate_up, torch's SiLU times up, down, the residual add."""
    ops = torch.ops.decodelab
    g = torch.Generator().manual_seed(rows)
    wo = QuantProj(torch.randn(64, 64, generator=g), None, WeightOptions("int4", 32, kernel="native"))
    gu = QuantProj(torch.randn(64, 256, generator=g) * 12, None, WeightOptions("int4", 32, kernel="native"))
    dn = QuantProj(torch.randn(128, 64, generator=g), None, WeightOptions("int4", 32, kernel="native"))
    attn, x = torch.randn(rows, 64, generator=g), torch.randn(rows, 64, generator=g) * 8
    w = torch.rand(64, generator=g) * 4 + 0.5
    t = lambda p: (p.codes, p.scales, p.shifts, 32)  # noqa: E731
    got = ops.int4_block_out(attn, x, *t(wo), w, 1e-6, 0.0, *t(gu), *t(dn))
    x1 = x + ops.int4_mm(attn, *t(wo))
    h = ops.int4_mm(native.rms_norm(x1, w, 1e-6, 0.0), *t(gu))
    gate, up = h.chunk(2, -1)
    assert gate.min() < -88 and gate.max() > 88  # exp(-x) overflows to inf (SiLU -0) and underflows to 0
    want = x1 + ops.int4_mm(torch.nn.functional.silu(gate) * up, *t(dn))
    assert torch.equal(got, want), (got - want).abs().max().item()


def test_the_fused_int4_block_operators_check_their_inputs():
    """int4_qkv_rope and int4_block_out pass torch's operator checks (their fakes give
    inductor the right shapes) and refuse mismatched weights, norms and angles by name."""
    ops = torch.ops.decodelab
    g = torch.Generator().manual_seed(0)
    qkv = QuantProj(torch.randn(64, 128), None, WeightOptions("int4", 32, kernel="native"))  # q 64, k/v 32
    wo = QuantProj(torch.randn(64, 64), None, WeightOptions("int4", 32, kernel="native"))
    gu = QuantProj(torch.randn(64, 256), None, WeightOptions("int4", 32, kernel="native"))
    dn = QuantProj(torch.randn(128, 64), None, WeightOptions("int4", 32, kernel="native"))
    t = lambda p: (p.codes, p.scales, p.shifts)  # noqa: E731
    x, w = torch.randn(3, 64, generator=g), torch.rand(64, generator=g) + 0.5
    cos, sin = torch.rand(3, 16, generator=g), torch.rand(3, 16, generator=g)
    args = (x, w, 1e-6, 0.0, *t(qkv), 32, None, cos, sin, 64, 32, 16)
    torch.library.opcheck(ops.int4_qkv_rope.default, args, test_utils=("test_schema", "test_faketensor"))
    out_args = (torch.randn(3, 64, generator=g), x, *t(wo), 32, w, 1e-6, 0.0, *t(gu), 32, *t(dn), 32)
    torch.library.opcheck(ops.int4_block_out.default, out_args, test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(RuntimeError, match=r"q 64 \+ 2 x kv 16 \(both > 0\) must be the weight's 128 outputs"):
        ops.int4_qkv_rope(*args[:11], 64, 16, 16)
    with pytest.raises(RuntimeError, match=r"q 160 \+ 2 x kv -16 \(both > 0\)"):
        ops.int4_qkv_rope(*args[:11], 160, -16, 16)
    with pytest.raises(RuntimeError, match=r"cos and sin must be float32 \[3, 16\]"):
        ops.int4_qkv_rope(*args[:9], cos[:2], sin, 64, 32, 16)
    with pytest.raises(RuntimeError, match="a weight of 64 inputs where 128 come in"):
        ops.int4_block_out(*out_args[:13], *t(gu), 32)
    with pytest.raises(RuntimeError, match=r"scales and shifts must hold \[64, 2\]"):
        ops.int4_block_out(*out_args[:3], gu.scales, *out_args[4:])


# paged and sliding: 13.6 s in the default run on a 2-core Zen 3 (session 53)
@pytest.mark.parametrize("backend", ["dense", "int4",
                                     *(pytest.param(b, marks=pytest.mark.slow) for b in ("paged", "sliding"))])
def test_fused_int4_blocks_sample_as_their_steps_on_every_cache(monkeypatch, tiny_models, backend):
    """Through `generate`, eager and compiled (dynamo's eager backend: the same graph, the
    operators run for real), on every cache: prompts of two lengths (a padded, packed prefill:
    `int4_block_out` on the valid rows, the qkv product and RoPE one by one), then seeded
    temperature sampling, which any logit bit moves; the fused and unfused models give the
    same tokens."""
    from functools import partial

    import decodelab.decoding.runner as runner
    from decodelab.cache.int4 import QuantizedCache
    from decodelab.cache.paged import PagedCache
    from decodelab.cache.sliding import SlidingCache
    from decodelab.decoding import SamplingDecoder, generate
    from decodelab.models.transformer import Block
    from tests.conftest import cache_for, random_ids

    monkeypatch.setattr(runner, "BACKEND", "eager")
    factory = {"dense": None, "paged": partial(PagedCache, block_size=4),
               "sliding": partial(SlidingCache, window=6, sinks=2, rollback=3),
               "int4": partial(QuantizedCache, group_size=32, residual=4)}[backend]
    model = WeightOptions("int4", kernel="native").apply(tiny_models["llama"].model)
    prompts = [random_ids(11, seed=1), random_ids(5, seed=2)]
    for compile in (False, True):
        got = {}
        for fuse in (True, False):
            monkeypatch.setattr(Block, "fuse", fuse)
            cache = cache_for(model, 2, 40) if factory is None else cache_for(model, 2, 40, factory)
            with torch.profiler.profile() as prof:
                got[fuse] = generate(model, cache, SamplingDecoder(temperature=0.8, top_k=20, seed=3), prompts, 12,
                                     compile=compile).tokens
            fused = sum(e.name == "decodelab::int4_block_out" for e in prof.events())
            assert (fused > 0) == fuse  # (generate runs without gradients: the blocks fuse)
        assert got[True] == got[False], (backend, compile)


def test_fused_int4_blocks_take_a_flat_batch_as_their_steps(monkeypatch, tiny_models):
    """`Transformer.flat_hidden` (the runner's flat token batches: RoPE angles [N, 1, D]) gives
    the same bits fused and unfused, with an attention that reads q, k and v elementwise (so
    any bit of the rotated q, k or of v would show)."""
    from decodelab.models.transformer import Block

    model = WeightOptions("int4", kernel="native").apply(tiny_models["llama"].model)
    ids = torch.randint(0, 256, (7,), generator=torch.Generator().manual_seed(4))
    pos = torch.tensor([0, 1, 2, 9, 10, 3, 4])

    def attend(layer, q, k, v):  # [N, Hq, D], [N, Hkv, D] x 2
        g = q.shape[1] // k.shape[1]
        return q * 0.5 + k.repeat_interleave(g, 1) * v.repeat_interleave(g, 1)

    assert model.layers[0].fuses(torch.zeros(7, model.cfg.dim))
    out = {}
    for fuse in (True, False):
        monkeypatch.setattr(Block, "fuse", fuse)
        with torch.no_grad():
            out[fuse] = model.flat_hidden(ids, pos, attend)
    assert torch.equal(out[True], out[False])


def test_the_native_argmax_is_torchs():
    """native.argmax (greedy decoding's, where the kernels are loaded) gives torch.argmax(x, -1):
    random rows of several lengths (tails past the 8 lanes), ties (the first), -0 beside +0,
    all -inf, NaN rows (torch's answer), and torch's own for what the kernel does not take;
    the operator passes opcheck."""
    native.problem()  # loaded
    g = torch.Generator().manual_seed(0)
    cases = [torch.randn(*s, generator=g) for s in [(1, 49152), (3, 37), (2, 5, 8), (1, 1), (4, 9), (7,)]]
    tie = torch.zeros(2, 30)
    tie[0, 3] = tie[0, 20] = 1.0
    tie[1, 5], tie[1, 2] = 0.0, -0.0
    nan = torch.randn(3, 50, generator=g)
    nan[0, 10] = nan[2, 49] = float("nan")
    cases += [tie, torch.full((2, 20), -float("inf")), nan, torch.randn(2, 9, dtype=torch.float64)]
    for x in cases:
        got = native.argmax(x)
        assert got.dtype == torch.long and torch.equal(got, x.argmax(-1)), x.shape
    assert native.argmax(tie).tolist() == [3, 0]
    torch.library.opcheck(torch.ops.decodelab.argmax.default, (cases[1],),
                          test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(RuntimeError, match="float32 CPU tensor with a non-empty last dimension"):
        torch.ops.decodelab.argmax(torch.zeros(2, 0))
