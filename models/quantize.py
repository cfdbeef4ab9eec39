"""Weight-only quantization (int8 / int4) with optimum-quanto's quantizers, computed by
fast kernels: a model option for targets, and the quantized self-draft of speculative
decoding.

The codes, scales and shifts are quanto's (int8: symmetric, one scale per output
channel, `absmax_scale`; int4: affine, one scale and shift per group of `group_size`
input channels, `MaxOptimizer`, w = code x scale - shift). What computes the product is
an option, `WeightOptions.kernel` (`KERNELS`), and declared per projection
(`QuantProj.kernel`, `WeightOptions.kernel_for()`):
- `native`: decodelab's own CPU kernels (models/native.py; x86 with AVX2 + FMA, built
  with the C compiler on first use). int8: fp32 activations and quanto's fp32 scales, so
  the product is quanto's dequantized weight exactly (summation order aside). int4:
  quanto's fp32 scales and shifts, codes at 0.5 byte per weight, activations quantized to
  int8 per 32 input channels (as llama.cpp's Q8 activations) for integer dot products.
  int4 needs input sizes divisible by 64 and a group size that is a multiple of 32.
- `torch`: torch's packed CPU kernels on bf16 activations (an fp32 model keeps fp32
  everywhere else): int8 `torch._weight_int8pack_mm` (bf16 scales); int4
  `torch._weight_int4pack_mm_for_cpu` (codes packed by `_convert_weight_to_int4pack_for_cpu`;
  per group a bf16 scale and a bf16 zero, the value at code 8: w = (code - 8) x scale +
  zero, so zero = 8 x scale - shift), which takes groups of 32, 64, 128 or 256 input
  channels (quanto's own CPU fast path only groups of 128, which SmolLM2's 576 inputs do
  not divide) and output sizes divisible by 16. These are fast where the CPU has bf16
  arithmetic (AVX-512 BF16, AMX); without it they convert in software.
- `auto` (default): `native` where it serves, else `torch`.
Products of more than `QuantProj.max_kernel_rows` rows (16, native kernels 32: a prefill,
a batch of more rows) dequantize the weight and multiply (native: in blocks of output rows
through one reused buffer per dtype, so no full-size copy is made; torch's path: the whole
weight; inside a compiled step the native kernel takes every row count). For an fp32
model the option `WeightOptions.prefill_dtype` (`PREFILL_DTYPES`) picks what the layers' projections multiply in:
- `float32`: fp32 GEMMs over the dequantized weight (what the fp32 model computes, with
  the quantized weight);
- `bfloat16`: activations and dequantized weight in bf16, products accumulated in fp32 by
  oneDNN and then rounded to bf16 (torch's CPU matmul has no fp32 output for bf16 inputs)
  and widened again: one rounding (at most 2^-8 relative) of each input and each output, small
  beside the int8/int4 rounding itself (tests/models/test_quantize.py bounds it; the
  teacher-forced figures in experiments/README.md, "Quantized weights", measure it).
  Native int8: the codes go to bf16 exactly and the per-channel scales multiply the
  widened product; native int4: code x scale + shift rounded to bf16 (dequantized
  straight to bf16); torch's path: its dequantized weight computed in bf16. oneDNN runs
  these GEMMs on AMX tiles where the CPU has them: SmolLM2-135M's four layer projections
  at 256 rows on a 2-core Xeon with AMX, 1.0 ms against fp32's 5.7 ms;
- `auto` (default): `bfloat16` where the CPU has AMX-BF16 (and torch's oneDNN is on), else
  `float32`.
The LM head multiplies in fp32 either way: a bf16 output would round logits to 8
significant bits (a logit of 20 to steps of 0.125), making ties of near ties. A model in
another dtype multiplies as before (native: fp32; torch's path: the model's dtype). The
torch int4 path keeps its codes twice for the dequantized product (the kernel's packed
layout, and plain nibbles): 1 byte per weight.

A case without a fast kernel (another device, a group size or shape no kernel takes) is
refused before the model is quantized, naming the fix; `allow_slow=True` runs it with
quanto's own modules instead (which dequantize per call on a CPU).

The options travel as one value, `WeightOptions` (a model's `weights`, the yaml node
`model.weights` / `draft.weights`, presets in conf/weights/): it checks itself
(`problems`, `problems_for` a model's shapes on a device) and quantizes a model (`apply`).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from copy import deepcopy
from dataclasses import dataclass, fields, replace

import torch
from torch import nn

from decodelab.models.errors import SetupError, raise_if
from decodelab.models.transformer import Proj

WEIGHT_TYPES = ("none", "int8", "int4")
#: what computes quantized projections (`WeightOptions.kernel`)
KERNELS = ("auto", "native", "torch")
#: the group sizes torch's int4 CPU kernel takes
INT4_GROUPS = (32, 64, 128, 256)
#: what many-row (prefill) products of quantized weights compute in (`WeightOptions.prefill_dtype`)
PREFILL_DTYPES = ("auto", "float32", "bfloat16")


def cpu_has_amx_bf16() -> bool:
    """Whether this CPU has AMX tiles with bf16 arithmetic (Linux: /proc/cpuinfo) and
    torch's oneDNN, which runs bf16 GEMMs on them, is available and enabled."""
    from decodelab.models.native import _cpu_flags

    onednn = torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
    return onednn and {"amx_bf16", "amx_tile"} <= _cpu_flags()


