"""experiments.spec_bench on the tiny model: both parts run and their tables hold."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def spec_bench(tmp_path, *args: str) -> list[dict]:
    out = tmp_path / "out.json"
    p = subprocess.run([sys.executable, "-m", "decodelab.experiments.spec_bench", "model=tiny-llama", "model.device=cpu",
                        "prompts=2", "new_tokens=10", "max_prompt_tokens=64", "draft_options.early-exit.layers=1",
                        f"out={out}", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text())["rows"]


def test_lossless_on_every_backend_and_drafter(tmp_path):
    rows = spec_bench(tmp_path, "part=lossless", "gammas=[3]", "drafts=[prompt-lookup,early-exit,model]",
                      "backends=[dense,paged,int4,sliding]", "backend_options.int4={residual: 4, group_size: 32}")
    assert len(rows) == 4 * 3
    assert all(r["identical_prompts"] == r["prompts"] == 2 for r in rows)


def test_speed_rows_carry_both_predictions(tmp_path):
    rows = spec_bench(tmp_path, "part=speed", "gammas=[2,4]", "drafts=[prompt-lookup]")
    assert [r["gamma"] for r in rows] == [2, 4]
    for r in rows:
        assert r["identical_prompts"] == "2/2" and 0 <= r["alpha"] <= 1
        assert r["efficiency"] == pytest.approx(r["measured_speedup"] / r["predicted_this_hw"])
        assert r["efficiency_vs_leviathan"] == pytest.approx(r["measured_speedup"] / r["predicted_leviathan"])


def test_verify_cost_rows_per_impl_and_token_count(tmp_path):
    from decodelab.models.matmul import onednn_available

    impls = ["reference", "onednn"] if onednn_available() else ["reference"]
    rows = spec_bench(tmp_path, "part=verify_cost", "tokens=[3,1,5]", "repeats=2", f"impls=[{','.join(impls)}]")
    assert [(r["matmul"], r["tokens"]) for r in rows] == [(i, t) for t in (1, 3, 5) for i in impls]  # T = 1 first
    one = {r["matmul"]: r["ms"] for r in rows if r["tokens"] == 1}
    for r in rows:
        assert r["ms"] > 0 and r["context"] > 0
        assert r["cost_vs_1_token"] == pytest.approx(r["ms"] / one[r["matmul"]])


def spec_bench_fails(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "decodelab.experiments.spec_bench", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_unknown_part_or_impl_is_refused_before_the_model_loads():
    p = spec_bench_fails("part=sped")
    assert p.returncode != 0 and "part must be one of ['speed', 'lossless', 'verify_cost'], got 'sped'" in p.stderr
    p = spec_bench_fails("part=verify_cost", "impls=[reference,mkl]")
    assert p.returncode != 0 and "impls[] must be one of ['auto', 'reference', 'onednn'], got 'mkl'" in p.stderr
