"""experiments.bench end to end on tiny models: a sweep into a report, skipping finished
runs, surviving kill -9, bad configs refused whole; and its metrics in process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from decodelab.experiments.bench import RESULTS, config_hash, run, vs_greedy, vs_transformers
from decodelab.experiments.report import load_runs
from decodelab.models.loading import CONF_DIR

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model=tiny-llama", "model.device=cpu", "draft.layers=1", "progress=false", "warmup=false"]


@pytest.fixture
def prompts(tmp_path) -> Path:
    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": p}) for p in ("Write a haiku about the sea.",
                                                                 "Name three prime numbers and why.")) + "\n")
    return f


def bench(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "decodelab.experiments.bench", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, **kw)


def results(root: Path) -> dict[Path, dict]:
    """Finished runs under root: results file -> its summary line."""
    return {f: json.loads(f.read_text().splitlines()[-1]) for f in root.rglob(RESULTS)}


@pytest.mark.slow  # 23 s in the default run on a 2-core Zen 3 (session 50)
def test_sweep_every_cache_and_decoder_into_a_report_then_rerun_skips(tmp_path, prompts):
    sweep = tmp_path / "sweep"
    # prompts of 200 tokens: past int4's exact residual (112) by more than a group (64), so int4 quantizes
    args = ["-m", *TINY, "workload=synthetic", "workload.lengths=[200]", "workload.per_length=2", "max_new_tokens=6",
            "cache=dense,paged,int4,sliding", "decoder=greedy,speculative", f"hydra.sweep.dir={sweep}"]
    p = bench(*args)
    assert p.returncode == 0, p.stderr[-3000:]
    runs = results(sweep)
    assert len(runs) == 8
    dense_mib = {s["setup"]["decoder"]: s["metrics"]["kv_mib"] for s in runs.values() if s["setup"]["cache"] == "dense"}
    for f, s in runs.items():
        m, lines = s["metrics"], f.read_text().splitlines()
        assert s["kind"] == "summary" and len(lines) == 3  # 2 prompts + the summary
        assert m["prompts"] == 2 and m["new_tokens"] == 12 and m["ttft_ms"] > 0 and m["kv_mib"] > 0
        if s["setup"]["cache"] == "int4":  # quantized K/V: logits move, the kept bytes shrink
            assert 1e-4 < m["agree_max_abs_dlogit"] < 1.0 and m["agree_top1"] >= 0.8
            # 200 tokens: 64 quantized, the newest 136-142 exact in fp32 (in a buffer with up to a
            # sixteenth of room for appends, cache/int4.py), against dense's 206 fp32 slots
            assert m["kv_mib"] < 0.8 * dense_mib[s["setup"]["decoder"]]
        else:
            assert m["agree_top1"] == 1.0 and m["agree_max_abs_dlogit"] <= 1e-4
        spec = s["setup"]["decoder"] == "speculative"
        assert (m["acceptance_rate"] is not None) == spec and (s["setup"]["gamma"] == 4) == spec
        for line in lines[:-1]:
            rec = json.loads(line)
            if s["setup"]["cache"] != "int4":  # greedy and greedy speculative: dense's argmax
                assert rec["agreement"]["first_diff"] is None
            assert len(rec["itl_ms"]) == len(rec["context"]) == rec["new_tokens"] - 1
            assert rec["ttft_ms"] >= rec["tokenize_ms"] + rec["prefill_ms"]
    md = (sweep / "report.md").read_text()
    assert sum(line.startswith("| ") for line in md.splitlines()) == 8 + 1  # header + one row per run
    assert (sweep / "report.csv").is_file() and (sweep / "ttft_vs_prompt_len.png").is_file()
    for cache in ("dense", "paged", "int4", "sliding"):
        assert f"| {cache}/greedy |" in md and f"| {cache}/speculative/early-exit |" in md

    before = {f: f.stat().st_mtime_ns for f in runs}
    again = bench(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (again.stdout + again.stderr).count("already done") == 8
    assert {f: f.stat().st_mtime_ns for f in results(sweep)} == before
    assert len(load_runs(sweep)) == 8


@pytest.mark.slow  # 12 s (CI runs the slow set after the default one)
def test_kill_9_mid_sweep_keeps_finished_runs_and_the_rerun_completes_the_rest(tmp_path, prompts):
    sweep = tmp_path / "sweep"
    args = ["-m", *TINY, "workload=jsonl", f"workload.path={prompts}", "max_new_tokens=40",
            "cache=dense,paged,int4,sliding", f"hydra.sweep.dir={sweep}"]
    proc = subprocess.Popen([sys.executable, "-m", "decodelab.experiments.bench", *args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while not results(sweep) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = results(sweep)
    assert 1 <= len(done) < 4, "the kill should land mid-sweep"
    assert not list(sweep.rglob("*.tmp"))[1:]  # at most the one being written, never a half results.jsonl
    before = {f: f.stat().st_mtime_ns for f in done}

    p = bench(*args)
    assert p.returncode == 0, p.stderr[-3000:]
    assert (p.stdout + p.stderr).count("already done") == len(done)
    after = results(sweep)
    assert len(after) == 4 and all(after[f]["run"] == done[f]["run"] for f in done)
    assert {f: f.stat().st_mtime_ns for f in done} == before
    runs = load_runs(sweep)
    assert len(runs) == 4 and len({r["run"] for r in runs}) == 4


@pytest.mark.slow  # 5.6 s in the default run on a 2-core Zen 3 (session 50)
def test_bad_config_fails_fast_with_every_reason_and_no_traceback():
    t = time.perf_counter()
    p = bench("cache=pagd", "decoder=speculative", "decoder.gamma=0", "decoder.temperature=-1")
    p2 = bench("cache=int4", "cache.nbits=3", "decoder=speculative", "decoder.gamma=0", "decoder.temperature=-1")
    elapsed = time.perf_counter() - t
    for proc, n in ((p, 3), (p2, 3)):
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert f"invalid setup ({n} problem(s))" in proc.stderr, proc.stderr
    assert "no such cache; the options are dense, dense-bf16, dense-fp16, dense-fp8, int4, paged, paged-fp8, sliding" in p.stderr
    assert "nbits must be one of [2, 4]" in p2.stderr and "gamma must be" in p2.stderr
    assert "Loading weights" not in p.stderr + p2.stderr
    print(f"two refused configs in {elapsed:.1f} s")


def config(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def test_batch_rows_and_side_by_side_greedy(tmp_path, prompts):
    cfg = config(*[a for a in TINY if not a.startswith("draft.")], "workload=jsonl", f"workload.path={prompts}",
                 "max_new_tokens=8", "batch_size=2", "decoder=speculative", "draft=prompt-lookup",
                 "compare_greedy=true", "cache=paged")
    s = run(cfg, tmp_path)
    recs = [json.loads(x) for x in (tmp_path / RESULTS).read_text().splitlines()[:-1]]
    assert [r["prompt_id"] for r in recs] == ["prompts-0", "prompts-1"]
    assert all(r["greedy"]["identical"] for r in recs)  # greedy speculative == greedy, row by row
    m = s["metrics"]
    assert m["greedy_identical"] == 1.0 and m["speedup_vs_greedy"] > 0 and m["c_verify"] > 0
    # not under Hydra: the target
    assert s["conditions"]["batch"] == 2 and s["setup"]["cache"] == "decodelab.cache.paged.PagedCache"


def test_compiled_draft_steps_in_a_bench_run(tmp_path, monkeypatch):
    """draft.compile=true (dynamo's eager backend here, for speed): one compile shared by
    prompts of different lengths (rounded capacities), output identical to greedy, the
    compile time recorded apart from TTFT."""

    from decodelab.decoding import compiled

    calls = []
    real = compiled.StaticDecoder.__init__
    monkeypatch.setattr(compiled.StaticDecoder, "__init__",
                        lambda self, model, cache, **kw: calls.append(cache.capacity) or real(self, model, cache, **kw))
    monkeypatch.setattr(sys.modules["decodelab.decoding.runner"], "BACKEND", "eager")  # every runner's (the draft's)
    cfg = config(*TINY, "warmup=true", "workload=synthetic", "workload.lengths=[12,30]", "max_new_tokens=6",
                 "decoder=speculative", "draft=early-exit", "draft.compile=true", "compare_greedy=true",
                 "agree_with_dense=false")
    s = run(cfg, tmp_path)
    recs = [json.loads(x) for x in (tmp_path / RESULTS).read_text().splitlines()[:-1]]
    assert all(r["greedy"]["identical"] for r in recs) and len(recs) == 2
    assert set(calls) == {256}  # the warm-up and both prompts: one capacity, one compiled shape
    assert all(r["compile_ms"] > 0 for r in recs) and s["metrics"]["greedy_identical"] == 1.0
    import decodelab.experiments.bench as bench_module

    monkeypatch.setattr(bench_module, "choices", lambda: {"cache": "dense", "decoder": "speculative",
                                                          "draft": "early-exit"})
    named = bench_module.describe(cfg)  # under Hydra: the group choices, and what compiles
    assert named["draft"] == "early-exit (compiled)" and named["name"] == "dense/speculative/early-exit (compiled)"
    greedy_compiled = config(*TINY, "compile=true")
    monkeypatch.setattr(bench_module, "choices", lambda: {"cache": "dense", "decoder": "greedy"})
    assert bench_module.describe(greedy_compiled)["name"] == "dense/greedy (compiled)"
    head = config(*[o for o in TINY if not o.startswith("draft.")], "decoder=speculative", "draft=int8-self",
                  "draft.weights.quantize_head=true", "draft.compile=true")
    monkeypatch.setattr(bench_module, "choices", lambda: {"cache": "dense", "decoder": "speculative",
                                                          "draft": "int8-self"})
    assert bench_module.describe(head)["draft"] == "int8-self+head (compiled)"  # a quantized head: named apart
    own = config(*[o for o in TINY if not o.startswith("draft.")], "decoder=speculative", "draft=int8-self",
                 "draft.compile=true", "draft.cache=dense")
    assert bench_module.describe(own)["draft"] == "int8-self (compiled, dense cache)"  # its own cache: named


@pytest.mark.slow  # 3.4 s in the default run on a 2-core Zen 3 (session 50)
def test_side_by_side_with_transformers_generate(tmp_path):
    """compare_transformers (the `baseline` preset): transformers' generate() on the same
    ids, EOS ignored on both sides: the same tokens, its timings beside ours."""
    cfg = config(*TINY, "workload=synthetic", "workload.lengths=[12,20]", "max_new_tokens=5", "ignore_eos=true",
                 "compare_transformers=true", "agree_with_dense=false")
    m = run(cfg, tmp_path)["metrics"]
    recs = [json.loads(x) for x in (tmp_path / RESULTS).read_text().splitlines()[:-1]]
    assert [r["transformers"]["new_tokens"] for r in recs] == [5, 5] and m["new_tokens"] == 10
    assert m["same_tokens_as_hf"] == 1.0 and all(r["transformers"]["identical"] for r in recs)
    assert m["hf_decode_tok_s"] > 0 and m["hf_ttft_ms"] > 0 and m["decode_speedup_vs_hf"] > 0
    bad = bench(*TINY, "compare_transformers=true", "batch_size=2")
    assert bad.returncode == 2 and "use batch_size=1" in bad.stderr


def test_side_by_side_figures_by_hand():
    """vs_greedy and vs_transformers on made-up records, every figure worked out by hand:
    a plain step is 2.0 s / 10 steps = 0.2 s, so c_draft = 0.16 / 8 / 0.2 = 0.1 and
    c_verify = 0.8 / 2 / 0.2 = 2; alpha 0.5 at gamma 4 gives (1 - 0.5^5) / 0.5 = 1.9375
    tokens per call: Leviathan 1.9375 / 1.4, with the measured verify cost 1.9375 / 2.4."""
    recs = [{"decode_s": 1.0, "greedy": {"decode_s": 2.0, "new_tokens": 11, "identical": True},
             "spec_stats": {"target_calls": 2, "mean_gamma": 4, "time_draft_s": 0.16, "time_verify_s": 0.8,
                            "alpha": 0.5}}]
    m = vs_greedy(recs)
    assert m["speedup_vs_greedy"] == 2.0 and m["greedy_identical"] == 1.0
    assert m["c_draft"] == pytest.approx(0.1) and m["c_verify"] == pytest.approx(2.0)
    assert m["predicted_leviathan"] == pytest.approx(1.383929, rel=1e-6)
    assert m["predicted_this_hw"] == pytest.approx(0.807292, rel=1e-6)
    assert m["efficiency"] == pytest.approx(2.477419, rel=1e-6)
    hf = vs_transformers([{"decode_s": 0.4, "new_tokens": 5, "ttft_ms": 10.0, "transformers": {
        "decode_s": 0.8, "new_tokens": 5, "ttft_ms": 20.0, "identical": True}}])
    assert hf == {"hf_ttft_ms": 20.0, "hf_decode_tok_s": 5.0, "same_tokens_as_hf": 1.0, "decode_speedup_vs_hf": 2.0,
                  "ttft_ours_over_hf": 0.5}


def test_config_hash_ignores_bookkeeping_only():
    a = config(*TINY)
    assert config_hash(a) == config_hash(config(*TINY, "redo=true", "name=other", "progress=true"))
    assert config_hash(a) != config_hash(config(*TINY, "cache=paged"))
    assert config_hash(a) != config_hash(config(*TINY, "max_new_tokens=7"))


def test_config_hash_takes_cpu_wrapper_only_where_it_is_set():
    """cpu_wrapper (added in session 50) at its default leaves the hash a config had before the
    option existed, so a sweep finds its earlier runs; a wrapper chosen is a setup of its own."""
    from omegaconf import open_dict

    a, before = config(*TINY), config(*TINY)
    with open_dict(before):
        del before["cpu_wrapper"]
    assert "cpu_wrapper" in a and config_hash(a) == config_hash(before)
    assert config_hash(config(*TINY, "cpu_wrapper=python")) not in (config_hash(a),
                                                                    config_hash(config(*TINY, "cpu_wrapper=cpp")))


@pytest.mark.slow  # local: 14 s in the default run on a 2-core Zen 3, 12.9 s in CI's (session 50)
@pytest.mark.parametrize("launcher", ["local", "parallel"])
def test_sweep_through_the_cluster_and_parallel_launchers(tmp_path, prompts, launcher):
    """`local`: submitit's local executor, i.e. the Slurm launcher's code path (pickled
    jobs, job folders) on this machine; `parallel`: joblib processes."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher" if launcher == "local"
                        else "hydra_plugins.hydra_joblib_launcher")
    sweep = tmp_path / "sweep"
    p = bench("-m", f"hydra/launcher={launcher}", *TINY, "threads=1", "workload=jsonl", f"workload.path={prompts}",
              "max_new_tokens=4", "cache=dense,paged", f"hydra.sweep.dir={sweep}")
    assert p.returncode == 0, p.stderr[-3000:]
    runs = results(sweep)
    assert sorted(s["setup"]["cache"] for s in runs.values()) == ["dense", "paged"]
    assert all(s["metrics"]["new_tokens"] == 8 for s in runs.values())
    assert (sweep / "report.md").is_file()
    if launcher == "local":
        assert list((sweep / ".submitit").rglob("*_result.pkl"))  # went through submitit's job folders


def test_the_tree_decoder_through_the_bench(tmp_path, prompts):
    """decoder=tree draft=prompt-lookup: greedy speculative over a tree of drafts, identical
    to greedy row by row, on a paged cache."""
    cfg = config(*[a for a in TINY if not a.startswith("draft.")], "workload=jsonl", f"workload.path={prompts}",
                 "max_new_tokens=8", "batch_size=2", "decoder=tree", "draft=prompt-lookup", "decoder.width=2",
                 "compare_greedy=true", "cache=paged")
    s = run(cfg, tmp_path)
    recs = [json.loads(x) for x in (tmp_path / RESULTS).read_text().splitlines()[:-1]]
    assert all(r["greedy"]["identical"] for r in recs)
    assert s["metrics"]["greedy_identical"] == 1.0
    assert s["setup"]["decoder"] == "decodelab.decoding.tree_speculative.TreeSpeculativeDecoder"
