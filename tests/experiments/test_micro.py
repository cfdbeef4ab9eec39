"""experiments.micro on the tiny model: each part's rows, its results.jsonl read by
report, and bad options refused before the model loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from decodelab.experiments.micro import run
from decodelab.experiments.report import load_runs
from decodelab.models.errors import SetupError
from decodelab.models.loading import CONF_DIR

TINY = ["model=tiny-llama", "model.device=cpu", "threads=1"]


def micro(out: Path, *overrides: str) -> list[dict]:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="micro", overrides=[*TINY, *overrides])
    return run(cfg, out)


def test_kv_speed_rows_per_context_and_system(tmp_path):
    rows = micro(tmp_path, "part=kv_speed", "contexts=[24,48]", "steps=3", "repeats=2", "backends=[dense,paged]")
    assert [(r["context"], r["system"]) for r in rows] == [
        (c, s) for c in (24, 48) for s in ("dense", "paged", "hf-QuantizedCache")]
    for r in rows:
        assert r["itl_ms"] > 0 and r["kv_bytes"] > 0
        assert r["itl_vs_dense"] == pytest.approx(r["itl_ms"] / next(
            x["itl_ms"] for x in rows if x["context"] == r["context"] and x["system"] == "dense"))
    assert rows[3]["kv_bytes"] == 2 * 2 * 2 * 16 * 4 * (48 + 3 + 1)  # tiny-llama: 2 layers, 2 kv heads, d 16, fp32
    runs = load_runs(tmp_path)
    assert len(runs) == 6 and {r["entry"] for r in runs} == {"micro"}


def test_verify_cost_is_relative_to_one_token_per_impl(tmp_path):
    rows = micro(tmp_path, "part=verify_cost", "tokens=[1,3]", "repeats=2", "impls=[reference,onednn]")
    assert [(r["tokens"], r["matmul"]) for r in rows] == [(1, "reference"), (1, "onednn"), (3, "reference"),
                                                          (3, "onednn")]
    assert [r["cost_vs_1_token"] for r in rows[:2]] == [1.0, 1.0] and all(r["ms"] > 0 for r in rows)


def test_bad_options_are_refused_before_the_model_loads(tmp_path, monkeypatch):
    import decodelab.models.loading as loading

    monkeypatch.setattr(loading, "random_model", lambda *a, **k: pytest.fail("weights were loaded"))
    with pytest.raises(SetupError) as e:
        micro(tmp_path, "part=kv_sped", "steps=0")
    assert "part must be one of" in str(e.value) and "steps must be an integer >= 1" in str(e.value)
    with pytest.raises(SetupError, match="backends: no cache 'pagd'"):
        micro(tmp_path, "part=kv_speed", "backends=[dense,pagd]")
    p = subprocess.run([str(Path(sys.executable).parent / "decodelab-micro"), *TINY, "part=verify_cost",
                        "impls=[fast]", f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "impls[]" in p.stderr and "Traceback" not in p.stderr
