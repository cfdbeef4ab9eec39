"""`decodelab.decoding` as a library: every decoder and drafter a config names is exported,
and each conf/decoder yaml holds its target's own defaults (the command line and Python
agree). Both enumerate the yaml files: a new one is checked without editing this file."""

from __future__ import annotations

import inspect

import pytest
from hydra.utils import get_object
from omegaconf import OmegaConf

import decodelab.decoding
from decodelab.decoding import PromptLookupDrafter
from decodelab.models.loading import CONF_DIR, instantiate_unwrapped

YAMLS = sorted((CONF_DIR / "decoder").glob("*.yaml")) + sorted((CONF_DIR / "draft").glob("*.yaml"))
DECODER_YAMLS = sorted((CONF_DIR / "decoder").glob("*.yaml"))


def target(path) -> str:
    return OmegaConf.load(path)._target_


def options(path) -> dict:
    """The yaml's option values (its `_target_`, `_partial_` and `defaults` left out)."""
    spec = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    return {k: v for k, v in spec.items() if not k.startswith("_") and k != "defaults"}


def test_the_configs_name_decoders_and_drafters():
    assert len(DECODER_YAMLS) >= 3 and len(YAMLS) > len(DECODER_YAMLS)
    assert all(target(p).startswith("decodelab.decoding.") for p in YAMLS)


@pytest.mark.parametrize("path", YAMLS, ids=[f"{p.parent.name}/{p.stem}" for p in YAMLS])
def test_every_config_target_is_exported(path):
    name = target(path).rsplit(".", 1)[-1]
    assert name in decodelab.decoding.__all__, f"{path.name}: {target(path)} is not in decodelab.decoding.__all__"
    assert getattr(decodelab.decoding, name) is get_object(target(path))


def test_everything_in_all_is_there():
    assert len(set(decodelab.decoding.__all__)) == len(decodelab.decoding.__all__)
    for name in decodelab.decoding.__all__:
        assert getattr(decodelab.decoding, name) is not None


def state(decoder) -> dict:
    """A decoder's parameters (its drafter, generator and private statistics left out)."""
    return {k: v for k, v in vars(decoder).items() if not k.startswith("_") and k not in ("drafter", "generator")}


@pytest.mark.parametrize("path", DECODER_YAMLS, ids=[p.stem for p in DECODER_YAMLS])
def test_each_decoder_yaml_holds_its_targets_defaults(path):
    fn = get_object(target(path))
    params = inspect.signature(fn).parameters
    for key, value in options(path).items():
        assert key in params, f"{path.name}: {key} is not an option of {target(path)}"
        if value == "${oc.select:draft.gamma,4}":  # the draft's own gamma, as the decoder's None takes it
            assert key in ("gamma", "depth") and params[key].default is None  # depth: the tree decoder's
            continue
        assert params[key].default == value, (
            f"{path.name}: {key}: {value!r}, but {target(path)} defaults to {params[key].default!r}")
    # and built: the yaml's decoder is its target's, called with nothing (a drafter where it needs one)
    kw = {"drafter": PromptLookupDrafter()} if getattr(fn, "needs_drafter", False) else {}
    from_yaml, from_python = instantiate_unwrapped(OmegaConf.load(path), **kw), fn(**kw)
    assert type(from_yaml) is type(from_python) and state(from_yaml) == state(from_python)
    assert repr(from_yaml) == repr(from_python)


def test_the_decoder_takes_the_drafts_gamma_unless_given(tiny_llama):
    """gamma: the drafter's own best measured lookahead (the int8 self-draft's 8, prompt
    lookup's 4) where the decoder sets none, in Python and through the configs alike; a
    decoder.gamma given wins."""
    from hydra import compose, initialize_config_dir

    from decodelab.decoding import SpeculativeDecoder
    from decodelab.decoding.drafters import prompt_lookup, quantized_self
    from decodelab.models.loading import CONF_DIR

    assert SpeculativeDecoder(prompt_lookup()).gamma0 == 4
    assert SpeculativeDecoder(quantized_self(tiny_llama, "int8")).gamma0 == 8
    assert SpeculativeDecoder(quantized_self(tiny_llama, "int8"), gamma=3).gamma0 == 3
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        for overrides, gamma in ((["draft=int8-self"], 8), (["draft=prompt-lookup"], 4),
                                 (["draft=int8-self", "decoder.gamma=6"], 6)):
            cfg = compose(config_name="generate", overrides=["decoder=speculative", *overrides])
            assert cfg.decoder.gamma == gamma, overrides


def test_greedy_is_sampling_at_temperature_0_and_sampling_samples():
    from decodelab.decoding import SamplingDecoder, SpeculativeDecoder, greedy

    assert greedy().params.greedy and not SamplingDecoder().params.greedy
    assert SamplingDecoder().params.temperature == 1.0 and SamplingDecoder().params.top_p == 1.0
    assert SpeculativeDecoder(PromptLookupDrafter()).params.greedy  # greedy verification by default
    # what setup and bench read from a config's target before building it
    for trait in ("needs_drafter", "lossless_at_temperature_0"):
        assert getattr(greedy, trait) == getattr(SamplingDecoder, trait)