def resolve_prefill_dtype(option: str = "auto") -> torch.dtype | None:
    """The dtype many-row products of an fp32 model's quantized weights compute in: bf16,
    or None (fp32), for a `WeightOptions.prefill_dtype` that `problems` accepts."""
    if option == "auto":
        return torch.bfloat16 if cpu_has_amx_bf16() else None
    return torch.bfloat16 if option == "bfloat16" else None


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


def _torch_kernel(weights: str, n_in: int, n_out: int, group_size: int | None) -> tuple[str | None, str]:
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


@dataclass(frozen=True)
class WeightOptions:
    """How a model's projections hold and compute their weights: one value from the config
    (`model.weights`, `draft.weights`; presets in conf/weights/) to the quantizer. Frozen
    and hashable: equal options make equal quantized copies (a cache key)."""

    kind: str = "none"  # none | int8 | int4 (`WEIGHT_TYPES`): weight-only quantization of the projections
    #: int4: input channels per scale and shift; None: the largest of 128, 64, 32 dividing every input
    group_size: int | None = None
    quantize_head: bool = False  # the LM head quantized too (a tied head: a quantized copy of the embedding)
    allow_slow: bool = False  # a case without a fast kernel runs quanto's own modules instead of being refused
    kernel: str = "auto"  # what multiplies (`KERNELS`; module docstring)
    prefill_dtype: str = "auto"  # what many-row products of an fp32 model compute in (`PREFILL_DTYPES`)

    @classmethod
    def of(cls, value=None, key: str = "model.weights") -> WeightOptions:
        """`value` as options: a WeightOptions as it is; None: no quantization; a kind
        (`"int8"`): that kind, every other field its default; a mapping (dict, DictConfig)
        of fields. A key that is no field, or a value of another type, is refused naming
        `key`; the field values are checked by `problems`."""
        if value is None or isinstance(value, cls):
            return cls() if value is None else value
        names = [f.name for f in fields(cls)]
        if isinstance(value, str):
            return cls(kind=value)
        if not isinstance(value, Mapping):
            raise SetupError(f"{key} must be a weight kind ({' | '.join(WEIGHT_TYPES)}) or a mapping of "
                             f"{', '.join(names)}, got {value!r}")
        close = {k: difflib.get_close_matches(str(k), names, n=1) for k in value if k not in names}
        raise_if([f"{key}.{k} is not a weight option; " + (f"did you mean {key}.{c[0]}? " if c else "")
                  + f"the options are {', '.join(names)}" for k, c in close.items()])
        return cls(**{str(k): value[k] for k in value})

    def problems(self, key: str = "model.weights") -> list[str]:
        """Every problem of these options alone (before any model is known), each naming
        its config key under `key` (`model.weights`, `draft.weights`)."""
        p = [] if self.kind in WEIGHT_TYPES else [f"{key}.kind must be one of {list(WEIGHT_TYPES)}, got {self.kind!r}"]
        if self.kernel not in KERNELS:
            p.append(f"{key}.kernel must be one of {list(KERNELS)}, got {self.kernel!r}")
        if self.prefill_dtype not in PREFILL_DTYPES:
            p.append(f"{key}.prefill_dtype must be one of {list(PREFILL_DTYPES)} (what many-row products of "
                     f"int8/int4 weights compute in), got {self.prefill_dtype!r}")
        g = self.group_size
        if g is not None:
            if self.kind != "int4":
                p.append(f"{key}.group_size applies to int4 weights (int8 has one scale per output channel); "
                         f"remove it or use {key}.kind=int4")
            elif not isinstance(g, int) or isinstance(g, bool) or g < 1:
                p.append(f"{key}.group_size must be a positive integer, got {g!r}")
        for name in ("quantize_head", "allow_slow"):
            if not isinstance(v := getattr(self, name), bool):
                p.append(f"{key}.{name} must be true or false, got {v!r}")
        return p

    def group_for(self, cfg) -> int | None:
        """int4's group size for a model of `cfg`: `group_size`, else the largest of 128,
        64, 32 dividing every projection's input (None: none does); None for int8."""
        if self.kind != "int4" or self.group_size is not None:
            return self.group_size
        return default_group([n for n, _ in projections(cfg, self.quantize_head).values()])

    def problems_for(self, cfg, device="cpu", key: str = "model.weights") -> list[str]:
        """Every reason these options cannot quantize a model of `cfg` on `device` with
        fast kernels (checked before the model is quantized, and before its weights load
        where the config is known first)."""
        p = self.problems(key)
        if p or self.kind == "none":
            return p
        shapes = projections(cfg, self.quantize_head)
        g = self.group_for(cfg)
        if self.kind == "int4" and g is None:
            sizes = sorted({n for n, _ in shapes.values()})
            return [f"int4 weights: no group size of {list(INT4_GROUPS)} divides every projection's input size "
                    f"{sizes}; this model cannot take int4 weights with the fast kernel"
                    + ("" if self.allow_slow else f" (or set {key}.allow_slow=true for quanto's slow path)")]
        for name, (n_in, n_out) in shapes.items():
            if self.kind == "int4" and n_in % g:
                ok = [x for x in INT4_GROUPS if all(n % x == 0 for n, _ in shapes.values())]
                p.append(f"{key}.group_size={g} does not divide the input size {n_in} of the {name} projection; "
                         f"use one of {ok or 'none'}" + (" (or leave it null: the largest that divides)" if ok else ""))
                continue
            found, why = replace(self, group_size=g).kernel_for(n_in, n_out, device)
            if found is None and not self.allow_slow:
                p.append(f"{self.kind} weights of the {name} projection ({n_in} -> {n_out}) have no fast kernel "
                         f"({key}.kernel={self.kernel}): {why}; set {key}.allow_slow=true to run quanto's slower "
                         "path anyway")
        return p

    def kernel_for(self, n_in: int, n_out: int, device) -> tuple[str | None, str]:
        """(the fast kernel that computes a projection of `n_in` -> `n_out` on `device`
        under these options, `group_size` given for int4; or None and why not)."""
        dev = torch.device(device).type
        if dev != "cpu":
            return None, (f"no fast {self.kind} kernel is wired for {dev} here (this build dispatches CPU kernels "
                          "only: decodelab's native ones and torch's packed ones)")
        if self.kernel in ("auto", "native"):
            from decodelab.models import native

            why = native.problem() or native.shape_problem(self.kind, n_in, self.group_size)
            if why is None:
                return f"native-{self.kind}", ""
            if self.kernel == "native":
                return None, why + "; use kernel=auto (native where it serves, else torch's) or kernel=torch"
            if native.problem():
                native.note_fallback(f"{self.kind} weights")
        return _torch_kernel(self.kind, n_in, n_out, self.group_size)

    def apply(self, model, copy: bool = True, key: str = "model.weights"):
        """`model` (a copy of it, unless `copy=False`) with its projections holding these
        weights computed by fast kernels (`QuantProj`); embeddings and norms stay in the
        model dtype, and so does the LM head unless `quantize_head`. A case without a fast
        kernel is refused (naming `key`'s fields), or with `allow_slow` computed by
        quanto's own modules. The model records what it got (`weight_quantization`)."""
        raise_if(self.problems(key))
        if self.kind == "none":
            return model
        if not any(isinstance(m, Proj) for m in model.modules()):
            raise SetupError("this model's projections are quantized already; quantize an unquantized model "
                             "(model.weights.kind=none), or use another draft than a quantized self-draft")
        raise_if(self.problems_for(model.cfg, model.device, key))
        # the group size resolved, `auto` prefills read off the CPU once
        opts = replace(self, group_size=self.group_for(model.cfg),
                       prefill_dtype="bfloat16" if resolve_prefill_dtype(self.prefill_dtype) else "float32")
        q = deepcopy(model) if copy else model
        with torch.no_grad():
            slow = _quantize_projections(q, opts)
        if slow:  # allowed explicitly (problems_for refused it otherwise): quanto's modules
            from optimum.quanto import freeze, qint4, qint8, quantize

            quantize(q, weights={"int8": qint8, "int4": qint4}[self.kind])
            freeze(q)
        q._head_t = None
        kernels = sorted({m.kernel for m in q.modules() if isinstance(m, QuantProj)})
        # the native int4 kernel quantizes its activations: what feeds it must be the same bits eager
        # and compiled, or the compiled text drifts from the eager one (Transformer.share_kernels)
        if "native-int4" in kernels and q.dtype == torch.float32 and q.device.type == "cpu":
            q.share_kernels()
        # what the layers' many-row products compute in (the head: fp32); None: not an fp32 model, as before
        q.weight_quantization = {"weights": self.kind, "group_size": opts.group_size,
                                 "quantize_head": self.quantize_head, "slow": slow, "kernel": self.kernel,
                                 "prefill_dtype": opts.prefill_dtype if q.dtype == torch.float32 else None,
                                 "kernels": kernels, "shared_kernels": q.shared_kernels}
        return q.eval()


