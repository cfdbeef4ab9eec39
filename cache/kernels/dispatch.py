"""Which attention a cache runs: its pure-torch reference or its Triton kernel.

`impl` is a cache option (conf/cache/paged.yaml, int4.yaml):
- `auto`: the Triton kernel on CUDA when triton is installed, the reference elsewhere;
- `reference`: always the reference (the cache's own torch attention);
- `triton`: always the kernel; on a CPU only under the Triton interpreter
  (`TRITON_INTERPRET=1`, slow, for tests), else a SetupError that says so.
The kernels serve decode-sized forwards (at most `DECODE_QUERIES` queries per row: one
token, or gamma + 1 in speculative verification); longer forwards (prefill) always take
the reference path, which is SDPA over gathered keys.
"""

from __future__ import annotations

import importlib.util
import os

import torch

IMPLS = ("auto", "reference", "triton")
#: the most query positions per row a kernel call takes (gamma + 1 <= 16)
DECODE_QUERIES = 16


def triton_installed() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken or blocked install counts as none
        return False


def interpreting() -> bool:
    """True when Triton kernels run in its interpreter (numpy, on the CPU)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def impl_problems(impl: str, device: torch.device | str) -> list[str]:
    """Every reason `impl` cannot run on `device` (empty when it can)."""
    if impl not in IMPLS:
        return [f"impl must be one of {list(IMPLS)}, got {impl!r}"]
    if impl != "triton":
        return []
    if not triton_installed():
        return ["impl=triton needs the `triton` package (pip install triton; Linux only); "
                "use impl=reference or impl=auto"]
    if torch.device(device).type != "cuda" and not interpreting():
        return [f"impl=triton on {torch.device(device).type!r} runs only in the Triton interpreter: set "
                "TRITON_INTERPRET=1 in the environment before the process starts (slow; for tests), "
                "or use impl=reference / impl=auto"]
    return []


def resolve_impl(impl: str, device: torch.device | str) -> str:
    """'triton' or 'reference' for an option that `impl_problems` accepts."""
    if impl == "auto":
        return "triton" if torch.device(device).type == "cuda" and triton_installed() else "reference"
    return impl


def split_count(programs: int, keys: int, device: torch.device | str, min_keys: int = 128) -> int:
    """Splits of the key range (flash-decoding) so that `programs` x splits fills about two
    waves of the GPU's multiprocessors, each split reading at least `min_keys` keys."""
    dev = torch.device(device)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
    return max(1, min(-(-keys // min_keys), -(-2 * sms // max(programs, 1)), 64))
