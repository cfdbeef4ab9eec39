"""The native int4 decode attention alone (models/kernels/native_kernels.cpp
`dl_int4_decode_attn`, through cache/kernels/int4.py `int4_attention_native`) at SmolLM2-135M's
shapes: 9 query heads over 3 kv heads of 64 channels, one query, the int4 cache's defaults
(group 64, residual 112, fp16 scales). Per context, one cache per layer (30) holds that many
random tokens; a round calls the 30 layers' kernels in turn, as a decode step does (the 30
layers' stores, 1.9 MB each at 8,000 tokens, do not stay in the caches between calls), and
then one layer 30 times (its stores cache-resident). Median microseconds per call over
`--rounds` rounds, quartiles beside.

    python -c "from decodelab.experiments.int4_kernel import main; main()" [--contexts 2048 8000] [--rounds 40]
        [--isa avx2]   (the kernel's AVX2 form where the CPU has AVX-512 VNNI)

Prints a markdown table and the run conditions; JSON lines to --out when given."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

LAYERS, HQ, HKV, D = 30, 9, 3, 64


def layers(context: int) -> list[tuple]:
    """Per layer: (query, the kernel's rows, (query positions, V(q))) of a cache holding
    `context` random tokens and one new token stored."""
    import torch

    from decodelab.cache.base import CacheLayout
    from decodelab.cache.int4 import QuantizedCache

    layout = CacheLayout(1, HKV, D, torch.float32, torch.device("cpu"), (None,), D**-0.5)
    out = []
    for layer in range(LAYERS):
        cache = QuantizedCache(layout, 1, context + 16)
        cache.fill_random(context, seed=layer)
        plan = cache.plan(cache.lengths[:, None] + torch.arange(1))
        g = torch.Generator().manual_seed(layer)
        q, k, v = (torch.randn(1, h, 1, D, generator=g) for h in (HQ, HKV, HKV))
        cache.attend(0, q, k, v, plan)
        out.append((q, cache.kernel_rows(0, plan), cache.kernel_queries(plan)))
    return out


def timed(calls: list[tuple], rounds: int) -> list[float]:
    """Microseconds per call of each round of `calls` in turn."""
    from decodelab.cache.kernels.int4 import int4_attention_native

    def once():
        for q, rows, (qpos, vis) in calls:
            int4_attention_native(q, rows, qpos, vis, D**-0.5)

    for _ in range(3):
        once()
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        once()
        out.append((time.perf_counter() - t) / len(calls) * 1e6)
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    import torch

    from decodelab.experiments.harness import run_conditions
    from decodelab.models import native

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8000])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--isa", choices=["best", "avx2"], default="best",
                    help="avx2: the kernel's AVX2 form even where the CPU has AVX-512 VNNI")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if native.problem():
        raise SystemExit(f"the native kernels cannot run here: {native.problem()}")
    torch.set_num_threads(args.threads)
    level = torch.ops.decodelab.isa(-1)
    if args.isa == "avx2":
        torch.ops.decodelab.isa(0)
    rows = []
    for ctx in args.contexts:
        calls = layers(ctx)
        turn, one = timed(calls, args.rounds), timed(calls[:1] * LAYERS, args.rounds)
        rows.append({"context": ctx, "isa": "avx512-vnni" if torch.ops.decodelab.isa(-1) else "avx2",
                     "layers_in_turn_us": statistics.median(turn), "in_turn_p25": statistics.quantiles(turn)[0],
                     "in_turn_p75": statistics.quantiles(turn)[2], "one_layer_us": statistics.median(one)})
    torch.ops.decodelab.isa(level)
    cond = run_conditions()
    print("| context | isa | 30 layers in turn (us/call) | IQR | one layer repeated (us/call) |")
    print("|---:|---|---:|---|---:|")
    for r in rows:
        print(f"| {r['context']} | {r['isa']} | {r['layers_in_turn_us']:.1f} | {r['in_turn_p25']:.1f}-"
              f"{r['in_turn_p75']:.1f} | {r['one_layer_us']:.1f} |")
    print(f"conditions: {cond}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("w") as f:
            for r in rows:
                f.write(json.dumps(r | {"conditions": cond}) + "\n")
    return rows
