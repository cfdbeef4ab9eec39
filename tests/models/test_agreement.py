"""The native forward agrees with transformers' own model holding the same weights."""

from __future__ import annotations

import pytest
import torch

from decodelab.models.reference import hf_reference
from tests.conftest import cache_for, random_ids

TOL = 1e-4  # fp32, max |logit difference|


def native_logits(model, ids: list[int]) -> torch.Tensor:
    """All-position logits [T, V] of one prompt in one pass."""
    T = len(ids)
    cache = cache_for(model, 1, T)
    with torch.inference_mode():
        return model(torch.tensor([ids]), torch.arange(T)[None], cache)[0]


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("length", [7, 100])
def test_tiny_models_match_transformers(tiny, length):
    # 100 tokens is past the tiny Gemma's window of 16
    hf = hf_reference(tiny.model)
    ids = random_ids(length, tiny.cfg.vocab_size)
    diff = (native_logits(tiny.model, ids) - hf_logits(hf, ids)).abs().max().item()
    assert diff <= TOL, f"{tiny.name}: max |dlogit| = {diff:.2e}"


def test_reference_is_really_transformers_class(tiny_models):
    from transformers import Gemma3ForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

    kinds = {"llama": LlamaForCausalLM, "gemma3": Gemma3ForCausalLM, "qwen2": Qwen2ForCausalLM,
             "qwen3": Qwen3ForCausalLM}
    for name, cls in kinds.items():
        assert type(hf_reference(tiny_models[name].model)) is cls


def test_disagreement_is_detected(tiny_gemma):
    """The check can fail: a perturbed norm weight moves the logits beyond tolerance."""
    hf = hf_reference(tiny_gemma.model)
    with torch.no_grad():
        hf.model.layers[0].pre_feedforward_layernorm.weight.add_(0.05)
    ids = random_ids(20)
    assert (native_logits(tiny_gemma.model, ids) - hf_logits(hf, ids)).abs().max() > TOL


def test_logit_index_computes_only_requested_positions(tiny_llama):
    m = tiny_llama.model
    ids = random_ids(12)
    full = native_logits(m, ids)
    cache = cache_for(m, 1, 12)
    with torch.inference_mode():
        some = m(torch.tensor([ids]), torch.arange(12)[None], cache, logit_index=torch.tensor([[3, 11]]))
    assert some.shape == (1, 2, m.cfg.vocab_size)
    torch.testing.assert_close(some[0], full[[3, 11]], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(smollm2.hf_dir, dtype=torch.float32).eval()
    ids = smollm2.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 60)[:600]
    diff = (native_logits(smollm2.model, ids) - hf_logits(hf, ids)).abs().max().item()
    assert diff <= TOL, f"SmolLM2-135M: max |dlogit| = {diff:.2e}"


@pytest.mark.slow
def test_gemma3_270m_matches_transformers_past_the_window(gemma3_270m):
    from transformers import Gemma3ForCausalLM

    text = "In the beginning the universe was created. This made many people angry. " * 80
    ids = gemma3_270m.tokenizer.encode(text)[:700]
    assert len(ids) == 700 > 512  # past the 512-token window of the local layers
    ours = native_logits(gemma3_270m.model, ids)
    diffs = {}
    for impl in ("sdpa", "eager"):
        hf = Gemma3ForCausalLM.from_pretrained(gemma3_270m.hf_dir, dtype=torch.float32,
                                               attn_implementation=impl).eval()
        diffs[impl] = hf_logits(hf, ids)
    own_noise = (diffs["sdpa"] - diffs["eager"]).abs().max().item()
    diff = (ours - diffs["sdpa"]).abs().max().item()
    assert diff <= TOL, f"Gemma-3-270M vs transformers (sdpa): max |dlogit| = {diff:.2e}"
    # transformers' own eager and sdpa paths differ by ~3.4e-4 on this model (logits up
    # to ~37): against eager we can only ask to stay within that spread
    eager = (ours - diffs["eager"]).abs().max().item()
    assert eager <= max(2 * own_noise, TOL), f"vs eager {eager:.2e}, eager vs sdpa {own_noise:.2e}"


@pytest.mark.slow
def test_smollm2_greedy_32_tokens_identical_to_transformers_generate(smollm2):
    from transformers import LlamaForCausalLM

    from decodelab.decoding import generate, greedy

    hf = LlamaForCausalLM.from_pretrained(smollm2.hf_dir, dtype=torch.float32).eval()
    tok = smollm2.tokenizer
    prompts = ["Write a long story about a dragon who learns to cook.", "Explain how a bicycle works, in detail.",
               "List twenty animals that live in the ocean."]
    for prompt in prompts:
        ids = tok.encode(prompt, chat=True)
        ours = generate(smollm2.model, cache_for(smollm2.model, 1, len(ids) + 32), greedy(), [ids], 32,
                        eos_ids=tok.eos_ids).tokens[0]
        with torch.inference_mode():
            x = torch.tensor([ids])
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=32, do_sample=False,
                              eos_token_id=list(tok.eos_ids), pad_token_id=0)
        assert ours == out[0, len(ids):].tolist()
        assert len(ours) == 32, "pick prompts whose answers are longer than 32 tokens"
