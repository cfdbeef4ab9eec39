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

import functools
import json
import logging
import re
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, ListConfig

from decodelab.decoding.generate import generate
from decodelab.decoding.text import make_cache
from decodelab.experiments import harness
from decodelab.models.errors import SetupError, raise_if

log = logging.getLogger("decodelab.generate")


def read_prompt(cfg: DictConfig) -> str:
    """The prompt from `prompt=`, `prompt_file=` (UTF-8 text), or standard input
    (`prompt=-` or piped; read once, so the console script's precheck and the run share it)."""
    if cfg.prompt is not None and cfg.prompt_file is not None:
        raise SetupError("give either prompt= or prompt_file=, not both")
    if cfg.prompt_file is not None:
        path = Path(cfg.prompt_file).expanduser()
        if not path.exists() or path.is_dir():
            raise SetupError(f"prompt_file {path} {'is a directory' if path.is_dir() else 'does not exist'}; "
                             "give a text file")
        try:
            return path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise SetupError(f"prompt_file {path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                             f"{e.start}); convert it, e.g. iconv -f latin1 -t utf-8 {path} > prompt.txt") from None
        except OSError as e:
            raise SetupError(f"prompt_file {path} cannot be read ({e.strerror}); check its permissions") from None
    if cfg.prompt == "-" or (cfg.prompt is None and not sys.stdin.isatty()):
        return _stdin()
    if cfg.prompt is None:
        raise SetupError('no prompt: pass prompt="...", prompt_file=PATH, or pipe text to stdin')
    return str(cfg.prompt)


@functools.cache
def _stdin() -> str:
    return sys.stdin.read()


ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def stop_strings(stop) -> tuple[str, ...]:
    """`stop=` as stop strings: one string (`stop=night`) or a list of them; `\\n`, `\\t`,
    `\\r` and `\\\\` in them are a newline, a tab, a carriage return and a backslash (a shell
    and Hydra pass `stop='["\\n\\n"]'` as backslash and n). An empty one is refused."""
    items = list(stop) if isinstance(stop, (list, tuple, ListConfig)) else [] if stop is None else [stop]
    bad = [s for s in items if not isinstance(s, str) or not s]
    raise_if([f"stop={list(items)!r}: every stop string must be non-empty text (an empty one would end the "
              "reply before its first token); e.g. stop='[\"\\n\\n\", \"User:\"]'"] if bad else [])
    return tuple(re.sub(r"\\([ntr\\])", lambda m: ESCAPES[m[1]], s) for s in items)


def check_request(cfg: DictConfig, text: str | None = None) -> None:
    """The prompt (read here unless given), stop strings and sizes: every problem together."""
    reasons = []
    text = harness.collect(reasons, lambda: read_prompt(cfg)) if text is None else text
    if text is not None and not text.strip():
        reasons.append("the prompt is empty: give some text")
    harness.collect(reasons, lambda: stop_strings(cfg.stop))
    raise_if(reasons + harness.int_problems(cfg, {"max_new_tokens": 1, "prefill_chunk": 1},
                                            nullable=("prefill_chunk",)) + harness.run_option_problems(cfg))


def report(result, out=None) -> None:
    """The human summary (finish, TTFT, ITL, tok/s, KV bytes), to stderr unless `out` is given."""
    out = out or sys.stderr
    s = result.summary()
    fmt = lambda v, unit="": "n/a" if v is None else f"{v:.2f}{unit}"  # noqa: E731
    print(f"\n\n--- {s['new_tokens']} tokens, finish: {','.join(result.finish_reasons)}", file=out)
    print(f"TTFT {fmt(1000 * s['ttft_s'], ' ms')} (tokenize {1000 * s['tokenize_s']:.1f} ms, "
          f"prefill {1000 * s['prefill_s']:.1f} ms) | ITL p50 {fmt(s['itl_p50_ms'], ' ms')} "
          f"p95 {fmt(s['itl_p95_ms'], ' ms')} | decode {fmt(s['decode_tok_s'], ' tok/s')}", file=out)
    if s["compile_s"]:
        print(f"compiled decode step: {s['compile_s']:.1f} s before the prefill (not in TTFT or ITL)", file=out)
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
        "compile_ms": ms(s["compile_s"]),
        **{k: s[k] for k in ("itl_p50_ms", "itl_p95_ms", "itl_p99_ms", "decode_tok_s")},
        **{k: s[k] for k in ("kv_tokens", "kv_bytes_formula", "kv_bytes_allocated")},
        "stats": result.stats, "conditions": conditions,
    }


def run(cfg: DictConfig):
    text = read_prompt(cfg)
    check(cfg)  # before any weights load
    lm = harness.load_model(cfg)
    log.info("model: %s (%s, %s)", lm.name, lm.model.dtype, lm.model.device)
    factory, decoder = harness.build(cfg, lm)
    tok = lm.tokenizer
    t0 = time.perf_counter()  # TTFT counts from here: tokenizing is part of it
    ids = tok.encode(text, chat=cfg.chat_template, system=cfg.system)
    tokenize_s = time.perf_counter() - t0
    need = len(ids) + cfg.max_new_tokens + decoder.lookahead
    cache = make_cache(lm.model, 1, harness.capacity(cfg, lm.model, 1, need, factory), factory)
    log.info("cache: %s, capacity %d", type(cache).__name__, cache.capacity)
    stream = (lambda row, t, delta: print(delta, end="", flush=True)) if cfg.stream and not cfg.json else None
    eos = () if cfg.ignore_eos else tok.eos_ids  # ignore_eos=true: exactly max_new_tokens
    result = generate(lm.model, cache, decoder, [ids], cfg.max_new_tokens, eos_ids=eos,
                      stop=stop_strings(cfg.stop), tokenizer=tok, on_token=stream, prefill_chunk=cfg.prefill_chunk,
                      t_start=t0, tokenize_s=tokenize_s, compile=cfg.compile)
    emit(cfg, result, harness.run_conditions(lm), streamed=stream is not None)
    return result


def emit(cfg: DictConfig, result, conditions: dict, streamed: bool) -> None:
    """stdout: the text (unless already streamed) or, with `json=true`, one JSON record;
    stderr: the summary, the decoder statistics and the run conditions."""
    if cfg.json:
        print(json.dumps(record(result, conditions)), flush=True)
    elif not streamed:
        print(result.text[0], end="", flush=True)
    report(result)
    if conditions.get("weight_kernel"):
        print(f"weights: {conditions['weights']} through {conditions['weight_kernel']}", file=sys.stderr)
    if result.stats:
        log.info("decoder statistics: %s", result.stats)
    log.info("conditions: %s", conditions)


# conf/generate.yaml: config.yaml with Hydra's logs on stderr and no run directory
def check(cfg: DictConfig) -> None:
    """The request and the setup, every problem together, before any weights load."""
    harness.gather(lambda: check_request(cfg), lambda: harness.check(cfg))


main, cli = harness.entry_points("generate", lambda cfg, out: run(cfg), check)


if __name__ == "__main__":
    cli()