def option_problems(value, key: str = "model.weights") -> list[str]:
    """Every problem of a weights option as given (a kind, a mapping of fields, a
    WeightOptions), before any model is known, each naming its key under `key`."""
    try:
        return WeightOptions.of(value, key).problems(key)
    except SetupError as e:
        return list(e.reasons)


def kind_of(value) -> str | None:
    """The kind a weights option as given asks for (None: it cannot be read; `option_problems` says why)."""
    try:
        return WeightOptions.of(value).kind
    except SetupError:
        return None


class QuantProj(nn.Module):
    """A projection y = x @ W (+ b) whose W is held as quanto's int8 or int4 codes and
    computed by a fast kernel (`WeightOptions.kernel_for`): decodelab's native one or
    torch's packed one (bf16 activations)."""

    def __init__(self, weight_in_out: torch.Tensor, bias: torch.Tensor | None, weights: WeightOptions | str):
        """`weights`: int8 or int4 options (or the kind alone); int4 without a group size
        takes the largest of 128, 64, 32 dividing the input; `quantize_head` and
        `allow_slow` are the model's business, not a projection's."""
        super().__init__()
        opts = WeightOptions.of(weights)
        raise_if(opts.problems() + ([] if opts.kind != "none" else ["a QuantProj holds int8 or int4 weights"]))
        #: what many-row products of fp32 activations compute in (None: fp32; module docstring);
        #: a model in another dtype multiplies as before
        fp32 = weight_in_out.dtype == torch.float32
        self.prefill_dtype = resolve_prefill_dtype(opts.prefill_dtype) if fp32 else None
        self._fp32 = fp32
        from optimum.quanto import MaxOptimizer, absmax_scale, qint4, qint8, ungroup
        from optimum.quanto.tensor.weights import WeightQBitsTensor, WeightQBytesTensor

        w = weight_in_out.detach().t().float().contiguous()  # [out, in], quantized in float32
        self.n_in, self.n_out = w.shape[1], w.shape[0]
        if opts.kind == "int4" and opts.group_size is None:
            opts = replace(opts, group_size=default_group([self.n_in]))
        weights, group_size = opts.kind, opts.group_size
        self.weights, self.group_size = weights, group_size  # the kind, int4's group size
        self.kernel, why = opts.kernel_for(self.n_in, self.n_out, w.device)
        if self.kernel is None:
            raise SetupError(f"{weights} weights ({self.n_in} -> {self.n_out}): no fast kernel: {why}")
        native = self.kernel.startswith("native")
        if weights == "int8":
            t = WeightQBytesTensor.quantize(w, qint8, 0, absmax_scale(w, qint8, axis=0))
            self.register_buffer("codes", t._data.contiguous())  # [out, in] int8
            scale = t._scale.reshape(-1).float()
            self.register_buffer("scales", scale.contiguous() if native else scale.to(torch.bfloat16))  # [out]
        else:
            g = group_size
            scale, shift = MaxOptimizer()(w, qtype=qint4, axis=0, group_size=g)  # [out * in / g, 1] each
            t = WeightQBitsTensor.quantize(w, qint4, 0, g, scale, shift)
            codes = ungroup(t._data.unpack(), axis=0, orig_shape=w.shape).to(torch.int32)  # [out, in] in [0, 15]
            if native:  # w = code x scale + shifts, fp32 as quanto made them
                from decodelab.models.native import pack_int4

                self.register_buffer("codes", pack_int4(codes))  # [out, in / 2]
                self.register_buffer("scales", scale.reshape(self.n_out, -1).float().contiguous())  # [out, in / g]
                self.register_buffer("shifts", (-shift).reshape(self.n_out, -1).float().contiguous())
            else:
                scale = scale.reshape(self.n_out, self.n_in // g, 1)
                zero = 8 * scale - shift.reshape(self.n_out, self.n_in // g, 1)  # the value at code 8
                self.register_buffer("codes", torch._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 2))
                self.register_buffer("scale_zeros", torch.cat([scale, zero], 2).transpose(0, 1).contiguous()
                                     .to(torch.bfloat16))  # [in / g, out, 2]
                # the same codes as plain nibbles [out, in / 2] (even input channel low), for the
                # multi-row products that dequantize (the kernel's packed layout is opaque)
                self.register_buffer("nibbles", (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    #: products of more rows than this (a prefill) dequantize the weight and multiply
    #: (`prefill_dtype`) instead: the kernels' cost grows with the rows (torch's packed ones
    #: on a CPU without bf16 arithmetic: 576 x 3072 on 2 AVX2 cores equal to fp32 at 16
    #: rows, 2-3x its cost at 256), while dequantizing costs about one 16-row product
    MAX_KERNEL_ROWS = 16
    #: the same bound for decodelab's native kernels: they stream the weight once for any row
    #: count, so a product of up to 32 rows (a short prompt, a batched decode step) costs less
    #: through them than dequantizing (SmolLM2, 32-token prefill, Zen 3, 2 threads: int8 0.77x,
    #: int4 0.92x fp32's against 1.35x, 1.26x dequantized); at 64 rows and more fp32's GEMM wins
    MAX_NATIVE_ROWS = 32
    #: the native path dequantizes many-row products in blocks of output rows of at most
    #: this many weights (fp32: 32 MiB), through one buffer per dtype shared by all
    #: projections: every projection of a small model but its head is one block, multiplied
    #: by one GEMM straight into the output (on a Zen 3, 256 rows: dequantize + GEMM
    #: 0.97-1.00x fp32's GEMM alone, where blocks of 2^19 weights, each a GEMM into a copied
    #: slice, cost 1.10-1.22x); larger weights go in blocks whose fp32 GEMMs write their
    #: columns of the output in place (bf16 ones: widened, then copied in)
    DEQUANT_BLOCK = 1 << 23

    takes_norm = True  # (models/transformer.py `normed`)

    def forward(self, x: torch.Tensor, norm=None) -> torch.Tensor:
        """y = x @ W (+ b); with `norm` (a shared-kernels model's RMSNorm, `Transformer.share_kernels`),
        of norm(x): where the native int4 kernel takes the product, one operator computes both
        (decodelab::int4_mm_normed: the norm's own arithmetic, then the product)."""
        x2 = x.reshape(-1, self.n_in)
        # (a compiled native step takes the kernel at any row count)
        dequantize = x2.shape[0] > self.max_kernel_rows and not (self.kernel.startswith("native")
                                                                 and torch.compiler.is_compiling())
        if norm is not None and (dequantize or self.kernel != "native-int4" or not norm.native):
            x2, norm = norm(x2), None
        if dequantize:
            y = self._dequantized_product(x2)
        elif self.kernel == "native-int8":
            y = torch.ops.decodelab.int8_mm(x2, self.codes, self.scales)
        elif self.kernel == "native-int4" and norm is not None:
            y = torch.ops.decodelab.int4_mm_normed(x2, self.codes, self.scales, self.shifts, self.group_size,
                                                   norm.weight, norm.eps, float(norm.offset))
        elif self.kernel == "native-int4":
            y = torch.ops.decodelab.int4_mm(x2, self.codes, self.scales, self.shifts, self.group_size)
        elif self.weights == "int8":
            y = torch._weight_int8pack_mm(x2.to(torch.bfloat16), self.codes, self.scales)
        else:
            y = torch._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16), self.codes, self.group_size,
                                                  self.scale_zeros)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.n_out)
        return y if self.bias is None else y + self.bias

    def step_bytes(self) -> int:
        """Bytes a one-row product reads: the codes and scales (and shifts) its kernel streams,
        and the bias; not the plain-nibble copy torch's int4 path keeps for many-row products."""
        read = [self.codes, *(getattr(self, n) for n in ("scales", "shifts", "scale_zeros") if hasattr(self, n))]
        read += [] if self.bias is None else [self.bias]
        return sum(t.numel() * t.element_size() for t in read)

    @property
    def max_kernel_rows(self) -> int:
        """The most rows this projection's kernel takes in eager code (more dequantize)."""
        return self.MAX_NATIVE_ROWS if self.kernel.startswith("native") else self.MAX_KERNEL_ROWS

    def _dequantized_product(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 [rows, in] @ the dequantized weight, in `prefill_dtype` where the activations
        are fp32 (module docstring); returned in fp32 from the native path, else in the
        activations' dtype."""
        bf16 = self.prefill_dtype == torch.bfloat16 and x2.dtype == torch.float32
        if not self.kernel.startswith("native"):
            dt = torch.bfloat16 if bf16 else x2.dtype
            return (x2.to(dt) @ self.dequantized(dt)).to(x2.dtype)
        from decodelab.models.native import dequantize_rows

        xf = x2.to(torch.bfloat16) if bf16 else x2.float()
        rows = max(1, min(self.n_out, self.DEQUANT_BLOCK // self.n_in))
        buf = None if bf16 else _scratch(rows * self.n_in)
        args = (self.codes, self.scales, getattr(self, "shifts", None), self.group_size)

        def block(o0: int, n: int) -> torch.Tensor:  # rows o0 .. o0 + n of the weight [n, in] in xf's dtype
            if not bf16:
                return dequantize_rows(self.weights, o0, n, buf, *args)
            wb = _scratch(n * self.n_in, torch.bfloat16).view(-1)[: n * self.n_in].view(n, self.n_in)
            if self.weights == "int8":  # the codes exactly; the scales apply to the fp32 product
                return wb.copy_(self.codes[o0:o0 + n])
            return dequantize_rows(self.weights, o0, n, wb, *args)  # straight to bf16

        def product(o0: int, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
            w = block(o0, n)
            if not bf16:
                return torch.mm(xf, w.t(), out=out) if out is not None else xf @ w.t()
            y = torch.mm(xf, w.t()).float()  # bf16 GEMM (fp32 accumulation)
            if self.weights == "int8":
                y.mul_(self.scales[o0:o0 + n])
            return y if out is None else out.copy_(y)

        if rows == self.n_out:
            return product(0, rows)
        y = torch.empty(xf.shape[0], self.n_out, dtype=torch.float32)
        for o0 in range(0, self.n_out, rows):  # each GEMM writes its columns of y (row stride n_out)
            product(o0, min(rows, self.n_out - o0), y[:, o0:o0 + rows])
        return y

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [in, out] (a transposed view) this projection computes with: the codes
        times the scales, plus the shifts (int4; torch's path: bf16 scales and zeros), in `dtype`."""
        if self.kernel.startswith("native"):
            from decodelab.models.native import dequantize_rows

            out = torch.empty(self.n_out, self.n_in, dtype=torch.float32)
            w = dequantize_rows(self.weights, 0, self.n_out, out, self.codes, self.scales,
                                getattr(self, "shifts", None), self.group_size)
            return w.to(dtype).t()
        if self.weights == "int8":
            return (self.codes.to(dtype) * self.scales.to(dtype)[:, None]).t()
        n = self.nibbles
        q = torch.stack([n & 15, n >> 4], -1).view(self.n_out, self.n_in // self.group_size, self.group_size)
        scale, zero = self.scale_zeros.to(dtype).transpose(0, 1).unbind(-1)  # [out, in / g] each
        w = q.to(dtype) * scale[..., None] + (zero - 8 * scale)[..., None]  # (code - 8) x scale + zero
        return w.view(self.n_out, self.n_in).t()

    def extra_repr(self) -> str:
        g = f", group_size={self.group_size}" if self.weights == "int4" else ""
        pre = ", prefill in " + ("bfloat16" if self.prefill_dtype else "float32") if self._fp32 else ""
        return f"{self.n_in} -> {self.n_out}, {self.weights}{g}, kernel={self.kernel}{pre}"


_SCRATCH: dict[torch.dtype, torch.Tensor] = {}


def _scratch(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A reused buffer of at least n elements of `dtype` (the native path's dequantized blocks)."""
    if dtype not in _SCRATCH or _SCRATCH[dtype].numel() < n:
        _SCRATCH[dtype] = torch.empty(n, dtype=dtype)
    return _SCRATCH[dtype]


def _as_linear(p: Proj) -> nn.Linear:
    n_in, n_out = p.weight.shape
    lin = nn.Linear(n_in, n_out, bias=p.bias is not None, device=p.weight.device, dtype=p.weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(p.weight.t())
        if p.bias is not None:
            lin.bias.copy_(p.bias)
    return lin


def _quantize_projections(q, opts: WeightOptions) -> list[str]:
    """Every projection of `q` (and its head with `quantize_head`) replaced in place by a
    `QuantProj` of `opts` (group size and prefill dtype resolved), or, where no fast kernel
    serves, by an `nn.Linear` for quanto to quantize; the names of those."""
    slow = []
    for module in list(q.modules()):
        for name, child in list(module.named_children()):
            if not isinstance(child, Proj):
                continue
            if opts.kernel_for(*child.weight.shape, child.weight.device)[0] is None:
                setattr(module, name, _as_linear(child))
                slow.append(name)
            else:
                setattr(module, name, QuantProj(child.weight, child.bias, opts))
    if opts.quantize_head:
        w = q.embed.weight.t() if q.lm_head is None else q.lm_head.weight  # [dim, vocab]
        b = None if q.lm_head is None else q.lm_head.bias
        if opts.kernel_for(*w.shape, w.device)[0] is None:
            lin = nn.Linear(*w.shape, bias=b is not None, device=w.device, dtype=w.dtype)
            lin.weight.copy_(w.t())
            q.lm_head = lin
            slow.append("lm_head")
        else:  # logits stay fp32 (module docstring)
            q.lm_head = QuantProj(w, b, replace(opts, prefill_dtype="float32"))
    return slow
