"""The report's figures: what each one shows, built from the runs (`report.load_runs`) as
`plotting` specs, then rendered and written.

- bench's generations: TTFT vs prompt length per setup (`ttft_figure`), ITL vs context per
  cache for plain decoders (`itl_figure`), KV MiB held vs context per cache with the
  formula (`kv_figure`), speculative speedup over greedy and acceptance vs gamma per
  drafter and cache, bench's and micro part=spec_gamma's (`speculative_figure`);
- agree's matrix: top-1, mean KL and max |dlogit| per setup against its thresholds
  (`agreement_figure`);
- micro part=weights: decode tok/s and TTFT over fp32 vs context per weight type
  (`weights_figure`);
- micro part=perplexity: perplexity per weights x cache setup against transformers' fp32
  (`perplexity_figure`);
- serve: latency and throughput vs request rate, KV budget in use over time (`serve_figures`).

Every caption names what a point is, its n and its spread (see `plotting`), then the run
conditions the records carry (`conditions_line`).
"""

from __future__ import annotations

import logging
import math
import statistics
from pathlib import Path

from decodelab.experiments.plotting import (FigureSpec, Panel, Point, Row, RowPanel, Series, merge_identical, n_text,
                                            point, pooled, render, save)

log = logging.getLogger("decodelab.report")

BREAK_EVEN = (1.0, "break-even (1x greedy)")


# -- captions ------------------------------------------------------------------------------
def _distinct(runs: list[dict], get) -> str:
    """The distinct non-empty values of `get(run)` over `runs`, sorted (numbers by value,
    before text), joined with ', '."""
    vals = {v for v in map(get, runs) if v not in (None, "")}
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    return ", ".join(str(v) for v in sorted(vals, key=lambda v: (0, v, "") if number(v) else (1, 0, str(v))))


def conditions_line(runs: list[dict]) -> str:
    """'Model M (dtype); hardware; T threads; torch V; git G' from the runs' setups (else
    their `config.model.name`) and the run conditions each record carries
    (`harness.run_conditions`): the hardware is the GPU
    where the runs ran on one, else the CPU; a field no run has is left out, and the
    distinct values of runs that differ are all listed."""
    cond = lambda r: r.get("conditions") or {}  # noqa: E731
    model = _distinct(runs, lambda r: (r.get("setup") or {}).get("model")
                      or ((r.get("config") or {}).get("model") or {}).get("name"))
    dtype = _distinct(runs, lambda r: cond(r).get("dtype"))
    parts = [f"Model {model}" + (f" ({dtype})" if dtype else "") if model else "",
             _distinct(runs, lambda r: cond(r).get("cuda") or cond(r).get("cpu")),
             f"{_distinct(runs, lambda r: cond(r).get('threads'))} threads" if any(
                 cond(r).get("threads") for r in runs) else "",
             f"torch {_distinct(runs, lambda r: cond(r).get('torch'))}" if any(cond(r).get("torch") for r in runs)
             else "",
             f"git {_distinct(runs, lambda r: cond(r).get('git'))}" if any(cond(r).get("git") for r in runs) else ""]
    return "; ".join(p for p in parts if p) + "."


def _config(runs: list[dict], key: str) -> int | None:
    """The runs' shared integer `config.<key>`, else None (missing or differing)."""
    vals = {(r.get("config") or {}).get(key) for r in runs}
    return vals.pop() if len(vals) == 1 and isinstance(next(iter(vals)), int) else None


# -- bench's generations -------------------------------------------------------------------
APART = ("draft", "gamma", "weights", "workload")  # setup fields that keep runs of one label apart


def _labelled(runs: list[dict], field: str, skip=lambda setup: False) -> dict[str, list[dict]]:
    """The runs not skipped per their setup's `field` (prefixed by the model when the runs
    have several), runs of one label that differ in a field of APART labelled apart by it
    ("dense/speculative gamma=4"): different setups are never pooled as if repeats."""
    multi = len({(r.get("setup") or {}).get("model") for r in runs}) > 1
    first: dict[str, list[dict]] = {}
    for r in runs:
        s = r.get("setup") or {}
        if not skip(s):
            first.setdefault(f"{s.get('model')} {s.get(field)}" if multi else str(s.get(field)), []).append(r)
    out: dict[str, list[dict]] = {}
    for label, rs in first.items():
        varying = [k for k in APART if len({str((r.get("setup") or {}).get(k)) for r in rs}) > 1]
        for r in rs:
            tags = [f"{k}={r['setup'][k]}" for k in varying if r["setup"].get(k) is not None]
            out.setdefault(" ".join([label, *tags]), []).append(r)
    return out


