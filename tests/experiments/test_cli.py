"""The generation CLI and the baseline entry point, end to end on tiny models."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from decodelab.experiments.generate import run
from decodelab.models.errors import SetupError
from decodelab.models.loading import CONF_DIR

ROOT = Path(__file__).resolve().parents[2]


def config(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def test_generate_streams_and_reports(capsys):
    r = run(config("model=tiny-llama", "model.device=cpu", "prompt=Hello there", "max_new_tokens=6"))
    out = capsys.readouterr().out
    assert len(r.tokens[0]) == 6
    assert "TTFT" in out and "ITL p50" in out and "tok/s" in out
    assert f"formula {r.kv['kv_bytes_formula']:,} B" in out and "allocated" in out
    assert out.startswith(r.text[0])  # the streamed text came first


def test_generate_prompt_file_chat_off_and_sampling(tmp_path, capsys):
    f = tmp_path / "p.txt"
    f.write_text("Once upon a time")
    cfg = config("model=tiny-gemma3", "model.device=cpu", f"prompt_file={f}", "chat_template=false",
                 "decoder=sampling", "decoder.seed=5", "max_new_tokens=5", "stream=false")
    a = run(cfg)
    b = run(cfg)
    assert a.tokens == b.tokens and len(a.tokens[0]) == 5


@pytest.mark.parametrize("override,match", [
    ("prompt=", "empty"),
    ("decoder.temperature=-1", "temperature"),
    ("decoder.top_p=1.5", "top_p"),
    ("max_new_tokens=0", "max_new_tokens"),
])
def test_bad_requests_fail_before_weights_load(override, match, monkeypatch):
    import decodelab.models.loading as loading

    monkeypatch.setattr(loading, "random_model", lambda *a, **k: pytest.fail("weights were loaded"))
    args = ["model=tiny-llama", "prompt=hi", override]
    with pytest.raises(SetupError, match=match):
        run(config(*args))


def test_cli_exit_code_and_message():
    p = subprocess.run([sys.executable, "-m", "decodelab.experiments.generate", "model=tiny-llama", "prompt=hi",
                        "decoder.temperature=nan", "decoder.top_k=-3"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 2
    assert "temperature" in p.stderr and "top_k" in p.stderr and "2 problem(s)" in p.stderr


def test_cli_reads_stdin():
    p = subprocess.run([sys.executable, "-m", "decodelab.experiments.generate", "model=tiny-llama", "model.device=cpu",
                        "max_new_tokens=3", "chat_template=false"], cwd=ROOT, input="Hello from stdin",
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "--- 3 tokens" in p.stdout


def test_baseline_runs_on_a_tiny_model(capsys):
    from decodelab.experiments.baseline import main

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="baseline", overrides=["model=tiny-llama", "model.device=cpu", "repeats=1",
                                                           "prompt_lengths=[16]", "new_tokens=4"])
    main.__wrapped__(cfg)
    out = capsys.readouterr().out
    assert "decode_speedup" in out and "| 16 | 4 |" in out and "True" in out  # same tokens both sides
