"""`stream` / `stream_tokens`: the generation loop as an iterator of TokenEvents, for
several rows. Its tokens are `generate`'s, each row's text pieces concatenate to its final
text (multi-byte characters split over tokens included), leaving the loop early stops the
generation, and an error inside reaches the consumer."""

from __future__ import annotations

import pytest
import torch

from decodelab.decoding import (PromptLookupDrafter, SamplingDecoder, SpeculativeDecoder, TokenEvent, generate,
                                generate_text, greedy, stream, stream_tokens)
from decodelab.models.errors import SetupError
from tests.conftest import cache_for, random_ids

PROMPTS = ["Hello there", "Why is the sky blue? Tell me in a few words."]


@pytest.fixture(scope="module")
def lm():
    """The tiny random Llama with SmolLM2's tokenizer (byte-level BPE: some of its tokens
    hold part of a multi-byte character)."""
    from decodelab.models.loading import load

    return load("tiny-llama", device="cpu")


def by_row(events: list[TokenEvent], rows: int) -> tuple[list[list[int]], list[str]]:
    tokens = [[e.token for e in events if e.row == b] for b in range(rows)]
    return tokens, ["".join(e.text for e in events if e.row == b) for b in range(rows)]


def run(events):
    """(every event, the GenerationResult the iterator returns)."""
    out = []
    while True:
        try:
            out.append(next(events))
        except StopIteration as done:
            return out, done.value


DECODERS = {
    "greedy": greedy,
    "sampling": lambda: SamplingDecoder(seed=5),  # temperature 1: varied tokens, one of them a partial character
    "speculative": lambda: SpeculativeDecoder(PromptLookupDrafter(), gamma=3),  # several tokens per step
}


@pytest.mark.parametrize("name", list(DECODERS))
def test_two_rows_stream_generate_texts_and_tokens(lm, name):
    n = 24
    events, result = run(stream(lm, PROMPTS, decoder=DECODERS[name](), max_new_tokens=n))
    want = generate_text(lm, PROMPTS, decoder=DECODERS[name](), max_new_tokens=n)
    ids = [lm.tokenizer.encode(p) for p in PROMPTS]
    plain = generate(lm.model, cache_for(lm.model, 2, 64), DECODERS[name](), ids, n, eos_ids=lm.tokenizer.eos_ids)
    tokens, texts = by_row(events, 2)
    assert texts == want.text == result.text
    assert tokens == plain.tokens == want.tokens == result.tokens
    assert {e.row for e in events[:2]} == {0, 1}  # the rows interleave as the steps produce them
    if name == "sampling":  # a token that decodes to part of a character: its text waited for the next
        assert any(e.text == "" and not e.finished for e in events)
    for b in range(2):  # one last event per row, with the row's finish reason
        mine = [e for e in events if e.row == b]
        assert [e.finished for e in mine] == [False] * (len(mine) - 1) + [True]
        assert mine[-1].finish_reason == result.finish_reasons[b] == want.finish_reasons[b]


def test_stop_strings_per_row(lm):
    free = generate_text(lm, PROMPTS, decoder=SamplingDecoder(seed=5), max_new_tokens=30)
    stop = free.text[1][4:7]  # a piece of row 1's text; row 0 may or may not contain it
    events, result = run(stream(lm, PROMPTS, decoder=SamplingDecoder(seed=5), max_new_tokens=30, stop=[stop]))
    want = generate_text(lm, PROMPTS, decoder=SamplingDecoder(seed=5), max_new_tokens=30, stop=[stop])
    assert by_row(events, 2) == (want.tokens, want.text) and result.text == want.text
    assert want.finish_reasons[1] == "stop" and stop not in want.text[1]


class ByteTokenizer:
    """Token i is byte i (UTF-8, broken sequences replaced); token 0 is a special token (skipped)."""

    eos_ids = (0,)

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i != 0).decode("utf-8", errors="replace")


