"""experiments.micro on the tiny model: each part's rows, its results.jsonl read by
report, and bad options refused before the model loads."""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from decodelab.experiments.micro import run
from decodelab.experiments.report import load_runs, table_rows
from decodelab.models.errors import SetupError
from decodelab.models.loading import CONF_DIR

TINY = ["model=tiny-llama", "model.device=cpu", "threads=1"]


def micro(out: Path, *overrides: str) -> list[dict]:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="micro", overrides=[*TINY, *overrides])
    return run(cfg, out)


class FixedTimer:
    """A stand-in for harness.Timer whose median is fixed by creation order (per context:
    dense, paged, transformers), so the ratios below are known by hand."""

    made = 0

    def __init__(self, device):
        self.s = (0.010, 0.015, 0.030)[FixedTimer.made % 3]
        FixedTimer.made += 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def median(self):
        return self.s

    @property
    def seconds(self):
        return [self.s]


def test_kv_speed_rows_per_context_and_system(tmp_path, monkeypatch):
    from decodelab.experiments import harness

    monkeypatch.setattr(harness, "Timer", FixedTimer)
    rows = micro(tmp_path, "part=kv_speed", "contexts=[24,48]", "steps=3", "repeats=2", "backends=[dense,paged]")
    assert [(r["context"], r["system"]) for r in rows] == [
        (c, s) for c in (24, 48) for s in ("dense", "paged", "hf-QuantizedCache")]
    assert [r["itl_ms"] for r in rows] == pytest.approx([10, 15, 30] * 2)
    assert [r["itl_vs_dense"] for r in rows] == pytest.approx([1.0, 1.5, 3.0] * 2)
    assert all(r["kv_bytes"] > 0 for r in rows)
    assert rows[3]["kv_bytes"] == 2 * 2 * 2 * 16 * 4 * (48 + 3 + 1)  # tiny-llama: 2 layers, 2 kv heads, d 16, fp32
    runs = load_runs(tmp_path)
    assert len(runs) == 6 and {r["entry"] for r in runs} == {"micro"}


def test_kv_speed_prefills_in_chunks_and_leaves_transformers_out_when_asked(tmp_path, monkeypatch):
    """prefill_chunk: the prompt in chunks (the cache then holds what one pass holds: the same
    bytes, the same greedy steps); compare_transformers=false: no QuantizedCache row, and
    transformers' model is never built; bad values refused before the model loads."""
    import importlib

    from decodelab.experiments import harness, micro as micro_mod

    prefill_mod = importlib.import_module("decodelab.decoding.prefill")

    monkeypatch.setattr(harness, "Timer", FixedTimer)
    monkeypatch.setattr(micro_mod, "hf_model_for", lambda lm: pytest.fail("transformers' model was built"))
    chunks = []
    real = prefill_mod._run
    monkeypatch.setattr(prefill_mod, "_run", lambda m, c, p, k, *a: chunks.append(k) or real(m, c, p, k, *a))
    rows = micro(tmp_path, "part=kv_speed", "contexts=[40]", "steps=2", "repeats=1", "backends=[dense,int4]",
                 "prefill_chunk=16", "compare_transformers=false")
    assert [r["system"] for r in rows] == ["dense", "int4"] and chunks == [16, 16]
    assert rows[0]["kv_bytes"] == 2 * 2 * 2 * 16 * 4 * (40 + 2 + 1)
    with pytest.raises(SetupError) as e:
        micro(tmp_path, "part=kv_speed", "prefill_chunk=0", "compare_transformers=maybe")
    assert "prefill_chunk must be null or an integer >= 1, got 0" in str(e.value)
    assert "compare_transformers must be true or false, got 'maybe'" in str(e.value)


@pytest.mark.slow  # 3.0 s in the default run on a 2-core Zen 3 (session 50)
def test_kv_speed_times_the_compiled_step_beside_the_eager_one(tmp_path, monkeypatch):
    """kv_compile=true: each backend also through the compiled static step (dynamo's eager
    backend here: fast to build), compiled once per context with its compile time; ratios
    against the first backend's eager ITL and its own mode's; the quartiles beside."""
    g = sys.modules["decodelab.decoding.compiled"]
    monkeypatch.setattr(g, "compiled_step", functools.partial(g.compiled_step, backend="eager"))
    calls = []
    real = g.compiled_step
    monkeypatch.setattr(g, "compiled_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    rows = micro(tmp_path, "part=kv_speed", "contexts=[24]", "steps=3", "repeats=2", "backends=[dense,int4]",
                 "kv_compile=true")
    assert [r["system"] for r in rows] == ["dense", "int4", "dense compiled", "int4 compiled", "hf-QuantizedCache"]
    assert len(calls) == 2  # one compile per backend and context, reused by both repeats
    by = {r["system"]: r for r in rows}
    assert by["dense compiled"]["vs_first_same_mode"] == 1.0 and by["dense"]["itl_vs_dense"] == 1.0
    assert by["int4 compiled"]["itl_vs_dense"] == pytest.approx(by["int4 compiled"]["itl_ms"] / by["dense"]["itl_ms"])
    assert all(by[f"{b} compiled"]["compile_s"] > 0 for b in ("dense", "int4"))
    assert all(r["itl_ms_p25"] <= r["itl_ms"] <= r["itl_ms_p75"] for r in rows)
    assert by["int4 compiled"]["kv_bytes"] == by["int4"]["kv_bytes"]  # the same tokens held
    rows = micro(tmp_path, "part=kv_speed", "contexts=[24]", "steps=2", "repeats=1", "backends=[dense,int4]",
                 "kv_weights=[int4+head]")
    assert [r["system"] for r in rows] == ["dense", "int4", "int4+head weights, dense", "int4+head weights, int4",
                                           "hf-QuantizedCache"]
    with pytest.raises(SetupError, match="(?s)kv_weights: 'int3' is not one of.*kv_compile must be true or false"):
        micro(tmp_path, "part=kv_speed", "kv_weights=[int3]", "kv_compile=maybe")


