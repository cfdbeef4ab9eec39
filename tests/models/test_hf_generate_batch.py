"""transformers' continuous batching (`hf_generate_batch`) decodes greedily token for token like decodelab."""

from __future__ import annotations

import pytest

from decodelab.decoding import generate, greedy
from decodelab.models.reference import hf_generate_batch, hf_reference
from tests.conftest import cache_for, random_ids

PROMPTS = [random_ids(n, seed=i) for i, n in enumerate([5, 17, 29, 40])]
NEW = 16


def ours(model, prompts: list[list[int]], eos=(), news: list[int] | None = None) -> list[list[int]]:
    """decodelab's greedy, one prompt at a time (`news[i]` new tokens for prompt i, else NEW)."""
    return [generate(model, cache_for(model, 1, 80), greedy(), [p], n, eos_ids=eos).tokens[0]
            for p, n in zip(prompts, news or [NEW] * len(prompts))]


def check_times(out: dict) -> None:
    """Per-token times ascend, the first is the TTFT, all within the call; the generation within the call."""
    for toks, times, first in zip(out["tokens"], out["token_times"], out["ttft_s"]):
        assert len(times) == len(toks) and times == sorted(times)
        assert 0 < first == times[0] <= times[-1] <= out["wall_s"]
    assert 0 < out["gen_s"] < out["wall_s"]
    assert max(t[-1] for t in out["token_times"]) - min(out["ttft_s"]) <= out["gen_s"]


# the tied tiny llama only echoes the prompt's last token; the untied one makes varied text
@pytest.mark.parametrize("name", ["llama", "llama3-rope-untied"])
def test_generate_batch_matches_greedy(tiny_models, name):
    model = tiny_models[name].model
    out = hf_generate_batch(hf_reference(model), PROMPTS, NEW)
    assert out["tokens"] == ours(model, PROMPTS) and all(len(t) == NEW for t in out["tokens"])
    check_times(out)


def test_generate_batch_stops_at_eos(tiny_models):
    model = tiny_models["llama3-rope-untied"].model
    eos = (ours(model, PROMPTS[1:2])[0][3],)  # the 4th token of the 2nd prompt
    out = hf_generate_batch(hf_reference(model), PROMPTS, NEW, eos=eos)
    assert out["tokens"] == ours(model, PROMPTS, eos) and out["tokens"][1][-1] == eos[0]


def test_generate_batch_per_request_lengths(tiny_models):
    """A list of max_new_tokens: each request gets exactly its own count, the same tokens as ours."""
    model = tiny_models["llama3-rope-untied"].model
    news = [5, 16, 9, 12]
    out = hf_generate_batch(hf_reference(model), PROMPTS, news)
    assert [len(t) for t in out["tokens"]] == news
    assert out["tokens"] == ours(model, PROMPTS, news=news)
    check_times(out)
