"""Offline serving throughput of the compiled engine (`compile=True`: a decode step in which
every cache row decodes runs through the compiled static step; with a speculative decoder,
a round in which every row verifies runs the compiled verify and the draft's steps are
compiled) against the eager engine and transformers' continuous batching
(`generate_batch`), side by side in one process.

    python -c "from decodelab.experiments.engine_compile import main; main()"   # [--backends ...] [--decoders ...]
    python -c "from decodelab.experiments.engine_compile import step_times; step_times()"   # one step, B=1 and 8
    python -c "from decodelab.experiments.engine_compile import verify_times; verify_times()"  # a verify, B=1

SmolLM2-135M fp32, `--requests` ShareGPT prompts (seed 0, chat template) all at t = 0,
`--new` tokens each (EOS ignored), `--rows` cache rows; decoders: greedy, and greedy
speculative with the int8 self-draft at its defaults (conf/draft/int8-self.yaml: gamma 8,
caching through the target's backend); `--decoders ... tree`: a tree of prompt-lookup
drafts (depth 4, width 3), whose compiled engine verifies its trees through flat graphs.
Per backend and decoder the two engines alternate
`--rounds` times, transformers once per round beside the first backend's greedy only;
reported: output tok/s over the whole run (median over rounds; the compile, done once
before the first compiled run, apart), whether each engine's tokens equal the eager greedy
engine's (speculative decoding is lossless at temperature 0) and transformers'."""

from __future__ import annotations

import argparse
import json
import statistics


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backends", nargs="+", default=["dense", "paged", "int4", "sliding"])
    ap.add_argument("--decoders", nargs="+", default=["greedy", "int8-self"], choices=["greedy", "int8-self", "tree"])
    ap.add_argument("--flat", action="store_true",
                    help="also a compiled engine whose other forwards run through the compiled runner's flat "
                         "token batches (compile_flat=True): what they add")
    a = ap.parse_args(argv)
    import torch

    from decodelab.cache import backend as cache_backend
    from decodelab.decoding import SpeculativeDecoder, TreeSpeculativeDecoder, greedy, make_cache
    from decodelab.decoding.drafters import prompt_lookup, quantized_self
    from decodelab.decoding.engine import Engine, Request
    from decodelab.experiments.harness import run_conditions
    from decodelab.experiments.workloads import ShareGPT
    from decodelab.models import load
    from decodelab.models.reference import hf_generate_batch, hf_model_for

    torch.set_num_threads(a.threads)
    lm = load("smollm2-135m", device="cpu")
    prompts = [lm.tokenizer.encode(r.prompt, chat=True) for r in ShareGPT(n=a.requests, seed=0)(lm)]
    capacity = max(map(len, prompts)) + a.new + 16  # (room for a verify's lookahead)
    hf = hf_model_for(lm)
    hf_generate_batch(hf, [prompts[0][:16]], [4])  # warm-up, untimed
    rows = []
    for i, b in enumerate(a.backends):
        factory, greedy_tokens = cache_backend(b), None
        for d in a.decoders:
            def decoder():  # the int8 self-draft at its defaults (gamma 8), caching through the target's backend
                if d == "tree":  # prompt lookup's tree, depth 4, width 3 (conf/decoder/tree.yaml)
                    return TreeSpeculativeDecoder(prompt_lookup(), depth=4, width=3)
                return greedy() if d == "greedy" else SpeculativeDecoder(quantized_self(lm, "int8", cache=factory))
            # sliding's rollback (8 by default) raised to a tree's 12 nodes
            rows_of = cache_backend(b, rollback=12) if d == "tree" and b == "sliding" else factory
            engines = {m: Engine(lm.model, make_cache(lm.model, a.rows, capacity, rows_of), decoder(), compile=c)
                       for m, c in (("eager", False), ("compiled", True))}
            if a.flat:
                engines["compiled_flat"] = Engine(lm.model, make_cache(lm.model, a.rows, capacity, rows_of),
                                                  decoder(), compile=True, compile_flat=True)
            with_hf = i == 0 and d == "greedy"
            tok_s, tokens, compile_s, compiled_steps = {m: [] for m in [*engines, "transformers"]}, {}, 0.0, 0
            for _ in range(a.rounds):
                for m, e in engines.items():
                    r = e.run([Request(p, a.new, 0.0, j) for j, p in enumerate(prompts)])
                    tok_s[m].append(sum(len(x.tokens) for x in r.requests) / r.wall_s)
                    tokens[m] = [x.tokens for x in r.requests]
                    if m == "compiled":
                        compile_s, compiled_steps = max(compile_s, r.compile_s), r.compiled_steps
                if with_hf:
                    h = hf_generate_batch(hf, prompts, [a.new] * len(prompts))
                    tok_s["transformers"].append(sum(map(len, h["tokens"])) / h["wall_s"])
                    tokens["transformers"] = h["tokens"]
            if d == "greedy":
                greedy_tokens = tokens["eager"]
            med = {m: statistics.median(v) for m, v in tok_s.items() if v}
            rows.append({"backend": b, "decoder": d, "output_tok_s": med,
                         "compiled_over_eager": med["compiled"] / med["eager"],
                         **({"compiled_over_transformers": med["compiled"] / med["transformers"],
                             "eager_over_transformers": med["eager"] / med["transformers"],
                             "same_as_transformers": tokens["eager"] == tokens["transformers"]} if with_hf else {}),
                         "compiled_same_as_eager": tokens["compiled"] == tokens["eager"],
                         **({"flat_over_eager": med["compiled_flat"] / med["eager"],
                             "flat_same_as_eager": tokens["compiled_flat"] == tokens["eager"]} if a.flat else {}),
                         **({"same_as_greedy_engine": tokens["eager"] == greedy_tokens}
                            if d != "greedy" and greedy_tokens is not None else {}),
                         "rounds": tok_s, "compile_s": compile_s, "compiled_steps_last_run": compiled_steps})
            print(json.dumps(rows[-1]), flush=True)
    cond = {**run_conditions(lm.model), "requests": a.requests, "rows": a.rows, "new_tokens": a.new,
            "prompt_tokens": [len(p) for p in prompts]}
    print(json.dumps({"conditions": cond}))


