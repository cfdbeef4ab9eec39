"""Bad inputs to the entry points fail cleanly (issue 14's fault-injection cases): stop
strings, prompt files, bad JSONL workloads refused by file and line before any weights
load, a garbage results file that only reruns its own run, and a run claimed once when two
identical sweeps share a directory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from decodelab.experiments.generate import stop_strings
from decodelab.experiments.report import load_runs
from decodelab.models.errors import SetupError

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model=tiny-llama", "model.device=cpu", "progress=false", "warmup=false"]


def entry(name: str, *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"decodelab.experiments.{name}", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, **kw)


def refused(p: subprocess.CompletedProcess, *words: str) -> None:
    """Exit 2, no traceback, every word in the message, and no weights loaded."""
    assert p.returncode == 2, p.stderr[-2000:]
    assert "Traceback" not in p.stderr and "model: " not in p.stderr
    for w in words:
        assert w in p.stderr, (w, p.stderr[-2000:])


# -- stop strings ---------------------------------------------------------------------
def test_stop_strings_take_escapes_a_plain_string_and_refuse_an_empty_one():
    assert stop_strings(["\\n\\n"]) == ("\n\n",)  # what the shell and Hydra hand over for '["\n\n"]'
    assert stop_strings(["a\\tb", "c\\\\n"]) == ("a\tb", "c\\n")
    assert stop_strings("night") == ("night",)  # one string, not its characters
    assert stop_strings([]) == ()
    with pytest.raises(SetupError, match="non-empty"):
        stop_strings([""])


@pytest.mark.slow  # 9 s: two generate processes of 120 tokens (stop strings are also checked in process)
def test_stop_newlines_end_the_reply_end_to_end():
    """README's `stop='["\\n\\n"]'` as a shell passes it: the reply ends before a blank line."""
    free = entry("generate", *TINY, "prompt=Hello", "max_new_tokens=120", "json=true")
    assert free.returncode == 0, free.stderr[-2000:]
    text = json.loads(free.stdout)["text"]
    if "\n" not in text:
        pytest.skip("the tiny model's reply holds no newline to stop at")
    cut = entry("generate", *TINY, "prompt=Hello", "max_new_tokens=120", "json=true", 'stop=["\\n"]')
    rec = json.loads(cut.stdout)
    assert rec["finish"] == "stop" and rec["text"] == text[: text.index("\n")]
    empty = entry("generate", *TINY, "prompt=Hello", 'stop=[""]')
    refused(empty, "every stop string must be non-empty")


# -- prompts ---------------------------------------------------------------------------
@pytest.mark.slow  # 12 s in the default run on a 2-core Zen 3 (session 50)
def test_prompt_file_problems_are_named(tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9".encode("latin-1"))
    refused(entry("generate", *TINY, f"prompt_file={bad}"), "is not UTF-8 text", "iconv")
    refused(entry("generate", *TINY, f"prompt_file={tmp_path}"), "is a directory")
    refused(entry("generate", *TINY, f"prompt_file={tmp_path / 'nope.txt'}"), "does not exist")


@pytest.mark.slow  # 3.7 s in the default run on a 2-core Zen 3 (session 50)
def test_an_empty_prompt_is_listed_with_every_other_problem():
    p = entry("generate", *TINY, "prompt=", "cache=pagd", "decoder.temprature=1", "max_new_tokens=0")
    refused(p, "the prompt is empty", "no such cache", "did you mean decoder.temperature", "max_new_tokens")


# -- workloads -------------------------------------------------------------------------
BAD_WORKLOADS = {
    "no_prompt": ('{"prompt": "a"}\n{"text": "b"}\n', ":2: no `prompt` text"),
    "malformed": ('{"prompt": "a"}\n{"prompt": "b"\n', ":2: not JSON"),
    "empty": ("", "holds no records"),
    "not_objects": ('["a"]\n', ":1: a list, not a JSON object"),
    "bad_reference": ('{"prompt": "a", "reference": 3}\n', ":1: `reference` must be text"),
}


# a CLI run each, 4.5 s on a 2-core Zen 3 (session 53): two cases in the default run, all in the slow one
@pytest.mark.parametrize("case", [c if c in ("empty", "malformed") else pytest.param(c, marks=pytest.mark.slow)
                                  for c in sorted(BAD_WORKLOADS)])
# agree: 20 s in the default run on a 2-core Zen 3 (session 50)
@pytest.mark.parametrize("name", ["bench", pytest.param("agree", marks=pytest.mark.slow)])
def test_a_bad_jsonl_workload_is_refused_by_file_and_line_before_weights_load(tmp_path, case, name):
    text, message = BAD_WORKLOADS[case]
    f = tmp_path / "w.jsonl"
    f.write_text(text)
    p = entry(name, *TINY, "workload=jsonl", f"workload.path={f}", f"hydra.run.dir={tmp_path / 'out'}")
    refused(p, str(f), message)
    assert not (tmp_path / "out" / "results.jsonl").exists()


# -- results ---------------------------------------------------------------------------
@pytest.fixture
def prompts(tmp_path) -> Path:
    f = tmp_path / "prompts.jsonl"
    f.write_text('{"prompt": "Hello there"}\n{"prompt": "Name a prime."}\n')
    return f


def sweep_args(prompts: Path, sweep: Path) -> list[str]:
    return ["-m", *TINY, "workload=jsonl", f"workload.path={prompts}", "max_new_tokens=4", "cache=dense,paged",
            f"hydra.sweep.dir={sweep}"]


@pytest.mark.slow  # 12 s of sweeps
def test_a_garbage_results_file_reruns_that_run_only_and_the_report_is_rebuilt(tmp_path, prompts):
    sweep = tmp_path / "sweep"
    first = entry("bench", *sweep_args(prompts, sweep))
    assert first.returncode == 0, first.stderr[-2000:]
    files = sorted(sweep.rglob("results.jsonl"))
    assert len(files) == 2
    files[0].write_text("garbage {\n[1, 2]\n")
    kept = files[1].stat().st_mtime_ns
    (sweep / "report.md").unlink()
    again = entry("bench", *sweep_args(prompts, sweep))
    assert again.returncode == 0, again.stderr[-2000:]
    assert (again.stdout + again.stderr).count("already done") == 1  # the good run is kept
    assert files[1].stat().st_mtime_ns == kept
    assert json.loads(files[0].read_text().splitlines()[-1])["kind"] == "summary"  # the bad one reran
    assert len(load_runs(sweep)) == 2 and (sweep / "report.md").is_file()
    assert sum(line.startswith("| ") for line in (sweep / "report.md").read_text().splitlines()) == 1 + 2


@pytest.mark.slow  # 9.5 s in the default run on a 2-core Zen 3 (session 50)
def test_two_identical_sweeps_into_one_directory_run_each_job_once(tmp_path, prompts):
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "decodelab.experiments.bench", *sweep_args(prompts, sweep)]
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs
    measured = sum(log.count("] - run ") for log in logs)  # bench logs "run HASH: ..." when it measures
    assert measured == 2, logs  # each job once: the other process skipped it (claimed) or found it done
    assert len(load_runs(sweep)) == 2


