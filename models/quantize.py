"""Weight-only quantization (int8 / int4) with optimum-quanto's quantizers, computed by
fast kernels: a model option for targets, and the quantized self-draft of speculative
decoding.

The codes, scales and shifts are quanto's (int8: symmetric, one scale per output
channel, `absmax_scale`; int4: affine, one scale and shift per group of `group_size`
input channels, `MaxOptimizer`, w = code x scale - shift). What computes the product is
declared per case (`weight_kernel`):
- CPU int8: `torch._weight_int8pack_mm` (int8 [out, in], bf16 scales);
- CPU int4: `torch._weight_int4pack_mm_for_cpu` (codes packed by
  `_convert_weight_to_int4pack_for_cpu`; per group a bf16 scale and a bf16 zero, the
  value at code 8: w = (code - 8) x scale + zero, so zero = 8 x scale - shift). It takes
  groups of 32, 64, 128 or 256 input channels (quanto's own CPU fast path only groups of
  128, which SmolLM2's 576 inputs do not divide) and output sizes divisible by 16.
Both kernels read bf16 activations: a projection casts its input to bf16 and its output
back to the model's dtype (an fp32 model keeps fp32 everywhere else). With fp32
activations the same kernels are 4-20x slower (measured on the issue's AVX-512 machine),
so that case is never taken. Products of more than `QuantProj.MAX_KERNEL_ROWS` rows (a
prefill) dequantize the weight and multiply in the model's dtype: the kernels' cost grows
with the rows where the CPU has no bf16 arithmetic. int4 keeps its codes twice for that
(the kernel's packed layout, and plain nibbles): 1 byte per weight instead of 0.5.

A case without a fast kernel (another device, a group size or shape the kernel does not
take) is refused before the model is quantized, naming the fix; `allow_slow=True` runs it
with quanto's own modules instead (which dequantize per call on a CPU).
"""

from __future__ import annotations

from copy import deepcopy

import torch
from torch import nn

from decodelab.models.errors import SetupError, raise_if
from decodelab.models.transformer import Proj

WEIGHT_TYPES = ("none", "int8", "int4")
#: the group sizes torch's int4 CPU kernel takes
INT4_GROUPS = (32, 64, 128, 256)


def weight_option_problems(weights: str = "none", group_size=None, quantize_head=False, allow_slow=False,
                           key: str = "model") -> list[str]:
    """Every problem of the weight options alone (before any model is known)."""
    p = [] if weights in WEIGHT_TYPES else [f"{key}.weights must be one of {list(WEIGHT_TYPES)}, got {weights!r}"]
    if group_size is not None:
        if weights != "int4":
            p.append(f"{key}.weight_group_size applies to int4 weights (int8 has one scale per output channel); "
                     f"remove it or use {key}.weights=int4")
        elif not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
            p.append(f"{key}.weight_group_size must be a positive integer, got {group_size!r}")
    for name, v in (("quantize_head", quantize_head), ("allow_slow", allow_slow)):
        if not isinstance(v, bool):
            p.append(f"{key}.{name} must be true or false, got {v!r}")
    return p


