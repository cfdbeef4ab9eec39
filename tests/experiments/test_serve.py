"""experiments.serve on the tiny model: the serving metrics of every run, side by side with
the static loop, results read by report; bad trace options refused before weights load."""

from __future__ import annotations

import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from decodelab.experiments.report import load_runs, read_results
from decodelab.experiments.serve import arrivals, check, run
from decodelab.models.errors import SetupError
from decodelab.models.loading import CONF_DIR

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model=tiny-llama", "model.device=cpu", "threads=1", "trace=synthetic", "requests=6",
        "synthetic.prompt_tokens=[8,40]", "synthetic.output_tokens=[4,12]", "compare_transformers=false",
        "max_running=3", "token_budget=16"]


def config(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name="serve", overrides=[*TINY, *overrides])


def test_serve_measures_every_backend_and_rate(tmp_path):
    run(config("rates=[inf,50]", "check_alone=6"), tmp_path)
    summaries = read_results(tmp_path / "results.jsonl")  # each with its request records as `prompts`
    assert [(s["setup"]["cache"], s["setup"]["rate"]) for s in summaries] == [
        ("dense", math.inf), ("dense", 50.0), ("paged", math.inf), ("paged", 50.0)]
    for s in summaries:
        m = s["metrics"]
        assert m["completed"] == 6 and m["rejected"] == 0 and m["output_tok_s"] > 0
        assert m["ttft_p50_ms"] <= m["ttft_p99_ms"] and m["queue_p50_ms"] >= 0 and m["max_running"] <= 3
        assert 0 < m["kv_util_max"] <= 1 and m["goodput_req_s"] <= m["requests_s"]
    assert summaries[0]["metrics"]["alone_identical"] == summaries[0]["metrics"]["alone_checked"] == 6
    prompts = [p for s in summaries for p in s["prompts"]]
    assert len(prompts) == 4 * 6 and all(len(p["token_times"]) == p["output_len"] for p in prompts)
    assert len(load_runs(tmp_path)) == 4  # report reads every run


def test_a_budget_below_a_request_rejects_it_and_serves_the_rest(tmp_path):
    run(config("backends=[dense]", "kv_budget_mb=0.004", "check_alone=0"), tmp_path)  # ~26 tokens of the tiny model
    m = read_results(tmp_path / "results.jsonl")[0]["metrics"]
    assert m["rejected"] > 0 and m["completed"] + m["rejected"] == 6


def test_poisson_arrivals_have_the_asked_rate():
    t = arrivals(4000, 5.0, seed=1)
    assert t[0] == 0.0 and t == sorted(t)
    assert abs(len(t) / t[-1] - 5.0) < 0.3
    assert arrivals(3, math.inf, 0) == [0.0, 0.0, 0.0]


def test_latency_percentiles_interpolate_linearly_as_vllm_does():
    """vLLM's benchmark_serving takes numpy's linear percentiles: TTFTs 1..4 ms in any order
    (a request without one left out) -> p50 at h 1.5 = 2.5 ms, p99 at h 2.97 = 3.97 ms."""
    from decodelab.experiments.serve import _pcts

    got = _pcts([0.004, 0.001, None, 0.003, 0.002], "ttft")
    assert got == {"ttft_p50_ms": pytest.approx(2.5), "ttft_p99_ms": pytest.approx(3.97)}
    assert _pcts([None], "tpot") == {"tpot_p50_ms": None, "tpot_p99_ms": None}


@pytest.mark.parametrize("override,msg", [("rates=[0]", "rates must be > 0"), ("token_budget=0", "token_budget"),
                                          ("policy=lifo", "policy must be one of"), ("trace=nope", "trace must be"),
                                          ("backends=[nosuch]", "does not exist"),
                                          ("synthetic.prompt_tokens=[9,3]", "synthetic.prompt_tokens"),
                                          ("compile=maybe", "backend dense: compile must be true or false")])
def test_bad_options_are_refused_before_weights_load(override, msg):
    with pytest.raises(SetupError, match=msg):
        check(config(override))


