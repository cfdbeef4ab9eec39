"""Report: turn a run or multirun directory of `results.jsonl` files into a CSV, a
Markdown table and PNG plots.

    python -m decodelab.experiments.report DIR [--out OUTDIR]

Every run directory (at any depth under DIR) holds one `results.jsonl` written by
`experiments.bench`: one `{"kind": "prompt", ...}` line per prompt, then one
`{"kind": "summary", ...}` line. A file without a summary is an unfinished run and is
skipped with a warning. A run hash seen more than once (a sweep rerun with redo) keeps
its newest `finished` record, so the report holds every run exactly once.

Plots use matplotlib's Agg canvas directly (no pyplot, no global backend switch); a
plot with no data is skipped with a logged message.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import sys
from datetime import datetime, timezone
from pathlib import Path

log = logging.getLogger("decodelab.report")

RESULTS = "results.jsonl"
SETUP_FIELDS = ("name", "model", "cache", "decoder", "draft", "gamma", "workload", "experiment")
METRIC_FIELDS = ("ttft_ms", "itl_p50_ms", "itl_p95_ms", "itl_p99_ms", "decode_tok_s", "prompt_tok_s",
                 "kv_mib", "kv_mib_formula", "peak_rss_mib", "peak_cuda_mib", "acceptance_rate",
                 "mean_accepted", "alpha", "predicted_speedup", "agree_top1", "agree_kl",
                 "agree_max_abs_dlogit")
# the comparison the main job prints; `model`/`workload` are prepended when they vary
MAIN_COLUMNS = ("name", "cache", "decoder", "draft", "gamma", "ttft_ms", "itl_p50_ms", "decode_tok_s",
                "kv_mib", "agree_top1", "agree_kl", "acceptance_rate", "speedup_vs_greedy")
HEADERS = {"name": "setup", "ttft_ms": "TTFT ms", "itl_p50_ms": "ITL p50 ms", "itl_p95_ms": "ITL p95 ms",
           "itl_p99_ms": "ITL p99 ms", "decode_tok_s": "decode tok/s", "prompt_tok_s": "prompt tok/s",
           "kv_mib": "KV MiB", "kv_mib_formula": "KV MiB (formula)", "agree_top1": "top-1 vs dense",
           "agree_kl": "KL vs dense", "agree_max_abs_dlogit": "max |dlogit|", "acceptance_rate": "acceptance",
           "speedup_vs_greedy": "speedup vs greedy"}
MIB = 2**20
ITL_BINS = 20


# ---------------------------------------------------------------- loading

def find_results(root: str | Path) -> list[Path]:
    """Every `results.jsonl` under `root` (root itself included), in path order."""
    return sorted(Path(root).rglob(RESULTS))


def read_results(path: str | Path) -> dict | None:
    """The summary record of one `results.jsonl` with its prompt rows attached as
    `prompts` and the file as `path`; None (with a warning) when the file has no summary
    line or a line that is not JSON."""
    path = Path(path)
    summary, prompts = None, []
    try:
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)
            if rec.get("kind") == "summary":
                summary = rec
            elif rec.get("kind") == "prompt":
                prompts.append(rec)
    except (OSError, ValueError) as e:
        log.warning("%s: unreadable (%s); skipped", path, e)
        return None
    if summary is None:
        log.warning("%s: no summary line (the run did not finish); skipped", path)
        return None
    return {**summary, "prompts": prompts, "path": path}


def finished_at(run: dict) -> datetime:
    """The run's `finished` time as an aware datetime (naive times are taken as UTC;
    a missing or unparsable one sorts first)."""
    try:
        t = datetime.fromisoformat(str(run.get("finished")).replace("Z", "+00:00"))
    except ValueError:
        return datetime.min.replace(tzinfo=timezone.utc)
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def dedupe(runs: list[dict]) -> list[dict]:
    """One record per run hash: the newest `finished` (ties: the later path)."""
    best: dict[str, dict] = {}
    for r in runs:
        key = r.get("run") or str(r["path"])
        old = best.get(key)
        if old is not None:
            keep, drop = (r, old) if finished_at(r) >= finished_at(old) else (old, r)
            log.info("run %s found twice: kept %s, dropped %s", key, keep["path"], drop["path"])
            r = keep
        best[key] = r
    return list(best.values())


def load_runs(root: str | Path) -> list[dict]:
    """The finished runs under `root`: summary records with `prompts` (their prompt rows)
    and `path` attached, one per run hash (the newest `finished`), in path order."""
    runs = [r for p in find_results(root) if (r := read_results(p)) is not None]
    return sorted(dedupe(runs), key=lambda r: str(r["path"]))


# ---------------------------------------------------------------- the table

def is_speculative(setup: dict) -> bool:
    """A speculative setup: it has a drafter or a gamma, or its decoder says so."""
    return setup.get("draft") is not None or setup.get("gamma") is not None \
        or "speculative" in str(setup.get("decoder") or "")


def _sort_key(row: dict) -> tuple:
    # None sorts before any value, and values are never compared with None
    return tuple((row.get(k) is not None, row.get(k) if row.get(k) is not None else "")
                 for k in ("model", "cache", "decoder", "draft", "gamma"))


def flat_row(run: dict, root: Path | None = None) -> dict:
    """One run as a flat dict: run hash, setup fields, metrics (bench's order, then any
    extra metric), prompt count, finish time and the run's directory."""
    setup, metrics = run.get("setup") or {}, run.get("metrics") or {}
    path = Path(run["path"]).parent
    if root is not None and path.is_relative_to(root):
        path = path.relative_to(root)
    row = {"run": run.get("run"), **{k: setup.get(k) for k in SETUP_FIELDS}}
    row.update({k: metrics.get(k) for k in METRIC_FIELDS})
    row.update({k: v for k, v in metrics.items() if k not in row})
    row.update(speedup_vs_greedy=metrics.get("speedup_vs_greedy"), n_prompts=len(run.get("prompts", [])),
               finished=run.get("finished"), dir=str(path))
    return row


