# In one process: the compiled int4+head step loop, alternating blocks of steps with the int4
# weight prefetches T0 (0) and NTA (1), via dl_set_pf_nta.
import os, sys, time, statistics, ctypes, torch
torch.set_num_threads(2)
from decodelab.models import load, native
from decodelab.models.quantize import WeightOptions
from decodelab.decoding.compiled import compiled_step
from decodelab.cache import backend
from decodelab.decoding.text import make_cache
from decodelab.decoding.prefill import prefill
lm = load("smollm2-135m", device="cpu")
kind = sys.argv[1] if len(sys.argv) > 1 else "int4+head"
w = kind.split("+")[0]
model = WeightOptions(w, 64 if w == "int4" else None, quantize_head=kind.endswith("+head")).apply(lm.model)
prompt = list(range(100, 356))
R, B = 12, 24
cache = make_cache(model, 1, 256 + R * B * 2 + 40, backend("dense"))
step = compiled_step(model, cache)
lib = ctypes.CDLL(str(native.library()))
lib.dl_set_pf_nta.argtypes = [ctypes.c_int]
with torch.no_grad():
    cache.reset(); tok = prefill(model, cache, [prompt], None).argmax(-1)
    for _ in range(5): tok = step.step(tok).argmax(-1)
    t = {0: [], 1: []}
    for r in range(R):
        for v in ((0, 1) if r % 2 == 0 else (1, 0)):
            lib.dl_set_pf_nta(v)
            for _ in range(B):
                t0 = time.perf_counter(); tok = step.step(tok).argmax(-1); t[v].append(time.perf_counter() - t0)
    print(kind, {v: round(statistics.median(x) * 1e3, 3) for v, x in t.items()},
          "T0/NTA", round(statistics.median(t[0]) / statistics.median(t[1]), 3))