def step_times(batches=(1, 8), steps: int = 20, threads: int = 2) -> None:
    """One decode step, compiled (static step, replayed) against eager (the model's forward),
    per batch size, dense cache, 60-token rows; median-free mean over `steps` after 3 warm-ups."""
    import time

    import torch

    from decodelab.cache.dense import DenseCache
    from decodelab.decoding import make_cache, prefill
    from decodelab.decoding.compiled import compiled_step
    from decodelab.models import load

    torch.set_num_threads(threads)
    m = load("smollm2-135m", device="cpu").model
    for B in batches:
        prompts = [[5 + i] * 60 for i in range(B)]
        last = torch.zeros(B, dtype=torch.long)
        static = compiled_step(m, make_cache(m, B, 256, DenseCache))
        prefill(m, static.cache, prompts)
        eager = make_cache(m, B, 256, DenseCache)
        prefill(m, eager, prompts)
        out = {}
        with torch.no_grad():
            for name, fn in (("compiled", lambda: static.step(last)),
                             ("eager", lambda: m(last[:, None], eager.lengths[:, None], eager))):
                for _ in range(3):
                    fn()
                t = time.perf_counter()
                for _ in range(steps):
                    fn()
                out[name + "_ms"] = 1e3 * (time.perf_counter() - t) / steps
        print(json.dumps({"batch": B, **out}), flush=True)


