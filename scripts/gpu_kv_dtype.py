"""The dense cache's kv_dtype on a CUDA GPU (the eager path: stored K/V converted, torch's
attention): a random SmolLM2-135M-shape model in fp32, a 300-token prompt and 32 greedy
steps per kv_dtype, logits against the fp32 dense cache's; and the compiled step refused
with its reason. Prints one line per dtype; exits 1 on a failure.

    python scripts/gpu_kv_dtype.py          # on the GPU machine, after gpu_check.sh's set-up
    python scripts/gpu_kv_dtype.py cpu      # the same on the CPU (the default without CUDA: the native kernel path)
"""

from __future__ import annotations

import sys

import torch
from omegaconf import OmegaConf

from decodelab.cache.dense import DenseCache
from decodelab.decoding.compiled import StaticDecoder
from decodelab.decoding.prefill import prefill
from decodelab.decoding.text import make_cache
from decodelab.models.errors import SetupError
from decodelab.models.loading import CONF_DIR, instantiate_unwrapped


def run(model, kind: str, prompt: list[int], steps: int = 32) -> torch.Tensor:
    cache = make_cache(model, 1, len(prompt) + steps + 1, lambda lay, b, c: DenseCache(lay, b, c, kv_dtype=kind))
    with torch.no_grad():
        logits = prefill(model, cache, [prompt])
        out = [logits]
        for _ in range(steps):
            tok = out[-1].argmax(-1)[:, None]
            out.append(model(tok, cache.lengths[:, None].to(model.device), cache)[:, -1])
    return torch.stack(out).float()


def main() -> int:
    device = sys.argv[1] if len(sys.argv) > 1 else ("cuda" if torch.cuda.is_available() else "cpu")
    spec = OmegaConf.merge(OmegaConf.load(CONF_DIR / "model" / "smollm2-135m-shape.yaml"),
                           {"dtype": "float32", "device": device})
    model = instantiate_unwrapped(spec).model
    prompt = torch.randint(0, model.cfg.vocab_size, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = run(model, "auto", prompt)
    ok = True
    for kind in ("bfloat16", "float16", "float8_e4m3"):
        got = run(model, kind, prompt)
        d = (got - ref).abs().max().item()
        top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        good = torch.isfinite(got).all().item() and top1 >= 0.8  # random weights: near-ties flip
        ok &= good
        print(f"{kind}: max |dlogit| {d:.3g}, top-1 agreement {top1:.3f} ({'ok' if good else 'FAIL'})", flush=True)
    if device == "cpu":
        return 0 if ok else 1
    try:
        cache = make_cache(model, 1, 64, lambda lay, b, c: DenseCache(lay, b, c, kv_dtype="float8_e4m3"))
        StaticDecoder(model, cache, mode="graph")
        print("compiled step with kv_dtype on CUDA: NOT refused (FAIL)")
        ok = False
    except SetupError as e:
        print(f"compiled step with kv_dtype on CUDA: refused ({str(e).splitlines()[-1].strip()[:160]})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
