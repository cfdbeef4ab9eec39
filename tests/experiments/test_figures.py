"""experiments.figures and experiments.plotting on fabricated runs: each figure's data
(medians, quartiles, n), its caption (model, hardware, threads, n), its reference lines
and thresholds, series that never hide each other, axis scales, and the files written."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from decodelab.experiments.report import load_runs, table_rows, write_report
from tests.experiments.test_report import CPU, PLOTS, PNG_MAGIC, make_sweep


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    """test_report's fabricated multirun (bench: dense, paged, sliding; speculative at gamma 2 and 4)."""
    return make_sweep(tmp_path)


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
    recs = [{"kind": "prompt", "run": "agree-x-int4-weights", "top1": t, "kl": 0.3, "max_abs_dlogit": 9.0,
             "prompt_tokens": n} for t, n in ((0.6, 528), (0.78, 479))]
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


def test_every_group_keeps_its_own_colour_and_marker_and_line_panels_legend_lines():
    from decodelab.experiments.plotting import FigureSpec, Panel, Point, Series

    many = tuple(Series(f"g{i}", (Point(i, 1.0 + i),)) for i in range(12))
    fig = drawn(FigureSpec((Panel(many, "x", "y", "t"), Panel(many[:1], "x", "y", "t", markers=False)), "cap"))
    proxies = fig.legends[0].legend_handles
    assert len({(h.get_color(), h.get_marker()) for h in proxies}) == 12  # 10 colours, 11 markers
    lines = drawn(FigureSpec((Panel(many[:2], "x", "y", "t", markers=False),), "cap")).legends[0].legend_handles
    assert all(h.get_marker() in ("", "None") and h.get_linestyle() == "-" for h in lines)


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
    assert "n=8 positions (2 prompts of 479-528 tokens)" in spec.caption and "A zero is drawn at 0" in spec.caption
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
    decode_only = weights_figure([{**r, "metrics": {k: v for k, v in r["metrics"].items() if "ttft" not in k}}
                                  for r in load_runs(tmp_path) if r["entry"] == "micro"])
    assert len(decode_only.panels) == 1 and "TTFT" not in decode_only.caption


def perplexity_runs(root: Path) -> list[dict]:
    """micro part=perplexity's records: transformers' fp32 (the reference) and four setups,
    their relative differences to it as a run computes them."""
    ref, rel = 6.32, {"ours-fp32-dense": 8.7e-8, "ours-fp32-int4": 0.00559, "ours-int4-dense": 0.323,
                      "transformers-quanto-int8": 0.00307}
    cache = {"ours-fp32-dense": "dense", "ours-fp32-int4": "int4", "ours-int4-dense": "dense"}
    recs = [{"kind": "summary", "entry": "micro", "run": f"ppl-{i}", "finished": "2025-01-01T00:00:00",
             "setup": {"name": "perplexity", "model": "smollm2-135m"},
             "metrics": {"system": name, "weights": name.split("-")[1] if name.startswith("ours") else "int8",
                         "cache": cache.get(name, "transformers"), "perplexity": ref * (1 + d),
                         "vs_transformers_fp32": d, "tokens": 1535, "context": 512, "stride": 256, "chunk": 128},
             "config": {"nbits": 4, "group_size": 64, "residual": 128}, "conditions": {"cpu": CPU, "threads": 2}}
            for i, (name, d) in enumerate({"transformers-fp32": 0.0, **rel}.items())]
    (root / "ppl").mkdir(parents=True)
    (root / "ppl" / "results.jsonl").write_text("".join(json.dumps(x) + "\n" for x in recs))
    return load_runs(root)


def test_perplexity_figure_draws_the_reference_and_labels_each_setups_difference(tmp_path):
    from decodelab.experiments.figures import perplexity_figure

    spec = perplexity_figure(perplexity_runs(tmp_path))
    (panel,) = spec.panels
    assert [r.label for r in panel.rows] == ["ours fp32 weights, dense KV", "ours fp32 weights, int4 KV",
                                             "ours int4 weights, dense KV", "transformers + quanto int8"]
    assert [r.note for r in panel.rows] == ["+8.7e-06%", "+0.56%", "+32%", "+0.31%"]
    assert panel.vlines == ((6.32, "transformers fp32, the reference (6.32)"),)
    assert "n=1535 scored tokens" in spec.caption and "int4 KV at 4 bits, group 64, residual 128" in spec.caption
    assert "Model smollm2-135m" in spec.caption and CPU in spec.caption
    fig = drawn(spec)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.texts] == ["+8.7e-06%", "+0.56%", "+32%", "+0.31%"]
    assert [line.get_xdata()[0] for line in ax.lines if line.get_linestyle() == ":"] == [6.32]
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "perplexity" in labels and "transformers fp32, the reference (6.32)" in labels
    assert "passed its bars" not in labels  # measured, not judged
    assert perplexity_figure([r for r in load_runs(tmp_path) if r["metrics"]["system"] == "transformers-fp32"]) \
        is None  # the reference alone: nothing to compare


