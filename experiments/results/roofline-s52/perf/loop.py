import os, sys, time, statistics, torch
torch.set_num_threads(int(os.environ.get("T", "2")))
from decodelab.models import load
from decodelab.models.quantize import WeightOptions
from decodelab.decoding.compiled import compiled_step
from decodelab.cache import backend
from decodelab.decoding.text import make_cache
from decodelab.decoding.prefill import prefill
lm = load("smollm2-135m", device="cpu")
kind = sys.argv[1] if len(sys.argv) > 1 else "int4+head"
w = kind.split("+")[0]
model = WeightOptions(w, 64 if w == "int4" else None, quantize_head=kind.endswith("+head")).apply(lm.model) if kind != "fp32" else lm.model
prompt = list(range(100, 356))
N = int(os.environ.get("N", "300"))
cache = make_cache(model, 1, 256 + N + 20, backend("dense"))
step = compiled_step(model, cache)
with torch.no_grad():
    cache.reset(); tok = prefill(model, cache, [prompt], None).argmax(-1)
    for _ in range(5): tok = step.step(tok).argmax(-1)
    print("go", flush=True); open("/tmp/s49/go", "w").close()
    ts = []
    for _ in range(N):
        t = time.perf_counter(); tok = step.step(tok).argmax(-1); ts.append(time.perf_counter() - t)
    print(kind, "step ms median", round(statistics.median(ts) * 1e3, 3))
