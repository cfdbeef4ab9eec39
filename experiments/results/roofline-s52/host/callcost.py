# per-call cost of a decodelab custom op (rms_norm on [1, 576]) inside a cpp-wrapper compiled graph
import time, statistics, torch, sys
torch.set_num_threads(2)
import decodelab.models.native as nat
nat.problem()
from decodelab.decoding.compiled import inductor_cache_dir
inductor_cache_dir()
N = 90
ws = [torch.randn(576) for _ in range(N)]
def f(x, *ws):
    for w in ws:
        x = torch.ops.decodelab.rms_norm(x, w, 1e-5, 0.0)
    return x
def g(x, *ws):
    for w in ws:
        x = x * w
    return x
x = torch.randn(1, 576)
def med(fn, n=300):
    ts = []
    for _ in range(n):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6
opts = {"cpp_wrapper": True, "size_asserts": False, "alignment_asserts": False}
cf = torch.compile(f, options=opts, fullgraph=True, dynamic=False)
cg = torch.compile(g, options=opts, fullgraph=True, dynamic=False)
with torch.inference_mode():
    cf(x, *ws); cg(x, *ws)
    for r in range(3):
        print(f"eager rms_norm per call {med(lambda: f(x, *ws))/N:.2f} us; compiled cpp-wrapper: {N} custom calls {med(lambda: cf(x, *ws)):.1f} us, {N} fused muls {med(lambda: cg(x, *ws)):.1f} us;"
              f" raw kernel-ish: at::empty+norm via torch.ops {med(lambda: torch.ops.decodelab.rms_norm(x, ws[0], 1e-5, 0.0)):.2f} us")
