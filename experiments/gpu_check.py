"""One prepared GPU check (README, "GPU path"), under 8 minutes on one H200: kernel correctness, the copy
bandwidth (the roofline), decode speed of every cache backend (reference vs Triton) on random models at GPU
shapes, attention alone, the compiled step, and the targets' verdicts, one record each in results.jsonl
(rewritten after every record; a time budget skips what does not fit; one failure never ends the run).
Caches are filled by their `fill_random` (decode speed does not depend on values); bytes read per step come
from their `read_bytes`.

    decodelab-gpu-check                  # a CUDA GPU: the full check (plans in conf/gpu_check.yaml)
    decodelab-gpu-check smoke=true       # tiny shapes on the CPU (tests run this)
    options: out=DIR (default $OUT, else outputs/gpu_check/<time>), budget_s=420
"""

from __future__ import annotations

import gc
import json
import os
import time
import traceback
from itertools import product
from pathlib import Path

import torch
from omegaconf import OmegaConf

from decodelab.cache import CacheLayout, DenseCache
from decodelab.cache.int4 import QuantizedCache
from decodelab.cache.kernels.check import CASES, model_shape_cases, run_cases
from decodelab.cache.kernels.dispatch import impl_problems
from decodelab.cache.paged import PagedCache
from decodelab.decoding.compiled import StaticDecoder
from decodelab.decoding.text import make_cache
from decodelab.experiments import harness
from decodelab.models.errors import SetupError
from decodelab.models.loading import CONF_DIR, instantiate_unwrapped

BACKENDS = (("dense", ("reference",)), ("sliding", ("reference",)), ("paged", ("reference", "triton")),
            ("int4", ("reference", "triton")))


class Report:
    """The records (results.jsonl, rewritten atomically after every record) and the time budget."""

    def __init__(self, out: Path, budget_s: float, conditions: dict, cfg):
        self.path, self.budget_s, self.t0 = out / harness.RESULTS, budget_s, time.perf_counter()
        self.conditions, self.cfg, self.records, self.id = conditions, cfg, [], harness.run_id("gpu_check")

    def add(self, section: str, entry: dict) -> None:
        run = f"{self.id}-{section}-{len(self.records)}"
        self.records.append(harness.summary("gpu_check", run, {"name": section}, entry, self.conditions, self.cfg))
        harness.write_jsonl(self.path, self.records)
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {section}: {json.dumps(entry, default=str)[:240]}", flush=True)

    def section(self, name: str) -> list[dict]:
        return [r["metrics"] for r in self.records if r["setup"]["name"] == name]

    def attempt(self, where: str, fn, *args, need_s: float = 0.0, **kw):
        """fn(*args), or None with the error (or a skip: need_s > time left) recorded; one failure never ends a run."""
        left = self.budget_s - (time.perf_counter() - self.t0)
        if left < need_s:
            self.add("skipped", {"where": where, "why": f"time budget ({left:.0f}s left)"})
            return None
        try:
            return fn(*args, **kw)
        except Exception as e:  # recorded, then the next config runs
            self.add("error", {"where": where, "error": repr(e)[:2000], "traceback": traceback.format_exc()[-3000:]})
            return None
        finally:
            gc.collect()
            torch.cuda.empty_cache()  # a no-op where CUDA was never initialized


def seconds_per(fn, device, n: int, warmup: int = 2) -> float:
    """Seconds per call of fn: n calls timed together after `warmup` calls (device synchronized)."""
    for _ in range(warmup):
        fn()
    with harness.Timer(device) as timer:
        for _ in range(n):
            fn()
    return timer.seconds[0] / n


def copy_bandwidth(rep: Report, device, mib: int) -> float:
    """A large device-to-device copy: bytes read + written per second (recorded; returns GB/s)."""
    n = mib * 2**20
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = seconds_per(lambda: dst.copy_(src), device, n=10, warmup=3)
    gbps = 2 * n / t / 1e9
    rep.add("copy_bandwidth", {"bytes_per_copy": n, "seconds": t, "GBps": gbps,
                               "counted": "bytes read + bytes written"})
    return gbps


