"""The compiled CPU step's call paths side by side (issue 28: compile through public APIs).

    python -c "from decodelab.experiments.compile_paths import main; main()" [--weights none int4 int4+head] ...
    (or main(["--weights", "int4"]); as the console scripts run: under `python -m` the replayed
    step measured slower than the call through dynamo, 10.7-11.2 ms against 9.6-9.8 for
    SmolLM2 int4 on a Zen 5, where imported it measured 8.0 against 9.6; cause not found)

For each weight type, one model, four ways to call a compiled one-token step,
alternated round by round: `replay` (the graph called directly after its first guarded
call: decoding/compiled.py's `torch_private`, built with the wrapper a user gets,
`cpu_wrapper`: inductor's C++ wrapper unless DECODELAB_CPU_WRAPPER says otherwise),
`replay-python` (the same, built with inductor's Python wrapper: what a step cost before
the C++ one was the default), `dynamo` (the replay's step, every call through dynamo,
guards evaluated; `SKIP_GUARD_EVAL = False`) and `public` (a step built with no private
torch API at all: torch.compile's `options` carry the inductor patches, every call through
dynamo; what runs where `torch_private`'s probe fails). Prints the median ms per step of
each (medians over rounds of per-round medians), with the run conditions, and writes them
as JSON lines to --out when given. Greedy tokens of all four are checked equal."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from unittest import mock


def _steps(model, cache, dec, prompt, steps: int) -> tuple[float, list[int]]:
    """Median seconds of `steps` compiled steps after a prefill (first two left out), tokens."""
    import torch

    from decodelab.decoding import prefill

    cache.reset()
    last = prefill(model, cache, [prompt]).argmax(-1)
    dec.guarded = False
    times, tokens = [], []
    with torch.no_grad():
        for _ in range(steps):
            t = time.perf_counter()
            last = dec.step(last).argmax(-1)
            times.append(time.perf_counter() - t)
            tokens.append(int(last[0]))
    return statistics.median(times[2:]), tokens


def measure(weights: str, steps: int, rounds: int) -> list[dict]:
    """The three paths for one weight type: a record each."""
    from decodelab.decoding import compiled, make_cache
    from decodelab.models import load

    kind = {"kind": weights.removesuffix("+head"), "quantize_head": weights.endswith("+head")}
    lm = load("smollm2-135m", device="cpu", **({} if weights == "none" else {"weights": kind}))
    prompt = lm.tokenizer.encode("Write a long story about a dragon who learns to code in Python.", chat=True)
    caches = {p: make_cache(lm.model, 1, 512) for p in ("replay", "replay-python", "public")}
    decs = {"replay": compiled.compiled_step(lm.model, caches["replay"])}
    decs["dynamo"], caches["dynamo"] = decs["replay"], caches["replay"]  # the same graph, called through dynamo
    with mock.patch.dict(os.environ, DECODELAB_CPU_WRAPPER="python"):  # read when the step is built and compiled
        decs["replay-python"] = compiled.compiled_step(lm.model, caches["replay-python"])
    real = compiled.torch_private
    compiled.torch_private = lambda: None
    try:
        decs["public"] = compiled.compiled_step(lm.model, caches["public"])
    finally:
        compiled.torch_private = real
    per, tokens = {p: [] for p in ("replay", "replay-python", "dynamo", "public")}, {}
    for _ in range(rounds):
        for p in per:
            compiled.SKIP_GUARD_EVAL = p.startswith("replay")
            s, tokens[p] = _steps(lm.model, caches[p], decs[p], prompt, steps)
            per[p].append(s)
    compiled.SKIP_GUARD_EVAL = True
    same = len({tuple(t) for t in tokens.values()}) == 1
    return [{"weights": weights, "path": p, "wrapper": "python" if p == "replay-python" else compiled.cpu_wrapper(),
             "ms_per_step": 1e3 * statistics.median(v),
             "rounds_ms": [round(1e3 * x, 3) for x in v], "tokens_equal": same} for p, v in per.items()]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", nargs="+", default=["none", "int4", "int4+head"])
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import torch

    from decodelab.experiments.harness import run_conditions

    torch.set_num_threads(a.threads)
    rows = [r for w in a.weights for r in measure(w, a.steps, a.rounds)]
    cond = run_conditions()
    print("| weights | path | wrapper | ms per step | vs replay | tokens equal |\n|---|---|---|---:|---:|---|")
    for r in rows:
        base = next(x["ms_per_step"] for x in rows if x["weights"] == r["weights"] and x["path"] == "replay")
        print(f"| {r['weights']} | {r['path']} | {r['wrapper']} | {r['ms_per_step']:.2f} | "
              f"{r['ms_per_step'] / base:.3f} | {r['tokens_equal']} |")
    print(f"conditions: {json.dumps(cond)}", file=sys.stderr)
    if a.out:
        with open(a.out, "w") as f:
            for r in rows:
                f.write(json.dumps({**r, "conditions": cond}) + "\n")


if __name__ == "__main__":
    main()
