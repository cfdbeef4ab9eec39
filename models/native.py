"""decodelab's own CPU kernels for weight-only int8 / int4 projections (x86 with AVX2 and
FMA), in `models/kernels/` (package data): the C-style kernels in `native_kernels.cpp` and
the shim that registers them as torch operators, `torch.ops.decodelab.*`, in
`native_ops.cpp`; built together with torch.utils.cpp_extension on first use.

Why: torch's packed CPU kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`)
are fast only where the CPU has bf16 arithmetic (AVX-512 BF16 / AMX). On a CPU without it
(AMD Zen 1-3, AVX2 Xeons) they convert bf16 in software, and int4 ran no faster than our
own int8 here. These kernels stream the codes once per product and compute:
- int8 (`int8_mm`): y = x @ (codes x scale)^T with fp32 activations and fp32 scales, so it
  is quanto's dequantized weight exactly (float summation order aside);
- int4 (`int4_mm`): the codes (0..15, w = code x scale + shift per group of input
  channels) against activations quantized to int8 per 32 input channels (absmax / 127,
  round to nearest even), as llama.cpp's Q8 activations: integer dot products per block
  (`vpmaddubsw`), scaled in fp32; the shifts meet the exact fp32 sums of x per group;
- dequantization of either to fp32 (`int8_dequant`, `int4_dequant`; int4 also straight to
  bf16), for products of many rows (a prefill), which then multiply in fp32 or bf16
  (models/quantize.py, `prefill_dtype`);
- fp32 one-row products (`f32_mv`: a batch-1 decode step of an fp32 model, models/matmul.py):
  each thread streams a contiguous block of the [in, out] weight's rows into its own sums,
  then the sums are added in thread order (so they depend on the thread count).

The int4 kernel reads a row's codes two 32-channel blocks per 32-byte load (`pack_int4`'s
layout puts channels 0-15 of a block in the low nibbles, 16-31 in the high ones; the
activation codes are paired to match once per product): two `vpmaddubsw` summed in int16,
one `vpmaddwd`, then one convert and one fused multiply-add per block pair, its factor the
group scale times each block's activation scale; a row's shifts times the sums of x per group
join its accumulator's 8 lanes (fused, 8 groups at a time) before its one horizontal sum. The
one-row kernel has an AVX-512 VNNI form
(`vpdpbusd`, two rows per 512-bit register), chosen at run time where the CPU has AVX-512
F/BW/DQ/VL and VNNI (Zen 4/5, Xeons since Cascade Lake), else the AVX2 one: the same integer
sums and the same float operations lane by lane, so the two give bit-identical results
(`torch.ops.decodelab.isa(0)` asks for the AVX2 form, `isa(1)` for VNNI where the CPU has it;
tests compare them, on CPUs without AVX-512 through SIMDe's emulation of it).
The int4 cache's decode attention (`int4_decode_attention`) scores the quantized keys in
integers: per key group and query head the query, folded with the group's scales, is rounded
to int16 against its largest channel (max|q'| / 32767 a step; `int16_key_scores` in
cache/kernels/int4.py is its torch model, and bounds what it moves), and the codes are summed
against it in int32 (`pmaddwd`; `vpdpwssd` with VNNI, 16 rows at a time where the head size is
a multiple of 64): exact sums, so both forms give the same scores. The values are summed in
fp32 (512 bits wide at the VNNI level with value groups of 32 channels or more): the same
arithmetic in another order, within float rounding of each other. Both loops fetch the codes
4 KB (keys) and 8 KB (values) ahead of the rows they read.
`rms_norm` and `rope_cos_sin` compute a model's norms and RoPE angles in one order of
arithmetic for eager code and compiled graphs alike (where an int4 product reads them, a
compiled graph's own fused versions differ in the last bit and flip activation codes:
models/transformer.py `share_kernels`).
A shared-kernels model's Llama-style blocks whose four projections are native int4 run as two
operators around their attention (models/transformer.py `Block.fuses`): `int4_qkv_rope` (the
norm, the qkv product, its bias, RoPE on q and k) and `int4_block_out` (wo, the residual add,
the norm, gate_up, the SiLU (ATen's arithmetic and exp) and product, down, the residual add),
each the same arithmetic as its steps one by one, so the same bits, in two operator calls where
the steps make about twenty (what that buys: experiments/README.md, "Batch-1 decode at the memory roofline").
`argmax` is torch.argmax over the last dimension (the same indices; a row with a NaN answered by
torch), vectorized, for greedy decoding's logits (decoding/sampling.py).
A compiled step's int4 layers call `int4_host_attend`, which holds each layer's bound
stores per step plan and runs `int4_store_attend` (write the new K/V, then attend) on them.
The one-row kernels fetch the weight rows 16 rows ahead of the ones they compute
(`ROWS_AHEAD`) and keep their per-call buffers across calls (no allocation per product).

Rows (the product's M) are independent: a row's result does not depend on how many rows
share the call. Threads: OpenMP, linked against the libgomp torch itself loaded (one pool,
`torch.set_num_threads` sets both). As torch operators they cost one dispatcher call from
eager code and run inside a torch.compile graph as opaque calls (fake impls give their
shapes). The library is built once per source, torch, Python, compiler and flags, in a
cpp_extension build directory `$DECODELAB_CACHE/kernels/<key>/` (default
~/.cache/decodelab/kernels; it needs a C++ compiler and ninja), checked before every load
and rebuilt when damaged (models/native_build.py). `problem()` says why the kernels cannot
serve here (None when they can); nothing in this module builds anything until it is called.

int4 codes are stored per block of 32 input channels as 16 bytes, byte j holding channel
j in its low nibble and channel j + 16 in its high one (`pack_int4`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shlex
import shutil
import sys
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from decodelab.models import native_build
from decodelab.models.paths import cache_root

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

#: the kernels' sources, package data of decodelab.models (pyproject's package-data)
SOURCES = ("kernels/native_kernels.cpp", "kernels/native_ops.cpp")
#: compiler flags for both sources (cpp_extension adds torch's includes, -fPIC, -std=c++...)
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
_problem: str | None = None
_checked = False
_library: Path | None = None


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def sources() -> list[Traversable]:
    """The kernels' source files, as the installed package holds them."""
    return [resources.files("decodelab.models").joinpath(s) for s in SOURCES]


