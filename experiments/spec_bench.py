"""Speculative decoding benchmark: for each drafter and gamma, the measured speedup
over plain greedy decoding on the same prompts, alpha, tokens per target call, the
speedup Leviathan's formula predicts, and the implementation efficiency
(measured / predicted). Greedy speculative output is also checked token for token.

    python -m decodelab.experiments.spec_bench [part=speed] [prompts=5] [new_tokens=128] [gammas=[2,4,8]]
        [drafts=[prompt-lookup,early-exit]]
    python -m decodelab.experiments.spec_bench part=lossless prompts=20 new_tokens=64 gammas=[4]
    python -m decodelab.experiments.spec_bench part=verify_cost [tokens=[1,2,3,5,9]] [impls=[reference,onednn]]

Speedup = sum over prompts of plain decode time / sum of speculative decode time
(decode time: first to last generated token). Runs alternate plain and speculative
per prompt; every figure is printed with the run conditions.

`part=verify_cost` times one target forward of T tokens after the first prompt (what a
verify call over gamma = T - 1 drafts costs) for each `models.matmul` impl, as a ratio to
T = 1 under the same impl; impls alternate per T, medians over `repeats`.

Costs are measured in this run in units of one plain greedy decode step: c_draft (one
draft step) and c_verify (one target call over gamma + 1 tokens). Leviathan's formula
assumes c_verify = 1 (true on a GPU); on a CPU a (gamma + 1)-token forward costs more, so
the table gives both predictions, and efficiency = measured / the prediction with the
measured c_verify (what the implementation loses to its own overheads);
efficiency_vs_leviathan = measured / Leviathan's.
"""

from __future__ import annotations

import statistics
import time

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from decodelab.decoding.decoders import greedy
from decodelab.decoding.generate import generate
from decodelab.decoding.speculative import SpeculativeDecoder, predicted_speedups
from decodelab.decoding.text import make_cache
from decodelab.experiments.common import git_rev, print_table, write_results
from decodelab.experiments.workloads import sharegpt
from decodelab.models.errors import SetupError
from decodelab.models.loading import CONF_DIR, instantiate_unwrapped
from decodelab.models.matmul import impl_problems


def decode_seconds(r) -> float:
    t = r.token_times[0]
    return t[-1] - t[0]


def run(model, decoder, ids: list[int], new_tokens: int):
    cache = make_cache(model, 1, len(ids) + new_tokens + decoder.lookahead)
    return generate(model, cache, decoder, [ids], new_tokens)


def bench_setting(lm, drafter, gamma: int, prompts: list[list[int]], cfg, plain: dict) -> dict:
    spec_s, plain_s, plain_steps, identical, stats = 0.0, 0.0, 0, 0, []
    for i, ids in enumerate(prompts):
        r = run(lm.model, SpeculativeDecoder(drafter, gamma=gamma), ids, cfg.new_tokens)
        p = plain[i] if i in plain else run(lm.model, greedy(), ids, cfg.new_tokens)
        plain[i] = p
        spec_s += decode_seconds(r)
        plain_s += decode_seconds(p)
        plain_steps += len(p.tokens[0]) - 1
        identical += r.tokens == p.tokens
        stats.append(r.stats)
    pred = predicted_speedups(stats, plain_s / plain_steps)  # costs in plain decode steps, this run
    measured = plain_s / spec_s
    return {"draft": repr(drafter), "gamma": gamma, "alpha": pred["alpha"],
            "tokens_per_call": statistics.mean(s["tokens_per_target_call"] for s in stats),
            "c_draft": pred["c_draft"], "c_verify": pred["c_verify"],
            "predicted_leviathan": pred["predicted_leviathan"], "predicted_this_hw": pred["predicted_this_hw"],
            "measured_speedup": measured, "efficiency": measured / pred["predicted_this_hw"],
            "efficiency_vs_leviathan": measured / pred["predicted_leviathan"],
            "identical_prompts": f"{identical}/{len(prompts)}"}


def drafter_for(cfg, name: str, lm, cache=None):
    from hydra import compose  # conf/draft/<name>.yaml with its defaults list (draft=model holds a model)

    spec = OmegaConf.merge(compose(config_name="config", overrides=["decoder=speculative", f"draft={name}"]).draft,
                           cfg.draft_options.get(name, {}))
    kw = {"cache": cache} if cache is not None else {}
    return instantiate_unwrapped(spec)(target=lm, **kw)


