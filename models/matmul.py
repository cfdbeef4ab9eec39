"""The projections' matmul y = x @ W (+ b), W stored [in, out], and its CPU fast path.

`matmul` is a model option (conf/model/*.yaml, `load(..., matmul=...)`):
- `reference`: always `x @ W`, torch's own kernel (MKL on an x86 CPU);
- `onednn`: products of 2 to `MAX_ROWS` (64) rows (a verify over gamma + 1 tokens, a
  decode step of a batch, a short prompt) use oneDNN's linear over a packed copy of the
  weight (fp32 models on a CPU; autograd takes the reference); longer prefills stay on
  `x @ W`. Traced by torch.compile (a compiled step,
  decoding/compiled.py), the oneDNN product is one opaque call in the graph
  (`decodelab::onednn_linear`), where inductor would lower `x @ W` to MKL's sgemm
  (experiments/results/engine-compile);
  One-row products (a batch-1 decode step, the tied head's too) take decodelab's native
  `f32_mv` where its kernels serve (models/native.py): each thread streams a contiguous
  block of the weight's rows into its own sums, added in thread order (results depend on
  the thread count, not on the data);
- `auto`: `onednn` where it serves (a torch built with oneDNN, an fp32 model on a CPU),
  else `reference`.

Why: a decode step feeds one row per sequence, a speculative verify feeds gamma + 1.
Decoding is memory-bound, so gamma + 1 rows should cost about what one row costs: the
weights are read once either way. MKL's small-M sgemm on this project's CPU (AMD EPYC,
AVX-512) does not get there: SmolLM2-135M's 3-row forward costs 1.8x a 1-row one and a
5-row one 2.3x. oneDNN's packed linear streams the weights once for all rows: 1.1x
(experiments/README.md, "CPU verify cost"). One-row products do not take oneDNN, whose
small-M path was slower than MKL's gemv there (the LM head: 7.0 ms against 4.6 ms); they
take the native `f32_mv`, which reads the weight as one contiguous stream per thread
(its bandwidth against MKL's: experiments/README.md, "Batch-1 decode at the memory roofline").

Cost: the packed copies hold the projection weights a second time, and a tied head's
embedding too (made on first use, rebuilt when the weight changes). Results differ from
`x @ W` by float summation order, as MKL's own kernels for different row counts already
do (tests/models/test_matmul.py: logits within 1e-4 on every tiny model family).
"""

from __future__ import annotations

import weakref

import torch

from decodelab.models.handles import Handles

IMPLS = ("auto", "reference", "onednn")
_PACK_ROWS = 16  # the row count oneDNN tunes the packed layout for (any count runs)
#: the most rows a product sends to oneDNN: decode-shaped products (verify calls, batched
#: decode steps, short prompts); longer prefills stay on `x @ W`, bit-identical with
#: transformers' own forward (tests/models/test_agreement.py holds them to that)
MAX_ROWS = 64


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _serves(dtype: torch.dtype | None, device: torch.device | str | None) -> bool:
    """oneDNN's path serves fp32 models on a CPU (None: not known yet)."""
    return dtype in (None, torch.float32) and (device is None or torch.device(device).type == "cpu")


def impl_problems(impl: str, dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                  key: str = "matmul") -> list[str]:
    """Every reason `impl` cannot run for a model of `dtype` on `device` (empty when it can)."""
    if impl not in IMPLS:
        return [f"{key} must be one of {list(IMPLS)}, got {impl!r}"]
    if impl != "onednn":
        return []
    if not onednn_available():
        return [f"{key}=onednn needs a torch built with oneDNN (torch.backends.mkldnn); use {key}=auto "
                f"or {key}=reference"]
    if not _serves(dtype, device):
        return [f"{key}=onednn serves float32 models on a CPU, not {dtype} on {device}; use {key}=auto "
                f"(it picks the reference there) or dtype=float32 on the CPU"]
    return []


def resolve_impl(impl: str, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> str:
    """'onednn' or 'reference' for an option that `impl_problems` accepts."""
    if impl == "auto":
        return "onednn" if onednn_available() and _serves(dtype, device) else "reference"
    return impl


def version_of(w: torch.Tensor) -> int:
    """`w._version`, or -1 for an inference tensor (it keeps no version counter)."""
    return -1 if w.is_inference() else w._version


class PackedWeight:
    """oneDNN's packed copy of one weight, rebuilt when the weight object, its storage,
    version, dtype or device changes. In-place edits of the parameter (under no_grad)
    are seen; edits through `.data` or of an inference tensor are not: call
    `Transformer.set_matmul(model.matmul)` after those to drop every copy."""

    def __init__(self):
        self.key: tuple | None = None
        self.source: weakref.ref | None = None
        self.packed: torch.Tensor | None = None
        self.handle = _PACKS.add(self)  # what a compiled graph's oneDNN call finds it by (models/handles.py)

    def get(self, w: torch.Tensor, out_in: bool = False) -> torch.Tensor:
        """The packed copy of `w` ([in, out], or [out, in] with `out_in`)."""
        key = (w.data_ptr(), version_of(w), w.dtype, w.device, out_in)
        if key != self.key or self.source is None or self.source() is not w:
            w_oi = w.detach() if out_in else w.detach().t()  # [out, in], as oneDNN takes it
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w_oi.contiguous(), _PACK_ROWS)
            self.key, self.source = key, weakref.ref(w)
        return self.packed

    def clear(self) -> None:
        self.key = self.source = self.packed = None

    def __deepcopy__(self, memo) -> "PackedWeight":
        return PackedWeight()  # derived data (and oneDNN's opaque tensors cannot be copied)

    def __reduce__(self):
        return PackedWeight, ()  # derived data: an unpickled copy (any protocol) packs afresh, with its own handle


