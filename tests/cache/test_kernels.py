"""The Triton decode kernels against their torch references, and the `impl` switch.

On the CPU the kernels run in the Triton interpreter. It must be on before triton is
first imported and it would change every later kernel of the process, so all CPU cases
run in one subprocess (`python -m decodelab.cache.kernels.check` with TRITON_INTERPRET=1) and each
test here asserts one case's error. On CUDA the same cases, plus a grid of larger shapes,
run in-process on the compiled kernels (skipped without a GPU). Everything that needs
triton skips when it is not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from decodelab.cache.base import CacheLayout
from decodelab.cache.kernels.check import CASES, cache_case, int4_case, paged_case, run_cases
from decodelab.cache.kernels.dispatch import impl_problems, resolve_impl, triton_installed
from decodelab.cache.paged import PagedCache
from decodelab.models.errors import SetupError
from tests.cache.conftest import build

ROOT = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(not triton_installed(), reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# max abs error of a kernel against its torch reference (outputs of order 1): fp32 to float
# rounding, bf16 to a few units of its 2^-8 rounding. The test's own limits, not check.py's.
LIMIT = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def pythonpath() -> str:
    """The repo first, then whatever the test process was given."""
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


@pytest.fixture(scope="module")
def interpreted() -> dict:
    """(case, dtype) -> result of every case, run once under the Triton interpreter."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=pythonpath())
    run = subprocess.run([sys.executable, "-m", "decodelab.cache.kernels.check", "device=cpu", "dtypes=float32,bfloat16"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"the interpreter run failed:\n{run.stderr[-4000:]}"
    return {(r["case"], r["dtype"]): r for r in json.loads(run.stdout)}


@pytest.mark.slow  # 26 s in the default run on a 2-core Zen 3 (session 50)
@needs_triton
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", [c.name for c in CASES])
def test_kernel_matches_reference_in_interpreter(interpreted, case, dtype):
    r = interpreted[case, dtype]
    assert r["finite"], f"{case} {dtype}: non-finite kernel output"
    assert r["max_abs_err"] <= LIMIT[getattr(torch, dtype)], f"{case} {dtype}: max abs error {r['max_abs_err']:.3g}"


def ptxas_bundled() -> bool:
    import triton

    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


@pytest.mark.slow  # 7.1 s in the default run on a 2-core Zen 3 (session 50)
@needs_triton
def test_kernels_compile_for_hopper():
    """Triton's real compiler (not the interpreter) builds every bf16 kernel variant the
    caches launch for sm_90 (H100/H200), with the bundled ptxas, no GPU needed."""
    if not ptxas_bundled():
        pytest.skip("triton's bundled ptxas is missing")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": pythonpath()}
    run = subprocess.run([sys.executable, "-m", "decodelab.cache.kernels.check", "aot=90", "dtypes=bfloat16"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    built = json.loads(run.stdout)
    assert {b["kernel"] for b in built} == {"_paged_kernel", "_int4_kernel", "_combine_kernel"}
    assert all(b["cubin"] and b["shared_bytes"] <= 227 * 1024 for b in built)  # fits an H100/H200 block


# -- the same on CUDA, compiled, and over a grid of shapes --------------------------------
@needs_triton
@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_cases_on_cuda(dtype):
    results = run_cases("cuda", [dtype])
    assert sorted(r["case"] for r in results) == sorted(c.name for c in CASES)
    bad = [r for r in results if not (r["finite"] and r["max_abs_err"] <= LIMIT[dtype])]
    assert not bad, bad


PAGED_GRID = [dict(Hq=hq, Hkv=8, D=d, bs=bs, B=4, lengths=(1000, 4100, 17, 2500), T=t, window=w)
              for hq in (8, 32) for d in (64, 128) for bs in (16, 32) for t in (1, 5) for w in (None, 1024)]
INT4_GRID = [dict(Hq=hq, Hkv=4, D=d, B=3, lengths=(3000, 700, 129), T=t, window=w, group_size=64, residual=112,
                  flush=64, key_axis=ka, value_axis=va)
             for hq in (4, 16) for d in (64, 128) for t in (1, 4) for w in (None, 512)
             for ka, va in (("channel", "token"), ("token", "channel"))]


@needs_triton
@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", PAGED_GRID + INT4_GRID, ids=str)
def test_kernel_grid_on_cuda(shape, dtype):
    run = int4_case if "group_size" in shape else paged_case
    got, want = run("cuda", dtype, **shape)
    assert got.isfinite().all()
    assert (got.float() - want.float()).abs().max().item() <= LIMIT[dtype]


@needs_triton
@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["paged", "int4"])
def test_caches_agree_on_cuda(backend):
    got, want = cache_case("cuda", torch.bfloat16, backend=backend)
    assert got.isfinite().all()
    assert (got.float() - want.float()).abs().max().item() <= LIMIT[torch.bfloat16]


# -- the impl switch ----------------------------------------------------------------------
def test_auto_is_the_reference_on_cpu():
    assert resolve_impl("auto", "cpu") == "reference"
    assert build("paged", (None, None)).impl == build("int4", (None, None)).impl == "reference"


def test_triton_on_cpu_without_interpreter_names_the_fix(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    layout = CacheLayout(1, 2, 8, torch.float32, torch.device("cpu"), (None,), 8**-0.5)
    with pytest.raises(SetupError, match="TRITON_INTERPRET=1|pip install triton"):
        PagedCache(layout, 1, 16, impl="triton")
    with pytest.raises(SetupError, match="TRITON_INTERPRET=1|pip install triton"):
        build("int4", (None, None), impl="triton")


@needs_triton
def test_triton_on_cpu_with_interpreter_is_accepted(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert impl_problems("triton", "cpu") == []
    assert build("paged", (None, None), impl="triton").impl == "triton"  # built only: no kernel runs here


def test_unknown_impl_is_refused_with_the_choices():
    with pytest.raises(SetupError, match="auto.*reference.*triton"):
        build("paged", (None, None), impl="cuda")
    assert impl_problems("reference", "cuda") == []
