"""Building a setup (model, cache backend, decoder, drafter) from Hydra configs.

`check(cfg)` runs before any weights load and raises one SetupError with every reason
it finds (decoder parameters, cache options, rollback vs gamma); `build(cfg, lm)` makes
the cache factory and the decoder for a loaded target.
"""

from __future__ import annotations

import functools
import logging

import torch
from omegaconf import DictConfig

from decodelab.cache.base import CacheLayout
from decodelab.models.errors import SetupError
from decodelab.models.loading import instantiate_unwrapped

log = logging.getLogger("decodelab.setup")


def _collect(reasons: list[str], fn):
    try:
        return fn()
    except SetupError as e:
        reasons += e.reasons
        return None


def _probe_layout() -> CacheLayout:
    """A small stand-in layout for checking cache options before the model is known
    (head_dim 64 like most checkpoints; the real layout is checked again at build time)."""
    return CacheLayout(2, 1, 64, torch.float32, torch.device("cpu"), (None, None), 0.125)


def is_speculative(decoder) -> bool:
    return isinstance(decoder, functools.partial)  # speculative decoders wait for their drafter


def model_problems(spec, key: str = "model") -> list[str]:
    """The non-architecture options of a conf/model spec (weights, matmul)."""
    from decodelab.models.loading import model_option_problems

    return model_option_problems(spec.get("weights", "none"), spec.get("matmul", "auto"), spec.get("dtype"),
                                 spec.get("device"), key)


def draft_problems(cfg: DictConfig) -> list[str]:
    """A draft model's options; a quantized self-draft of a target that is quantized already."""
    draft = cfg.get("draft") or {}
    p = model_problems(draft.model, "draft.model") if draft.get("model") is not None else []
    if str(draft.get("_target_", "")).endswith("quantized_self") and cfg.model.get("weights", "none") != "none":
        p.append(f"draft={draft.get('weights')}-self quantizes the target, but the target is quantized already "
                 f"(model.weights={cfg.model.weights}); use model.weights=none, or another draft (early-exit, "
                 "prompt-lookup)")
    return p


def check(cfg: DictConfig) -> None:
    """Every problem of the decoder and cache configs, before weights load."""
    reasons = model_problems(cfg.model)
    decoder = _collect(reasons, lambda: instantiate_unwrapped(cfg.decoder))
    if is_speculative(decoder):
        decoder = _collect(reasons, lambda: decoder(drafter=None))
        reasons += draft_problems(cfg)
    factory = _collect(reasons, lambda: instantiate_unwrapped(cfg.cache))
    probe = _collect(reasons, lambda: factory(_probe_layout(), 1, 128)) if factory else None
    lookahead = getattr(decoder, "gamma_max", 0) if decoder is not None else 0
    if probe is not None and lookahead and probe.rollback_limit < lookahead:
        reasons.append(f"cache {cfg.cache._target_} can roll back {probe.rollback_limit} tokens but the decoder's "
                       f"gamma needs {lookahead}; raise the cache's rollback/residual or lower gamma")
    if reasons:
        raise SetupError(reasons)


def build(cfg: DictConfig, lm):
    """(cache factory, decoder) for the loaded target `lm`."""
    factory = instantiate_unwrapped(cfg.cache)
    decoder = instantiate_unwrapped(cfg.decoder)
    if is_speculative(decoder):
        drafter = instantiate_unwrapped(cfg.draft)(target=lm, cache=factory)
        decoder = decoder(drafter=drafter)
    log.info("cache: %s | decoder: %s", cfg.cache._target_, decoder)
    return factory, decoder
