"""The composition matrix on the fast path (issue 28): every cache backend x decoder,
eager and `compile=True`, side by side in one process.

    python -c "from decodelab.experiments.fastpath import main; main()" [--tokens 64] [--rounds 2]
    (main(["--prompt-tokens", "2048", "--backends", "dense", "sliding", "--decoders", "greedy"]): long context)
    (main(["--cli"]): every cell through the `decodelab-generate` command line, once each way)

For each backend (dense, paged, int4, sliding with a 512-token window and 4 sinks imposed
on SmolLM2) and decoder (greedy; speculative with the int8 self-draft; speculative with
prompt lookup, gamma 4 both; a tree of prompt-lookup drafts, depth 4, width 3; with --cli
the configs' defaults: the int8 self-draft at its own gamma 8), one ShareGPT prompt of 180-260 tokens (chat template) is
decoded `--tokens` greedy tokens eagerly and with `compile=True`, alternated, `--rounds`
times each (the first compiled call compiles: `compile_s` apart; decode tok/s is the
median over rounds). A cell that compile=True refuses says why. The greedy text of the
compiled run must equal the eager run's (`text_equal`). Prints a markdown table and the
run conditions; writes JSON lines to --out when given."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

BACKENDS = {"dense": {}, "paged": {}, "int4": {}, "sliding": {"window": 512, "sinks": 4}}
DECODERS = ("greedy", "speculative int8-self", "speculative prompt-lookup", "tree prompt-lookup")


def prompt(lm) -> list[int]:
    """The first ShareGPT prompt (seed 0) of 180-260 tokens, through the chat template."""
    from decodelab.experiments.workloads import ShareGPT

    req = ShareGPT(n=1, seed=0, min_prompt_tokens=180, max_prompt_tokens=260)(lm)[0]
    return lm.tokenizer.encode(req.prompt, chat=True)


def decoder(lm, name: str, factory):
    """A fresh decoder of `name` (a drafter caching through the target's backend)."""
    from decodelab.decoding import SpeculativeDecoder, TreeSpeculativeDecoder, greedy
    from decodelab.decoding.drafters import prompt_lookup, quantized_self

    if name == "greedy":
        return greedy()
    if name.startswith("tree"):
        return TreeSpeculativeDecoder(prompt_lookup(), depth=4, width=3)
    drafter = quantized_self(lm, "int8", cache=factory) if name.endswith("int8-self") else prompt_lookup()
    return SpeculativeDecoder(drafter, gamma=4)


def tree_rollback(backend: str, dec: str) -> dict:
    """The sliding backend's rollback (8 by default) raised to what a tree of 1 + 3 x 4 nodes needs."""
    return {"rollback": 12} if backend == "sliding" and dec.startswith("tree") else {}


def cell(lm, ids: list[int], backend: str, dec: str, tokens: int, rounds: int) -> dict:
    """One backend x decoder: eager and compiled decode tok/s, compile seconds, text equality."""
    from decodelab.cache import backend as cache_backend
    from decodelab.decoding import generate, make_cache
    from decodelab.models.errors import SetupError

    factory = cache_backend(backend, **BACKENDS[backend], **tree_rollback(backend, dec))
    runs = {False: [], True: []}
    texts, compile_s, refused = {}, 0.0, None
    for _ in range(rounds):
        for compiled in (False, True):
            if compiled and refused:
                continue
            cache = make_cache(lm.model, 1, len(ids) + tokens + 16, factory)  # (a verify's lookahead)
            try:
                r = generate(lm.model, cache, decoder(lm, dec, factory), [ids], tokens, compile=compiled,
                             tokenizer=lm.tokenizer)
            except SetupError as e:
                refused = "; ".join(e.reasons)
                continue
            runs[compiled].append(r.summary()["decode_tok_s"])
            texts[compiled] = r.text[0]
            compile_s = max(compile_s, r.compile_s)
    eager = statistics.median(runs[False]) if runs[False] else None  # None: refused eagerly too
    comp = statistics.median(runs[True]) if runs[True] else None
    return {"backend": backend, "decoder": dec, "eager_tok_s": eager, "compiled_tok_s": comp,
            "compiled_vs_eager": comp / eager if comp and eager else None, "compile_s": compile_s,
            "text_equal": texts.get(True) == texts.get(False) if comp and eager else None, "refused": refused,
            "eager_rounds": runs[False], "compiled_rounds": runs[True]}


#: each decoder as decodelab-generate's overrides (the configs' defaults: gamma is the draft's own)
CLI_DECODERS = {"greedy": [], "speculative int8-self": ["decoder=speculative", "draft=int8-self"],
                "speculative prompt-lookup": ["decoder=speculative", "draft=prompt-lookup"],
                "tree prompt-lookup": ["decoder=tree", "draft=prompt-lookup"]}


def cli_cell(prompt_file: str, backend: str, dec: str, tokens: int, threads: int) -> dict:
    """One backend x decoder through the command line a user types: `decodelab-generate ...
    compile=false`, then `compile=true`, each in its own process (`json=true` records)."""
    import shutil
    import subprocess

    exe = shutil.which("decodelab-generate") or str(Path(sys.executable).parent / "decodelab-generate")
    options = {**BACKENDS[backend], **tree_rollback(backend, dec)}
    cache = [f"cache={backend}"] + [f"cache.{k}={v}" for k, v in options.items()]
    recs, refused = {}, None
    for compiled in (False, True):
        args = [exe, f"prompt_file={prompt_file}", *cache, *CLI_DECODERS[dec], f"compile={str(compiled).lower()}",
                f"max_new_tokens={tokens}", "ignore_eos=true", "json=true", "stream=false", f"threads={threads}"]
        out = subprocess.run(args, capture_output=True, text=True)
        if out.returncode:
            refused = (out.stderr.strip().splitlines() or ["failed"])[-1]
            break
        recs[compiled] = json.loads(out.stdout.strip().splitlines()[-1])
    eager, comp = (recs.get(c, {}).get("decode_tok_s") for c in (False, True))
    return {"backend": backend, "decoder": dec, "eager_tok_s": eager, "compiled_tok_s": comp,
            "compiled_vs_eager": comp / eager if comp and eager else None,
            "compile_s": (recs.get(True, {}).get("compile_ms") or 0) / 1000,
            "text_equal": recs[True]["text"] == recs[False]["text"] if len(recs) == 2 else None,
            "refused": refused, "prompt_tokens": recs.get(False, {}).get("prompt_tokens"),
            "command": " ".join(["decodelab-generate", "prompt_file=PROMPT", *cache, *CLI_DECODERS[dec],
                                 "compile=true|false", f"max_new_tokens={tokens}", "ignore_eos=true"])}


def table(rows: list[dict]) -> str:
    """The matrix as markdown."""
    out = ["| backend | decoder | eager tok/s | compiled tok/s | compiled / eager | compile s | text equal |",
           "|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        comp = f"{r['compiled_tok_s']:.1f}" if r["compiled_tok_s"] else f"refused: {(r['refused'] or '')[:90]}"
        ratio = f"{r['compiled_vs_eager']:.2f}" if r["compiled_vs_eager"] else "-"
        eager = f"{r['eager_tok_s']:.1f}" if r["eager_tok_s"] else f"failed: {(r['refused'] or '')[:90]}"
        out.append(f"| {r['backend']} | {r['decoder']} | {eager} | {comp} | {ratio} | "
                   f"{r['compile_s']:.1f} | {r['text_equal']} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS))
    ap.add_argument("--decoders", nargs="+", default=list(DECODERS))
    ap.add_argument("--prompt-tokens", type=int, default=None,
                    help="a synthetic prompt of this many tokens instead of the ShareGPT one (long contexts)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--cli", action="store_true",
                    help="run each cell through the decodelab-generate command line (one process per run)")
    a = ap.parse_args(argv)
    if a.cli and a.prompt_tokens:
        ap.error("--cli runs the ShareGPT prompt as text; --prompt-tokens (a synthetic prompt of ids) takes the "
                 "generate() cells only")
    import torch

    from decodelab.experiments.harness import run_conditions
    from decodelab.models import load

    torch.set_num_threads(a.threads)
    lm = load("smollm2-135m", device="cpu")
    if a.prompt_tokens:
        from decodelab.experiments.workloads import synthetic_prompt

        ids = synthetic_prompt(lm, a.prompt_tokens)
    else:
        ids = prompt(lm)
    rows = []
    if a.cli:  # the same prompt as text, which the CLI tokenizes through the chat template again
        import tempfile

        from decodelab.experiments.workloads import ShareGPT

        text = ShareGPT(n=1, seed=0, min_prompt_tokens=180, max_prompt_tokens=260)(lm)[0].prompt
        assert lm.tokenizer.encode(text, chat=True) == ids
        prompt_file = Path(tempfile.mkdtemp()) / "prompt.txt"
        prompt_file.write_text(text)
    for b in a.backends:
        for d in a.decoders:
            rows.append(cli_cell(str(prompt_file), b, d, a.tokens, a.threads) if a.cli else
                        cell(lm, ids, b, d, a.tokens, a.rounds))
            print(json.dumps({k: rows[-1][k] for k in ("backend", "decoder", "eager_tok_s", "compiled_tok_s")}),
                  file=sys.stderr, flush=True)
    cond = {**run_conditions(lm.model), "prompt_tokens": len(ids), "new_tokens": a.tokens,
            "rounds": 1 if a.cli else a.rounds, "through": "decodelab-generate" if a.cli else "generate()"}
    if a.out:  # the records first: nothing measured is lost to the printing
        with open(a.out, "w") as f:
            for r in rows:
                f.write(json.dumps({**r, "conditions": cond}) + "\n")
    print(table(rows))
    print(f"conditions: {json.dumps(cond)}", file=sys.stderr)


if __name__ == "__main__":
    main()
