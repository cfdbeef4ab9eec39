"""Generation CLI: stream a reply, then print TTFT, ITL, tokens/s and KV-cache bytes.

    python -m decodelab.experiments.generate prompt="Hello" [model=smollm2-135m] [cache=dense]
        [decoder=greedy|sampling] [decoder.temperature=0.7] [max_new_tokens=64]
        [chat_template=true|false] [prompt_file=PATH] [stop='[".\\n"]'] [json=true]
    echo "Hello" | python -m decodelab.experiments.generate > reply.txt

Unix habits: stdout carries the generated text and nothing else (streamed as it comes);
logs and the timing summary go to stderr; a plain call writes no files (no outputs/
run directory). With `json=true`, stdout holds one JSON record instead (see `record`).
Everything that can be checked before the weights load is checked first.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

from omegaconf import DictConfig

from decodelab.decoding.generate import generate
from decodelab.decoding.text import make_cache
from decodelab.experiments import harness
from decodelab.models.errors import SetupError, raise_if

log = logging.getLogger("decodelab.generate")

def read_prompt(cfg: DictConfig) -> str:
    """The prompt from `prompt=`, `prompt_file=`, or standard input (`prompt=-` or piped)."""
    if cfg.prompt is not None and cfg.prompt_file is not None:
        raise SetupError("give either prompt= or prompt_file=, not both")
    if cfg.prompt_file is not None:
        path = Path(cfg.prompt_file)
        if not path.is_file():
            raise SetupError(f"prompt_file {path} does not exist")
        return path.read_text()
    if cfg.prompt == "-" or (cfg.prompt is None and not sys.stdin.isatty()):
        return sys.stdin.read()
    if cfg.prompt is None:
        raise SetupError('no prompt: pass prompt="...", prompt_file=PATH, or pipe text to stdin')
    return str(cfg.prompt)


def check_request(cfg: DictConfig, text: str) -> None:
    p = [] if text.strip() else ["the prompt is empty: give some text"]
    raise_if(p + harness.int_problems(cfg, {"max_new_tokens": 1, "prefill_chunk": 1, "threads": 1},
                                      nullable=("prefill_chunk", "threads")))


def report(result, out=None) -> None:
    """The human summary (finish, TTFT, ITL, tok/s, KV bytes), to stderr unless `out` is given."""
    out = out or sys.stderr
    s = result.summary()
    fmt = lambda v, unit="": "n/a" if v is None else f"{v:.2f}{unit}"  # noqa: E731
    print(f"\n\n--- {s['new_tokens']} tokens, finish: {','.join(result.finish_reasons)}", file=out)
    print(f"TTFT {fmt(1000 * s['ttft_s'], ' ms')} (tokenize {1000 * s['tokenize_s']:.1f} ms, "
          f"prefill {1000 * s['prefill_s']:.1f} ms) | ITL p50 {fmt(s['itl_p50_ms'], ' ms')} "
          f"p95 {fmt(s['itl_p95_ms'], ' ms')} | decode {fmt(s['decode_tok_s'], ' tok/s')}", file=out)
    print(f"KV cache: {s['kv_tokens']} tokens, formula {s['kv_bytes_formula']:,} B "
          f"(2 x layers x kv_heads x tokens x head_dim x bytes), allocated {s['kv_bytes_allocated']:,} B", file=out)


def record(result, conditions: dict) -> dict:
    """The `json=true` record of a one-prompt run: text, finish reason, token counts,
    TTFT and ITL percentiles (ms), decode tok/s, KV bytes (formula and allocated),
    decoder statistics ({} when the decoder keeps none) and the run conditions."""
    s = result.summary()
    ms = lambda v: None if v is None else 1000 * v  # noqa: E731
    return {
        "text": result.text[0], "finish": result.finish_reasons[0],
        "prompt_tokens": result.prompt_lengths[0], "new_tokens": s["new_tokens"],
        "ttft_ms": ms(s["ttft_s"]), "tokenize_ms": ms(s["tokenize_s"]), "prefill_ms": ms(s["prefill_s"]),
        **{k: s[k] for k in ("itl_p50_ms", "itl_p95_ms", "itl_p99_ms", "decode_tok_s")},
        **{k: s[k] for k in ("kv_tokens", "kv_bytes_formula", "kv_bytes_allocated")},
        "stats": result.stats, "conditions": conditions,
    }


def run(cfg: DictConfig):
    text = read_prompt(cfg)
    harness.gather(lambda: check_request(cfg, text), lambda: harness.check(cfg))  # before any weights load
    lm = harness.load_model(cfg)
    log.info("model: %s (%s, %s)", lm.name, lm.model.dtype, lm.model.device)
    factory, decoder = harness.build(cfg, lm)
    tok = lm.tokenizer
    t0 = time.perf_counter()  # TTFT counts from here: tokenizing is part of it
    ids = tok.encode(text, chat=cfg.chat_template, system=cfg.system)
    tokenize_s = time.perf_counter() - t0
    cache = make_cache(lm.model, 1, len(ids) + cfg.max_new_tokens + decoder.lookahead, factory)
    log.info("cache: %s, capacity %d", type(cache).__name__, cache.capacity)
    stream = (lambda row, t, delta: print(delta, end="", flush=True)) if cfg.stream and not cfg.json else None
    result = generate(lm.model, cache, decoder, [ids], cfg.max_new_tokens, eos_ids=tok.eos_ids,
                      stop=tuple(cfg.stop), tokenizer=tok, on_token=stream, prefill_chunk=cfg.prefill_chunk,
                      t_start=t0, tokenize_s=tokenize_s)
    emit(cfg, result, harness.run_conditions(lm.model), streamed=stream is not None)
    return result


def emit(cfg: DictConfig, result, conditions: dict, streamed: bool) -> None:
    """stdout: the text (unless already streamed) or, with `json=true`, one JSON record;
    stderr: the summary, the decoder statistics and the run conditions."""
    if cfg.json:
        print(json.dumps(record(result, conditions)), flush=True)
    elif not streamed:
        print(result.text[0], end="", flush=True)
    report(result)
    if result.stats:
        log.info("decoder statistics: %s", result.stats)
    log.info("conditions: %s", conditions)


# conf/generate.yaml: config.yaml with Hydra's logs on stderr and no run directory
main, cli = harness.entry_points("generate", lambda cfg, out: run(cfg), harness.check)


if __name__ == "__main__":
    cli()