def _ldflags() -> list[str]:
    """Link against the libgomp torch itself ships where it has one (one OpenMP pool);
    cpp_extension adds torch's own libraries."""
    lib = Path(torch.__file__).parent / "lib"
    gomp = [str(lib / "libgomp.so.1")] if (lib / "libgomp.so.1").is_file() else ["-fopenmp"]
    return [*gomp, f"-Wl,-rpath,{lib}"]


def _compile(folder: Path) -> str | None:
    """Build `folder/<native_build.LIBRARY>` from the packaged sources; None, or why not."""
    with contextlib.ExitStack() as files:  # real paths, also for a package inside a zip
        paths = [str(files.enter_context(resources.as_file(s))) for s in sources()]
        return native_build.compile_extension(folder, paths, CFLAGS, _ldflags())


def _key(cxx: str) -> str:
    """Changes with either source, torch, Python, the compiler or the flags."""
    parts = [*(s.read_text() for s in sources()), torch.__version__, sys.implementation.cache_tag, cxx,
             *CFLAGS, *_ldflags()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _toolchain_problem(cxx: str) -> str | None:
    """Why cpp_extension cannot build here: no C++ compiler (it runs $CXX, else c++) or no ninja."""
    if not cxx.strip() or shutil.which(shlex.split(cxx)[0]) is None:
        return ("decodelab's native kernels are built with a C++ compiler on first use (torch.utils.cpp_extension "
                f"runs $CXX, else c++), and {cxx!r} was not found (install g++, or set CXX)")
    if native_build.ninja_dir() is None:
        return ("decodelab's native kernels are built with ninja on first use (torch.utils.cpp_extension needs it), "
                "and none was found (pip install ninja)")
    return None


def _build() -> None:
    global _problem, _checked, _library
    _checked = True
    if os.uname().machine not in ("x86_64", "AMD64"):
        _problem = f"decodelab's native kernels are x86 (AVX2) code; this machine is {os.uname().machine}"
        return
    missing = {"avx2", "fma", "f16c"} - _cpu_flags()
    if missing:
        _problem = f"decodelab's native kernels need AVX2, FMA and F16C; this CPU lacks {sorted(missing)}"
        return
    cxx = os.environ.get("CXX", "c++")
    _problem = _toolchain_problem(cxx)
    if _problem is not None:
        return
    folder = cache_root() / "kernels" / _key(cxx)
    _problem = native_build.ready(folder, _compile)
    if _problem is not None:
        return
    out = folder / native_build.LIBRARY
    try:
        torch.ops.load_library(str(out))
        _library = out
        torch.library.register_fake("decodelab::f32_mv")(
            lambda x, w, bias=None: x.new_empty(x.shape[0], w.shape[1], dtype=torch.float32))
        torch.library.register_fake("decodelab::rms_norm")(lambda x, w, eps, offset: x.new_empty(x.shape))
        torch.library.register_fake("decodelab::int4_mm_normed")(
            lambda x, nib, scales, shifts, group_size, norm_w, eps, offset:
            x.new_empty(x.shape[0], nib.shape[0], dtype=torch.float32))
        torch.library.register_fake("decodelab::rope_cos_sin")(_rope_cos_sin_fake)
        torch.library.register_fake("decodelab::argmax")(lambda x: x.new_empty(x.shape[:-1], dtype=torch.long))
        torch.library.register_fake("decodelab::int4_qkv_rope")(
            lambda x, norm_w, eps, offset, nib, *rest: x.new_empty(x.shape[0], nib.shape[0], dtype=torch.float32))
        torch.library.register_fake("decodelab::int4_block_out")(
            lambda attn, x, wo_nib, *rest: x.new_empty(x.shape[0], wo_nib.shape[0], dtype=torch.float32))
        torch.library.register_fake("decodelab::int8_mm")(
            lambda x, codes, scales: x.new_empty(x.shape[0], codes.shape[0], dtype=torch.float32))
        torch.library.register_fake("decodelab::int4_mm")(
            lambda x, nib, scales, shifts, group_size: x.new_empty(x.shape[0], nib.shape[0], dtype=torch.float32))
        torch.library.register_fake("decodelab::decode_attention")(
            lambda q, keys, values, pos, scale, window, k_scale=None, v_scale=None: q.new_empty(q.shape))
        torch.library.register_fake("decodelab::paged_decode_attention")(
            lambda q, k_pool, v_pool, table, pos, scale, window, k_scale=None, v_scale=None: q.new_empty(q.shape))
        torch.library.register_fake("decodelab::int4_decode_attention")(
            lambda q, *stores_and_options: q.new_empty(q.shape))
        torch.library.register_fake("decodelab::int4_store_attend")(
            lambda q, k, v, *stores_and_options: q.new_empty(q.shape))
        torch.library.register_fake("decodelab::int4_host_attend")(
            lambda q, k, v, layer, handle: torch.empty_like(q))
    except Exception as e:  # a cached library this torch cannot load: say so; never half-registered
        _problem = (f"loading decodelab's native kernels from {out} failed ({type(e).__name__}: {e}); delete "
                    f"{out.parent} to rebuild them")


def problem() -> str | None:
    """Why the native kernels cannot serve on this machine (None: they can; built the
    first time on this machine, and loaded as torch operators by this call)."""
    if not _checked:
        _build()
    return _problem


_noted: set[str] = set()


def note_fallback(what: str) -> None:
    """Say once per process, on stderr, that `what` runs on torch's kernels instead of the
    native ones, and why (`problem()`)."""
    if what not in _noted:
        _noted.add(what)
        print(f"decodelab: {what} run on torch's kernels, not decodelab's native ones: {problem()}",
              file=sys.stderr, flush=True)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1), the same indices (the first of equal maxima; a row with a NaN as torch
    answers it), by a vectorized kernel where x is float32 on the CPU and the kernels are already
    loaded (a greedy step's [B, V] logits; torch's is a scalar loop: experiments/README.md);
    elsewhere torch's own. Never builds the kernels."""
    if _library is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() == 0 or x.shape[-1] == 0:
        return x.argmax(-1)
    return torch.ops.decodelab.argmax(x)