def _by_x(prompts: list[dict], x, y) -> list[tuple[list, list]]:
    """Atoms for `plotting.pooled`: the prompts' `y(p)` grouped by equal `x(p)` (those with
    both), e.g. the TTFTs of the prompts of one length."""
    groups: dict[float, list[float]] = {}
    for p in prompts:
        if x(p) is not None and y(p) is not None:
            groups.setdefault(x(p), []).append(y(p))
    return [([k] * len(v), v) for k, v in groups.items()]


def ttft_figure(runs: list[dict]) -> FigureSpec | None:
    """TTFT vs prompt length per setup: at each prompt length the median TTFT of that
    length's prompts, IQR where there are several (at most 20 points per setup)."""
    series = [Series(label, pooled(_by_x([p for r in rs for p in r["prompts"]], lambda p: p.get("prompt_tokens"),
                                         lambda p: p.get("ttft_ms"))))
              for label, rs in _labelled(runs, "name").items()]
    series = [s for s in series if s.points]
    if not series:
        return None
    spread = "no repeats, so no spread" if n_text(series) == "n=1 per point" else "band: IQR where n>1"
    return FigureSpec((Panel(tuple(series), "prompt tokens", "TTFT (ms)", "Time to first token vs prompt length"),),
                      f"Each point: median TTFT (tokenize + prefill + first sample) of the prompts of that length, "
                      f"{n_text(series)} ({spread}).\n{conditions_line(runs)}")


def itl_figure(runs: list[dict]) -> FigureSpec | None:
    """ITL vs context per cache, plain decoders only: per prompt (never split; at most 20
    points, neighbours pooled) the median ITL of its decode steps at their median context,
    the band their IQR."""
    labelled = _labelled(runs, "cache", skip=lambda s: s.get("needs_drafter"))
    series = [Series(label, pooled([(p.get("context") or [], p.get("itl_ms") or []) for r in rs
                                    for p in r["prompts"]]))
              for label, rs in labelled.items()]
    series = [s for s in series if s.points]
    if not series:
        return None
    return FigureSpec((Panel(tuple(series), "tokens in cache", "ITL (ms)",
                             "Inter-token latency vs context (plain decoders)"),),
                      f"Each point: the decode steps of one prompt, {n_text(series)}: median ITL at their median "
                      f"context; band: interquartile range of those steps.\n"
                      f"{conditions_line([r for rs in labelled.values() for r in rs])}")


def kv_figure(runs: list[dict]) -> FigureSpec | None:
    """KV MiB held after each prompt (prompt + new tokens) per cache, and the formula's
    bytes; caches with equal curves, and equal formula lines, are drawn once."""
    def mib(key: str):
        return lambda p: p[key] / 2**20 if p.get(key) is not None else None

    tokens = lambda p: p["prompt_tokens"] + p["new_tokens"]  # noqa: E731
    labelled = _labelled(runs, "cache")
    held, formula = [], []
    for label, rs in labelled.items():
        prompts = [p for r in rs for p in r["prompts"]]
        held.append(Series(label, pooled(_by_x(prompts, tokens, mib("kv_bytes_allocated")))))
        formula.append(Series(None, pooled(_by_x(prompts, tokens, mib("kv_bytes_formula"))), "formula"))
    series = [s for s in merge_identical(held) + merge_identical(formula) if s.points]
    if not series:
        return None
    return FigureSpec((Panel(tuple(series), "prompt + new tokens", "KV cache (MiB)", "KV cache memory vs context"),),
                      "Each point: bytes the cache holds after one prompt's generation (memory, not timed: no "
                      "spread); caches with equal bytes share one curve (a = b). Formula: 2 x layers x KV heads x "
                      f"head dim x tokens x bytes per element.\n{conditions_line(runs)}",
                      (("formula", "formula (every token, full precision)"),))


# -- speculative decoding vs gamma ---------------------------------------------------------
def _spec_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("needs_drafter") and r.get("gamma") is not None]