class Scripted:
    """A decoder that emits fixed tokens per row, `per_step` at a time (like a speculative
    round), whatever the model says."""

    lookahead, stats = 0, {}

    def __init__(self, rows: list[list[int]], per_step: int = 3, fail_at: int | None = None):
        self.rows, self.per_step, self.fail_at = rows, per_step, fail_at

    def problems(self, model, cache):
        return []

    def begin(self, device, prompts, capacity):
        self.at, self.steps = 1, 0

    def start(self, logits):
        return torch.tensor([r[0] for r in self.rows])

    def step(self, runner, last, done=None, left=None):
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("the decoder failed")
        out = [(r + [0] * 99)[self.at: self.at + self.per_step] for r in self.rows]
        self.at += self.per_step
        return out


def test_multibyte_characters_split_over_tokens_stream_whole(tiny_llama):
    texts = ["h\u00e9llo \u4e16\u754c \U0001f642!", "\u00e7a va? \u2713 \u00fc\u00df"]
    rows = [list(t.encode()) + [0] for t in texts]  # + EOS
    m = tiny_llama.model
    events, result = run(stream_tokens(m, cache_for(m, 2, 64), Scripted(rows), [[1, 2], [3]], 40,
                                       eos_ids=[0], tokenizer=ByteTokenizer()))
    tokens, pieces = by_row(events, 2)
    assert pieces == texts == result.text and tokens == rows == result.tokens
    assert result.finish_reasons == ["eos", "eos"]
    assert all("\ufffd" not in e.text for e in events)  # a partial character waits for its last byte
    assert any(e.text == "\U0001f642" for e in events)  # 4 tokens, one piece
    cut = stream_tokens(m, cache_for(m, 2, 64), Scripted(rows), [[1, 2], [3]], 8, tokenizer=ByteTokenizer())
    events, result = run(cut)  # max_new_tokens ends row 0 inside a character: the last piece has its remains
    assert by_row(events, 2)[1] == result.text and result.text[0].endswith("\ufffd")


def test_breaking_out_early_stops_generating(lm):
    forwards = []
    hook = lm.model.register_forward_pre_hook(lambda *a: forwards.append(1))
    try:
        events = stream(lm, PROMPTS, max_new_tokens=50)
        assert forwards == []  # nothing runs before the first event is asked for
        seen = []
        for e in events:
            assert torch.is_grad_enabled()  # the consumer's own grad mode between the steps
            seen.append(e)
            if len(seen) == 6:
                break
        ran = len(forwards)
        assert ran == 3  # the prefill and two decode steps: 2 rows x 3 tokens
        events.close()
        assert len(forwards) == ran and list(events) == []
    finally:
        hook.remove()
    r = generate_text(lm, PROMPTS, max_new_tokens=5)  # the model and a new cache serve the next call
    assert [len(t) for t in r.tokens] == [5, 5]


def test_an_error_inside_reaches_the_consumer(tiny_llama):
    m = tiny_llama.model
    rows = [random_ids(20, seed=1), random_ids(20, seed=2)]
    seen = []
    with pytest.raises(RuntimeError, match="the decoder failed"):
        for e in stream_tokens(m, cache_for(m, 2, 64), Scripted(rows, fail_at=2), [[1], [2]], 20):
            seen.append(e)
    # the first tokens, then the first step's three per row; the second step raised
    assert [e.token for e in seen] == [rows[0][0], rows[1][0], *rows[0][1:4], *rows[1][1:4]]


def test_bad_input_is_refused_when_the_stream_is_made(lm):
    with pytest.raises(SetupError, match="max_new_tokens must be an integer"):
        stream(lm, PROMPTS, max_new_tokens=0)
    with pytest.raises(SetupError, match="cache must be a cache factory"):
        stream(lm, PROMPTS, cache="paged")


def test_the_callback_sees_the_same_events(lm):
    seen = []
    r = generate_text(lm, PROMPTS, decoder=SamplingDecoder(seed=7), max_new_tokens=12,
                      on_token=lambda row, t, text: seen.append((row, t, text)))
    events, _ = run(stream(lm, PROMPTS, decoder=SamplingDecoder(seed=7), max_new_tokens=12))
    assert seen == [(e.row, e.token, e.text) for e in events]
    assert by_row([TokenEvent(*s) for s in seen], 2) == (r.tokens, r.text)
