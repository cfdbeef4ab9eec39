"""The native kernels of the batch-1 decode roofline (models/kernels/native_kernels.cpp):
`f32_mv`, fp32 one-row products streamed from the weight's [in, out] rows, against float64
products; and the int4 kernel's AVX-512 VNNI path, bit-identical to its AVX2 path (and to
the many-row kernel's row) wherever the CPU has both."""

from __future__ import annotations

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


@pytest.mark.parametrize("k,n,group", [(576, 960, 64), (576, 576, 32), (1536, 576, 128), (512, 64, 128),
                                       (64, 7, 32), (256, 8, 256), (576, 1030, 64)])
def test_int4_vnni_is_bit_identical_to_avx2(k, n, group):
    """The one-row int4 kernel with AVX-512 VNNI against the AVX2 one, and both against the
    many-row kernel's first row: equal to the bit (the same integer sums, the same float
    operations lane by lane; the shifts' share in one compiled form)."""
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


def test_empty_products_are_empty():
    """No rows, or no outputs: an empty result, not an out-of-memory error."""
    assert torch.ops.decodelab.f32_mv(torch.randn(1, 16), torch.randn(16, 0)).shape == (1, 0)
    p = QuantProj(torch.randn(64, 16), None, WeightOptions("int4", 32, kernel="native"))
    assert torch.ops.decodelab.int4_mm(torch.randn(0, 64), p.codes, p.scales, p.shifts, 32).shape == (0, 16)
    p8 = QuantProj(torch.randn(64, 16), None, WeightOptions("int8", kernel="native"))
    assert torch.ops.decodelab.int8_mm(torch.randn(0, 64), p8.codes, p8.scales).shape == (0, 16)
