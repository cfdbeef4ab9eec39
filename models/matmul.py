"""The projections' matmul y = x @ W (+ b), W stored [in, out], and its CPU fast path.

`matmul` is a model option (conf/model/*.yaml, `load(..., matmul=...)`):
- `reference`: always `x @ W`, torch's own kernel (MKL on an x86 CPU);
- `onednn`: forwards of 2 or more rows use oneDNN's linear over a packed copy of the
  weight (fp32, CPU, no autograd); one-row forwards stay on `x @ W`;
- `auto`: `onednn` where it can run (a CPU torch built with oneDNN), else `reference`.

Why: a decode step feeds one row per sequence, a speculative verify feeds gamma + 1.
Decoding is memory-bound, so gamma + 1 rows should cost about what one row costs: the
weights are read once either way. MKL's small-M sgemm on this project's CPU (AMD EPYC,
AVX-512) does not get there: SmolLM2-135M's 3-row forward costs 1.8x a 1-row one and a
5-row one 2.3x. oneDNN's packed linear streams the weights once for all rows: 1.1x
(experiments/README.md, "CPU verify cost"). One-row products stay with MKL, whose gemv
is faster there (the LM head: 4.6 ms against 7.0 ms).

Cost: the packed copy holds the projection weights a second time (made on first use,
rebuilt when the weight changes). Results differ from `x @ W` by float summation order
(relative 1e-6 in fp32), as MKL's own kernels for different row counts already do.
"""

from __future__ import annotations

import torch

IMPLS = ("auto", "reference", "onednn")
_PACK_ROWS = 16  # the row count oneDNN tunes the packed layout for (any count runs)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def impl_problems(impl: str) -> list[str]:
    """Every reason `impl` cannot run here (empty when it can)."""
    if impl not in IMPLS:
        return [f"matmul must be one of {list(IMPLS)}, got {impl!r}"]
    if impl == "onednn" and not onednn_available():
        return ["matmul=onednn needs a torch built with oneDNN (torch.backends.mkldnn); use matmul=auto "
                "or matmul=reference"]
    return []


def resolve_impl(impl: str) -> str:
    """'onednn' or 'reference' for an option that `impl_problems` accepts."""
    if impl == "auto":
        return "onednn" if onednn_available() else "reference"
    return impl


class PackedWeight:
    """oneDNN's packed copy of one [in, out] weight, rebuilt whenever the weight's
    storage, version, dtype or device changes."""

    def __init__(self):
        self.key: tuple | None = None
        self.packed: torch.Tensor | None = None

    def get(self, w: torch.Tensor) -> torch.Tensor:
        key = (w.data_ptr(), w._version, w.dtype, w.device)
        if key != self.key:
            w_oi = w.detach().t().contiguous()  # [out, in], as oneDNN takes it
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w_oi, _PACK_ROWS)
            self.key = key
        return self.packed

    def clear(self) -> None:
        self.key = self.packed = None

    def __deepcopy__(self, memo) -> "PackedWeight":
        return PackedWeight()  # derived data (and oneDNN's opaque tensors cannot be copied)

    def __getstate__(self) -> dict:
        return {"key": None, "packed": None}


def _takes_onednn(x: torch.Tensor, w: torch.Tensor, rows: int) -> bool:
    grad = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)
    return rows >= 2 and x.device.type == "cpu" and x.dtype == w.dtype == torch.float32 and not grad


def project(
    x: torch.Tensor,  # [..., in]
    w: torch.Tensor,  # [in, out]
    b: torch.Tensor | None,  # [out]
    impl: str,  # resolved: 'onednn' or 'reference'
    packed: PackedWeight,
) -> torch.Tensor:
    """y [..., out] = x @ W (+ b)."""
    rows = x.numel() // x.shape[-1]
    if impl != "onednn" or not _takes_onednn(x, w, rows):
        y = x @ w
        return y if b is None else y + b
    x2 = x.reshape(rows, x.shape[-1])
    if rows == 2:  # oneDNN's 2-row kernel streams the weights ~35% slower than its 3-row one
        x2 = torch.cat([x2, x2[:1]])
    y = torch.ops.mkldnn._linear_pointwise(x2, packed.get(w), b, "none", [], "")
    return y[:rows].reshape(*x.shape[:-1], y.shape[-1])
