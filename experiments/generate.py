"""Generation CLI: stream a reply, then print TTFT, ITL, tokens/s and KV-cache bytes.

    python -m decodelab.experiments.generate prompt="Hello" [model=smollm2-135m] [cache=dense]
        [decoder=greedy|sampling] [decoder.temperature=0.7] [max_new_tokens=64]
        [chat_template=true|false] [prompt_file=PATH] [stop='[".\\n"]']
    echo "Hello" | python -m decodelab.experiments.generate

Everything that can be checked before the weights load is checked first.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig

from decodelab.decoding.generate import generate
from decodelab.decoding.text import make_cache
from decodelab.experiments import setup
from decodelab.experiments.cli import precheck
from decodelab.experiments.common import run_conditions
from decodelab.models.errors import SetupError
from decodelab.models.loading import CONF_DIR, instantiate_unwrapped

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
    p = []
    if not text.strip():
        p.append("the prompt is empty: give some text")
    if not isinstance(cfg.max_new_tokens, int) or cfg.max_new_tokens < 1:
        p.append(f"max_new_tokens must be an integer >= 1, got {cfg.max_new_tokens}")
    if cfg.prefill_chunk is not None and (not isinstance(cfg.prefill_chunk, int) or cfg.prefill_chunk < 1):
        p.append(f"prefill_chunk must be null or an integer >= 1, got {cfg.prefill_chunk}")
    if p:
        raise SetupError(p)


def report(result, out=None) -> None:
    out = out or sys.stdout
    s = result.summary()
    fmt = lambda v, unit="": "n/a" if v is None else f"{v:.2f}{unit}"  # noqa: E731
    print(f"\n\n--- {s['new_tokens']} tokens, finish: {','.join(result.finish_reasons)}", file=out)
    print(f"TTFT {fmt(1000 * s['ttft_s'], ' ms')} (tokenize {1000 * s['tokenize_s']:.1f} ms, "
          f"prefill {1000 * s['prefill_s']:.1f} ms) | ITL p50 {fmt(s['itl_p50_ms'], ' ms')} "
          f"p95 {fmt(s['itl_p95_ms'], ' ms')} | decode {fmt(s['decode_tok_s'], ' tok/s')}", file=out)
    print(f"KV cache: {s['kv_tokens']} tokens, formula {s['kv_bytes_formula']:,} B "
          f"(2 x layers x kv_heads x tokens x head_dim x bytes), allocated {s['kv_bytes_allocated']:,} B", file=out)


def check_all(cfg: DictConfig, text: str) -> None:
    """The request and the setup, every problem raised together, before weights load."""
    reasons = []
    for check in (lambda: check_request(cfg, text), lambda: setup.check(cfg)):
        try:
            check()
        except SetupError as e:
            reasons += e.reasons
    if reasons:
        raise SetupError(reasons)


def run(cfg: DictConfig):
    text = read_prompt(cfg)
    check_all(cfg, text)  # before any weights load
    lm = instantiate_unwrapped(cfg.model)
    log.info("model: %s (%s, %s)", lm.name, lm.model.dtype, lm.model.device)
    factory, decoder = setup.build(cfg, lm)
    tok = lm.tokenizer
    t0 = time.perf_counter()  # TTFT counts from here: tokenizing is part of it
    ids = tok.encode(text, chat=cfg.chat_template, system=cfg.system)
    tokenize_s = time.perf_counter() - t0
    cache = make_cache(lm.model, 1, len(ids) + cfg.max_new_tokens + decoder.lookahead, factory)
    log.info("cache: %s, capacity %d", type(cache).__name__, cache.capacity)
    stream = (lambda row, t, delta: print(delta, end="", flush=True)) if cfg.stream else None
    result = generate(lm.model, cache, decoder, [ids], cfg.max_new_tokens, eos_ids=tok.eos_ids,
                      stop=tuple(cfg.stop), tokenizer=tok, on_token=stream, prefill_chunk=cfg.prefill_chunk,
                      t_start=t0, tokenize_s=tokenize_s)
    if not cfg.stream:
        print(result.text[0], end="")
    report(result)
    if result.stats:
        log.info("decoder statistics: %s", result.stats)
    log.info("conditions: %s", run_conditions(lm.model))
    return result


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except SetupError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def cli() -> None:
    """Console entry: every bad config-group option reported with the other problems."""
    precheck(sys.argv[1:], "config", setup.check)
    main()


if __name__ == "__main__":
    cli()
