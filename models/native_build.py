"""The native kernel library on disk: built once per key by torch.utils.cpp_extension,
checked before every load.

`compile_extension` runs `torch.utils.cpp_extension.load` in a child process: it writes
the ninja file into the key's folder (the extension's build directory), compiles there
with torch's include paths and libraries, and leaves the library at `folder/LIBRARY`.
It runs in a child because `load` also loads what it built, and this process loads a
library only when it is known good. A library loaded with `torch.ops.load_library` runs
as machine code inside this process: damaged bytes in it end the process with a signal
(SIGSEGV, SIGILL, SIGBUS), before any Python handler can say a word. So:

- `record` (beside the library) holds its size and xxh3-64 checksum, written when it was
  built and had passed `probe`; `library_problem` checks both (a few hundred KB: well
  under a millisecond) before every load;
- `probe` loads a library in a throw-away subprocess and runs every operator once on small
  inputs against its torch reference: a crash there costs the subprocess, not the caller.
  It runs after each build, and on a library found without a record (a build killed
  before its probe, or an older decodelab's);
- `ready` makes a folder's library good: checked as it is, else (re)built from nothing
  under a file lock (one build at a time per key: a second process waits for the first
  and reuses its library), probed, recorded. A damaged library is rebuilt, saying so; one
  that cannot be rebuilt is refused with the folder to delete.

The lock is an flock beside the folder rather than cpp_extension's own (a `lock` file
made inside it, which a build killed by SIGKILL or a power cut leaves behind, so that
every later `load` waits on it forever): an flock goes with its process however that
ends. Holding it, no other decodelab process builds into the folder, and a rebuild
clears the folder first: a stale `lock`, objects of the damaged build and all.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import xxhash  # declared in pyproject (also the converted weights' checksums)

NAME = "decodelab_kernels"  # the extension's name: cpp_extension writes NAME.so
LIBRARY = f"{NAME}.so"
RECORD = "library.json"
PROBE_TIMEOUT_S = 300

#: build and load the extension (argv[1]: `load`'s arguments as JSON)
BUILD = r"""
import json, sys
from torch.utils.cpp_extension import load
try:
    load(**json.loads(sys.argv[1]), is_python_module=False, is_standalone=False, verbose=False)
except Exception as e:  # its message holds the compiler's output: that, not a traceback
    sys.exit(f"{type(e).__name__}: {e}")
"""

#: every operator once on small inputs against its torch reference (argv[1]: the library)
PROBE = r"""
import sys, torch
torch.ops.load_library(sys.argv[1])
ops, g = torch.ops.decodelab, torch.Generator().manual_seed(0)
x = torch.randn(3, 64, generator=g)
codes = torch.randint(-127, 128, (8, 64), dtype=torch.int8, generator=g)
scale = torch.rand(8, generator=g) + 0.5
w8 = codes.float() * scale[:, None]
torch.testing.assert_close(ops.int8_mm(x, codes, scale), x @ w8.T, rtol=1e-4, atol=1e-3)
out = torch.empty(8 * 64)
ops.int8_dequant(codes, scale, 0, 8, out)
torch.testing.assert_close(out.view(8, 64), w8)
c4 = torch.randint(0, 16, (8, 64), dtype=torch.uint8, generator=g)
nib = (c4.view(8, 2, 2, 16)[:, :, 0] | (c4.view(8, 2, 2, 16)[:, :, 1] << 4)).reshape(8, 32).contiguous()
s4, t4 = torch.rand(8, 2, generator=g) + 0.5, torch.randn(8, 2, generator=g)
w4 = c4.float() * s4.repeat_interleave(32, 1) + t4.repeat_interleave(32, 1)
ops.int4_dequant(nib, s4, t4, 32, 0, 8, out)
torch.testing.assert_close(out.view(8, 64), w4)
for rows in (1, 3):
    torch.testing.assert_close(ops.int4_mm(x[:rows], nib, s4, t4, 32), x[:rows] @ w4.T, rtol=0.05, atol=0.3)
