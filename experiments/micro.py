"""Microbenchmarks: one step or one forward, timed side by side in one process
(experiments/README.md has the tables).

    decodelab-micro part=kv_speed     # decode step per backend and transformers' QuantizedCache, 1k and 4k
                                      # (kv_compile=true: each backend compiled too; kv_weights: on int4 weights too;
                                      # llama.cpp with each of kv_llama_cpp's KV types, where it is installed)
    decodelab-micro part=kv_quality   # KV types (ours; transformers' int4) vs dense fp32, teacher-forced ShareGPT
                                      # replies (quality_context=N: after N tokens of concatenated conversations)
    decodelab-micro part=verify_cost  # a forward of T tokens vs one token, per matmul impl
    decodelab-micro part=kv_memory    # bytes each backend holds vs the formula (fp32, bf16); paged vs dense waste
    decodelab-micro part=mixed_step   # a prefill chunk beside a decode step: alone, two forwards, one forward
    decodelab-micro part=weights      # decode tok/s, TTFT: fp32/int8/int4 weights; transformers, llama.cpp
    decodelab-micro part=weights_quality  # int8 / int4 weights vs fp32, teacher-forced: ours and transformers + quanto
    decodelab-micro part=step_profile     # one compiled decode step per weight type: projections (GB/s), attention,
                                          # head, sampling, the rest; thread utilization; the roofline
                                          # (those three: experiments/micro_weights.py)
    decodelab-micro part=spec_gamma   # speculative speedup vs gamma per drafter, measured and predicted
    decodelab-micro part=perplexity   # held-out perplexity, every weights x cache setup; transformers beside
    decodelab-micro -m preset=kivi-ablation  # a named sweep of these options (conf/preset/)

A timed part records, beside each median, the quartiles of the samples it summarizes
(`<metric>_p25`, `_p75`; `_p50` where the metric itself is pooled), which the report draws
as the point's interquartile range.
"""

from __future__ import annotations

import statistics
import sys
import time
from functools import partial

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from decodelab.cache.base import CacheLayout
from decodelab.decoding.agreement import compare, dense_logits, forced_logits
from decodelab.decoding.prefill import prefill
from decodelab.decoding.text import make_cache
from decodelab.experiments import harness
from decodelab.experiments.micro_weights import (hf_quanto, llama_cpp_for, llama_cpp_problems, step_profile,
                                                 weight_problems, weights, weights_quality)
from decodelab.experiments.plotting import quartile_fields
from decodelab.experiments.report import markdown_table
from decodelab.experiments.workloads import ShareGPT, long_conversations, synthetic_prompt
from decodelab.models.reference import (LLAMA_CPP_KV, hf_cache_bytes, hf_model_for, hf_quantized_cache, hf_steps,
                                        llama_cpp_steps)
from decodelab.models.errors import raise_if
from decodelab.models.matmul import impl_problems


def hf_int4(hf, cfg):
    """transformers' QuantizedCache at the part's nbits, group size and residual."""
    return hf_quantized_cache(hf, cfg.nbits, cfg.group_size, cfg.residual)


# -- ours -----------------------------------------------------------------------------------------
@torch.no_grad()
def our_steps(model, factory, prompt: list[int], steps: int, timer, chunk: int | None = None) -> int:
    """Prefill (in chunks of `chunk` tokens; None: one pass), then `steps` greedy one-token
    forwards, each timed; the cache's bytes."""
    cache = make_cache(model, 1, len(prompt) + steps + 1, factory)
    tok = prefill(model, cache, [prompt], chunk).argmax(-1)[:, None]  # [1, 1]
    for _ in range(steps):
        with timer:
            tok = model(tok, cache.lengths[:, None].to(model.device), cache)[:, -1].argmax(-1)[:, None]
    return cache.nbytes()


