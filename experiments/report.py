"""Report: every `results.jsonl` under a directory (any depth, from any entry point) as a
CSV, Markdown tables and figures (PNG at print resolution, plus SVG or PDF when asked).

    decodelab-report DIR [out=OUTDIR] [format=png|svg|pdf]      # or dir=DIR

The files are in the harness's one schema (experiments/harness.py): prompt lines and one
`{"kind": "summary", "entry": ..., "run": ID, ...}` line per table row. An unfinished run
(no summary) and a line that is not a JSON object are skipped with a warning; a run ID seen
more than once (a sweep rerun with redo) keeps its newest `finished` record. Each entry
point gets its table (bench: the comparison columns; agree, micro, gpu_check: their
metrics). The figures (experiments/figures.py, drawn by experiments/plotting.py), where
the runs have data: bench's generations (TTFT, ITL and KV bytes vs context, speculative
speedup vs gamma measured and predicted), agree's matrix (top-1, KL and max |dlogit| per
setup against its thresholds), micro part=weights (decode tok/s and TTFT per weight type),
micro part=perplexity (perplexity per setup against transformers' fp32) and serve's load
curves; each with its spread, its n and the run conditions in a caption.

For analysis in Python, `load_results(path)` gives every record as pandas DataFrames, one
per kind, nested fields as dotted columns (`frames["summary"]["metrics.decode_tok_s"]`).
"""

from __future__ import annotations

import csv
import json
import logging
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from decodelab.experiments import harness
from decodelab.models.errors import SetupError

if TYPE_CHECKING:
    import pandas as pd

log = logging.getLogger("decodelab.report")

RESULTS = harness.RESULTS
SETUP_FIELDS = ("name", "model", "cache", "decoder", "needs_drafter", "draft", "gamma", "workload", "experiment")
SORT_FIELDS = ("model", "cache", "decoder", "draft", "gamma")
# the comparison the main job prints; `model`/`workload` are prepended when they vary
MAIN_COLUMNS = ("name", "cache", "decoder", "draft", "gamma", "prompt_tokens", "ttft_ms", "itl_p50_ms", "decode_tok_s",
                "kv_mib", "agree_top1", "agree_kl", "acceptance_rate", "speedup_vs_greedy")
# columns of the side-by-side comparisons, shown when some run made them
SIDE_BY_SIDE = ("draft_kv_mib", "greedy_identical", "c_verify", "predicted_this_hw", "efficiency", "hf_ttft_ms",
                "hf_decode_tok_s", "decode_speedup_vs_hf", "same_tokens_as_hf")
HEADERS = {"name": "setup", "ttft_ms": "TTFT ms", "itl_p50_ms": "ITL p50 ms", "itl_p95_ms": "ITL p95 ms",
           "itl_p99_ms": "ITL p99 ms", "decode_tok_s": "decode tok/s", "prompt_tok_s": "prompt tok/s",
           "kv_mib": "KV MiB", "kv_mib_formula": "KV MiB (formula)", "draft_kv_mib": "draft KV MiB",
           "agree_top1": "top-1 vs dense",
           "agree_kl": "KL vs dense", "agree_max_abs_dlogit": "max |dlogit|", "acceptance_rate": "acceptance",
           "speedup_vs_greedy": "speedup vs greedy", "prompt_tokens": "prompt tokens (median)",
           "hf_decode_tok_s": "HF decode tok/s", "decode_speedup_vs_hf": "decode x HF", "hf_ttft_ms": "HF TTFT ms",
           "same_tokens_as_hf": "same tokens as HF", "predicted_this_hw": "predicted (measured costs)"}


# -- loading -------------------------------------------------------------------------------
def results_files(path: str | Path) -> list[Path]:
    """`path` itself when it is a file, else every `results.jsonl` under it (a run folder, a
    sweep's numbered jobs, any depth), in path order."""
    path = Path(path)
    return [path] if path.is_file() else sorted(path.rglob(RESULTS))


