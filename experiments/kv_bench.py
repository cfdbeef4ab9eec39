"""KV-cache backends side by side: quality (teacher-forced agreement with dense),
decode speed at long contexts, and memory; ours next to transformers' QuantizedCache.

    python -m decodelab.experiments.kv_bench part=quality   # 20 ShareGPT prompts x 256 reference tokens
    python -m decodelab.experiments.kv_bench part=speed     # decode ITL at 1k and 4k context
    python -m decodelab.experiments.kv_bench part=memory    # bytes: int4 vs bf16 dense, sliding Gemma 3, paged waste

Every figure comes with the run conditions; JSON goes to `out=` (default
experiments/results/kv_bench-<part>.json).
"""

from __future__ import annotations

import statistics
import time
from functools import partial

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from decodelab.decoding.agreement import compare, dense_logits, forced_logits
from decodelab.decoding.prefill import prefill
from decodelab.decoding.text import make_cache
from decodelab.experiments.common import git_rev, print_table, synthetic_prompt, write_results
from decodelab.models.loading import CONF_DIR, instantiate_unwrapped


def backend(name: str, **options):
    """Cache factory from conf/cache/<name>.yaml with option overrides."""
    spec = OmegaConf.merge(OmegaConf.load(CONF_DIR / "cache" / f"{name}.yaml"), options)
    return instantiate_unwrapped(spec)


