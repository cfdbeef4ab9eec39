"""scripts/main_job.sh (`make run`) end to end on the tiny model: its steps with their own
options narrowed through the *_ARGS hooks, one report with every panel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def main_job(out: Path, *overrides: str, **env: str) -> subprocess.CompletedProcess:
    hooks = {"WEIGHTS_ARGS": "contexts=[8,12,16,20,24] steps=3",
             "GAMMA_ARGS": "drafts=[prompt-lookup,int8-self] gammas=[1,2] prompts=1 steps=4",
             "CONTEXT_ARGS": "workload.lengths=[8,16,24,32,40] max_new_tokens=3",
             "PPL_ARGS": "ppl_tokens=200 context=64 stride=32 ppl_chunk=16 group_size=32 residual=32",
             "AGREE_ARGS": "draft.layers=1 workload.n=1 forced_tokens=4 free_tokens=2 setups=[dense,paged,int4,"
                           "speculative-dense,int8-weights]"}
    return subprocess.run(["bash", str(ROOT / "scripts" / "main_job.sh"), "model=tiny-llama", "model.device=cpu",
                           "threads=1", *overrides], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "BIN": str(Path(sys.executable).parent), "DECODELAB_MAIN": str(out),
                               **hooks, **env})


@pytest.mark.slow  # 30 s: the whole main job on the tiny model (CI runs the slow tests after the default run)
def test_main_job_writes_every_panel(tmp_path):
    r = main_job(tmp_path / "main")
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "main"
    for stem in ("weights_decode_vs_context", "speculative_vs_gamma", "itl_vs_context", "kv_mib_vs_context",
                 "perplexity", "agreement"):
        assert (out / f"{stem}.png").read_bytes()[:8] == PNG_MAGIC, stem
    md = (out / "report.md").read_text()
    for section in ("## bench", "## agree", "## micro: spec_gamma", "## micro: weights", "## micro: perplexity"):
        assert section in md
    caches = {json.loads(line)["setup"]["cache"] for p in (out / "context").rglob("results.jsonl")
              for line in p.read_text().splitlines() if '"summary"' in line}
    assert caches == {"dense", "paged", "int4", "sliding"}  # sliding: the run with an imposed window
    for step in ("weights", "gamma", "context", "sliding", "ppl", "agree"):
        assert f"{step} done in" in r.stderr and (out / f"{step}.log").is_file()


@pytest.mark.slow  # 12 s in the default run on a 2-core Zen 3 (session 50)
def test_main_job_stops_at_a_failing_step(tmp_path):
    r = main_job(tmp_path / "bad", GAMMA_ARGS="drafts=[prompt-lokup]")
    assert r.returncode != 0 and "main job: step 'gamma' failed" in r.stderr
    assert "drafts: no draft 'prompt-lokup'" in r.stderr  # the tail of the step's log
    assert not (tmp_path / "bad" / "context").exists()  # nothing after the failing step ran


@pytest.mark.slow
def test_main_job_reports_failed_agreement_bars_after_the_report(tmp_path):
    r = main_job(tmp_path / "bars", SLIDING="", AGREE_ARGS="draft.layers=1 workload.n=1 forced_tokens=4 "
                 "free_tokens=2 setups=[dense,int4-weights] agreement.max_kl=0")
    assert r.returncode == 1, r.stderr[-3000:]
    assert "some setups failed their agreement bars" in r.stderr and "FAIL int4-weights" in r.stderr
    assert (tmp_path / "bars" / "agreement.png").is_file()  # the report is written all the same
    assert "sliding done" not in r.stderr  # SLIDING="" skips that run
