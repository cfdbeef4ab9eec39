"""experiments.agree: the agreement matrix on the tiny models (exact setups pass, int4
figures are reported), its exit codes (1: a threshold exceeded, 2: a bad config with
every reason, before weights load), and (slow) SmolLM2-135M against transformers."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from decodelab.cache.dense import DenseCache
from decodelab.cache.paged import PagedCache
from decodelab.decoding.agreement import first_diff, forced_logits, verify_forced_logits
from decodelab.experiments.agree import compose_setup, run, split_overrides
from decodelab.experiments.report import read_results
from decodelab.models.loading import CONF_DIR
from tests.conftest import random_ids

ROOT = Path(__file__).resolve().parents[2]
# one thread: on a busy 2-core CPU, two threads on tiny matrices spin against each other (~15x slower)
TINY_LLAMA = ["model=tiny-llama", "model.device=cpu", "draft.layers=1", "workload=synthetic", "threads=1"]
# int4 that really quantizes short tiny sequences: blocks of 32 behind an exact residual of 8
INT4_SMALL = ["++cache.residual=8", "++cache.group_size=32", "++cache.rollback=8"]
REPLIES = [
    {"prompt": "What is a KV cache, in two sentences?",
     "reference": "A KV cache keeps the keys and values of the tokens already processed, so each decoding step "
                  "attends over stored entries instead of recomputing the whole sequence. It trades memory for "
                  "speed, which is why its size grows with the context length."},
    {"prompt": "Write a haiku about autumn leaves.",
     "reference": "Red leaves drift and fall,\nwhispering to the cold ground,\nthe year exhales slow.\n\n"
                  "Each leaf is a letter the tree writes to the wind before the long silence of winter."},
]


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread (see TINY_LLAMA; SmolLM2 too: 60 ms a decode step here against
    0.5 s with two on a busy CPU); restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def agree(tmp_path: Path, *overrides: str) -> tuple[int, dict | None]:
    """Run the matrix in-process: (exit code, its results.jsonl as a matrix or None)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="agree", overrides=list(overrides))
    code = run(cfg, list(overrides), tmp_path)
    return code, matrix(tmp_path)


def matrix(out: Path) -> dict | None:
    """results.jsonl read back as report reads it: {reference, passed, rows (+ per_prompt)}."""
    if not (out / "results.jsonl").is_file():
        return None
    runs = read_results(out / "results.jsonl")
    rows = [{**r["metrics"], "setup": r["setup"]["name"], "per_prompt": r["prompts"]} for r in runs]
    return {"reference": runs[0]["setup"]["reference"], "passed": all(r["passed"] for r in rows), "rows": rows}


def cli(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "decodelab.experiments.agree", *overrides], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def rows(doc: dict) -> dict[str, dict]:
    return {r["setup"]: r for r in doc["rows"]}


def jsonl(tmp_path: Path, records: list[dict]) -> Path:
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in records))
    return f


def test_exact_setups_pass_on_tiny_llama(tmp_path, capsys):
    exact = ["dense", "paged", "sliding", "speculative-dense", "speculative-paged", "speculative-sliding"]
    code, doc = agree(tmp_path, *TINY_LLAMA, "workload.lengths=[9,30]", "forced_tokens=12", "free_tokens=8",
                      f"setups=[{','.join(exact)},sampling-dense]")
    out = capsys.readouterr().out
    assert code == 0, out
    r = rows(doc)
    for name in exact:
        assert r[name]["passed"] and r[name]["max_abs_dlogit"] <= 1e-4 and r[name]["top1"] == 1.0
        assert r[name]["first_diff"] is None and r[name]["positions"] == 24  # 2 prompts x 12 forced
        assert all(p["teacher"] == "greedy" for p in r[name]["per_prompt"])  # synthetic: no replies
    assert r["speculative-paged"]["per_prompt"][0]["decoder_stats"]["target_calls"] > 0
    assert r["sampling-dense"]["sampled"] and r["sampling-dense"]["passed"]  # its first diff is not judged
    assert "| speculative-paged |" in out and "PASS" in out and "FAIL" not in out
    assert "| setup | max abs dlogit | mean KL | top1 | first diff | thresholds | result |" in out
    assert (tmp_path / "agree.md").read_text().count("PASS") == len(exact) + 1


