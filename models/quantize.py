"""Weight-only quantization with optimum-quanto (int8 / int4): a model option for
targets, and the quantized self-draft of speculative decoding.

quanto quantizes `nn.Linear` modules, so the copy's projections are turned back into
`nn.Linear` ([out, in] weights) first. Note: quanto's kernels on CPU dequantize per
call (measured here: int8 ~15x, int4 ~40x slower than fp32 for SmolLM2-sized layers);
they pay off on GPUs. Quantized models need `torch.no_grad()` rather than
`torch.inference_mode()` (quanto sets version counters), which is what decoding uses.
"""

from __future__ import annotations

from copy import deepcopy

import torch
from torch import nn

from decodelab.models.errors import SetupError
from decodelab.models.transformer import Proj

WEIGHT_TYPES = ("none", "int8", "int4")


def _as_linear(p: Proj) -> nn.Linear:
    n_in, n_out = p.weight.shape
    lin = nn.Linear(n_in, n_out, bias=p.bias is not None, device=p.weight.device, dtype=p.weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(p.weight.t())
        if p.bias is not None:
            lin.bias.copy_(p.bias)
    return lin


def quantize_weights(model, weights: str = "int8", copy: bool = True):
    """`model` (a copy of it, unless `copy=False`) with its projections holding quanto
    `weights` (none | int8 | int4); embeddings, norms and the tied head stay in the
    model dtype. int8 scales per output channel; int4 per group of input channels, whose
    size quanto picks (128, or the largest multiple of 32 down to 32 dividing the input
    size)."""
    if weights not in WEIGHT_TYPES:
        raise SetupError(f"weights {weights!r} unknown; use one of {WEIGHT_TYPES}")
    if weights == "none":
        return model
    if not any(isinstance(m, Proj) for m in model.modules()):
        raise SetupError("this model's projections are quantized already; quantize an unquantized model "
                         "(model.weights=none), or use another draft than a quantized self-draft")
    from optimum.quanto import freeze, qint4, qint8, quantize

    q = deepcopy(model) if copy else model
    for module in list(q.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Proj):
                setattr(module, name, _as_linear(child))
    quantize(q, weights={"int8": qint8, "int4": qint4}[weights])
    freeze(q)
    q._head_t = None
    return q.eval()
