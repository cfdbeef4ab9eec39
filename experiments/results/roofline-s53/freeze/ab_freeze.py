# In one process: the compiled step as built (the model's weights are graph inputs) against one built with
# inductor's freezing (the weights become the graph's constants), each on its own cache, alternated step by
# step; same tokens asserted.
import os, sys, time, statistics, torch
torch.set_num_threads(2)
from decodelab.models import load, native
from decodelab.models.quantize import WeightOptions
import decodelab.decoding.compiled as C
from decodelab.cache import backend
from decodelab.decoding.text import make_cache
from decodelab.decoding.prefill import prefill
kind = sys.argv[1] if len(sys.argv) > 1 else "int4+head"
R = int(os.environ.get("R", "6")); N = int(os.environ.get("N", "64")); ctx = int(os.environ.get("CTX", "256"))
lm = load("smollm2-135m", device="cpu")
w = kind.split("+")[0]
model = WeightOptions(w, quantize_head=kind.endswith("+head")).apply(lm.model) if kind != "fp32" else lm.model
prompt = [100 + (i * 7) % 3000 for i in range(ctx)]
steps, caches = {}, {}
with torch.inference_mode():
    for label, extra in (("inputs", {}), ("frozen", {"freezing": True})):
        saved = dict(C.INDUCTOR_PATCHES); C.INDUCTOR_PATCHES.update(extra)
        caches[label] = make_cache(model, 1, ctx + N + 8, backend("dense"))
        t0 = time.perf_counter()
        steps[label] = C.compiled_step(model, caches[label])
        C.INDUCTOR_PATCHES.clear(); C.INDUCTOR_PATCHES.update(saved)
        rp = steps[label].replay
        print(label, "compile s", round(time.perf_counter() - t0, 1), "replay", rp is not None, "inputs", len(rp[1]) if rp else None, flush=True)
    t = {k: [] for k in steps}
    import resource; print("maxrss MB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
    for r in range(R):
        toks, last = {k: [] for k in steps}, {}
        for k in steps:
            caches[k].reset(); last[k] = native.argmax(prefill(model, caches[k], [prompt], None))
        for i in range(N):
            order = list(steps) if (i + r) % 2 == 0 else list(steps)[::-1]
            for k in order:
                t0 = time.perf_counter(); last[k] = native.argmax(steps[k].step(last[k])); dt = time.perf_counter() - t0
                if i >= 2: t[k].append(dt)
                toks[k].append(int(last[k]))
        assert toks["inputs"] == toks["frozen"], "tokens differ"
        print("round", r, {k: round(statistics.median(v) * 1e3, 3) for k, v in t.items()}, flush=True)
rs = [a / b for a, b in zip(t["inputs"], t["frozen"])]
q = statistics.quantiles(rs, n=4)
print(f"{kind}: inputs {statistics.median(t['inputs'])*1e3:.3f} ms, frozen {statistics.median(t['frozen'])*1e3:.3f} ms; "
      f"speed-up (paired) median {statistics.median(rs):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f}); same tokens")