def library() -> Path | None:
    """The kernel library this process loaded (None: none, see `problem()`)."""
    problem()
    return _library


def _ops():
    p = problem()
    if p:
        raise RuntimeError(p)
    return torch.ops.decodelab


def shape_problem(weights: str, n_in: int, group_size: int | None) -> str | None:
    """Why the native kernel cannot take a projection of `n_in` inputs (None: it can)."""
    if weights == "int8":
        return None if n_in % 8 == 0 else f"the native int8 kernel needs an input size divisible by 8, not {n_in}"
    if n_in % 64:
        return f"the native int4 kernel needs an input size divisible by 64, not {n_in}"
    if group_size is None or group_size % 32 or n_in % group_size:
        return (f"the native int4 kernel needs a group size that is a multiple of 32 and divides the input size "
                f"{n_in}, not {group_size}")
    return None


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Codes [out, in] (0..15) -> [out, in / 2] uint8 in the native layout: per block of 32
    input channels, byte j = channel j | channel j + 16 << 4."""
    n_out, n_in = codes.shape
    c = codes.to(torch.uint8).reshape(n_out, n_in // 32, 2, 16)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n_out, n_in // 2).contiguous()


def unpack_int4(nib: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int4`: [out, in] codes (uint8)."""
    n_out = nib.shape[0]
    b = nib.reshape(n_out, -1, 16)
    return torch.stack([b & 15, b >> 4], 2).reshape(n_out, -1)