def read_records(path: str | Path) -> list[dict] | None:
    """The JSON-object lines of one results file, in order; a blank line is nothing, any other
    line is skipped with a warning; None (with a warning) for an unreadable file."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        log.warning("%s: unreadable (%s); skipped", path, e)
        return None
    records = []
    for i, line in enumerate(lines, 1):
        try:
            rec = json.loads(line) if line.strip() else {}  # a blank line: nothing
        except ValueError:
            rec = None
        if not isinstance(rec, dict):
            log.warning("%s:%d: not a JSON object; line skipped", path, i)
        elif rec:
            records.append(rec)
    return records


def read_results(path: str | Path) -> list[dict]:
    """The summary records of one `results.jsonl`, with their prompt lines (same `run`) as `prompts`,
    their engine steps (serve) as `timeline` and the file as `path`; a non-object line is skipped
    with a warning, an unfinished run gives []."""
    path, records = Path(path), read_records(path)
    if records is None:
        return []
    summaries = [r for r in records if r.get("kind") == "summary"]
    by_run: dict[str, dict] = {"prompt": {}, "timeline": {}}  # timeline, serve: one line per engine step
    for rec in records:
        if rec.get("kind") in by_run:
            by_run[rec["kind"]].setdefault(rec.get("run"), []).append(rec)
    if not summaries:
        log.warning("%s: no summary line (the run did not finish); skipped", path)
    return [{**s, "prompts": by_run["prompt"].get(s.get("run"), []),
             "timeline": by_run["timeline"].get(s.get("run"), []), "path": path} for s in summaries]


def load_results(path: str | Path) -> dict[str, pd.DataFrame]:
    """Every record under `path` (a `results.jsonl`, a run folder, or a tree of them such as a
    Hydra multirun) as {kind: pandas.DataFrame}, one frame per record `kind` (`summary`,
    `prompt`, `timeline`; a line without one: `unknown`), rows in path and line order.
    Nested dicts are flattened into dotted columns (`setup.cache`, `metrics.decode_tok_s`,
    `conditions.git`, `config.model.name`, `spec.alpha`), lists stay one cell (`itl_ms`);
    a frame has only the columns some row of its kind fills (none all-missing). Each row
    gets `path` (its file) and `entry` (a prompt or timeline line: that of the summary
    with the same `run` in its file). Raw, unlike `load_runs`: an unfinished run's lines
    and a repeated run ID are kept; a bad line or an unreadable file is skipped with a warning
    (`read_records`); a folder with no results gives {}, a missing `path` FileNotFoundError."""
    import pandas as pd  # only here: importing report stays light

    if not Path(path).exists():
        raise FileNotFoundError(f"{path}: no such file or directory (give a {RESULTS} or a folder holding some)")
    rows: dict[str, list[dict]] = {}
    for file in results_files(path):
        records = read_records(file) or []
        entries = {r.get("run"): r.get("entry") for r in records if r.get("kind") == "summary"}
        for r in records:
            row = {**r, "entry": r.get("entry", entries.get(r.get("run"))), "path": str(file)}
            rows.setdefault(str(r.get("kind", "unknown")), []).append(row)
    return {kind: pd.json_normalize(recs, sep=".").dropna(axis=1, how="all") for kind, recs in rows.items()}


def finished_at(run: dict) -> datetime:
    """The run's `finished` time (naive: UTC; missing or unparsable: the oldest)."""
    try:
        t = datetime.fromisoformat(str(run.get("finished")).replace("Z", "+00:00"))
    except ValueError:
        t = datetime.min
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def load_runs(root: str | Path) -> list[dict]:
    """The finished runs under `root` (see `read_results`), one per run ID (the newest
    `finished`; ties: the later path), in path order."""
    runs = [r for p in results_files(root) for r in read_results(p)]
    newest = {r.get("run") or str(r["path"]): r for r in sorted(runs, key=finished_at)}  # stable: ties keep path order
    return sorted(newest.values(), key=lambda r: str(r["path"]))


