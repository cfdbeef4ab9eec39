"""Kernel-vs-reference cases, shared by tests/cache/test_kernels.py (on the CPU under the
Triton interpreter, in a subprocess) and experiments/gpu_check.py (on CUDA).

Every case draws fresh random inputs, runs the Triton path and the torch reference on
them, and returns both outputs; `run_cases` reports the max abs error against the
tolerance of the dtype (fp32 1e-4, bf16 2e-2). Block tables are random permutations of
the pool (non-consecutive blocks), unused blocks hold a large poison value, and rows
have different lengths.

    TRITON_INTERPRET=1 python -m decodelab.cache.kernels.check            # every case on the CPU, JSON out
    python -m decodelab.cache.kernels.check device=cuda dtypes=bfloat16   # on a GPU
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from decodelab.cache.base import CacheLayout
from decodelab.cache.kernels.int4 import int4_attention_reference, int4_attention_triton
from decodelab.cache.kernels.paged import dense_as_pool, paged_attention_reference, paged_attention_triton

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def paged_case(device, dtype, B=3, Hq=4, Hkv=2, D=16, bs=4, lengths=(5, 37, 20), T=1, window=None, softcap=None,
               splits=None, seed=0):
    """Kernel and reference outputs [B, Hq, T, D] for the last T positions of each row."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / bs) for n in lengths]
    N = sum(need) + 3  # spare blocks, poisoned
    order = torch.randperm(N, generator=g)
    table = torch.full((B, max(need) + 1), -1, dtype=torch.long)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = order[used:used + n]
        used += n
    pools = [torch.randn(Hkv, N, bs, D, generator=g) for _ in range(2)]
    for p in pools:
        p[:, order[used:]] = 1e4  # never read: a kernel reading a wrong block shows it
    k, v = (p.to(device, dtype) for p in pools)
    kv_len = torch.tensor(lengths)
    qpos = (kv_len[:, None] - T + torch.arange(T)).clamp(min=0)  # [B, T]
    q = torch.randn(B, Hq, T, D, generator=g).to(device, dtype)
    args = (q, k, v, table.to(device), qpos.to(device), kv_len.to(device), D**-0.5, window, softcap, splits)
    return paged_attention_triton(*args), paged_attention_reference(*args)


def dense_case(device, dtype, B=2, Hq=4, Hkv=2, D=16, S=48, bs=16, lengths=(30, 48), window=None, splits=None,
               seed=0):
    """A dense layer [B, Hkv, S, D] read by the paged kernel through `dense_as_pool` (the
    static decode step's path), one query per row, against SDPA over each row's keys."""
    from decodelab.cache.base import reference_attention

    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(B, Hkv, S, D, generator=g).to(device, dtype) for _ in range(2))
    q = torch.randn(B, Hq, 1, D, generator=g).to(device, dtype)
    kv_len = torch.tensor(lengths, device=device)
    qpos = (kv_len - 1)[:, None]  # [B, 1]
    (kp, table), (vp, _) = dense_as_pool(k, bs), dense_as_pool(v, bs)
    got = paged_attention_triton(q, kp, vp, table, qpos, kv_len, D**-0.5, window, None, splits)
    kpos = torch.arange(S, device=device)
    mask = kpos <= qpos if window is None else (kpos <= qpos) & (kpos > qpos - window)  # [B, S]
    return got, reference_attention(q, k, v, mask[:, None, None], D**-0.5)


def int4_case(device, dtype, B=2, Hq=4, Hkv=2, D=32, lengths=(100, 150), T=1, window=None, softcap=None,
              splits=None, seed=0, **options):
    """Kernel and reference outputs for T new queries per row of an int4 cache that holds
    `lengths` tokens (stored as the cache stores them: quantized blocks + exact store), on
    the inputs the cache hands its kernel (`kernel_rows`, `kernel_queries`)."""
    from decodelab.cache.int4 import QuantizedCache

    g = torch.Generator().manual_seed(seed)
    # rollback >= T: the first query's exact keys outlive the forward's drop (read after attend)
    opts = dict(nbits=4, group_size=32, residual=8, flush=32, key_axis="channel", value_axis="token",
                rollback=max(4, T))
    opts.update(options)
    layout = CacheLayout(1, Hkv, D, dtype, torch.device(device), (window,), D**-0.5, softcap)
    c = QuantizedCache(layout, B, max(lengths) + T, impl="reference", **opts)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype)  # noqa: E731
    pos = torch.arange(max(lengths)).expand(B, -1)
    plan = c.plan(pos, pos < torch.tensor(lengths)[:, None])  # right-padded prompt
    c.attend(0, rand(B, Hq, pos.shape[1], D), rand(B, Hkv, pos.shape[1], D), rand(B, Hkv, pos.shape[1], D), plan)
    plan = c.plan(c.lengths[:, None] + torch.arange(T))  # the decode / verification forward
    q = rand(B, Hq, T, D)
    c.attend(0, q, rand(B, Hkv, T, D), rand(B, Hkv, T, D), plan)  # stores it (and runs the cache's reference)
    args = (q, c.kernel_rows(0, plan), *c.kernel_queries(plan), D**-0.5, window, softcap, splits)
    return int4_attention_triton(*args), int4_attention_reference(*args)


