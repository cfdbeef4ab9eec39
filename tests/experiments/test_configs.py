"""Every config in every group composes and instantiates; bad setups fail early with
every reason listed."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from experiments import setup
from models.errors import SetupError
from models.loading import CONF_DIR


def config(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def names(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


@pytest.mark.parametrize("cache", names("cache"))
@pytest.mark.parametrize("decoder", names("decoder"))
def test_every_cache_decoder_combination_checks_and_builds(cache, decoder, tiny_models):
    cfg = config(f"cache={cache}", f"decoder={decoder}", "draft=early-exit", "draft.layers=1")
    setup.check(cfg)
    lm = tiny_models["llama"]
    factory, dec = setup.build(cfg, lm)
    assert callable(factory) and hasattr(dec, "step")


@pytest.mark.parametrize("draft", names("draft"))
def test_every_draft_builds(draft, tiny_models):
    overrides = ["decoder=speculative", f"draft={draft}"] + (["draft.layers=1"] if draft == "early-exit" else [])
    _, dec = setup.build(config(*overrides), tiny_models["llama"])
    assert dec.drafter is not None


def test_bad_config_lists_every_reason():
    cfg = config("decoder=speculative", "decoder.gamma=0", "decoder.temperature=-1", "decoder.top_p=2")
    with pytest.raises(SetupError) as e:
        setup.check(cfg)
    assert len(e.value.reasons) == 3
