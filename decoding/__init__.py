"""Sampling math, the shared prefill, the generation loop and the decoders."""

from decoding.decoders import SamplingDecoder, greedy
from decoding.generate import GenerationResult, generate
from decoding.prefill import prefill
from decoding.sampling import SamplingParams, choose, logits_to_probs, sample
from decoding.text import generate_text, make_cache

__all__ = ["SamplingDecoder", "greedy", "GenerationResult", "generate", "prefill", "SamplingParams",
           "choose", "logits_to_probs", "sample", "generate_text", "make_cache"]