@torch.no_grad()
def compiled_steps(model, factory, prompt: list[int], steps: int, timer, built: dict, chunk: int | None = None) -> int:
    """`our_steps` through the compiled static step (decoding/compiled.py): compiled once per
    backend and cache shape (kept in `built`, its compile time beside it), then per call the
    cache emptied, the prompt prefilled, `steps` greedy steps each timed; the cache's bytes."""
    from decodelab.decoding.compiled import compiled_step

    if "step" not in built:
        built["cache"] = make_cache(model, 1, len(prompt) + steps + 1, factory)
        t0 = time.perf_counter()
        built["step"] = compiled_step(model, built["cache"])
        built["compile_s"] = time.perf_counter() - t0
    cache, step = built["cache"], built["step"]
    cache.reset()
    tok = prefill(model, cache, [prompt], chunk).argmax(-1)  # [1]
    for _ in range(steps):
        with timer:
            tok = step.step(tok).argmax(-1)
    return cache.nbytes()


def llama_cpp_kv(cfg, lm, ctx: int) -> dict:
    """kv_speed's llama.cpp systems at one context: per KV type of `kv_llama_cpp`, its name ->
    a runner of the part's signature (llama.cpp on the model's GGUF, the same prompt ids, its
    greedy steps timed; returns the KV bytes its context holds: n_ctx x the model's K/V
    elements per token, every layer, x the type's bytes per element; on a model with windowed
    layers llama.cpp keeps less for those, so this is its upper bound). Empty where llama.cpp
    is skipped."""
    out = {}
    for kv in cfg.kv_llama_cpp:
        llm = llama_cpp_for(cfg, lm, ctx + cfg.steps + 1, kv)
        if llm is None:
            return {}
        lay = CacheLayout.of(lm.model)
        nbytes = int(llm.n_ctx() * 2 * lay.n_layers * lay.n_kv_heads * lay.head_dim * LLAMA_CPP_KV[kv])

        def run(p, s, timer, llm=llm, nbytes=nbytes):
            llama_cpp_steps(llm, p, s, timer)
            return nbytes
        out[llm.system] = run
    return out


def kv_speed(cfg, lm, hf) -> list[dict]:
    """Decode ITL after a synthetic prompt of each context (prefilled in chunks of
    `prefill_chunk`), per backend, eager and (with `kv_compile`) through the compiled step,
    transformers' QuantizedCache beside (with `compare_transformers`), and llama.cpp with
    each KV type of `kv_llama_cpp` where it is installed (`compare_llama_cpp`); every system
    timed in turn within each repeat. `itl_vs_<first>`: over the first
    backend's eager ITL; `vs_first_same_mode`: over the first backend's ITL in the same mode
    (eager for transformers and llama.cpp)."""
    from decodelab.models.quantize import WeightOptions

    first = cfg.backends[0]
    models = {"": lm.model}  # weights as loaded, then each of kv_weights (a quantized copy)
    for w in cfg.kv_weights:
        kind = w.split("+")[0]
        models[f"{w} weights, "] = WeightOptions(kind, cfg.weight_group_size if kind == "int4" else None,
                                                quantize_head=w.endswith("+head")).apply(lm.model)
    rows = []
    for ctx in cfg.contexts:
        systems, built = {}, {}
        for mode in ("", " compiled") if cfg.kv_compile else ("",):
            for tag, model in models.items():
                for name in cfg.backends:
                    n = f"{tag}{name}{mode}"
                    built[n] = {}
                    systems[n] = (partial(compiled_steps, model, harness.cache_factory(name), built=built[n],
                                          chunk=cfg.prefill_chunk) if mode
                                  else partial(our_steps, model, harness.cache_factory(name), chunk=cfg.prefill_chunk))
        if hf is not None:
            systems["hf-QuantizedCache"] = lambda p, s, timer: hf_cache_bytes(hf_steps(
                hf, p, s, cache=hf_int4(hf, cfg), timer=timer)[1])
        systems |= llama_cpp_kv(cfg, lm, ctx)
        prompt = synthetic_prompt(lm, ctx)
        timers = {n: harness.Timer(lm.model.device) for n in systems}
        nbytes = {}
        for _ in range(cfg.repeats):  # alternate systems within each repeat
            for n, fn in systems.items():
                nbytes[n] = fn(prompt, cfg.steps, timer=timers[n])
        unit = {mode: timers[f"{first}{mode}"].median() for mode in ("", " compiled") if f"{first}{mode}" in timers}
        for n, t in timers.items():
            mode = " compiled" if n.endswith(" compiled") else ""
            row = {"context": ctx, "system": n, "itl_ms": 1e3 * t.median(), f"itl_vs_{first}": t.median() / unit[""],
                   "vs_first_same_mode": t.median() / unit[mode], "kv_bytes": nbytes[n]}
            if mode:
                row["compile_s"] = built[n]["compile_s"]
            rows.append(row | quartile_fields("itl_ms", [1e3 * x for x in t.seconds]))
        for b in built.values():  # the compiled steps of this context hold its caches: freed before the next
            b.clear()
        systems.clear()  # (llama.cpp's contexts with them)
    return rows