def add_speedups(rows: list[dict]) -> list[dict]:
    """Set `speedup_vs_greedy` on each speculative row that did not measure it against
    greedy itself (bench's `compare_greedy`): its decode tok/s over that of the greedy row
    with the same model, cache and workload (the newest one when several); None without
    such a row."""
    greedy: dict[tuple, dict] = {}
    for r in sorted((r for r in rows if r.get("decoder") == "greedy" and not is_speculative(r)),
                    key=lambda r: str(r.get("finished"))):
        greedy[(r.get("model"), r.get("cache"), r.get("workload"))] = r
    for r in rows:
        base = greedy.get((r.get("model"), r.get("cache"), r.get("workload")))
        if r.get("speedup_vs_greedy") is not None:  # measured side by side in the run itself
            continue
        if is_speculative(r) and base and base.get("decode_tok_s") and r.get("decode_tok_s") is not None:
            r["speedup_vs_greedy"] = r["decode_tok_s"] / base["decode_tok_s"]
    return rows


def table_rows(runs: list[dict], root: str | Path | None = None) -> list[dict]:
    """One flat row per run (see `flat_row`), with speedups vs greedy, sorted stably by
    model, cache, decoder, draft, gamma. `root` makes the `dir` column relative."""
    rows = [flat_row(r, Path(root) if root is not None else None) for r in runs]
    return sorted(add_speedups(rows), key=_sort_key)


def fmt(v) -> str:
    """A cell: '-' for None, 3 significant digits for floats (no decimals from 1000)."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def default_columns(rows: list[dict]) -> list[str]:
    """MAIN_COLUMNS, preceded by `model` and `workload` when the rows do not share one."""
    varying = [k for k in ("model", "workload") if len({r.get(k) for r in rows}) > 1]
    return varying + list(MAIN_COLUMNS)


def markdown_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """A Markdown table of `rows` over `columns` (default: `default_columns`), with
    readable headers, numbers right-aligned and '-' for missing values."""
    cols = list(columns) if columns is not None else default_columns(rows)
    numeric = {c for c in cols if any(isinstance(r.get(c), (int, float)) and not isinstance(r.get(c), bool)
                                      for r in rows)}
    lines = ["| " + " | ".join(HEADERS.get(c, c) for c in cols) + " |",
             "|" + "|".join("---:" if c in numeric else "---" for c in cols) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(c)).replace("|", "\\|") for c in cols) + " |")
    return "\n".join(lines) + "\n"


def write_csv(rows: list[dict], path: Path) -> Path:
    """All fields of `rows` (their union, first-seen order) as CSV; None is empty."""
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows({k: ("" if r.get(k) is None else r.get(k)) for k in fields} for r in rows)
    return path


# ---------------------------------------------------------------- plots

def _figure(ncols: int = 1):
    """A Figure on an Agg canvas (no pyplot state) and its axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4 * ncols, 4.4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]
    return fig, axes


def _save(fig, path: Path) -> Path:
    for ax in fig.axes:
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.savefig(path, dpi=100)
    return path


