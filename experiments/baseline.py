"""Baseline: our dense greedy decoder vs transformers' `generate()`, same model, prompts
and dtype, in one process, alternating, medians over repeats.

    python -m decodelab.experiments.baseline [model=smollm2-135m] [prompt_lengths=[128,1024]]
        [new_tokens=64] [repeats=5] [model.dtype=float32] [threads=null]

Both sides generate exactly `new_tokens` tokens (EOS ignored) from the same token ids.
TTFT is the time from the call to the first token; decode tokens/s counts the tokens
after the first over the time after the first.
"""

from __future__ import annotations

import statistics
import time

import hydra
import torch
from omegaconf import DictConfig

from decodelab.decoding.decoders import greedy
from decodelab.decoding.generate import generate
from decodelab.decoding.text import make_cache
from decodelab.experiments.common import print_table, run_conditions, synthetic_prompt
from decodelab.models.loading import CONF_DIR, instantiate_unwrapped


class _TimingStreamer:
    """transformers streamer that stamps each generated token (put() first gets the prompt)."""

    def __init__(self, t0: float):
        self.t0, self.times, self.calls = t0, [], 0

    def put(self, value) -> None:
        self.calls += 1
        if self.calls > 1:
            self.times.append(time.perf_counter() - self.t0)

    def end(self) -> None:
        pass


def run_ours(model, ids: list[int], new_tokens: int) -> dict:
    cache = make_cache(model, 1, len(ids) + new_tokens)
    r = generate(model, cache, greedy(), [ids], new_tokens)
    return _timing(r.token_times[0], r.tokens[0])


def run_hf(hf, ids: list[int], new_tokens: int) -> dict:
    x = torch.tensor([ids], device=hf.device)
    t0 = time.perf_counter()
    s = _TimingStreamer(t0)
    with torch.no_grad():
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False, streamer=s, pad_token_id=0)
    return _timing(s.times, out[0, len(ids):].tolist())


def _timing(times: list[float], tokens: list[int]) -> dict:
    decode_s = times[-1] - times[0]
    return {"ttft_s": times[0], "decode_tok_s": (len(times) - 1) / decode_s, "tokens": tokens}


def compare(lm, hf, prompt_len: int, new_tokens: int, repeats: int) -> dict:
    """Alternate ours / transformers `repeats` times after one warm-up each; medians."""
    ids = synthetic_prompt(lm, prompt_len)
    run_ours(lm.model, ids, new_tokens), run_hf(hf, ids, new_tokens)  # warm-up
    ours, theirs = [], []
    for _ in range(repeats):
        ours.append(run_ours(lm.model, ids, new_tokens))
        theirs.append(run_hf(hf, ids, new_tokens))
    med = lambda runs, k: statistics.median(r[k] for r in runs)  # noqa: E731
    row = {"prompt_len": prompt_len, "new_tokens": new_tokens,
           "ours_ttft_ms": 1000 * med(ours, "ttft_s"), "hf_ttft_ms": 1000 * med(theirs, "ttft_s"),
           "ours_decode_tok_s": med(ours, "decode_tok_s"), "hf_decode_tok_s": med(theirs, "decode_tok_s")}
    row["decode_speedup"] = row["ours_decode_tok_s"] / row["hf_decode_tok_s"]
    row["ttft_ratio_ours_over_hf"] = row["ours_ttft_ms"] / row["hf_ttft_ms"]
    row["same_tokens"] = all(o["tokens"] == t["tokens"] for o, t in zip(ours, theirs))
    return row


def hf_model_for(lm):
    """transformers' own model with the same weights (from the converted checkpoint
    when there is one, else built from the native weights)."""
    from transformers import AutoModelForCausalLM

    from decodelab.models.reference import hf_reference

    if lm.hf_dir is None:
        return hf_reference(lm.model, attn_implementation="sdpa")
    hf = AutoModelForCausalLM.from_pretrained(lm.hf_dir, dtype=lm.model.dtype, attn_implementation="sdpa")
    return hf.to(lm.model.device).eval()


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="baseline")
def main(cfg: DictConfig) -> None:
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    lm = instantiate_unwrapped(cfg.model)
    hf = hf_model_for(lm)
    rows = [compare(lm, hf, n, cfg.new_tokens, cfg.repeats) for n in cfg.prompt_lengths]
    print(f"model={lm.name} dtype={lm.model.dtype} repeats={cfg.repeats} (medians)")
    print_table(rows)
    print("conditions:", run_conditions(lm.model))


if __name__ == "__main__":
    main()