def cache_case(device, dtype, backend="paged", windows=(None, 7), T=3, seed=0, **options):
    """Whole-cache agreement: two caches of one backend, impl=triton and impl=reference,
    through a padded prefill (reference path), decode steps of T and 1 queries, a rollback
    and more decoding; the outputs of valid queries of every decode step, stacked."""
    from decodelab.cache.int4 import QuantizedCache
    from decodelab.cache.paged import PagedCache

    g = torch.Generator().manual_seed(seed)
    Hkv, Hq, D, B = 2, 6, 32, 3
    layout = CacheLayout(len(windows), Hkv, D, dtype, torch.device(device), windows, D**-0.5)
    if backend == "paged":
        make = lambda impl: PagedCache(layout, B, 96, block_size=8, impl=impl, **options)  # noqa: E731
    else:
        opts = dict(group_size=32, residual=8, flush=32, rollback=4) | options
        make = lambda impl: QuantizedCache(layout, B, 96, impl=impl, **opts)  # noqa: E731
    caches = [make("triton"), make("reference")]
    rand = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype)  # noqa: E731
    got, want = [], []

    def forward(positions, valid=None, keep=False):
        qkv = [(rand(B, Hq, positions.shape[1], D), rand(B, Hkv, positions.shape[1], D),
                rand(B, Hkv, positions.shape[1], D)) for _ in windows]
        for c, sink in zip(caches, (got, want)):
            plan = c.plan(positions, valid)
            outs = [c.attend(layer, *qkv[layer], plan) for layer in range(len(windows))]
            if keep:
                sink.append(torch.stack(outs))
    pos = torch.arange(50).expand(B, -1)
    forward(pos, pos < torch.tensor([[21], [50], [34]]))
    for step in (T, 1, 1):
        forward(caches[0].lengths[:, None] + torch.arange(step), keep=True)
    back = (caches[0].lengths - torch.tensor([2, 1, 0])).tolist()  # a speculative-style rollback
    for c in caches:
        c.truncate(back)
    forward(caches[0].lengths[:, None] + torch.arange(T), keep=True)
    return torch.cat([x.flatten() for x in got]), torch.cat([x.flatten() for x in want])


@dataclass
class Case:
    name: str
    run: Callable
    options: dict = field(default_factory=dict)


CASES = [
    Case("paged-q1", paged_case),
    Case("paged-q1-split3", paged_case, dict(splits=3)),
    Case("paged-q4-causal", paged_case, dict(T=4, splits=2)),
    Case("paged-window", paged_case, dict(T=3, window=7, splits=2)),
    Case("paged-softcap", paged_case, dict(T=2, softcap=20.0)),
    Case("paged-gqa4-d64-bs16", paged_case, dict(Hq=8, Hkv=2, D=64, bs=16, lengths=(100, 33), B=2, T=5, splits=4)),
    Case("paged-mqa-short", paged_case, dict(Hq=3, Hkv=1, lengths=(1, 2, 9), T=1)),
    Case("dense-as-pool", dense_case),
    Case("dense-as-pool-window-split2", dense_case, dict(window=9, splits=2, Hq=6)),
    Case("int4-decode", int4_case),
    Case("int4-verify-token-channel", int4_case, dict(T=4, key_axis="token", value_axis="channel")),
    Case("int4-window", int4_case, dict(T=2, window=40, splits=2)),
    Case("int4-qint2-gqa3", int4_case, dict(Hq=6, nbits=2, T=3)),
    Case("int4-short-rows", int4_case, dict(lengths=(3, 70), T=2)),
    Case("int4-softcap-splits3", int4_case, dict(softcap=20.0, splits=3)),
    Case("paged-cache", cache_case, dict(backend="paged")),
    Case("int4-cache", cache_case, dict(backend="int4")),
]


def model_shape_cases(shapes: dict[str, tuple[int, int, int]]) -> list[Case]:
    """Paged and int4 cases at model shapes {name: (Hq, Hkv, D)}, one decode and one verify
    query count each, over long rows of different lengths (GPU sizes)."""
    cases = []
    for name, (Hq, Hkv, D) in shapes.items():
        for T in (1, 5):
            shape = dict(Hq=Hq, Hkv=Hkv, D=D, T=T)
            cases.append(Case(f"paged-{name}-T{T}", paged_case,
                              shape | dict(B=4, bs=16, lengths=(4000, 1000, 9000, 17))))
            cases.append(Case(f"int4-{name}-T{T}", int4_case,
                              shape | dict(B=3, lengths=(6000, 700, 129), group_size=64, residual=112, flush=64)))
    return cases