def _spec_label(rows: list[dict]):
    """Label of a speculative row: 'drafter / cache', then its model and entry where the
    rows have several (bench's sweeps and micro's spec_gamma are kept apart)."""
    apart = [k for k in ("model", "entry") if len({r.get(k) for r in rows}) > 1]
    return lambda r: f"{r.get('draft')} / {r.get('cache')}" + "".join(f" {r.get(k)}" for k in apart)


def speculative_series(rows: list[dict]) -> dict[str, list[tuple]]:
    """(gamma, value) per "drafter / cache measured" (speedup over greedy, side by side)
    and "... predicted" (from the run's own alpha, c_draft and c_verify), over the table
    rows of speculative runs that have them."""
    spec, out = _spec_rows(rows), {}
    label = _spec_label(spec)
    for field, suffix in (("speedup_vs_greedy", " measured"), ("predicted_this_hw", " predicted")):
        for r in spec:
            if r.get(field) is not None:
                out.setdefault(label(r) + suffix, []).append((r["gamma"], r[field]))
    return out


def prompt_speedups(prompts: list[dict]) -> list[float]:
    """Per prompt run side by side with greedy (bench's compare_greedy): greedy's decode time
    per token over the speculative one's."""
    out = []
    for p in prompts:
        g = p.get("greedy") or {}
        if g.get("decode_s") and p.get("decode_s") and g.get("new_tokens", 0) > 1 and p.get("new_tokens", 0) > 1:
            out.append((g["decode_s"] / (g["new_tokens"] - 1)) / (p["decode_s"] / (p["new_tokens"] - 1)))
    return out


def _spec_point(r: dict, run: dict, field: str, samples: list[float]) -> Point:
    """Table row `r`'s point at its gamma: the median and IQR of the run's per-prompt values
    where it has two or more (bench); else the quartiles its record carries (micro
    spec_gamma: `field_p25/_p50/_p75` over its prompts x rounds); else its own value (as in
    the table: pooled over its prompts and rounds), n=1."""
    if len(samples) > 1:
        return point(r["gamma"], samples)
    if r.get(f"{field}_p25") is not None:
        n = (_config([run], "prompts") or 0) * (_config([run], "repeats") or 0)
        return _metric_point(r["gamma"], r, field, n or None)
    return Point(float(r["gamma"]), float(r[field]))


def speculative_figure(pairs: list[tuple[dict, dict]]) -> FigureSpec | None:
    """Speedup over greedy (measured: solid; predicted: dashed) and acceptance vs gamma per
    drafter and cache, from (table row, run) of bench's and micro spec_gamma's runs; each
    point `_spec_point` of the run (prediction: the run's own); a break-even line at 1x.
    None without a measured speedup."""
    spec = [(r, run) for r, run in pairs if r.get("needs_drafter") and r.get("gamma") is not None]
    label = _spec_label([r for r, _ in spec])
    series: dict[tuple[str, str], list[Point]] = {}
    for r, run in spec:
        ps = run.get("prompts") or []
        accept = [(p.get("spec") or {}).get("acceptance_rate") for p in ps]
        for kind, field, samples in (("measured", "speedup_vs_greedy", prompt_speedups(ps)),
                                     ("predicted", "predicted_this_hw", []),
                                     ("acceptance", "acceptance_rate", [a for a in accept if a is not None])):
            if r.get(field) is not None:
                series.setdefault((label(r), kind), []).append(_spec_point(r, run, field, samples))
    if not any(kind == "measured" for _, kind in series):
        return None
    pick = lambda kinds: tuple(Series(g, tuple(pts), "dashed" if k == "predicted" else "solid")  # noqa: E731
                               for (g, k), pts in series.items() if k in kinds)
    gamma = "gamma (draft tokens per step)"
    return FigureSpec((Panel(pick(("measured", "predicted")), gamma, "speedup over greedy (x)",
                             "Speculative speedup vs gamma", (BREAK_EVEN,), xscale="linear"),
                       Panel(pick(("acceptance",)), gamma, "acceptance rate", "Acceptance vs gamma", xscale="linear",
                             yscale="linear")),
                      f"{_speculative_n(spec)}\n{conditions_line([run for _, run in spec])}",
                      (("solid", "measured"), ("dashed", "predicted from the run's alpha, c_draft, c_verify")))


