"""Sampling math, the shared prefill, the generation loop, the decoders and the drafters."""

from decodelab.decoding.decoders import SamplingDecoder, greedy
from decodelab.decoding.drafters import (EarlyExit, ModelDrafter, PromptLookupDrafter, draft_model, early_exit,
                                         prompt_lookup, quantized_self)
from decodelab.decoding.engine import Engine, Request, serve
from decodelab.decoding.generate import GenerationResult, TokenEvent, generate, stream_tokens
from decodelab.decoding.prefill import prefill
from decodelab.decoding.runner import ModelRunner, model_runner
from decodelab.decoding.sampling import SamplingParams, choose, logits_to_probs, sample
from decodelab.decoding.speculative import SpeculativeDecoder, rejection_sample
from decodelab.decoding.text import generate_text, make_cache, stream
from decodelab.decoding.tree_speculative import TreeSpeculativeDecoder

__all__ = ["SamplingDecoder", "greedy", "SpeculativeDecoder", "TreeSpeculativeDecoder", "rejection_sample",
           "ModelDrafter", "PromptLookupDrafter", "EarlyExit", "early_exit", "quantized_self", "prompt_lookup",
           "draft_model", "Engine", "Request", "serve", "GenerationResult", "TokenEvent", "generate", "stream_tokens",
           "generate_text", "stream", "make_cache", "prefill", "ModelRunner", "model_runner",
           "SamplingParams", "choose", "logits_to_probs", "sample"]