def roofline(nbytes: int, seconds: float, copy_gbps: float | None) -> dict:
    """Bytes read per second, and that as a fraction of the copy bandwidth (None without one)."""
    gbps = nbytes / seconds / 1e9
    return {"achieved_GBps": gbps, "fraction_of_copy_bw": gbps / copy_gbps if copy_gbps else None}


def weight_bytes(model, batch: int) -> int:
    """Weight bytes one decode step reads (`Transformer.weight_read_bytes`)."""
    return model.weight_read_bytes(batch)


def step_speed(model, cache, ctx: int, seconds: float, copy_gbps: float | None) -> dict:
    """Tokens/s of a decode step at ctx cached tokens, and the bytes it reads: weights + K/V."""
    w, kv = weight_bytes(model, cache.batch_size), cache.read_bytes(ctx)
    return {"tokens_per_s": cache.batch_size / seconds, "step_ms": seconds * 1e3, "weight_bytes": w,
            "kv_bytes_read": kv, "bytes_per_step": w + kv} | roofline(w + kv, seconds, copy_gbps)


def greedy(model, forward, shape: tuple):
    """A greedy decode step, ids = argmax forward(ids), from random ids [shape]; ids stay on the device."""
    ids = torch.randint(0, model.cfg.vocab_size, shape, device=model.device)

    def step():
        nonlocal ids
        ids = forward(ids).argmax(-1)
    return step


def model_stage(rep: Report, plan: dict, name: str, compiled: list, copy_gbps, decode: bool = False) -> None:
    """Build the random model, time its compiled step (batch 1) at each (backend, context, mode,
    seconds needed) of `compiled`, then, with `decode`, every backend at every batch and context."""
    spec = OmegaConf.merge(OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml"),
                           {"dtype": plan["dtype"], "device": plan["device"]})
    lm = rep.attempt(f"model {name}", instantiate_unwrapped, spec, need_s=20)
    if lm is None:
        return
    for backend, ctx, mode, need_s in compiled:
        rep.attempt(f"compiled {name} {backend} ctx{ctx} {mode}", compiled_entry, rep, plan, name, lm.model, backend,
                    ctx, mode, copy_gbps, need_s=need_s)
    for batch, ctx, (backend, impls) in product(plan["batches"], plan["contexts"], BACKENDS) if decode else ():
        rep.attempt(f"decode {name} b{batch} ctx{ctx} {backend}", decode_backend, rep, plan, name, lm.model, backend,
                    impls, batch, ctx, copy_gbps, need_s=10)


def decode_backend(rep, plan, name, model, backend, impls, batch, ctx, copy_gbps) -> None:
    """The framework's decode step (what the decoders run) over one filled cache, each impl."""
    opts = {"sliding": plan["sliding"], "int4": plan["int4"]}.get(backend, {})
    cache = make_cache(model, batch, ctx + 64, harness.cache_factory(backend, **opts))
    cache.fill_random(ctx)
    forward = lambda ids: model(ids, cache.lengths[:, None].to(model.device), cache)[:, -1:]  # noqa: E731
    for impl in impls:
        entry = {"model": name, "batch": batch, "context": ctx, "backend": getattr(cache, "label", backend),
                 "impl": impl}
        if impl == "triton" and impl_problems("triton", model.device):
            rep.add("skipped", entry | {"why": "no CUDA (and no TRITON_INTERPRET=1)"})
            continue
        cache.impl = impl  # the same filled cache runs both paths
        with torch.no_grad():
            s = seconds_per(greedy(model, forward, (batch, 1)), model.device, plan["steps"], plan["warmup"])
        rep.add("decode", entry | step_speed(model, cache, ctx, s, copy_gbps))