# -- the table -----------------------------------------------------------------------------
def flat_row(run: dict, root: Path | None = None) -> dict:
    """One run as a flat dict: entry, run ID, setup fields, metrics (bench's order, then any
    extra metric), prompt count, finish time and the run's directory (relative to `root`)."""
    setup, metrics = run.get("setup") or {}, run.get("metrics") or {}
    path = Path(run["path"]).parent
    if root is not None and path.is_relative_to(root):
        path = path.relative_to(root)
    row = {"entry": run.get("entry", "bench"), "run": run.get("run"), **{k: setup.get(k) for k in SETUP_FIELDS},
           **{k: v for k, v in setup.items() if k not in SETUP_FIELDS}}
    row.update({k: v for k, v in metrics.items() if row.get(k) is None})
    row.update(speedup_vs_greedy=metrics.get("speedup_vs_greedy"), n_prompts=len(run.get("prompts", [])),
               finished=run.get("finished"), dir=str(path))
    return row


def table_rows(runs: list[dict], root: str | Path | None = None) -> list[dict]:
    """`flat_row` of each run, sorted stably by SORT_FIELDS (missing values first). A speedup over
    greedy is only what a run measured side by side (bench's `compare_greedy`), never a ratio of two runs."""
    rows = [flat_row(r, Path(root) if root is not None else None) for r in runs]
    return sorted(rows, key=lambda row: [(v is not None, "" if v is None else v) for v in map(row.get, SORT_FIELDS)])


def fmt(v) -> str:
    """A cell: '-' for None, 3 significant digits for floats (no decimals from 1000)."""
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return "-" if v is None else str(v)


def entry_columns(entry: str, rows: list[dict]) -> list[str]:
    """bench: MAIN_COLUMNS, after `model` and `workload` when the rows do not share one, then the
    side-by-side columns some row has; any other entry: the setup name and its scalar metrics
    (micro: whatever its rows measured, a draft and gamma included)."""
    if entry == "bench":
        varying = [k for k in ("model", "workload") if len({r.get(k) for r in rows}) > 1]
        return varying + list(MAIN_COLUMNS) + [k for k in SIDE_BY_SIDE if any(r.get(k) is not None for r in rows)]
    keys = dict.fromkeys(k for r in rows for k, v in r.items() if isinstance(v, (int, float, str)) or v is None)
    skip = {"entry", "run", "finished", "dir", "n_prompts", "name"}
    # micro's setup is its part and model, so a draft, gamma or speedup there is a metric (spec_gamma's grid)
    skip |= {"needs_drafter"} if entry == "micro" else {"speedup_vs_greedy", *SETUP_FIELDS} - {"model"}
    return ["name"] + [k for k in keys if k not in skip and any(r.get(k) is not None for r in rows)]


def report_markdown(rows: list[dict]) -> str:
    """One table per entry point (bench first; agree's setups together; for micro and
    gpu_check one per part or section), each under its heading when there are several."""
    group = lambda r: r["entry"] if r["entry"] in ("bench", "agree") else f"{r['entry']}: {r['name']}"  # noqa: E731
    groups = sorted({group(r) for r in rows}, key=lambda g: (g != "bench", g))
    parts = []
    for g in groups:
        mine = [r for r in rows if group(r) == g]
        table = markdown_table(mine, entry_columns(mine[0]["entry"], mine))
        parts.append(table if len(groups) == 1 else f"## {g}\n\n{table}")
    return "\n".join(parts)


