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
    print("go", flush=True); open("/tmp/s53/go", "w").close()
    import decodelab.decoding.compiled as C
    graph, inputs = step.replay
    pc = time.perf_counter
    ts, tb, tg, ta, parts = [], [], [], [], []
    cold, warm = [], []
    xs, ws = torch.randn(1, 576), torch.randn(576)
    for _ in range(N):
        t0 = pc()
        pos = step.cache.lengths[:, None] + torch.arange(step.tokens)
        ta0 = pc()
        step.ids.copy_(tok.view(-1, step.tokens), non_blocking=True)
        ta1 = pc()
        step.cache.book(pos)
        ta2 = pc()
        step.plan.load(pos)
        t1 = pc()
        parts.append((ta0 - t0, ta1 - ta0, ta2 - ta1, t1 - ta2))
        out = graph(*inputs)[0]
        t2 = pc()
        tok = out.argmax(-1)
        t3 = pc()
        tc0 = pc(); torch.ops.decodelab.rms_norm(xs, ws, 1e-5, 0.0); tc1 = pc(); torch.ops.decodelab.rms_norm(xs, ws, 1e-5, 0.0); tc2 = pc()
        cold.append(tc1 - tc0); warm.append(tc2 - tc1)
        ts.append(t3 - t0); tb.append(t1 - t0); tg.append(t2 - t1); ta.append(t3 - t2)
    m = lambda v: round(statistics.median(v) * 1e3, 3)
    print(kind, "step", m(ts), "book", m(tb), "graph", m(tg), "argmax", m(ta))
    print("rms_norm op cold", m(cold), "warm", m(warm))
    print("pos ids book load", [m([p[i] for p in parts]) for i in range(4)])
    for _ in range(300):
        t0 = pc(); step.cache.lengths -= 1; pos = step.cache.lengths[:, None] + torch.arange(step.tokens); step.cache.book(pos); tb.append(pc() - t0)
    print("warm book alone", m(tb[-300:]))
