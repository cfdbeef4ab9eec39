"""One prepared GPU check (README, "GPU path"), under 8 minutes on one H200: kernel
correctness, the copy bandwidth (the roofline), decode speed of every cache backend
(reference vs Triton) on random models at GPU shapes, attention alone, the compiled step,
and the targets' verdicts, one record each in results.jsonl (written after every
section; a time budget skips what does not fit; one failure never ends the run).

    decodelab-gpu-check                  # a CUDA GPU: the full check (plans in conf/gpu_check.yaml)
    decodelab-gpu-check smoke=true       # tiny shapes on the CPU (tests run this)
    options: out=DIR (default $OUT, else outputs/gpu_check/<time>), budget_s=420

Caches are filled by their `fill_random` (decode speed does not depend on values); bytes
read per step come from their `read_bytes`.
"""

from __future__ import annotations

import gc
import json
import os
import time
import traceback
from pathlib import Path

import torch
from omegaconf import OmegaConf

from decodelab.cache.base import CacheLayout
from decodelab.cache.dense import DenseCache
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
    """The records (results.jsonl, rewritten atomically after every section) and the time budget."""

    def __init__(self, out: Path, budget_s: float, conditions: dict, cfg):
        self.path, self.budget_s, self.t0 = out / harness.RESULTS, budget_s, time.perf_counter()
        self.conditions, self.cfg, self.records, self.id = conditions, cfg, [], harness.run_id("gpu_check")

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def add(self, section: str, entry: dict) -> None:
        run = f"{self.id}-{section}-{len(self.records)}"
        self.records.append(harness.summary("gpu_check", run, {"name": section}, entry, self.conditions, self.cfg))
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {section}: {json.dumps(entry, default=str)[:240]}", flush=True)

    def section(self, name: str) -> list[dict]:
        return [r["metrics"] for r in self.records if r["setup"]["name"] == name]

    def attempt(self, where: str, fn, *args, need_s: float = 0.0, **kw):
        """fn(*args), or None with the error (or the skip) recorded: one failure never ends the run."""
        if self.left() < need_s:
            self.add("skipped", {"where": where, "why": f"time budget ({self.left():.0f}s left)"})
            return None
        try:
            return fn(*args, **kw)
        except Exception as e:  # recorded, then the next config runs
            self.add("error", {"where": where, "error": repr(e)[:2000], "traceback": traceback.format_exc()[-3000:]})
            return None
        finally:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def write(self) -> None:
        harness.write_jsonl(self.path, self.records)


def seconds_per(fn, device, n: int, warmup: int = 2) -> float:
    """Seconds per call of fn: n calls timed together after `warmup` calls (device synchronized)."""
    for _ in range(warmup):
        fn()
    timer = harness.Timer(device)
    with timer:
        for _ in range(n):
            fn()
    return timer.seconds[0] / n


def triton_ok(device) -> bool:
    return not impl_problems("triton", device)


# -- environment and the roofline ---------------------------------------------------------
def environment(device) -> dict:
    """The run conditions, plus the GPU's properties and the Triton mode."""
    env = harness.run_conditions() | {"device": str(device), "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET")}
    if torch.device(device).type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env |= {"gpu": p.name, "sms": p.multi_processor_count, "gpu_memory_gib": round(p.total_memory / 2**30, 1),
                "cuda_runtime": torch.version.cuda}
    return env


def copy_bandwidth(device, mib: int) -> dict:
    """A large device-to-device copy: bytes read + written per second."""
    n = mib * 2**20
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = seconds_per(lambda: dst.copy_(src), device, n=10, warmup=3)
    return {"bytes_per_copy": n, "seconds": t, "GBps": 2 * n / t / 1e9, "counted": "bytes read + bytes written"}


# -- caches ---------------------------------------------------------------------------
def build_cache(name: str, model, batch: int, capacity: int, **overrides):
    return make_cache(model, batch, capacity, harness.cache_factory(name, **overrides))


# -- bytes ------------------------------------------------------------------------------
def weight_bytes(model, batch: int) -> int:
    """Parameter bytes one decode step reads: all of them, but only `batch` rows of an
    untied embedding (a tied one is read whole by the head)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:
        e = model.embed.weight
        total -= (e.shape[0] - batch) * e.shape[1] * e.element_size()
    return total


# -- decode -----------------------------------------------------------------------------
def plain_step(model, cache):
    """The framework's decode step (what the decoders run), greedy, ids kept on the device."""
    ids = torch.randint(0, model.cfg.vocab_size, (cache.batch_size, 1), device=model.device)

    def step():
        nonlocal ids
        pos = cache.lengths[:, None].to(model.device)
        ids = model(ids, pos, cache)[:, -1].argmax(-1, keepdim=True)
    return step


