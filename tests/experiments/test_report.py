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


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
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


def test_cli_prints_table_and_paths(sweep):
    r = subprocess.run([str(Path(sys.executable).parent / "decodelab-report"), str(sweep)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "| speedup vs greedy |" in r.stdout and f"wrote {sweep / 'report.csv'}" in r.stdout  # data: stdout
    assert (sweep / "speculative_vs_gamma.png").exists()


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


def test_cli_exits_2_without_finished_runs(tmp_path):
    write_run(tmp_path / "only" / "0", "c00000000001", "dense", complete=False)
    for target in (tmp_path / "only", tmp_path / "missing"):
        r = subprocess.run([sys.executable, "-m", "decodelab.experiments.report", str(target)], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, r.stderr
        assert str(target) in r.stderr and "results.jsonl" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "only" / "report.csv").exists()


# -- figures -------------------------------------------------------------------------------------
def drawn(spec):
    """The rendered Figure of a spec, laid out (extents valid)."""
    from decodelab.experiments.plotting import render

    fig = render(spec)
    fig.draw_without_rendering()
    return fig


def agree_and_micro(root: Path) -> Path:
    """agree's matrix (an exact setup with KL 0, a quantized one that failed, one without a
    |dlogit| bar) and micro part=weights (fp32, int8; TTFT quartiles per record)."""
    def summary(entry, run, setup, metrics, config=None):
        return {"kind": "summary", "entry": entry, "run": run, "finished": "2025-01-01T00:00:00",
                "setup": {"model": "tiny-llama", **setup}, "metrics": metrics, "config": config or {},
                "conditions": {"cpu": CPU, "threads": 3, "git": "abc"}}

    bars = {"dense": {"min_top1": 1.0, "max_kl": 1e-6, "max_abs_dlogit": 3e-4},
            "int4-weights": {"min_top1": 0.75, "max_kl": 0.5, "max_abs_dlogit": None}}
    recs = [{"kind": "prompt", "run": "agree-x-int4-weights", "top1": t, "kl": 0.3, "max_abs_dlogit": 9.0}
            for t in (0.6, 0.78)]
    recs += [summary("agree", "agree-x-dense", {"name": "dense", "reference": "dense"},
                     {"top1": 1.0, "mean_kl": 0.0, "max_abs_dlogit": 1e-5, "positions": 8, "prompts": 2,
                      "thresholds": bars["dense"], "passed": True}),
             summary("agree", "agree-x-int4-weights", {"name": "int4-weights", "reference": "dense"},
                     {"top1": 0.69, "mean_kl": 0.31, "max_abs_dlogit": 9.0, "positions": 8, "prompts": 2,
                      "thresholds": bars["int4-weights"], "passed": False})]
    config = {"repeats": 1, "prompts_per_context": 1, "ttft_rounds": 4}
    recs += [summary("micro", f"weights-x-{i}-{s}", {"name": "weights"},
                     {"context": ctx, "system": s, "decode_tok_s": rate * (1 - ctx / 1e4), "ttft_vs_fp32": r,
                      "ttft_vs_fp32_p25": r - 0.1, "ttft_vs_fp32_p75": r + 0.2}, config)
             for i, ctx in enumerate((32, 64, 128)) for s, rate, r in (("fp32", 14.0, 1.0), ("int8", 19.0, 1.3))]
    (root / "r").mkdir(parents=True)
    (root / "r" / "results.jsonl").write_text("".join(json.dumps(x) + "\n" for x in recs))
    return root


def test_points_are_medians_with_the_interquartile_range_of_their_samples():
    import numpy as np

    from decodelab.experiments.plotting import Point, n_text, point, pooled

    ys = [5.0, 1.0, 9.0, 3.0, 7.0, 100.0]
    q1, med, q3 = np.percentile(ys, [25, 50, 75])
    assert point(2, ys) == Point(2.0, med, q1, q3, 6) and (q1, med, q3) == (3.5, 6.0, 8.5)
    assert point(2, [4.0]) == Point(2.0, 4.0)  # one sample: no spread invented
    # atoms are never split; 3 atoms into 2 bins: the first two pooled
    pts = pooled([([30, 31], [9.0, 11.0]), ([10, 11], [1.0, 3.0]), ([20], [5.0])], bins=2)
    assert [p.x for p in pts] == [11.0, 30.5] and pts[0].y == 3.0 and pts[0].n == 3 and pts[1].lo == 9.5
    assert n_text([type("S", (), {"points": pts})]) == "n=2-3 per point"


def test_itl_band_is_drawn_from_each_prompts_step_quartiles(sweep):
    import numpy as np

    from decodelab.experiments.figures import itl_figure

    spec = itl_figure(load_runs(sweep))
    dense = next(s for s in spec.panels[0].series if s.group == "dense")
    itl = [10.0 + c / 100 for c in range(16, 20)]  # the 16-token prompt's four decode steps
    q1, med, q3 = np.percentile(itl, [25, 50, 75])
    assert dense.points[1].x == 17.5  # the median of its contexts 16..19
    assert (dense.points[1].y, dense.points[1].lo, dense.points[1].hi, dense.points[1].n) == (med, q1, q3, 4)
    assert "n=4 per point" in spec.caption and "interquartile range" in spec.caption
    fig = drawn(spec)
    ax = fig.axes[0]
    band = ax.collections[[s.group for s in spec.panels[0].series].index("dense")]  # one band per series, in order
    verts = band.get_paths()[0].vertices
    at = verts[np.isclose(verts[:, 0], 17.5)][:, 1]
    assert sorted(at) == pytest.approx([q1, q3])  # the band spans the quartiles of that prompt's steps


def test_captions_name_the_model_hardware_threads_and_n(sweep):
    from decodelab.experiments.figures import conditions_line, kv_figure, ttft_figure

    runs = load_runs(sweep)
    assert conditions_line(runs) == f"Model tiny-llama; {CPU}; 2 threads; git abc."
    spec = ttft_figure(runs)
    assert "n=1 per point (no repeats, so no spread)" in spec.caption and CPU in spec.caption
    assert all(p.lo is None for s in spec.panels[0].series for p in s.points)
    fig = drawn(spec)
    text = " ".join(t.get_text() for t in fig.texts).replace("\n", " ")
    assert "tiny-llama" in text and "2 threads" in text and "n=1 per point" in text
    both = [{**r, "setup": {**r["setup"], "model": "m2"}, "conditions": {"threads": 4}} for r in runs[:1]]
    assert conditions_line(runs + both) == f"Model m2, tiny-llama; {CPU}; 2, 4 threads; git abc."
    serve = {"setup": {}, "config": {"model": {"name": "m3"}}, "conditions": {"cuda": "GPU X", "cpu": CPU}}
    assert conditions_line([serve]) == "Model m3; GPU X."  # the model from the config; a GPU run names the GPU
    assert "no spread" in kv_figure(runs).caption


def test_equal_curves_and_formula_lines_are_drawn_once(sweep):
    from decodelab.experiments.figures import kv_figure

    runs = load_runs(sweep)
    assert sorted(kv_figure(runs).panels[0].series[0].group.split(" = ")) == [
        "dense", "dense draft=early-exit gamma=2", "dense draft=early-exit gamma=4", "paged", "sliding"]  # kept apart
    spec = kv_figure([r for r in runs if r["setup"]["decoder"] == "greedy"])
    series = spec.panels[0].series
    # every cache of the sweep allocates the same bytes (fabricated): one curve, one formula line
    assert [(s.group, s.style) for s in series] == [("dense = paged", "solid"), (None, "formula")]
    assert [p.y for p in series[1].points] == pytest.approx([64 * (n + 5) / 2**20 for n in (8, 16, 32)])
    fig = drawn(spec)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["dense = paged",
                                                                  "formula (every token, full precision)"]


def test_markers_that_would_hide_each_other_shrink():
    from decodelab.experiments.plotting import FigureSpec, Panel, Point, Series, depths

    a = Series("a", (Point(1, 10.0), Point(2, 20.0)))
    b = Series("b", (Point(1, 10.05), Point(2, 40.0)))
    c = Series("c", (Point(1, 10.0),), "dashed")  # overlays by design
    assert depths([a, b, c]) == [[0, 0], [1, 0], [0]]
    fig = drawn(FigureSpec((Panel((a, b), "x", "y", "t"),), "cap"))
    sizes = {(line.get_color(), tuple(line.get_xdata())): line.get_markersize() for line in fig.axes[0].lines
             if line.get_marker() not in ("", "None")}
    assert sizes[("C0", (1.0, 2.0))] > sizes[("C1", (1.0,))] and sizes[("C1", (2.0,))] == sizes[("C0", (1.0, 2.0))]


def test_speedup_plot_breaks_even_at_one_and_keeps_its_legend_outside(sweep):
    from decodelab.experiments.figures import prompt_speedups, speculative_figure

    runs = load_runs(sweep)
    rows = {r["run"]: {**r, "predicted_this_hw": 1.9 if r["gamma"] else None} for r in table_rows(runs)}
    spec = speculative_figure([(rows[r["run"]], r) for r in runs])
    speed, accept = spec.panels
    assert speed.hlines == ((1.0, "break-even (1x greedy)"),)
    dense = next(s for s in speed.series if s.group == "early-exit / dense" and s.style == "solid")
    # per prompt: greedy 0.4 (1 + i) s over 0.4 s -> 1, 2, 3: median 2, quartiles 1.5 and 2.5 (the table: 1.8, 2.0)
    gamma4 = next(r for r in runs if r["run"] == "a00000000003")
    assert prompt_speedups(gamma4["prompts"]) == pytest.approx([1.0, 2.0, 3.0])
    assert [(p.x, p.y, p.lo, p.hi, p.n) for p in dense.points] == [(2, 2.0, 1.5, 2.5, 3), (4, 2.0, 1.5, 2.5, 3)]
    predicted = next(s for s in speed.series if s.group == "early-exit / dense" and s.style == "dashed")
    assert [(p.y, p.lo, p.n) for p in predicted.points] == [(1.9, None, 1)] * 2  # the run's own prediction
    assert [(p.y, p.lo, p.hi) for p in accept.series[0].points[:1]] == [pytest.approx((0.4, 0.35, 0.45))]
    assert "median and IQR (band) of per-prompt values (n=3 prompts" in spec.caption
    fig = drawn(spec)
    ax = fig.axes[0]
    assert any(list(line.get_ydata()) == [1.0, 1.0] and line.get_linestyle() == ":" for line in ax.lines)
    assert ax.get_legend() is None and len(fig.legends) == 1
    box = fig.legends[0].get_window_extent()
    assert all(box.x0 >= a.get_window_extent().x1 for a in fig.axes)  # outside every panel
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels.count("early-exit / dense") == 1 and "break-even (1x greedy)" in labels and "measured" in labels


def test_agreement_draws_each_setups_own_thresholds_and_zero_honestly(tmp_path):
    from decodelab.experiments.figures import agreement_figure

    spec = agreement_figure([r for r in load_runs(agree_and_micro(tmp_path)) if r["entry"] == "agree"])
    top1, kl, dlogit = spec.panels
    assert [(r.label, r.value, r.threshold, r.ok) for r in top1.rows] == [("dense", 1.0, 1.0, True),
                                                                        ("int4-weights", 0.69, 0.75, False)]
    assert top1.rows[1].samples == (0.6, 0.78) and [r.threshold for r in dlogit.rows] == [3e-4, None]
    assert "n=8 positions (2 prompts)" in spec.caption and "A zero is drawn at 0" in spec.caption
    fig = drawn(spec)
    ax_top1, ax_kl, ax_dlogit = fig.axes
    bars = lambda ax: sorted((line.get_xdata()[0], line.get_ydata()[0]) for line in ax.lines  # noqa: E731
                             if line.get_marker() == "|")
    assert bars(ax_top1) == [(0.75, 0), (1.0, 1)]  # int4-weights in the bottom row, dense on top
    assert bars(ax_kl) == [(1e-6, 1), (0.5, 0)] and bars(ax_dlogit) == [(3e-4, 1)]  # no bar where none is set
    assert ax_kl.get_xscale() == "symlog" and ax_kl.get_xlim()[0] == 0  # KL 0 at 0, no invented floor
    assert ax_dlogit.get_xscale() == "log"
    failed = [line for line in ax_top1.lines if line.get_marker() == "X"]
    assert len(failed) == 1 and failed[0].get_xdata()[0] == 0.69


def test_weights_figure_says_n1_and_draws_ttft_quartiles(tmp_path):
    from decodelab.experiments.figures import weights_figure

    spec = weights_figure([r for r in load_runs(agree_and_micro(tmp_path)) if r["entry"] == "micro"])
    decode, ttft = spec.panels
    assert [s.group for s in decode.series] == ["fp32", "int8"] and not any(s.connect for s in decode.series)
    assert all(p.lo is None and p.n == 1 for s in decode.series for p in s.points)
    assert [s.group for s in ttft.series] == ["int8"] and ttft.hlines == ((1.0, "fp32 (1x)"),)
    assert [(p.y, p.lo, p.hi, p.n) for p in ttft.series[0].points] == [(1.3, 1.2, 1.5, 4)] * 3
    assert "n=1: repeats=1, one prompt; no spread" in spec.caption and "IQR over n=4" in spec.caption
    fig = drawn(spec)
    assert fig.axes[1].containers and fig.axes[1].get_yscale() == "linear"  # error bars; 1.2-1.5: no log


def test_axis_scales_follow_the_range():
    from decodelab.experiments.plotting import Row, RowPanel, axis_scale, row_scale

    assert axis_scale([128, 1536]) == "log" and axis_scale([32, 200]) == "linear"
    assert axis_scale([0, 10, 1000]) == "linear" and axis_scale([1, 100], "linear") == "linear"
    assert row_scale(RowPanel((Row("a", 3e-11), Row("b", 0.3)), "x", "t", "log")) == ("log", None)
    assert row_scale(RowPanel((Row("a", 0.0), Row("b", 0.3, threshold=2e-5)), "x", "t", "log")) == ("symlog", 1e-5)


def test_figures_at_print_resolution_plus_svg_or_pdf(sweep, tmp_path):
    from decodelab.models.errors import SetupError

    paths = write_report(sweep, tmp_path / "svg", fmt="svg")
    assert {f"{stem}.svg" for stem in PLOTS} <= set(paths) and set(PLOTS) <= set(paths)
    for stem in PLOTS:
        svg = paths[f"{stem}.svg"].read_text()
        assert svg.startswith("<?xml") and "<svg" in svg and len(svg) > 5000
        png = paths[stem].read_bytes()
        width, height = struct.unpack(">II", png[16:24])
        assert width >= 1200 and height >= 700  # 200 dpi
    pdf = write_report(sweep, tmp_path / "pdf", fmt="pdf")["speculative_vs_gamma.pdf"].read_bytes()
    assert pdf.startswith(b"%PDF") and len(pdf) > 5000 and not list((tmp_path / "pdf").glob("*.svg"))
    with pytest.raises(SetupError, match="format=jpg: must be one of png, svg, pdf"):
        write_report(sweep, tmp_path / "bad", fmt="jpg")
    assert not (tmp_path / "bad").exists()


def test_agree_and_micro_figures_are_written(tmp_path):
    paths = write_report(agree_and_micro(tmp_path))
    for stem in ("agreement", "weights_decode_vs_context"):
        assert paths[stem].read_bytes()[:8] == PNG_MAGIC
    assert "speculative_vs_gamma" not in paths and "itl_vs_context" not in paths  # no bench runs


def test_speculative_series_keep_sources_apart(sweep):
    from decodelab.experiments.figures import speculative_series

    rows = table_rows(load_runs(sweep))
    micro = {**rows[1], "entry": "micro", "speedup_vs_greedy": 1.1}  # a spec_gamma point at a gamma bench has
    labels = sorted(speculative_series([*rows, micro]))
    assert "early-exit / dense bench measured" in labels and "early-exit / dense micro measured" in labels
    runs = [{"setup": {"name": "int4", "reference": ref}, "prompts": [],
             "metrics": {"top1": t, "mean_kl": 0.01, "passed": True}}
            for ref, t in (("dense", 0.9), ("transformers", 0.8))]
    from decodelab.experiments.figures import agreement_figure

    assert [r.label for r in agreement_figure(runs).panels[0].rows] == ["int4 dense", "int4 transformers"]


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