def _speculative_n(spec: list[tuple[dict, dict]]) -> str:
    """The speculative figure's statistics sentence, for the sources present."""
    text = ("Speedup: greedy decode time over speculative decode time, measured side by side on the same prompts; "
            "acceptance: accepted over proposed draft tokens.")
    micro = [run for r, run in spec if r.get("entry") == "micro"]
    if micro:
        prompts, rounds = _config(micro, "prompts"), _config(micro, "repeats")
        over = f"{prompts} prompts x {rounds} round(s)" if prompts and rounds else "its prompts and rounds"
        if any(r.get("speedup_vs_greedy_p25") is not None for r, _ in spec if r.get("entry") == "micro"):
            n = f"n={prompts * rounds}" if prompts and rounds else "n unknown"
            text += (f" micro spec_gamma: median and IQR (error bar or band) of one speedup per prompt and round "
                     f"({n}: {over}); the prediction from the pooled statistics.")
        else:
            text += f" micro spec_gamma: one ratio per point, pooled over {over} (n=1 per point, no spread)."
    bench = [len(run.get("prompts") or []) for r, run in spec if r.get("entry") != "micro"]
    if bench:
        n = f"n={min(bench)}" if min(bench) == max(bench) else f"n={min(bench)}-{max(bench)}"
        text += (f" bench: median and IQR (band) of per-prompt values ({n} prompts; the table pools them); the "
                 "prediction from the run's pooled statistics.")
    return text


# -- agreement -----------------------------------------------------------------------------
AGREEMENT = (("top1", "top1", "min_top1", "top-1 agreement", "linear", "Top-1 (higher is better)"),
             ("mean_kl", "kl", "max_kl", "mean KL(reference || setup)", "log", "KL (lower is better)"),
             ("max_abs_dlogit", "max_abs_dlogit", "max_abs_dlogit", "max |logit difference|", "log",
              "Max |dlogit| (lower is better)"))


def agreement_figure(runs: list[dict]) -> FigureSpec | None:
    """decodelab-agree: top-1, mean KL and max |dlogit| against the reference per setup
    (the record's value; grey: each prompt's), each with the setup's own threshold from
    its record (`metrics.thresholds`: min_top1, max_kl, max_abs_dlogit; none drawn where
    null); a setup that failed its bars in red. None without agree runs."""
    found = [r for r in runs if (r.get("metrics") or {}).get("top1") is not None]
    if not found:
        return None
    apart = [k for k in ("model", "reference") if len({(r.get("setup") or {}).get(k) for r in found}) > 1]
    label = lambda r: " ".join([str(r["setup"].get("name")), *(str(r["setup"].get(k)) for k in apart)])  # noqa: E731
    panels = []
    for metric, per_prompt, bar, xlabel, scale, title in AGREEMENT:
        rows = [Row(label(r), r["metrics"][metric],
                    tuple(p[per_prompt] for p in r["prompts"] if p.get(per_prompt) is not None),
                    (r["metrics"].get("thresholds") or {}).get(bar), r["metrics"].get("passed", True))
                for r in found if r["metrics"].get(metric) is not None]
        if rows:
            panels.append(RowPanel(tuple(rows), xlabel, title, scale))
    return FigureSpec(tuple(panels), f"{_agreement_n(found, panels)}\n{conditions_line(found)}")


def _agreement_n(found: list[dict], panels: list[RowPanel]) -> str:
    """The agreement figure's statistics sentence."""
    ref = _distinct(found, lambda r: r["setup"].get("reference"))
    prompts = _distinct(found, lambda r: r["metrics"].get("prompts"))
    positions = _distinct(found, lambda r: r["metrics"].get("positions"))
    lengths = sorted({p["prompt_tokens"] for r in found for p in r.get("prompts") or [] if p.get("prompt_tokens")})
    span = f"{lengths[0]}-{lengths[-1]}" if len(lengths) > 1 else "".join(map(str, lengths))
    of = f" of {span} tokens" if span else ""
    text = (f"Teacher-forced against {ref}: each dot over n={positions} positions ({prompts} prompts{of}) per setup; "
            "grey: each prompt; black bar: the setup's own threshold (pass: top-1 at or above it, KL and |dlogit| "
            "at or below it), none where the setup has none.")
    if any(v == 0 for p in panels if p.xscale == "log" for r in p.rows for v in (r.value, *r.samples)):
        text += " A zero is drawn at 0 (symmetric-log axis: linear below its smallest positive decade)."
    return text


