# In one process, one compiled step over a dense cache: the dense decode attention's prefetch settings
# (ab_flag v: keys v % 1000 slots ahead, values v // 1000 slots ahead (0: none)) alternated step by step
# at the same positions (the cache's length rewound); same tokens asserted per setting.
import os, sys, time, statistics, torch
torch.set_num_threads(2)
from decodelab.models import load, native
from decodelab.models.quantize import WeightOptions
from decodelab.decoding.compiled import compiled_step
from decodelab.cache import backend
from decodelab.decoding.text import make_cache
from decodelab.decoding.prefill import prefill
kind = sys.argv[1] if len(sys.argv) > 1 else "int4+head"
flags = [int(f) for f in (sys.argv[2] if len(sys.argv) > 2 else "16,48,16016").split(",")]
R = int(os.environ.get("R", "8"))
ctx = int(os.environ.get("CTX", "256"))
lm = load("smollm2-135m", device="cpu")
w = kind.split("+")[0]
model = WeightOptions(w, quantize_head=kind.endswith("+head")).apply(lm.model) if kind != "fp32" else lm.model
prompt = [100 + (i * 7) % 3000 for i in range(ctx)]
cache = make_cache(model, 1, ctx + 40, backend("dense"))
step = compiled_step(model, cache)
t = {f: [] for f in flags}
with torch.inference_mode():
    for r in range(R):
        toks = {}
        for f in flags:
            torch.ops.decodelab.ab_flag(f)
            cache.reset(); tok = native.argmax(prefill(model, cache, [prompt], None)); seq = []
            for i in range(32):
                tok = native.argmax(step.step(tok)); seq.append(int(tok))
            toks[f] = seq
        assert all(toks[f] == toks[flags[0]] for f in flags), "tokens differ"
        cache.reset(); tok = native.argmax(prefill(model, cache, [prompt], None))
        for i in range(32):
            order = flags[r % len(flags):] + flags[:r % len(flags)]
            if i % 2: order = order[::-1]
            n0 = cache.lengths.clone()
            for f in order:
                torch.ops.decodelab.ab_flag(f)
                cache.lengths = n0.clone()
                t0 = time.perf_counter(); out = native.argmax(step.step(tok)); dt = time.perf_counter() - t0
                if i >= 2: t[f].append(dt)
            tok = out
        print("round", r, {f: round(statistics.median(t[f]) * 1e3, 3) for f in flags}, flush=True)
base = flags[0]
for f in flags[1:]:
    rs = [a / b for a, b in zip(t[base], t[f])]
    q = statistics.quantiles(rs, n=4)
    print(f"{kind} ctx {ctx}: flag {f} vs {base}: step {statistics.median(t[f])*1e3:.3f} vs {statistics.median(t[base])*1e3:.3f} ms, "
          f"speed-up (paired) median {statistics.median(rs):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f}), same tokens")