def test_windows_and_replies_on_tiny_gemma3_vs_transformers(tmp_path):
    # chat prompt (~20 tokens) + 24 reply tokens runs well past the tiny Gemma's window of 16
    code, doc = agree(tmp_path, "model=tiny-gemma3", "model.device=cpu", "draft.layers=1", "workload=jsonl",
                      f"workload.path={jsonl(tmp_path, REPLIES[:1])}", "reference=transformers",
                      "forced_tokens=24", "free_tokens=6", "setups=[dense,sliding,speculative-sliding,paged]")
    assert code == 0
    for r in doc["rows"]:
        assert r["passed"] and r["max_abs_dlogit"] <= 1e-4, r
        assert r["per_prompt"][0]["teacher"] == "reply" and r["per_prompt"][0]["prompt_tokens"] + 24 > 16
    assert doc["reference"] == "transformers"


def test_int4_figures_are_reported(tmp_path, capsys):
    code, doc = agree(tmp_path, *TINY_LLAMA, *INT4_SMALL, "workload.lengths=[100]", "forced_tokens=24",
                      "free_tokens=8", "setups=[int4,speculative-int4]")
    out = capsys.readouterr().out
    for r in doc["rows"]:
        assert r["thresholds"]["max_abs_dlogit"] is None and r["thresholds"]["max_kl"] == 0.05
        assert 0 < r["max_abs_dlogit"] < 10 and math.isfinite(r["mean_kl"]) and 0 <= r["top1"] <= 1  # quantized
        assert r["passed"] == (r["mean_kl"] <= 0.05 and r["top1"] >= 0.95)
        assert f"| {r['setup']} | {r['max_abs_dlogit']:.2e} |" in out
    assert code == (0 if all(r["passed"] for r in doc["rows"]) else 1)


@pytest.mark.slow  # 4.8 s in the default run on a 2-core Zen 3 (session 50)
def test_the_main_jobs_long_prompts_make_int4_kv_quantize_most_of_each_context(tmp_path):
    """workload=sharegpt-long (the main job's agreement panel): each forced position reads
    over half of its context quantized at int4's defaults (residual 112, flush 64), and the
    int4 row differs from dense; the default ShareGPT prompts (~55 tokens + 24 forced) sit
    inside the residual, where int4 is bit-identical to dense."""
    from decodelab.cache.base import CacheLayout
    from decodelab.experiments import harness

    tiny = ["model=tiny-llama", "model.device=cpu", "threads=1", "forced_tokens=24", "free_tokens=0",
            "setups=[dense,int4]"]
    _, long = agree(tmp_path / "long", *tiny, "workload=sharegpt-long")
    _, short = agree(tmp_path / "short", *tiny, "workload.n=2")
    long, short = rows(long), rows(short)
    lm = harness.load_model(compose_setup("int4", ["model=tiny-llama", "model.device=cpu"]))
    int4 = harness.cache_factory("int4")(CacheLayout.of(lm.model), 1, 8)
    for p in long["int4"]["per_prompt"]:
        first, last = p["prompt_tokens"] - 1, p["prompt_tokens"] + 22  # the positions predicting the 24 forced
        assert p["prompt_tokens"] >= 300 and int4.quantized_prefix(first) / (first + 1) > 0.6
        assert int4.quantized_prefix(last) / (last + 1) > 0.6
    assert long["int4"]["mean_kl"] > 0 and long["int4"]["max_abs_dlogit"] > 100 * long["dense"]["max_abs_dlogit"]
    assert all(p["prompt_tokens"] + 24 <= 112 for p in short["int4"]["per_prompt"])
    assert short["int4"]["max_abs_dlogit"] == short["dense"]["max_abs_dlogit"]  # never quantized
    assert short["int4"]["mean_kl"] == short["dense"]["mean_kl"]


