"""Benchmark one setup on a workload into `results.jsonl` (README, "Experiments").

    decodelab-bench [setup=paged | cache=int4 decoder=speculative draft=prompt-lookup] [workload=...]
    decodelab-bench -m cache=dense,paged,int4,sliding decoder=greedy,speculative
    decodelab-bench -m experiment=compare        # `make compare`; presets in conf/experiment/

Per prompt: TTFT (tokenize / prefill / first sampling), every ITL, tok/s, KV bytes, the
speculative statistics, agreement with dense (decoding.agreement, as `agree` measures it);
side by side, prompt by prompt: greedy (`compare_greedy`) or transformers' `generate()`
(`compare_transformers`). Results are written atomically when a run finishes; a rerun of a
sweep skips every finished run (same config hash) unless `redo=true`; a multirun ends
with its report.
"""

from __future__ import annotations

import hashlib
import json
import logging
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from decodelab.decoding.agreement import compare, dense_logits, first_diff, pool, setup_logits
from decodelab.decoding.decoders import greedy
from decodelab.decoding.generate import generate, percentile
from decodelab.decoding.speculative import speedup_over_greedy
from decodelab.decoding.text import capacity_problems, make_cache
from decodelab.experiments import harness
from decodelab.experiments.report import read_results
from decodelab.models.reference import hf_generate_timed, hf_model_for
from decodelab.models.errors import SetupError, raise_if
from decodelab.models.loading import instantiate_unwrapped
from decodelab.models.quantize import WeightOptions, kind_of

log = logging.getLogger("decodelab.bench")
RESULTS = harness.RESULTS
NOT_HASHED = ("hydra", "redo", "progress", "name")  # change nothing that is measured
#: options added after sweeps were run: hashed only where set, so that their default (null)
#: leaves the hash of every earlier run as it was and finished runs are still found
HASHED_WHERE_SET = ("cpu_wrapper",)


# -- before any weights load ----------------------------------------------------------
def check(cfg: DictConfig):
    """Every problem of the run options, the setup and the workload, together; returns
    the validated workload."""
    reasons = harness.int_problems(cfg, {"max_new_tokens": 1, "batch_size": 1}) + harness.run_option_problems(cfg)
    if cfg.compare_transformers:  # transformers' greedy generate() at full precision, one prompt at a time
        lossless = harness.declared(cfg.decoder, "lossless_at_temperature_0") and not cfg.decoder.get("temperature")
        reasons += [f"compare_transformers {why}" for ok, why in (
            (cfg.batch_size == 1, "times transformers' generate() one prompt at a time: use batch_size=1"),
            (lossless, "compares against transformers' greedy output: use a decoder at temperature 0"),
            (kind_of(cfg.model.get("weights")) in ("none", None), "runs transformers at full precision: use "
                                                                   "model.weights.kind=none")) if not ok]
    return harness.gather(lambda: raise_if(reasons), lambda: harness.check(cfg),
                          lambda: instantiate_unwrapped(cfg.workload))[-1]


def config_hash(cfg: DictConfig) -> str:
    """12 hex digits of the resolved config, without the keys that change nothing measured (and
    `HASHED_WHERE_SET` at their default)."""
    c = {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items()
         if k not in NOT_HASHED and not (k in HASHED_WHERE_SET and v is None)}
    return hashlib.sha256(json.dumps(c, sort_keys=True, default=str).encode()).hexdigest()[:12]


def choices() -> dict:
    """The group options this run was composed from (cache=paged, ...)."""
    try:
        return dict(HydraConfig.get().runtime.choices)
    except ValueError:  # not under Hydra (tests call run() directly)
        return {}


def describe(cfg: DictConfig) -> dict:
    """The setup's names as tables show them, and what its decoder declares."""
    ch = choices()
    spec = harness.declared(cfg.decoder, "needs_drafter")
    cache, decoder = ch.get("cache", cfg.cache._target_), ch.get("decoder", cfg.decoder._target_)
    decoder += " (compiled)" if cfg.get("compile") else ""  # the step compiled: a setup of its own
    draft, opts = (ch.get("draft") if spec else None), cfg.get("draft") or {}
    if draft and WeightOptions.of(opts.get("weights")).quantize_head:
        draft += "+head"  # a quantized self-draft with its LM head quantized too: a draft of its own
    mods = ["compiled"] * bool(opts.get("compile")) + [f"{opts.get('cache')} cache"] * bool(opts.get("cache"))
    if draft and mods:  # a compiled step / a cache of its own: a draft of its own
        draft += f" ({', '.join(mods)})"
    return {"name": cfg.setup_name or f"{cache}/{decoder}" + (f"/{draft}" if spec else ""),
            "model": cfg.model.get("name") or ch.get("model"), "weights": kind_of(cfg.model.get("weights")),
            "cache": cache, "decoder": decoder, "needs_drafter": spec,
            "draft": draft, "gamma": cfg.decoder.get("gamma") if spec else None,
            "workload": ch.get("workload"), "experiment": ch.get("experiment")}