# -- micro part=weights --------------------------------------------------------------------
def _metric_point(x: float, m: dict, key: str, n: int | None) -> Point:
    """`m[key]` at x with the IQR the record carries (`key_p25`, `key_p75`), if any; where
    it also carries `key_p50` (`key` is pooled, not their median), that median instead."""
    lo, hi, med = m.get(f"{key}_p25"), m.get(f"{key}_p75"), m.get(f"{key}_p50")
    y = float(m[key] if med is None else med)
    if lo is None or hi is None:
        return Point(float(x), y, n=n or 1)
    return Point(float(x), y, float(lo), float(hi), n or 2)


def weights_figure(runs: list[dict]) -> FigureSpec | None:
    """decodelab-micro part=weights: decode tok/s per system vs context (markers, no line:
    the contexts barely change it) and TTFT over fp32's in the same round, its IQR as the
    record gives it, with fp32's level (1x) drawn. None without such runs."""
    mine = [r for r in runs if (r.get("setup") or {}).get("name") == "weights"]
    decode: dict[str, list[Point]] = {}
    ttft: dict[str, list[Point]] = {}
    n_dec = (_config(mine, "repeats") or 0) * (_config(mine, "prompts_per_context") or 0) or None
    n_ttft = (_config(mine, "ttft_rounds") or 0) * (_config(mine, "prompts_per_context") or 0) or None
    for r in mine:
        m = r.get("metrics") or {}
        system = str(m.get("system"))
        if m.get("decode_tok_s") is not None:
            decode.setdefault(system, []).append(_metric_point(m["context"], m, "decode_tok_s", n_dec))
        if m.get("ttft_vs_fp32") is not None and system != "fp32":  # fp32 is the unit
            ttft.setdefault(system, []).append(_metric_point(m["context"], m, "ttft_vs_fp32", n_ttft))
    if not decode:
        return None
    as_series = lambda d: tuple(Series(k, tuple(v), connect=False) for k, v in d.items())  # noqa: E731
    panels = (Panel(as_series(decode), "prompt tokens", "decode tok/s (batch 1)", "Decode speed per weight type",
                    dodge=True),
              Panel(as_series(ttft), "prompt tokens", "TTFT / fp32's TTFT (x)", "Time to first token relative to fp32",
                    ((1.0, "fp32 (1x)"),), dodge=True))
    return FigureSpec(panels if ttft else panels[:1], f"{_weights_n(as_series(decode), n_dec, n_ttft if ttft else 0)}"
                      f"\n{conditions_line(mine)}")


def kv_speed_figure(runs: list[dict]) -> FigureSpec | None:
    """decodelab-micro part=kv_speed: decode step time (ITL) and KV bytes vs context per
    system (cache backend, eager or compiled; transformers' QuantizedCache), log axes, the
    point's IQR as the record gives it; where a system's ITL crosses its mode's first
    backend's between two measured contexts, the crossing (log-linear interpolation) is
    marked. None without such runs."""
    import math

    mine = [r for r in runs if (r.get("setup") or {}).get("name") == "kv_speed"]
    itl: dict[str, list[Point]] = {}
    kv: dict[str, list[Point]] = {}
    n = (_config(mine, "repeats") or 0) * (_config(mine, "steps") or 0) or None  # decode steps per point
    for r in mine:
        m = r.get("metrics") or {}
        if m.get("itl_ms") is None:
            continue
        system = str(m["system"])
        itl.setdefault(system, []).append(_metric_point(m["context"], m, "itl_ms", n))
        if m.get("kv_bytes") is not None:
            kv.setdefault(system, []).append(Point(float(m["context"]), m["kv_bytes"] / 2**20))
    if not itl:
        return None
    backends = list(_config_list(mine, "backends") or [])
    crossings = []
    for mode in ("", " compiled"):
        unit = {p.x: p.y for p in itl.get(f"{backends[0]}{mode}", [])} if backends else {}
        for b in backends[1:]:
            pts = sorted((p.x, p.y / unit[p.x], p.y) for p in itl.get(f"{b}{mode}", []) if p.x in unit)
            for (x0, r0, y0), (x1, r1, y1) in zip(pts, pts[1:]):
                if (r0 - 1) * (r1 - 1) < 0:  # the ratio to the first backend crosses 1 between x0 and x1
                    f = (r0 - 1) / (r0 - r1)
                    x = math.exp(math.log(x0) + f * (math.log(x1) - math.log(x0)))
                    crossings.append(Series(f"{b}{mode} = {backends[0]}{mode} at ~{x:,.0f} tokens",
                                            (Point(x, y0 + f * (y1 - y0)),), connect=False))
    ordered = lambda d: tuple(Series(k, tuple(sorted(v, key=lambda p: p.x))) for k, v in d.items())  # noqa: E731
    panels = (Panel(ordered(itl) + tuple(crossings), "tokens in cache", "decode step (ms, batch 1)",
                    "Decode step time vs context", xscale="log", yscale="log"),
              Panel(ordered(kv), "tokens in cache", "KV cache held (MiB)", "KV bytes vs context", xscale="log",
                    yscale="log"))[:2 if kv else 1]
    return FigureSpec(panels, f"Each point: median ITL of {_config(mine, 'repeats')} x {_config(mine, 'steps')} "
                              f"decode steps (repeats x steps) after a prompt of that many "
                              f"tokens (band: IQR); the marked points: where a backend's ITL crosses its mode's "
                              f"first backend's ({backends[0] if backends else '-'}), interpolated on log x."
                              f"\n{conditions_line(mine)}")


