"""The weight options as one value (models/quantize.py `WeightOptions`): built from a kind,
a mapping or a DictConfig; every problem at once, named by its config key; equal options
equal and hashable (agree keys its quantized copies by them); the same value whether a
model comes from a Hydra-composed config or from `load(name, weights=...)`."""

from __future__ import annotations

import dataclasses

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from decodelab.models.config import ModelConfig
from decodelab.models.errors import SetupError
from decodelab.models.loading import CONF_DIR, instantiate_unwrapped, load, random_model
from decodelab.models.quantize import WeightOptions, kind_of, option_problems
from tests.conftest import TINY

CFG = ModelConfig.from_dict({**TINY["llama"], "rope": {"theta": 10000.0}})


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name="config", overrides=["model=tiny-llama", "model.device=cpu", *overrides])


def test_built_from_a_kind_a_mapping_or_a_dictconfig():
    assert WeightOptions.of(None) == WeightOptions() == WeightOptions.of("none")
    assert WeightOptions() == WeightOptions("none", None, False, False, "auto", "auto")
    assert WeightOptions.of("int8") == WeightOptions(kind="int8")
    int4 = WeightOptions("int4", group_size=32, kernel="torch")
    assert WeightOptions.of(int4) is int4
    assert WeightOptions.of({"kind": "int4", "group_size": 32, "kernel": "torch"}) == int4
    assert WeightOptions.of(OmegaConf.create({"kind": "int4", "group_size": 32, "kernel": "torch"})) == int4
    assert WeightOptions.of(OmegaConf.create(dataclasses.asdict(int4))) == int4  # the whole yaml node
    assert kind_of({"kind": "int4"}) == "int4" and kind_of(7) is None


def test_a_mapping_with_another_key_or_another_type_is_refused_naming_the_key():
    with pytest.raises(SetupError) as e:
        WeightOptions.of({"kind": "int4", "group_sise": 32, "head": True}, key="draft.weights")
    assert len(e.value.reasons) == 2
    assert e.value.reasons[0].startswith("draft.weights.group_sise is not a weight option; "
                                         "did you mean draft.weights.group_size?")
    assert "the options are kind, group_size, quantize_head, allow_slow, kernel, prefill_dtype" in e.value.reasons[1]
    with pytest.raises(SetupError, match=r"model.weights must be a weight kind \(none \| int8 \| int4\)"):
        WeightOptions.of(8)
    assert option_problems([8], "draft.model.weights")[0].startswith("draft.model.weights must be a weight kind")


def test_every_problem_at_once_each_with_its_key():
    bad = WeightOptions("int3", group_size=64, quantize_head="yes", allow_slow=1, kernel="fast", prefill_dtype="half")
    p = bad.problems("draft.weights")
    assert [x.split(" ")[0] for x in p] == ["draft.weights.kind", "draft.weights.kernel", "draft.weights.prefill_dtype",
                                           "draft.weights.group_size", "draft.weights.quantize_head",
                                           "draft.weights.allow_slow"]
    assert "remove it or use draft.weights.kind=int4" in p[3]
    assert WeightOptions("int4", group_size=0).problems() == [
        "model.weights.group_size must be a positive integer, got 0"]
    assert WeightOptions("int4", group_size=True).problems()[0].endswith("got True")
    assert WeightOptions("int4", 64, True, True, "torch", "bfloat16").problems() == []
    # against a model's shapes, on a device: the group that divides no input, the fix named
    p = WeightOptions("int4", 128).problems_for(CFG, "cpu", key="draft.weights")
    assert p and all(x.startswith("draft.weights.group_size=128 does not divide") for x in p)
    assert WeightOptions("int4").group_for(CFG) == 64 and WeightOptions("int8").group_for(CFG) is None


def test_equal_options_are_one_hashable_frozen_value():
    a, b = WeightOptions.of("int8"), WeightOptions.of({"kind": "int8", "kernel": "auto"})
    assert a == b and hash(a) == hash(b) and len({a, b, WeightOptions("int4")}) == 2
    copies = {a: "int8 copy"}
    assert copies[WeightOptions.of(OmegaConf.create({"kind": "int8"}))] == "int8 copy"
    assert a != WeightOptions("int8", kernel="torch")
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.kind = "int4"


def test_the_presets_are_the_kinds_with_every_other_field_its_default():
    for kind in ("none", "int8", "int4"):
        assert WeightOptions.of(OmegaConf.load(CONF_DIR / "weights" / f"{kind}.yaml")) == WeightOptions(kind)
    for name in ("tiny-llama", "smollm2-135m", "hf"):  # every model carries the whole node, none quantized
        assert WeightOptions.of(OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml").weights) == WeightOptions()


@pytest.mark.parametrize("overrides, weights", [
    (["weights=int4", "model.weights.group_size=32"], {"kind": "int4", "group_size": 32}),  # a preset, a field over it
    (["model.weights.kind=int8", "model.weights.quantize_head=true"], {"kind": "int8", "quantize_head": True}),
    (["model.weights=int8"], "int8"),  # the kind alone, as the key was spelt before it was a node
    ([], WeightOptions()),
])
def test_a_composed_config_and_load_by_name_give_the_same_options(overrides, weights):
    cfg = composed(*overrides)
    want = WeightOptions.of(cfg.model.weights)
    by_name = load("tiny-llama", device="cpu", weights=weights)
    from_config = instantiate_unwrapped(cfg.model)  # what the entry points build (harness.load_model)
    assert by_name.weights == from_config.weights == want
    assert by_name.model.__dict__.get("weight_quantization") == from_config.model.__dict__.get("weight_quantization")


def test_a_loader_records_its_options_and_a_draft_names_its_own_key():
    from decodelab.decoding.drafters import quantized_self

    lm = random_model(TINY["llama"], device="cpu", weights={"kind": "int4", "group_size": 32})
    assert lm.weights == WeightOptions("int4", 32) and lm.model.weight_quantization["group_size"] == 32
    full = random_model(TINY["llama"], device="cpu")
    assert full.weights == WeightOptions()
    with pytest.raises(SetupError, match="draft.weights.group_size=128 does not divide"):
        quantized_self(full, {"kind": "int4", "group_size": 128})
    assert quantized_self(full, WeightOptions("int8", quantize_head=True)).name == "self-int8"