@pytest.mark.slow  # 4.2 s in the default run on a 2-core Zen 3 (session 50)
def test_verify_cost_is_relative_to_one_token_per_impl(tmp_path, monkeypatch):
    from decodelab.experiments import micro as module

    assert micro(tmp_path, "part=verify_cost", "tokens=[1,3]", "repeats=2")[-1]["ms"] > 0  # the real timing runs
    g = sys.modules["decodelab.decoding.compiled"]  # the compiled rows through dynamo's eager backend (fast to build)
    monkeypatch.setattr(g, "compiled_step", functools.partial(g.compiled_step, backend="eager"))
    compiled = [r for r in micro(tmp_path, "part=verify_cost", "tokens=[1,3]", "repeats=2", "impls=[reference]",
                                 "verify_compile=true") if r["matmul"] == "compiled"]
    assert [r["tokens"] for r in compiled] == [1, 3] and compiled[0]["cost_vs_1_token"] == 1.0
    assert all(r["ms"] > 0 and r["compile_s"] > 0 for r in compiled)
    ms = {("reference", 1): 2.0, ("reference", 3): 3.0, ("onednn", 1): 1.0, ("onednn", 3): 4.0}
    monkeypatch.setattr(module, "forward_ms", lambda model, cache, T, repeats: ms[model.matmul, T])
    rows = micro(tmp_path, "part=verify_cost", "tokens=[1,3]", "repeats=2", "impls=[reference,onednn]")
    assert [(r["tokens"], r["matmul"], r["ms"]) for r in rows] == [(1, "reference", 2.0), (1, "onednn", 1.0),
                                                                   (3, "reference", 3.0), (3, "onednn", 4.0)]
    assert [r["cost_vs_1_token"] for r in rows] == [1.0, 1.0, 1.5, 4.0]  # each impl against its own T = 1


