# In one process: the compiled batch-1 int4+head step of SmolLM2 from context 256, each step's greedy token
# taken by torch.argmax or by decodelab's native.argmax, alternating step by step (20 rounds of 32 steps,
# re-prefilled each round); medians of step + argmax per variant, the median pairwise ratio, same tokens.
import time, statistics, torch
torch.set_num_threads(2)
from decodelab.models import load, native
from decodelab.models.quantize import WeightOptions
from decodelab.decoding.compiled import compiled_step
from decodelab.cache import backend
from decodelab.decoding.text import make_cache
from decodelab.decoding.prefill import prefill
lm = load("smollm2-135m", device="cpu")
model = WeightOptions("int4", quantize_head=True).apply(lm.model)
caches = {n: make_cache(model, 1, 256 + 40, backend("dense")) for n in ("torch", "native")}
steps = {n: compiled_step(model, c) for n, c in caches.items()}
pick = {"torch": lambda x: x.argmax(-1), "native": native.argmax}
t, ratios, same = {n: [] for n in pick}, [], True
with torch.inference_mode():
    for r in range(21):
        tok = {n: prefill(model, c.reset() or c, [list(range(100, 356))], None).argmax(-1) for n, c in caches.items()}
        for i in range(32):
            dt = {}
            for n in (("torch", "native") if (i + r) % 2 == 0 else ("native", "torch")):
                t0 = time.perf_counter(); tok[n] = pick[n](steps[n].step(tok[n])); dt[n] = time.perf_counter() - t0
            same &= bool(torch.equal(tok["torch"], tok["native"]))
            if r:
                for n in dt: t[n].append(dt[n])
                ratios.append(dt["torch"] / dt["native"])
x = torch.randn(1, 49152)
one = {}
for n, f in pick.items():
    ts = []
    for _ in range(2000):
        t0 = time.perf_counter(); f(x); ts.append(time.perf_counter() - t0)
    one[n] = round(statistics.median(ts[50:]) * 1e6, 1)
print("step+argmax ms", {n: round(statistics.median(v) * 1e3, 3) for n, v in t.items()}, "torch/native per step pair: median",
      round(statistics.median(ratios), 3), "quartiles", [round(q, 3) for q in statistics.quantiles(ratios, n=4)],
      "same tokens", same, "| argmax alone on [1, 49152], us:", one)