def speed(cfg, lm, prompts) -> list[dict]:
    rows, plain = [], {}
    for name in cfg.drafts:
        drafter = drafter_for(cfg, name, lm)
        for gamma in cfg.gammas:
            rows.append(bench_setting(lm, drafter, gamma, prompts, cfg, plain))
            print_table(rows[-1:])
    return rows


def forward_ms(model, cache, T: int, repeats: int) -> float:
    """Median ms of one forward of T tokens after what `cache` holds (rolled back after each)."""
    L = cache.lengths.clone()
    ids = torch.full((1, T), 5, dtype=torch.long, device=model.device)
    positions = (L[:, None] + torch.arange(T)[None]).to(model.device)
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    times = []
    with torch.no_grad():
        for i in range(repeats + 1):  # the first is a warm-up (it may pack weights)
            sync()
            t0 = time.perf_counter()
            model(ids, positions, cache)
            sync()
            times.append(time.perf_counter() - t0)
            cache.truncate(L)
    return 1e3 * statistics.median(times[1:])


def verify_cost(cfg, lm, prompts) -> list[dict]:
    """Forward of T tokens vs one token, per matmul impl, at the first prompt's context."""
    from decodelab.decoding.prefill import prefill

    model, rows, one = lm.model, [], {}
    cache = make_cache(model, 1, len(prompts[0]) + max(cfg.tokens))
    prefill(model, cache, prompts[:1])
    for T in [1] + [t for t in cfg.tokens if t != 1]:  # T = 1 first: the unit
        for impl in cfg.impls:
            model.set_matmul(impl)
            ms = forward_ms(model, cache, T, cfg.repeats)
            one.setdefault(impl, ms)
            rows.append({"matmul": impl, "tokens": T, "context": len(prompts[0]), "ms": ms,
                         "cost_vs_1_token": ms / one[impl]})
            print_table(rows[-1:])
    model.set_matmul(cfg.model.get("matmul", "auto"))
    return rows


def lossless(cfg, lm, prompts) -> list[dict]:
    """Greedy speculative vs plain greedy, token for token, on every cache backend
    (target and draft caches of that backend) and drafter: the share of identical prompts."""
    from decodelab.experiments.kv_bench import backend

    rows = []
    for cache_name in cfg.backends:
        factory = backend(cache_name, **cfg.backend_options.get(cache_name, {}))
        plain = [generate(lm.model, make_cache(lm.model, 1, len(p) + cfg.new_tokens, factory), greedy(), [p],
                          cfg.new_tokens).tokens for p in prompts]
        for name in cfg.drafts:
            drafter = drafter_for(cfg, name, lm, factory)
            same = 0
            for p, ref in zip(prompts, plain):
                dec = SpeculativeDecoder(drafter, gamma=cfg.gammas[0])
                cache = make_cache(lm.model, 1, len(p) + cfg.new_tokens + dec.lookahead, factory)
                same += generate(lm.model, cache, dec, [p], cfg.new_tokens).tokens == ref
            rows.append({"cache": cache_name, "draft": repr(drafter), "gamma": cfg.gammas[0],
                         "identical_prompts": same, "prompts": len(prompts)})
            print_table(rows[-1:])
    return rows


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="spec_bench")
def main(cfg: DictConfig) -> None:
    parts = {"speed": speed, "lossless": lossless, "verify_cost": verify_cost}
    reasons = [] if cfg.part in parts else [f"part must be one of {list(parts)}, got {cfg.part!r}"]
    if cfg.part == "verify_cost":
        reasons += [r for impl in cfg.impls for r in impl_problems(impl, key="impls[]")]
    if reasons:
        raise SetupError(reasons)  # before the model loads
    git_rev()  # the code this run starts with
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    lm = instantiate_unwrapped(cfg.model)
    tok = lm.tokenizer
    reqs = sharegpt(cfg.prompts, seed=cfg.seed, tokenizer=tok, max_prompt_tokens=cfg.max_prompt_tokens)
    prompts = [tok.encode(r.prompt, chat=True) for r in reqs]
    run(lm.model, greedy(), prompts[0][:16], 4)  # warm-up
    rows = parts[cfg.part](cfg, lm, prompts)
    print(f"model={lm.name} prompts={len(prompts)} new_tokens={cfg.new_tokens} (ShareGPT, chat template)")
    write_results(f"spec_bench-{cfg.part}", cfg, rows, lm.model)


if __name__ == "__main__":
    main()