def compiled_entry(rep, plan, name, model, backend, ctx, mode, copy_gbps) -> None:
    """The static step (decoding/compiled.py) at batch 1: eager, CUDA graph, or torch.compile + graph."""
    cache = make_cache(model, 1, -(-(ctx + 64) // 64) * 64, harness.cache_factory(backend))
    cache.fill_random(ctx)
    dec = StaticDecoder(model, cache, mode=mode, backend=plan["compile_backend"])
    s = seconds_per(greedy(model, dec.step, (1,)), model.device, plan["steps"] * 4, plan["warmup"] + 1)
    entry = {"model": name, "batch": 1, "context": ctx, "backend": backend, "mode": mode}
    rep.add("compiled", entry | step_speed(model, cache, ctx, s, copy_gbps))


def attention_entry(rep, plan, name, shape, batch, ctx, copy_gbps) -> None:
    """One layer's decode attention at ctx cached tokens: dense SDPA, paged (both impls),
    int4 (the cache's reference path and the kernel, through its public `attention`)."""
    Hq, Hkv, D = shape
    dev, dtype = torch.device(plan["device"]), getattr(torch, plan["dtype"])
    layout = CacheLayout(1, Hkv, D, dtype, dev, (None,), D**-0.5)
    q, k, v = (torch.randn(batch, h, 1, D, device=dev).to(dtype) for h in (Hq, Hkv, Hkv))
    pos = torch.full((batch, 1), ctx)
    impls = ("reference",) if impl_problems("triton", dev) else ("reference", "triton")

    def add(label: str, cache, impl: str, fn, **extra) -> None:
        t, nbytes = seconds_per(fn, dev, plan["reps"]), cache.read_bytes(ctx)
        entry = {"shape": name, "batch": batch, "context": ctx, "backend": label, "impl": impl, **extra}
        rep.add("attention", entry | {"us": t * 1e6, "kv_bytes": nbytes} | roofline(nbytes, t, copy_gbps))

    for label, cache, cache_impls in (("DenseCache", DenseCache(layout, batch, ctx + 1), ("reference",)),
                                      ("PagedCache", PagedCache(layout, batch, ctx + 1), impls)):
        cache.fill_random(ctx)
        for impl in cache_impls:
            cache.impl = impl
            step = cache.plan(pos)
            add(label, cache, impl, lambda: cache.attend(0, q, k, v, step))
    c = QuantizedCache(layout, batch, ctx + 1, impl=impls[-1], **plan["int4"])
    c.fill_random(ctx)
    step = c.plan(pos)
    c.attend(0, q, k, v, step)  # stores this step's token; `attention` then only reads
    ref = lambda: c.attention(0, q, step, impl="reference")  # noqa: E731
    add("QuantizedCache", c, "reference", ref)
    if "triton" in impls:
        tri = lambda: c.attention(0, q, step, impl="triton")  # noqa: E731
        err = (tri().float() - ref().float()).abs().max().item()
        add("QuantizedCache", c, "triton", tri, max_abs_err_vs_reference=err)


def kernel_checks(rep: Report, plan: dict, shapes: dict, smoke: bool) -> None:
    dev = plan["device"]
    if problems := impl_problems("triton", dev):
        rep.add("skipped", {"where": "kernel_checks", "why": problems})
        return
    cases = [c for c in CASES if not smoke or c.name in ("paged-q4-causal", "dense-as-pool", "int4-decode")]
    cases += [] if smoke else model_shape_cases(shapes)  # the model shapes, long rows of different lengths
    for dtype, case in product(plan["kernel_dtypes"], cases):
        for r in rep.attempt(f"kernel {case.name} {dtype}", run_cases, dev, [getattr(torch, dtype)], [case]) or []:
            rep.add("kernel_checks", r)


def verdicts(rep: Report) -> dict:
    """The issue's targets, from the numbers (None where the numbers are missing)."""
    dec, att, comp, kernels = map(rep.section, ("decode", "attention", "compiled", "kernel_checks"))
    pick = lambda rows, **kw: [r for r in rows if all(r.get(k) == v for k, v in kw.items())]  # noqa: E731
    best = lambda rows, key: max((r[key] or 0 for r in rows), default=None)  # noqa: E731
    llama = pick(dec + comp, model="llama3-8b-shape", batch=1, backend="dense")  # the compiled step is batch 1
    paged, int4 = {}, {}
    for r in pick(dec, impl="triton", backend="paged"):
        if dense := pick(dec, model=r["model"], batch=r["batch"], context=r["context"], backend="dense"):
            paged[f"{r['model']} b{r['batch']} ctx{r['context']}"] = r["tokens_per_s"] / dense[0]["tokens_per_s"]
    for r in pick(att, backend="QuantizedCache", impl="triton"):
        key = {"shape": r["shape"], "batch": r["batch"], "context": r["context"]}
        dense = pick(att, backend="DenseCache", **key)
        ref = pick(att, backend="QuantizedCache", impl="reference", **key)
        int4[f"{r['shape']} b{r['batch']} ctx{r['context']}"] = {
            "dense_us_over_int4_triton_us (target > 1 at 8k+)": dense[0]["us"] / r["us"] if dense else None,
            "int4_reference_us_over_triton_us (target >= 2)": ref[0]["us"] / r["us"] if ref else None}
    return {"kernels_all_ok": all(r["ok"] for r in kernels) if kernels else None,
            "dense_b1_llama_best_fraction_of_copy_bw (target >= 0.8)": best(llama, "fraction_of_copy_bw"),
            "paged_triton_over_dense_tokens_per_s (target >= 0.9)": paged,
            "int4_attention": int4,
            "smollm2_compiled_b1_best_tokens_per_s (target >= 1500)": best(pick(comp, model="smollm2-135m-shape"),
                                                                            "tokens_per_s")}


def run(cfg, out: Path) -> dict:
    """Every section within the budget; returns the verdicts (also the last record)."""
    if not cfg.smoke and not torch.cuda.is_available():
        raise SetupError("gpu_check needs a CUDA GPU, and torch sees none here (torch.cuda.is_available() is False); "
                         "on a GPU machine: decodelab-gpu-check; for the CPU dry run: decodelab-gpu-check smoke=true")
    plan = OmegaConf.to_container(cfg.plans.smoke if cfg.smoke else cfg.plans.full)
    dev = torch.device(plan["device"])
    # the run conditions (with the GPU's name, SMs, memory and CUDA runtime), the device and the Triton mode
    conditions = harness.run_conditions() | {"device": str(dev), "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET")}
    rep = Report(Path(cfg.out or os.environ.get("OUT") or out), cfg.budget_s or (120 if cfg.smoke else 420),
                 conditions, {**plan, "smoke": cfg.smoke})
    torch.manual_seed(0)
    gbps = rep.attempt("copy_bandwidth", copy_bandwidth, rep, dev, plan["copy_mib"])
    configs = {n: OmegaConf.load(CONF_DIR / "model" / f"{n}.yaml").config for n in plan["models"]}
    shapes = {n: (c.n_heads, c.n_kv_heads, c.head_dim) for n, c in configs.items()}
    kernel_checks(rep, plan, shapes, cfg.smoke)
    # compiled steps (backend, context, mode, seconds needed): a CUDA graph (off CUDA: the static step eagerly) of
    # dense and paged; torch.compile + graph with the plan's backend (smoke: dynamo's `eager`, generating nothing)
    graph, compile_s = ("graph", 150) if dev.type == "cuda" else ("eager", 0)
    graphs = lambda contexts: [(b, c, graph, 10) for b, c in product(("dense", "paged"), contexts)]  # noqa: E731
    compiled = [("dense", plan["contexts"][0], "compile", compile_s)]
    first, *rest = plan["models"]  # the small model's compiled step first: 1,500 tokens/s needs torch.compile
    model_stage(rep, plan, first, graphs(plan["contexts"][:2]) + compiled, gbps)
    for name in rest:
        model_stage(rep, plan, name, graphs(plan["contexts"]), gbps, decode=True)
    model_stage(rep, plan, first, [], gbps, decode=True)  # the small model's decode grid: after the large models'
    for (name, shape), batch, ctx in product(shapes.items(), plan["batches"], plan["contexts"]):
        rep.attempt(f"attention {name} b{batch} ctx{ctx}", attention_entry, rep, plan, name, shape, batch, ctx, gbps,
                    need_s=5)
    for name in rest:  # torch.compile of the large models: last, only with time to spare
        rep.attempt(f"compile {name}", model_stage, rep, plan, name, compiled, gbps, need_s=compile_s)
    v = verdicts(rep)
    rep.add("verdicts", v)
    print(json.dumps({"verdicts": v, "errors": len(rep.section("error")), "skipped": len(rep.section("skipped")),
                      "results": str(rep.path)}, indent=1, default=str))
    return v


main = harness.hydra_app("gpu_check", run)


if __name__ == "__main__":
    main()
