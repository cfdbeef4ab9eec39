"""Serving under load, measured as vLLM's `benchmark_serving` measures it (README, "Serving").

    decodelab-serve                                   # ShareGPT trace, all at once, dense and paged
    decodelab-serve trace=system-prompt rates=[1,2,4] backends=[dense,paged]
    decodelab-serve trace=synthetic requests=64 rates=[0.5,1,inf] kv_budget_mb=16
    decodelab-serve trace=interference token_budget=16   # a long prompt arriving mid-stream: ITL, chunked or not

A trace is a list of requests (prompt ids and an output length: ShareGPT's reply lengths
capped at `max_output_tokens`, a synthetic range, or ShareGPT prompts behind one shared
system prompt; `interference`: synthetic requests at t = 0 and one long prompt arriving
mid-stream, served with and without chunked prefill); for each request rate (Poisson
arrivals, `inf` = all at t = 0) and cache backend, the continuous-batching engine
(decoding/engine.py) serves the whole trace,
ignoring EOS so every request generates exactly its length (as vLLM's benchmark does).
Per request: TTFT from arrival (split into queue wait and prefill), TPOT, ITL, end-to-end
latency; per run: output and total tok/s, requests/s, goodput under the SLO (`slo.ttft_s`,
`slo.tpot_s`), preemptions, KV budget utilization over time. Side by side in the same
process at rate `inf`: transformers' continuous batching (`generate_batch`) on the same
requests (`compare_transformers`), and `check_alone` requests decoded one at a time by the
static loop (token identity).
"""

from __future__ import annotations

import logging
import math
import random
import re
import statistics
import sys
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from decodelab.decoding.compiled import cpu_wrapper_chosen
from decodelab.decoding.engine import Engine, Request, engine_compile_problems, engine_problems
from decodelab.decoding.generate import generate, percentile
from decodelab.decoding.text import make_cache
from decodelab.experiments import harness
from decodelab.experiments.workloads import load_jsonl, sharegpt_jsonl, synthetic_prompt
from decodelab.models.errors import SetupError, raise_if
from decodelab.models.loading import instantiate_unwrapped
from decodelab.models.reference import hf_generate_batch, hf_model_for

log = logging.getLogger("decodelab.serve")
TRACES = ("sharegpt", "synthetic", "system-prompt", "interference")


# -- before any weights load ----------------------------------------------------------------
def rates_of(cfg: DictConfig) -> list[float]:
    """The request rates as floats (`inf`: all requests at t = 0)."""
    return [float(r) for r in cfg.rates]