#: the live PackedWeights of the process, by handle (what the traced op carries)
_PACKS = Handles()


def _linear(x2: torch.Tensor, packed: PackedWeight, w: torch.Tensor, b: torch.Tensor | None,
            out_in: bool) -> torch.Tensor:
    """y [rows, out] = x2 [rows, in] @ W (+ b) through oneDNN's packed copy of w (packed on
    first use, rebuilt when w changes)."""
    rows = x2.shape[0]
    if rows == 2:  # oneDNN's 2-row kernel streams the weights ~35% slower than its 3-row one
        x2 = torch.cat([x2, x2[:1]])
    y = torch.ops.mkldnn._linear_pointwise(x2, packed.get(w, out_in=out_in), b, "none", [], "")
    return y[:rows] if rows == 2 else y


def _onednn_linear(x2: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out_in: bool,
                   handle: torch.Tensor) -> torch.Tensor:
    """`_linear` on the PackedWeight `handle` names: what a traced graph calls (one opaque
    op, `decodelab::onednn_linear`: oneDNN's packed weight is an opaque oneDNN tensor, which
    inductor cannot take as a graph input; its fake gives the output's shape)."""
    packed = _PACKS.get(handle)
    if packed is None:
        raise RuntimeError("a compiled step's oneDNN projection ran after its model's weights were dropped or its "
                           "projections replaced; build a new compiled step for the model as it is now")
    return _linear(x2, packed, w, b, out_in)


def _onednn_linear_fake(x2, w, b, out_in, handle):
    torch._check(x2.shape[1] == (w.shape[1] if out_in else w.shape[0]),
                 lambda: f"onednn_linear: {x2.shape[1]} inputs against a weight of shape {tuple(w.shape)}")
    return x2.new_empty(x2.shape[0], w.shape[0] if out_in else w.shape[1])


# registered with the module (under a millisecond, no torch._dynamo import); CPU only
torch.library.custom_op("decodelab::onednn_linear", _onednn_linear, mutates_args=(),
                        device_types="cpu").register_fake(_onednn_linear_fake)


#: whether decodelab's native kernels serve here (models/native.py), asked once by
#: `native_mv_ready` (from `Transformer.set_matmul`: the build, if any, at model load)
_NATIVE_MV: list[bool] = []


def native_mv_ready() -> bool:
    """Whether one-row fp32 products can take the native `f32_mv` (built on first use; where
    it cannot, said once on stderr and `x @ W` serves)."""
    if not _NATIVE_MV:
        from decodelab.models import native

        _NATIVE_MV.append(native.problem() is None)
        if not _NATIVE_MV[0]:
            native.note_fallback("fp32 one-row products (decode steps)")
    return _NATIVE_MV[0]


def _takes_native_mv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    grad = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (b is not None and b.requires_grad))
    if not _NATIVE_MV and x.device.type == "cpu" and not torch.compiler.is_compiling():
        native_mv_ready()  # a projection used outside a model (its set_matmul asks first)
    return (bool(_NATIVE_MV) and _NATIVE_MV[0] and x.device.type == "cpu" and x.dtype == w.dtype == torch.float32
            and w.is_contiguous() and w.shape[1] % 8 == 0 and not grad
            and (b is None or b.dtype == torch.float32))


def _takes_onednn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, rows: int) -> bool:
    grad = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (b is not None and b.requires_grad))
    return 2 <= rows <= MAX_ROWS and x.device.type == "cpu" and x.dtype == w.dtype == torch.float32 and not grad


def project(
    x: torch.Tensor,  # [..., in]
    w: torch.Tensor,  # [in, out]
    b: torch.Tensor | None,  # [out]
    impl: str,  # resolved: 'onednn' or 'reference'
    packed: PackedWeight,
    w_out_in: torch.Tensor | None = None,  # [out, in]: the same weight, packed without a transpose
) -> torch.Tensor:
    """y [..., out] = x @ W (+ b)."""
    rows = x.numel() // x.shape[-1]
    if rows == 1 and impl == "onednn" and _takes_native_mv(x, w, b):
        y = torch.ops.decodelab.f32_mv(x.reshape(1, x.shape[-1]), w, b)
        return y.reshape(*x.shape[:-1], y.shape[-1])
    if impl != "onednn" or not _takes_onednn(x, w, b, rows):
        y = x @ w
        return y if b is None else y + b
    x2 = x.reshape(rows, x.shape[-1])
    wt, out_in = (w, False) if w_out_in is None else (w_out_in, True)
    if torch.compiler.is_compiling():
        y = torch.ops.decodelab.onednn_linear(x2, wt, b, out_in, packed.handle)
    else:
        y = _linear(x2, packed, wt, b, out_in)
    return y.reshape(*x.shape[:-1], y.shape[-1])