def _label(run: dict, field: str, multi_model: bool) -> str:
    """A series label: the setup field, prefixed by the model when the report has several."""
    setup = run.get("setup") or {}
    return f"{setup.get('model')} {setup.get(field)}" if multi_model else str(setup.get(field))


def _multi_model(runs: list[dict]) -> bool:
    return len({(r.get("setup") or {}).get("model") for r in runs}) > 1


def _series(pairs: dict[str, list[tuple]]) -> dict[str, list[tuple]]:
    """Series with data only, each sorted by x."""
    return {k: sorted(v) for k, v in pairs.items() if v}


def ttft_series(runs: list[dict]) -> dict[str, list[tuple]]:
    """(prompt_tokens, ttft_ms) of every prompt, one series per setup name."""
    out: dict[str, list[tuple]] = {}
    multi = _multi_model(runs)
    for r in runs:
        pts = [(p["prompt_tokens"], p["ttft_ms"]) for p in r["prompts"]
               if p.get("prompt_tokens") is not None and p.get("ttft_ms") is not None]
        out.setdefault(_label(r, "name", multi), []).extend(pts)
    return _series(out)


def binned_median(xs: list[float], ys: list[float], bins: int = ITL_BINS) -> list[tuple]:
    """(median x, median y) in up to `bins` equal-width bins of x; empty bins dropped."""
    import numpy as np

    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    if x.size == 0:
        return []
    edges = np.linspace(x.min(), x.max(), min(bins, len(np.unique(x))) + 1)
    idx = np.digitize(x, edges[1:-1])  # 0 .. n_bins-1
    return [(float(np.median(x[idx == i])), float(np.median(y[idx == i]))) for i in np.unique(idx)]


def itl_series(runs: list[dict]) -> dict[str, list[tuple]]:
    """Median ITL per context bin, one series per cache backend, non-speculative runs."""
    raw: dict[str, tuple[list, list]] = {}
    multi = _multi_model(runs)
    for r in runs:
        if is_speculative(r.get("setup") or {}):
            continue
        xs, ys = raw.setdefault(_label(r, "cache", multi), ([], []))
        for p in r["prompts"]:
            pairs = list(zip(p.get("context") or [], p.get("itl_ms") or []))
            xs.extend(c for c, _ in pairs)
            ys.extend(t for _, t in pairs)
    return _series({k: binned_median(xs, ys) for k, (xs, ys) in raw.items()})


def kv_series(runs: list[dict]) -> tuple[dict, dict]:
    """Allocated and formula KV MiB vs prompt_tokens + new_tokens, per cache backend
    (formula points deduplicated by context length)."""
    alloc: dict[str, list[tuple]] = {}
    formula: dict[str, dict] = {}
    multi = _multi_model(runs)
    for r in runs:
        key = _label(r, "cache", multi)
        for p in r["prompts"]:
            if p.get("prompt_tokens") is None or p.get("new_tokens") is None:
                continue
            ctx = p["prompt_tokens"] + p["new_tokens"]
            if p.get("kv_bytes_allocated") is not None:
                alloc.setdefault(key, []).append((ctx, p["kv_bytes_allocated"] / MIB))
            if p.get("kv_bytes_formula") is not None:
                formula.setdefault(key, {})[ctx] = p["kv_bytes_formula"] / MIB
    return _series(alloc), _series({k: list(v.items()) for k, v in formula.items()})


def plot_ttft(runs: list[dict], path: Path) -> Path | None:
    """TTFT vs prompt length, one series per setup name."""
    series = ttft_series(runs)
    if not series:
        log.info("skipped %s: no prompt rows with prompt_tokens and ttft_ms", path.name)
        return None
    fig, (ax,) = _figure()
    for name, pts in series.items():
        ax.plot(*zip(*pts), marker="o", linewidth=0.8, label=name)
    ax.set(xlabel="prompt tokens", ylabel="TTFT (ms)", title="Time to first token vs prompt length")
    return _save(fig, path)


def plot_itl(runs: list[dict], path: Path) -> Path | None:
    """ITL vs context length (median per context bin), one series per cache backend."""
    series = itl_series(runs)
    if not series:
        log.info("skipped %s: no non-speculative runs with per-step itl_ms and context", path.name)
        return None
    fig, (ax,) = _figure()
    for name, pts in series.items():
        ax.plot(*zip(*pts), marker="o", label=name)
    ax.set(xlabel="tokens in cache", ylabel="ITL (ms), median per bin",
           title="Inter-token latency vs context (non-speculative)")
    return _save(fig, path)


