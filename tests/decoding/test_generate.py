"""The cache changes no result; the loop stops, streams and times correctly; bad
input fails before any forward pass."""

from __future__ import annotations

import pytest
import torch

from decodelab.decoding import generate, greedy, prefill
from decodelab.decoding.decoders import SamplingDecoder
from decodelab.models.errors import SetupError
from tests.conftest import cache_for, random_ids


class Counting:
    """Wraps a model: counts forward calls and processed positions."""

    def __init__(self, model):
        self.model, self.calls, self.positions = model, 0, 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, ids, positions, cache, **kw):
        self.calls += 1
        self.positions += ids.numel()
        return self.model(ids, positions, cache, **kw)


def full_logits(model, ids):
    T = len(ids)
    with torch.inference_mode():
        return model(torch.tensor([ids]), torch.arange(T)[None], cache_for(model, 1, T))[0]


def test_step_by_step_equals_full_recompute(tiny):
    m = tiny.model
    ids = random_ids(30, m.cfg.vocab_size)  # past the tiny Gemma's window of 16
    ref = full_logits(m, ids)
    cache = cache_for(m, 1, 40)
    with torch.inference_mode():
        got = [prefill(m, cache, [ids[:10]])[0]]
        for t in range(10, 30):
            got.append(m(torch.tensor([[ids[t]]]), torch.tensor([[t]]), cache)[0, -1])
    torch.testing.assert_close(torch.stack(got), ref[9:], rtol=0, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_chunked_prefill_equals_one_pass(tiny, chunk):
    m = tiny.model
    ids = random_ids(45, m.cfg.vocab_size, seed=1)
    one = prefill(m, cache_for(m, 1, 50), [ids])
    chunked = prefill(m, cache_for(m, 1, 50), [ids], chunk_size=chunk)
    torch.testing.assert_close(chunked, one, rtol=0, atol=1e-5)


def test_mixed_length_batch_equals_each_alone(tiny):
    m = tiny.model
    prompts = [random_ids(n, m.cfg.vocab_size, seed=n) for n in (5, 33, 18)]
    batch = generate(m, cache_for(m, 3, 60), greedy(), prompts, 12)
    for b, p in enumerate(prompts):
        alone = generate(m, cache_for(m, 1, 60), greedy(), [p], 12)
        assert batch.tokens[b] == alone.tokens[0]
    # and the logits: batched prefill equals each prompt's own
    logits = prefill(m, cache_for(m, 3, 60), prompts, chunk_size=8)
    for b, p in enumerate(prompts):
        torch.testing.assert_close(logits[b], full_logits(m, p)[-1], rtol=0, atol=1e-5)


def test_design_positions_processed(tiny_llama):
    # 13 prompt tokens + 5 generated cost 13 + 4 = 17 processed positions with a cache
    m = Counting(tiny_llama.model)
    r = generate(m, cache_for(tiny_llama.model, 1, 20), greedy(), [random_ids(13)], 5)
    assert len(r.tokens[0]) == 5 and m.positions == 17 and m.calls == 5


def test_first_token_comes_from_last_prompt_position(tiny_llama):
    m = tiny_llama.model
    ids = random_ids(9, seed=3)
    r = generate(m, cache_for(m, 1, 12), greedy(), [ids], 1)
    assert r.tokens[0] == [int(full_logits(m, ids)[-1].argmax())]


def test_greedy_equals_argmax_of_full_recompute(tiny_gemma):
    m = tiny_gemma.model
    ids = random_ids(20, seed=4)
    r = generate(m, cache_for(m, 1, 40), greedy(), [ids], 15)
    seq = list(ids)
    for _ in range(15):
        seq.append(int(full_logits(m, seq)[-1].argmax()))
    assert r.tokens[0] == seq[20:]


def test_eos_and_max_new_tokens(tiny_llama):
    m = tiny_llama.model
    ids = random_ids(6, seed=5)
    free = generate(m, cache_for(m, 1, 30), greedy(), [ids], 10)
    assert len(free.tokens[0]) == 10 and free.finish_reasons == ["length"]
    eos = free.tokens[0][3]
    stopped = generate(m, cache_for(m, 1, 30), greedy(), [ids], 10, eos_ids=[eos])
    first = free.tokens[0].index(eos)
    assert stopped.tokens[0] == free.tokens[0][: first + 1] and stopped.finish_reasons == ["eos"]


class CharTokenizer:
    """Each id decodes to one letter (enough to test stop strings and streaming)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_stop_strings_and_streaming(tiny_llama):
    m = tiny_llama.model
    ids = random_ids(6, seed=6)
    tok = CharTokenizer()
    dec = lambda: SamplingDecoder(temperature=1.0, seed=1)  # noqa: E731  varied text
    free = generate(m, cache_for(m, 1, 40), dec(), [ids], 20, tokenizer=tok)
    text = free.text[0]
    assert len(set(text)) > 5
    stop = text[5:7]
    cut = text.index(stop)
    seen = []
    r = generate(m, cache_for(m, 1, 40), dec(), [ids], 20, tokenizer=tok, stop=[stop],
                 on_token=lambda row, t, d: seen.append((row, t, d)))
    assert r.text[0] == text[:cut] and r.finish_reasons == ["stop"]
    assert "".join(d for _, _, d in seen) == text[:cut]
    assert [t for _, t, _ in seen] == r.tokens[0] and len(r.tokens[0]) == cut + len(stop)


def test_timestamps_and_summary(tiny_llama):
    m = tiny_llama.model
    r = generate(m, cache_for(m, 2, 40), greedy(), [random_ids(8), random_ids(3, seed=9)], 10)
    for times in r.token_times:
        assert len(times) == 10 and all(b >= a for a, b in zip(times, times[1:]))
    s = r.summary()
    assert s["new_tokens"] == 20 and s["ttft_s"] > 0 and s["itl_p50_ms"] > 0 and s["decode_tok_s"] > 0
    assert s["kv_bytes_formula"] == (8 + 9 + 3 + 9) * 2 * 2 * 2 * 16 * 4
    assert s["kv_bytes_allocated"] == 2 * 2 * 2 * 40 * 2 * 16 * 4


def test_percentile_interpolates_linearly_as_numpy_and_vllm():
    """h = q/100 x (n - 1) into the ascending times, linear between neighbours, in ms:
    [1, 2, 3, 4] s: p50 at h 1.5 = 2 + 0.5 x 1 -> 2500; p95 at h 2.85 -> 3850; p99 at h 2.97 -> 3970."""
    from decodelab.decoding.generate import GenerationResult, percentile

    times = [4.0, 1.0, 3.0, 2.0]  # any order: sorted inside
    assert percentile(times, 50) == pytest.approx(2500.0)
    assert percentile(times, 95) == pytest.approx(3850.0)
    assert percentile(times, 99) == pytest.approx(3970.0)
    assert percentile(times, 0) == pytest.approx(1000.0) and percentile(times, 100) == pytest.approx(4000.0)
    # h 3.8: 40 + 0.8 x 10 (nearest rank, the old rule, gave 50)
    assert percentile([0.01, 0.02, 0.03, 0.04, 0.05], 95) == pytest.approx(48.0)
    assert percentile([0.25], 99) == pytest.approx(250.0) and percentile([], 50) is None
    # the summary's ITL percentiles: gaps 0.1, 0.2, 0.3, 0.4 s -> 250, 385 (h 2.85), 397 (h 2.97) ms
    r = GenerationResult(tokens=[[1] * 5], text=None, finish_reasons=["length"], prompt_lengths=[3],
                         token_times=[[0.1, 0.2, 0.4, 0.7, 1.1]], prefill_s=0.05)
    s = r.summary()
    assert (s["itl_p50_ms"], s["itl_p95_ms"], s["itl_p99_ms"]) == pytest.approx((250.0, 385.0, 397.0))


def test_sampling_same_seed_same_output(tiny_llama):
    m = tiny_llama.model
    ids = random_ids(5)
    run = lambda seed: generate(m, cache_for(m, 1, 30), SamplingDecoder(1.0, seed=seed), [ids], 20).tokens  # noqa: E731
    assert run(3) == run(3)
    assert run(3) != run(4)


@pytest.mark.parametrize("prompts,max_new,match", [
    ([[]], 4, "empty"),
    ([[1, 2, 999]], 4, "outside the vocabulary"),
    ([[1, -1]], 4, "outside the vocabulary"),
    ([[1, 2]], 600, "exceeds the model's context"),
    ([[1, 2]], 0, "max_new_tokens"),
    ([[1], [2]], 4, "batch"),
])
def test_bad_input_fails_before_any_forward(tiny_llama, prompts, max_new, match):
    m = Counting(tiny_llama.model)
    with pytest.raises(SetupError, match=match):
        generate(m, cache_for(tiny_llama.model, 1, 512), greedy(), prompts, max_new)  # 512: the context
    assert m.calls == 0


def test_all_problems_reported_together(tiny_llama):
    with pytest.raises(SetupError) as e:
        generate(tiny_llama.model, cache_for(tiny_llama.model, 1, 8), greedy(), [[5000]], 10, stop=["x"])
    assert len(e.value.reasons) == 3  # vocabulary, cache capacity, stop strings without tokenizer
