import ctypes, sys, time, statistics, numpy as np, os
libs = {v: ctypes.CDLL(f"/tmp/s49/ab/{v}.so") for v in sys.argv[1].split(",")}
P = ctypes.c_void_p; I = ctypes.c_int64; F = ctypes.c_float
for l in libs.values():
    l.dl_decode_attn.argtypes = [P, P, P, P, I, I, I, I, I, I, F, I, P, P, I, I, I, ctypes.c_int, P, P]
    l.dl_decode_attn.restype = ctypes.c_int
rng = np.random.default_rng(0)
Hq, Hkv, D, S, L = 9, 3, 64, 1024, 30
ctx = int(os.environ.get("CTX", "300"))
ks = [rng.standard_normal((1, Hkv, S, D), dtype=np.float32) for _ in range(L)]
vs = [rng.standard_normal((1, Hkv, S, D), dtype=np.float32) for _ in range(L)]
q = rng.standard_normal((1, Hq, 1, D), dtype=np.float32)
pos = np.array([[ctx - 1]], dtype=np.int64)
out = np.zeros((1, Hq, 1, D), np.float32)
flush = np.ones(64 << 20 >> 2, np.float32)
outs = {}
ptrs = [(ks[i].ctypes.data, vs[i].ctypes.data) for i in range(L)]
qp, pp, op = q.ctypes.data, pos.ctypes.data, out.ctypes.data
def run(l):
    f = l.dl_decode_attn
    for kp, vp in ptrs:
        f(qp, kp, vp, pp, 1, Hq, Hkv, 1, S, D, 0.125, 0, op, None, 0, 0, 0, 0, None, None)
for v, l in libs.items():
    run(l); outs[v] = out.copy()
t = {v: [] for v in libs}
for _ in range(int(os.environ.get("TRIALS", "40"))):
    for v, l in libs.items():
        if not os.environ.get("WARM"): flush.sum()
        t0 = time.perf_counter(); run(l); t[v].append((time.perf_counter() - t0) / L * 1e6)
names = list(libs)
kvb = 2 * Hkv * ctx * D * 4
line = f"ctx {ctx} " + " ".join(f"{v} {statistics.median(t[v]):6.1f}us ({kvb / statistics.median(t[v]) / 1e3:4.1f} GB/s)" for v in names)
if len(names) == 2:
    r = [a / b for a, b in zip(t[names[0]], t[names[1]])]
    line += f"  {names[0]}/{names[1]} {statistics.median(r):.3f}  maxdiff {np.abs(outs[names[0]] - outs[names[1]]).max():.1e}"
print(line, flush=True)