def plot_kv(runs: list[dict], path: Path) -> Path | None:
    """KV MiB allocated (markers) and by formula (dashed) vs context, per cache backend."""
    alloc, formula = kv_series(runs)
    if not alloc and not formula:
        log.info("skipped %s: no prompt rows with KV bytes", path.name)
        return None
    fig, (ax,) = _figure()
    for i, name in enumerate(sorted(set(alloc) | set(formula))):
        color = f"C{i % 10}"
        if name in alloc:
            ax.plot(*zip(*alloc[name]), "o", color=color, label=f"{name} allocated")
        if name in formula:
            ax.plot(*zip(*formula[name]), "--", color=color, label=f"{name} formula")
    ax.set(xlabel="prompt + new tokens", ylabel="KV cache (MiB)", title="KV cache memory vs context")
    return _save(fig, path)


def gamma_series(rows: list[dict], field: str) -> dict[str, list[tuple]]:
    """(gamma, row[field]) of speculative rows, one series per drafter and cache."""
    multi = len({r.get("model") for r in rows}) > 1
    out: dict[str, list[tuple]] = {}
    for r in rows:
        if is_speculative(r) and r.get("gamma") is not None and r.get(field) is not None:
            key = f"{r.get('draft')} / {r.get('cache')}"
            key = f"{r.get('model')} {key}" if multi else key
            out.setdefault(key, []).append((r["gamma"], r[field]))
    return _series(out)


def plot_speculative(rows: list[dict], path: Path) -> Path | None:
    """Speedup vs greedy and acceptance rate vs gamma, per drafter and cache; skipped
    when there is no speculative row or none has a greedy counterpart."""
    if not any(is_speculative(r) for r in rows):
        log.info("skipped %s: no speculative runs", path.name)
        return None
    speedup = gamma_series(rows, "speedup_vs_greedy")
    if not speedup:
        log.info("skipped %s: no speculative run has a greedy run with the same model, cache and workload",
                 path.name)
        return None
    fig, (ax1, ax2) = _figure(ncols=2)
    for name, pts in speedup.items():
        ax1.plot(*zip(*pts), marker="o", label=name)
    ax1.axhline(1.0, color="grey", linewidth=0.8)
    for name, pts in gamma_series(rows, "acceptance_rate").items():
        ax2.plot(*zip(*pts), marker="o", label=name)
    from matplotlib.ticker import MaxNLocator

    ax1.set(xlabel="gamma", ylabel="decode tok/s / greedy", title="Speculative speedup vs gamma")
    ax2.set(xlabel="gamma", ylabel="acceptance rate", title="Acceptance vs gamma", ylim=(0, 1.05))
    for ax in (ax1, ax2):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return _save(fig, path)


# ---------------------------------------------------------------- the report

class NoRunsError(FileNotFoundError):
    """A directory with no finished run under it."""


def write_report(root: str | Path, out: str | Path | None = None) -> dict[str, Path]:
    """Load the runs under `root` and write `report.csv`, `report.md` and the PNG plots
    that have data into `out` (default: `root`). Returns {"csv", "md", plot stem: path}
    for what was written; raises NoRunsError when `root` holds no finished run."""
    root = Path(root)
    runs = load_runs(root)
    if not runs:
        raise NoRunsError(f"{root}: no finished runs found (expected {RESULTS} files ending with a "
                          f'{{"kind": "summary"}} line, in DIR or any directory below it)')
    out = Path(out) if out is not None else root
    out.mkdir(parents=True, exist_ok=True)
    rows = table_rows(runs, root)
    paths = {"csv": write_csv(rows, out / "report.csv"), "md": out / "report.md"}
    paths["md"].write_text(markdown_table(rows))
    plots = {"ttft_vs_prompt_len": lambda p: plot_ttft(runs, p), "itl_vs_context": lambda p: plot_itl(runs, p),
             "kv_mib_vs_context": lambda p: plot_kv(runs, p),
             "speculative_vs_gamma": lambda p: plot_speculative(rows, p)}
    for stem, plot in plots.items():
        if (written := plot(out / f"{stem}.png")) is not None:
            paths[stem] = written
    return paths


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="decodelab-report", description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path, help="a run or multirun directory (results.jsonl files at any depth)")
    p.add_argument("--out", type=Path, default=None, help="where to write the report (default: DIR)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """CLI: print the Markdown table and the paths written; exit 2 when DIR has no
    finished run (or does not exist)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    if not args.dir.is_dir():
        print(f"error: {args.dir} is not a directory (expected a run or multirun directory holding "
              f"{RESULTS} files)", file=sys.stderr)
        return 2
    try:
        paths = write_report(args.dir, args.out)
    except NoRunsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(paths["md"].read_text())
    for path in paths.values():
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
