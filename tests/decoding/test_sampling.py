"""Sampling math: greedy, temperature, top-k/top-p/min-p, seeds, and the distribution."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from decodelab.decoding.decoders import SamplingDecoder
from decodelab.decoding.sampling import SamplingParams, choose, logits_to_probs, sample
from decodelab.models.errors import SetupError

DESIGN_LOGITS = torch.tensor([[0.1, 0.2, 0.1, 0.3, 2.4, 0.2, 0.5]])


def test_design_worked_first_token():
    # greedy picks id 4; softmax gives it about 0.59 and the others 0.06 to 0.09
    assert choose(DESIGN_LOGITS, SamplingParams()).item() == 4
    p = logits_to_probs(DESIGN_LOGITS, SamplingParams(temperature=1.0))[0]
    assert p[4].item() == pytest.approx(0.59, abs=0.005)
    others = torch.cat([p[:4], p[5:]])
    assert others.min().item() >= 0.06 - 0.005 and others.max().item() <= 0.09 + 0.005


def test_greedy_is_one_hot_argmax():
    p = logits_to_probs(DESIGN_LOGITS, SamplingParams(temperature=0.0))
    assert p[0].tolist() == [0, 0, 0, 0, 1, 0, 0]


def test_temperature_scales_logits():
    p = logits_to_probs(DESIGN_LOGITS, SamplingParams(temperature=2.0))
    # by hand: exp(l / 2) / sum; the peak e^1.2 / 10.07886 = 0.32941
    want = torch.tensor([[0.1043, 0.1097, 0.1043, 0.1153, 0.3294, 0.1097, 0.1274]])
    torch.testing.assert_close(p, want, atol=1e-4, rtol=0)


def test_top_k_keeps_k_largest():
    p = logits_to_probs(DESIGN_LOGITS, SamplingParams(temperature=1.0, top_k=2))[0]
    assert set(p.nonzero().flatten().tolist()) == {4, 6}
    assert p.sum().item() == pytest.approx(1.0)


def test_top_p_keeps_smallest_prefix_reaching_mass():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))[0]
    # 0.5 + 0.3 reaches 0.8: the first two stay, renormalized
    torch.testing.assert_close(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.81))[0]
    assert (p > 0).sum().item() == 3
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.01))[0]
    assert p.tolist() == [1.0, 0.0, 0.0, 0.0]  # the top token always survives


def test_min_p_relative_to_max():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, min_p=0.25))[0]
    # threshold 0.25 * 0.5 = 0.125: 0.05 goes
    assert (p > 0).tolist() == [True, True, True, False]


@pytest.mark.parametrize("bad,field", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"),
    (dict(min_p=-0.1), "min_p"), (dict(min_p=1.1), "min_p"),
])
def test_bad_parameters_are_named(bad, field):
    with pytest.raises(SetupError, match=field):
        SamplingDecoder(**bad)


def test_all_bad_parameters_listed_together():
    with pytest.raises(SetupError) as e:
        SamplingDecoder(temperature=-1, top_k=-1, top_p=2, min_p=3)
    assert len(e.value.reasons) == 4


def test_seeded_generator_reproduces():
    probs = torch.softmax(torch.randn(4, 50), -1)
    a = sample(probs, torch.Generator().manual_seed(7))
    b = sample(probs, torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


def test_samples_follow_the_distribution():
    """Chi-square goodness of fit at significance 0.001, and it rejects a wrong target."""
    probs = logits_to_probs(DESIGN_LOGITS, SamplingParams(temperature=1.0, top_k=5))
    n = 40_000
    g = torch.Generator().manual_seed(0)
    draws = sample(probs.expand(n, -1).contiguous(), g)
    counts = torch.bincount(draws, minlength=7).double()
    support = probs[0] > 0
    assert counts[~support].sum() == 0  # nothing outside top-k
    expected = probs[0][support].double()
    assert stats.chisquare(counts[support], expected / expected.sum() * n).pvalue > 1e-3
    wrong = torch.softmax(DESIGN_LOGITS[0][support].double() * 1.1, -1) * n
    assert stats.chisquare(counts[support], wrong).pvalue < 1e-3
    assert math.isclose(counts.sum().item(), n)
