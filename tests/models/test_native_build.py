"""The native kernel library on disk: its sources are package data, it is built with
torch.utils.cpp_extension into a folder under DECODELAB_CACHE, damage is found before the
library is loaded, a damaged library is rebuilt (or refused naming the folder), one build
at a time, and a machine that cannot build gets a reason rather than an exception."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from fnmatch import fnmatch
from importlib import resources
from pathlib import Path

import pytest

from decodelab.models import native
from decodelab.models import native_build
from decodelab.models.native_build import LIBRARY, RECORD, compile_extension, library_problem, probe, ready
from decodelab.models.paths import cache_root

pytestmark = pytest.mark.skipif(native.problem() is not None, reason=f"no native kernels here: {native.problem()}")


def copying(calls: list):
    """A `build` that 'compiles' by copying this process's good library (and counts calls)."""
    def build(folder: Path):
        calls.append(sorted(p.name for p in folder.iterdir()))  # what the build found there
        shutil.copy(native.library(), folder / LIBRARY)
    return build


@pytest.fixture
def built(tmp_path) -> Path:
    folder = tmp_path / "kernels" / "key"
    assert ready(folder, copying([])) is None
    assert library_problem(folder) is None
    return folder


def scribble(lib: Path, offset: int = 80_000, n: int = 4096) -> None:
    with open(lib, "r+b") as fh:
        fh.seek(offset)
        fh.write(os.urandom(n))


@pytest.mark.slow  # 6.1 s in the default run on a 2-core Zen 3 (session 50)
def test_a_build_is_probed_and_recorded(built):
    assert (built / RECORD).is_file() and probe(built / LIBRARY) is None
    calls = []
    assert ready(built, copying(calls)) is None and calls == []  # a good library is loaded as it is


@pytest.mark.slow  # 19 s in the default run on a 2-core Zen 3 (session 50)
@pytest.mark.parametrize("damage", ["random bytes", "truncated", "random bytes, no record"])
def test_a_damaged_library_is_found_and_rebuilt(built, damage, capsys):
    lib = built / LIBRARY
    good = lib.read_bytes()
    if damage == "truncated":
        os.truncate(lib, 1000)
    else:
        scribble(lib)
    if damage.endswith("no record"):
        (built / RECORD).unlink()
    why = library_problem(built)
    assert why and {"truncated": "truncated or changed (1,000 bytes", "random bytes": "checksum differs",
                    "random bytes, no record": "no integrity record"}[damage] in why
    calls = []
    assert ready(built, copying(calls)) is None and calls == [[]]  # rebuilt in an emptied folder
    assert lib.read_bytes() == good and library_problem(built) is None
    err = capsys.readouterr().err
    assert "rebuilding the native kernels" in err and "building the native int8/int4 kernels" in err
    if damage.endswith("no record"):
        assert "in a probe process" in err  # the probe, not the caller, met the damage


@pytest.mark.slow  # 6.5 s in the default run on a 2-core Zen 3 (session 50)
def test_an_older_build_without_a_record_is_probed_and_kept(built):
    (built / RECORD).unlink()
    calls = []
    assert ready(built, copying(calls)) is None and calls == [] and library_problem(built) is None


def test_a_library_that_crashes_its_probe_is_named_with_the_signal(tmp_path):
    bad = tmp_path / LIBRARY
    shutil.copy(native.library(), bad)
    scribble(bad)
    why = probe(bad)
    assert why is not None and str(bad) in why and ("killed it with SIG" in why or "failed (exit" in why)


@pytest.mark.slow  # 3.2 s in the default run on a 2-core Zen 3 (session 50)
def test_a_damaged_library_that_cannot_be_rebuilt_names_the_folder_to_delete(built):
    scribble(built / LIBRARY)
    why = ready(built, lambda tmp: "no compiler here")
    assert why.startswith("the native kernel library is damaged") and "no compiler here" in why
    assert f"rm -r {built}" in why


@pytest.mark.slow  # 2.5 s in the default run on a 2-core Zen 3 (session 50)
def test_a_freshly_built_library_that_fails_its_probe_is_not_installed(tmp_path):
    folder = tmp_path / "k"

    def broken(folder: Path):
        (folder / LIBRARY).write_bytes(b"\x7fELF" + os.urandom(2000))
    why = ready(folder, broken)
    assert why and "freshly built library fails its check" in why and not (folder / LIBRARY).exists()


