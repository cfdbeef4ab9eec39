"""Triton decode-attention kernels beside their pure-torch references.

Each kernel module pairs `<name>_reference` and `<name>_triton`, with the same
signature; tests run both and compare (tests/cache/test_kernels.py). The `@triton.jit`
code lives in the `*_triton` modules, imported only when a Triton path first runs (after
`dispatch` has checked that it can), so every module here imports on a CPU-only machine
without triton, and `TRITON_INTERPRET=1` takes effect if it is set before that first use.

- `dispatch`: the `impl: auto | reference | triton` option of the paged and int4 caches;
- `paged`: decode attention read straight from the paged pool through the block table;
- `int4`: decode attention over quanto-packed codes (dequantized in registers) plus the
  full-precision exact store of the int4 cache;
- `check`: the kernel-vs-reference cases, shared by the tests and experiments/gpu_check.
"""