def markdown_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """A Markdown table of `rows` over `columns` (default: bench's), with readable headers,
    numbers right-aligned and '-' for missing values."""
    cols = list(columns) if columns is not None else entry_columns("bench", rows)
    numeric = {c for c in cols for r in rows if isinstance(r.get(c), (int, float)) and not isinstance(r.get(c), bool)}
    lines = ["| " + " | ".join(HEADERS.get(c, c).replace("|", "\\|") for c in cols) + " |",
             "|" + "|".join("---:" if c in numeric else "---" for c in cols) + "|"]
    lines += ["| " + " | ".join(fmt(r.get(c)).replace("|", "\\|") for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_csv(rows: list[dict], path: Path) -> Path:
    """All fields of `rows` (their union, first-seen order) as CSV; None is empty."""
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows({k: ("" if r.get(k) is None else r.get(k)) for k in fields} for r in rows)
    return path


# -- the report ----------------------------------------------------------------------------
class NoRunsError(SetupError):
    """A directory with no finished run under it (the console exits 2, as for any SetupError)."""

    def __str__(self) -> str:
        return self.reasons[0]


def check_format(fmt) -> tuple[str, ...]:
    """The formats a `format` option asks for: PNG always, plus svg or pdf (`plotting.FORMATS`);
    a SetupError naming the choices for any other value."""
    from decodelab.experiments.plotting import FORMATS

    if fmt is None or str(fmt).lower() not in FORMATS:
        raise SetupError(f"format={fmt}: must be one of {', '.join(FORMATS)} (PNG is always written; svg or pdf "
                         "adds a vector copy of every figure)")
    return tuple(dict.fromkeys(("png", str(fmt).lower())))


def write_report(root: str | Path, out: str | Path | None = None, fmt: str = "png") -> dict[str, Path]:
    """Load the runs under `root` and write `report.csv`, `report.md` and the figures that
    have data (`figures.write_figures`: PNG, plus an SVG or PDF copy of each for `fmt` svg
    or pdf) into `out` (default: `root`). Returns {"csv", "md", figure stem: PNG path,
    "stem.svg"/"stem.pdf": vector path} for what was written; raises NoRunsError when
    `root` holds no finished run, a SetupError for a `fmt` not in `plotting.FORMATS`."""
    from decodelab.experiments.figures import write_figures

    formats = check_format(fmt)
    root = Path(root)
    runs = load_runs(root)
    if not runs:
        raise NoRunsError(f"{root}: no finished runs found (expected {RESULTS} files ending with a "
                          f'{{"kind": "summary"}} line, in DIR or any directory below it)')
    out = Path(out) if out is not None else root
    out.mkdir(parents=True, exist_ok=True)
    rows = table_rows(runs, root)
    paths = {"csv": write_csv(rows, out / "report.csv"), "md": out / "report.md"}
    paths["md"].write_text(report_markdown(rows))
    paths.update(write_figures(runs, rows, out, formats))
    return paths


def run(cfg, _output_dir: Path) -> None:
    """Print the tables and the paths written; a `dir` with no finished run is a NoRunsError."""
    if cfg.dir is None or not Path(cfg.dir).is_dir():
        raise NoRunsError(f"dir={cfg.dir} is not a directory; give a run or multirun directory holding {RESULTS} "
                          "files: decodelab-report dir=outputs/sweeps/compare (or the directory alone)")
    paths = write_report(cfg.dir, cfg.out, cfg.format)
    print(paths["md"].read_text())
    print("\n".join(f"wrote {path}" for path in paths.values()))


main = harness.hydra_app("report", run)


def cli() -> None:
    """Console entry: `decodelab-report DIR` is `decodelab-report dir=DIR`."""
    from decodelab.experiments.cli import VALUE_FLAGS

    plain = lambda a: a.startswith("-") or ("=" in a and not Path(a).exists())  # noqa: E731  (sweep dirs hold = and ,)
    argv = sys.argv[1:]  # a word after a flag that takes one (`--cfg job`) is the flag's, not a folder
    sys.argv[1:] = [a if plain(a) or (i and argv[i - 1] in VALUE_FLAGS) else f"dir='{a}'" for i, a in enumerate(argv)]
    main()


if __name__ == "__main__":
    cli()
