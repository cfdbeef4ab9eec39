"""How fast decodelab starts, side by side in one run: `python -c "import torch"` (the
floor every entry point pays), `decodelab-generate --help`, a refused bad config
(`cache=pagd`: named before anything loads), and the first against the second request's
TTFT in one process (weights packed and the tokenizer loaded at load time, so the first
request pays neither).

    .venv/bin/python -m decodelab.experiments.startup [--repeats 5] [--model smollm2-135m] [--out FILE]

Each process timing is the median wall time of `--repeats` fresh processes; the TTFT pair
is the median over `--repeats` fresh processes of (first, second) generate_text calls,
each on its own prompt of the same length. Prints a Markdown table and the run conditions;
writes both as JSON to `--out` (default outputs/startup.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

TTFT_CHILD = r"""
import json, sys, time, torch
torch.set_num_threads(2)
t0 = time.perf_counter()
from decodelab.models import load
from decodelab.decoding import generate_text
lm = load(sys.argv[1])
load_s = time.perf_counter() - t0
ttft = []
for prompt in ("Name three rivers of Europe and say where each one ends.",
               "Name three mountains of Africa and say where each one is."):
    r = generate_text(lm, prompt, max_new_tokens=2, chat=True)
    ttft.append(r.ttft()[0])
print(json.dumps({"load_s": load_s, "first_ttft_s": ttft[0], "second_ttft_s": ttft[1]}))
"""


def wall(cmd: list[str], ok: tuple[int, ...] = (0,)) -> float:
    """Seconds one fresh process of `cmd` takes (its exit status must be in `ok`)."""
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode not in ok:
        raise RuntimeError(f"{cmd} exited {p.returncode}: {p.stderr[-1000:]}")
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", type=Path, default=Path("outputs/startup.json"))
    args = ap.parse_args()
    bin_dir = Path(sys.executable).parent
    gen = str(bin_dir / "decodelab-generate")
    cases = {"python -c 'import torch'": ([sys.executable, "-c", "import torch"], (0,)),
             "decodelab-generate --help": ([gen, "--help"], (0,)),
             "decodelab-generate cache=pagd (refused)": ([gen, "cache=pagd", "prompt=hi"], (2,))}
    rows = []
    for name, (cmd, ok) in cases.items():
        times = [wall(cmd, ok) for _ in range(args.repeats)]
        rows.append({"what": name, "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)})
    runs = [json.loads(subprocess.run([sys.executable, "-c", TTFT_CHILD, args.model], capture_output=True, text=True,
                                      check=True).stdout.splitlines()[-1]) for _ in range(args.repeats)]
    for key in ("load_s", "first_ttft_s", "second_ttft_s"):
        xs = [r[key] for r in runs]
        rows.append({"what": f"{args.model} {key.removesuffix('_s').replace('_', ' ')} (in process)",
                     "median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs)})
    floor = rows[0]["median_s"]
    ratio = statistics.median(r["first_ttft_s"] / r["second_ttft_s"] for r in runs)
    from decodelab.experiments.harness import run_conditions
    from decodelab.experiments.report import markdown_table

    cond = run_conditions() | {"repeats": args.repeats, "model": args.model}
    for r in rows[1:3]:
        r["beyond_import_torch_s"] = r["median_s"] - floor
    print(markdown_table(rows, ["what", "median_s", "min_s", "max_s", "beyond_import_torch_s"]))
    print(f"first / second TTFT (median of {args.repeats} processes): {ratio:.2f}x")
    print(f"conditions: {cond}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "first_over_second_ttft": ratio, "conditions": cond}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
