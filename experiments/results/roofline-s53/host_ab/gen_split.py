import os, sys, time, statistics, torch
torch.set_num_threads(2)
from decodelab.models import load
from decodelab.models.quantize import WeightOptions
from decodelab.decoding.text import make_cache
from decodelab.decoding.generate import generate
from decodelab.decoding.decoders import greedy
import decodelab.decoding.compiled as C
lm = load("smollm2-135m", device="cpu")
model = WeightOptions("int4", 64, quantize_head=True).apply(lm.model)
prompt = list(range(100, 356))
n = 200
gt = []
orig = C.CompiledStep._compiled_call if hasattr(C, "CompiledStep") else None
cls = [v for v in vars(C).values() if isinstance(v, type) and hasattr(v, "_compiled_call")][0]
orig = cls._compiled_call
def timed(self):
    t = time.perf_counter(); out = orig(self); gt.append(time.perf_counter() - t); return out
cls._compiled_call = timed
T = {}
def wrap(owner, name, key):
    f = getattr(owner, name)
    def w(*a, **k):
        t = time.perf_counter(); out = f(*a, **k); T.setdefault(key, []).append(time.perf_counter() - t); return out
    setattr(owner, name, w)
from decodelab.models import native
from decodelab.decoding import decoders as D
wrap(cls, "step", "static.step")
wrap(native, "argmax", "argmax")
wrap(D.SamplingDecoder, "step", "decoder.step")
for rep in range(3):
    gt.clear(); T.clear()
    r = generate(model, make_cache(model, 1, len(prompt) + n + 1), greedy(), [prompt], n, compile=True)
    times = r.token_times[0]
    itl = [b - a for a, b in zip(times[1:], times[2:])]
    g = gt[5:]
    print(f"rep {rep}: per token median {statistics.median(itl)*1e3:.3f} ms, graph call median {statistics.median(g)*1e3:.3f} ms, outside {statistics.median(itl)*1e3 - statistics.median(g)*1e3:.3f} ms")
    print("   ", {k: round(statistics.median(v[5:]) * 1e3, 3) for k, v in T.items()})
