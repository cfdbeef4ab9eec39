"""Issue 30's fault cases, each run as a user would, into one Markdown table: case,
command, exit code, first line of what it printed (the error, the note, or the result).

    .venv/bin/python scripts/issue30_cases.py > table.md     # about 10 minutes

Nothing of the user's is touched: every case runs under a temporary DECODELAB_CACHE (the
converted weights linked from the user's cache, so nothing is converted again; the native
kernels and torch's compile cache built there from nothing), and serve runs in a
temporary folder. The read-only case bind-mounts the kernels folder read-only (root only;
skipped elsewhere).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
GEN = f"{PY} -m decodelab.experiments.generate"
SERVE = f"{PY} -m decodelab.experiments.serve"
TINY = "model=tiny-llama model.device=cpu"
ASK = "prompt='The capital of France is' chat_template=false max_new_tokens=12 json=true"
SMALL_SERVE = f"{TINY} trace=synthetic requests=4 compare_transformers=false check_alone=0 backends=[dense]"
ROWS: list[tuple[str, str, int, str]] = []
NOISE = ("Loading weights", "  0%", "Set the environment", "Error executing job")


def first_line(p: subprocess.CompletedProcess) -> str:
    """The line that says what happened: an error, a decodelab note, a traceback's last line,
    else the result (the JSON record's text, or stdout's first line)."""
    err = [ln for ln in p.stderr.splitlines() if ln.strip() and not ln.startswith(NOISE)
           and not (ln.startswith("[20") and "][INFO]" in ln)]  # Hydra's timestamped INFO log lines
    if p.returncode and any(ln.startswith("error") for ln in err):
        i = next(k for k, ln in enumerate(err) if ln.startswith("error"))
        return " ".join(err[i:i + 2])
    if any("Traceback" in ln for ln in err) or p.returncode < 0:
        return f"signal {-p.returncode}" if p.returncode < 0 else err[-1]
    both = err + p.stdout.splitlines()  # serve logs on stdout
    notes = [ln.split("] - ", 1)[-1] for ln in both if ln.startswith("decodelab:") or "][ERROR]" in ln
             or "][WARNING]" in ln]
    summaries = [ln.split("] - ", 1)[-1][:120] for ln in both if "'completed':" in ln]
    try:
        r = json.loads(p.stdout.strip().splitlines()[-1])
        result = f"text {r['text']!r}" + (f", weight_kernel {r['conditions'].get('weight_kernel')}"
                                          if r.get("conditions", {}).get("weight_kernel") else "")
    except (ValueError, IndexError, KeyError, TypeError):
        result = next((ln for ln in p.stdout.strip().splitlines() if not ln.startswith("[20")), "")
    return " | ".join([*notes[:2], *summaries[:1], *([result] if result else [])])


def sh(case: str, cmd: str, env: dict, cwd: Path = ROOT, show: str | None = None) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, shell=True, cwd=cwd, capture_output=True, text=True, timeout=1500,
                       env={**os.environ, **env})
    msg = first_line(p)
    ROWS.append((case, show or cmd.replace(PY, "python").replace(str(cwd), "."), p.returncode, msg[:400]))
    print(f"{case}: exit {p.returncode}: {msg[:300]}", file=sys.stderr, flush=True)
    return p


def text(p: subprocess.CompletedProcess) -> str | None:
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])["text"]
    except (ValueError, IndexError, KeyError):
        return None


def kernel_library(cache: Path) -> Path:
    (lib,) = (cache / "kernels").glob("*/libdecodelab_kernels.so")
    return lib


def damage(lib: Path, how: str) -> None:
    if how == "random":  # 4 KiB of random bytes at offset 80,000
        with open(lib, "r+b") as f:
            f.seek(80_000)
            f.write(random.Random(0).randbytes(4096))
    else:  # truncated to 1,000 bytes
        with open(lib, "r+b") as f:
            f.truncate(1000)


def main() -> None:
    user_cache = Path(os.environ.get("DECODELAB_CACHE", Path.home() / ".cache" / "decodelab"))
    tmp = Path(tempfile.mkdtemp(prefix="issue30-"))
    cache = tmp / "cache"
    (cache / "converted").mkdir(parents=True)
    for d in (user_cache / "converted").glob("*"):
        (cache / "converted" / d.name).symlink_to(d)
    env = {"DECODELAB_CACHE": str(cache)}
    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)  # torch's compile cache: under the temporary cache
    int8 = f"{GEN} model=smollm2-135m weights=int8 {ASK}"
    comp = f"{GEN} model=smollm2-135m compile=true {ASK}"

    # 1. the native kernel library damaged; the must-show 2 comparison with the text before
    base8 = text(sh("1. int8, first build (the reference)", int8, env))
    basec = text(sh("1. fp32 compile=true (the reference)", comp, env))
    for how, label in (("random", "4 KiB random at 80,000"), ("truncate", "truncated to 1,000 B")):
        for name, cmd, want in (("int8", int8, base8), ("compile=true", comp, basec),
                                ("int8 weights.kernel=native", f"{int8} model.weights.kernel=native", base8)):
            damage(kernel_library(cache), how)
            p = sh(f"1. {name}, library {label}", cmd, env)
            ROWS[-1] = (*ROWS[-1][:3], ROWS[-1][3] + f" [same text as before the damage: {text(p) == want}]")

    # silent fallbacks: a read-only damaged folder, no compiler; the summary names the kernel
    lib = kernel_library(cache)
    damage(lib, "truncate")
    ro = subprocess.run(f"mount --bind {lib.parent} {lib.parent} && mount -o remount,ro,bind {lib.parent}",
                        shell=True, capture_output=True)
    if ro.returncode == 0:
        try:
            sh("silent: read-only damaged library, weights.kernel=auto", int8, env)
            sh("silent: read-only damaged library, weights.kernel=native", f"{int8} model.weights.kernel=native", env)
        finally:
            subprocess.run(f"umount {lib.parent}", shell=True)
    sh("silent: no compiler (CC=/nonexistent/cc), weights.kernel=auto", int8, {**env, "CC": "/nonexistent/cc"})
    sh("silent: the summary names the kernel", f"{GEN} model=smollm2-135m weights=int8 prompt=Hi "
       "chat_template=false max_new_tokens=4", env)

    # must-show 3: two processes at once on an empty kernels folder
    shutil.rmtree(cache / "kernels")
    procs = [subprocess.Popen(int8, shell=True, cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=1500) for p in procs]
    builds = sum(e.count("building the native int8/int4 kernels") for _, e in outs)
    waits = sum(e.count("waiting for another process building") for _, e in outs)
    same = [text(subprocess.CompletedProcess("", 0, o, "")) == base8 for o, _ in outs]
    ROWS.append(("two processes at once, empty kernels folder", f"2 x ({int8.replace(PY, 'python')})",
                 max(p.returncode for p in procs), f"{builds} build(s), {waits} wait(s); texts equal the "
                                                   f"reference: {same}"))
    print(ROWS[-1], file=sys.stderr)

    # 2. serve's rates; 3. added keys; 4. an over-long request; 6. nothing completed, a refused run
    work = tmp / "serve"
    work.mkdir()
    sh("2. serve rates=2", f"{SERVE} {SMALL_SERVE} rates=2", env, work)
    sh("2. serve rates=abc", f"{SERVE} {SMALL_SERVE} rates=abc", env, work)
    sh("3. +cache.block_sizee=4", f"{GEN} {TINY} cache=paged +cache.block_sizee=4 prompt=hi", env)
    sh("3. +draft.layerz=1", f"{GEN} {TINY} decoder=speculative draft=early-exit +draft.layerz=1 prompt=hi", env)
    sh("3. serve +backend_options.paged={block_sizee: 4}",
       f"{SERVE} {SMALL_SERVE} '+backend_options.paged={{block_sizee: 4}}'", env, work)
    sh("4. serve synthetic.prompt_tokens=[16,3000]", f"{SERVE} {SMALL_SERVE} 'synthetic.prompt_tokens=[16,3000]'",
       env, work)
    sh("4. serve interference.prompt_tokens=5000",
       f"{SERVE} {SMALL_SERVE} trace=interference interference.prompt_tokens=5000", env, work)
    sh("6. serve kv_budget_mb=0.001", f"{SERVE} {SMALL_SERVE} kv_budget_mb=0.001", env, work)
    shutil.rmtree(work / "outputs", ignore_errors=True)
    sh("6. a refused serve run (max_running=0)", f"{SERVE} {SMALL_SERVE} max_running=0", env, work)
    ROWS[-1] = (*ROWS[-1][:3], ROWS[-1][3] + f" [outputs/ left: {(work / 'outputs').exists()}]")

    # 5. a damaged compile cache entry: a zero-byte .main.so, as a killed compile leaves
    tinyc = f"{GEN} {TINY} compile=true {ASK}"
    want = text(sh("5. tiny compile=true (the reference)", tinyc, env))
    for f in (cache / "inductor").rglob("*.main.so"):
        f.write_bytes(b"")
    p = sh("5. compile=true, zero-byte .main.so in the compile cache", tinyc, env)
    ROWS[-1] = (*ROWS[-1][:3], ROWS[-1][3] + f" [same text: {text(p) == want}]")

    # 7. library messages
    lib_calls = {
        "generate_text(lm, 123)": "generate_text(lm, 123)",
        'SamplingDecoder(top_p="0.5")': 'SamplingDecoder(top_p="0.5")',
        "SpeculativeDecoder stepped before begin":
            "SpeculativeDecoder(prompt_lookup()).step(model_runner(lm.model, make_cache(lm.model, 1, 32)), "
            "torch.tensor([1]))",
    }
    for case, call in lib_calls.items():
        code = ("import torch; from decodelab.models.loading import load; from decodelab.decoding import "
                "generate_text, SamplingDecoder, make_cache, model_runner; from decodelab.decoding.speculative import "
                "SpeculativeDecoder; from decodelab.decoding.drafters import prompt_lookup; "
                f"lm = load('tiny-llama', device='cpu'); {call}")
        p = subprocess.run([PY, "-c", code], cwd=ROOT, capture_output=True, text=True, env={**os.environ, **env})
        last = [ln for ln in p.stderr.splitlines() if ln.strip()][-2:]
        ROWS.append((f"7. {case}", call, p.returncode, " ".join(x.strip() for x in last)[:400]))
        print(ROWS[-1], file=sys.stderr)

    # the README's Gemma example as written (max_new_tokens lowered)
    sh("README: model=gemma3-270m cache=sliding", f"{GEN} prompt='Why is the sky blue?' model=gemma3-270m "
       "cache=sliding chat_template=false max_new_tokens=8", env)

    print("| case | command | exit | first line |\n|---|---|---|---|")
    for case, cmd, rc, msg in ROWS:
        print(f"| {case} | `{cmd}` | {rc} | {msg.replace('|', '/')} |")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