def verify_times(contexts=(53, 200), tokens=(1, 5, 9), steps: int = 15, rounds: int = 3, threads: int = 2) -> None:
    """One forward of T tokens at batch 1 (a speculative verify's shape) after `contexts`
    tokens, dense cache: the compiled static step of T tokens against the model's eager
    forward (oneDNN's multi-row products), rolled back after each; the two alternate
    `rounds` times, `steps` forwards each after 3 warm-ups; median of the rounds' means."""
    import time

    import torch

    from decodelab.cache.dense import DenseCache
    from decodelab.decoding import make_cache, prefill
    from decodelab.decoding.compiled import compiled_step
    from decodelab.models import load

    torch.set_num_threads(threads)
    m = load("smollm2-135m", device="cpu").model
    for ctx in contexts:
        for T in tokens:
            ids = torch.full((1, T), 7)
            static = compiled_step(m, make_cache(m, 1, 512, DenseCache), tokens=T)
            eager = make_cache(m, 1, 512, DenseCache)
            for c in (static.cache, eager):
                prefill(m, c, [[5] * ctx])
            L = eager.lengths.clone()

            def compiled():
                static.cache.truncate(L)
                return static.step(ids)

            def plain():
                eager.truncate(L)
                return m(ids, L[:, None] + torch.arange(T), eager)

            ms = {"compiled": [], "eager": []}
            with torch.no_grad():
                for _ in range(rounds):
                    for name, fn in (("compiled", compiled), ("eager", plain)):
                        for _ in range(3):
                            fn()
                        t = time.perf_counter()
                        for _ in range(steps):
                            fn()
                        ms[name].append(1e3 * (time.perf_counter() - t) / steps)
            print(json.dumps({"context": ctx, "tokens": T, **{k + "_ms": statistics.median(v) for k, v in ms.items()},
                              "rounds": ms}), flush=True)


if __name__ == "__main__":
    main()


def runner_times(steps: int = 10, rounds: int = 3, threads: int = 2, rows: int = 8) -> None:
    """One engine-shaped forward, dense cache of `rows` rows at 60 tokens each: the compiled
    flat runner (decoding/runner.py) against the eager `forward_segments`, and, for a step in
    which every row decodes, the compiled static step; shapes: every row decodes, 3 rows
    decode, every row decodes beside a 56-token prefill chunk (one row's), a 128-token chunk
    alone. Rolled back after each forward; the paths alternate `rounds` times, `steps`
    forwards each after 2 warm-ups; median of the rounds' means. Prints each bucket's
    compile time first."""
    import time

    import torch

    from decodelab.cache.dense import DenseCache
    from decodelab.decoding import make_cache, prefill
    from decodelab.decoding.compiled import compiled_step
    from decodelab.decoding.runner import ModelRunner
    from decodelab.experiments.harness import run_conditions
    from decodelab.models import load
    from decodelab.models.transformer import Segment

    torch.set_num_threads(threads)
    m = load("smollm2-135m", device="cpu").model
    prompts = [[5 + i] * 60 for i in range(rows)]
    caches = {k: make_cache(m, rows, 512, DenseCache) for k in ("flat", "eager", "static")}
    runner = ModelRunner(m, caches["flat"], compile=True, max_tokens=128)
    print(json.dumps({"compile_s_per_bucket": {n: round(s, 1) for n, s in runner.warm().items()}}), flush=True)
    static = compiled_step(m, caches["static"])
    for c in caches.values():
        prefill(m, c, prompts)
    L = caches["eager"].lengths.clone()

    def decode(rs):
        rs = list(rs)
        return Segment(torch.full((len(rs), 1), 7), L[rs][:, None].clone(), None, rs,
                       torch.zeros(len(rs), 1, dtype=torch.long))

    def chunk(row, n):  # row's next n tokens (the row decodes nothing in that step)
        return Segment(torch.full((1, n), 9), L[row] + torch.arange(n)[None], None, [row], torch.tensor([[n - 1]]))

    shapes = {"decode_all": [decode(range(rows))], "decode_3": [decode(range(3))],
              "decode_7_chunk_56": [decode(range(rows - 1)), chunk(rows - 1, 56)],
              "chunk_128": [chunk(0, 128)]}
    last = torch.full((rows,), 7)
    for name, segs in shapes.items():
        paths = {"flat": lambda: runner.forward_segments(segs),
                 "eager": lambda: m.forward_segments(segs, caches["eager"])}
        if name == "decode_all":
            paths["static"] = lambda: static.step(last)
        ms = {p: [] for p in paths}
        with torch.no_grad():
            for _ in range(rounds):
                for p, fn in paths.items():
                    c = caches[p]
                    for i in range(steps + 2):
                        if i == 2:
                            t = time.perf_counter()
                        fn()
                        c.truncate(L)
                    ms[p].append(1e3 * (time.perf_counter() - t) / steps)
        med = {p + "_ms": round(statistics.median(v), 2) for p, v in ms.items()}
        print(json.dumps({"shape": name, "tokens": sum(int(s.ids.numel()) for s in segs), **med,
                          "flat_over_eager": round(med["flat_ms"] / med["eager_ms"], 3)}), flush=True)
    print(json.dumps({"conditions": {**run_conditions(m), "rows": rows, "context": 60}}))