def test_bad_options_are_refused_before_the_model_loads(tmp_path, monkeypatch):
    import decodelab.models.loading as loading

    monkeypatch.setattr(loading, "random_model", lambda *a, **k: pytest.fail("weights were loaded"))
    with pytest.raises(SetupError) as e:
        micro(tmp_path, "part=kv_sped", "steps=0")
    assert "part must be one of" in str(e.value) and "steps must be an integer >= 1" in str(e.value)
    with pytest.raises(SetupError, match="backends: no cache 'pagd'"):
        micro(tmp_path, "part=kv_speed", "backends=[dense,pagd]")
    p = subprocess.run([str(Path(sys.executable).parent / "decodelab-micro"), *TINY, "part=verify_cost",
                        "impls=[fast]", f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "impls[]" in p.stderr and "Traceback" not in p.stderr


def test_kv_memory_bytes_against_the_formula(tmp_path):
    rows = micro(tmp_path, "part=kv_memory", "contexts=[40]", "backends=[dense,int4]")
    dense, int4, paged_waste, dense_waste = rows
    # tiny-llama: 2 (K, V) x 2 layers x 2 kv heads x 16 dims x 4 bytes = 512 bytes a token
    assert dense["kv_bytes"] == dense["formula_bytes"] == 40 * 512 and dense["vs_bf16_formula"] == 2.0
    assert int4["formula_bytes"] == 40 * 512 and int4["kv_bytes"] > 0
    assert paged_waste["system"].startswith("paged") and dense_waste["system"].startswith("dense")
    assert 0 < paged_waste["unused_fraction"] < dense_waste["unused_fraction"] < 1  # blocks of 16 vs the longest row


def test_mixed_step_times_each_way_per_backend_and_chunk(tmp_path, monkeypatch):
    rows = micro(tmp_path, "part=mixed_step", "backends=[dense,int4,sliding]", "chunks=[3,8]", "decode_rows=2",
                 "decode_context=20", "chunk_context=30", "repeats=1")
    systems = ["decode", "chunk", "two forwards", "one forward"]
    assert [(r["backend"], r["chunk_tokens"], r["system"]) for r in rows] == [
        (b, t, s) for b in ("dense", "int4", "sliding") for t in (3, 8) for s in systems]
    assert all(r["ms"] > 0 and r["decode_rows"] == 2 for r in rows)
    assert [r["vs_decode"] for r in rows if r["system"] == "decode"] == [1.0] * 6
    import decodelab.models.loading as loading

    monkeypatch.setattr(loading, "random_model", lambda *a, **k: pytest.fail("weights were loaded"))
    with pytest.raises(SetupError, match="chunks must be a non-empty list of integers >= 1"):
        micro(tmp_path, "part=mixed_step", "chunks=[0]")


def test_quartile_fields_interpolate_linearly_as_the_latency_percentiles():
    """numpy's linear percentiles, h = q/100 x (n - 1): samples 1..4 -> 1.75, 2.5, 3.25; one sample: itself."""
    from decodelab.experiments.plotting import quartile_fields

    assert quartile_fields("x", [4.0, 1.0, 3.0, 2.0]) == pytest.approx({"x_p25": 1.75, "x_p75": 3.25})
    assert quartile_fields("x", [4.0, 1.0, 3.0, 2.0], median=True) == pytest.approx(
        {"x_p25": 1.75, "x_p50": 2.5, "x_p75": 3.25})
    assert quartile_fields("ttft", [1.5]) == {"ttft_p25": 1.5, "ttft_p75": 1.5}


def paced(monkeypatch, tokens: int, step_s):
    """decoding.generate with known token times: the k-th call of a model or decoder (keyed
    by `step_s`'s choice) that generates `tokens` tokens steps every `step_s(model, decoder, k)`
    seconds; other calls (warm-ups, TTFT) keep their real times."""
    import decodelab.decoding as decoding

    real, calls = decoding.generate, {}

    def timed(model, cache, decoder, prompts, n, **kw):
        res = real(model, cache, decoder, prompts, n, **kw)
        if n == tokens:
            key = step_s(model, decoder, None)
            calls[key] = calls.get(key, -1) + 1
            dt = step_s(model, decoder, calls[key])
            res.token_times = [[1.0 + dt * i for i in range(len(t))] for t in res.tokens]
        return res

    monkeypatch.setattr(decoding, "generate", timed)


def test_weights_decode_rate_is_the_median_of_its_timed_decodes_with_their_quartiles(tmp_path, monkeypatch):
    """Each model's k-th 3-token decode steps every 10 x (1 + k % 4) ms: k = 0 is the warm-up
    round, the 4 timed ones (repeats=4, one prompt) run at 50, 33.3, 25 and 100 tok/s (2
    intervals each): median 41.67, quartiles 31.25 and 62.5 (linear); the figure draws them."""
    paced(monkeypatch, 3, lambda model, dec, k: id(model) if k is None else 0.01 * (1 + k % 4))
    from decodelab.experiments import harness

    reads = iter([[8.0, 12.0], [10.0]])  # GB/s: before the context, after it
    monkeypatch.setattr(harness, "read_bandwidth", lambda device: next(reads))
    rows = micro(tmp_path, "part=weights", "contexts=[12]", "steps=3", "repeats=4", "prompts_per_context=1",
                 "weight_types=[int8]", "ttft_rounds=1", "weight_compile=false", "compare_transformers=false",
                 "text_prompts=0")
    by = {r["system"]: r for r in rows}
    for name in ("fp32", "int8"):
        r = by[name]
        spread = (r["decode_tok_s_p25"], r["decode_tok_s"], r["decode_tok_s_p75"])
        assert spread == pytest.approx((31.25, 125 / 3, 62.5))
        assert (r["read_GBps_p25"], r["read_GBps"], r["read_GBps_p75"]) == (9.0, 10.0, 11.0)
    assert by["int8"]["vs_fp32"] == pytest.approx(1.0)
    # the roofline: tiny-llama's fp32 weights (73,728 projection weights, the tied 49,152 x 64
    # embedding read whole by the head, 320 norm weights) + fp32 K/V of 12 + 3 // 2 = 13 tokens
    # (2 layers x K, V x 2 heads x 16 dims x 4 bytes each)
    fp32 = by["fp32"]
    assert (fp32["weight_bytes"], fp32["kv_bytes"]) == ((73_728 + 49_152 * 64 + 320) * 4, 13 * 2 * 2 * 2 * 16 * 4)
    n = fp32["weight_bytes"] + fp32["kv_bytes"]
    assert fp32["bytes_per_token"] == n and fp32["roofline_tok_s"] == pytest.approx(10e9 / n)
    assert fp32["roofline_fraction"] == pytest.approx(125 / 3 * n / 10e9)
    assert by["int8"]["weight_bytes"] < fp32["weight_bytes"] and by["int8"]["kv_bytes"] == fp32["kv_bytes"]
    assert "roofline_fraction" not in by["fp32 (control)"]
    from decodelab.experiments.figures import weights_figure

    decode = weights_figure(load_runs(tmp_path)).panels[0]
    assert [v for s in decode.series for p in s.points for v in (p.y, p.lo, p.hi, p.n)] == pytest.approx(
        [125 / 3, 31.25, 62.5, 4] * 2)


@pytest.mark.slow  # 2.7 s in the default run on a 2-core Zen 3 (session 50)
def test_step_profile_splits_a_compiled_step_by_part(tmp_path):
    """Per weight type, the compiled step's profile: tiny-llama's 2 layers call each
    projection kind twice a step (wqkv, wo, w_gate_up, w_down), the head, attention and
    greedy's argmax once a layer / step; the parts and the rest add up to the profiled step;
    each projection kind's bytes are what its modules' one-row kernels read (the step's
    bytes: the weights as stored and the fp32 K/V of 12 + 2 tokens)."""
    from decodelab.models.quantize import WeightOptions

    rows = micro(tmp_path, "part=step_profile", "contexts=[12]", "steps=2", "repeats=1", "weight_types=[int4+head]")
    for w in ("fp32", "int4+head"):
        mine = {r["part"]: r for r in rows if r["weights"] == w}
        assert set(mine) == {"step", "projection wqkv", "projection wo", "projection w_gate_up", "projection w_down",
                             "projection head", "attention", "sampling", "rest"}
        calls = {p: r["calls_per_step"] for p, r in mine.items() if "calls_per_step" in r}
        assert calls == {"projection wqkv": 2, "projection wo": 2, "projection w_gate_up": 2, "projection w_down": 2,
                         "projection head": 1, "attention": 2, "sampling": 1}
        assert sum(r["share"] for p, r in mine.items() if p != "step") == pytest.approx(1.0)
        step = mine["step"]
        assert step["profiled_step_ms"] * 1e3 == pytest.approx(sum(r["us_per_step"] for p, r in mine.items()
                                                                   if p != "step"))
        assert 0 < step["cpu_utilization"] <= 1.05 and step["step_ms_p25"] <= step["step_ms"] <= step["step_ms_p75"]
        for p, r in mine.items():
            if p.startswith("projection"):
                assert r["GBps"] == pytest.approx(r["bytes"] / (r["us_per_step"] * 1e-6) / 1e9)
    fp32 = {r["part"]: r for r in rows if r["weights"] == "fp32"}
    assert fp32["projection w_gate_up"]["bytes"] == 2 * 64 * 256 * 4
    assert fp32["projection head"]["bytes"] == 49_152 * 64 * 4
    assert fp32["step"]["bytes"] == (73_728 + 49_152 * 64 + 320) * 4 + 14 * 2 * 2 * 2 * 16 * 4
    q = {r["part"]: r for r in rows if r["weights"] == "int4+head"}
    from omegaconf import OmegaConf

    from decodelab.models.loading import random_model

    spec = OmegaConf.load(CONF_DIR / "model" / "tiny-llama.yaml")
    tiny = random_model(spec.config, seed=spec.seed, device="cpu").model  # as micro builds it
    int4 = WeightOptions("int4", quantize_head=True).apply(tiny)
    assert q["projection head"]["bytes"] == int4.lm_head.step_bytes()
    assert q["step"]["bytes"] == int4.weight_read_bytes(1) + 14 * 2 * 2 * 2 * 16 * 4


@pytest.mark.slow  # 7.0 s in the default run on a 2-core Zen 3 (session 50)
def test_weights_part_rows_against_fp32_and_transformers(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules["decodelab.decoding.runner"], "BACKEND", "eager")  # fast to build
    rows = micro(tmp_path, "part=weights", "contexts=[12]", "steps=3", "repeats=1", "prompts_per_context=2",
                 "weight_types=[int8,int4+head]", "ttft_rounds=3", "text_prompts=2", "text_tokens=8")
    assert [r["system"] for r in rows] == ["fp32", "fp32 compiled", "int8", "int8 compiled", "int4+head",
                                           "int4+head compiled", "transformers-fp32", "fp32 (control)"]
    by = {r["system"]: r for r in rows}
    fp32, hf, control = by["fp32"], by["transformers-fp32"], by.pop("fp32 (control)")
    assert fp32["vs_fp32"] == 1.0 and hf["vs_transformers"] == 1.0
    assert all(r["decode_tok_s"] > 0 for r in by.values()) and "decode_tok_s" not in control
    assert all(r["vs_llama_cpp"] is None for r in by.values())  # a random model: no GGUF for llama.cpp
    from decodelab.models.quantize import cpu_has_amx_bf16

    assert fp32["prefill_dtype"] is None and by["int8"]["prefill_dtype"] == by["int4+head compiled"]["prefill_dtype"] \
        == ("bfloat16" if cpu_has_amx_bf16() else "float32")  # auto: bf16 products where the CPU has AMX
    # TTFT: each prefill path (compiled steps prefill eagerly: none of their own), paired with fp32's
    ttft = [r for r in rows if "ttft_ms" in r]
    assert [r["system"] for r in ttft] == ["fp32", "int8", "int4+head", "transformers-fp32", "fp32 (control)"]
    assert fp32["ttft_vs_fp32"] == fp32["ttft_vs_fp32_p25"] == fp32["ttft_vs_fp32_p75"] == 1.0
    assert all(r["ttft_ms"] > 0 and 0 < r["ttft_vs_fp32_p25"] <= r["ttft_vs_fp32"] <= r["ttft_vs_fp32_p75"]
               for r in ttft)
    assert fp32["identical_to_fp32"] == "2/2" and hf["identical_to_fp32"] == "2/2"  # transformers' greedy = ours
    assert by["fp32 compiled"]["identical_to_fp32"] == "2/2"  # the compiled step decodes the same tokens
    assert by["int8 compiled"]["identical_to_fp32"] == by["int8"]["identical_to_fp32"]
    # every compiled step writes its eager path's text on ShareGPT prompts (the gamma experiment's)
    assert [(r["system"], r["same_text_as_eager"], r["text_first_difference_median"]) for r in rows
            if "same_text_as_eager" in r] == [(f"{w} compiled", "2/2", 8) for w in ("fp32", "int8", "int4+head")]
    assert all((r["compile_s"] > 0) == r["system"].endswith("compiled") for r in by.values() if r is not hf)
    import decodelab.models.loading as loading

    monkeypatch.setattr(loading, "random_model", lambda *a, **k: pytest.fail("weights were loaded"))
    with pytest.raises(SetupError) as e:
        micro(tmp_path, "part=weights", "weight_types=[int3]", "weight_group_size=0", "weight_kernels=[fast]",
              "weight_prefill_dtypes=[fp16,auto,auto]")
    assert "weight_types: 'int3'" in str(e.value) and "weight_group_size must be a positive integer" in str(e.value)
    assert "weight_kernels: each must be one of ['auto', 'native', 'torch'], got 'fast'" in str(e.value)
    assert "weight_prefill_dtypes: each must be one of ['auto', 'float32', 'bfloat16']" in str(e.value)
    assert "got 'fp16'" in str(e.value) and "weight_prefill_dtypes names a dtype twice" in str(e.value)
    with pytest.raises(SetupError, match="compare_llama_cpp must be auto, true or false, got 0"):
        micro(tmp_path, "part=weights", "compare_llama_cpp=0")
    with pytest.raises(SetupError) as e:
        micro(tmp_path, "part=weights", "ttft_rounds=0", "compare_llama_cpp=maybe", "text_prompts=-1")
    assert "ttft_rounds must be an integer >= 1, got 0" in str(e.value)
    assert "text_prompts must be an integer >= 0, got -1" in str(e.value)
    assert "compare_llama_cpp must be auto, true or false, got 'maybe'" in str(e.value)
    reference = sys.modules["decodelab.models.reference"]
    monkeypatch.setattr(reference, "llama_cpp_available", lambda: False)
    with pytest.raises(SetupError) as e:
        micro(tmp_path, "part=weights", "compare_llama_cpp=true")
    assert "compare_llama_cpp=true needs llama-cpp-python" in str(e.value)
    assert "model 'tiny-llama' has no GGUF file for llama.cpp to run" in str(e.value)
    with pytest.raises(SetupError) as e:  # kv_speed's llama.cpp rows: the same checks, and its KV types
        micro(tmp_path, "part=kv_speed", "compare_llama_cpp=true", "kv_llama_cpp=[q4_0,q5_1]")
    assert "kv_llama_cpp: 'q5_1' is not one of llama.cpp's KV types ['f16', 'q8_0', 'q4_0']" in str(e.value)
    assert "compare_llama_cpp=true needs llama-cpp-python" in str(e.value)
    from decodelab.experiments.micro import check

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        check(compose(config_name="micro", overrides=[*TINY, "part=kv_speed", "compare_llama_cpp=true",
                                                      "kv_llama_cpp=[]"]))  # no llama.cpp rows: nothing refused


def test_weights_quality_names_each_kernel_when_several_are_compared(tmp_path):
    """`weight_kernels=[torch,native]`: every weight type computed by each, named apart,
    each model built on the kernel it names."""
    from decodelab.models import native

    kernels = ["torch"] + (["native"] if native.problem() is None else [])
    rows = micro(tmp_path, "part=weights_quality", "prompts=1", "forced_tokens=8", "weight_types=[int4]",
                 f"weight_kernels=[{','.join(kernels)}]", "compare_transformers=false")
    assert [r["system"] for r in rows] == [f"ours int4@{k}" for k in kernels]
    assert all(0 < r["mean_kl"] for r in rows)
    if len(rows) == 2:  # bf16 activations against int8-quantized ones: not the same numbers
        assert rows[0]["mean_kl"] != rows[1]["mean_kl"]


def test_weights_quality_names_each_prefill_dtype_when_several_are_compared(tmp_path):
    """`weight_prefill_dtypes=[float32,bfloat16]`: every weight type with its prompt
    prefilled by fp32 and by bf16 products, named apart; the bf16 one differs, a little."""
    rows = micro(tmp_path, "part=weights_quality", "prompts=1", "forced_tokens=8", "weight_types=[int8]",
                 "weight_prefill_dtypes=[float32,bfloat16]", "compare_transformers=false")
    assert [r["system"] for r in rows] == ["ours int8 prefill float32", "ours int8 prefill bfloat16"]
    assert [r["prefill_dtype"] for r in rows] == ["float32", "bfloat16"]
    kl = [r["mean_kl"] for r in rows]
    assert 0 < kl[0] != kl[1] > 0 and abs(kl[0] - kl[1]) < 0.5 * kl[0]


def test_weights_quality_part_against_fp32_ours_and_transformers(tmp_path):
    rows = micro(tmp_path, "part=weights_quality", "prompts=1", "forced_tokens=8", "weight_types=[int8,int4]")
    by = {r["system"]: r for r in rows}
    assert list(by) == ["ours int8", "ours int4", "transformers fp32", "transformers + quanto int8",
                        "transformers + quanto int4"]
    assert by["transformers fp32"]["mean_kl"] < 1e-6  # the same model: float rounding only
    assert 0 < by["ours int8"]["mean_kl"] < by["ours int4"]["mean_kl"]  # quantized for real, int4 the coarser
    assert 0 < by["transformers + quanto int8"]["mean_kl"]
    assert all(r["prompts"] == 1 and r["forced_tokens"] == 8 and r["forward_ms_median"] > 0 for r in rows)


def test_spec_gamma_part_grid_against_greedy_beside_each_drafter(tmp_path, monkeypatch):
    """Real decodes (tokens and statistics) with their token times replaced by known ones
    (greedy 0.1 s per token, speculative 0.04 s): the speedups and the greedy unit follow
    from those times alone."""
    import decodelab.decoding as decoding

    real = decoding.generate

    def timed(model, cache, decoder, prompts, n, **kw):
        res = real(model, cache, decoder, prompts, n, **kw)
        dt = 0.04 if decoder.lookahead else 0.1
        res.token_times = [[1.0 + dt * i for i in range(len(t))] for t in res.tokens]
        return res

    monkeypatch.setattr(decoding, "generate", timed)
    rows = micro(tmp_path, "part=spec_gamma", "drafts=[prompt-lookup,int8-self]", "gammas=[1,3]", "prompts=2",
                 "steps=8", "repeats=1")
    assert [(r["draft"], r["gamma"]) for r in rows] == [("prompt-lookup", 1), ("prompt-lookup", 3),
                                                         ("int8-self", 1), ("int8-self", 3)]
    for r in rows:
        assert r["greedy_identical"] == "2/2"  # temperature 0: every setup decodes greedy's tokens
        assert r["speedup_vs_greedy"] == pytest.approx(0.1 / 0.04)  # 7 decode intervals each, both sides
        assert r["greedy_tok_s"] == pytest.approx(10.0)  # one plain step: 0.1 s
        assert 1 <= r["mean_accepted"] <= r["gamma"] + 1 and 0 <= r["acceptance_rate"] <= 1
        assert r["predicted_this_hw"] > 0 and r["c_verify"] > 0 and r["c_draft"] >= 0
        assert r["efficiency"] == pytest.approx(r["speedup_vs_greedy"] / r["predicted_this_hw"])
    int8 = [r for r in rows if r["draft"] == "int8-self"]
    assert all(r["alpha"] > 0.5 for r in int8)  # the target's own weights in int8 agree with it mostly

    runs = load_runs(tmp_path)  # the report draws these rows as measured and predicted speedup vs gamma
    from decodelab.experiments.figures import speculative_series
    from decodelab.experiments.report import write_report
    series = speculative_series(table_rows(runs))
    assert sorted(series) == ["int8-self / dense measured", "int8-self / dense predicted",
                              "prompt-lookup / dense measured", "prompt-lookup / dense predicted"]
    assert all([g for g, _ in pts] == [1, 3] for pts in series.values())
    assert "speculative_vs_gamma" in write_report(tmp_path)

    import decodelab.models.loading as loading

    monkeypatch.setattr(loading, "random_model", lambda *a, **k: pytest.fail("weights were loaded"))
    with pytest.raises(SetupError) as e:
        micro(tmp_path, "part=spec_gamma", "drafts=[prompt-lokup,model]", "gammas=[0]", "steps=1")
    for msg in ("drafts: no draft 'prompt-lokup'", "gammas must be a non-empty list of integers >= 1",
                "steps must be an integer >= 2", "drafts: 'model' takes a model of its own"):
        assert msg in str(e.value)
    with pytest.raises(SetupError, match="quantizes the target, but the target is quantized already"):
        micro(tmp_path, "part=spec_gamma", "drafts=[int8-self]", "model.weights.kind=int8")


def test_spec_gamma_records_the_quartiles_of_its_per_prompt_speedups(tmp_path, monkeypatch):
    """Greedy steps every 0.1 s; the drafter's k-th timed decode every 0.04, 0.05, 0.02, 0.1 s:
    its 4 samples (2 prompts x 2 rounds) are 2.5, 2, 5 and 1x greedy: median 2.25, quartiles
    1.75 and 3.125 (linear); pooled (summed times) 0.4 / 0.21; the figure draws the median
    and quartiles with n = 4."""
    times = (0.04, 0.05, 0.02, 0.1)
    paced(monkeypatch, 8, lambda model, dec, k: id(dec) if k is None else (times[k % 4] if dec.lookahead else 0.1))
    rows = micro(tmp_path, "part=spec_gamma", "drafts=[prompt-lookup]", "gammas=[2]", "prompts=2", "steps=8",
                 "repeats=2")
    (r,) = rows
    assert r["speedup_vs_greedy"] == pytest.approx(0.4 / 0.21) and r["greedy_tok_s"] == pytest.approx(10.0)
    assert (r["speedup_vs_greedy_p25"], r["speedup_vs_greedy_p50"], r["speedup_vs_greedy_p75"]) == pytest.approx(
        (1.75, 2.25, 3.125))
    assert r["acceptance_rate_p25"] <= r["acceptance_rate_p50"] <= r["acceptance_rate_p75"]
    from decodelab.experiments.figures import speculative_figure

    runs = load_runs(tmp_path)
    by_run = {x["run"]: x for x in runs}
    spec = speculative_figure([(row, by_run[row["run"]]) for row in table_rows(runs)])
    measured = next(s for s in spec.panels[0].series if s.style == "solid")
    assert [v for p in measured.points for v in (p.x, p.y, p.lo, p.hi, p.n)] == pytest.approx([2, 2.25, 1.75, 3.125, 4])
    assert "median and IQR (error bar or band) of one speedup per prompt and round (n=4: 2 prompts x 2 round(s))" \
        in spec.caption


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama-cpp-python (the optional llama.cpp anchor, README) is not installed")
def test_the_llama_cpp_anchor_decodes_the_prompts_our_fp32_model_decodes(tmp_path):
    """SmolLM2's own Q4_1 GGUF through llama.cpp, fed the same token ids: greedy tokens that
    agree with our fp32 model (the same weights, dequantized) for several tokens, which a
    misfed prompt or another model would not; timed beside ours, its row the unit of
    vs_llama_cpp."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="micro", overrides=[
            "model=smollm2-135m", "threads=1", "part=weights", "contexts=[24]", "steps=6", "repeats=1",
            "prompts_per_context=2", "weight_types=[int4]", "weight_compile=false", "compare_transformers=false",
            "compare_llama_cpp=true", "ttft_rounds=1"])
    by = {r["system"]: r for r in run(cfg, tmp_path)}
    assert list(by) == ["fp32", "int4", "llama.cpp Q4_1", "fp32 (control)"]
    ll = by["llama.cpp Q4_1"]
    assert ll["vs_llama_cpp"] == 1.0 and ll["decode_tok_s"] > 0 and ll["ttft_ms"] > 0
    assert by["fp32"]["vs_llama_cpp"] == pytest.approx(by["fp32"]["decode_tok_s"] / ll["decode_tok_s"])
    assert ll["first_difference_median"] >= 3, ll


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama-cpp-python (the optional llama.cpp anchor, README) is not installed")
def test_kv_speed_times_llama_cpp_with_each_kv_type_on_the_same_prompt(tmp_path):
    """part=kv_speed's llama.cpp rows: SmolLM2's Q4_1 GGUF with f16 and q4_0 K/V (flash
    attention), the KV bytes at each type's size per element; its greedy steps with f16 KV
    continue the same prompt ids as llama.cpp's default decode (the same tokens for several
    steps), and q4_0 KV keeps the first of them."""
    from decodelab.experiments import harness
    from decodelab.experiments.workloads import synthetic_prompt
    from decodelab.models.reference import llama_cpp_generate_timed, llama_cpp_steps

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="micro", overrides=[
            "model=smollm2-135m", "threads=1", "part=kv_speed", "contexts=[40]", "steps=4", "repeats=1",
            "backends=[dense]", "compare_llama_cpp=true", "kv_llama_cpp=[f16,q4_0]"])
    rows = run(cfg, tmp_path)
    by = {r["system"]: r for r in rows}
    assert list(by) == ["dense", "hf-QuantizedCache", "llama.cpp Q4_1, f16 KV", "llama.cpp Q4_1, q4_0 KV"]
    f16, q4 = by["llama.cpp Q4_1, f16 KV"], by["llama.cpp Q4_1, q4_0 KV"]
    assert f16["itl_ms"] > 0 and q4["itl_ms"] > 0
    assert q4["kv_bytes"] / f16["kv_bytes"] == pytest.approx(18 / 64)  # q4_0: 18 bytes per 32 elements
    assert f16["kv_bytes"] % (2 * 30 * 3 * 64 * 2) == 0  # SmolLM2: 30 layers, 3 kv heads, d 64, 2 bytes each
    lm = harness.load_model(cfg)
    prompt = synthetic_prompt(lm, 40)
    plain, _ = llama_cpp_generate_timed(llama_cpp_for_test(cfg, lm, None), prompt, 6)
    runs = {kv: llama_cpp_steps(llama_cpp_for_test(cfg, lm, kv), prompt, 5, harness.Timer(lm.model.device))
            for kv in ("f16", "q4_0")}
    first = next((i for i, (a, b) in enumerate(zip(runs["f16"], plain)) if a != b), len(plain))
    assert first >= 3 and runs["q4_0"][0] == plain[0], (runs, plain)


def llama_cpp_for_test(cfg, lm, kv):
    from decodelab.experiments.micro_weights import llama_cpp_for

    return llama_cpp_for(cfg, lm, 64, kv)


@pytest.mark.slow  # 2.7 s in the default run on a 2-core Zen 3 (session 50)
def test_kv_quality_at_long_context_forces_the_text_after_concatenated_conversations(tmp_path):
    """quality_context=N: each sequence is ShareGPT conversations concatenated to N tokens,
    then forced_tokens of the text after them; int4 (ours, residual 112 of 300 tokens)
    quantizes most of the context, so its logits differ from dense while agreeing mostly."""
    from decodelab.experiments import harness
    from decodelab.experiments.workloads import long_conversations

    rows = micro(tmp_path, "part=kv_quality", "prompts=2", "forced_tokens=8", "quality_context=300",
                 "quality_backends=[int4,dense-fp8]")
    assert [r["system"] for r in rows] == ["ours-int4", "ours-dense-fp8", "hf-QuantizedCache"]
    assert all(r["context_tokens"] == 300 and r["prompts"] == 2 for r in rows)
    assert all(0 < r["mean_kl"] < 1 and 0 <= r["top1_agreement"] <= 1 for r in rows)
    lm = harness.load_model(micro_cfg())
    seqs = long_conversations(lm, 2, 300, 8)
    assert [(len(p), len(r)) for p, r in seqs] == [(300, 8)] * 2 and seqs[0][0] != seqs[1][0]
    whole = seqs[0][0] + seqs[0][1]  # the forced tokens are the text that follows the context
    assert lm.tokenizer.decode(whole).startswith("User: ")
    with pytest.raises(SetupError, match="forced tokens must be >= 1"):
        long_conversations(lm, 1, 300, 0)
    with pytest.raises(SetupError, match="quality_backends: no cache 'dense-int3'"):
        micro(tmp_path, "part=kv_quality", "quality_backends=[dense-int3]")


def micro_cfg():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name="micro", overrides=TINY)


def test_the_bandwidth_read_outgrows_the_last_level_cache(monkeypatch, tmp_path):
    """read_bandwidth reads 256 MiB, or twice the largest cache sysfs reports where that is more
    (a 300 MiB L3 would serve a 256 MiB read); run conditions record that cache."""
    import torch

    from decodelab.experiments import harness

    sizes = []
    monkeypatch.setattr(torch, "ones", lambda n, device=None: sizes.append(n * 4 / 2**20) or torch.zeros(8))
    for llc, want in ((0, 256), (32 << 20, 256), (300 << 20, 600), ((300 << 20) + 1, 601)):
        monkeypatch.setattr(harness, "last_level_cache_bytes", lambda llc=llc: llc)
        assert len(harness.read_bandwidth(repeats=2)) == 2 and sizes[-1] == want
    assert harness.run_conditions()["llc_MiB"] == round(((300 << 20) + 1) / 2**20, 1)
    cache = tmp_path / "cache"  # the parser, on a sysfs of our own
    for i, size in enumerate(["32K", "1024K", "300M", "x"]):
        (cache / f"index{i}").mkdir(parents=True)
        (cache / f"index{i}" / "size").write_text(size + "\n")
    monkeypatch.undo()
    monkeypatch.setattr(harness, "Path", lambda p: cache if "cache" in str(p) else Path(p))
    assert harness.last_level_cache_bytes() == 300 << 20
