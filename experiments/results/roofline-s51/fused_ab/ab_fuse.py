# In one process: batch-1 greedy decode steps of SmolLM2 (weights argv[1], default int4+head) from context 256,
# through two models of the same quantized weights: one whose blocks fuse (Block.fuse, the default: the
# operators int4_qkv_rope and int4_block_out) and one whose blocks run their steps one by one. argv[2]:
# "compiled" (each model's compiled step, compiled once) or "eager" (model.forward). Each round re-prefills
# both, then alternates them step by step for 32 steps (the order swapped every step); medians per model,
# the median of each step pair's ratio plain/fused with its quartiles, and whether both gave the same tokens.
import copy, os, sys, time, statistics, torch
torch.set_num_threads(2)
from decodelab.models import load
from decodelab.models.quantize import WeightOptions
from decodelab.decoding.compiled import compiled_step
from decodelab.cache import backend
from decodelab.decoding.text import make_cache
from decodelab.decoding.prefill import prefill
kind = sys.argv[1] if len(sys.argv) > 1 else "int4+head"
mode = sys.argv[2] if len(sys.argv) > 2 else "compiled"
R = int(os.environ.get("R", "20"))
lm = load("smollm2-135m", device="cpu")
w = kind.split("+")[0]
models = {"fused": WeightOptions(w, quantize_head=kind.endswith("+head")).apply(lm.model)}
models["plain"] = copy.deepcopy(models["fused"])
for b in models["plain"].layers:
    b.fuse = False
prompt = list(range(100, 356))
caches = {n: make_cache(m, 1, 256 + 40, backend("dense")) for n, m in models.items()}
steps = {n: compiled_step(m, caches[n]) for n, m in models.items()} if mode == "compiled" else None
names = list(models)
t, ratios, same = {n: [] for n in names}, [], True
with torch.inference_mode():
    for r in range(R + 1):
        tok = {}
        for n in names:
            caches[n].reset()
            tok[n] = prefill(models[n], caches[n], [prompt], None).argmax(-1)
        for i in range(32):
            dt = {}
            for n in (names if (i + r) % 2 == 0 else names[::-1]):
                t0 = time.perf_counter()
                if steps:
                    tok[n] = steps[n].step(tok[n]).argmax(-1)
                else:
                    tok[n] = models[n](tok[n].view(1, 1), torch.tensor([[256 + i]]), caches[n])[:, -1].argmax(-1)
                dt[n] = time.perf_counter() - t0
            same &= bool(torch.equal(tok["fused"], tok["plain"]))
            if r:
                for n in names:
                    t[n].append(dt[n])
                ratios.append(dt["plain"] / dt["fused"])
print(kind, mode, "ms/step", {n: round(statistics.median(x) * 1e3, 3) for n, x in t.items()},
      "plain/fused per step pair: median", round(statistics.median(ratios), 3),
      "quartiles", [round(q, 3) for q in statistics.quantiles(ratios, n=4)], "same tokens", same, flush=True)