@torch.no_grad()
def hf_forced(hf, prompt: list[int], ref: list[int], **qkw) -> torch.Tensor:
    """Teacher forcing through transformers' QuantizedCache(backend="quanto"): logits [N, V]."""
    from transformers import QuantizedCache

    cache = QuantizedCache(backend="quanto", config=hf.config, **qkw)
    o = hf(torch.tensor([prompt]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    out = [o.logits[0, -1]]
    for t in ref[:-1]:
        o = hf(torch.tensor([[t]]), past_key_values=o.past_key_values, use_cache=True)
        out.append(o.logits[0, -1])
    return torch.stack(out).float()


def quality(cfg, lm, hf) -> list[dict]:
    from decodelab.experiments.workloads import sharegpt

    tok = lm.tokenizer
    reqs = sharegpt(cfg.prompts, seed=cfg.seed, tokenizer=tok, max_prompt_tokens=cfg.max_prompt_tokens,
                    min_reference_tokens=cfg.forced_tokens)
    q = dict(nbits=cfg.nbits, q_group_size=cfg.group_size, residual_length=cfg.residual)
    systems = {"ours-int4": partial(forced_logits, lm.model, backend("int4", nbits=cfg.nbits, group_size=cfg.group_size,
                                                                   residual=cfg.residual)),
               "hf-QuantizedCache": lambda p, r: hf_forced(hf, p, r, **q)}
    per = {name: [] for name in systems}
    for i, req in enumerate(reqs):
        prompt = tok.encode(req.prompt, chat=True)
        ref = tok.encode(req.reference)[: cfg.forced_tokens]
        dense = dense_logits(lm.model, prompt, ref)
        for name, fn in systems.items():
            per[name].append(compare(dense, fn(prompt, ref)))
        print(f"prompt {i + 1}/{len(reqs)} ({len(prompt)} tokens): "
              + ", ".join(f"{n} top1 {v[-1]['top1']:.3f} kl {v[-1]['kl']:.4f}" for n, v in per.items()), flush=True)
    return [{"system": n, "prompts": len(v), "forced_tokens": cfg.forced_tokens,
             "top1_agreement": statistics.mean(x["top1"] for x in v), "mean_kl": statistics.mean(x["kl"] for x in v),
             "worst_prompt_top1": min(x["top1"] for x in v)} for n, v in per.items()]


# -- decode speed ---------------------------------------------------------------------
@torch.no_grad()
def ours_itl(model, factory, prompt: list[int], steps: int) -> tuple[float, int]:
    """Median decode-step time (s) after a prompt, and the cache's allocated bytes."""
    cache = make_cache(model, 1, len(prompt) + steps + 1, factory)
    logits = prefill(model, cache, [prompt])
    tok = logits.argmax(-1)[:, None]
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        logits = model(tok, cache.lengths[:, None].to(model.device), cache)[:, -1]
        tok = logits.argmax(-1)[:, None]
        times.append(time.perf_counter() - t)
    return statistics.median(times), cache.nbytes()


@torch.no_grad()
def hf_itl(hf, prompt: list[int], steps: int, **qkw) -> tuple[float, int]:
    from transformers import QuantizedCache

    cache = QuantizedCache(backend="quanto", config=hf.config, **qkw)
    o = hf(torch.tensor([prompt]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    tok = o.logits[:, -1].argmax(-1)[:, None]
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        o = hf(tok, past_key_values=o.past_key_values, use_cache=True)
        tok = o.logits[:, -1].argmax(-1)[:, None]
        times.append(time.perf_counter() - t)
    return statistics.median(times), _hf_quant_bytes(o.past_key_values)


def _hf_quant_bytes(cache) -> int:
    """Bytes transformers' QuantizedCache holds: packed data, scales, shifts, residual."""
    total = 0
    for layer in cache.layers:
        for name in ("_quantized_keys", "_quantized_values"):
            qt = getattr(layer, name, None)
            for t in _tensors(qt):
                total += t.numel() * t.element_size()
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def _tensors(qt):
    if qt is None:
        return []
    if type(qt) is torch.Tensor:
        return [qt]
    names, _ = qt.__tensor_flatten__()
    return [t for n in names for t in _tensors(getattr(qt, n))]


def speed(cfg, lm, hf) -> list[dict]:
    q = dict(nbits=cfg.nbits, q_group_size=cfg.group_size, residual_length=cfg.residual)
    systems = {name: partial(ours_itl, lm.model, backend(name)) for name in cfg.backends}
    systems["hf-QuantizedCache"] = lambda p, s: hf_itl(hf, p, s, **q)
    rows = []
    for ctx in cfg.contexts:
        prompt = synthetic_prompt(lm, ctx)
        runs = {n: [] for n in systems}
        for _ in range(cfg.repeats):  # alternate systems within each repeat
            for n, fn in systems.items():
                runs[n].append(fn(prompt, cfg.steps))
        dense_itl = statistics.median(r[0] for r in runs["dense"])
        for n, r in runs.items():
            itl = statistics.median(x[0] for x in r)
            rows.append({"context": ctx, "system": n, "itl_ms": 1000 * itl, "itl_vs_dense": itl / dense_itl,
                         "kv_bytes": r[-1][1]})
        print_table(rows[-len(systems):])
    return rows


# -- memory ---------------------------------------------------------------------------
def memory(cfg, lm, hf) -> list[dict]:
    """int4 (everything counted) vs a bf16 dense cache at 4k; sliding on Gemma 3 at 4k;
    paged waste for a batch of mixed lengths 100-2000 next to dense preallocation."""
    import random

    from decodelab.cache.base import CacheLayout
    from decodelab.cache.paged import waste_report
    from decodelab.cache.sliding import sliding_memory
    from decodelab.models.loading import load

    ctx, rows = 4096, []
    lay = CacheLayout.of(lm.model)
    bf16_dense = ctx * CacheLayout(**{**lay.__dict__, "dtype": torch.bfloat16}).bytes_per_token()
    c = backend("int4")(lay, 1, ctx)  # conf/cache/int4.yaml defaults
    _fill(c, ctx)
    rows.append({"what": f"int4 (yaml defaults: residual {c.residual}, rollback {c.rollback_limit}), {lm.name}, 4k",
                 "bytes": c.nbytes(), "reference": "bf16 dense", "reference_bytes": bf16_dense,
                 "ratio": c.nbytes() / bf16_dense})
    glay = CacheLayout.of(load("gemma3-270m", device="cpu").model)
    sl = backend("sliding", rollback=8)(glay, 1, ctx)
    _fill(sl, ctx)
    dense = backend("dense")(glay, 1, ctx)
    assert sl.nbytes() == sliding_memory(glay, ctx, rollback=8)["stored_bytes"]
    rows.append({"what": "sliding (rollback 8), gemma3-270m, 4k (allocated)", "bytes": sl.nbytes(),
                 "reference": "dense", "reference_bytes": dense.nbytes(), "ratio": sl.nbytes() / dense.nbytes()})
    lengths = [random.Random(s).randint(100, 2000) for s in range(16)]
    w = waste_report(lengths, 16, lay.bytes_per_token())
    rows.append({"what": "paged block 16, 16 rows of 100-2000 tokens: waste fraction",
                 "bytes": w["paged_waste_fraction"], "reference": "dense preallocated to the longest",
                 "reference_bytes": w["dense_waste_fraction"],
                 "ratio": w["paged_waste_fraction"] / w["dense_waste_fraction"]})
    return rows


def _fill(cache, n: int, chunk: int = 512) -> None:
    lay = cache.layout
    for s in range(0, n, chunk):
        pos = torch.arange(s, min(n, s + chunk))[None]
        cache.prepare(pos)
        for layer in range(lay.n_layers):
            kv = torch.randn(1, lay.n_kv_heads, pos.shape[1], lay.head_dim, dtype=lay.dtype)
            q = torch.randn(1, lay.n_kv_heads, pos.shape[1], lay.head_dim, dtype=lay.dtype)
            cache.attend(layer, q, kv, kv, pos)


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="kv_bench")
def main(cfg: DictConfig) -> None:
    git_rev()  # the code this run starts with
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    lm = instantiate_unwrapped(cfg.model)
    from decodelab.experiments.baseline import hf_model_for

    hf = hf_model_for(lm)
    rows = {"quality": quality, "speed": speed, "memory": memory}[cfg.part](cfg, lm, hf)
    write_results(f"kv_bench-{cfg.part}", cfg, rows, lm.model)


if __name__ == "__main__":
    main()