def _config_list(runs: list[dict], key: str) -> list | None:
    """A list option of the runs' configs (the first that has it)."""
    for r in runs:
        v = (r.get("config") or {}).get(key)
        if v is not None:
            return v
    return None


def _weights_n(decode: tuple[Series, ...], n_dec: int | None, n_ttft: int | None) -> str:
    """The weights figure's statistics sentence (`n_ttft` 0: no TTFT panel; None: n unknown)."""
    spread = any(p.lo is not None for s in decode for p in s.points)
    if spread:
        dec = f"median of {n_text(decode)} decodes (repeats x prompts), error bar: IQR"
    elif n_dec == 1:
        dec = "one decode per point (n=1: repeats=1, one prompt; no spread)"
    else:
        dec = f"median of n={n_dec or '?'} decodes (repeats x prompts; quartiles not recorded)"
    ttft = "" if n_ttft == 0 else (
        "TTFT: each system's TTFT over fp32's in the same round, median and IQR over "
        f"{f'n={n_ttft} (rounds x prompts)' if n_ttft else 'its rounds x prompts'}; 'fp32 (control)' is fp32 timed "
        "again. ")
    return (f"Decode: tokens/s of a batch-1 greedy decode, {dec}; systems measured side by side, in rotated order. "
            f"{ttft}Points at one context are spread sideways for legibility.")


# -- micro part=perplexity -----------------------------------------------------------------
PPL_REFERENCE = "transformers-fp32"  # the system every row's vs_transformers_fp32 is relative to
KV_KEYS = ("nbits", "group_size", "residual")  # micro's int4 KV settings (ours and QuantizedCache)


def perplexity_figure(runs: list[dict]) -> FigureSpec | None:
    """decodelab-micro part=perplexity: one dot per system but the reference (our weights x
    cache setups, the anchors), labelled with its relative difference to transformers' fp32
    model on the same tokens (`vs_transformers_fp32`), which is the dotted reference line;
    a quantized-KV row names the KV settings that differ between the runs (KIVI's
    ablation, conf/preset/kivi-ablation.yaml). None without such runs."""
    mine = [r for r in runs if (r.get("setup") or {}).get("name") == "perplexity"
            and (r.get("metrics") or {}).get("perplexity") is not None]
    vary = [k for k in KV_KEYS if len({str((r.get("config") or {}).get(k)) for r in mine}) > 1]
    first = {s: i for i, s in reversed(list(enumerate(r["metrics"].get("system") for r in mine)))}
    rows = {}
    for r in sorted(mine, key=lambda r: (first[r["metrics"].get("system")],  # each system's settings together
                                         *(float((r.get("config") or {}).get(k) or 0) for k in vary))):
        m = r["metrics"]
        if m.get("system") != PPL_REFERENCE:
            d = m.get("vs_transformers_fp32")
            row = Row(_ppl_label(r, vary), float(m["perplexity"]), note=None if d is None else f"{100 * d:+.2g}%")
            rows.setdefault((row.label, row.value), row)  # a setup every run of a sweep repeats: once
    if not rows:
        return None
    by_sample: dict[str, list[dict]] = {}  # one panel per text sample (each has its own reference)
    for r in mine:
        by_sample.setdefault(str(r["metrics"].get("sample") or "sharegpt-replies"), []).append(r)
    panels = []
    for sample, runs_of in by_sample.items():
        labelled = {(_ppl_label(r, vary), float(r["metrics"]["perplexity"])) for r in runs_of}
        these = tuple(row for key, row in rows.items() if key in labelled)
        ref = [r["metrics"]["perplexity"] for r in runs_of if r["metrics"].get("system") == PPL_REFERENCE]
        x = statistics.median(ref) if ref else None
        line = ((x, f"transformers fp32, the reference ({x:.4g})"),) if ref else ()
        title = f"Perplexity: {SAMPLE_NAMES.get(sample, sample)}"
        panels.append(RowPanel(these, "perplexity (lower is better)", title, vlines=line, value_label="perplexity"))
    has_ref = any(r["metrics"].get("system") == PPL_REFERENCE for r in mine)
    return FigureSpec(tuple(panels), f"{_perplexity_n(mine, has_ref)}\n{conditions_line(mine)}")


