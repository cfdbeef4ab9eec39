"""The generation CLI end to end on tiny models: stdout holds only the reply (or one JSON
record with `json=true`); logs and the summary go to stderr."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from decodelab.experiments.generate import run
from decodelab.models.errors import SetupError
from decodelab.models.loading import CONF_DIR

ROOT = Path(__file__).resolve().parents[2]


def config(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def test_generate_streams_and_reports(capsys):
    r = run(config("model=tiny-llama", "model.device=cpu", "prompt=Hello there", "max_new_tokens=6"))
    out, err = capsys.readouterr()
    assert len(r.tokens[0]) == 6
    assert out == r.text[0]  # stdout: the streamed text, nothing else
    assert "TTFT" in err and "ITL p50" in err and "tok/s" in err  # the summary: stderr
    # tiny-llama: 2 x 2 layers x 2 kv heads x 16 dims x 4 bytes = 512 bytes per token
    assert f"formula {512 * r.kv['kv_tokens']:,} B" in err and "allocated" in err


def test_generate_prompt_file_chat_off_and_sampling(tmp_path, capsys):
    f = tmp_path / "p.txt"
    f.write_text("Once upon a time")
    cfg = config("model=tiny-gemma3", "model.device=cpu", f"prompt_file={f}", "chat_template=false",
                 "decoder=sampling", "decoder.seed=5", "max_new_tokens=5", "stream=false")
    a = run(cfg)
    b = run(cfg)
    assert a.tokens == b.tokens and len(a.tokens[0]) == 5
    assert capsys.readouterr().out == a.text[0] + b.text[0]  # stream=false: the text at the end


@pytest.mark.parametrize("override,match", [
    ("prompt=", "empty"),
    ("decoder.temperature=-1", "temperature"),
    ("decoder.top_p=1.5", "top_p"),
    ("max_new_tokens=0", "max_new_tokens"),
    ("compile=maybe", "compile must be true or false"),
    ("decoder=speculative draft=early-exit draft.compile=1", "draft.compile must be true or false"),
    ("decoder=speculative draft=int8-self draft.cache=dens", "draft.cache must be null .* got 'dens'"),
    ("decoder=speculative decoder.gamma=17 draft=early-exit draft.cache=int4",
     "draft.cache QuantizedCache can roll back 16 tokens but the decoder's gamma needs 17; lower gamma"),
])
def test_bad_requests_fail_before_weights_load(override, match, monkeypatch):
    import decodelab.models.loading as loading

    monkeypatch.setattr(loading, "random_model", lambda *a, **k: pytest.fail("weights were loaded"))
    args = ["model=tiny-llama", "prompt=hi", *override.split()]
    with pytest.raises(SetupError, match=match):
        run(config(*args))


def test_generate_compiled_reports_the_compile_apart(capsys, monkeypatch):
    """compile=true: the same tokens as the eager loop; the summary and the JSON record
    carry the compile time, which TTFT leaves out."""
    monkeypatch.setattr(sys.modules["decodelab.decoding.runner"], "BACKEND", "eager")  # fast to build
    args = ["model=tiny-llama", "model.device=cpu", "prompt=Hello there", "max_new_tokens=6", "stream=false"]
    want = run(config(*args))
    capsys.readouterr()
    got = run(config(*args, "compile=true", "json=true"))
    out, err = capsys.readouterr()
    rec = json.loads(out)
    assert got.tokens == want.tokens
    assert rec["compile_ms"] > 0 and rec["compile_ms"] == pytest.approx(1e3 * got.compile_s)
    assert "compiled decode step" in err and "not in TTFT" in err
    assert rec["ttft_ms"] < rec["compile_ms"]  # tracing the step takes far longer than this request's TTFT


@pytest.mark.slow  # 3.4 s in the default run on a 2-core Zen 3 (session 50)
def test_cli_exit_code_and_message():
    p = subprocess.run([sys.executable, "-m", "decodelab.experiments.generate", "model=tiny-llama", "prompt=hi",
                        "decoder.temperature=nan", "decoder.top_k=-3"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 2
    assert "temperature" in p.stderr and "top_k" in p.stderr and "2 problem(s)" in p.stderr


@pytest.mark.slow  # 7.2 s in the default run on a 2-core Zen 3 (session 50)
def test_cli_reads_stdin():
    p = subprocess.run([sys.executable, "-m", "decodelab.experiments.generate", "model=tiny-llama", "model.device=cpu",
                        "max_new_tokens=3", "chat_template=false"], cwd=ROOT, input="Hello from stdin",
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "--- 3 tokens" in p.stderr and "---" not in p.stdout


# One deterministic greedy request, run by the CLI in a subprocess and by the library here
PROMPT, NEW = "The quick brown fox", 8
ARGS = ["model=tiny-llama", "model.device=cpu", f"prompt={PROMPT}", "chat_template=false", f"max_new_tokens={NEW}"]


@pytest.fixture(scope="module")
def expected():
    """The request decoded by the library alone (tokenizer, dense cache, greedy loop)."""
    from decodelab.decoding import generate, greedy
    from decodelab.experiments.harness import run_conditions
    from decodelab.models.loading import instantiate_unwrapped
    from tests.conftest import cache_for

    lm = instantiate_unwrapped(config(*ARGS).model)
    ids = lm.tokenizer.encode(PROMPT, chat=False)
    r = generate(lm.model, cache_for(lm.model, 1, len(ids) + NEW), greedy(), [ids], NEW,
                 eos_ids=lm.tokenizer.eos_ids, tokenizer=lm.tokenizer)
    assert r.finish_reasons == ["length"] and r.text[0].strip()  # no EOS: all NEW tokens, some text
    return {"text": r.text[0], "prompt_tokens": len(ids), "conditions": run_conditions(lm)}


def generate_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The console script `decodelab-generate` (installed beside this interpreter)."""
    exe = Path(sys.executable).with_name("decodelab-generate")
    p = subprocess.run([str(exe), *ARGS, *args], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return p


@pytest.mark.slow  # 8.3 s in the default run on a 2-core Zen 3 (session 50)
def test_cli_stdout_holds_only_the_text(expected, tmp_path):
    p = generate_cli(cwd=tmp_path)
    assert p.stdout == expected["text"]  # `> out.txt` keeps the reply alone
    assert "[decodelab.generate][INFO] - model: tiny-llama" in p.stderr  # logs: stderr
    assert f"--- {NEW} tokens, finish: length" in p.stderr and "TTFT" in p.stderr and "ITL p50" in p.stderr
    kv = 2 * 2 * 2 * (expected["prompt_tokens"] + NEW - 1) * 16 * 4  # 2 x layers x kv_heads x tokens x dim x fp32
    assert f"formula {kv:,} B" in p.stderr
    assert list(tmp_path.iterdir()) == []  # no outputs/ run dir, .hydra/ or generate.log


def test_cli_json_prints_one_record(expected, tmp_path):
    p = generate_cli("json=true", cwd=tmp_path)
    assert p.stdout.count("\n") == 1  # one line, no streamed text before it
    rec = json.loads(p.stdout)
    assert rec["text"] == expected["text"] and rec["finish"] == "length"
    assert rec["prompt_tokens"] == expected["prompt_tokens"] and rec["new_tokens"] == NEW
    cached = expected["prompt_tokens"] + NEW - 1  # the last token is never fed back
    assert rec["kv_tokens"] == cached
    assert rec["kv_bytes_formula"] == 2 * 2 * 2 * cached * 16 * 4  # tiny-llama: 2 layers, 2 KV heads, dim 16, fp32
    assert rec["kv_bytes_allocated"] == 2 * 2 * 2 * (cached + 1) * 16 * 4  # dense: capacity prompt + NEW
    assert rec["ttft_ms"] >= rec["tokenize_ms"] + rec["prefill_ms"] > 0  # TTFT counts both and the first pick
    assert 0 < rec["itl_p50_ms"] <= rec["itl_p95_ms"] <= rec["itl_p99_ms"]
    # NEW - 1 = 7 gaps g0 <= .. <= g6: their mean (1000 / decode tok/s) is at most g5 + (g6 - g5) / 7, and
    # p99 (linear, h = 0.99 x 6 = 5.94) is g5 + 0.94 (g6 - g5), so p99 bounds it
    assert 1000 / rec["decode_tok_s"] <= rec["itl_p99_ms"] * (1 + 1e-9)
    assert rec["stats"] == {}  # greedy keeps no decoder statistics
    assert rec["conditions"].keys() == expected["conditions"].keys()
    assert rec["conditions"]["device"] == "cpu" and rec["conditions"]["dtype"] == "float32"
    assert f"--- {NEW} tokens" in p.stderr  # the human summary still goes to stderr


def test_ignore_eos_generates_every_token(monkeypatch, capsys):
    """ignore_eos=true: exactly max_new_tokens, even where the reply's first token is an EOS
    id (made one here: every token the tokenizer's EOS); without it the reply stops there."""
    from decodelab.models import tokenizer

    args = ("model=tiny-llama", "model.device=cpu", "prompt=Hello there", "max_new_tokens=6", "stream=false")
    first = run(config(*args)).tokens[0][0]
    real_init = tokenizer.Tokenizer.__init__

    def eos_is_first(self, *a, **k):
        real_init(self, *a, **k)
        self.eos_ids = (first,)

    monkeypatch.setattr(tokenizer.Tokenizer, "__init__", eos_is_first)
    stopped = run(config(*args))
    assert stopped.tokens[0] == [first] and stopped.finish_reasons[0] == "eos"
    assert len(run(config(*args, "ignore_eos=true")).tokens[0]) == 6
