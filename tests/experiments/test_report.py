"""experiments.report on fabricated run directories: loading, dedup, speedups, CSV,
Markdown, figures (their data, spread, captions, reference lines and formats) and the
CLI's error path."""

from __future__ import annotations

import csv
import json
import logging
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from decodelab.experiments.report import load_runs, markdown_table, table_rows, write_report

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOTS = ("ttft_vs_prompt_len", "itl_vs_context", "kv_mib_vs_context", "speculative_vs_gamma")


CPU = "Test CPU 9000 avx2"


def prompt_row(run: str, i: int, prompt_tokens: int, new_tokens: int = 5, spec: bool = False) -> dict:
    """One fabricated prompt line; ITL grows with context, KV bytes with tokens; a
    speculative one decoded (1 + i) times as fast as its greedy twin, accepting 0.3 + 0.1 i."""
    context = [prompt_tokens + s for s in range(new_tokens - 1)]
    side = {"decode_s": 0.4, "greedy": {"decode_s": 0.4 * (1 + i), "new_tokens": new_tokens, "identical": True},
            "spec": {"acceptance_rate": 0.3 + 0.1 * i}} if spec else {"spec": None}
    return {"kind": "prompt", "run": run, "prompt_id": f"p{i}", "prompt_tokens": prompt_tokens,
            "new_tokens": new_tokens, "tokenize_ms": 0.1, "prefill_ms": prompt_tokens * 0.5,
            "first_sample_ms": 0.05, "ttft_ms": prompt_tokens * 0.5 + 0.15,
            "itl_ms": [10.0 + c / 100 for c in context], "context": context, "itl_p50_ms": 10.2,
            "itl_p95_ms": 10.4, "itl_p99_ms": 10.5, "decode_tok_s": 95.0, "prompt_tok_s": 500.0,
            "kv_bytes_formula": 64 * (prompt_tokens + new_tokens),
            "kv_bytes_allocated": 64 * 1024, "agreement": None, **side}


