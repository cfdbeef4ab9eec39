"""experiments/gpu_check.py in small: the CPU dry run (smoke=true) goes through every
section with tiny shapes, the Triton paths in the interpreter, so the prepared GPU check
has no bugs before a GPU is ever lent; and without CUDA the full check refuses clearly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from decodelab.cache.kernels.dispatch import triton_installed
from decodelab.experiments.gpu_check import weight_bytes
from decodelab.experiments.report import read_results

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # 4.0 s in the default run on a 2-core Zen 3 (session 50)
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_full_check_refuses_without_cuda(tmp_path):
    p = subprocess.run([str(Path(sys.executable).parent / "decodelab-gpu-check"), f"out={tmp_path}"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "needs a CUDA GPU" in p.stderr and "Traceback" not in p.stderr
    assert not list(tmp_path.iterdir())


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict:
    """The dry run's records, read back as `decodelab-report` reads them: section -> entries."""
    out = tmp_path_factory.mktemp("gpu_check")
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([str(Path(sys.executable).parent / "decodelab-gpu-check"), "smoke=true", f"out={out}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    sections: dict[str, list] = {}
    for r in read_results(out / "results.jsonl"):
        assert r["entry"] == "gpu_check" and r["conditions"]["device"] == "cpu"
        sections.setdefault(r["setup"]["name"], []).append(r["metrics"])
    return sections


@pytest.mark.slow  # 34 s in the default run on a 2-core Zen 3 (session 50)
def test_smoke_runs_every_section_without_errors(smoke):
    assert "error" not in smoke, smoke.get("error")
    assert smoke["copy_bandwidth"][0]["GBps"] > 0
    assert {"decode", "attention", "compiled", "verdicts"} <= set(smoke)
    assert ("kernel_checks" in smoke) == triton_installed()  # without triton: skipped, and said so



@pytest.mark.slow  # with the module's `smoke` (34 s; session 50)
@pytest.mark.skipif(not triton_installed(), reason="triton is not installed")
def test_smoke_kernels_agree_in_the_interpreter(smoke):
    assert smoke["kernel_checks"] and all(r["ok"] for r in smoke["kernel_checks"])
    int4 = [r for r in smoke["attention"] if r["backend"] == "QuantizedCache" and r["impl"] == "triton"]
    assert int4 and all(r["max_abs_err_vs_reference"] <= 1e-4 for r in int4)


@pytest.mark.slow  # with the module's `smoke` (34 s; session 50)
def test_smoke_decodes_every_backend_and_impl(smoke):
    runs = {(r["backend"].split("(")[0], r["impl"], r["batch"]) for r in smoke["decode"]}
    impls = ("reference", "triton") if triton_installed() else ("reference",)
    want = {(b, i, n) for n in (1, 2) for b, ii in (("dense", ("reference",)), ("sliding", ("reference",)),
                                                    ("paged", impls), ("int4", impls)) for i in ii}
    assert runs == want
    for r in smoke["decode"]:
        assert r["tokens_per_s"] > 0 and r["kv_bytes_read"] > 0
    compiled = {(r["backend"], r["mode"]) for r in smoke["compiled"]}
    assert {("dense", "eager"), ("paged", "eager"), ("dense", "compile")} <= compiled


def test_bytes_one_decode_step_reads_by_hand(tiny_models):
    """Weights: every parameter, but one row of an untied embedding per batch row (a tied
    one is read whole by the head); K/V: every visible token of every layer."""
    llama, untied = tiny_models["llama"].model, tiny_models["llama3-rope-untied"].model
    assert weight_bytes(llama, 1) == 90_432 * 4  # tied: all 90,432 fp32 parameters
    assert weight_bytes(untied, 1) == 410_880 - 255 * 64 * 4  # untied 256 x 64 embedding: 1 row read
    from decodelab.cache.dense import DenseCache
    from decodelab.decoding.text import make_cache

    # 2 rows x 40 tokens x 2 (K, V) x 2 layers x 2 kv heads x 16 dims x 4 bytes
    assert make_cache(llama, 2, 64, DenseCache).read_bytes(40) == 2 * 40 * 2 * 2 * 2 * 16 * 4
    gemma = tiny_models["gemma3"].model  # local layers read their window (16) only
    assert make_cache(gemma, 1, 64, DenseCache).read_bytes(40) == (16 + 16 + 40) * 2 * 1 * 32 * 4
