import os, sys, time, statistics, torch
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
model = WeightOptions(w, quantize_head=kind.endswith("+head")).apply(lm.model) if kind != "fp32" else lm.model
prompt = list(range(100, 356))
cache = make_cache(model, 1, 256 + 400, backend("dense"))
step = compiled_step(model, cache)
def med(f, n=200):
    ts = []
    for _ in range(n):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return round(statistics.median(ts) * 1e6, 1)
with torch.inference_mode():
    cache.reset(); tok = prefill(model, cache, [prompt], None).argmax(-1)
    for _ in range(5): tok = native.argmax(step.step(tok))
    graph, inputs = step.replay
    print("inputs", len(inputs))
    n0 = int(cache.lengths[0])
    def full():
        cache.lengths.fill_(n0); native.argmax(step.step(tok))
    def graph_only():
        graph(*inputs)
    def host_only():
        cache.lengths.fill_(n0)
        pos = cache.lengths[:, None] + torch.arange(1)
        step.ids.copy_(tok.view(-1, 1), non_blocking=True)
        step.plan.book(cache, pos)
    lg = step.step(tok)
    for r in range(3):
        print("full", med(full), "graph", med(graph_only), "host(book etc)", med(host_only), "argmax", med(lambda: native.argmax(lg)))
    import cProfile, pstats
    pr = cProfile.Profile(); pr.enable()
    for _ in range(200): graph_only()
    pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(15)
