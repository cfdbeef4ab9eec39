"""The installed import names: `decodelab.*`, usable from a project whose own folders are
called `models/` and `cache/` (they shadow nothing, and nothing shadows them)."""

from __future__ import annotations

import subprocess
import sys


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