def run_cases(device="cpu", dtypes=(torch.float32,), cases=CASES) -> list[dict]:
    """Every case in every dtype: max abs error of the kernel against the reference."""
    results = []
    for dtype in dtypes:
        for case in cases:
            t0 = time.perf_counter()
            got, want = case.run(device, dtype, **case.options)
            err = (got.float() - want.float()).abs().max().item()
            results.append({"case": case.name, "dtype": str(dtype).removeprefix("torch."), "max_abs_err": err,
                            "tol": TOLERANCE[dtype], "finite": bool(got.isfinite().all()),
                            "ok": bool(got.isfinite().all()) and err <= TOLERANCE[dtype],
                            "seconds": round(time.perf_counter() - t0, 3)})
    return results


AOT_CASES = [
    Case("paged-llama-shape", paged_case, dict(Hq=32, Hkv=8, D=128, bs=16, lengths=(300, 200), B=2, splits=1)),
    Case("paged-verify-window-split", paged_case, dict(Hq=9, Hkv=3, D=64, T=5, lengths=(300, 90), B=2, window=64,
                                                        bs=16, splits=3)),
    Case("dense-as-pool-llama-shape", dense_case, dict(Hq=32, Hkv=8, D=128, S=256, bs=64, lengths=(200, 256))),
    Case("int4-llama-shape", int4_case, dict(Hq=32, Hkv=8, D=128, lengths=(300, 200), group_size=64, residual=112,
                                             flush=64)),
    Case("int4-token-channel-qint2", int4_case, dict(Hq=9, Hkv=3, D=64, T=4, lengths=(300, 130), group_size=64,
                                                     residual=112, flush=64, nbits=2, key_axis="token",
                                                     value_axis="channel")),
]


def compile_ahead(cases=AOT_CASES, dtypes=(torch.bfloat16, torch.float32), arch: int = 90) -> list[dict]:
    """Compile every kernel launch the cases make for a CUDA target (default sm_90, the
    H100/H200) with Triton's own compiler and bundled ptxas, no GPU needed: launches are
    recorded instead of run, then compiled with the JIT's specializations (16-divisible
    pointers and ints, ints equal to 1). Catches what the interpreter cannot (types,
    layouts, unsupported ops). Needs the kernel modules imported without TRITON_INTERPRET."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from decodelab.cache.kernels import common_triton, int4_triton, paged_triton

    kernels = [(paged_triton, "_paged_kernel"), (int4_triton, "_int4_kernel"), (common_triton, "_combine_kernel")]
    launches: dict = {}
    originals = [(m, n, getattr(m, n)) for m, n in kernels]
    for m, n, fn in originals:  # record launches instead of running them
        setattr(m, n, _Recorder(fn, launches))
    try:
        for dtype in dtypes:
            for case in cases:
                case.run("cpu", dtype, **case.options)
    finally:
        for m, n, fn in originals:
            setattr(m, n, fn)
    out = []
    for (name, consts), (fn, call) in launches.items():
        sig, constexprs, attrs = _specialize(fn, call)
        t0 = time.perf_counter()
        k = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                           options={"num_warps": call[1].get("num_warps", 4)})
        out.append({"kernel": name, "constexprs": {c: str(v) for c, v in consts}, "shared_bytes": k.metadata.shared,
                    "seconds": round(time.perf_counter() - t0, 2), "cubin": "cubin" in k.asm})
    return out


class _Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **constexprs)` records the launch."""

    def __init__(self, fn, launches: dict):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        def launch(*args, **kw):
            key = (self.fn.__name__, tuple(sorted((k, str(v)) for k, v in kw.items())))
            self.launches.setdefault(key, (self.fn, (args, kw)))
        return launch


def _specialize(fn, call):
    """Signature, constexprs and attributes of one recorded call, as Triton's JIT would make them."""
    args, kw = call
    names = fn.arg_names
    types = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
             torch.int64: "i64", torch.uint8: "u8"}
    bound = dict(zip(names, args)) | {k: v for k, v in kw.items() if k in names}
    sig, constexprs, attrs = {}, {}, {}
    for i, n in enumerate(names):
        a = bound[n]
        if fn.params[i].is_constexpr or (type(a) is int and a == 1):
            sig[n], constexprs[n] = "constexpr", a
            continue
        sig[n] = "*" + types[a.dtype] if isinstance(a, torch.Tensor) else ("fp32" if isinstance(a, float) else "i32")
        if (isinstance(a, torch.Tensor) and a.data_ptr() % 16 == 0) or (type(a) is int and a % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, constexprs, attrs


def main(argv: list[str] | None = None) -> None:
    """key=value arguments: device (cpu), dtypes (float32,bfloat16); or aot=90 (and dtypes)
    to compile for sm_90 without a GPU. Prints JSON."""
    args = dict(a.split("=", 1) for a in (sys.argv[1:] if argv is None else argv))
    if "aot" in args:
        dtypes = [DTYPES[d] for d in args.get("dtypes", "bfloat16,float32").split(",")]
        print(json.dumps(compile_ahead(dtypes=dtypes, arch=int(args["aot"])), indent=1))
        return
    dtypes = [DTYPES[d] for d in args.get("dtypes", "float32,bfloat16").split(",")]
    print(json.dumps(run_cases(args.get("device", "cpu"), dtypes), indent=1))


if __name__ == "__main__":
    main()