def test_quantized_weight_setups_are_judged_against_the_fp32_reference(tmp_path):
    """int8-weights / int4-weights quantize a copy of the loaded model: their logits really
    differ from the reference's (which stays fp32: dense beside them is exact), by more
    for int4 than for int8, and each is judged by its own thresholds."""
    code, doc = agree(tmp_path, *TINY_LLAMA, "workload.lengths=[40]", "forced_tokens=16", "free_tokens=8",
                      "setups=[dense,int8-weights,int4-weights]")
    r = rows(doc)
    assert r["dense"]["passed"] and r["dense"]["max_abs_dlogit"] <= 1e-4  # the reference is not quantized
    for name in ("int8-weights", "int4-weights"):
        q = r[name]
        assert q["max_abs_dlogit"] > 1e-4 and math.isfinite(q["mean_kl"]) and q["mean_kl"] >= 0
        assert q["passed"] == (q["mean_kl"] <= q["thresholds"]["max_kl"] and q["top1"] >= q["thresholds"]["min_top1"])
    assert r["int4-weights"]["mean_kl"] > r["int8-weights"]["mean_kl"]
    assert code == (0 if all(x["passed"] for x in doc["rows"]) else 1)


@pytest.mark.parametrize("override", ["model.weights=int8", "weights=int8", "model.weights.kind=int8",
                                      "model.weights.group_size=32"])
def test_command_line_weights_cannot_replace_a_weights_setups_own(tmp_path, capsys, monkeypatch, override):
    """The target's weights on the command line (a kind, a conf/weights preset, a field of
    what they are) would relabel what int4-weights measures and quantize the reference:
    refused before the weights load, the fix named."""
    import decodelab.models.loading as loading

    monkeypatch.setattr(loading, "random_model", lambda *a, **k: pytest.fail("weights were loaded"))
    code, _ = agree(tmp_path, *TINY_LLAMA, override, "setups=[dense,int4-weights]")
    assert code == 2
    err = capsys.readouterr().err
    assert f"{override}: setups ['int4-weights'] choose their own weights" in err
    assert "leave those setups out" in err


def test_command_line_says_how_a_weights_setups_weights_compute(tmp_path, monkeypatch):
    """model.weights.prefill_dtype / .kernel: how the quantized copies compute, which
    the weights setups leave open: the command line sets them for those copies (the
    reference stays fp32)."""
    import decodelab.experiments.agree as agree_mod

    made = []
    real = agree_mod.setup_models

    def spy(cfg, composed, lm):
        out = real(cfg, composed, lm)
        made.extend(m.weight_quantization for m in out.values() if hasattr(m, "weight_quantization"))
        return out

    monkeypatch.setattr(agree_mod, "setup_models", spy)
    code, doc = agree(tmp_path, *TINY_LLAMA, "workload.lengths=[40]", "forced_tokens=8", "free_tokens=2",
                      "model.weights.prefill_dtype=bfloat16", "model.weights.kernel=torch",
                      "setups=[dense,int8-weights]")
    assert code in (0, 1) and rows(doc)["dense"]["max_abs_dlogit"] <= 1e-4  # the reference is not quantized
    assert [(w["prefill_dtype"], w["kernel"]) for w in made] == [("bfloat16", "torch")]


@pytest.mark.slow  # 7.8 s in the default run on a 2-core Zen 3 (session 50)
def test_an_impossible_threshold_exits_1(tmp_path):
    p = cli(*TINY_LLAMA, *INT4_SMALL, "workload.lengths=[100]", "forced_tokens=16", "free_tokens=0",
            "setups=[int4]", "agreement.max_abs_dlogit=1e-9", f"hydra.run.dir={tmp_path}")
    assert p.returncode == 1, p.stderr
    assert "FAIL int4: max |dlogit|" in p.stdout and "| int4 |" in p.stdout
    assert matrix(tmp_path)["passed"] is False


BAD = ["model=tiny-llama", "workload=synthetic", "workload.lengths=[]", "setups=[dense,nope,speculative-paged]",
       "reference=hf", "forced_tokens=0", "decoder.temperature=-1", "agreement.min_top1=2", "cache=paged"]


