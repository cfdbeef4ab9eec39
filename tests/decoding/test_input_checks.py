"""Fault injection at the library's inputs (issue 14): float token ids are refused, not
truncated; speculative statistics count what was emitted; a cache is sized against the
model's context and the free memory before anything is allocated."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from decodelab.cache.dense import DenseCache
from decodelab.decoding import generate, greedy, prefill
from decodelab.decoding import text
from decodelab.decoding.drafters import ModelDrafter
from decodelab.decoding.prefill import token_id_problems
from decodelab.decoding.speculative import SpeculativeDecoder
from decodelab.decoding.text import capacity_problems, make_cache
from decodelab.models.errors import SetupError
from tests.conftest import cache_for, random_ids


# -- (a) token ids: integers in the vocabulary, or refused --------------------------------
@pytest.mark.parametrize("prompt", [[5.7, 12.0, 3.0], [5, 12, 3.5], torch.tensor([5.0, 12.0, 3.0]),
                                    np.array([5.0, 12.0]), [True, False, True], [5, True, 3]],
                         ids=["floats", "one-float", "float-tensor", "float-array", "bools", "int-and-bool"])
def test_non_integer_token_ids_are_refused_not_truncated(tiny_llama, prompt):
    m = tiny_llama.model
    cache = cache_for(m, 1, 40)
    with pytest.raises(SetupError, match="prompt 0 has token ids that are not integers"):
        generate(m, cache, greedy(), [prompt], 4)
    with pytest.raises(SetupError, match="not integers"):  # the one prefill path checks too
        prefill(m, cache, [prompt])
    assert cache.lengths.tolist() == [0]  # refused before the cache was touched


def test_integer_ids_of_every_form_are_accepted(tiny_llama):
    m = tiny_llama.model
    ids = random_ids(6)
    want = generate(m, cache_for(m, 1, 20), greedy(), [ids], 3).tokens
    for form in (tuple(ids), torch.tensor(ids), np.array(ids), [np.int64(t) for t in ids]):
        assert generate(m, cache_for(m, 1, 20), greedy(), [form], 3).tokens == want


def test_token_id_problems_lists_every_row(tiny_llama):
    p = token_id_problems([[1, 2], [], [300, -1], [1.5], "ab", [[1, 2]]], 256)
    assert [r.split(" ", 2)[1] for r in p] == ["1", "2", "3", "4", "5"]
    assert "empty" in p[0] and "[300, -1]" in p[1] and "float" in p[2]


# -- (b) speculative statistics count what was emitted ------------------------------------
def test_statistics_count_emitted_tokens_when_gamma_exceeds_the_output(tiny_llama):
    m = tiny_llama.model
    spec = SpeculativeDecoder(ModelDrafter(m), gamma=100)  # draft = target: every draft accepted
    r = generate(m, cache_for(m, 1, 120), spec, [random_ids(7)], 4)
    s = r.stats
    assert s["target_calls"] == 1
    assert s["tokens_per_target_call"] == 3  # 1 token from the prefill + 3 kept from the one call, not 101
    assert r.summary()["new_tokens"] == 4 == s["emitted_tokens"]
    assert s["acceptance_rate"] == 1.0  # the drafter's quality: every verified draft position counts
    assert s["mean_gamma"] == 2  # 3 tokens left after the first: 2 drafts + the verify's own token
    assert r.tokens == generate(m, cache_for(m, 1, 120), greedy(), [random_ids(7)], 4).tokens


def test_library_stop_strings_one_string_is_one_stop_and_empty_is_refused(tiny_llama):
    class Letters:  # a tokenizer stand-in: id -> one letter
        def decode(self, ids):
            return "".join(chr(97 + i % 26) for i in ids)

    m, tok, ids = tiny_llama.model, Letters(), random_ids(7)
    free = generate(m, cache_for(m, 1, 64), greedy(), [ids], 40, tokenizer=tok).text[0]
    word = free[3:5]  # a plain string: one stop string, not its letters
    r = generate(m, cache_for(m, 1, 64), greedy(), [ids], 40, tokenizer=tok, stop=word)
    assert r.finish_reasons == ["stop"] and r.text[0] == free[: free.index(word)]
    with pytest.raises(SetupError, match="non-empty text"):
        generate(m, cache_for(m, 1, 64), greedy(), [ids], 4, tokenizer=tok, stop=[""])


def test_statistics_count_tokens_cut_by_eos(tiny_gemma):
    m = tiny_gemma.model  # its greedy output varies (tiny llama repeats one token)
    ids = random_ids(7, seed=2)
    plain = generate(m, cache_for(m, 1, 60), greedy(), [ids], 12).tokens[0]
    eos = next(t for i, t in enumerate(plain) if i >= 2 and t not in plain[:i])  # ends the row after a call
    spec = SpeculativeDecoder(ModelDrafter(m), gamma=8)
    r = generate(m, cache_for(m, 1, 60), spec, [ids], 12, eos_ids=[eos])
    n = len(r.tokens[0])
    assert r.finish_reasons == ["eos"] and r.tokens[0] == plain[:n] and r.stats["emitted_tokens"] == n
    assert r.stats["target_calls"] == 1  # gamma 8 > n - 1: one call produced all of them, and more
    assert r.stats["tokens_per_target_call"] == pytest.approx((n - 1) / r.stats["target_calls"])


# -- (c) caches are sized before they are allocated ---------------------------------------
def test_cache_beyond_the_model_context_is_refused_before_allocation(tiny_llama, monkeypatch):
    m = tiny_llama.model
    built = []
    monkeypatch.setattr(DenseCache, "__init__", lambda self, *a: built.append(a))
    with pytest.raises(SetupError, match="exceeds the model's context of 512 tokens; lower max_new_tokens"):
        make_cache(m, 1, m.cfg.max_seq_len + 1)
    with pytest.raises(SetupError, match="1,000,000,000 tokens per row"):
        make_cache(m, 1, 10**9)
    assert built == []  # no backend constructor ran


def test_cache_larger_than_free_memory_is_refused_before_allocation(tiny_llama, monkeypatch):
    m = tiny_llama.model
    need = 2 * 100 * m.cfg.n_layers * 2 * m.cfg.n_kv_heads * m.cfg.head_dim * 4  # 2 rows x 100 tokens, fp32
    monkeypatch.setattr(text, "free_bytes", lambda device: need - 1)
    assert capacity_problems(m, 2, 99) == []
    (reason,) = capacity_problems(m, 2, 100)
    assert f"needs 0.00 GiB ({need:,} bytes)" in reason
    assert "lower max_new_tokens or shorten the prompt, lower the batch" in reason
    with pytest.raises(SetupError, match="is free on cpu; lower max_running, lower the batch"):
        make_cache(m, 2, 100, fix="lower max_running")  # the advice of the entry point that asks


def test_free_memory_is_known_on_this_machine():
    free = text.free_bytes("cpu")
    assert free is None or free > 0


def test_free_memory_on_cuda_counts_what_torch_holds_unused(monkeypatch):
    # no GPU needed: the driver's free bytes plus the allocator's reserved-but-unused ones
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1000, 5000))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 300)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 100)
    assert text.free_bytes("cuda:0") == 1200


def test_a_draft_model_with_a_shorter_context_is_refused_naming_the_draft():
    from decodelab.models.loading import random_model

    shape = {"family": "llama", "vocab_size": 256, "dim": 32, "n_heads": 2, "n_kv_heads": 1, "head_dim": 16,
             "intermediate_size": 64, "rope": {"theta": 10000.0}}
    target = random_model({**shape, "n_layers": 2, "max_seq_len": 512}).model
    draft = random_model({**shape, "n_layers": 1, "max_seq_len": 64}).model
    spec = SpeculativeDecoder(ModelDrafter(draft, name="small"), gamma=2)
    with pytest.raises(SetupError, match="draft small: a cache of 200 tokens .* context of 64 tokens"):
        generate(target, make_cache(target, 1, 200), spec, [[1, 2, 3] * 30], 50)


# -- (b) the library's public functions: argument types first, the expected type named --------
@pytest.mark.parametrize("call, message", [
    (lambda lm: text.generate_text(lm, 123), "prompts must be a str or a non-empty list of str, got 123 (an int)"),
    (lambda lm: text.generate_text(lm, [1, 2]), "got [1, 2] (a list); token ids go to decodelab.decoding.generate"),
    (lambda lm: text.generate_text(lm, "hi", max_new_tokens="4"), "max_new_tokens must be an integer >= 1, got '4'"),
    (lambda lm: text.generate_text(lm, "hi", decoder="greedy"),
     "decoder must be a decoder object (greedy(), SamplingDecoder(...), SpeculativeDecoder(drafter, ...)), got "
     "'greedy' (a str, without problems, begin, start, step); a conf/decoder option by name"),
    (lambda lm: text.generate_text(lm, "hi", cache="paged"), "cache must be a cache factory, called (layout, "),
    (lambda lm: text.generate_text(lm.model, "hi"), "generate_text takes a LoadedModel"),
    (lambda lm: generate(lm, cache_for(lm.model), greedy(), [[1]], 3), "pass lm.model, or generate_text(lm, text)"),
    (lambda lm: generate(lm.model, DenseCache, greedy(), [[1]], 3), "cache must be a built KV cache (make_cache("),
])
def test_a_public_function_names_the_type_it_expected(tiny_llama, call, message):
    with pytest.raises(SetupError) as e:
        call(tiny_llama)
    assert message in str(e.value)


@pytest.mark.parametrize("kw, message", [
    ({"top_p": "0.5"}, "top_p must be a number in (0, 1] (1 = off), got '0.5' (a str)"),
    ({"temperature": "1"}, "temperature must be a number >= 0 and finite (0 = greedy), got '1' (a str)"),
    ({"top_k": 1.5}, "top_k must be an integer >= 0 (0 = off), got 1.5 (a float)"),
    ({"min_p": True}, "min_p must be a number in [0, 1] (0 = off), got True (a bool)"),
    ({"top_p": 2}, "top_p must be a number in (0, 1] (1 = off), got 2"),
])
def test_sampling_options_name_a_wrong_type_apart_from_a_wrong_value(kw, message):
    from decodelab.decoding import SamplingDecoder

    with pytest.raises(SetupError) as e:
        SamplingDecoder(**kw)
    assert message in str(e.value)
    with pytest.raises(SetupError) as e:
        SamplingDecoder(temperature=-1, top_p="x")  # both listed
    assert len(e.value.reasons) == 2


@pytest.mark.parametrize("decoder", ["greedy", "speculative"])
@pytest.mark.parametrize("call", ["start", "step"])
def test_a_decoder_used_before_begin_says_begin_is_missing(tiny_llama, decoder, call):
    from decodelab.decoding.drafters import prompt_lookup

    m = tiny_llama.model
    d = greedy() if decoder == "greedy" else SpeculativeDecoder(prompt_lookup(), gamma=2)
    cache = cache_for(m, 1, 32)
    args = (torch.zeros(1, 256),) if call == "start" else (m, cache, torch.tensor([1]))
    with pytest.raises(SetupError, match=rf"{type(d).__name__}\.{call} called before begin\(device, prompts, "
                                         r"capacity\): call decoder\.begin first"):
        getattr(d, call)(*args)
    d.begin(m.device, [[1]], 32)  # in order: it runs
    assert d.start(torch.zeros(1, 256)).shape == (1,)