def speed(entry: dict, model, cache, ctx: int, seconds: float, copy_gbps: float | None) -> dict:
    B = cache.batch_size
    w, kv = weight_bytes(model, B), cache.read_bytes(ctx)
    gbps = (w + kv) / seconds / 1e9
    return entry | {"tokens_per_s": B / seconds, "step_ms": seconds * 1e3, "weight_bytes": w, "kv_bytes_read": kv,
                    "bytes_per_step": w + kv, "achieved_GBps": gbps,
                    "fraction_of_copy_bw": gbps / copy_gbps if copy_gbps else None}


def decode_grid(rep: Report, name: str, model, plan: dict, copy_gbps) -> None:
    for batch in plan["batches"]:
        for ctx in plan["contexts"]:
            for backend, impls in BACKENDS:
                rep.attempt(f"decode {name} b{batch} ctx{ctx} {backend}", decode_backend, rep, name, model, plan,
                            backend, impls, batch, ctx, copy_gbps, need_s=10)
            rep.write()


def decode_backend(rep, name, model, plan, backend, impls, batch, ctx, copy_gbps) -> None:
    opts = {"sliding": plan["sliding"], "int4": plan["int4"]}.get(backend, {})
    cache = build_cache(backend, model, batch, ctx + 64, **opts)
    cache.fill_random(ctx)
    for impl in impls:
        entry = {"model": name, "batch": batch, "context": ctx, "backend": getattr(cache, "label", backend),
                 "impl": impl}
        if impl == "triton" and not triton_ok(model.device):
            rep.add("skipped", entry | {"why": "no CUDA (and no TRITON_INTERPRET=1)"})
            continue
        cache.impl = impl  # the same filled cache runs both paths
        with torch.no_grad():
            s = seconds_per(plain_step(model, cache), model.device, plan["steps"], plan["warmup"])
        rep.add("decode", speed(entry, model, cache, ctx, s, copy_gbps))


