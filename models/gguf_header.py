"""The tensor types a GGUF file stores, read from its header alone (the `gguf` package's
reader maps every tensor). Run conditions say from which quantized types a model's fp32
weights were dequantized.

Layout (GGUF v2/v3, little-endian): magic `GGUF`, u32 version, u64 tensor count, u64
key-value count; each key-value: string key, u32 value type, value; then per tensor: string
name, u32 dims, u64 x dims, u32 type, u64 offset. A string is u64 length + bytes.
"""

from __future__ import annotations

import struct
from collections import Counter
from pathlib import Path

#: GGML tensor type ids (ggml.h) -> names; the unquantized ones are FLOAT_TYPES
TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K",
              11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS",
              18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16",
              26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}
FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


class _Reader:
    def __init__(self, f):
        self.f = f

    def take(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        data = self.f.read(size)
        if len(data) != size:
            raise ValueError("the file ends inside its header")
        return struct.unpack("<" + fmt, data)[0]

    def string(self) -> str:
        return self.f.read(self.take("Q")).decode("utf-8", "replace")

    def skip_value(self, kind: int) -> None:
        if kind == 8:
            self.string()
        elif kind == 9:  # an array: its item type, its length, the items
            item, n = self.take("I"), self.take("Q")
            if item in _SCALARS:
                self.f.seek(n * struct.calcsize("<" + _SCALARS[item]), 1)
            else:
                for _ in range(n):
                    self.skip_value(item)
        elif kind in _SCALARS:
            self.take(_SCALARS[kind])
        else:
            raise ValueError(f"unknown GGUF value type {kind}")


def tensor_types(path: str | Path) -> Counter:
    """How many tensors of each GGML type (`Q4_1`, `F32`, ...) the GGUF file at `path` holds.
    ValueError for a file that is not GGUF or whose header is cut short."""
    with open(path, "rb") as f:
        r = _Reader(f)
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
        version = r.take("I")
        if version < 2:
            raise ValueError(f"{path} is GGUF version {version}; versions 2 and 3 are read")
        n_tensors, n_kv = r.take("Q"), r.take("Q")
        for _ in range(n_kv):
            r.string()
            r.skip_value(r.take("I"))
        types = Counter()
        for _ in range(n_tensors):
            r.string()
            f.seek(8 * r.take("I"), 1)  # the dims
            kind = r.take("I")
            types[TYPE_NAMES.get(kind, f"type{kind}")] += 1
            r.take("Q")  # the data offset
        return types


def quantized_types(path: str | Path) -> list[str]:
    """The quantized GGML types in the file, most tensors first (empty: a float file)."""
    return [t for t, _ in tensor_types(path).most_common() if t not in FLOAT_TYPES]