def check(cfg: DictConfig) -> None:
    """Every problem of the trace, rates, engine and model options, before weights load."""
    p = harness.model_problems(cfg.model)
    if cfg.trace not in TRACES:
        p.append(f"trace must be one of {list(TRACES)}, got {cfg.trace!r}")
    p += harness.int_problems(cfg, {"requests": 1, "max_output_tokens": 1, "max_prompt_tokens": 1,
                                    "max_running": 1, "system_prompt_tokens": 1, "check_alone": 0, "unloaded": 0,
                                    "repeats": 1, "headroom": 0}) + harness.run_option_problems(cfg)
    not_lists = harness.list_problems(cfg, {"rates": "inf", "backends": "dense"})
    p += not_lists.values()
    try:
        rates = [] if "rates" in not_lists else rates_of(cfg)
        p += [f"rates must be > 0 requests/s (inf: all at once), got {r}" for r in rates if not r > 0]
        p += [] if rates or not_lists else ["rates must list at least one request rate, e.g. rates=[inf]"]
    except (TypeError, ValueError):
        p.append(f"rates must be a list of numbers or inf, e.g. rates=[0.5,1,inf], got "
                 f"{OmegaConf.to_container(cfg.rates)}")
    lo, hi = cfg.synthetic.prompt_tokens, cfg.synthetic.output_tokens
    for key, pair in (("prompt_tokens", lo), ("output_tokens", hi)):
        a, b = pair if isinstance(pair, (list, ListConfig)) and len(pair) == 2 else (None, None)
        if not (isinstance(a, int) and isinstance(b, int) and 1 <= a <= b):
            p.append(f"synthetic.{key} must be [min, max] with 1 <= min <= max, got [{a}, {b}]")
    if cfg.trace == "interference":
        i = cfg.interference
        if not (isinstance(i.prompt_tokens, int) and i.prompt_tokens >= 1 and i.at_s >= 0 and cfg.requests >= 2):
            p.append(f"trace=interference needs interference.prompt_tokens >= 1, interference.at_s >= 0 and "
                     f"requests >= 2, got {i.prompt_tokens}, {i.at_s} and {cfg.requests}")
    backends = [] if "backends" in not_lists else cfg.backends
    unknown = [b for b in backends if b not in harness.group_options("cache")]
    p += [f"backend {b!r} does not exist; the cache options are {harness.group_options('cache')}" for b in unknown]
    probe, decoder = harness._probe_layout(), harness.collect(p, lambda: decoder_of(cfg))
    for i, b in enumerate(b for b in backends if b not in unknown):
        cache = harness.collect(p, lambda b=b: factory_of(cfg, b)(probe, 2, 128))
        if cache is not None and decoder is not None:  # the engine options once, the backends' capability each
            p += [r if "cannot serve" not in r else f"backend {b}: {r}"
                  for r in engine_problems(cache, decoder, cfg.token_budget, cfg.policy)
                  if i == 0 or "cannot serve" in r]
            with cpu_wrapper_chosen(cfg.get("cpu_wrapper")):  # checked with the run's wrapper
                p += [f"backend {b}: {r}"
                      for r in engine_compile_problems(cache, decoder, cfg.compile, cfg.compile_flat)]
    for b in (cfg.backend_options or {}):  # options of a backend this run does not serve: checked all the same
        if b not in harness.group_options("cache"):
            p.append(f"backend_options.{b}: no cache backend {b!r}; the options are {harness.group_options('cache')}")
        elif b not in backends:
            harness.collect(p, lambda b=b: factory_of(cfg, b))
    if cfg.kv_budget_mb is not None and not cfg.kv_budget_mb > 0:
        p.append(f"kv_budget_mb must be > 0 (or null: the whole cache), got {cfg.kv_budget_mb}")
    for key in ("ttft_s", "tpot_s"):
        if not cfg.slo[key] > 0:
            p.append(f"slo.{key} must be > 0 seconds, got {cfg.slo[key]}")
    raise_if(p)


def decoder_of(cfg: DictConfig):
    return instantiate_unwrapped(cfg.decoder)


def factory_of(cfg: DictConfig, backend: str):
    """The cache factory of conf/cache/<backend>.yaml with `backend_options[backend]` over it."""
    return harness.option("cache", backend, where=f"backend_options.{backend}.",
                          **(cfg.backend_options or {}).get(backend, {}))


