"""Sampling math, the shared prefill, the generation loop and the decoders."""

from decodelab.decoding.decoders import SamplingDecoder, greedy
from decodelab.decoding.engine import Engine, Request, serve
from decodelab.decoding.generate import GenerationResult, generate
from decodelab.decoding.prefill import prefill
from decodelab.decoding.sampling import SamplingParams, choose, logits_to_probs, sample
from decodelab.decoding.text import generate_text, make_cache

__all__ = ["SamplingDecoder", "greedy", "Engine", "Request", "serve", "GenerationResult", "generate", "prefill",
           "SamplingParams",
           "choose", "logits_to_probs", "sample", "generate_text", "make_cache"]
