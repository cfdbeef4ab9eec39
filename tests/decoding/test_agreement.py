"""decoding.agreement.compare: KL, top-1 and |dlogit| against numbers worked out by hand."""

from __future__ import annotations

import math

import torch

from decodelab.decoding.agreement import Thresholds, compare, pool


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


def test_pool_weights_by_positions_and_thresholds_judge_it():
    rows = [{"max_abs_dlogit": 0.1, "kl": 0.02, "top1": 1.0, "positions": 30, "first_diff": None},
            {"max_abs_dlogit": 0.3, "kl": 0.10, "top1": 0.9, "positions": 10, "first_diff": 4}]
    p = pool(rows)
    # KL (0.02 x 30 + 0.10 x 10) / 40 = 0.04; top-1 (30 + 9) / 40 = 0.975
    assert p == {"max_abs_dlogit": 0.3, "mean_kl": 0.04, "top1": 0.975, "positions": 40, "first_diff": 4,
                 "prompts_differing": 1, "prompts": 2}
    assert Thresholds(max_kl=0.05, min_top1=0.97, free_identical=False).failures(p) == []
    fails = Thresholds(max_abs_dlogit=0.2, max_kl=0.03, min_top1=0.98, free_identical=True).failures(p)
    assert fails == ["max |dlogit| 0.3 > 0.2", "mean KL 0.04 > 0.03", "top-1 0.9750 < 0.9800",
                     "free-running output differs from the reference's at token 4 (1/2 prompts)"]
    assert Thresholds(free_identical=True).failures(p, judge_free=False) == []  # sampled output: not judged
    assert Thresholds(max_kl=float("nan")).failures({**p, "mean_kl": float("nan")})  # NaN exceeds all
    assert Thresholds(max_kl=-1, min_top1=2, free_identical="yes").problems() == [
        "agreement.max_kl must be null (not judged) or a number >= 0, got -1",
        "agreement.min_top1 must be null (not judged) or a number in [0, 1], got 2",
        "agreement.free_identical must be null, true or false, got 'yes'"]
