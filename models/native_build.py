"""The native kernel library on disk: built once per key, checked before every load.

A library loaded with `torch.ops.load_library` runs as machine code inside this process:
damaged bytes in it end the process with a signal (SIGSEGV, SIGILL, SIGBUS), before any
Python handler can say a word. So a library is loaded only when it is known good:

- `record` (beside the library) holds its size and xxh3-64 checksum, written when it was
  built and had passed `probe`; `library_problem` checks both (a few hundred KB: well
  under a millisecond) before every load;
- `probe` loads a library in a throw-away subprocess and runs every operator once on small
  inputs against its torch reference: a crash there costs the subprocess, not the caller.
  It runs after each build, and on a library found without a record (an older decodelab's);
- `ready` makes a folder's library good: checked as it is, else (re)built under a file
  lock (one build at a time per key: a second process waits for the first and reuses its
  library), probed, recorded. A damaged library is rebuilt, saying so; one that cannot be
  rebuilt is refused with the folder to delete.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

import xxhash  # declared in pyproject (also the converted weights' checksums)

LIBRARY = "libdecodelab_kernels.so"
RECORD = "library.json"
PROBE_TIMEOUT_S = 300

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
        import signal

        return f"loading {lib} in a probe process killed it with {signal.Signals(-r.returncode).name}"
    tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
    return f"loading {lib} in a probe process failed (exit {r.returncode}: {tail[:300]})"


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
    """Make `folder/LIBRARY` loadable (see the module doc); `build(tmp)` writes a fresh
    library at `tmp/LIBRARY` and returns None, or the reason it could not. Returns None
    when the library is good, else why it cannot be used (with the folder to delete where
    a damaged library could not be rebuilt)."""
    if library_problem(folder) is None:
        return None
    with build_lock(folder):
        why = library_problem(folder)  # another process may have built it while this one waited
        if why is None:
            return None
        lib = folder / LIBRARY
        if lib.is_file() and not (folder / RECORD).is_file():  # an older decodelab's build: probe it
            if (failed := probe(lib)) is None:
                with contextlib.suppress(OSError):  # it works: record it
                    write_record(folder)
                return None
            why = f"{why}, and {failed}"
        damaged = lib.is_file()
        if damaged:
            print(f"decodelab: {why}; rebuilding the native kernels", file=sys.stderr, flush=True)
        failed = _build_into(folder, build)
        if failed and damaged:
            return (f"the native kernel library is damaged ({why}) and could not be rebuilt ({failed}); delete "
                    f"{folder} (rm -r {folder}) so that the next run builds it anew")
        return failed


def _build_into(folder: Path, build: Callable[[Path], str | None]) -> str | None:
    """Build in a temporary folder beside `folder`, probe it, then rename the library into
    place (a new file: a process that has the old one loaded keeps its mapping) and record it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            tmp = Path(tmp)
            print(f"decodelab: building the native int8/int4 kernels into {folder} (once; about a minute)",
                  file=sys.stderr, flush=True)
            why = build(tmp)
            if why is None and (why := probe(tmp / LIBRARY)) is not None:
                why = f"the freshly built library fails its check: {why}"
            if why is not None:
                return why
            os.replace(tmp / LIBRARY, folder / LIBRARY)
            write_record(folder)
    except OSError as e:
        return (f"cannot build decodelab's native kernels into {folder} ({e.strerror or e}); set DECODELAB_CACHE to "
                "a writable folder")
    return None
