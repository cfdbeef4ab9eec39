import time, statistics, torch, ctypes, os
torch.set_num_threads(2)
import decodelab.models.native as nat
nat.problem()
ctypes.CDLL(str(nat._library), mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL | os.RTLD_NOW)
from decodelab.decoding.compiled import inductor_cache_dir
inductor_cache_dir()
N = 90
ws = [torch.randn(576) for _ in range(N)]
def f(x, *ws):
    for w in ws:
        x = torch.ops.decodelab.rms_norm(x, w, 1e-5, 0.0)
    return x
x = torch.randn(1, 576)
def med(fn, n=300):
    ts = []
    for _ in range(n):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6
opts = {"cpp_wrapper": True, "size_asserts": False, "alignment_asserts": False}
cf = torch.compile(f, options=opts, fullgraph=True, dynamic=False)
import torch._inductor.config as ic
op = torch.ops.decodelab.rms_norm.default
sopts = dict(opts, **{"aot_inductor.custom_ops_to_c_shims": {op: ["AOTITorchError aoti_torch_cpu_rms_norm(AtenTensorHandle, AtenTensorHandle, double, double, AtenTensorHandle*)"]}})
cs = torch.compile(f, options=sopts, fullgraph=True, dynamic=False)
with torch.inference_mode():
    a = cf(x, *ws); b = cs(x, *ws)
    print("same", torch.equal(a, b))
    for r in range(3):
        print(f"{N} calls: dispatcher {med(lambda: cf(x, *ws)):.1f} us, shim {med(lambda: cs(x, *ws)):.1f} us")