def kv_quality(cfg, lm, hf) -> list[dict]:
    tok = lm.tokenizer
    if cfg.quality_context:  # long contexts: concatenated conversations, int4 quantizes almost all of each
        seqs = long_conversations(lm, cfg.prompts, cfg.quality_context, cfg.forced_tokens, cfg.seed)
    else:
        reqs = ShareGPT(cfg.prompts, cfg.seed, max_prompt_tokens=cfg.max_prompt_tokens,
                        min_reference_tokens=cfg.forced_tokens)(lm)
        seqs = [(tok.encode(r.prompt, chat=True), tok.encode(r.reference)[: cfg.forced_tokens]) for r in reqs]
    ours = {b: harness.cache_factory(b, **({"nbits": cfg.nbits, "group_size": cfg.group_size,
                                              "residual": cfg.residual} if b == "int4" else {}))
            for b in cfg.quality_backends}
    forced = lambda f, p, r: forced_logits(lm.model, f, p, r).double()  # noqa: E731
    systems = {f"ours-{b}": partial(forced, f) for b, f in ours.items()}
    systems["hf-QuantizedCache"] = lambda p, r: hf_steps(hf, p, len(r) - 1, r, hf_int4(hf, cfg))[0].double()
    per = {name: [] for name in systems}
    for i, (prompt, ref) in enumerate(seqs):
        dense = dense_logits(lm.model, prompt, ref).double()
        for name, fn in systems.items():
            per[name].append(compare(dense, fn(prompt, ref)))
        print(f"prompt {i + 1}/{len(seqs)} ({len(prompt)} tokens): " + ", ".join(
            f"{n} top1 {v[-1]['top1']:.3f} kl {v[-1]['kl']:.4f}" for n, v in per.items()), file=sys.stderr)
    return [{"system": n, "prompts": len(v), "forced_tokens": cfg.forced_tokens,
             "context_tokens": statistics.mean(len(p) for p, _ in seqs),
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
            rows.append({"matmul": impl, "tokens": T, "context": len(prompt), "ms": ms,
                         "cost_vs_1_token": ms / one[impl]})
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
            rows.append({"context": ctx, "system": name, "kv_bytes": c.nbytes(),
                         "formula_bytes": c.theoretical_bytes(), "vs_formula": c.nbytes() / c.theoretical_bytes(),
                         "vs_bf16_formula": c.nbytes() / (ctx * bf16)})
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


def spec_gamma(cfg, lm, hf) -> list[dict]:
    """Speculative speedup over plain greedy for each drafter of `drafts` (conf/draft
    names) x each of `gammas`, on `prompts` ShareGPT prompts x `steps` new tokens (EOS
    ignored), dense cache. Per round and prompt, each drafter in turn: greedy, then the
    drafter at every gamma, so the greedy decode right before them is the unit of that
    drafter's speedups (`repeats` rounds, after a short warm-up of every setup). Per setup
    (`_spec_row`): the speedup (decode time summed over prompts and rounds), the speedup
    predicted from its own alpha, c_draft and c_verify in units of that greedy step
    (`speedup_over_greedy`, as experiment=gamma reports it), acceptance, whether its tokens
    equal greedy's (they must: temperature 0), and the spread over its samples (one per
    round and prompt)."""
    from decodelab.decoding import greedy
    from decodelab.decoding.agreement import first_diff
    from decodelab.decoding.speculative import SpeculativeDecoder

    factory = harness.cache_factory("dense")
    drafters = {d: harness.option("draft", d)(target=lm, cache=factory) for d in cfg.drafts}
    setups = {(d, g): SpeculativeDecoder(drafters[d], gamma=g) for d in cfg.drafts for g in cfg.gammas}
    reqs = ShareGPT(cfg.prompts, cfg.seed, max_prompt_tokens=cfg.max_prompt_tokens)(lm)
    prompts = [r.encode(lm.tokenizer) for r in reqs]
    run = partial(_decode_once, lm.model)
    for dec in [greedy(), *setups.values()]:  # warm-up: allocator, the quantized kernels' packing
        run(dec, prompts[0][:16], 4)
    plain_s, spec_s, stats, same = ({k: [] for k in setups} for _ in range(4))  # per setup: one per sample
    for rep in range(cfg.repeats):
        for i, prompt in enumerate(prompts):
            for d in cfg.drafts:
                plain = run(greedy(), prompt, cfg.steps)
                for g in cfg.gammas:
                    r = run(setups[(d, g)], prompt, cfg.steps)
                    plain_s[(d, g)].append(harness.decode_s(plain.token_times[0]))
                    spec_s[(d, g)].append(harness.decode_s(r.token_times[0]))
                    stats[(d, g)].append(r.stats)
                    same[(d, g)].append(first_diff(r.tokens[0], plain.tokens[0]) is None)
            print(f"round {rep + 1}/{cfg.repeats} prompt {i + 1}/{len(prompts)} ({len(prompt)} tokens) done",
                  file=sys.stderr)
    return [_spec_row(d, g, cfg.steps, plain_s[(d, g)], spec_s[(d, g)], stats[(d, g)], same[(d, g)])
            for d, g in setups]


def _decode_once(model, decoder, prompt: list[int], n: int):
    """`n` new tokens of `decoder` after `prompt` on a fresh dense cache (EOS ignored)."""
    from decodelab.decoding import generate

    return generate(model, make_cache(model, 1, len(prompt) + n + 1 + decoder.lookahead), decoder, [prompt], n)


def _spec_row(draft: str, gamma: int, steps: int, plain: list[float], spec: list[float], stats: list[dict],
              same: list[bool]) -> dict:
    """One drafter x gamma from its samples (one per round and prompt: greedy's and its own
    decode seconds over `steps` new tokens, its decoder statistics, whether its tokens were
    greedy's): the pooled speedup (summed times) and its prediction, mean acceptance, and the
    quartiles of the per-sample speedups (greedy's time over its own) and acceptance rates
    (`speedup_vs_greedy_p25/_p50/_p75`, `acceptance_rate_p25/_p50/_p75`: the report's
    point and interquartile range)."""
    from decodelab.decoding.speculative import speedup_over_greedy

    plain_steps, accept = len(plain) * (steps - 1), [x["acceptance_rate"] for x in stats]
    return {"draft": draft, "gamma": gamma, "cache": "dense", "needs_drafter": True,
            **speedup_over_greedy(sum(spec), sum(plain), plain_steps, stats),
            **quartile_fields("speedup_vs_greedy", [p / s for p, s in zip(plain, spec)], median=True),
            "acceptance_rate": statistics.mean(accept), **quartile_fields("acceptance_rate", accept, median=True),
            "mean_accepted": statistics.mean(x["tokens_per_target_call"] for x in stats),
            "greedy_tok_s": plain_steps / sum(plain), "greedy_identical": f"{sum(same)}/{len(same)}"}


def perplexity(cfg, lm, hf) -> list[dict]:
    """Perplexity of each held-out sample of `ppl_samples` (experiments/perplexity.py: ShareGPT
    replies, Shakespeare's plays) for our fp32 model and each of `ppl_weights` x each of
    `ppl_caches` (int4 at nbits / group_size / residual), beside transformers' fp32 model
    (`transformers-fp32`, the reference: each row's `vs_transformers_fp32` is its relative
    difference on the same sample) and, with `ppl_anchors`, transformers + quanto weights and
    transformers' QuantizedCache at the same int4 settings. Every system is built once and
    scores every sample."""
    from decodelab.experiments import perplexity as ppl

    samples = {s: ppl.sample_ids(lm, cfg.ppl_tokens, s) for s in cfg.ppl_samples}  # all read before any scoring
    systems, rows = _ppl_systems(cfg, lm, hf), []
    for sample, ids in samples.items():
        mine = []
        for (name, w, c), fn in systems.items():
            t = time.perf_counter()
            r = ppl.perplexity(fn, ids, cfg.context, cfg.stride)
            mine.append({"system": name, "weights": w, "cache": c, **r, "seconds": time.perf_counter() - t})
            print(f"{sample} {name}: perplexity {r['perplexity']:.4f} over {r['tokens']} tokens", file=sys.stderr)
        ref = next((r["perplexity"] for r in mine if r["system"] == "transformers-fp32"), None)
        for r in mine:
            r["vs_transformers_fp32"] = None if ref is None else r["perplexity"] / ref - 1
            r |= {"context": cfg.context, "stride": cfg.stride, "chunk": cfg.ppl_chunk, "sample": sample}
        rows += mine
    return rows


def _ppl_systems(cfg, lm, hf) -> dict:
    """(name, weights, cache) -> chunk_logits (experiments/perplexity.py) of each system
    `perplexity` measures, transformers' fp32 first (where `hf` is given)."""
    from decodelab.experiments import perplexity as ppl
    from decodelab.models.quantize import WeightOptions

    caches = {c: _ppl_cache(cfg, c) for c in cfg.ppl_caches}
    systems = {("transformers-fp32", "fp32", "transformers"): ppl.transformers_one_pass(hf)} if hf is not None else {}
    for w in ["fp32", *cfg.ppl_weights]:
        g = cfg.weight_group_size if w == "int4" else None  # (int8: a scale per output channel)
        m = lm.model if w == "fp32" else WeightOptions(w, g).apply(lm.model)
        systems |= {(f"ours-{w}-{c}", w, c): ppl.ours(m, f, cfg.ppl_chunk) for c, f in caches.items()}
    if hf is not None and cfg.ppl_anchors:
        systems |= {(f"transformers-quanto-{w}", w, "transformers"): ppl.transformers_one_pass(hf_quanto(hf, w))
                    for w in cfg.ppl_weights}
        if "int4" in caches:
            systems[("transformers-QuantizedCache", "fp32", f"QuantizedCache int{cfg.nbits}")] = \
                ppl.transformers_cached(hf, lambda: hf_int4(hf, cfg), cfg.ppl_chunk)
    return systems


def _ppl_cache(cfg, name: str):
    """The factory of conf/cache option `name` as part=perplexity builds it: int4 at the
    part's nbits, group_size and residual."""
    int4 = {"nbits": cfg.nbits, "group_size": cfg.group_size, "residual": cfg.residual}
    return harness.cache_factory(name, **(int4 if name == "int4" else {}))


PARTS = {"kv_speed": kv_speed, "kv_quality": kv_quality, "verify_cost": verify_cost, "kv_memory": kv_memory,
         "mixed_step": mixed_step, "weights": weights,
         "weights_quality": weights_quality, "step_profile": step_profile, "spec_gamma": spec_gamma,
         "perplexity": perplexity}
#: the list options each part needs non-empty (those in INT_LISTS: of integers >= 1)
LISTS = {"kv_speed": ("contexts", "backends"), "kv_memory": ("contexts", "backends"),
         "verify_cost": ("tokens", "impls"), "mixed_step": ("chunks", "backends"),
         "weights": ("contexts", "weight_types"), "step_profile": ("contexts",), "spec_gamma": ("gammas", "drafts")}
INT_LISTS = ("contexts", "tokens", "chunks", "gammas")


def check(cfg: DictConfig) -> None:
    """The part and its options, before the model loads: every reason at once (SetupError)."""
    p = [] if cfg.part in PARTS else [f"part must be one of {list(PARTS)}, got {cfg.part!r}"]
    if cfg.part == "verify_cost":
        p += [r for impl in cfg.impls for r in impl_problems(impl, key="impls[]")]
        if not isinstance(cfg.verify_compile, bool):
            p.append(f"verify_compile must be true or false, got {cfg.verify_compile!r}")
    if cfg.part in ("kv_speed", "kv_memory", "mixed_step"):
        p += _backend_problems(cfg)
    if cfg.part == "kv_quality":
        known = harness.group_options("cache")
        p += [f"quality_backends: no cache {b!r}; the options are {', '.join(known)}" for b in cfg.quality_backends
              if b not in known]
    if cfg.part == "kv_speed":
        kinds = ("int8", "int4", "int8+head", "int4+head")
        p += [f"kv_weights: {w!r} is not one of {list(kinds)}" for w in cfg.kv_weights if w not in kinds]
        if not isinstance(cfg.kv_compile, bool):
            p.append(f"kv_compile must be true or false, got {cfg.kv_compile!r}")
        p += [f"kv_llama_cpp: {t!r} is not one of llama.cpp's KV types {list(LLAMA_CPP_KV)}" for t in cfg.kv_llama_cpp
              if t not in LLAMA_CPP_KV]
        p += llama_cpp_problems(cfg) if list(cfg.kv_llama_cpp) else []
        p += harness.int_problems(cfg, {"prefill_chunk": 1}, nullable=("prefill_chunk",))
        if not isinstance(cfg.compare_transformers, bool):
            p.append(f"compare_transformers must be true or false, got {cfg.compare_transformers!r}")
    p += harness.int_problems(cfg, dict.fromkeys(("repeats", "steps", "prompts", "forced_tokens",
                                                  "decode_rows", "decode_context", "chunk_context"), 1))
    p += harness.run_option_problems(cfg)
    if cfg.part in ("weights", "weights_quality", "step_profile"):
        p += weight_problems(cfg)
    if cfg.part == "perplexity":
        p += _perplexity_problems(cfg)
    if cfg.part == "spec_gamma":
        p += _spec_gamma_problems(cfg)
    for key in LISTS.get(cfg.part, ()):
        items, ints = list(cfg[key]), key in INT_LISTS
        if not items or (ints and not all(isinstance(x, int) and x >= 1 for x in items)):
            p.append(f"{key} must be a non-empty list{' of integers >= 1' if ints else ''}, got {items}")
    p += harness.model_problems(cfg.model)
    raise_if(p)


def _backend_problems(cfg) -> list[str]:
    """`backends` of kv_speed, kv_memory and mixed_step: conf/cache options; mixed_step's
    must serve a forward over some of their rows (a chunk beside other rows' decode)."""
    known = harness.group_options("cache")
    p = [f"backends: no cache {b!r}; the options are {', '.join(known)}" for b in cfg.backends if b not in known]
    for b in (b for b in cfg.backends if b in known and cfg.part == "mixed_step"):
        f = harness.cache_factory(b)
        cls = getattr(f, "func", f)
        if not cls.serves_row_subsets:
            p.append(f"backends: {b} cannot run a forward over some of its rows ({cls.row_subset_reason}); "
                     "part=mixed_step needs one that serves row subsets (dense, paged, int4)")
    return p


def _perplexity_problems(cfg) -> list[str]:
    """part=perplexity's options: sizes, stride < context, ppl_caches known and each buildable
    with the part's int4 settings (on a stand-in layout), ppl_weights known, ppl_anchors a bool."""
    from decodelab.models.quantize import WEIGHT_TYPES

    from decodelab.experiments.perplexity import sample_problems

    p = harness.int_problems(cfg, {"ppl_tokens": 2, "context": 2, "stride": 1, "ppl_chunk": 1})
    samples = list(cfg.ppl_samples) if isinstance(cfg.ppl_samples, (list, ListConfig)) else None
    if not samples:
        p.append(f"ppl_samples must list at least one text sample (sharegpt-replies, shakespeare), "
                 f"got {cfg.ppl_samples!r}")
    for sample in samples or []:
        p += sample_problems(sample)
    if isinstance(cfg.stride, int) and isinstance(cfg.context, int) and cfg.stride >= cfg.context:
        p.append(f"stride must be < context (a window's first new target needs the token before it in the "
                 f"window), got stride={cfg.stride} context={cfg.context}")
    known = harness.group_options("cache")
    p += [f"ppl_caches: no cache {c!r}; the options are {', '.join(known)}" for c in cfg.ppl_caches if c not in known]
    for c in (c for c in cfg.ppl_caches if c in known):
        harness.collect(p, lambda c=c: _ppl_cache(cfg, c)(harness._probe_layout(), 1, 128))
    quantized = [w for w in WEIGHT_TYPES if w != "none"]
    p += [f"ppl_weights: {w!r} is not one of {quantized} (fp32 always runs)" for w in cfg.ppl_weights
          if w not in quantized]
    if not list(cfg.ppl_caches):
        p.append("ppl_caches must name at least one cache backend (dense, ...)")
    if not isinstance(cfg.ppl_anchors, bool):
        p.append(f"ppl_anchors must be true or false, got {cfg.ppl_anchors!r}")
    return p


def _spec_gamma_problems(cfg) -> list[str]:
    """part=spec_gamma's drafts: conf/draft options that need no model of their own and
    can draft for this model; steps >= 2."""
    known = harness.group_options("draft")
    p = [f"drafts: no draft {d!r}; the options are {', '.join(known)}" for d in cfg.drafts if d not in known]
    yaml = lambda d: OmegaConf.load(harness.CONF_DIR / "draft" / f"{d}.yaml")  # noqa: E731
    composed = [d for d in cfg.drafts if d in known and "defaults" in yaml(d)]
    p += [f"drafts: {d!r} takes a model of its own, which part=spec_gamma does not compose; time it with "
          f"decodelab-bench -m experiment=gamma draft={d} model@draft.model=<a conf/model option>" for d in composed]
    known = [d for d in known if d not in composed]
    p += harness.int_problems(cfg, {"steps": 2})
    return p + [r for d in cfg.drafts if d in known for r in harness.draft_problems(
        OmegaConf.create({"draft": yaml(d), "model": cfg.model}))]


def run(cfg: DictConfig, out) -> list[dict]:
    """Check, load the model (and transformers' where the part compares with it), run the
    part, print its table and write one summary record per row to `out`/results.jsonl."""
    check(cfg)
    lm = harness.load_model(cfg)
    hf = hf_model_for(lm) if cfg.part == "kv_quality" or (
        cfg.part in ("kv_speed", "weights", "weights_quality", "perplexity") and cfg.compare_transformers) else None
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
