import os, sys, time, statistics, torch
torch.set_num_threads(2)
from decodelab.models import load
from decodelab.models.quantize import WeightOptions
from decodelab.decoding import compiled as C
from decodelab.cache import backend
from decodelab.decoding.text import make_cache
from decodelab.decoding.prefill import prefill
lm = load("smollm2-135m", device="cpu")
kind = sys.argv[1] if len(sys.argv) > 1 else "int4+head"
w = kind.split("+")[0]
model = WeightOptions(w, 64 if w == "int4" else None, quantize_head=kind.endswith("+head")).apply(lm.model) if kind != "fp32" else lm.model
prompt = list(range(100, 356))
N = int(os.environ.get("N", "200"))
variants = sys.argv[2].split(",")
steps, caches, toks = {}, {}, {}
with torch.no_grad():
    for v in variants:
        C.INDUCTOR_PATCHES.pop("cpp_wrapper", None); C.INDUCTOR_PATCHES.pop("cpp_wrapper_build_separate", None)
        if v.startswith("cppw"): C.INDUCTOR_PATCHES["cpp_wrapper"] = True
        if v == "cppwsep": C.INDUCTOR_PATCHES["cpp_wrapper_build_separate"] = True
        torch._dynamo.reset()
        caches[v] = make_cache(model, 1, 256 + N + 20, backend("dense"))
        t0 = time.perf_counter()
        steps[v] = C.compiled_step(model, caches[v])
        caches[v].reset(); toks[v] = prefill(model, caches[v], [prompt], None).argmax(-1)
        for _ in range(3): toks[v] = steps[v].step(toks[v]).argmax(-1)
        print(v, "compile+warm s", round(time.perf_counter() - t0, 1), flush=True)
    ts = {v: [] for v in variants}
    for i in range(N - 10):
        for v in variants:
            t = time.perf_counter(); toks[v] = steps[v].step(toks[v]).argmax(-1); ts[v].append(time.perf_counter() - t)
    for v in variants: print(v, "step ms median", round(statistics.median(ts[v]) * 1e3, 3), "q1", round(sorted(ts[v])[len(ts[v])//4]*1e3, 3))
    if len(variants) == 2:
        r = [a / b for a, b in zip(*ts.values())]
        print(f"{variants[0]}/{variants[1]} median ratio {statistics.median(r):.3f}")
    print("same tokens:", len({int(t) for t in toks.values()}) == 1)
