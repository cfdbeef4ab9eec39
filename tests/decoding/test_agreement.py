"""decoding.agreement.compare: KL, top-1 and |dlogit| against numbers worked out by hand."""

from __future__ import annotations

import math

import torch

from decodelab.decoding.agreement import compare


def test_kl_top1_and_dlogit_by_hand():
    ref = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1]], dtype=torch.float64))
    other = torch.log(torch.tensor([[0.25, 0.75], [0.9, 0.1]], dtype=torch.float64))
    r = compare(ref, other, tokens=[1, 0])
    # KL(p || q) row 0: 0.5 ln 2 + 0.5 ln(2/3) = 0.143841; row 1: 0
    assert math.isclose(r["kl"], 0.143841 / 2, rel_tol=1e-5)
    assert r["top1"] == 0.5  # row 0: argmax 0 (a tie goes to the first) vs 1; row 1: both 0
    assert math.isclose(r["max_abs_dlogit"], math.log(2), rel_tol=1e-12)  # ln 0.5 - ln 0.25
    assert r["first_diff"] == 0 and r["positions"] == 2  # token 1 at row 0 is not ref's argmax


def test_kl_of_equal_or_nearly_equal_logits_is_never_negative():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        x = 30 * torch.randn(64, 4096, generator=g, dtype=dtype)
        for y in (x, x + 1e-6 * torch.randn(64, 4096, generator=g, dtype=dtype), x + 5.0):  # + 5: same softmax
            assert compare(x, y)["kl"] >= 0.0