# -- traces ---------------------------------------------------------------------------------
def trace(cfg: DictConfig, lm) -> list[tuple[list[int], int]]:
    """(prompt ids, output tokens) per request, from `cfg.trace` with `cfg.seed`
    (interference: the synthetic requests, then the long one last)."""
    rng = random.Random(cfg.seed)
    if cfg.trace == "interference":
        long = synthetic_prompt(lm, cfg.interference.prompt_tokens, seed=cfg.seed + 7919)
        return trace(OmegaConf.merge(cfg, {"trace": "synthetic", "requests": cfg.requests - 1}), lm) + [(long, 1)]
    if cfg.trace == "synthetic":
        (a, b), (c, d) = cfg.synthetic.prompt_tokens, cfg.synthetic.output_tokens
        out = []
        for i in range(cfg.requests):
            ids = synthetic_prompt(lm, rng.randint(a, b), seed=cfg.seed + i)
            out.append((ids[i % len(ids):] + ids[:i % len(ids)], rng.randint(c, d)))
        return out
    system = synthetic_prompt(lm, cfg.system_prompt_tokens, seed=cfg.seed) if cfg.trace == "system-prompt" else []
    pool = load_jsonl(sharegpt_jsonl()[0])
    rng.shuffle(pool)
    tok, out = lm.tokenizer, []
    room = cfg.max_prompt_tokens - len(system)
    for rec in pool:
        ids = tok.encode(rec.prompt, chat=True)
        reply = len(tok.encode(rec.reference or ""))
        if 4 <= len(ids) <= room and reply >= 4:  # vLLM drops prompts or replies under 4 tokens
            out.append((system + ids, min(reply, cfg.max_output_tokens)))
        if len(out) == cfg.requests:
            return out
    raise SetupError(f"only {len(out)} ShareGPT records fit max_prompt_tokens={cfg.max_prompt_tokens}; raise it "
                     "or ask for fewer requests")


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Poisson arrivals: cumulative exponential gaps of mean 1 / rate seconds (0 for inf)."""
    if math.isinf(rate):
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# -- metrics --------------------------------------------------------------------------------
def _pcts(values: list[float], name: str) -> dict:
    v = [x for x in values if x is not None]
    return {f"{name}_p50_ms": percentile(v, 50), f"{name}_p99_ms": percentile(v, 99)}


def metrics(result, slo) -> dict:
    """vLLM's serving metrics of one engine run (times in ms, rates per second)."""
    done = [r for r in result.requests if r.finish_reason not in (None, "rejected")]
    dur = result.wall_s
    out_tok = sum(len(r.tokens) for r in done)
    good = [r for r in done if r.ttft_s <= slo.ttft_s and (r.tpot_s or 0.0) <= slo.tpot_s]
    util = [t["kv_bytes"] / result.kv_budget_bytes for t in result.timeline]
    return {"completed": len(done), "rejected": sum(r.finish_reason == "rejected" for r in result.requests),
            "duration_s": dur, "output_tok_s": out_tok / dur, "total_tok_s": (out_tok + sum(r.prompt_len for r in done))
            / dur, "requests_s": len(done) / dur, "goodput_req_s": len(good) / dur,
            **_pcts([r.ttft_s for r in done], "ttft"), **_pcts([r.queue_s for r in done], "queue"),
            **_pcts([r.token_times[0] - r.admitted_s for r in done], "prefill"),
            **_pcts([r.tpot_s for r in done], "tpot"), **_pcts([x for r in done for x in r.itl_s()], "itl"),
            **_pcts([r.e2e_s for r in done], "e2e"), "preemptions": result.preemptions, "steps": result.steps,
            "max_running": max((t["running"] for t in result.timeline), default=0),
            "mean_running": statistics.fmean(t["running"] for t in result.timeline) if result.timeline else 0.0,
            "kv_util_mean": statistics.fmean(util) if util else 0.0, "kv_util_max": max(util, default=0.0),
            "prefix_reused_tokens": sum(r.prefix_reused for r in done)}


# -- one run --------------------------------------------------------------------------------
def engine_for(cfg: DictConfig, lm, backend: str, capacity: int) -> Engine:
    cache = make_cache(lm.model, cfg.max_running, capacity, factory_of(cfg, backend),
                       fix="lower max_running, max_prompt_tokens or max_output_tokens (synthetic: its token ranges)")
    return Engine(lm.model, cache, decoder_of(cfg), token_budget=cfg.token_budget, policy=cfg.policy,
                  chunked_prefill=cfg.chunked_prefill, kv_budget_mb=cfg.kv_budget_mb, headroom=cfg.headroom,
                  compile=cfg.compile, compile_flat=cfg.compile_flat)


def serve_once(engine: Engine, reqs: list[tuple[list[int], int]], rate: float, seed: int, times=None):
    times = arrivals(len(reqs), rate, seed) if times is None else times
    return engine.run([Request(p, n, t, id=i) for i, ((p, n), t) in enumerate(zip(reqs, times))])


def unloaded(engine: Engine, reqs) -> dict:
    """TTFT and ITL of requests served one at a time (one after another through one engine,
    so a paged cache holds a common system prompt from the second on, as under load): the
    unloaded reference the loaded runs are read against."""
    done = [serve_once(engine, [r], math.inf, 0).requests[0] for r in reqs]
    return {f"unloaded_{k}": v for k, v in (_pcts([r.ttft_s for r in done], "ttft") |
                                             _pcts([x for r in done for x in r.itl_s()], "itl")).items()}


