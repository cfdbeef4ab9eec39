"""Every entry point's stdout, redirected to a file, holds only its data (its table, or
generate's text) and ends with the path of what it wrote; logs and progress go to stderr."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

TINY = ["model=tiny-llama", "model.device=cpu", "threads=1"]
LOG_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d |\]\[(INFO|WARNING|DEBUG)\]|^(INFO|WARNING|DEBUG)[: ]|it/s\]|^prompt \d+/")


def entry(tmp_path: Path, name: str, *args: str) -> tuple[list[str], str]:
    """Run `decodelab.experiments.<name>` with stdout into a file: (its lines, stderr)."""
    out = tmp_path / f"{name}.stdout"
    with open(out, "w") as f:
        p = subprocess.run([sys.executable, "-m", f"decodelab.experiments.{name}", *args], cwd=tmp_path, stdout=f,
                           stderr=subprocess.PIPE, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return out.read_text().splitlines(), p.stderr


def data_only(lines: list[str]) -> None:
    noise = [line for line in lines if LOG_LINE.search(line)]
    assert not noise, noise


def table_then_path(lines: list[str], prefix: str) -> Path:
    """A Markdown table, then the last line names an existing file."""
    data_only(lines)
    assert any(line.startswith("| ") for line in lines), lines
    last = [line for line in lines if line.strip()][-1]
    assert last.startswith(prefix), last
    path = Path(last.removeprefix(prefix).strip().split(",")[0])
    assert path.is_file(), last
    return path


@pytest.fixture(scope="module")
def bench_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bench")


def test_bench_prints_its_table_and_the_results_path(bench_dir):
    lines, err = entry(bench_dir, "bench", *TINY, "workload=synthetic", "workload.lengths=[16]",
                       "workload.per_length=1", "max_new_tokens=3", "warmup=false", f"hydra.run.dir={bench_dir}/run")
    assert table_then_path(lines, "results: ") == bench_dir / "run" / "results.jsonl"
    assert "decodelab.bench" in err  # its log went to stderr


def test_report_prints_its_table_and_what_it_wrote(bench_dir):
    if not (bench_dir / "run" / "results.jsonl").is_file():
        pytest.skip("needs the bench run above")
    lines, _ = entry(bench_dir, "report", str(bench_dir / "run"))
    written = table_then_path(lines, "wrote ")
    assert written.parent == bench_dir / "run"


def test_agree_prints_its_matrix_and_the_results_path(tmp_path):
    lines, err = entry(tmp_path, "agree", *TINY, "draft.layers=1", "workload=synthetic", "workload.lengths=[9]",
                       "forced_tokens=6", "free_tokens=4", f"hydra.run.dir={tmp_path}/run")
    table_then_path(lines, "wrote ")
    assert "decodelab" in err


def test_micro_prints_its_table_and_the_results_path(tmp_path):
    lines, err = entry(tmp_path, "micro", *TINY, "part=kv_speed", "contexts=[24]", "steps=2", "repeats=1",
                       "backends=[dense]", f"hydra.run.dir={tmp_path}/run")
    assert table_then_path(lines, "wrote ") == tmp_path / "run" / "results.jsonl"
    assert "conditions" in err  # the run conditions: on stderr (and in results.jsonl)


def test_serve_prints_its_table_and_the_results_path(tmp_path):
    lines, err = entry(tmp_path, "serve", *TINY, "trace=synthetic", "requests=3", "synthetic.prompt_tokens=[8,16]",
                       "synthetic.output_tokens=[4,6]", "compare_transformers=false", "rates=[inf]",
                       "backends=[dense]", f"hydra.run.dir={tmp_path}/run")
    assert table_then_path(lines, "results: ") == tmp_path / "run" / "results.jsonl"
    assert "decodelab.serve" in err


def test_generate_prints_only_the_text(tmp_path):
    lines, err = entry(tmp_path, "generate", *TINY, "prompt=hi", "max_new_tokens=4", f"hydra.run.dir={tmp_path}/run")
    data_only(lines)
    assert "TTFT" in err and not any("TTFT" in line for line in lines)