def test_axis_scales_follow_the_range():
    from decodelab.experiments.plotting import Row, RowPanel, axis_scale, row_scale

    assert axis_scale([128, 1536]) == "log" and axis_scale([32, 200]) == "linear"
    assert axis_scale([0, 10, 1000]) == "linear" and axis_scale([1, 100], "linear") == "linear"
    assert row_scale(RowPanel((Row("a", 3e-11), Row("b", 0.3)), "x", "t", "log")) == ("log", None)
    assert row_scale(RowPanel((Row("a", 0.0), Row("b", 0.3, threshold=2e-5)), "x", "t", "log")) == ("symlog", 1e-5)


@pytest.mark.slow  # 7.5 s in the default run on a 2-core Zen 3 (session 50)
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


@pytest.mark.slow  # 4.5 s in the default run on a 2-core Zen 3 (session 50)
def test_agree_and_micro_figures_are_written(tmp_path):
    paths = write_report(agree_and_micro(tmp_path))
    for stem in ("agreement", "weights_decode_vs_context"):
        assert paths[stem].read_bytes()[:8] == PNG_MAGIC
    assert "speculative_vs_gamma" not in paths and "itl_vs_context" not in paths  # no bench runs
    assert "perplexity" not in paths
    perplexity_runs(tmp_path)
    assert write_report(tmp_path)["perplexity"].read_bytes()[:8] == PNG_MAGIC


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


def test_kv_speed_figure_draws_time_and_bytes_on_log_axes_and_marks_the_crossover(tmp_path):
    """kv_speed's records: dense and int4, eager and compiled, at 1k, 2k and 8k; int4 is
    slower than dense at 1k and faster at 2k (eager: the crossing is marked between them,
    on log x), never faster compiled (nothing marked); the bytes panel holds every system."""
    from decodelab.experiments.figures import kv_speed_figure

    itl = {"dense": (30.0, 40.0, 60.0), "int4": (33.0, 36.0, 42.0), "dense compiled": (28.0, 30.0, 40.0),
           "int4 compiled": (30.0, 33.0, 41.0)}
    recs = [{"kind": "summary", "entry": "micro", "run": f"kv-{i}-{c}", "finished": "2025-01-01T00:00:00",
             "setup": {"name": "kv_speed", "model": "smollm2-135m"},
             "metrics": {"context": c, "system": s, "itl_ms": v[j], "itl_ms_p25": v[j] - 1, "itl_ms_p75": v[j] + 1,
                         "kv_bytes": c * (1000 if "dense" in s else 200)},
             "config": {"repeats": 3, "steps": 16, "backends": ["dense", "int4"]},
             "conditions": {"cpu": CPU, "threads": 2}}
            for i, (s, v) in enumerate(itl.items()) for j, c in enumerate((1024, 2048, 8192))]
    (tmp_path / "kv").mkdir()
    (tmp_path / "kv" / "results.jsonl").write_text("".join(json.dumps(x) + "\n" for x in recs))
    spec = kv_speed_figure([r for r in load_runs(tmp_path) if r["entry"] == "micro"])
    time, nbytes = spec.panels
    assert (time.xscale, time.yscale, nbytes.xscale, nbytes.yscale) == ("log",) * 4
    groups = [s.group for s in time.series]
    assert groups[:4] == list(itl) and len(groups) == 5  # one crossing: eager int4 at 1k-2k
    (cross,) = time.series[4].points
    f = (33 / 30 - 1) / (33 / 30 - 36 / 40)  # where int4 / dense = 1 between 1k and 2k
    assert cross.x == pytest.approx(1024 * 2**f) and 1024 < cross.x < 2048
    assert "int4 = dense at ~" in groups[4]
    assert time.series[0].points[0].n == 48 and time.series[0].points[0].lo == 29.0
    assert [p.y for p in nbytes.series[1].points] == pytest.approx([c * 200 / 2**20 for c in (1024, 2048, 8192)])
    assert "3 x 16 decode steps" in spec.caption
    drawn(spec)