def request_records(result, backend: str, rate: float, run: str) -> list[dict]:
    return [{"kind": "prompt", "run": run, "backend": backend, "rate": rate, "id": r.id, "prompt_len": r.prompt_len,
             "output_len": len(r.tokens), "arrival_s": r.arrival_s, "ttft_s": r.ttft_s, "queue_s": r.queue_s,
             "tpot_s": r.tpot_s, "e2e_s": r.e2e_s, "preemptions": r.preemptions, "finish": r.finish_reason,
             "error": r.error, "token_times": r.token_times} for r in result.requests]


def offline(cfg: DictConfig, lm, fresh, reqs, first: bool) -> tuple:
    """At rate inf, `repeats` times: the engine, then (beside the first backend, with
    `compare_transformers`) transformers' generate_batch on the same requests, alternating.
    The engine run of median output tok/s, and the side-by-side metrics (medians, every
    repeat's tok/s listed). Every run gets a `fresh()` engine: an empty cache, no prefix
    cached by an earlier run."""
    hf = hf_model_for(lm) if cfg.compare_transformers and first else None
    if hf is not None:
        hf_generate_batch(hf, [reqs[0][0][:16]], [4])  # warm-up, untimed
    ours, theirs = [], []
    for _ in range(cfg.repeats):
        ours.append(serve_once(fresh(), reqs, math.inf, cfg.seed))
        served = [i for i, r in enumerate(ours[0].requests) if r.finish_reason != "rejected"]
        if hf is not None and served:  # the same requests ours served (a rejected one is not given to transformers)
            theirs.append(hf_generate_batch(hf, [reqs[i][0] for i in served], [reqs[i][1] for i in served]))
    tok_s = [sum(len(r.tokens) for r in x.requests) / x.wall_s for x in ours]
    result = ours[sorted(range(len(ours)), key=tok_s.__getitem__)[len(ours) // 2]]
    out = {"output_tok_s_repeats": tok_s}
    if theirs:
        out |= transformers_metrics(theirs, [result.requests[i].tokens for i in served])
        out["output_tok_s_over_hf"] = statistics.median(tok_s) / out["hf_output_tok_s"]
    return result, out


def transformers_metrics(runs: list[dict], ours: list[list[int]]) -> dict:
    """generate_batch's output tok/s (whole call, and generation alone: `gen_s`), TTFT from
    its own timestamps (median run), token identity with ours (every run)."""
    n_out = sum(len(t) for t in runs[0]["tokens"])
    walls = [n_out / g["wall_s"] for g in runs]
    mid = runs[sorted(range(len(runs)), key=walls.__getitem__)[len(runs) // 2]]
    ttft = [t for t in mid["ttft_s"] if t is not None]
    return {"hf_output_tok_s": statistics.median(walls), "hf_output_tok_s_repeats": walls,
            "hf_gen_output_tok_s": statistics.median(n_out / g["gen_s"] for g in runs),
            "hf_ttft_p50_ms": percentile(ttft, 50), "hf_ttft_p99_ms": percentile(ttft, 99),
            "hf_identical": min(sum(a == b for a, b in zip(g["tokens"], ours)) for g in runs),
            "hf_requests": len(ours)}


def alone_check(cfg: DictConfig, lm, reqs, result, backend: str) -> dict:
    """`check_alone` requests decoded alone by the static loop on the same backend: token
    identity against the engine's outputs."""
    ours = [r.tokens for r in result.requests]
    out = {}
    if cfg.check_alone:
        served = [i for i, r in enumerate(result.requests) if r.finish_reason != "rejected"][:cfg.check_alone]
        factory, ahead = factory_of(cfg, backend), getattr(decoder_of(cfg), "lookahead", 0)
        alone = [generate(lm.model, make_cache(lm.model, 1, len(reqs[i][0]) + reqs[i][1] + ahead, factory),
                          decoder_of(cfg), [reqs[i][0]], reqs[i][1]).tokens[0] for i in served]
        out.update(alone_checked=len(served), alone_identical=sum(a == ours[i] for a, i in zip(alone, served)))
    return out


def steady_itl(result) -> list[float]:
    """ITLs once every request has its first token (decode steps only, no prefill)."""
    started = [r.token_times[0] for r in result.requests if r.token_times]
    if not started:  # every request rejected: nothing decoded (report_rejections says so)
        return []
    start = max(started)
    return [b - a for r in result.requests for a, b in zip(r.token_times, r.token_times[1:]) if a >= start]


def interference_metrics(result, unloaded_itl: list[float]) -> dict:
    """ITL of the other requests while the long prompt (the last request) waits and
    prefills (from its arrival to its first token), against `unloaded_itl`: the same
    requests' decode-only ITLs served without the long prompt."""
    long = result.requests[-1]
    if not long.token_times:
        return {}
    start, end = long.arrival_s, long.token_times[0]
    during = [b - a for r in result.requests[:-1] for a, b in zip(r.token_times, r.token_times[1:])
              if a < end and b >= start]
    p = _pcts(during, "itl_during_long") | _pcts(unloaded_itl, "itl_unloaded")
    ratio = lambda q: p["itl_during_long_p99_ms"] / p[f"itl_unloaded_p{q}_ms"] if during else None  # noqa: E731
    return p | {"itl_p99_over_unloaded_p50": ratio(50), "itl_p99_over_unloaded_p99": ratio(99),
                "long_prompt_ttft_ms": 1e3 * long.ttft_s}


def interference(cfg: DictConfig, lm, reqs, backend: str, capacity: int, conditions: dict, run_id: str) -> list:
    """The synthetic requests at t = 0 and the long prompt at `interference.at_s`, served
    with chunked prefill and without, side by side, and the synthetic requests alone (the
    unloaded reference): summaries and request records."""
    times = [0.0] * (len(reqs) - 1) + [float(cfg.interference.at_s)]
    records = []
    fresh = lambda chunked=True: engine_for(OmegaConf.merge(cfg, {"chunked_prefill": chunked}), lm, backend,  # noqa: E731
                                            capacity)  # every run: an empty cache
    serve_once(fresh(), [(reqs[0][0][:16], 4)], math.inf, cfg.seed)  # warm-up, untimed
    base = steady_itl(serve_once(fresh(), reqs[:-1], math.inf, cfg.seed))
    for chunked in (True, False):
        result = serve_once(fresh(chunked), reqs, math.inf, cfg.seed, times)
        m = metrics(result, cfg.slo) | interference_metrics(result, base)
        m["long_prompt_rejected"] = result.requests[-1].finish_reason == "rejected"  # nothing measured: exit 1
        name = f"interference {backend} chunked={chunked} budget={cfg.token_budget}"
        log.info("%s: %s", name, {k: round(v, 3) if isinstance(v, float) else v for k, v in m.items()})
        rid = f"{run_id}-{backend}-{'chunked' if chunked else 'whole'}"
        setup = {"name": name, "cache": backend, "trace": "interference", "chunked_prefill": chunked,
                 "token_budget": cfg.token_budget, "long_prompt_tokens": len(reqs[-1][0])}
        records += request_records(result, backend, math.inf, rid)
        records.append(harness.summary("serve", rid, setup, m, conditions, cfg))
    return records


def capacity_of(cfg: DictConfig, lm, reqs) -> int:
    """Tokens per cache row: the longest request's prompt + output (+ the decoder's lookahead),
    at most the model's context. A request longer than that is the engine's to reject, with
    its reason; the rest are served."""
    need = max(len(p) + n for p, n in reqs) + getattr(decoder_of(cfg), "lookahead", 0)
    return min(need, lm.model.cfg.max_seq_len)


def rejections(records: list[dict]) -> list[str]:
    """The distinct reasons requests were rejected (reasons that differ only in their numbers
    are one: the first is shown), each with its count and the runs it happened in."""
    seen: dict[str, tuple[str, list]] = {}
    for r in records:
        if r.get("kind") == "prompt" and r.get("finish") == "rejected":
            seen.setdefault(re.sub(r"\d+", "#", r["error"]), (r["error"], []))[1].append(r["run"])
    return [f"{len(runs)} request(s), e.g.: {first} (runs {', '.join(sorted(set(runs)))})"
            for first, runs in seen.values()]


def report_rejections(records: list[dict]) -> int:
    """Log the distinct rejection reasons; 1 (the exit status) where a run completed no
    request, or an interference run's long prompt was rejected, with those runs named: its
    figures measure nothing."""
    empty = [r["run"] for r in records if r.get("kind") == "summary"
             and (not r["metrics"]["completed"] or r["metrics"].get("long_prompt_rejected"))]
    for reason in rejections(records):
        (log.error if empty else log.warning)("rejected: %s", reason)
    if empty:
        print(f"error: nothing measured in run(s) {', '.join(empty)} (no request completed, or the long prompt "
              "was rejected); the rejection reasons are above "
              "(raise kv_budget_mb or the model's context, or shorten the prompts)", file=sys.stderr)
    return 1 if empty else 0


def run(cfg: DictConfig, out: Path) -> int:
    check(cfg)
    lm = harness.load_model(cfg)
    reqs = trace(cfg, lm)
    capacity = capacity_of(cfg, lm, reqs)
    conditions, run_id = harness.run_conditions(lm), harness.run_id("serve")
    log.info("trace %s: %d requests, prompts %d-%d tokens, outputs %d-%d", cfg.trace, len(reqs),
             min(len(p) for p, _ in reqs), max(len(p) for p, _ in reqs), min(n for _, n in reqs),
             max(n for _, n in reqs))
    records = []
    for backend in cfg.backends:
        if cfg.trace == "interference":
            records += interference(cfg, lm, reqs, backend, capacity, conditions, run_id)
            harness.write_jsonl(out / harness.RESULTS, records)
            continue
        fresh = lambda: engine_for(cfg, lm, backend, capacity)  # noqa: E731  every run: an empty cache
        serve_once(fresh(), [(reqs[0][0][:16], 4)], math.inf, cfg.seed)  # warm-up, untimed
        alone = unloaded(fresh(), reqs[:cfg.unloaded]) if cfg.unloaded else {}
        for rate in rates_of(cfg):
            side = {}
            if math.isinf(rate):
                result, side = offline(cfg, lm, fresh, reqs, backend == cfg.backends[0])
                side |= alone_check(cfg, lm, reqs, result, backend)
            else:
                result = serve_once(fresh(), reqs, rate, cfg.seed)
            m = metrics(result, cfg.slo) | {"kv_budget_mb": result.kv_budget_bytes / 2**20} | alone | side
            setup = {"name": f"{cfg.trace} {backend} rate={rate:g}", "cache": backend, "rate": rate,
                     "trace": cfg.trace, "requests": len(reqs), "max_running": cfg.max_running,
                     "token_budget": cfg.token_budget, "policy": cfg.policy, "chunked_prefill": cfg.chunked_prefill}
            log.info("%s: %s", setup["name"], {k: round(v, 3) if isinstance(v, float) else v for k, v in m.items()})
            records += request_records(result, backend, rate, f"{run_id}-{backend}-{rate:g}")
            records += [{"kind": "timeline", "run": f"{run_id}-{backend}-{rate:g}", **t} for t in result.timeline]
            records.append(harness.summary("serve", f"{run_id}-{backend}-{rate:g}", setup, m, conditions, cfg))
            harness.write_jsonl(out / harness.RESULTS, records)  # after every run: nothing measured is lost
    print_table(records, out / harness.RESULTS)
    return report_rejections(records)


#: the columns of the table serve prints (stdout) at the end: one row per run
TABLE = ("name", "completed", "rejected", "output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "itl_p99_ms",
         "preemptions", "output_tok_s_over_hf", "alone_identical", "itl_p99_over_unloaded_p50")


def print_table(records: list[dict], path: Path) -> None:
    """One Markdown row per run (the columns of `TABLE` that any run has) on stdout, then where
    the records are."""
    from decodelab.experiments.report import markdown_table

    rows = [{"name": r["setup"]["name"], **r["metrics"]} for r in records if r.get("kind") == "summary"]
    print(markdown_table(rows, [c for c in TABLE if any(c in r for r in rows)]), end="", flush=True)
    print(f"results: {path}", flush=True)


main, cli = harness.entry_points("serve", run, check)

if __name__ == "__main__":
    cli()