def test_a_claim_held_by_a_live_process_is_respected_and_ends_with_it(tmp_path):
    """harness.claimed: a lock another process holds makes the run skip; once that
    process is killed (kill -9) the claim is free again; two claims in one process do not
    both win either."""
    import signal
    import time

    from decodelab.experiments.harness import CLAIM, claimed

    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); f.write('elsewhere 42');"
        " f.flush(); print('held', flush=True); time.sleep(600)"), str(tmp_path / CLAIM)], stdout=subprocess.PIPE,
        text=True)
    assert holder.stdout.readline().strip() == "held"
    with claimed(tmp_path) as who:
        assert who == "elsewhere 42"  # skipped, and told who measures it
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    time.sleep(0.1)
    with claimed(tmp_path) as who:
        assert who is None  # the dead process's claim is gone with it
        with claimed(tmp_path) as again:
            assert again is not None  # a second claim on the same run does not win
    with claimed(tmp_path) as who:
        assert who is None  # released when the body ended


def test_only_a_run_folder_hydra_made_and_nothing_wrote_to_is_removed_on_refusal(tmp_path, monkeypatch):
    """A refused run's folder goes when it holds only Hydra's .hydra/ and logs; the working
    directory (generate runs in `.`), a folder without .hydra/, and one with results stay."""
    from decodelab.experiments.harness import remove_if_unused

    monkeypatch.chdir(tmp_path)
    (tmp_path / "old.log").write_text("x")
    remove_if_unused(tmp_path)  # generate's `.`: empty of anything else, and still never removed
    remove_if_unused(Path("."))
    assert (tmp_path / "old.log").exists()
    plain = tmp_path / "plain"
    plain.mkdir()
    remove_if_unused(plain)  # no .hydra/: not Hydra's
    assert plain.is_dir()
    import os

    from decodelab.experiments.harness import MARK, mark_run

    def hydra_run(name, *files, others=()):
        run = tmp_path / "outputs" / "serve" / name
        (run / ".hydra").mkdir(parents=True)
        (run / ".hydra" / "config.yaml").write_text("a: 1")
        for f in files:
            (run / f).write_text("x")
        for pid in others:  # another process running in the same folder (same second)
            (run / ".hydra" / f"{MARK}{pid}").touch()
        mark_run(run)
        return run
    run, kept, shared = hydra_run("t1", "serve.log"), hydra_run("t0", "results.jsonl"), hydra_run("t2", others=[1])
    unmarked = tmp_path / "outputs" / "serve" / "t3"
    (unmarked / ".hydra").mkdir(parents=True)
    older = hydra_run("t4", "serve.log")
    os.utime(older / "serve.log", (0, 0))  # a log of a run before this process
    for f in (run, kept, shared, unmarked, older):
        remove_if_unused(f)
    assert not run.exists() and (tmp_path / "outputs" / "serve").is_dir()
    assert (kept / "results.jsonl").exists() and shared.is_dir() and unmarked.is_dir() and older.is_dir()
    assert not (shared / ".hydra" / f"{MARK}{os.getpid()}").exists()  # its own mark gone, the other's kept
    assert (shared / ".hydra" / f"{MARK}1").exists()
    remove_if_unused(kept.parent.parent)  # an ancestor: no .hydra/ of its own
    assert kept.exists()
