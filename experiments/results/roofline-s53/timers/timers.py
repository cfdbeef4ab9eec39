# With apply_timers.py's temporary timers: per compiled int4+head step (the replayed graph called directly),
# the graph's wall time, the time inside its operators, inside their OpenMP regions, and in the products'
# serial activation quantization; medians over N steps.
import os, sys, time, statistics, torch
torch.set_num_threads(2)
from decodelab.models import load, native
from decodelab.models.quantize import WeightOptions
from decodelab.decoding.compiled import compiled_step
from decodelab.cache import backend
from decodelab.decoding.text import make_cache
from decodelab.decoding.prefill import prefill
kind = sys.argv[1] if len(sys.argv) > 1 else "int4+head"
N = int(os.environ.get("N", "300"))
lm = load("smollm2-135m", device="cpu")
w = kind.split("+")[0]
model = WeightOptions(w, quantize_head=kind.endswith("+head")).apply(lm.model) if kind != "fp32" else lm.model
prompt = [100 + (i * 7) % 3000 for i in range(256)]
cache = make_cache(model, 1, 256 + N + 8, backend("dense"))
step = compiled_step(model, cache)
ab = torch.ops.decodelab.ab_flag
rec = {k: [] for k in ("step", "graph", "ops", "regions", "quantize")}
with torch.inference_mode():
    cache.reset(); tok = native.argmax(prefill(model, cache, [prompt], None))
    for _ in range(5): tok = native.argmax(step.step(tok))
    graph, inputs = step.replay
    for i in range(N):
        t0 = time.perf_counter()
        pos = step.cache.lengths[:, None] + torch.arange(step.tokens)
        step.ids.copy_(tok.view(-1, 1)); step.plan.book(step.cache, pos)
        for k in range(3): ab(k)
        ab(98)
        if i == 5: ab(99)
        t1 = time.perf_counter(); out = graph(*inputs)[0]; t2 = time.perf_counter()
        ops, par, ser = ab(0), ab(1), ab(2)
        for j in range(6): rec.setdefault(f"ph{j}", []).append(ab(10 + j) / 1e6)
        ab(98)
        tok = native.argmax(out); t3 = time.perf_counter()
        rec["step"].append((t3 - t0) * 1e3); rec["graph"].append((t2 - t1) * 1e3)
        rec["ops"].append(ops / 1e6); rec["regions"].append(par / 1e6); rec["quantize"].append(ser / 1e6)
import sys as _s; _s.stderr.flush(); ab(99)  # per operator over the last N - 6 steps (gap: from the previous operator's exit)
m = {k: statistics.median(v) for k, v in rec.items()}
print(kind, {k: round(v, 3) for k, v in m.items()}, "ms")
print(f"  graph outside its operators {m['graph'] - m['ops']:.3f} ms; operators outside their regions {m['ops'] - m['regions']:.3f} ms "
      f"(of which the products' activation quantization {m['quantize']:.3f}); step outside the graph {m['step'] - m['graph']:.3f} ms")
