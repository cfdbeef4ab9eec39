"""Every command in README.md's code blocks, so that the docs cannot drift from the code.

Default run: each `decodelab-*` command passes its entry point's own checks as written
(`precheck` and `check`: every group option, key and value, no weights loaded; a sweep,
each of its jobs); each generate command runs for real on a tiny model (where the model
does not matter: `README_TINY` says what is swapped); `make` targets and scripts exist;
the Python blocks run with `load` returning the tiny model. Slow: the generate commands
and the Python blocks as written, on the real models."""

from __future__ import annotations

import itertools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from decodelab.models.loading import CONF_DIR

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CONFIGS = {"generate": "generate", "bench": "config", "agree": "agree", "micro": "micro", "serve": "serve"}
#: on the tiny models: the model, and what depends on it (early-exit layers of a 2-layer model)
README_TINY = {"model=gemma3-270m": "model=tiny-gemma3", "draft.layers=12": "draft.layers=1"}
#: in the Python blocks on the tiny model: a KV budget its 8 x 1024-token cache can hold
README_TINY_PYTHON = {"kv_budget_mb=24": "kv_budget_mb=2"}


def blocks(lang: str) -> list[tuple[int, str]]:
    """(line number, text) of each ```lang fenced block of README.md."""
    out, at, lines = [], None, README.splitlines()
    for i, line in enumerate(lines, 1):
        if line.startswith("```"):
            if at is None and line[3:].strip() == lang:
                at, body = i, []
            elif at is not None:
                out.append((at, "\n".join(body)))
                at = None
        elif at is not None:
            body.append(line)
    return out


def commands() -> list[tuple[str, list[str], str | None]]:
    """(where, argv, piped stdin text) of every shell command in the bash blocks."""
    out = []
    for at, text in blocks("bash"):
        for n, line in enumerate(text.replace("\\\n", " ").splitlines()):
            words = shlex.split(line, comments=True)
            stdin = None
            if "|" in words:  # echo "text" | command
                cut = words.index("|")
                assert words[0] == "echo", f"README.md:{at}: a pipe from something other than echo: {line}"
                stdin, words = " ".join(words[1:cut]) + "\n", words[cut + 1:]
            while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):  # VAR=value command
                words = words[1:]
            if words:
                out.append((f"README.md:{at}+{n + 1}", words, stdin))
    return out


CMDS = commands()
ENTRY = [(w, a, s) for w, a, s in CMDS if a[0].startswith(".venv/bin/decodelab-")]
GENERATE = [(w, a, s) for w, a, s in ENTRY if a[0] == ".venv/bin/decodelab-generate"]


def test_the_readme_has_the_commands_this_test_reads():
    assert len(ENTRY) >= 20 and len(GENERATE) >= 10 and len(blocks("python")) >= 2
    assert {a[0] for _, a, _ in CMDS} <= {"make", "bash", ".venv/bin/pip", *(a[0] for _, a, _ in ENTRY)}


def jobs(argv: list[str]) -> list[list[str]]:
    """The overrides of each job of a command line: a `-m` sweep (`a=x,y b=u,v`) expanded;
    Hydra's own keys (hydra.*) dropped (they shape the launch, not the job)."""
    args = [a for a in argv if a != "-m" and not a.startswith("hydra.")]
    if "-m" not in argv:
        return [args]

    def values(arg):
        key, _, value = arg.partition("=")
        return [f"{key}={v}" for v in value.split(",")] if value[:1] not in "[{'\"" and "," in value else [arg]
    return [list(x) for x in itertools.product(*map(values, args))]


def piped(monkeypatch, tmp_path, stdin: str | None) -> None:
    """The command's working folder, the repository's root as the README's commands assume
    (linked, plus the prompt file a README line names: nothing lands in the checkout), and
    its stdin."""
    from decodelab.experiments import generate

    for item in ROOT.iterdir():
        if item.name not in ("outputs", "prompt.txt"):
            (tmp_path / item.name).symlink_to(item)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompt.txt").write_text("Why is the sky blue?\n")
    monkeypatch.setattr(generate, "_stdin", lambda: stdin if stdin is not None else pytest.fail("read stdin"))
    monkeypatch.setattr(sys.stdin, "isatty", lambda: stdin is None, raising=False)


