"""Where the GPU decode step's time goes (a follow-up to the prepared GPU check, whose eager
and graph steps ran far below the copy bandwidth): per backend, an eager decode step of the
SmolLM2-135M-shape random model timed and profiled (CPU and CUDA activity, the top ops and
every synchronizing call), the CUDA-graph step's host and device time, and one int4 Triton
attention call. Writes profile.txt and profile.json under $OUT (else outputs/gpu_profile).

    python scripts/gpu_profile.py            # on a CUDA GPU (the device tool, after gpu_check's set-up)
    python scripts/gpu_profile.py cpu        # the same on the CPU (a dry run: tiny shapes)
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch.profiler import ProfilerActivity, profile

from decodelab.cache import CacheLayout
from decodelab.cache.int4 import QuantizedCache
from decodelab.decoding.compiled import StaticDecoder
from decodelab.decoding.text import make_cache
from decodelab.experiments import harness
from decodelab.models.loading import CONF_DIR, instantiate_unwrapped

CPU = sys.argv[1:] == ["cpu"]
DEV = torch.device("cpu" if CPU else "cuda")
OUT = Path(os.environ.get("OUT") or "outputs/gpu_profile")
OUT.mkdir(parents=True, exist_ok=True)
LINES: list[str] = []
RECORDS: list[dict] = []
SYNC = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemcpyAsync", "cudaEventSynchronize",
        "aten::item", "aten::_local_scalar_dense", "aten::nonzero", "cudaMalloc", "cudaFree")


def say(*parts) -> None:
    line = " ".join(str(p) for p in parts)
    print(line, flush=True)
    LINES.append(line)


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, n: int) -> float:
    """Median seconds per call of fn over n calls, each synchronized."""
    ts = []
    for _ in range(n):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[n // 2]


def profiled(name: str, fn, n: int = 3) -> None:
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV.type == "cuda" else [])
    with profile(activities=acts) as p:
        for _ in range(n):
            fn()
        sync()
    ev = p.key_averages()
    cuda_total = sum(getattr(e, "self_device_time_total", 0) or 0 for e in ev) / n
    cpu_total = sum(e.self_cpu_time_total for e in ev) / n
    calls = sum(e.count for e in ev) / n
    syncs = {e.key: e.count / n for e in ev if any(s in e.key for s in SYNC)}
    top_cpu = sorted(ev, key=lambda e: -e.self_cpu_time_total)[:12]
    top_dev = sorted(ev, key=lambda e: -(getattr(e, "self_device_time_total", 0) or 0))[:8]
    say(f"\n## {name}: per call {calls:.0f} profiled events, self CPU {cpu_total / 1e3:.2f} ms, "
        f"self device {cuda_total / 1e3:.2f} ms; syncing/allocating calls per call: {syncs}")
    for e in top_cpu:
        say(f"  cpu  {e.key[:60]:60s} {e.self_cpu_time_total / n / 1e3:8.3f} ms  x{e.count / n:.0f}")
    for e in top_dev:
        d = getattr(e, "self_device_time_total", 0) or 0
        if d:
            say(f"  dev  {e.key[:60]:60s} {d / n / 1e3:8.3f} ms  x{e.count / n:.0f}")
    RECORDS.append({"name": name, "events": calls, "self_cpu_ms": cpu_total / 1e3, "self_device_ms": cuda_total / 1e3,
                    "syncs": syncs})


def main() -> None:
    name = "tiny-llama" if CPU else "smollm2-135m-shape"
    dtype = "float32" if CPU else "bfloat16"
    ctx = 130 if CPU else 1024
    spec = OmegaConf.merge(OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml"), {"dtype": dtype, "device": str(DEV)})
    model = instantiate_unwrapped(spec).model
    say("conditions:", json.dumps(harness.run_conditions(), default=str))
    say(f"model {name} {dtype} batch 1 context {ctx}")
    ids = torch.randint(0, model.cfg.vocab_size, (1, 1), device=DEV)
    with torch.no_grad():
        for backend in ("paged", "sliding", "dense", "int4", "paged"):  # paged twice: first and last (order effects)
            opts = {"sliding": {"window": 4096, "sinks": 4}}.get(backend, {})
            cache = make_cache(model, 1, ctx + 64, harness.cache_factory(backend, **opts))
            cache.fill_random(ctx)

            def step():
                model(ids, cache.lengths[:, None].to(DEV), cache)[:, -1:].argmax(-1)
                cache.truncate(torch.full((1,), ctx))  # every step at the same context
            for _ in range(3):
                step()
            s = timed(step, 15)
            say(f"\neager {backend} ({getattr(cache, 'impl', '-')}): {s * 1e3:.2f} ms/step ({1 / s:.1f} tok/s)")
            RECORDS.append({"name": f"eager {backend}", "ms_per_step": s * 1e3})
            profiled(f"eager {backend}", step)
            del cache
        cache = make_cache(model, 1, -(-(ctx + 64) // 64) * 64, harness.cache_factory("dense"))
        cache.fill_random(ctx)
        dec = StaticDecoder(model, cache, mode="eager" if CPU else "graph")
        last = torch.zeros(1, dtype=torch.long, device=DEV)

        def gstep():
            dec.step(last)
            cache.truncate(torch.full((1,), ctx))
        for _ in range(3):
            gstep()
        s = timed(gstep, 15)
        say(f"\ngraph step (dense): {s * 1e3:.2f} ms/step ({1 / s:.1f} tok/s)")
        RECORDS.append({"name": "graph dense", "ms_per_step": s * 1e3})
        profiled("graph dense", gstep)
        if DEV.type == "cuda":  # the replay alone: what the graph costs on the device
            r = timed(dec.graph.replay, 15)
            say(f"graph replay alone: {r * 1e3:.3f} ms")
            RECORDS.append({"name": "graph replay alone", "ms": r * 1e3})
        # one int4 attention call, Llama-3-8B's head shape at 8k
        Hq, Hkv, D, c4 = (32, 8, 128, 8192) if not CPU else (4, 2, 16, 130)
        layout = CacheLayout(1, Hkv, D, getattr(torch, dtype), DEV, (None,), D**-0.5)
        q, k, v = (torch.randn(1, h, 1, D, device=DEV).to(getattr(torch, dtype)) for h in (Hq, Hkv, Hkv))
        impl = "reference" if CPU else "triton"
        c = QuantizedCache(layout, 1, c4 + 1, impl=impl)
        c.fill_random(c4)
        plan = c.plan(torch.full((1, 1), c4))
        c.attend(0, q, k, v, plan)
        for i in ("reference", impl):
            s = timed(lambda: c.attention(0, q, plan, impl=i), 15)
            say(f"\nint4 attention {i} ({Hq}/{Hkv}/{D}, ctx {c4}): {s * 1e6:.1f} us")
            RECORDS.append({"name": f"int4 attention {i}", "us": s * 1e6})
            profiled(f"int4 attention {i}", lambda: c.attention(0, q, plan, impl=i))
    (OUT / "profile.txt").write_text("\n".join(LINES) + "\n")
    (OUT / "profile.json").write_text(json.dumps(RECORDS, indent=1, default=str))


if __name__ == "__main__":
    main()
