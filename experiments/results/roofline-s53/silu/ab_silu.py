# In one process, one compiled int4+head step: int4_block_out's SiLU through ATen (flag 1, as committed before)
# or silu_rows over ATen's own AVX2 exp (flag 0), alternated step by step; same tokens asserted (session 52's ab_loops.py).
import os, sys, time, statistics, torch
torch.set_num_threads(2)
from decodelab.models import load, native
from decodelab.models.quantize import WeightOptions
from decodelab.decoding.compiled import compiled_step
from decodelab.cache import backend
from decodelab.decoding.text import make_cache
from decodelab.decoding.prefill import prefill
kind = sys.argv[1] if len(sys.argv) > 1 else "int4+head"
mode = sys.argv[2] if len(sys.argv) > 2 else "compiled"
R = int(os.environ.get("R", "12"))
lm = load("smollm2-135m", device="cpu")
w = kind.split("+")[0]
model = WeightOptions(w, quantize_head=kind.endswith("+head")).apply(lm.model)
prompt = list(range(100, 356))
cache = make_cache(model, 1, 256 + 40, backend("dense"))
step = compiled_step(model, cache) if mode == "compiled" else None
t, ratios = {0: [], 1: []}, []
toks = {0: [], 1: []}
with torch.inference_mode():
    for r in range(R + 1):
        for flag in (0, 1):
            torch.ops.decodelab.ab_flag(flag)
            cache.reset()
            tok = prefill(model, cache, [prompt], None).argmax(-1)
            seq = []
            for i in range(32):
                tok = native.argmax(step.step(tok)) if step else native.argmax(model(tok.view(1, 1), torch.tensor([[256 + i]]), cache)[:, -1])
                seq.append(int(tok))
            toks[flag] = seq
        assert toks[0] == toks[1], "tokens differ"
        # timing: alternate the flag step by step on one sequence
        cache.reset(); tok = prefill(model, cache, [prompt], None).argmax(-1)
        for i in range(32):
            dt = {}
            for flag in ((0, 1) if (i + r) % 2 == 0 else (1, 0)):
                torch.ops.decodelab.ab_flag(flag)
                n0 = int(cache.lengths[0])
                t0 = time.perf_counter()
                out = native.argmax(step.step(tok)) if step else native.argmax(model(tok.view(1, 1), torch.tensor([[n0]]), cache)[:, -1])
                dt[flag] = time.perf_counter() - t0
                if flag == 1 and (i + r) % 2 == 0 or flag == 0 and (i + r) % 2 == 1:
                    pass
                cache.lengths.fill_(n0)  # both flags step at the same position
            cache.lengths.fill_(n0 + 1); tok = out
            if r:
                for f in (0, 1): t[f].append(dt[f])
                ratios.append(dt[1] / dt[0])
print(kind, mode, "ms/step silu_rows", round(statistics.median(t[0]) * 1e3, 3), "aten", round(statistics.median(t[1]) * 1e3, 3),
      "aten/silu_rows per step pair: median", round(statistics.median(ratios), 4), "quartiles",
      [round(q, 4) for q in statistics.quantiles(ratios, n=4)], "same tokens True", flush=True)
