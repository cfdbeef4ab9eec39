import ctypes, sys, time, statistics, numpy as np, os
libs = {v: ctypes.CDLL(f"/tmp/s49/ab/{v}.so") for v in sys.argv[1].split(",")}
P = ctypes.c_void_p; I = ctypes.c_int64
for l in libs.values():
    l.dl_int4_mm.argtypes = [P, I, I, P, P, P, I, P, I]
rng = np.random.default_rng(0)
shapes = {"wqkv": (960, 576), "wo": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}
g = 64
res = {}
for name, (N, K) in shapes.items():
    copies = 1 if name == "head" else 30
    ws = [(rng.integers(0, 256, (N, K // 2), dtype=np.uint8), rng.random((N, K // g), dtype=np.float32),
           rng.random((N, K // g), dtype=np.float32)) for _ in range(copies)]
    x = rng.standard_normal((1, K), dtype=np.float32); y = np.zeros((1, N), np.float32)
    outs = {}
    ptrs = [(w[0].ctypes.data, w[1].ctypes.data, w[2].ctypes.data) for w in ws]
    xp, yp = x.ctypes.data, y.ctypes.data

    def run(l):
        f = l.dl_int4_mm
        for a, b, c in ptrs:
            f(xp, 1, K, a, b, c, g, yp, N)
    for v, l in libs.items():
        run(l); outs[v] = y.copy()
    t = {v: [] for v in libs}
    for _ in range(int(os.environ.get("TRIALS", "40"))):
        for v, l in libs.items():
            t0 = time.perf_counter(); run(l); t[v].append((time.perf_counter() - t0) / copies * 1e6)
    names = list(libs)
    line = f"{name:8s} " + " ".join(f"{v} {statistics.median(t[v]):8.1f}us" for v in names)
    if len(names) == 2:
        r = [a / b for a, b in zip(t[names[0]], t[names[1]])]
        line += f"  {names[0]}/{names[1]} median {statistics.median(r):.3f} (q1 {np.quantile(r, .25):.3f} q3 {np.quantile(r, .75):.3f})"
        line += f"  maxdiff {np.abs(outs[names[0]] - outs[names[1]]).max():.2e}"
    print(line, flush=True)