def finished_run(out: Path, run_hash: str) -> dict | None:
    """The summary of a finished run of this config in `out`, if there is one (a results
    file that is unreadable or not this run's is no finished run: the run goes ahead)."""
    f = out / RESULTS
    return next((r for r in read_results(f) if r.get("run") == run_hash), None) if f.is_file() else None


# -- measuring --------------------------------------------------------------------------
def measure_batch(lm, factory, decoder, reqs, cfg, hf=None) -> list[dict]:
    """Generate for one batch of requests; one record per request."""
    tok = lm.tokenizer if any(r.ids is None for r in reqs) else None
    t0 = time.perf_counter()  # TTFT counts from here: tokenizing is part of it
    ids = [r.encode(tok) for r in reqs]
    tokenize_s = time.perf_counter() - t0
    need = max(map(len, ids)) + cfg.max_new_tokens + decoder.lookahead
    cache = make_cache(lm.model, len(ids), harness.capacity(cfg, lm.model, len(ids), need, factory), factory)
    eos = () if cfg.ignore_eos else _eos(lm)
    res = generate(lm.model, cache, decoder, ids, cfg.max_new_tokens, eos_ids=eos, t_start=t0, tokenize_s=tokenize_s,
                   compile=cfg.compile)
    recs = [prompt_record(res, b, r.id, ids[b], factory, decoder, lm, cfg) for b, r in enumerate(reqs)]
    if cfg.compare_greedy and decoder.needs_drafter:
        # greedy in the same mode: compile=true compares with the compiled greedy step
        plain = generate(lm.model, cache, greedy(), ids, cfg.max_new_tokens, eos_ids=eos, compile=cfg.compile)
        for b, rec in enumerate(recs):
            rec["greedy"] = {"decode_s": harness.decode_s(plain.token_times[b]), "new_tokens": len(plain.tokens[b]),
                             "identical": first_diff(plain.tokens[b], res.tokens[b]) is None}
            rec["spec_stats"] = res.stats  # row statistics for the side-by-side prediction
    if hf is not None:
        recs[0]["transformers"] = hf_generate(hf, ids[0], cfg.max_new_tokens, eos, res.tokens[0])
    return recs


def _eos(lm) -> tuple[int, ...]:
    try:
        return lm.tokenizer.eos_ids
    except SetupError:  # a random model without a tokenizer
        return tuple(lm.cfg.eos_ids or ())


def prompt_record(res, b: int, prompt_id: str, prompt_ids: list[int], factory, decoder, lm, cfg) -> dict:
    """Timings, memory, speculative statistics and agreement of row `b`."""
    times, n = res.token_times[b], res.prompt_lengths[b]
    itl = [y - x for x, y in zip(times, times[1:])]
    dec_s = harness.decode_s(times)
    rec = {"kind": "prompt", "prompt_id": prompt_id, "prompt_tokens": n, "new_tokens": len(res.tokens[b]),
           "finish": res.finish_reasons[b], "tokenize_ms": 1e3 * res.tokenize_s, "prefill_ms": 1e3 * res.prefill_s,
           "compile_ms": 1e3 * res.compile_s,
           "first_sample_ms": 1e3 * (times[0] - res.tokenize_s - res.prefill_s), "ttft_ms": 1e3 * times[0],
           "itl_ms": [1e3 * x for x in itl], "context": [n + i for i in range(len(itl))],
           **{f"itl_p{q}_ms": percentile(itl, q) for q in (50, 95, 99)},
           "decode_s": dec_s, "decode_tok_s": len(itl) / dec_s if dec_s > 0 else None,
           "prompt_tok_s": n / res.prefill_s if res.prefill_s > 0 else None,
           "kv_bytes_formula": res.kv["kv_bytes_formula"], "kv_bytes_allocated": res.kv["kv_bytes_allocated"],
           "draft_kv_bytes_allocated": _draft_kv(decoder), "spec": _spec(res.stats), "agreement": None}
    if cfg.agree_with_dense and res.tokens[b]:
        gen = res.tokens[b]
        rec["agreement"] = compare(dense_logits(lm.model, prompt_ids, gen),
                                   setup_logits(lm.model, factory, decoder, prompt_ids, gen), gen)
    return rec