@pytest.mark.parametrize("where, argv, stdin", ENTRY, ids=[w for w, _, _ in ENTRY])
def test_every_entry_point_command_passes_its_checks_as_written(where, argv, stdin, tmp_path, monkeypatch):
    import importlib

    entry = argv[0].removeprefix(".venv/bin/decodelab-")
    assert f"decodelab-{entry} = " in (ROOT / "pyproject.toml").read_text(), f"{where}: no console script {entry}"
    if entry not in CONFIGS:  # report (a path argument), gpu-check (no options)
        return
    module = importlib.import_module(f"decodelab.experiments.{entry}")
    piped(monkeypatch, tmp_path, stdin)
    from decodelab.experiments.cli import precheck

    whole = module.check if entry != "agree" else lambda cfg: module.check_all(cfg, argv[1:])
    precheck(argv[1:], CONFIGS[entry], whole)  # the command line as typed (-m and all): exits 2 on a fault
    for overrides in jobs(argv[1:]):
        check = module.check if entry != "agree" else lambda cfg, o=overrides: module.check_all(cfg, o)
        overrides = precheck(overrides, CONFIGS[entry], check)  # each job's: exits 2 naming any unknown option
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = compose(config_name=CONFIGS[entry], overrides=overrides)
        check(cfg)  # raises SetupError with every reason


def tiny(argv: list[str]) -> list[str]:
    args = [README_TINY.get(a, a) for a in argv[1:]]
    model = [] if any(a.startswith("model=") for a in args) else ["model=tiny-llama"]
    return model + args + ["max_new_tokens=4", "model.device=cpu"]


@pytest.mark.parametrize("where, argv, stdin", GENERATE, ids=[w for w, _, _ in GENERATE])
def test_every_generate_command_runs_on_a_tiny_model(where, argv, stdin, tmp_path, monkeypatch, capsys):
    from decodelab.experiments import generate

    piped(monkeypatch, tmp_path, stdin)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="generate", overrides=tiny(argv))
    result = generate.run(cfg)
    assert len(result.tokens[0]) >= 1 and capsys.readouterr().out == result.text[0]


def test_make_targets_and_scripts_named_in_the_readme_exist():
    targets = set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.M))
    for where, argv, _ in CMDS:
        if argv[0] == "make":
            assert set(argv[1:]) <= targets, f"{where}: make {argv[1:]} (targets: {sorted(targets)})"
        if argv[0] == "bash":
            assert (ROOT / argv[1]).is_file(), f"{where}: no {argv[1]}"


PYTHON = blocks("python")


@pytest.mark.parametrize("at, code", PYTHON, ids=[f"README.md:{at}" for at, _ in PYTHON])
def test_every_python_block_runs_on_a_tiny_model(at, code, monkeypatch, capsys):
    import decodelab.models
    import decodelab.models.loading as loading

    real = loading.load
    monkeypatch.setattr(loading, "load", lambda name, **kw: real("tiny-llama", **kw))
    monkeypatch.setattr(decodelab.models, "load", loading.load)
    for a, b in README_TINY_PYTHON.items():
        code = code.replace(a, b)
    exec(compile(code, f"README.md:{at}", "exec"), {})
    assert capsys.readouterr().out.strip()  # each block prints what it shows


@pytest.mark.slow
@pytest.mark.parametrize("where, argv, stdin", GENERATE, ids=[w for w, _, _ in GENERATE])
def test_every_generate_command_runs_as_written(where, argv, stdin, tmp_path):
    (tmp_path / "prompt.txt").write_text("Why is the sky blue?\n")
    cmd = [str(ROOT / argv[0]), *argv[1:], "max_new_tokens=4"]
    p = subprocess.run(cmd, cwd=tmp_path, input=stdin, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"{where}: {shlex.join(argv)}\n{p.stderr[-3000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("at, code", PYTHON, ids=[f"README.md:{at}" for at, _ in PYTHON])
def test_every_python_block_runs_as_written(at, code, tmp_path):
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0 and p.stdout.strip(), f"README.md:{at}\n{p.stderr[-3000:]}"
