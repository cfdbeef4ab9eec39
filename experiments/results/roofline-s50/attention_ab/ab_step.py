# In one process: the compiled step of SmolLM2 (weights argv[1]) from context 256, 32 steps per flag value (re-prefilled
# each round), alternating blocks of 32 steps between kernel flag values (dl_set_ab), order
# swapped each round; medians per value and the ratio.
import os, sys, time, statistics, ctypes, torch
torch.set_num_threads(2)
from decodelab.models import load, native
from decodelab.models.quantize import WeightOptions
from decodelab.decoding.compiled import compiled_step
from decodelab.cache import backend
from decodelab.decoding.text import make_cache
from decodelab.decoding.prefill import prefill
kind = sys.argv[1]
flags = [int(x) for x in sys.argv[2].split(",")]
R = int(os.environ.get("R", "10"))
lm = load("smollm2-135m", device="cpu")
w = kind.split("+")[0]
model = lm.model if kind == "fp32" else WeightOptions(w, 64 if w == "int4" else None,
                                                      quantize_head=kind.endswith("+head")).apply(lm.model)
prompt = list(range(100, 356))
cache = make_cache(model, 1, 256 + 32 * len(flags) + 8, backend("dense"))
step = compiled_step(model, cache)
lib = ctypes.CDLL(str(native.library()))
lib.dl_set_ab.argtypes = [ctypes.c_int]
t = {f: [] for f in flags}
toks = {f: [] for f in flags}
with torch.no_grad():
    for r in range(R + 1):
        order = flags if r % 2 == 0 else flags[::-1]
        cache.reset(); tok = prefill(model, cache, [prompt], None).argmax(-1)
        for f in order:
            lib.dl_set_ab(f)
            for _ in range(32):
                t0 = time.perf_counter(); tok = step.step(tok).argmax(-1); dt = time.perf_counter() - t0
                if r: t[f].append(dt)
lib.dl_set_ab(flags[0])
med = {f: statistics.median(x) * 1e3 for f, x in t.items()}
print(kind, "ms/step", {f: round(m, 3) for f, m in med.items()},
      "ratio first/others", [round(med[flags[0]] / med[f], 3) for f in flags[1:]], flush=True)