def int8_mm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] (any float dtype; computed in fp32) @ (codes [N, K] int8 x scales [N] fp32)^T
    -> [M, N] fp32 (the operator decodelab::int8_mm)."""
    return _ops().int8_mm(x, codes, scales)


def _rope_cos_sin_fake(inv: torch.Tensor, positions: torch.Tensor):
    shape = (*positions.shape[:-1], 1, positions.shape[-1], 2 * inv.shape[0])
    return inv.new_empty(shape), inv.new_empty(shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """RMSNorm of float32 x over its last dimension with weight [n]: w (x r) (offset 0, Llama's
    order) or (x r)(offset + w) (Gemma's), r = 1 / sqrt(mean(x^2) + eps), one order of
    arithmetic whoever calls it (the operator decodelab::rms_norm)."""
    return _ops().rms_norm(x, weight, eps, offset)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., 1, T, D] of RoPE at positions [..., T] for inverse frequencies
    inv_freq [D / 2] (float32), the angle float(position) x inv_freq in float32 as
    models/transformer.py's `rope_cos_sin` (channels i and i + D / 2 alike), then cosf / sinf
    (the operator decodelab::rope_cos_sin)."""
    return _ops().rope_cos_sin(inv_freq, positions)


def int4_mm(x: torch.Tensor, nib: torch.Tensor, scales: torch.Tensor, shifts: torch.Tensor,
            group_size: int) -> torch.Tensor:
    """x [M, K] @ W^T with W [N, K] = code x scale + shift per group (codes `pack_int4`ed,
    scales/shifts [N, K / group] fp32), x quantized to int8 per 32 channels -> [M, N] fp32
    (the operator decodelab::int4_mm)."""
    return _ops().int4_mm(x, nib, scales, shifts, group_size)


def dequantize_rows(weights: str, o0: int, n: int, out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                    shifts: torch.Tensor | None = None, group_size: int | None = None) -> torch.Tensor:
    """Rows o0 .. o0 + n of the weight [N, K] in `out`'s dtype (fp32; int4 also bf16,
    rounded to nearest even), written into `out` (>= n x K elements, contiguous); returns
    that [n, K] view."""
    ops = _ops()
    K = codes.shape[1] * (2 if weights == "int4" else 1)
    dtypes = (torch.float32, torch.bfloat16) if weights == "int4" else (torch.float32,)
    if out.numel() < n * K or not out.is_contiguous() or out.dtype not in dtypes:
        raise ValueError(f"dequantize_rows: out must be a contiguous buffer of >= {n * K} elements of "
                         f"{' or '.join(str(d).replace('torch.', '') for d in dtypes)}")
    if weights == "int8":
        ops.int8_dequant(codes, scales, o0, n, out)
    else:
        ops.int4_dequant(codes, scales, shifts, group_size, o0, n, out)
    return out.view(-1)[: n * K].view(n, K)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor, scale: float,
                     window: int | None = None, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, T, D] (fp32) over the row-major cache buffers keys, values [B, Hkv, S, D]
    (contiguous; fp32, bf16, fp16 or fp8 e4m3, read in place; GQA: query head h reads kv
    head h // (Hq / Hkv)): each query at position pos [B, T] sees the slots at or before it
    (and, with a `window`, the `window` - 1 before it); only those are read; k_scale,
    v_scale [Hkv] multiply what is read (fp8's scales) -> [B, Hq, T, D] (the operator
    decodelab::decode_attention)."""
    return _ops().decode_attention(q, keys, values, pos, scale, window or 0, k_scale, v_scale)


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                           pos: torch.Tensor, scale: float, window: int | None = None,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`decode_attention` over a paged cache's block pools k_pool, v_pool [Hkv, N, bs, D]
    (any storage dtype `decode_attention` reads, with its scales) read in place through the
    block table [B, M] (row b's slot s: block table[b, s // bs], offset s % bs; block ids
    checked against N; -1, no block, reads block 0 as `gather_rows` does) -> [B, Hq, T, D]
    (the operator decodelab::paged_decode_attention)."""
    return _ops().paged_decode_attention(q, k_pool, v_pool, table, pos, scale, window or 0, k_scale, v_scale)


def int4_decode_attention(q: torch.Tensor, stores: list[list[torch.Tensor]], spans: list[int], qpos: torch.Tensor,
                          vis: torch.Tensor, scale: float, window: int | None, key_group: int,
                          value_group: int) -> torch.Tensor:
    """Decode attention of q [B, Hq, T, D] (fp32) straight from an int4 cache layer's stores
    (cache/int4.py; keys per channel in groups of `key_group` tokens, values per token in
    groups of `value_group` channels): `stores` holds, per kind, one tensor per row, in the
    order key codes, key scales, key shifts, value codes, value scales, value shifts, exact
    keys, exact values; spans: per row (dequant_from, dequant_to, exact_from, exact_to,
    exact_start), flattened; qpos, vis [B, T]: each query's position and V(q). Reads the packed codes in
    place -> [B, Hq, T, D] (the operator decodelab::int4_decode_attention)."""
    return _ops().int4_decode_attention(q, *stores, spans, qpos, vis, scale, window or 0, key_group, value_group)


def int4_store_attend():
    """The operator decodelab::int4_store_attend(q, k, v, fresh, *stores, spans, qpos, vis,
    scale, window, key_group, value_group): `int4_decode_attention` (the same stores and
    options; spans 6 per row, its 5 and `extra`) over each row's exact stores taken extra[b]
    tokens past their views' ends (slots their buffers hold), after writing the row's first
    fresh[b] new tokens of k, v [B, Hkv, T, D] into the last fresh[b] of them (checked to lie
    in the stores' storage). Returned as the bound operator, for a caller that prepares its
    arguments once and calls it per layer (cache/int4.py's compiled step)."""
    return _ops().int4_store_attend