def write_run(d: Path, run: str, cache: str, decoder: str = "greedy", gamma: int | None = None,
              decode_tok_s: float = 20.0, finished: str = "2025-01-01T12:00:00+00:00",
              complete: bool = True, model: str = "tiny-llama") -> Path:
    """A run directory with results.jsonl as bench writes it (no summary when not complete)."""
    spec = decoder == "speculative"
    name = f"speculative-{cache}" if spec else cache
    lines = [prompt_row(run, i, n, spec=spec) for i, n in enumerate((8, 16, 32))]
    metrics = {"ttft_ms": 8.0, "itl_p50_ms": 10.2, "itl_p95_ms": 10.4, "itl_p99_ms": 10.5,
               "decode_tok_s": decode_tok_s, "prompt_tok_s": 500.0, "kv_mib": 0.0625, "kv_mib_formula": 0.002,
               "peak_rss_mib": 400.0, "peak_cuda_mib": None,
               "acceptance_rate": 0.2 + 0.1 * gamma if spec else None, "mean_accepted": 1.5 if spec else None,
               "alpha": 0.7 if spec else None, "predicted_speedup": 1.9 if spec else None,
               "agree_top1": 1.0, "agree_kl": 1.5e-7, "agree_max_abs_dlogit": 0.001,
               # measured side by side (bench's compare_greedy) against a 20 tok/s greedy run; sliding did not
               "speedup_vs_greedy": decode_tok_s / 20.0 if spec and cache == "dense" else None}
    if complete:
        lines.append({"kind": "summary", "entry": "bench", "run": run, "finished": finished,
                      "setup": {"name": name, "model": model, "cache": cache, "decoder": decoder, "needs_drafter": spec,
                                "draft": "early-exit" if spec else None, "gamma": gamma,
                                "workload": "synthetic", "experiment": "main"},
                      "metrics": metrics, "conditions": {"git": "abc", "threads": 2, "cpu": CPU}, "config": {}})
    d.mkdir(parents=True)
    (d / "results.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return d


def make_sweep(tmp_path: Path) -> Path:
    """A multirun: dense greedy + speculative (gamma 2, 4), paged greedy, sliding
    speculative (no greedy counterpart), an unfinished job, and a rerun of the gamma-2
    job nested deeper, finished later but earlier in path order."""
    root = tmp_path / "multirun"
    day1, day0 = root / "2025-01-02" / "10-00-00", root / "2025-01-01" / "10-00-00"
    write_run(day1 / "0", "a00000000001", "dense", decode_tok_s=20.0)
    write_run(day1 / "1", "a00000000002", "dense", "speculative", 2, decode_tok_s=30.0,
              finished="2025-01-02T10:05:00+00:00")
    write_run(day1 / "2", "a00000000003", "dense", "speculative", 4, decode_tok_s=40.0)
    write_run(day1 / "3", "a00000000004", "paged", decode_tok_s=18.0)
    write_run(day1 / "4", "a00000000005", "int4", complete=False)
    write_run(day1 / "5", "a00000000006", "sliding", "speculative", 2, decode_tok_s=25.0)
    write_run(day0 / "redo" / "nested" / "1", "a00000000002", "dense", "speculative", 2, decode_tok_s=36.0,
              finished="2025-01-03T08:00:00Z")
    return root


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    """`make_sweep` under the test's tmp_path."""
    return make_sweep(tmp_path)


def test_load_runs_dedups_and_skips_unfinished(sweep, caplog):
    caplog.set_level(logging.INFO, logger="decodelab.report")
    runs = load_runs(sweep)
    assert len(runs) == 5  # 7 files - 1 unfinished - 1 older duplicate
    assert sorted(r["run"] for r in runs) == [f"a0000000000{i}" for i in (1, 2, 3, 4, 6)]
    dup = next(r for r in runs if r["run"] == "a00000000002")
    assert dup["finished"] == "2025-01-03T08:00:00Z" and "redo" in str(dup["path"])
    assert dup["metrics"]["decode_tok_s"] == 36.0
    assert all(len(r["prompts"]) == 3 for r in runs)
    assert any("4/results.jsonl" in m and "no summary" in m for m in caplog.messages)


def test_table_rows_sorted_with_measured_speedups(sweep):
    rows = table_rows(load_runs(sweep), sweep)
    assert [(r["cache"], r["decoder"], r["gamma"]) for r in rows] == [
        ("dense", "greedy", None), ("dense", "speculative", 2), ("dense", "speculative", 4),
        ("paged", "greedy", None), ("sliding", "speculative", 2)]
    assert [r["speedup_vs_greedy"] for r in rows] == [None, pytest.approx(1.8), pytest.approx(2.0), None, None]
    assert rows[1]["dir"] == str(Path("2025-01-01/10-00-00/redo/nested/1"))
    assert rows[0]["n_prompts"] == 3 and rows[0]["name"] == "dense" and rows[1]["name"] == "speculative-dense"


def test_markdown_table_columns_and_missing_values():
    rows = [{"name": "a|b", "x": 1.23456, "y": None, "z": 12345.6}]
    md = markdown_table(rows, ["name", "x", "y", "z"])
    assert md.splitlines() == ["| setup | x | y | z |", "|---|---:|---|---:|", "| a\\|b | 1.23 | - | 12346 |"]


def test_write_report_files(sweep, tmp_path):
    out = tmp_path / "out"
    paths = write_report(sweep, out)
    assert set(paths) == {"csv", "md", *PLOTS}
    assert all(p.parent == out for p in paths.values())

    with open(paths["csv"]) as f:
        csv_rows = list(csv.DictReader(f))
    assert len(csv_rows) == 5
    assert [float(r["speedup_vs_greedy"]) if r["speedup_vs_greedy"] else None for r in csv_rows] == \
        [None, pytest.approx(1.8), pytest.approx(2.0), None, None]
    assert csv_rows[0]["run"] == "a00000000001" and csv_rows[0]["gamma"] == "" and csv_rows[0]["kv_mib"] == "0.0625"

    md = paths["md"].read_text().splitlines()
    assert len(md) == 2 + 5
    for header in ("setup", "cache", "decoder", "draft", "gamma", "TTFT ms", "ITL p50 ms", "decode tok/s",
                   "KV MiB", "top-1 vs dense", "KL vs dense", "acceptance", "speedup vs greedy"):
        assert f"| {header} |" in md[0]
    assert md[3].startswith("| speculative-dense | dense | speculative | early-exit | 2 |")
    assert md[3].endswith("| 1.8 |") and md[4].endswith("| 2 |") and md[5].endswith("| - |")

    for stem in PLOTS:
        data = paths[stem].read_bytes()
        assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
        width, height = struct.unpack(">II", data[16:24])
        assert width > 100 and height > 100


def test_speculative_plot_skipped_without_counterpart(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="decodelab.report")
    write_run(tmp_path / "g" / "0", "b00000000001", "dense")
    paths = write_report(tmp_path / "g")
    assert "speculative_vs_gamma" not in paths and "itl_vs_context" in paths
    assert any("skipped speculative_vs_gamma.png: no data" in m for m in caplog.messages)
    assert not (tmp_path / "g" / "speculative_vs_gamma.png").exists()

    write_run(tmp_path / "s" / "0", "b00000000002", "paged", "speculative", 3)
    paths = write_report(tmp_path / "s")
    assert "speculative_vs_gamma" not in paths and "itl_vs_context" not in paths  # ITL: speculative only
    assert any("no speculative run measured its speedup over greedy" in m for m in caplog.messages)


@pytest.mark.slow  # 5.8 s in the default run on a 2-core Zen 3 (session 50)
def test_cli_prints_table_and_paths(sweep):
    r = subprocess.run([str(Path(sys.executable).parent / "decodelab-report"), str(sweep), "format=pdf"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "| speedup vs greedy |" in r.stdout and f"wrote {sweep / 'report.csv'}" in r.stdout  # data: stdout
    assert (sweep / "speculative_vs_gamma.png").exists() and f"wrote {sweep / 'speculative_vs_gamma.pdf'}" in r.stdout


def test_every_entry_gets_its_table_and_bad_lines_are_skipped(tmp_path, caplog):
    """bench, agree and micro results under one root: a table each (bench first), the
    other entries' own columns; a JSON line that is not an object is skipped, not fatal."""
    write_run(tmp_path / "bench" / "0", "a1", "dense", decode_tok_s=20.0)
    other = [{"kind": "summary", "entry": "agree", "run": "agree-x-int4", "finished": "2025-01-01T00:00:00",
              "setup": {"name": "int4", "model": "tiny-llama"}, "metrics": {"max_abs_dlogit": 0.5, "top1": 0.97,
                                                                            "passed": True, "failures": []}},
             [1, 2, 3],
             {"kind": "summary", "entry": "micro", "run": "kv_speed-t-0", "finished": "2025-01-01T00:00:00",
              "setup": {"name": "kv_speed", "model": "tiny-llama"}, "metrics": {"context": 1024, "system": "paged",
                                                                                "itl_ms": 12.5}}]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "results.jsonl").write_text("".join(json.dumps(x) + "\n" for x in other) + "{oops\n")
    md = (tmp_path / "report.md").read_text() if write_report(tmp_path) else ""
    sections = md.split("## ")[1:]
    assert [s.splitlines()[0] for s in sections] == ["bench", "agree", "micro: kv_speed"]
    assert "| setup | model | max_abs_dlogit | top1 | passed |" in sections[1] and "| int4 | tiny-llama | 0.5 |" in md
    assert "| setup | model | context | system | itl_ms |" in sections[2] and "| kv_speed | tiny-llama | 1024 |" in md
    assert sum("not a JSON object" in m for m in caplog.messages) == 2  # the list and the broken line


@pytest.mark.slow  # 8.3 s in the default run on a 2-core Zen 3 (session 50)
def test_cli_exits_2_without_finished_runs(tmp_path):
    write_run(tmp_path / "only" / "0", "c00000000001", "dense", complete=False)
    for target in (tmp_path / "only", tmp_path / "missing"):
        r = subprocess.run([sys.executable, "-m", "decodelab.experiments.report", str(target)], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, r.stderr
        assert str(target) in r.stderr and "results.jsonl" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "only" / "report.csv").exists()
    write_run(tmp_path / "done" / "0", "c00000000002", "dense")
    r = subprocess.run([sys.executable, "-m", "decodelab.experiments.report", str(tmp_path / "done"), "format=eps"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "format=eps: must be one of png, svg, pdf" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "done" / "report.csv").exists()  # refused before writing anything


# -- load_results: every record as one DataFrame per kind ---------------------------------------
def harness_sweep(root: Path) -> Path:
    """A Hydra multirun as the harness writes it (`summary`, `write_jsonl`): job 0 a bench run
    (two prompt lines, a speculative one), job 1 a serve run (a request, two engine steps),
    job 2 unfinished (a prompt line, no summary)."""
    from omegaconf import OmegaConf

    from decodelab.experiments import harness

    cfg = OmegaConf.create({"model": {"name": "tiny-llama", "dim": 64}, "max_new_tokens": 3})
    cond = {"git": "abc1234", "threads": 1}
    bench = [{"kind": "prompt", "run": "b1", "prompt_id": "p0", "itl_ms": [10.0, 12.0], "spec": None},
             {"kind": "prompt", "run": "b1", "prompt_id": "p1", "itl_ms": [11.0], "spec": {"alpha": 0.7}},
             harness.summary("bench", "b1", {"name": "dense", "cache": "dense", "gamma": None},
                             {"decode_tok_s": 20.0, "itl_p99_ms": 11.97}, cond, cfg)]
    serve = [{"kind": "prompt", "run": "s1", "id": "r0", "ttft_s": 0.5, "token_times": [0.5, 0.6]},
             {"kind": "timeline", "run": "s1", "t": 0.0, "running": 1, "kv_bytes": 4096},
             {"kind": "timeline", "run": "s1", "t": 0.1, "running": 0, "kv_bytes": 0},
             harness.summary("serve", "s1", {"name": "paged-inf", "cache": "paged", "rate": float("inf")},
                             {"output_tok_s": 40.0, "ttft_p99_ms": 500.0}, cond, cfg)]
    root.mkdir(parents=True)
    (root / "multirun.yaml").write_text("hydra: {}\n")
    harness.write_jsonl(root / "0" / "results.jsonl", bench)
    harness.write_jsonl(root / "1" / "results.jsonl", serve)
    harness.write_jsonl(root / "2" / "results.jsonl", [{"kind": "prompt", "run": "u1", "prompt_id": "p9"}])
    return root


def test_load_results_one_flat_frame_per_kind_from_a_multirun(tmp_path):
    from decodelab.experiments.report import load_results

    root = harness_sweep(tmp_path / "sweep")
    frames = load_results(root)
    assert sorted(frames) == ["prompt", "summary", "timeline"]
    s, p, t = frames["summary"], frames["prompt"], frames["timeline"]
    assert len(s) == 2 and len(p) == 4 and len(t) == 2
    assert s["entry"].tolist() == ["bench", "serve"] and s["run"].tolist() == ["b1", "s1"]
    assert s["setup.cache"].tolist() == ["dense", "paged"] and s["setup.rate"].iloc[1] == float("inf")
    assert s["metrics.decode_tok_s"].iloc[0] == 20.0 and s["metrics.output_tok_s"].iloc[1] == 40.0
    assert s["metrics.itl_p99_ms"].iloc[0] == 11.97 and s["metrics.ttft_p99_ms"].iloc[1] == 500.0
    assert s["conditions.git"].tolist() == ["abc1234"] * 2 and s["config.model.name"].tolist() == ["tiny-llama"] * 2
    assert s["config.model.dim"].tolist() == [64, 64] and s["config.max_new_tokens"].tolist() == [3, 3]
    assert not {"setup", "metrics", "conditions", "config", "setup.gamma"} & set(s.columns)  # flat; all-None dropped
    assert s["path"].tolist() == [str(root / "0" / "results.jsonl"), str(root / "1" / "results.jsonl")]
    # prompt lines of every job, the entry from their run's summary (none for the unfinished job)
    assert p["prompt_id"].tolist()[:2] == ["p0", "p1"] and p["prompt_id"].iloc[3] == "p9"
    assert p["entry"].tolist()[:3] == ["bench", "bench", "serve"] and p["entry"].isna().iloc[3]
    assert p["itl_ms"].iloc[0] == [10.0, 12.0] and p["token_times"].iloc[2] == [0.5, 0.6]  # lists: one cell
    assert p["spec.alpha"].iloc[1] == 0.7 and "spec" not in p.columns and p["ttft_s"].iloc[2] == 0.5
    assert p["path"].iloc[3] == str(root / "2" / "results.jsonl")
    assert list(t.columns) == ["kind", "run", "t", "running", "kv_bytes", "entry", "path"]
    assert t["kv_bytes"].tolist() == [4096, 0] and t["entry"].tolist() == ["serve", "serve"]
    for frame in frames.values():
        assert not frame.isna().all().any()  # only the columns that kind has


def test_load_results_of_one_run_folder_or_file_and_raw_unlike_load_runs(sweep, tmp_path, caplog):
    from decodelab.experiments.report import load_results

    root = harness_sweep(tmp_path / "h")
    one = load_results(root / "1")
    assert sorted(one) == ["prompt", "summary", "timeline"] and one["summary"]["run"].tolist() == ["s1"]
    assert load_results(root / "0" / "results.jsonl").keys() == {"prompt", "summary"}
    # report's sweep: 7 files, one unfinished, one run ID twice; load_runs keeps 5 runs, load_results every line
    frames = load_results(sweep)
    assert len(frames["summary"]) == 6 and len(frames["prompt"]) == 7 * 3 and len(load_runs(sweep)) == 5
    assert frames["summary"]["run"].tolist().count("a00000000002") == 2
    assert sorted(frames["summary"]["metrics.decode_tok_s"])[-1] == 40.0
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "results.jsonl").write_text('{"kind": "summary", "run": "x"}\n[1]\n{"run": "y"}\n')
    bad = load_results(tmp_path / "bad")
    assert bad["summary"]["run"].tolist() == ["x"] and bad["unknown"]["run"].tolist() == ["y"]
    assert any("results.jsonl:2: not a JSON object" in m for m in caplog.messages)
    with pytest.raises(FileNotFoundError, match="nope"):
        load_results(tmp_path / "nope")


def test_load_results_reads_a_checked_in_sweep():
    """experiments/results/compare: the 8 jobs of `decodelab-bench -m experiment=compare`."""
    from decodelab.experiments.report import load_results

    frames = load_results(ROOT / "experiments" / "results" / "compare")
    s = frames["summary"]
    assert sorted(frames) == ["prompt", "summary"] and len(s) == 8 and set(s["entry"]) == {"bench"}
    assert sorted(s["setup.cache"]) == sorted(["dense", "int4", "paged", "sliding"] * 2)
    assert sorted(s["setup.decoder"].value_counts().tolist()) == [4, 4]
    assert set(frames["prompt"]["run"]) == set(s["run"]) and set(frames["prompt"]["entry"]) == {"bench"}
    assert (frames["prompt"]["itl_ms"].map(len) > 0).all() and (s["metrics.decode_tok_s"] > 0).all()
