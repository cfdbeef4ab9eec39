"""A/B, one process, alternating step by step: the compiled step's host booking as of HEAD (old)
against the working tree's (new: KVCache._plan_whole, the step's held offsets). Same tokens asserted."""
import os, sys, time, statistics, subprocess, textwrap, torch
torch.set_num_threads(2)
from decodelab.models import load, native
from decodelab.models.quantize import WeightOptions
from decodelab.decoding.compiled import StaticDecoder
from decodelab.cache import backend
from decodelab.cache.base import KVCache, Plan, SetupError, build_tree
from decodelab.decoding.text import make_cache
from decodelab.decoding.prefill import prefill
import decodelab.decoding.compiled as C

def old_fn(path, cls, name, ns):
    src = subprocess.run(["git", "show", f"HEAD:{path}"], capture_output=True, text=True, check=True).stdout
    lines = src.splitlines()
    start = next(i for i, l in enumerate(lines) if l.strip().startswith(f"def {name}(") and i > next(j for j, m in enumerate(lines) if m.startswith(f"class {cls}")))
    ind = len(lines[start]) - len(lines[start].lstrip())
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > ind):
        end += 1
    code = textwrap.dedent("\n".join(lines[start:end]))
    exec(code, ns)
    return ns[name]

import decodelab.cache.base as B
old_plan = old_fn("cache/base.py", "KVCache", "plan", dict(vars(B)))
old_step = old_fn("decoding/compiled.py", "StaticDecoder", "step", dict(vars(C)))
new_plan, new_step = KVCache.plan, StaticDecoder.step

kind = sys.argv[1] if len(sys.argv) > 1 else "int4+head"
w = kind.split("+")[0]
lm = load("smollm2-135m", device="cpu")
model = WeightOptions(w, 64 if w == "int4" else None, quantize_head=kind.endswith("+head")).apply(lm.model) if kind != "fp32" else lm.model
prompt = list(range(100, 356))
N = int(os.environ.get("N", "64"))
rounds = int(os.environ.get("R", "6"))
cache = make_cache(model, 1, 256 + N + 8, backend(os.environ.get("BACKEND", "dense")))
step = StaticDecoder(model, cache, mode="compile")
res = {"old": [], "new": []}
with torch.no_grad():
    for r in range(rounds):
        toks = {}
        for label in (["old", "new"] if r % 2 == 0 else ["new", "old"]):
            pass
        seqs = {"old": [], "new": []}
        for label in ("old", "new"):
            cache.reset(); tok = native.argmax(prefill(model, cache, [prompt], None))
            seqs[label] = [tok]
        caches = None
        # alternate: the two runs share one cache, so run each sequence whole but interleave steps via
        # two caches would double memory; instead alternate the booking code step by step in one sequence
        cache.reset(); tok = native.argmax(prefill(model, cache, [prompt], None))
        out = []
        for i in range(N):
            label = "old" if (i + r) % 2 == 0 else "new"
            KVCache.plan, StaticDecoder.step = (old_plan, old_step) if label == "old" else (new_plan, new_step)
            t = time.perf_counter(); tok = native.argmax(step.step(tok)); dt = time.perf_counter() - t
            if i >= 4: res[label].append(dt)
            out.append(int(tok))
        KVCache.plan, StaticDecoder.step = new_plan, new_step
        # reference: all-new, same tokens
        cache.reset(); tok = native.argmax(prefill(model, cache, [prompt], None)); ref = []
        for i in range(N):
            tok = native.argmax(step.step(tok)); ref.append(int(tok))
        assert out == ref, "different tokens"
        o, n = statistics.median(res["old"]), statistics.median(res["new"])
        print(f"round {r}: old {o*1e3:.3f} ms new {n*1e3:.3f} ms  old/new {o/n:.3f}", flush=True)
ratios = [a / b for a, b in zip(res["old"], res["new"])]
q = statistics.quantiles(ratios, n=4)
print(f"{kind} {os.environ.get('BACKEND', 'dense')}: step old {statistics.median(res['old'])*1e3:.3f} ms, new {statistics.median(res['new'])*1e3:.3f} ms; "
      f"old/new of medians {statistics.median(res['old'])/statistics.median(res['new']):.3f}; paired-neighbour ratio median {statistics.median(ratios):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f}); same tokens")