q = torch.randn(1, 2, 1, 8, generator=g)
k, v = torch.randn(2, 1, 1, 5, 8, generator=g)
ref = torch.softmax(q @ k[:, :, :4].transpose(-1, -2) * 0.5, -1) @ v[:, :, :4]
torch.testing.assert_close(ops.decode_attention(q, k, v, torch.tensor([[3]]), 0.5, 0), ref, rtol=1e-4, atol=1e-5)
print("ok")
"""


def checksum(path: Path) -> str:
    return xxhash.xxh3_64_hexdigest(path.read_bytes())


def library_problem(folder: Path) -> str | None:
    """Why `folder`'s library cannot be loaded as it is (missing, no record, another size or
    checksum than recorded at build time); None when it is as built."""
    lib = folder / LIBRARY
    if not lib.is_file():
        return f"{lib} does not exist"
    try:
        rec = json.loads((folder / RECORD).read_text())
        size, digest = int(rec["bytes"]), str(rec["xxh3_64"])
    except (OSError, ValueError, KeyError, TypeError):
        return f"{folder / RECORD} is missing or damaged (no integrity record of the library)"
    if (got := lib.stat().st_size) != size:
        return f"{lib} is truncated or changed ({got:,} bytes, {size:,} were built)"
    if checksum(lib) != digest:
        return f"{lib} is not what was built (its checksum differs)"
    return None


def _signal_name(returncode: int) -> str:
    import signal

    return signal.Signals(-returncode).name


def probe(lib: Path) -> str | None:
    """Load `lib` in a throw-away Python process and run each operator once against its
    torch reference; None when that passed, else what went wrong (a signal, a traceback)."""
    try:
        r = subprocess.run([sys.executable, "-c", PROBE, str(lib)], capture_output=True, text=True,
                           timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"loading {lib} in a probe process did not finish in {PROBE_TIMEOUT_S} s"
    if r.returncode == 0 and r.stdout.strip().endswith("ok"):
        return None
    if r.returncode < 0:
        return f"loading {lib} in a probe process killed it with {_signal_name(r.returncode)}"
    tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
    return f"loading {lib} in a probe process failed (exit {r.returncode}: {tail[:300]})"


def ninja_dir() -> str | None:
    """The folder holding the `ninja` that cpp_extension builds with: the one on PATH, else
    the `ninja` package's (a venv's bin/, on no PATH when the venv is not activated)."""
    if found := shutil.which("ninja"):
        return str(Path(found).parent)
    try:
        import ninja  # declared in pyproject
    except ImportError:
        return None
    bin_dir = getattr(ninja, "BIN_DIR", None)
    return bin_dir if bin_dir and shutil.which("ninja", path=bin_dir) else None


def compile_extension(folder: Path, sources: list[str], cflags: list[str], ldflags: list[str]) -> str | None:
    """Build `folder/LIBRARY` from `sources` with torch.utils.cpp_extension (`folder` is its
    build directory), in a child process; None, or why not (the compiler's last words)."""
    args = {"name": NAME, "sources": sources, "extra_cflags": cflags, "extra_ldflags": ldflags,
            "build_directory": str(folder)}
    folder.mkdir(parents=True, exist_ok=True)  # load() expects its build directory to exist
    env = dict(os.environ)
    if (bin_dir := ninja_dir()) is not None:
        env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", "")])
    r = subprocess.run([sys.executable, "-c", BUILD, json.dumps(args)], capture_output=True, text=True, env=env)
    if r.returncode == 0 and (folder / LIBRARY).is_file():
        return None
    if r.returncode < 0:
        return f"building decodelab's native kernels in {folder} killed its process with {_signal_name(r.returncode)}"
    return f"building decodelab's native kernels in {folder} failed: {r.stderr.strip()[-600:] or 'no output'}"


def write_record(folder: Path) -> None:
    """The library's size and checksum, written atomically beside it (after its probe passed)."""
    lib = folder / LIBRARY
    tmp = folder / f".{RECORD}.{os.getpid()}"
    tmp.write_text(json.dumps({"bytes": lib.stat().st_size, "xxh3_64": checksum(lib)}))
    os.replace(tmp, folder / RECORD)


@contextlib.contextmanager
def build_lock(folder: Path):
    """Hold an exclusive lock on `<folder>.lock` (flock: dropped when the process ends,
    however it ends). Says so on stderr when another process holds it (it is building).
    Where no lock file can be made (a read-only cache), runs unlocked: no build can
    happen there either."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        fh = open(folder.parent / f"{folder.name}.lock", "a")
    except OSError:
        yield
        return
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"decodelab: waiting for another process building the native kernels into {folder}",
                  file=sys.stderr, flush=True)
            fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def ready(folder: Path, build: Callable[[Path], str | None]) -> str | None:
    """Make `folder/LIBRARY` loadable (see the module doc); `build(folder)` writes a fresh
    library at `folder/LIBRARY` (into a folder made empty for it) and returns None, or the
    reason it could not. Returns None when the library is good, else why it cannot be used
    (with the folder to delete where a damaged library could not be rebuilt)."""
    if library_problem(folder) is None:
        return None
    with build_lock(folder):
        why = library_problem(folder)  # another process may have built it while this one waited
        if why is None:
            return None
        lib = folder / LIBRARY
        if lib.is_file() and not (folder / RECORD).is_file():  # a build never probed: probe it
            if (failed := probe(lib)) is None:
                with contextlib.suppress(OSError):  # it works: record it
                    write_record(folder)
                return None
            why = f"{why}, and {failed}"
        damaged = lib.is_file()
        if damaged:
            print(f"decodelab: {why}; rebuilding the native kernels", file=sys.stderr, flush=True)
        failed = _build_anew(folder, build)
        if failed and damaged:
            return (f"the native kernel library is damaged ({why}) and could not be rebuilt ({failed}); delete "
                    f"{folder} (rm -r {folder}) so that the next run builds it anew")
        return failed


def _build_anew(folder: Path, build: Callable[[Path], str | None]) -> str | None:
    """Empty `folder` (a process that has the old library loaded keeps its mapping: the file
    is unlinked, not overwritten), build into it, probe the library (removed when it fails)
    and record it."""
    try:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True, exist_ok=True)
        print(f"decodelab: building the native int8/int4 kernels into {folder} (once, with "
              "torch.utils.cpp_extension)", file=sys.stderr, flush=True)
        why = build(folder)
        if why is None and (why := probe(folder / LIBRARY)) is not None:
            why = f"the freshly built library fails its check: {why}"
        if why is not None:
            (folder / LIBRARY).unlink(missing_ok=True)
            return why
        write_record(folder)
    except OSError as e:
        return (f"cannot build decodelab's native kernels into {folder} ({e.strerror or e}); set DECODELAB_CACHE to "
                "a writable folder")
    return None