#: how a perplexity sample is named in figures (experiments/perplexity.py's SAMPLES)
SAMPLE_NAMES = {"sharegpt-replies": "ShareGPT replies", "shakespeare": "Shakespeare's plays"}


def _ppl_label(run: dict, vary: list[str]) -> str:
    """'ours int8 weights, int4 KV', or an anchor's system name; a quantized-KV row adds
    the settings of `vary` (group_size=32 ...)."""
    m, cfg = run["metrics"], run.get("config") or {}
    system, cache = str(m.get("system")), str(m.get("cache"))
    label = (f"ours {m.get('weights')} weights, {cache} KV" if system.startswith("ours-")
             else system.replace("transformers-quanto-", "transformers + quanto ").replace("-", " "))
    kv = cache == "int4" or cache.startswith("QuantizedCache")
    return label + "".join(f" {k}={cfg.get(k)}" for k in vary if kv)


def _perplexity_n(mine: list[dict], has_ref: bool) -> str:
    """The perplexity figure's sentence: the sample, the windows, the KV settings, the reference."""
    metric = lambda key: _distinct(mine, lambda r: r["metrics"].get(key))  # noqa: E731
    config = lambda key: _distinct(mine, lambda r: (r.get("config") or {}).get(key))  # noqa: E731
    ref = ("Dotted line: transformers' fp32 model on the same tokens, the reference; beside each dot: its "
           "relative difference to it. " if has_ref else "No transformers reference in these runs. ")
    samples = ", ".join(SAMPLE_NAMES.get(str(x), str(x)) for x in
                        dict.fromkeys(r["metrics"].get("sample") or "sharegpt-replies" for r in mine))
    return (f"Perplexity, exp(mean NLL), over n={metric('tokens')} scored tokens of each held-out sample ({samples}; "
            f"the same tokens for every setup), windows of {metric('context')} tokens every {metric('stride')}, fed "
            f"{metric('chunk')} tokens per forward through each cache; int4 KV at {config('nbits')} bits, group "
            f"{config('group_size')}, residual {config('residual')}. {ref}Computed, not timed: one value per setup.")


# -- serve ---------------------------------------------------------------------------------
def _by_rate(runs: list[dict], metric: str, style: str = "solid") -> tuple[Series, ...]:
    """`metrics[metric]` vs the finite request rate, per cache backend and trace."""
    pts: dict[str, list[Point]] = {}
    for r in runs:
        s, m = r.get("setup") or {}, r.get("metrics") or {}
        if s.get("rate") is not None and math.isfinite(s["rate"]) and m.get(metric) is not None:
            pts.setdefault(f"{s.get('cache')} {s.get('trace')}", []).append(
                Point(s["rate"], m[metric], n=m.get("completed") or 1))
    return tuple(Series(k, tuple(v), style) for k, v in pts.items())


def _kv_in_use(runs: list[dict]) -> tuple[Series, ...]:
    """Per serve run with a timeline and a KV budget: KV bytes over the budget vs seconds."""
    return tuple(Series(str((r.get("setup") or {}).get("name")),
                        tuple(Point(t["t"], t["kv_bytes"] / 2**20 / r["metrics"]["kv_budget_mb"])
                              for t in r["timeline"]))
                 for r in runs if r.get("timeline") and (r.get("metrics") or {}).get("kv_budget_mb"))


