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


@pytest.mark.slow  # 12 s: builds and installs a wheel
def test_a_built_wheel_installed_not_editable_runs_from_any_directory(tmp_path):
    """`pip wheel .` then `pip install --target` (no editable link to the checkout): the
    configs and the packaged workload come with it; generate and load(name) work from a
    scratch directory, and CONF_DIR is the installed one."""
    import os
    import zipfile
    from pathlib import Path

    pytest.importorskip("setuptools")  # the build backend (pyproject.toml), built without isolation: offline
    import shutil

    repo = Path(__file__).resolve().parents[1]
    root = tmp_path / "src"  # a copy: the build writes build/ and *.egg-info beside the sources
    root.mkdir()
    for item in ("pyproject.toml", "README.md", "conf", "models", "cache", "decoding", "experiments"):
        (shutil.copytree if (repo / item).is_dir() else shutil.copy)(
            repo / item, root / item, **({"ignore": shutil.ignore_patterns("__pycache__", "*.egg-info")}
                                         if (repo / item).is_dir() else {}))
    wheels, site, work = tmp_path / "wheels", tmp_path / "site", tmp_path / "work"
    work.mkdir()
    pip = [sys.executable, "-m", "pip", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", str(root), "-w", str(wheels)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("decodelab-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    confs = {n for n in names if n.startswith("decodelab/conf/") and n.endswith(".yaml")}
    assert len(confs) == len(list((repo / "conf").rglob("*.yaml")))
    assert "decodelab/experiments/results/agree-prompts.jsonl" in names
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True,
                   capture_output=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(site)}
    code = ("import decodelab.models.loading as l; from decodelab.experiments.workloads import PACKAGED; "
            "print(l.CONF_DIR); print(PACKAGED); l.load('tiny-llama', device='cpu')")
    p = subprocess.run([sys.executable, "-c", code], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    conf_dir, packaged = p.stdout.split()
    assert conf_dir == str(site / "decodelab" / "conf") and packaged.startswith(str(site))
    g = subprocess.run([sys.executable, "-m", "decodelab.experiments.generate", "model=tiny-llama", "prompt=hi",
                        "max_new_tokens=3", "model.device=cpu"], cwd=work, env=env, capture_output=True, text=True,
                       timeout=300)
    assert g.returncode == 0 and g.stdout, g.stderr[-2000:]


def test_decodelab_cache_exports_every_backend():
    import decodelab.cache as c
    from decodelab.experiments.harness import group_options

    names = {"dense": "DenseCache", "paged": "PagedCache", "int4": "QuantizedCache", "sliding": "SlidingCache"}
    assert set(names) == set(group_options("cache"))  # one export per conf/cache option
    assert all(issubclass(getattr(c, n), c.KVCache) and n in c.__all__ for n in names.values())
