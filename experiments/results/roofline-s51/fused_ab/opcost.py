# per-call cost of a decodelab custom op inside a compiled graph (cpp wrapper) vs an inductor elementwise kernel
import time, statistics, torch, sys
from decodelab.models import native
from decodelab.decoding import compiled
native.library()
torch.set_num_threads(2)
w = torch.ones(576)
N = 150
def chain_ops(x):
    for _ in range(N):
        x = torch.ops.decodelab.rms_norm(x, w, 1e-5, 0.0)
    return x
def chain_ew(x):
    for _ in range(N):
        x = torch.sin(x) * 1.0001 + x  # one fused kernel per iteration? barrier via clone
        x = torch.ops.aten.clone(x)
    return x
def nothing(x):
    return torch.ops.decodelab.rms_norm(x, w, 1e-5, 0.0)
x = torch.randn(1, 576)
for name, f in (("ops", chain_ops), ("one", nothing)):
    g = torch.compile(f, fullgraph=True, options=compiled.CPU_WRAPPERS[sys.argv[1] if len(sys.argv) > 1 else "cpp"])
    for _ in range(3): g(x)
    ts = []
    for r in range(7):
        t0 = time.perf_counter()
        for _ in range(200): g(x)
        ts.append((time.perf_counter() - t0) / 200 * 1e6)
    print(name, "us per call of graph:", round(statistics.median(ts), 1))
# eager native rms_norm direct
t0 = time.perf_counter()
for _ in range(20000): torch.ops.decodelab.rms_norm(x, w, 1e-5, 0.0)
print("eager op us", (time.perf_counter() - t0) / 20000 * 1e6)