def serve_figures(runs: list[dict]) -> dict[str, FigureSpec]:
    """decodelab-serve: p50 (solid) and p99 (dashed) TTFT and TPOT vs request rate, output
    tok/s and goodput vs rate, per cache backend and trace (finite rates); KV budget in use
    over time per run; only the figures with data."""
    def pcts(name: str) -> tuple[Series, ...]:
        return _by_rate(runs, f"{name}_p50_ms") + _by_rate(runs, f"{name}_p99_ms", "dashed")

    completed = _distinct(runs, lambda r: (r.get("metrics") or {}).get("completed"))
    cap = (f"Each point: one serve run at that request rate; percentiles over its n={completed} completed requests."
           f"\n{conditions_line(runs)}")
    specs = {"serve_latency_vs_rate": FigureSpec(
                 (Panel(pcts("ttft"), "requests/s", "TTFT (ms)", "Time to first token vs rate"),
                  Panel(pcts("tpot"), "requests/s", "TPOT (ms)", "Time per output token vs rate")),
                 cap, (("solid", "p50"), ("dashed", "p99"))),
             "serve_throughput_vs_rate": FigureSpec(
                 (Panel(_by_rate(runs, "output_tok_s"), "requests/s", "output tok/s", "Throughput vs rate"),
                  Panel(_by_rate(runs, "goodput_req_s"), "requests/s", "requests/s within the SLO",
                        "Goodput vs rate")), cap),
             "serve_kv_utilization": FigureSpec(
                 (Panel(_kv_in_use(runs), "seconds", "KV bytes / budget", "KV budget in use over time",
                        xscale="linear", yscale="linear", markers=False),),
                 "One line per serve run: the engine's KV bytes over its budget at each step.\n"
                 f"{conditions_line(runs)}")}
    return {k: v for k, v in specs.items() if any(s.points for p in v.panels for s in p.series)}


# -- writing -------------------------------------------------------------------------------
def write(specs: dict[str, FigureSpec | None], out: Path, formats=("png",)) -> dict[str, Path]:
    """Render and save each spec with data as `out/<stem>.png` (plus each vector format of
    `formats`); a None spec is skipped (logged). {stem: PNG path, "stem.fmt": vector path}."""
    paths = {}
    for stem, spec in specs.items():
        if spec is None:
            log.info("skipped %s.png: no data for it", stem)
            continue
        written = save(render(spec), out / stem, formats)
        paths[stem] = written.pop("png")
        paths.update({f"{stem}.{fmt}": p for fmt, p in written.items()})
    return paths


def write_figures(runs: list[dict], rows: list[dict], out: Path, formats=("png",)) -> dict[str, Path]:
    """Every figure the runs have data for (see the module docstring), `rows` their table
    rows (`report.table_rows`, in any order); returns what `write` wrote."""
    by_run = {r.get("run"): r for r in runs}
    bench = [r for r in runs if r.get("entry", "bench") == "bench"]  # the generation plots
    spec_pairs = [(row, by_run.get(row.get("run"), {})) for row in rows
                  if row["entry"] == "bench" or (row["entry"] == "micro" and row["name"] == "spec_gamma")]
    speculative = speculative_figure(spec_pairs)
    specs = {"ttft_vs_prompt_len": ttft_figure(bench), "itl_vs_context": itl_figure(bench),
             "kv_mib_vs_context": kv_figure(bench), "speculative_vs_gamma": speculative,
             "agreement": agreement_figure([r for r in runs if r.get("entry") == "agree"]),
             "weights_decode_vs_context": weights_figure([r for r in runs if r.get("entry") == "micro"]),
             "kv_speed_vs_context": kv_speed_figure([r for r in runs if r.get("entry") == "micro"]),
             "perplexity": perplexity_figure([r for r in runs if r.get("entry") == "micro"])}
    if speculative is None and _spec_rows([r for r, _ in spec_pairs]):
        specs.pop("speculative_vs_gamma")
        log.info("skipped speculative_vs_gamma.png: no speculative run measured its speedup over greedy "
                 "side by side (bench's compare_greedy=true)")
    serve = [r for r in runs if r.get("entry") == "serve"]
    return write({**specs, **(serve_figures(serve) if serve else {})}, out, formats)