def projections(cfg, quantize_head: bool = False) -> dict[str, tuple[int, int]]:
    """Name -> (inputs, outputs) of every projection quantization touches (one layer
    stands for all: they share shapes), the LM head with `quantize_head`."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    out = {"attention qkv": (cfg.dim, q + 2 * kv), "attention output": (q, cfg.dim),
           "mlp gate/up": (cfg.dim, 2 * cfg.intermediate_size), "mlp down": (cfg.intermediate_size, cfg.dim)}
    if quantize_head:
        out["lm head"] = (cfg.dim, cfg.vocab_size)
    return out


def default_group(sizes: list[int]) -> int | None:
    """The largest of 128, 64, 32 that divides every input size (None: none does)."""
    return next((g for g in (128, 64, 32) if all(n % g == 0 for n in sizes)), None)


def weight_kernel(weights: str, n_in: int, n_out: int, group_size: int | None, device) -> tuple[str | None, str]:
    """(the fast kernel that computes this projection, or None; why not, when None)."""
    dev = torch.device(device).type
    if dev != "cpu":
        return None, (f"no fast {weights} kernel is wired for {dev} here (this build dispatches torch's packed CPU "
                      "kernels only)")
    if weights == "int8":
        ok = hasattr(torch, "_weight_int8pack_mm")
        return ("_weight_int8pack_mm", "") if ok else (None, "this torch has no _weight_int8pack_mm")
    if not hasattr(torch, "_weight_int4pack_mm_for_cpu"):
        return None, "this torch has no _weight_int4pack_mm_for_cpu"
    if group_size not in INT4_GROUPS:
        return None, f"torch's int4 CPU kernel takes groups of {list(INT4_GROUPS)} input channels, not {group_size}"
    if n_in % group_size:
        return None, f"group size {group_size} does not divide the input size {n_in}"
    if n_out % 16:
        return None, f"torch's int4 CPU kernel needs an output size divisible by 16, not {n_out}"
    return "_weight_int4pack_mm_for_cpu", ""


def weight_problems(cfg, weights: str = "none", group_size=None, quantize_head=False, allow_slow=False, device="cpu",
                    key: str = "model") -> list[str]:
    """Every reason these weight options cannot quantize a model of `cfg` on `device`
    with fast kernels (checked before the model is quantized, and before its weights
    load where the config is known first)."""
    p = weight_option_problems(weights, group_size, quantize_head, allow_slow, key)
    if p or weights == "none":
        return p
    shapes = projections(cfg, quantize_head)
    g = group_size
    if weights == "int4" and g is None:
        g = default_group([n for n, _ in shapes.values()])
        if g is None:
            sizes = sorted({n for n, _ in shapes.values()})
            return [f"int4 weights: no group size of {list(INT4_GROUPS)} divides every projection's input size "
                    f"{sizes}; this model cannot take int4 weights with the fast kernel"
                    + ("" if allow_slow else f" (or set {key}.allow_slow=true for quanto's slow path)")]
    for name, (n_in, n_out) in shapes.items():
        if weights == "int4" and n_in % g:
            ok = [x for x in INT4_GROUPS if all(n % x == 0 for n, _ in shapes.values())]
            p.append(f"{key}.weight_group_size={g} does not divide the input size {n_in} of the {name} projection; "
                     f"use one of {ok or 'none'}" + (" (or leave it null: the largest that divides)" if ok else ""))
            continue
        kernel, why = weight_kernel(weights, n_in, n_out, g, device)
        if kernel is None and not allow_slow:
            p.append(f"{weights} weights of the {name} projection ({n_in} -> {n_out}) have no fast kernel: {why}; "
                     f"set {key}.allow_slow=true to run quanto's slower path anyway")
    return p


class QuantProj(nn.Module):
    """A projection y = x @ W (+ b) whose W is held as quanto's int8 or int4 codes and
    computed by torch's packed CPU kernel (`weight_kernel`) on bf16 activations."""

    def __init__(self, weight_in_out: torch.Tensor, bias: torch.Tensor | None, weights: str,
                 group_size: int | None = None):
        super().__init__()
        from optimum.quanto import MaxOptimizer, absmax_scale, qint4, qint8, ungroup
        from optimum.quanto.tensor.weights import WeightQBitsTensor, WeightQBytesTensor

        w = weight_in_out.detach().t().float().contiguous()  # [out, in], quantized in float32
        self.n_in, self.n_out = w.shape[1], w.shape[0]
        self.weights, self.group_size = weights, group_size
        self.kernel, why = weight_kernel(weights, self.n_in, self.n_out, group_size, w.device)
        if self.kernel is None:
            raise SetupError(f"{weights} weights ({self.n_in} -> {self.n_out}): no fast kernel: {why}")
        if weights == "int8":
            t = WeightQBytesTensor.quantize(w, qint8, 0, absmax_scale(w, qint8, axis=0))
            self.register_buffer("codes", t._data.contiguous())  # [out, in] int8
            self.register_buffer("scales", t._scale.reshape(-1).to(torch.bfloat16))  # [out]
        else:
            g = group_size
            scale, shift = MaxOptimizer()(w, qtype=qint4, axis=0, group_size=g)  # [out * in / g, 1] each
            t = WeightQBitsTensor.quantize(w, qint4, 0, g, scale, shift)
            codes = ungroup(t._data.unpack(), axis=0, orig_shape=w.shape).to(torch.int32)  # [out, in] in [0, 15]
            scale = scale.reshape(self.n_out, self.n_in // g, 1)
            zero = 8 * scale - shift.reshape(self.n_out, self.n_in // g, 1)  # the value at code 8
            self.register_buffer("codes", torch._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 2))
            self.register_buffer("scale_zeros", torch.cat([scale, zero], 2).transpose(0, 1).contiguous()
                                 .to(torch.bfloat16))  # [in / g, out, 2]
            # the same codes as plain nibbles [out, in / 2] (even input channel low), for the
            # multi-row products that dequantize (the kernel's packed layout is opaque)
            self.register_buffer("nibbles", (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    #: products of more rows than this (a prefill) dequantize the weight and multiply in the
    #: activations' dtype instead: the packed kernels' cost grows with the rows on a CPU
    #: without bf16 arithmetic (576 x 3072 on 2 AVX2 cores: equal to fp32 at 16 rows, 2-3x
    #: its cost at 256), while dequantizing costs about one 16-row product
    MAX_KERNEL_ROWS = 16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.n_in)
        if x2.shape[0] > self.MAX_KERNEL_ROWS:
            y = x2 @ self.dequantized(x.dtype)
        elif self.weights == "int8":
            y = torch._weight_int8pack_mm(x2.to(torch.bfloat16), self.codes, self.scales)
        else:
            y = torch._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16), self.codes, self.group_size,
                                                  self.scale_zeros)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.n_out)
        return y if self.bias is None else y + self.bias

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [in, out] (a transposed view) this projection computes with: the codes
        times the bf16 scales, plus the bf16 zeros (int4), in `dtype`."""
        if self.weights == "int8":
            return (self.codes.to(dtype) * self.scales.to(dtype)[:, None]).t()
        n = self.nibbles
        q = torch.stack([n & 15, n >> 4], -1).view(self.n_out, self.n_in // self.group_size, self.group_size)
        scale, zero = self.scale_zeros.to(dtype).transpose(0, 1).unbind(-1)  # [out, in / g] each
        w = q.to(dtype) * scale[..., None] + (zero - 8 * scale)[..., None]  # (code - 8) x scale + zero
        return w.view(self.n_out, self.n_in).t()

    def extra_repr(self) -> str:
        g = f", group_size={self.group_size}" if self.weights == "int4" else ""
        return f"{self.n_in} -> {self.n_out}, {self.weights}{g}, kernel={self.kernel}"


def _as_linear(p: Proj) -> nn.Linear:
    n_in, n_out = p.weight.shape
    lin = nn.Linear(n_in, n_out, bias=p.bias is not None, device=p.weight.device, dtype=p.weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(p.weight.t())
        if p.bias is not None:
            lin.bias.copy_(p.bias)
    return lin


def quantize_weights(model, weights: str = "int8", copy: bool = True, group_size: int | None = None,
                     quantize_head: bool = False, allow_slow: bool = False):
    """`model` (a copy of it, unless `copy=False`) with its projections holding `weights`
    (none | int8 | int4) computed by fast kernels (`QuantProj`); embeddings and norms stay
    in the model dtype, and so does the LM head unless `quantize_head` (a tied head gets a
    quantized copy of the embedding). int4 groups `group_size` input channels (None: the
    largest of 128, 64, 32 dividing every projection's input). A case without a fast
    kernel is refused, or with `allow_slow` computed by quanto's own modules."""
    raise_if(weight_option_problems(weights, group_size, quantize_head, allow_slow))
    if weights == "none":
        return model
    if not any(isinstance(m, Proj) for m in model.modules()):
        raise SetupError("this model's projections are quantized already; quantize an unquantized model "
                         "(model.weights=none), or use another draft than a quantized self-draft")
    raise_if(weight_problems(model.cfg, weights, group_size, quantize_head, allow_slow, model.device))
    g = group_size
    if weights == "int4" and g is None:
        g = default_group([n for n, _ in projections(model.cfg, quantize_head).values()])
    q = deepcopy(model) if copy else model
    slow = []
    with torch.no_grad():
        for module in list(q.modules()):
            for name, child in list(module.named_children()):
                if not isinstance(child, Proj):
                    continue
                n_in, n_out = child.weight.shape
                if weight_kernel(weights, n_in, n_out, g, child.weight.device)[0] is None:
                    setattr(module, name, _as_linear(child))
                    slow.append(name)
                else:
                    setattr(module, name, QuantProj(child.weight, child.bias, weights, g))
        if quantize_head:
            w = q.embed.weight.t() if q.lm_head is None else q.lm_head.weight  # [dim, vocab]
            b = None if q.lm_head is None else q.lm_head.bias
            if weight_kernel(weights, *w.shape, g, w.device)[0] is None:
                lin = nn.Linear(*w.shape, bias=b is not None, device=w.device, dtype=w.dtype)
                lin.weight.copy_(w.t())
                q.lm_head = lin
                slow.append("lm_head")
            else:
                q.lm_head = QuantProj(w, b, weights, g)
    if slow:  # allowed explicitly (weight_problems refused it otherwise): quanto's modules
        from optimum.quanto import freeze, qint4, qint8, quantize

        quantize(q, weights={"int8": qint8, "int4": qint4}[weights])
        freeze(q)
    q._head_t = None
    q.weight_quantization = {"weights": weights, "group_size": g if weights == "int4" else None,
                             "quantize_head": quantize_head, "slow": slow}
    return q.eval()
