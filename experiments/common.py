"""Helpers shared by the entry points: prompts of chosen lengths, run conditions, tables."""

from __future__ import annotations

import functools
import json
import platform
import subprocess
from importlib import metadata
from pathlib import Path

import torch

FILLER = ("The history of computing is a story of people who wanted to calculate faster than "
          "they could by hand. Mechanical calculators gave way to relays, relays to vacuum tubes, "
          "and tubes to transistors, each step making machines smaller, cheaper and more reliable. ")


def synthetic_prompt(lm, n_tokens: int, seed: int = 0) -> list[int]:
    """Exactly `n_tokens` ids: English filler through the tokenizer when the model has
    one, else seeded random ids."""
    try:
        tok = lm.tokenizer
    except Exception:  # a random-weight model without a tokenizer
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, lm.cfg.vocab_size, (n_tokens,), generator=g).tolist()
    ids = tok.encode(FILLER)
    while len(ids) < n_tokens:
        ids += tok.encode(FILLER)
    return ids[:n_tokens]


@functools.cache
def git_rev() -> str:
    """The revision this process runs: HEAD at the first call (entry points call it as
    they start), `-dirty` when tracked files differed from it then."""
    try:
        rev = _git("rev-parse", "--short", "HEAD") or "unknown"
        return rev + ("-dirty" if rev != "unknown" and _git("status", "--porcelain", "--untracked-files=no") else "")
    except Exception:
        return "unknown"


def _git(*args: str) -> str:
    root = Path(__file__).resolve().parents[1]
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=5).stdout.strip()


def run_conditions(model=None) -> dict:
    """Hardware, threads, versions and git revision, recorded with every figure."""
    versions = {}
    for pkg in ("torch", "transformers", "optimum-quanto", "triton"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    cond = {"git": git_rev(), "python": platform.python_version(), "cpu": cpu_name(),
            "threads": torch.get_num_threads(), "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            **versions}
    if model is not None:
        cond.update(dtype=str(model.dtype).removeprefix("torch."), device=str(model.device),
                    matmul=getattr(model, "matmul", None))
    return cond


def cpu_name() -> str:
    """The CPU's model name and widest vector ISA (from /proc/cpuinfo where there is one)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    flags = _cpuinfo_field(info, "flags").split()
    isa = next((f for f in ("avx512f", "avx2", "avx") if f in flags), "")
    return " ".join(x for x in (_cpuinfo_field(info, "model name") or platform.machine(), isa) if x)


def _cpuinfo_field(info: str, key: str) -> str:
    return next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith(key)), "")


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def print_table(rows: list[dict]) -> None:
    """A Markdown table of dicts sharing keys."""
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(_fmt(r[k]) for k in keys) + " |")


def write_results(name: str, cfg, rows: list[dict], model) -> Path:
    """Print the table and the run conditions; write both with the config as JSON to
    `cfg.out` (default experiments/results/<name>.json)."""
    from omegaconf import OmegaConf

    print_table(rows)
    cond = run_conditions(model)
    print("conditions:", cond)
    out = Path(cfg.out or Path(__file__).resolve().parent / "results" / f"{name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": OmegaConf.to_container(cfg), "rows": rows, "conditions": cond}, indent=1))
    print(f"wrote {out}")
    return out
