"""The agreement matrix: every named setup (conf/setup/) against a reference, per prompt.

    decodelab-agree [setups=[dense,paged,int4]] [reference=dense|transformers] [workload=...]
        [forced_tokens=64] [free_tokens=32] [agreement.max_kl=0.01] [++cache.block_size=8]

Per prompt, the reference (dense in one pass, or transformers' own model) gives the logits
of the prompt + its reply (else the reference's greedy continuation); each setup is
teacher-forced over it as its decoder feeds its cache (decoding.agreement.setup_logits),
then decodes `free_tokens` freely: where it first leaves the reference's greedy output.
Each setup is judged by its `agreement:` thresholds. Exit 0: all pass; 1: some setup
exceeds one; 2: a bad config, every reason, before weights load. An option only some
setups have is given as ++key=value and reaches those.
"""

from __future__ import annotations

import logging
import sys
from functools import partial
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from decodelab.cache.dense import DenseCache
from decodelab.decoding.agreement import (Thresholds, compare, dense_logits, first_diff, hf_greedy, hf_logits, pool,
                                          setup_logits)
from decodelab.decoding.decoders import greedy
from decodelab.decoding.generate import generate
from decodelab.decoding.text import make_cache
from decodelab.experiments import harness
from decodelab.experiments.cli import has_key
from decodelab.models.errors import SetupError, raise_if
from decodelab.models.loading import CONF_DIR, instantiate_unwrapped
from decodelab.models.quantize import WeightOptions
from decodelab.models.reference import hf_model_for

log = logging.getLogger("decodelab.agree")

OWN_KEYS = ("setups", "reference", "forced_tokens", "free_tokens")  # agree's options, not passed to setups
REFERENCES = ("dense", "transformers")
FIXED_BY_SETUP = ("cache", "decoder", "setup", "experiment")  # groups a setup chooses (not the command line)


# -- configs, all checked before weights load ---------------------------------------------
def option_problems(cfg: DictConfig) -> list[str]:
    """agree's own options: setups, reference, forced_tokens, free_tokens."""
    p, names, known = [], cfg.setups, harness.group_options("setup")
    if not OmegaConf.is_list(names) or not names or not all(isinstance(n, str) for n in names):
        p.append(f"setups must be a non-empty list of setup names, got {names!r}; known: {known}")
    else:
        if unknown := [n for n in names if n not in known]:
            p.append(f"unknown setup(s) {unknown}: each needs a conf/setup/<name>.yaml; known: {known}")
        if len(set(names)) != len(names):
            p.append(f"setups lists a name twice: {list(names)}")
    if cfg.reference not in REFERENCES:
        p.append(f"reference must be one of {list(REFERENCES)}, got {cfg.reference!r}")
    return p + harness.int_problems(cfg, {"forced_tokens": 1, "free_tokens": 0}) + harness.run_option_problems(cfg)


def threshold_problems(agreement) -> list[str]:
    """A setup's `agreement:` block: known keys (decoding.agreement.Thresholds), each in range."""
    known = list(Thresholds.__dataclass_fields__)
    if not OmegaConf.is_dict(agreement):
        return [f"agreement must be a mapping of {known}, got {agreement!r}"]
    unknown = [f"agreement.{k} is not a threshold; known: {known}" for k in agreement if k not in known]
    return unknown or Thresholds(**OmegaConf.to_container(agreement)).problems()


