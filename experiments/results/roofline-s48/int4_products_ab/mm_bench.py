import sys, time, statistics, torch
from decodelab.models import native
torch.manual_seed(0)
shapes = {"wqkv": (960, 576), "wo": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}
g = 64
def make(N, K, copies):
    return [(torch.randint(0, 256, (N, K // 2), dtype=torch.uint8), torch.rand(N, K // g), torch.rand(N, K // g)) for _ in range(copies)]
for th in [int(a) for a in sys.argv[1:]] or [1, 2]:
    torch.set_num_threads(th)
    for name, (N, K) in shapes.items():
        copies = 1 if name == "head" else 30
        ws = make(N, K, copies)
        x = torch.randn(1, K)
        nbytes = sum(w[0].numel() + 4 * (w[1].numel() + w[2].numel()) for w in ws)
        for _ in range(3):
            for w in ws: native.int4_mm(x, *w, g)
        ts = []
        for _ in range(30):
            t = time.perf_counter()
            for w in ws: native.int4_mm(x, *w, g)
            ts.append(time.perf_counter() - t)
        m = statistics.median(ts)
        print(f"threads {th} {name:8s} {m / copies * 1e6:8.1f} us/call  {nbytes / m / 1e9:6.1f} GB/s")