@pytest.mark.slow  # 6.9 s in the default run on a 2-core Zen 3 (session 50)
def test_two_processes_on_an_empty_folder_build_once(tmp_path):
    """The second waits on the lock, then finds the first one's library good (the build
    goes on until both processes have started)."""
    folder, count, started = tmp_path / "kernels" / "key", tmp_path / "builds.txt", tmp_path / "started"
    started.mkdir()
    code = textwrap.dedent(f"""
        import os, shutil, time
        from pathlib import Path
        from decodelab.models import native_build
        def build(folder):
            with open({str(count)!r}, "a") as fh:
                fh.write("build\\n")
            while len(os.listdir({str(started)!r})) < 2:
                time.sleep(0.05)
            shutil.copy({str(native.library())!r}, folder / native_build.LIBRARY)
        Path({str(started)!r}, str(os.getpid())).touch()
        print(native_build.ready(Path({str(folder)!r}), build))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [o.strip() for o, _ in outs] == ["None", "None"]
    assert count.read_text() == "build\n"
    assert any("waiting for another process building" in e for _, e in outs)
    assert library_problem(folder) is None


def test_a_fallback_says_so_once(monkeypatch, capsys):
    monkeypatch.setattr(native, "_checked", True)
    monkeypatch.setattr(native, "_problem", "no compiler was found (install gcc and g++)")
    monkeypatch.setattr(native, "_noted", set())
    from decodelab.models.quantize import WeightOptions

    assert WeightOptions("int8").kernel_for(64, 64, "cpu")[0] == "_weight_int8pack_mm"
    assert WeightOptions("int8").kernel_for(128, 64, "cpu")[0] == "_weight_int8pack_mm"
    err = capsys.readouterr().err
    assert err.count("int8 weights run on torch's kernels") == 1 and "install gcc and g++" in err


def test_the_kernel_sources_are_package_data():
    """The sources are files of the package decodelab.models (read with importlib.resources),
    and pyproject's package-data puts them in a built wheel."""
    tomllib = pytest.importorskip("tomllib")
    files = native.sources()
    assert [f.name for f in files] == ["native_kernels.cpp", "native_ops.cpp"] and all(f.is_file() for f in files)
    assert "void dl_int8_mm(" in files[0].read_text() and "TORCH_LIBRARY(decodelab, m)" in files[1].read_text()
    assert files[0] == resources.files("decodelab.models") / "kernels" / "native_kernels.cpp"
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    setup = pyproject["tool"]["setuptools"]
    assert "decodelab.models.kernels" in setup["packages"]  # a folder of data files, declared as setuptools asks
    globs = setup["package-data"]["decodelab.models.kernels"]
    assert all(any(fnmatch(f.name, g) for g in globs) for f in files), globs


def test_the_library_is_built_by_cpp_extension_under_the_cache():
    """The loaded library lies in its cpp_extension build folder: DECODELAB_CACHE/kernels/<key>,
    beside the ninja file and the objects cpp_extension made there, and as recorded."""
    lib = native.library()
    folder = lib.parent
    assert lib.name == LIBRARY and folder == cache_root() / "kernels" / native._key(os.environ.get("CXX", "c++"))
    assert {"build.ninja", "native_kernels.o", "native_ops.o", RECORD} <= {p.name for p in folder.iterdir()}
    assert str(native.sources()[0]) in (folder / "build.ninja").read_text()
    assert library_problem(folder) is None


@pytest.mark.slow  # 8.1 s in the default run on a 2-core Zen 3 (session 50)
def test_a_rebuild_clears_a_stale_cpp_extension_lock_and_old_objects(built):
    """cpp_extension waits forever on a `lock` file that a killed build left in its folder;
    holding decodelab's flock no other build is running, so a rebuild starts from an empty
    folder (lock, objects and the damaged library gone)."""
    (built / "lock").touch()
    (built / "native_ops.o").write_bytes(b"half an object")
    os.truncate(built / LIBRARY, 1000)
    calls = []
    assert ready(built, copying(calls)) is None and calls == [[]]
    assert not (built / "lock").exists() and library_problem(built) is None


@pytest.mark.slow  # 2.6 s in the default run on a 2-core Zen 3 (session 50)
def test_a_compile_error_is_a_problem_with_the_compilers_words(tmp_path):
    """The real cpp_extension build (in a child process) on a source that does not compile:
    a reason naming the folder and quoting the compiler, no exception, no library."""
    bad = tmp_path / "bad.cpp"
    bad.write_text("int broken = ;\n")
    why = compile_extension(tmp_path / "build", [str(bad)], [], [])
    assert why is not None and str(tmp_path / "build") in why and "bad.cpp" in why and "error" in why
    assert not (tmp_path / "build" / LIBRARY).exists()


@pytest.mark.parametrize("missing", ["compiler", "ninja"])
def test_a_machine_that_cannot_build_gets_a_reason_not_an_exception(monkeypatch, missing):
    for name in ("_checked", "_problem", "_library"):  # restored after the test
        monkeypatch.setattr(native, name, getattr(native, name))
    if missing == "compiler":
        monkeypatch.setenv("CXX", "/nonexistent/c++")
    else:
        monkeypatch.setattr(native_build, "ninja_dir", lambda: None)
    monkeypatch.setattr(native_build, "ready", lambda *a: pytest.fail("a build was tried"))
    native._build()
    assert native._problem == native.problem() and native._problem.endswith(
        {"compiler": "(install g++, or set CXX)", "ninja": "(pip install ninja)"}[missing])
