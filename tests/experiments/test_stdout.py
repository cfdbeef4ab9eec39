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


def start(tmp_path: Path, name: str, *args: str) -> tuple[subprocess.Popen, Path]:
    """Start `decodelab.experiments.<name>` with stdout into a file."""
    out = tmp_path / f"{name}.stdout"
    with open(out, "w") as f:
        p = subprocess.Popen([sys.executable, "-m", f"decodelab.experiments.{name}", *args], cwd=tmp_path, stdout=f,
                             stderr=subprocess.PIPE, text=True)
    return p, out


def finish(started: tuple[subprocess.Popen, Path]) -> tuple[list[str], str]:
    """Wait for a started entry point: (its stdout lines, its stderr)."""
    p, out = started
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    return out.read_text().splitlines(), err


def entry(tmp_path: Path, name: str, *args: str) -> tuple[list[str], str]:
    return finish(start(tmp_path, name, *args))


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
def ran(tmp_path_factory) -> dict:
    """bench, agree, micro, serve and generate started side by side (one thread each), then
    report on bench's run: name -> (stdout lines, stderr), and the folder."""
    d = tmp_path_factory.mktemp("entries")
    started = {
        "bench": start(d, "bench", *TINY, "workload=synthetic", "workload.lengths=[16]", "workload.per_length=1",
                       "max_new_tokens=3", "warmup=false", f"hydra.run.dir={d}/bench"),
        "agree": start(d, "agree", *TINY, "draft.layers=1", "workload=synthetic", "workload.lengths=[9]",
                       "forced_tokens=6", "free_tokens=4", f"hydra.run.dir={d}/agree"),
        "micro": start(d, "micro", *TINY, "part=kv_speed", "contexts=[24]", "steps=2", "repeats=1",
                       "backends=[dense]", f"hydra.run.dir={d}/micro"),
        "serve": start(d, "serve", *TINY, "trace=synthetic", "requests=3", "synthetic.prompt_tokens=[8,16]",
                       "synthetic.output_tokens=[4,6]", "compare_transformers=false", "rates=[inf]",
                       "backends=[dense]", f"hydra.run.dir={d}/serve"),
        "generate": start(d, "generate", *TINY, "prompt=hi", "max_new_tokens=4", f"hydra.run.dir={d}/generate"),
    }
    done = {name: finish(s) for name, s in started.items()}
    done["report"] = entry(d, "report", str(d / "bench"))
    return {**done, "dir": d}


@pytest.mark.slow  # 28 s in the default run on a 2-core Zen 3 (session 50)
def test_bench_prints_its_table_and_the_results_path(ran):
    lines, err = ran["bench"]
    assert table_then_path(lines, "results: ") == ran["dir"] / "bench" / "results.jsonl"
    assert "decodelab.bench" in err  # its log went to stderr


@pytest.mark.slow  # with the module's `ran` (every console script once, 28 s; session 50)
def test_report_prints_its_table_and_what_it_wrote(ran):
    lines, _ = ran["report"]
    assert table_then_path(lines, "wrote ").parent == ran["dir"] / "bench"


@pytest.mark.slow  # with the module's `ran` (every console script once, 28 s; session 50)
def test_agree_prints_its_matrix_and_the_results_path(ran):
    lines, err = ran["agree"]
    table_then_path(lines, "wrote ")
    assert "decodelab" in err


@pytest.mark.slow  # with the module's `ran` (every console script once, 28 s; session 50)
def test_micro_prints_its_table_and_the_results_path(ran):
    lines, err = ran["micro"]
    assert table_then_path(lines, "wrote ") == ran["dir"] / "micro" / "results.jsonl"
    assert "conditions" in err  # the run conditions: on stderr (and in results.jsonl)


@pytest.mark.slow  # with the module's `ran` (every console script once, 28 s; session 50)
def test_serve_prints_its_table_and_the_results_path(ran):
    lines, err = ran["serve"]
    assert table_then_path(lines, "results: ") == ran["dir"] / "serve" / "results.jsonl"
    assert "decodelab.serve" in err


@pytest.mark.slow  # with the module's `ran` (every console script once, 28 s; session 50)
def test_generate_prints_only_the_text(ran):
    lines, err = ran["generate"]
    data_only(lines)
    assert "TTFT" in err and not any("TTFT" in line for line in lines)


#: each console script with one spelling of a Hydra flag whose value is the next word (they share
#: one precheck); report, whose DIR shorthand once took that word for a folder, with every spelling
FLAGS = [("generate", ["--cfg", "job"]), ("bench", ["-c=job"]), ("agree", ["--info", "defaults"]),
         ("micro", ["-c", "job"]), ("serve", ["--cfg=job"]), ("report", ["--cfg", "job"]), ("report", ["-c=job"]),
         ("report", ["--info", "defaults"])]


@pytest.mark.slow  # 11 s in the default run on a 2-core Zen 3 (session 50)
def test_every_console_script_takes_hydras_flags_in_both_spellings(tmp_path):
    """The console scripts (precheck, report's DIR shorthand) leave the word after a flag to it."""
    bin_dir = Path(sys.executable).parent
    procs = [(e, flags, subprocess.Popen([str(bin_dir / f"decodelab-{e}"), *flags], cwd=tmp_path,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
             for e, flags in FLAGS]
    for e, flags, p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, (e, flags, err[-1500:])
        assert ("Defaults List" in out) if flags[0] == "--info" else ("_target_" in out or "dir:" in out), (e, out)