def paged_times(contexts=(60, 1000), batches=(1, 8), capacity: int = 1280, steps: int = 10, rounds: int = 3,
                threads: int = 2) -> None:
    """One compiled paged decode step (block size 16, `capacity` slots a row): the native
    kernel reading the pools in place through the block table (decodelab::paged_decode_attention,
    today's path) against the earlier path that gathered every slot the table addresses
    row-major first (`gather_rows`, then decodelab::decode_attention), each compiled on its
    own (torch.compiler.reset between); alternated `rounds` times, `steps` steps each after
    2 warm-ups, rolled back after each; median of the rounds' means."""
    import functools
    import time

    import torch

    from decodelab.cache import static
    from decodelab.cache.kernels.paged import gather_rows
    from decodelab.cache.paged import PagedCache
    from decodelab.decoding import make_cache, prefill
    from decodelab.decoding.compiled import compiled_step
    from decodelab.experiments.harness import run_conditions
    from decodelab.models import load

    torch.set_num_threads(threads)
    m = load("smollm2-135m", device="cpu").model
    in_place = static.StaticPlan.attend_pools

    def gathered(self, layer, q, k, v):  # the path before the in-place kernel
        k_pool, v_pool = self.storage.k[layer], self.storage.v[layer]
        for pool, new in ((k_pool, k), (v_pool, v)):
            pool[self.heads[..., None], self.blk[:, None], self.off[:, None]] = new
        bs, table, lay = self.storage.block_size, self.storage.table, self.layout
        keys, values = gather_rows(k_pool, table, bs), gather_rows(v_pool, table, bs)
        return torch.ops.decodelab.decode_attention(q, keys, values, self.pos, lay.softmax_scale,
                                                    lay.windows[layer] or 0)

    for ctx in contexts:
        for B in batches:
            made, last = {}, torch.zeros(B, dtype=torch.long)
            for name, fn in (("in_place", in_place), ("gathered", gathered)):
                torch.compiler.reset()  # a compile of its own: the graph traces `fn`
                static.StaticPlan.attend_pools = fn
                try:
                    st = compiled_step(m, make_cache(m, B, capacity, functools.partial(PagedCache, block_size=16)))
                    prefill(m, st.cache, [[5 + i] * ctx for i in range(B)])
                    held = st.cache.lengths.clone()
                    with torch.no_grad():
                        st.step(last)  # guarded: traced now, with `fn`; later steps replay that graph
                        st.step(last)
                    st.cache.truncate(held)
                finally:
                    static.StaticPlan.attend_pools = in_place
                made[name] = st
            ms = {k: [] for k in made}
            with torch.no_grad():
                for _ in range(rounds):
                    for k, st in made.items():
                        held = st.cache.lengths.clone()
                        for i in range(steps + 2):
                            if i == 2:
                                t = time.perf_counter()
                            st.step(last)
                            st.cache.truncate(held)
                        ms[k].append(1e3 * (time.perf_counter() - t) / steps)
            r = {"context": ctx, "batch": B, "capacity": capacity,
                 **{k + "_ms": round(statistics.median(v), 2) for k, v in ms.items()}}
            r["in_place_over_gathered"] = round(r["in_place_ms"] / r["gathered_ms"], 3)
            print(json.dumps(r), flush=True)
    print(json.dumps({"conditions": run_conditions(m)}))