@pytest.mark.slow  # 3.0 s in the default run on a 2-core Zen 3 (session 50)
def test_console_script_refuses_with_exit_2_no_traceback_and_no_output_folder(tmp_path):
    p = subprocess.run([sys.executable, "-m", "decodelab.experiments.serve", *TINY, "rates=[-1]", "token_budget=0"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "rates must be > 0" in p.stderr and "token_budget" in p.stderr
    assert not (tmp_path / "outputs").exists()  # Hydra's run folder held only its log: removed


def test_a_request_longer_than_the_context_is_rejected_and_the_rest_served(tmp_path):
    assert run(config("backends=[dense]", "+model.max_seq_len=40", "check_alone=6"), tmp_path) == 0
    (s,) = read_results(tmp_path / "results.jsonl")
    m, prompts = s["metrics"], s["prompts"]
    long = [p for p in prompts if p["prompt_len"] + 12 > 40]  # outputs up to 12 tokens
    assert m["rejected"] >= 1 and m["completed"] == 6 - m["rejected"] and m["completed"] >= 1
    assert all("the model's context (40)" in p["error"] for p in prompts if p["finish"] == "rejected")
    assert {p["id"] for p in prompts if p["finish"] == "rejected"} <= {p["id"] for p in long}
    assert m["alone_checked"] == m["alone_identical"] == m["completed"]  # the served ones, each alone


def test_a_run_where_nothing_completed_exits_1_with_its_reasons_and_keeps_its_records(tmp_path, caplog):
    assert run(config("backends=[dense]", "kv_budget_mb=0.0001", "check_alone=2"), tmp_path) == 1
    (s,) = read_results(tmp_path / "results.jsonl")
    assert s["metrics"]["completed"] == 0 and s["metrics"]["rejected"] == 6
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rejected:")]
    assert line.startswith("rejected: 6 request(s), e.g.: prompt + max_new_tokens = ") and "KV budget" in line


def test_interference_runs_chunked_and_whole_side_by_side(tmp_path):
    run(config("trace=interference", "backends=[dense]", "interference.prompt_tokens=120", "interference.at_s=0.05",
               "token_budget=8", "check_alone=0"), tmp_path)
    chunked, whole = read_results(tmp_path / "results.jsonl")
    assert chunked["setup"]["chunked_prefill"] is True and whole["setup"]["chunked_prefill"] is False
    for s in (chunked, whole):
        assert s["metrics"]["completed"] == 6 and s["metrics"]["long_prompt_ttft_ms"] > 0
    assert [p["output_len"] for p in chunked["prompts"]] == [p["output_len"] for p in whole["prompts"]]


def test_int4_with_options_and_the_unloaded_reference(tmp_path):
    run(config("backends=[int4]", "+backend_options={int4: {residual: 8, flush: 32, group_size: 32, rollback: 0}}",
               "unloaded=2", "check_alone=0"), tmp_path)
    (s,) = read_results(tmp_path / "results.jsonl")
    assert s["setup"]["cache"] == "int4" and s["metrics"]["completed"] == 6
    assert s["metrics"]["unloaded_ttft_p50_ms"] > 0 and s["metrics"]["unloaded_itl_p50_ms"] > 0
    assert s["config"]["backend_options"]["int4"]["residual"] == 8


@pytest.mark.slow  # 6.9 s in the default run on a 2-core Zen 3 (session 50)
def test_offline_repeats_side_by_side_with_transformers(tmp_path):
    run(config("backends=[paged]", "compare_transformers=true", "repeats=2", "check_alone=0"), tmp_path)
    (s,) = read_results(tmp_path / "results.jsonl")
    m = s["metrics"]
    assert len(m["output_tok_s_repeats"]) == 2 and len(m["hf_output_tok_s_repeats"]) == 2
    assert m["hf_identical"] == m["hf_requests"] == 6  # transformers' greedy = ours, every repeat
    assert m["output_tok_s_over_hf"] == pytest.approx(statistics.median(m["output_tok_s_repeats"]) /
                                                      statistics.median(m["hf_output_tok_s_repeats"]))
