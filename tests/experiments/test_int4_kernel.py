"""experiments/int4_kernel.py, the native int4 attention's own benchmark: it times the
kernel it names, over stores of the contexts asked for, and records what it ran on."""

from __future__ import annotations

import json

import pytest
import torch

from decodelab.cache.kernels.int4 import int4_attention_native, int4_attention_reference
from decodelab.experiments import int4_kernel
from decodelab.models import native

pytestmark = pytest.mark.skipif(native.problem() is not None, reason=f"native kernels: {native.problem()}")


def test_its_layers_are_what_it_says_and_it_writes_its_rows(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(int4_kernel, "LAYERS", 2)
    calls = int4_kernel.layers(300)
    assert len(calls) == 2
    q, rows, (qpos, vis) = calls[0]
    assert q.shape == (1, 9, 1, 64) and rows.key_codes[0].data.shape[0] == 3  # SmolLM2's heads
    assert rows.dequant_to[0] - rows.dequant_from[0] >= 128  # quantized keys to read, not only exact ones
    got = int4_attention_native(q, rows, qpos, vis, 64**-0.5)
    want = int4_attention_reference(q, rows, qpos, vis, 64**-0.5, int16_query=True)
    assert (got - want).abs().max().item() <= 1e-4  # the kernel it times is the one tests/cache checks
    out = tmp_path / "k.jsonl"
    before = torch.get_num_threads()
    try:
        rows_out = int4_kernel.main(["--contexts", "300", "--rounds", "2", "--threads", "1", "--out", str(out)])
    finally:
        torch.set_num_threads(before)
    (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert rec["context"] == 300 and rec["layers_in_turn_us"] > 0 and rec["one_layer_us"] > 0
    assert rec["conditions"]["threads"] == 1 and rec["isa"] in ("avx2", "avx512-vnni")
    assert rows_out[0]["context"] == 300 and "| 300 |" in capsys.readouterr().out