@pytest.mark.slow  # 5.9 s in the default run on a 2-core Zen 3 (session 50)
def test_bad_config_exits_2_with_every_reason_and_no_traceback(tmp_path):
    p = cli(*BAD, f"hydra.run.dir={tmp_path}")
    assert p.returncode == 2
    assert "Traceback" not in p.stderr + p.stdout
    for reason in ["unknown setup(s) ['nope']", "reference must be one of", "forced_tokens must be",
                   "workload.lengths", "setup dense: temperature", "setup speculative-paged: temperature",
                   "setup dense: agreement.min_top1", "cache=paged: each setup chooses its own cache"]:
        assert reason in p.stderr, reason
    p = cli("model=nope", "setups=[dense]")  # caught before Hydra composes (experiments.cli.precheck)
    assert p.returncode == 2 and "model=nope: no such model" in p.stderr and "Traceback" not in p.stderr


def test_bad_config_loads_no_weights(tmp_path, monkeypatch, capsys):
    import decodelab.models.loading as loading

    monkeypatch.setattr(loading, "random_model", lambda *a, **k: pytest.fail("weights were loaded"))
    code, doc = agree(tmp_path, *BAD)
    assert code == 2 and doc is None
    assert "9 problem(s)" in capsys.readouterr().err


def test_overrides_reach_the_setups_that_have_the_option():
    groups, values, problems = split_overrides(["model=tiny-llama", "draft.layers=2", "++cache.block_size=8",
                                                "setups=[dense]", "forced_tokens=3", "decoder=sampling"])
    assert groups == ["model=tiny-llama"] and problems == ["decoder=sampling: each setup chooses its own decoder; "
                                                           "pick setups with setups=[...] (an option of a setup's "
                                                           "decoder: ++decoder.OPTION=VALUE)"]
    paged, dense = compose_setup("speculative-paged", groups, values), compose_setup("dense", groups, values)
    assert paged.cache.block_size == 8 and paged.draft.layers == 2 and paged.model.name == "tiny-llama"
    assert "block_size" not in dense.cache and dense.cache._target_ == "decodelab.cache.dense.DenseCache"
    assert paged.agreement.free_identical is True and dense.setup_name == "dense"


@pytest.mark.parametrize("backend", [DenseCache, PagedCache])
def test_verification_feeding_matches_one_token_steps(tiny_llama, backend):
    """Teacher forcing in verify steps of gamma + 1 with rollbacks gives the logits of
    one-token steps (every kept-draft count 0..gamma occurs)."""
    m, prompt, seq = tiny_llama.model, random_ids(9), random_ids(23, seed=1)
    a, b = forced_logits(m, backend, prompt, seq), verify_forced_logits(m, backend, prompt, seq, gamma=3)
    assert a.shape == b.shape == (23, m.cfg.vocab_size)
    assert (a - b).abs().max() <= 1e-5


def test_first_diff():
    assert first_diff([1, 2, 3], [1, 2, 3]) is None
    assert first_diff([1, 2, 3], [1, 5, 3]) == 1
    assert first_diff([1, 2], [1, 2, 3]) == 2


@pytest.mark.slow
def test_smollm2_against_transformers_passes_exact_setups(tmp_path):
    from decodelab.experiments.workloads import FILLER

    # the second prompt is long enough (~250 tokens with the reply) for int4 to quantize
    # blocks behind its exact residual of 112
    long = {"prompt": FILLER * 3 + "Summarize the text above in one sentence.", "reference": REPLIES[0]["reference"]}
    code, doc = agree(tmp_path, "model=smollm2-135m", "model.device=cpu", "reference=transformers",
                      "workload=jsonl", f"workload.path={jsonl(tmp_path, [REPLIES[1], long])}", "forced_tokens=64",
                      "free_tokens=32", "setups=[dense,paged,sliding,speculative-paged,int4,int8-weights]")
    r = rows(doc)
    for name in ["dense", "paged", "sliding", "speculative-paged"]:
        assert r[name]["passed"], r[name]["failures"]
        assert r[name]["first_diff"] is None
    q = r["int4"]  # reported, judged by its own (lossy) thresholds
    assert q["max_abs_dlogit"] > 1e-2 and 0 <= q["top1"] <= 1 and math.isfinite(q["mean_kl"])  # it quantized
    w = r["int8-weights"]  # a quantized copy of the target against transformers' fp32: within its thresholds
    assert w["passed"], w["failures"]
    assert w["max_abs_dlogit"] > 1e-2 and w["top1"] >= 0.95 and 0 <= w["mean_kl"] <= 0.02
    assert code == (0 if q["passed"] else 1)