def _draft_kv(decoder) -> int | None:
    """Bytes the draft model's own cache holds (a model drafter), beside the target's."""
    cache = getattr(getattr(decoder, "drafter", None), "cache", None)
    return cache.nbytes() if cache is not None else None


def _spec(stats: dict) -> dict | None:
    if "acceptance_rate" not in stats:
        return None
    return {"acceptance_rate": stats["acceptance_rate"], "mean_accepted": stats["tokens_per_target_call"],
            "alpha": stats["alpha"], "predicted_speedup": stats["predicted_speedup"],
            "acceptance_by_position": stats["acceptance_per_position"], "gamma": stats["mean_gamma"],
            "draft_cost_ratio": stats["draft_cost_ratio"], "time_draft_s": stats["time_draft_s"],
            "time_verify_s": stats["time_verify_s"], "time_overhead_s": stats["time_overhead_s"]}


# -- transformers' generate(), side by side ---------------------------------------------------
def hf_generate(hf, ids: list[int], new_tokens: int, eos: tuple, ours: list[int]) -> dict:
    """transformers' greedy `generate()` on the same ids (EOS ignored when ours ignores
    it): TTFT, decode time and tokens, and whether its tokens equal ours."""
    tokens, times = hf_generate_timed(hf, ids, new_tokens, eos)
    return {"ttft_ms": 1e3 * times[0], "decode_s": harness.decode_s(times), "new_tokens": len(tokens),
            "identical": first_diff(tokens, ours) is None}


# -- the summary ------------------------------------------------------------------------------
def summarize(recs: list[dict], cfg: DictConfig, run_hash: str, lm) -> dict:
    """The run's summary line: medians / pooled percentiles / totals over its prompts."""
    itl = [x / 1e3 for r in recs for x in r["itl_ms"]]
    dec_tokens = sum(len(r["itl_ms"]) for r in recs)
    dec_s = sum(r["decode_s"] for r in recs)
    pre_s = sum(r["prefill_ms"] for r in recs) / 1e3
    spec = [r["spec"] for r in recs if r["spec"]]
    agree = [r["agreement"] for r in recs if r["agreement"]]
    mean = lambda xs: statistics.mean(xs) if xs else None  # noqa: E731
    metrics = {
        "prompt_tokens": statistics.median(r["prompt_tokens"] for r in recs),
        "ttft_ms": statistics.median(r["ttft_ms"] for r in recs),
        **{f"itl_p{q}_ms": percentile(itl, q) for q in (50, 95, 99)},
        "decode_tok_s": dec_tokens / dec_s if dec_s else None,
        "prompt_tok_s": sum(r["prompt_tokens"] for r in recs) / pre_s if pre_s else None,
        "kv_mib": max(r["kv_bytes_allocated"] for r in recs) / 2**20,
        "kv_mib_formula": max(r["kv_bytes_formula"] for r in recs) / 2**20,
        "draft_kv_mib": max((r.get("draft_kv_bytes_allocated") or 0) for r in recs) / 2**20 or None,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_cuda_mib": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None,
        **{k: mean([s[k] for s in spec]) for k in ("acceptance_rate", "mean_accepted", "alpha")},
        "predicted_speedup": mean([s["predicted_speedup"] for s in spec if s["predicted_speedup"]]),
        **({f"agree_{k}": pooled[v] for pooled in [pool(agree)] for k, v in (
            ("top1", "top1"), ("kl", "mean_kl"), ("max_abs_dlogit", "max_abs_dlogit"))} if agree else {}),
        "prompts": len(recs), "new_tokens": sum(r["new_tokens"] for r in recs),
        **vs_greedy([r for r in recs if r.get("greedy")]),
        **vs_transformers([r for r in recs if r.get("transformers")]),
    }
    cond = {**harness.run_conditions(lm), "batch": cfg.batch_size, "seed": cfg.decoder.get("seed")}
    return harness.summary("bench", run_hash, describe(cfg), metrics, cond, cfg)


def vs_greedy(recs: list[dict]) -> dict:
    """Speedup over greedy decoded side by side, token identity, and Leviathan's
    prediction from this run's costs (c_draft, c_verify in plain decode steps)."""
    if not recs:
        return {}
    m = speedup_over_greedy(sum(r["decode_s"] for r in recs), sum(r["greedy"]["decode_s"] for r in recs),
                            sum(r["greedy"]["new_tokens"] - 1 for r in recs), [r["spec_stats"] for r in recs])
    m.pop("alpha", None)  # the run's alpha is reported from its own statistics
    return m | {"greedy_identical": sum(r["greedy"]["identical"] for r in recs) / len(recs)}


