"""Does the serving engine gain from running a speculative decoder's verify in the same
forward as other rows' prefill chunks (one read of the weights), against the verify and
the chunks in forwards of their own (the engine before commit "Engine: a speculative
decoder's verify runs in the step's one forward")? Side by side in one process.

    python -c "from decodelab.experiments.shared_verify import main; main()" [--requests 16] [--rows 4]

SmolLM2-135M fp32, the int8 self-draft at its defaults (gamma 8), dense cache, every request
arriving at t = 0 (offline), ShareGPT prompts (seed 0), `--new` greedy tokens each (EOS
ignored); the two engines alternate `--rounds` times; reported: output tok/s over the
whole run (median over rounds), and whether both produced the same tokens."""

from __future__ import annotations

import argparse
import json
import statistics


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    import torch

    from decodelab.cache.dense import DenseCache
    from decodelab.decoding import SpeculativeDecoder, make_cache, prefill
    from decodelab.decoding.drafters import quantized_self
    from decodelab.decoding.engine import Request, serve
    from decodelab.decoding.runner import ModelRunner, StepOutput, StepPlan
    from decodelab.experiments.harness import run_conditions
    from decodelab.experiments.workloads import ShareGPT
    from decodelab.models import load

    torch.set_num_threads(a.threads)
    lm = load("smollm2-135m", device="cpu")
    reqs = ShareGPT(n=a.requests, seed=0)(lm)
    prompts = [lm.tokenizer.encode(r.prompt, chat=True) for r in reqs]
    shared_speculate = ModelRunner._speculate

    def separate(self, step, decoder):  # the earlier engine: verify alone, then the chunks,
        out = shared_speculate(self, StepPlan(step.decode, (), step.left), decoder)
        first = dict(out.first)
        for group in self._chunk_groups(step.chunks):  # a forward per group as THE prefill on those rows
            logits = prefill(self.model, self.cache, [list(c.tokens) for c in group], rows=[c.row for c in group])
            first |= self._first_tokens(group, logits, decoder)  # logits [b, V]
        return StepOutput(out.tokens, first, out.compiled)

    def run(mode: str):
        ModelRunner._speculate = shared_speculate if mode == "shared" else separate
        try:
            decoder = SpeculativeDecoder(quantized_self(lm, "int8", cache=DenseCache))
            cache = make_cache(lm.model, a.rows, max(map(len, prompts)) + a.new + decoder.lookahead, DenseCache)
            r = serve(lm.model, cache, decoder, [Request(p, a.new, 0.0, i) for i, p in enumerate(prompts)])
        finally:
            ModelRunner._speculate = shared_speculate
        return sum(len(x.tokens) for x in r.requests) / r.wall_s, [x.tokens for x in r.requests]

    tok_s, tokens = {"shared": [], "separate": []}, {}
    for _ in range(a.rounds):
        for mode in ("separate", "shared"):
            t, toks = run(mode)
            tok_s[mode].append(t)
            tokens[mode] = toks
    row = {m: statistics.median(v) for m, v in tok_s.items()}
    out = {"output_tok_s": row, "shared_over_separate": row["shared"] / row["separate"],
           "same_tokens": tokens["shared"] == tokens["separate"], "rounds": tok_s,
           "conditions": {**run_conditions(lm.model), "requests": a.requests, "rows": a.rows, "new_tokens": a.new,
                          "prompt_tokens": [len(p) for p in prompts]}}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
