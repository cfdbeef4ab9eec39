"""experiments/gpu_check.py in small: the CPU dry run (smoke=true) goes through every
section with tiny shapes, the Triton paths in the interpreter, so the prepared GPU check
has no bugs before a GPU is ever lent; and without CUDA the full check refuses clearly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from decodelab.cache.kernels.dispatch import triton_installed
from decodelab.experiments import gpu_check

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_full_check_refuses_without_cuda(tmp_path, capsys):
    assert gpu_check.main([f"out={tmp_path / 'r.json'}"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu_check") / "report.json"
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    run = subprocess.run([sys.executable, "-m", "decodelab.experiments.gpu_check", "smoke=true", f"out={out}"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(out.read_text())


def test_smoke_runs_every_section_without_errors(smoke):
    assert smoke["errors"] == [], smoke["errors"]
    assert smoke["copy_bandwidth"]["GBps"] > 0
    assert {"decode", "attention", "compiled", "verdicts"} <= set(smoke)
    assert ("kernel_checks" in smoke) == triton_installed()  # without triton: skipped, and said so



@pytest.mark.skipif(not triton_installed(), reason="triton is not installed")
def test_smoke_kernels_agree_in_the_interpreter(smoke):
    assert smoke["kernel_checks"] and all(r["ok"] for r in smoke["kernel_checks"])
    int4 = [r for r in smoke["attention"] if r["backend"] == "QuantizedCache" and r["impl"] == "triton"]
    assert int4 and all(r["max_abs_err_vs_reference"] <= 1e-4 for r in int4)


def test_smoke_decodes_every_backend_and_impl(smoke):
    runs = {(r["backend"].split("(")[0], r["impl"], r["batch"]) for r in smoke["decode"]}
    impls = ("reference", "triton") if triton_installed() else ("reference",)
    want = {(b, i, n) for n in (1, 2) for b, ii in (("dense", ("reference",)), ("sliding", ("reference",)),
                                                    ("paged", impls), ("int4", impls)) for i in ii}
    assert runs == want
    for r in smoke["decode"]:
        assert r["tokens_per_s"] > 0 and r["kv_bytes_read"] > 0
        assert r["bytes_per_step"] == r["weight_bytes"] + r["kv_bytes_read"]
    compiled = {(r["backend"], r["mode"]) for r in smoke["compiled"]}
    assert {("dense", "eager"), ("paged", "eager"), ("dense", "compile")} <= compiled