def vs_transformers(recs: list[dict]) -> dict:
    """transformers' `generate()` on the same prompts: its TTFT and decode tok/s, ours over it."""
    if not recs:
        return {}
    hf = [r["transformers"] for r in recs]
    hf_s, hf_tokens = sum(h["decode_s"] for h in hf), sum(h["new_tokens"] - 1 for h in hf)
    ours_s, ours_tokens = sum(r["decode_s"] for r in recs), sum(r["new_tokens"] - 1 for r in recs)
    m = {"hf_ttft_ms": statistics.median(h["ttft_ms"] for h in hf),
         "hf_decode_tok_s": hf_tokens / hf_s if hf_s else None,
         "same_tokens_as_hf": sum(h["identical"] for h in hf) / len(hf)}
    if m["hf_decode_tok_s"] and ours_s:
        m["decode_speedup_vs_hf"] = ours_tokens / ours_s / m["hf_decode_tok_s"]
    m["ttft_ours_over_hf"] = statistics.median(r["ttft_ms"] for r in recs) / m["hf_ttft_ms"]
    return m


def batches(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def run(cfg: DictConfig, out: Path) -> dict | None:
    """Check, skip when already done or claimed by a live process, load, measure, write;
    returns the summary (None when another process is running this run)."""
    workload = check(cfg)  # before any weights load
    run_hash = config_hash(cfg)
    with harness.claimed(out) as holder:
        if holder is not None:
            log.warning("skipped: %s is claimed by %s (host pid), which is measuring it now; its results "
                        "land there", out, holder)
            return None
        done = None if cfg.redo else finished_run(out, run_hash)
        if done is not None:
            log.info("already done (run %s, finished %s): %s; redo=true reruns it", run_hash, done["finished"],
                     out / RESULTS)
            return done
        return measure_run(cfg, out, workload, run_hash)


def measure_run(cfg: DictConfig, out: Path, workload, run_hash: str) -> dict:
    """Load, measure every prompt, write results.jsonl (atomically); the summary."""
    lm = harness.load_model(cfg)
    factory, decoder = harness.build(cfg, lm)
    hf = hf_model_for(lm) if cfg.compare_transformers else None
    reqs = workload(lm)
    tok = lm.tokenizer if any(r.ids is None for r in reqs) else None
    longest = max(len(r.encode(tok)) for r in reqs)  # every batch's cache checked before the first is measured
    raise_if(capacity_problems(lm.model, min(cfg.batch_size, len(reqs)), longest + cfg.max_new_tokens +
                               decoder.lookahead, factory))
    log.info("run %s: %s on %d prompts (%s) -> %s", run_hash, describe(cfg)["name"], len(reqs),
             choices().get("workload"), out)
    if cfg.warmup:
        warm = reqs[0].encode(lm.tokenizer if reqs[0].ids is None else None)[:16]
        cap = harness.capacity(cfg, lm.model, 1, 16 + 4 + decoder.lookahead, factory)  # a compile it shares
        generate(lm.model, make_cache(lm.model, 1, cap, factory), decoder, [warm], 4, compile=cfg.compile)
        if hf is not None:
            hf_generate(hf, warm, 4, (), [])
    recs = []
    for group in _progress(batches(reqs, cfg.batch_size), cfg.progress):
        recs += measure_batch(lm, factory, decoder, group, cfg, hf)
    for r in recs:
        r["run"] = run_hash
    summary = summarize(recs, cfg, run_hash, lm)
    harness.write_jsonl(out / RESULTS, recs + [summary])
    log.info("wrote %s: %s", out / RESULTS, {k: v for k, v in summary["metrics"].items() if v is not None})
    if not harness.multirun():  # a sweep's table comes once, from ReportCallback at its end
        from decodelab.experiments.report import markdown_table

        metrics = {"setup": summary["setup"].get("name"), **{k: v for k, v in summary["metrics"].items()
                                                            if v is not None and not isinstance(v, (list, dict))}}
        print(markdown_table([metrics], list(metrics)))
        print(f"results: {out / RESULTS}")
    return summary


def _progress(items: list, on: bool):
    if not on or len(items) < 2:
        return items
    from tqdm import tqdm

    return tqdm(items, desc="prompts", unit="batch", file=sys.stderr)


class ReportCallback(Callback):
    """At the end of a multirun: the sweep's report (CSV, Markdown, plots) and its table."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        from decodelab.experiments.report import NoRunsError, write_report

        root = Path(config.hydra.sweep.dir)
        try:
            paths = write_report(root)
        except NoRunsError as e:
            log.warning("no report: %s", e)
            return
        print(paths["md"].read_text())
        print(f"results: {root}/**/{RESULTS}\nreport: " + ", ".join(str(p) for p in paths.values()))


main, cli = harness.entry_points("config", run, check)


if __name__ == "__main__":
    cli()