def compiled_entry(rep, name, model, plan, backend, ctx, mode, copy_gbps) -> None:
    cache = build_cache(backend, model, 1, -(-(ctx + 64) // 64) * 64)
    cache.fill_random(ctx)
    dec = StaticDecoder(model, cache, mode=mode, backend=plan["compile_backend"])
    ids = torch.randint(0, model.cfg.vocab_size, (1,), device=model.device)

    def step():
        nonlocal ids
        ids = dec.step(ids).argmax(-1)
    s = seconds_per(step, model.device, plan["steps"] * 4, plan["warmup"] + 1)
    rep.add("compiled", speed({"model": name, "batch": 1, "context": ctx, "backend": backend, "mode": mode},
                              model, cache, ctx, s, copy_gbps))


def model_stage(rep: Report, plan: dict, name: str, parts: tuple, copy_gbps) -> None:
    """Build the random model, then run its parts: `graph` (the compiled step with CUDA graphs,
    dense and paged, batch 1), `compile` (torch.compile + graph, dense, the first context),
    `decode` (the backend grid). Off CUDA the graph part runs the static step eagerly and
    compile uses the plan's backend (smoke: dynamo's `eager`, which traces but generates nothing)."""
    dev = torch.device(plan["device"])
    compile_s = 150 if dev.type == "cuda" else 0  # what torch.compile may take, at least
    if "compile" in parts and set(parts) == {"compile"} and rep.left() < compile_s:
        rep.add("skipped", {"where": f"compile {name}", "why": f"time budget ({rep.left():.0f}s left)"})
        return
    spec = OmegaConf.merge(OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml"), {"dtype": plan["dtype"],
                                                                                    "device": str(dev)})
    lm = rep.attempt(f"model {name}", instantiate_unwrapped, spec, need_s=20)
    if lm is None:
        return
    graph = "graph" if dev.type == "cuda" else "eager"
    if "graph" in parts:
        for backend in ("dense", "paged"):
            for ctx in plan["contexts"][:2] if name == plan["models"][0] else plan["contexts"]:
                rep.attempt(f"compiled {name} {backend} ctx{ctx}", compiled_entry, rep, name, lm.model, plan,
                            backend, ctx, graph, copy_gbps, need_s=10)
        rep.write()
    if "compile" in parts:
        rep.attempt(f"compiled {name} torch.compile", compiled_entry, rep, name, lm.model, plan, "dense",
                    plan["contexts"][0], "compile", copy_gbps, need_s=compile_s)
        rep.write()
    if "decode" in parts:
        decode_grid(rep, name, lm.model, plan, copy_gbps)


# -- attention alone --------------------------------------------------------------------
def attention_grid(rep: Report, plan: dict, shapes: dict, copy_gbps) -> None:
    for name, shape in shapes.items():
        for batch in plan["batches"]:
            for ctx in plan["contexts"]:
                rep.attempt(f"attention {name} b{batch} ctx{ctx}", attention_entry, rep, plan, name, shape, batch,
                            ctx, copy_gbps, need_s=5)
        rep.write()


def attention_entry(rep, plan, name, shape, batch, ctx, copy_gbps) -> None:
    """One layer's decode attention at ctx cached tokens: dense SDPA, paged (both impls),
    int4 (the cache's reference path and the kernel, through its public `attention`)."""
    Hq, Hkv, D = shape
    dev, dtype = torch.device(plan["device"]), getattr(torch, plan["dtype"])
    layout = CacheLayout(1, Hkv, D, dtype, dev, (None,), D**-0.5)
    q, k, v = (torch.randn(batch, h, 1, D, device=dev).to(dtype) for h in (Hq, Hkv, Hkv))
    pos = torch.full((batch, 1), ctx)
    base = {"shape": name, "batch": batch, "context": ctx}
    for label, cache, impls in (("DenseCache", DenseCache(layout, batch, ctx + 1), ("reference",)),
                                ("PagedCache", PagedCache(layout, batch, ctx + 1), ("reference", "triton"))):
        cache.fill_random(ctx)
        for impl in impls:
            if impl == "triton" and not triton_ok(dev):
                continue
            cache.impl = impl
            cache.prepare(pos)
            t = seconds_per(lambda: cache.attend(0, q, k, v), dev, plan["reps"])
            rep.add("attention", rate(base | {"backend": label, "impl": impl}, cache.read_bytes(ctx), t, copy_gbps))
    kernel = triton_ok(dev)
    c = QuantizedCache(layout, batch, ctx + 1, impl="triton" if kernel else "reference", **plan["int4"])
    c.fill_random(ctx)
    c.prepare(pos)
    c.attend(0, q, k, v)  # stores this step's token; `attention` then only reads
    ref = lambda: c.attention(0, q, impl="reference")  # noqa: E731
    entry = base | {"backend": "QuantizedCache"}
    rep.add("attention", rate(entry | {"impl": "reference"}, c.read_bytes(ctx), seconds_per(ref, dev, plan["reps"]),
                              copy_gbps))
    if kernel:
        tri = lambda: c.attention(0, q, impl="triton")  # noqa: E731
        err = (tri().float() - ref().float()).abs().max().item()
        rep.add("attention", rate(entry | {"impl": "triton", "max_abs_err_vs_reference": err}, c.read_bytes(ctx),
                                  seconds_per(tri, dev, plan["reps"]), copy_gbps))


def rate(entry: dict, nbytes: int, seconds: float, copy_gbps) -> dict:
    gbps = nbytes / seconds / 1e9
    return entry | {"us": seconds * 1e6, "kv_bytes": nbytes, "achieved_GBps": gbps,
                    "fraction_of_copy_bw": gbps / copy_gbps if copy_gbps else None}


# -- kernels ----------------------------------------------------------------------------
def kernel_checks(rep: Report, plan: dict, shapes: dict, smoke: bool) -> None:
    dev = plan["device"]
    if not triton_ok(dev):
        rep.add("skipped", {"where": "kernel_checks", "why": impl_problems("triton", dev)})
        return
    smoke_cases = ("paged-q4-causal", "dense-as-pool", "int4-decode")
    cases = [c for c in CASES if c.name in smoke_cases or not smoke]
    if not smoke:  # the model shapes, long rows of different lengths
        cases += model_shape_cases(shapes)
    for dtype in plan["kernel_dtypes"]:
        for case in cases:
            for r in rep.attempt(f"kernel {case.name} {dtype}", run_cases, dev, [getattr(torch, dtype)], [case]) or []:
                rep.add("kernel_checks", r)


# -- verdicts ---------------------------------------------------------------------------
def verdicts(rep: Report) -> dict:
    """The issue's targets, from the numbers (None where the numbers are missing)."""
    dec, att, comp = rep.section("decode"), rep.section("attention"), rep.section("compiled")
    pick = lambda rows, **kw: [r for r in rows if all(r.get(k) == v for k, v in kw.items())]  # noqa: E731
    kernels = rep.section("kernel_checks")
    v = {"kernels_all_ok": all(r["ok"] for r in kernels) if kernels else None}
    llama = [r for r in pick(dec, model="llama3-8b-shape", batch=1, backend="dense") + pick(
        comp, model="llama3-8b-shape", backend="dense")]
    v["dense_b1_llama_best_fraction_of_copy_bw (target >= 0.8)"] = max(
        (r["fraction_of_copy_bw"] or 0 for r in llama), default=None)
    ratios = {}
    for r in pick(dec, impl="triton", backend="paged"):
        dense = pick(dec, model=r["model"], batch=r["batch"], context=r["context"], backend="dense")
        if dense:
            ratios[f"{r['model']} b{r['batch']} ctx{r['context']}"] = r["tokens_per_s"] / dense[0]["tokens_per_s"]
    v["paged_triton_over_dense_tokens_per_s (target >= 0.9)"] = ratios
    int4 = {}
    for r in pick(att, backend="QuantizedCache", impl="triton"):
        key = dict(shape=r["shape"], batch=r["batch"], context=r["context"])
        dense = pick(att, backend="DenseCache", **key)
        ref = pick(att, backend="QuantizedCache", impl="reference", **key)
        int4[f"{r['shape']} b{r['batch']} ctx{r['context']}"] = {
            "dense_us_over_int4_triton_us (target > 1 at 8k+)": dense[0]["us"] / r["us"] if dense else None,
            "int4_reference_us_over_triton_us (target >= 2)": ref[0]["us"] / r["us"] if ref else None}
    v["int4_attention"] = int4
    smol = pick(comp, model="smollm2-135m-shape")
    v["smollm2_compiled_b1_best_tokens_per_s (target >= 1500)"] = max((r["tokens_per_s"] for r in smol), default=None)
    return v


# -- the run ----------------------------------------------------------------------------
def run(cfg, out: Path) -> dict:
    """Every section within the budget; returns the verdicts (also the last record)."""
    if not cfg.smoke and not torch.cuda.is_available():
        raise SetupError("gpu_check needs a CUDA GPU, and torch sees none here (torch.cuda.is_available() is False); "
                         "on a GPU machine: decodelab-gpu-check; for the CPU dry run: decodelab-gpu-check smoke=true")
    plan = OmegaConf.to_container(cfg.plans.smoke if cfg.smoke else cfg.plans.full)
    out = Path(cfg.out or os.environ.get("OUT") or out)
    dev = torch.device(plan["device"])
    rep = Report(out, cfg.budget_s or (120 if cfg.smoke else 420), environment(dev), {**plan, "smoke": cfg.smoke})
    torch.manual_seed(0)
    bw = rep.attempt("copy_bandwidth", copy_bandwidth, dev, plan["copy_mib"])
    if bw:
        rep.add("copy_bandwidth", bw)
    gbps = bw["GBps"] if bw else None
    configs = {n: OmegaConf.load(CONF_DIR / "model" / f"{n}.yaml").config for n in plan["models"]}
    shapes = {n: (c.n_heads, c.n_kv_heads, c.head_dim) for n, c in configs.items()}
    kernel_checks(rep, plan, shapes, cfg.smoke)
    rep.write()
    first, *rest = plan["models"]  # the small model's compiled step first: the 1,500 tokens/s target needs torch.compile
    stages = [(first, ("graph", "compile"))] + [(n, ("graph", "decode")) for n in rest] + [(first, ("decode",))]
    for name, parts in stages:
        model_stage(rep, plan, name, parts, gbps)
    attention_grid(rep, plan, shapes, gbps)
    for name in rest:  # torch.compile of the large models: last, only with time to spare
        model_stage(rep, plan, name, ("compile",), gbps)
    v = verdicts(rep)
    rep.add("verdicts", v)
    rep.write()
    print(json.dumps({"verdicts": v, "errors": len(rep.section("error")), "skipped": len(rep.section("skipped")),
                      "results": str(rep.path)}, indent=1, default=str))
    return v


main = harness.hydra_app("gpu_check", run)


if __name__ == "__main__":
    main()