def split_overrides(overrides: list[str]) -> tuple[list[str], list, list[str]]:
    """The command line's overrides for the setups: group selections (model=, workload=,
    draft=), given to every setup's composition; option values (key=value, +key=value,
    ++key=value), applied to every setup that has that key; and the problems (a cache=
    or decoder= selection would replace what each setup chooses). agree's own options
    are not passed on."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    groups, values, p = [], [], []
    for o in OverridesParser.create().parse_overrides(list(overrides)):
        key = o.key_or_group
        if key.split(".")[0] in OWN_KEYS:
            continue
        if "." not in key and (CONF_DIR / key).is_dir():
            if key in FIXED_BY_SETUP:
                p.append(f"{o.input_line}: each setup chooses its own {key}; pick setups with setups=[...] "
                         f"(an option of a setup's {key}: ++{key}.OPTION=VALUE)")
            else:
                groups.append(o.input_line)
        elif o.is_delete():
            p.append(f"{o.input_line}: deleting keys is not supported by agree")
        else:
            values.append(o)
    return groups, values, p


def compose_setup(name: str, groups: list[str], values: list = ()) -> DictConfig:
    """config.yaml + setup=<name> + group selections (Hydra's compose API), then each
    option value whose key this setup has."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    args = [f"setup={name}", *groups]
    if GlobalHydra.instance().is_initialized():  # inside @hydra.main: its search path is CONF_DIR
        scfg = compose(config_name="config", overrides=args)
    else:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            scfg = compose(config_name="config", overrides=args)
    for o in values:
        if has_key(scfg, o.key_or_group):
            OmegaConf.update(scfg, o.key_or_group, o.value(), merge=False)
    return scfg


def _setup_problems(name: str, groups: list[str], values: list) -> tuple[DictConfig | None, list[str]]:
    """One setup composed and checked (decoder, cache, rollback, thresholds); its problems."""
    try:
        scfg = compose_setup(name, groups, values)
    except Exception as e:  # Hydra's composition errors
        return None, [f"setup {name}: {type(e).__name__}: {e}".replace("\n", " ")]
    p = threshold_problems(scfg.get("agreement"))
    harness.collect(p, lambda: harness.check(scfg))
    return scfg, [f"setup {name}: {r}" for r in p]


def check_all(cfg: DictConfig, overrides: list[str]) -> dict[str, DictConfig]:
    """Every setup's config, composed and validated, with agree's options and the
    workload; one SetupError with every reason of every setup (no weights load)."""
    reasons = option_problems(cfg)
    harness.collect(reasons, lambda: instantiate_unwrapped(cfg.workload))
    groups, values, p = split_overrides(overrides)
    reasons += p
    listed = cfg.setups if OmegaConf.is_list(cfg.setups) else []
    known = [n for n in listed if n in harness.group_options("setup")]
    composed = {}
    for name in dict.fromkeys(known):
        composed[name], p = _setup_problems(name, groups, values)
        reasons += p
    own_weights = [n for n in composed if _sets_weights(n)]
    for line, field in _weight_overrides(groups, values) if own_weights else ():
        # the command line's weight options would replace what those setups quantize
        setting = [n for n in own_weights if _sets_weights(n, field)]
        if field in HOW_FIELDS and not setting:
            continue  # how those setups' weights compute, which they leave open (the reference is not quantized)
        reasons.append(f"{line}: setups {setting or own_weights} choose their own weights, which this would "
                       "replace" + ("" if field in HOW_FIELDS else " (and it would quantize the reference too)")
                       + "; drop it, or leave those setups out")
    for o in values:  # a plain key=value Hydra has already matched against agree's own groups
        added = o.is_add() or o.is_force_add()
        if added and known and not any(has_key(c, o.key_or_group) for c in composed.values()):
            reasons.append(f"{o.input_line}: no chosen setup has the option {o.key_or_group}")
    raise_if(reasons)
    return composed


def build_all(composed: dict[str, DictConfig], lm) -> dict[str, tuple]:
    """name -> (cache factory, decoder) for the loaded model; problems only the model
    reveals (e.g. a draft deeper than the target) reported for all setups together."""
    built, reasons = {}, []
    for name, scfg in composed.items():
        try:
            built[name] = harness.build(scfg, lm)
        except SetupError as e:
            reasons += [f"setup {name}: {r}" for r in e.reasons]
    raise_if(reasons)
    return built


#: the fields of the target's weights (`model.weights`, models.quantize.WeightOptions) that say
#: how the quantized weights compute, not what they are: the command line may set them for
#: the setups that leave them open
HOW_FIELDS = ("kernel", "prefill_dtype")


def _weight_overrides(groups: list[str], values: list) -> list[tuple[str, str | None]]:
    """(override, the `model.weights` field it sets; None: all of them) of each override of
    the target's weights on the command line: `weights=<preset>` (conf/weights/),
    `model.weights=...`, `model.weights.FIELD=...`."""
    out = [(g, None) for g in groups if g.partition("=")[0].lstrip("+~") == "weights"
           and g.partition("=")[2] not in ("null", "")]
    for o in values:
        key = o.key_or_group
        if key == "model.weights" or key.startswith("model.weights."):
            out.append((o.input_line, key.removeprefix("model.weights").removeprefix(".") or None))
    return out


def _weights_of(model_cfg) -> WeightOptions:
    return WeightOptions.of(model_cfg.get("weights"))


def _sets_weights(name: str, field: str | None = None) -> bool:
    """Whether conf/setup/<name>.yaml sets weight options of its own (int8-weights, ...);
    with `field`, that field of `model.weights`."""
    weights = (OmegaConf.load(CONF_DIR / "setup" / f"{name}.yaml").get("model") or {}).get("weights")
    return weights is not None and (field is None or not OmegaConf.is_dict(weights) or field in weights)


def setup_models(cfg: DictConfig, composed: dict[str, DictConfig], lm) -> dict:
    """name -> the setup's target: the loaded model, or, for a setup whose weight options
    differ from the loaded model's (a quantized-weights setup), a copy quantized as it
    asks (one copy per distinct options); the reference stays the loaded model."""
    base, copies, out = _weights_of(cfg.model), {}, {}
    for name, scfg in composed.items():
        w = _weights_of(scfg.model)
        if w == base:
            out[name] = lm.model
            continue
        if w not in copies:  # one copy per distinct options (a WeightOptions is hashable)
            copies[w] = w.apply(lm.model)
        out[name] = copies[w]
    return out


# -- the reference ------------------------------------------------------------------------
def free_run(model, factory, decoder, prompt: list[int], n: int) -> tuple[list[int], dict]:
    """`n` tokens (EOS ignored) of a setup's own decoding, and its decoder statistics."""
    cache = make_cache(model, 1, len(prompt) + n + decoder.lookahead, factory)
    r = generate(model, cache, decoder, [prompt], n)
    return r.tokens[0], r.stats


def reference_fns(kind: str, lm):
    """(logits(prompt, seq) -> [N, V], greedy(prompt, n) -> ids) of the reference."""
    if kind == "transformers":
        hf = hf_model_for(lm)
        return partial(hf_logits, hf), partial(hf_greedy, hf)
    return partial(dense_logits, lm.model), lambda p, n: free_run(lm.model, DenseCache, greedy(), p, n)[0]


def prompt_ids(req, lm) -> list[int]:
    return list(req.ids) if req.ids is not None else req.encode(lm.tokenizer)


def reply_ids(req, lm, n: int) -> list[int]:
    """The first `n` ids of the workload's reply (no special tokens); [] without one."""
    if not req.reference:
        return []
    return list(lm.tokenizer.hf.encode(req.reference, add_special_tokens=False))[:n]


# -- one setup on one sequence ------------------------------------------------------------
def measure(model, built: tuple, prompt: list[int], seq: list[int], ref_logits, ref_free: list[int]) -> dict:
    """One setup on one prompt: teacher-forced agreement and the free-running first diff."""
    factory, decoder = built
    row = compare(ref_logits, setup_logits(model, factory, decoder, prompt, seq))  # [N, V] each
    row["first_diff"], row["decoder_stats"] = None, {}
    if ref_free:
        toks, stats = free_run(model, factory, decoder, prompt, len(ref_free))
        row["first_diff"], row["decoder_stats"] = first_diff(toks, ref_free), stats
    return row


# -- the matrix ---------------------------------------------------------------------------
def summarize(name: str, scfg: DictConfig, decoder, per_prompt: list[dict], free_tokens: int) -> dict:
    """A setup's row: its prompts pooled (decoding.agreement.pool) and judged by its thresholds."""
    sampled = float(scfg.decoder.get("temperature", 0.0) or 0.0) > 0
    row = {"setup": name, "cache": OmegaConf.to_container(scfg.cache), "decoder": repr(decoder), **pool(per_prompt),
           "free_tokens": free_tokens, "sampled": sampled, "thresholds": OmegaConf.to_container(scfg.agreement)}
    row["failures"] = Thresholds(**row["thresholds"]).failures(row, judge_free=free_tokens > 0 and not sampled)
    row["passed"] = not row["failures"]
    return row


def _first_diff_cell(r: dict) -> str:
    if not r["free_tokens"]:
        return "n/a"
    cell = "none" if r["first_diff"] is None else f"{r['first_diff']} ({r['prompts_differing']}/{r['prompts']})"
    return cell + (" sampled" if r["sampled"] else "")


def _thresholds_cell(t: dict) -> str:
    parts = [f"{label}{t[k]:.0e}" for k, label in (("max_abs_dlogit", "dl<="), ("max_kl", "KL<="))
             if t.get(k) is not None]
    parts += [f"top1>={t['min_top1']:g}"] if t.get("min_top1") is not None else []
    parts += ["same"] if t.get("free_identical") else []
    return " ".join(parts) or "none"


def markdown(rows: list[dict]) -> str:
    """The matrix as a Markdown table: one row per setup."""
    head = "| setup | max abs dlogit | mean KL | top1 | first diff | thresholds | result |\n" + "|---" * 7 + "|\n"
    return head + "".join(
        f"| {r['setup']} | {r['max_abs_dlogit']:.2e} | {r['mean_kl']:.2e} | {r['top1']:.4f} | "
        f"{_first_diff_cell(r)} | {_thresholds_cell(r['thresholds'])} | {'PASS' if r['passed'] else 'FAIL'} |\n"
        for r in rows)


def records(header: dict, rows: list[dict], per_prompt: dict, run_id: str) -> list[dict]:
    """The results schema: per setup its prompt lines and one summary (a matrix row)."""
    out = []
    for r in rows:
        run = f"{run_id}-{r['setup']}"
        out += [{"kind": "prompt", "run": run, **p} for p in per_prompt[r["setup"]]]
        setup = {"name": r["setup"], "model": header["model"], "reference": header["reference"],
                 "workload": header["workload"], "cache": r["cache"].get("_target_"), "decoder": r["decoder"]}
        metrics = {k: v for k, v in r.items() if k not in ("setup", "cache", "decoder")}
        out.append(harness.summary("agree", run, setup, metrics, header["conditions"], header["config"]))
    return out


def write_outputs(out_dir: Path, header: dict, rows: list[dict], per_prompt: dict) -> list[Path]:
    """results.jsonl (every setup, per prompt too) and agree.md (the matrix) in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md = f"# Agreement matrix\n\n{_header_line(header)}\n\n{markdown(rows)}"
    (out_dir / "agree.md").write_text(md)
    recs = records(header, rows, per_prompt, harness.run_id("agree"))
    return [harness.write_jsonl(out_dir / harness.RESULTS, recs), out_dir / "agree.md"]


def _header_line(h: dict) -> str:
    return (f"model {h['model']} | reference {h['reference']} | {h['prompts']} prompts ({h['workload']}) | "
            f"teacher-forced {h['forced_tokens']} tokens per prompt (at most) | free-running {h['free_tokens']}")


# -- the run ------------------------------------------------------------------------------
def run_matrix(cfg: DictConfig, composed: dict[str, DictConfig], lm, built: dict) -> tuple[list[dict], dict]:
    """Every setup on every prompt; the reference's logits and greedy output are
    computed once per prompt and shared by all setups."""
    ref_logits_fn, ref_greedy = reference_fns(cfg.reference, lm)
    models = setup_models(cfg, composed, lm)
    reqs = instantiate_unwrapped(cfg.workload)(lm)
    per_prompt = {name: [] for name in composed}
    for i, req in enumerate(reqs):
        prompt = prompt_ids(req, lm)
        seq = reply_ids(req, lm, cfg.forced_tokens)
        teacher = "reply" if seq else "greedy"
        need = max(cfg.free_tokens, 0 if seq else cfg.forced_tokens)
        cont = ref_greedy(prompt, need) if need else []
        seq = seq or cont[: cfg.forced_tokens]
        ref_logits = ref_logits_fn(prompt, seq)  # [N, V]
        for name in composed:
            r = measure(models[name], built[name], prompt, seq, ref_logits, cont[: cfg.free_tokens])
            per_prompt[name].append({"id": req.id, "prompt_tokens": len(prompt), "teacher": teacher, **r})
        log.info("prompt %d/%d (%d tokens, %d forced) done", i + 1, len(reqs), len(prompt), len(seq))
    rows = [summarize(name, composed[name], built[name][1], per_prompt[name], cfg.free_tokens) for name in composed]
    return rows, per_prompt


def run(cfg: DictConfig, overrides: list[str], out_dir: str | Path | None = None) -> int:
    """Check every setup, load the model once, print and write the matrix; the exit code
    (0 all within thresholds, 1 some setup exceeds one, 2 a bad config)."""
    try:
        composed = check_all(cfg, overrides)  # before any weights load
        lm = harness.load_model(cfg)
        built = build_all(composed, lm)
        rows, per_prompt = run_matrix(cfg, composed, lm, built)
    except SetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    header = {"model": lm.name, "reference": cfg.reference, "workload": cfg.workload._target_.rsplit(".", 1)[-1],
              "prompts": rows[0]["prompts"], "forced_tokens": cfg.forced_tokens, "free_tokens": cfg.free_tokens,
              "conditions": harness.run_conditions(lm), "config": OmegaConf.to_container(cfg)}
    print(_header_line(header))
    print(markdown(rows), end="")
    for r in rows:
        for f in r["failures"]:
            print(f"FAIL {r['setup']}: {f}")
    if out_dir is not None:
        for p in write_outputs(Path(out_dir), header, rows, per_prompt):
            print(f"wrote {p}")
    return 0 if all(r["passed"] for r in rows) else 1


def _cli_overrides() -> list[str]:
    """The setups' overrides of the command line as the console script checks them (unknown
    group options left out: experiments.cli reports them)."""
    from decodelab.experiments.cli import split_choices

    return [a for a in split_choices(sys.argv[1:])[1] if not a.startswith(("-", "hydra"))]


def _hydra_overrides() -> list[str]:
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task)


main, cli = harness.entry_points("agree", lambda cfg, out: run(cfg, _hydra_overrides(), out),
                                 lambda cfg: check_all(cfg, _cli_overrides()))


if __name__ == "__main__":
    cli()
