"""The installed import names: `decodelab.*`, usable from a project whose own folders are
called `models/` and `cache/` (they shadow nothing, and nothing shadows them)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_imports_from_a_directory_with_its_own_models_and_cache_folders(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "__init__.py").write_text("MINE = True\n")  # the user's own package
    code = ("from decodelab.models import load; from decodelab.cache import DenseCache; "
            "from decodelab.decoding import generate_text; import cache; "
            "import decodelab.models.loading as l; print(cache.MINE, l.CONF_DIR.is_dir())")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["True", "True"]  # the user's cache package, and ours with its configs


# CI proves the wheel in its slow run (builds it, installs it into a fresh venv, runs four console scripts)
@pytest.mark.slow  # 33 s in the default run on a 2-core Zen 3 (session 50)
def test_a_built_wheel_installed_not_editable_runs_from_any_directory(tmp_path):
    """`pip wheel .`, then `pip install` of that wheel (no editable link to the checkout)
    into a fresh venv that reuses the installed dependencies (a .pth line to this venv's
    site-packages, after its own): the configs and the packaged workload come with it, and
    from a scratch directory its console scripts run: generate, `--cfg job`, a two-cell
    bench sweep and a report of it."""
    import os
    import shutil
    import sysconfig
    import venv
    import zipfile
    from pathlib import Path

    pytest.importorskip("setuptools")  # the build backend (pyproject.toml), built without isolation: offline
    repo = Path(__file__).resolve().parents[1]
    root = tmp_path / "src"  # a copy: the build writes build/ and *.egg-info beside the sources
    root.mkdir()
    for item in ("pyproject.toml", "README.md", "conf", "models", "cache", "decoding", "experiments"):
        (shutil.copytree if (repo / item).is_dir() else shutil.copy)(
            repo / item, root / item, **({"ignore": shutil.ignore_patterns("__pycache__", "*.egg-info")}
                                         if (repo / item).is_dir() else {}))
    wheels, env_dir, work = tmp_path / "wheels", tmp_path / "venv", tmp_path / "work"
    work.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "-q", "wheel", "--no-deps", "--no-build-isolation", str(root),
                    "-w", str(wheels)], check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("decodelab-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    confs = {n for n in names if n.startswith("decodelab/conf/") and n.endswith(".yaml")}
    assert len(confs) == len(list((repo / "conf").rglob("*.yaml")))
    assert "decodelab/experiments/results/agree-prompts.jsonl" in names

    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # torch, hydra, ... (and pip)
    subprocess.run([str(py), "-m", "pip", "-q", "install", "--no-deps", str(wheel)], check=True,
                   capture_output=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}

    def run(*cmd: str) -> subprocess.CompletedProcess:
        p = subprocess.run([str(env_dir / "bin" / cmd[0]), *cmd[1:]], cwd=work, env=env, capture_output=True,
                           text=True, timeout=600)
        assert p.returncode == 0, (cmd, p.stderr[-2000:])
        return p

    where = run("python", "-c", "import decodelab.models.loading as l; from decodelab.experiments.workloads "
                                "import PACKAGED; print(l.CONF_DIR, PACKAGED)").stdout.split()
    assert where[0] == str(site / "decodelab" / "conf") and where[1].startswith(str(site))  # the installed copy
    gen = run("decodelab-generate", "model=tiny-llama", "prompt=hi", "max_new_tokens=4", "model.device=cpu")
    assert gen.stdout and "TTFT" in gen.stderr  # the text on stdout (a random model's), the figures on stderr
    job = run("decodelab-generate", "--cfg", "job")
    assert "max_new_tokens:" in job.stdout and "model:" in job.stdout
    sweep = work / "sweep"
    run("decodelab-bench", "-m", "model=tiny-llama", "model.device=cpu", "cache=dense,paged", "workload=synthetic",
        "workload.lengths=[16]", "workload.per_length=1", "max_new_tokens=3", "progress=false", "warmup=false",
        f"hydra.sweep.dir={sweep}")
    assert len(list(sweep.rglob("results.jsonl"))) == 2
    run("decodelab-report", str(sweep))
    md = (sweep / "report.md").read_text()
    assert "| dense/greedy |" in md and "| paged/greedy |" in md


def test_decodelab_cache_exports_every_backend():
    import decodelab.cache as c
    from decodelab.experiments.harness import group_options

    names = {"dense": "DenseCache", "paged": "PagedCache", "int4": "QuantizedCache", "sliding": "SlidingCache"}
    # one export per conf/cache option; dense-bf16, dense-fp16, dense-fp8 are dense with a kv_dtype
    assert set(names) == {o.split("-")[0] for o in group_options("cache")}
    assert all(issubclass(getattr(c, n), c.KVCache) and n in c.__all__ for n in names.values())
