"""Shared fixtures: tiny random models of every family and (slow) the real checkpoints."""

from __future__ import annotations

import os

import pytest
import torch

from decodelab.cache.dense import DenseCache
from decodelab.decoding.text import make_cache
from decodelab.models.loading import random_model

torch.set_num_threads(2)
# compiled CPU steps in tests: inductor's Python wrapper. The C++ wrapper users get by default
# builds a C++ entry per graph, which costs these tests' many small graphs more than it saves
# (experiments/results/roofline-s49/README.md); tests/decoding/test_cpu_wrapper.py runs it,
# and DECODELAB_CPU_WRAPPER=cpp pytest ... runs it everywhere
os.environ.setdefault("DECODELAB_CPU_WRAPPER", "python")

TINY = {
    "llama": dict(family="llama", vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                  intermediate_size=128, max_seq_len=512, rope=dict(theta=10000.0)),
    "llama3-rope-untied": dict(family="llama", vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=1,
                               head_dim=16, intermediate_size=128, max_seq_len=512, tie_embeddings=False,
                               rope=dict(theta=500000.0, kind="llama3", factor=8.0, low_freq_factor=1.0,
                                         high_freq_factor=4.0, original_max_position_embeddings=32)),
    "qwen2": dict(family="qwen2", vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                  intermediate_size=128, max_seq_len=512, qkv_bias=True, rope=dict(theta=1e6)),
    "qwen3": dict(family="qwen3", vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                  intermediate_size=128, max_seq_len=512, qk_norm=True, rope=dict(theta=1e6)),
    "gemma3": dict(family="gemma3", vocab_size=256, dim=64, n_layers=3, n_heads=4, n_kv_heads=1, head_dim=32,
                   intermediate_size=128, max_seq_len=512, norm_eps=1e-6, rope=dict(theta=1e6),
                   local_rope=dict(theta=10000.0), windows=(16, 16, None), qk_norm=True, norm_offset=1.0,
                   sandwich_norm=True, activation="gelu_tanh", embed_scale=8.0, attn_scale=32**-0.5),
}


@pytest.fixture(scope="session")
def tiny_models():
    """name -> LoadedModel (fp32, CPU, seed 0) for every tiny config."""
    return {name: random_model(cfg, seed=0, device="cpu", name=name) for name, cfg in TINY.items()}


@pytest.fixture(params=list(TINY))
def tiny(request, tiny_models):
    return tiny_models[request.param]


@pytest.fixture(scope="session")
def tiny_llama(tiny_models):
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def tiny_gemma(tiny_models):
    return tiny_models["gemma3"]


def cache_for(model, batch: int = 1, capacity: int = 256, backend=DenseCache):
    return make_cache(model, batch, capacity, backend)


def random_ids(n: int, vocab: int = 256, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@pytest.fixture(scope="session")
def smollm2():
    from decodelab.models.loading import load

    return load("smollm2-135m", device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def gemma3_270m():
    from decodelab.models.loading import load

    return load("gemma3-270m", device="cpu", dtype="float32")


@pytest.fixture(autouse=True, scope="module")
def _fresh_compiles_per_module():
    """Forget torch.compile's compiled steps after each test module: every module compiles
    its own shapes of the same step function, and together they would pass dynamo's
    recompile limit (decoding/compiled.py's RECOMPILE_LIMIT, an error by design). Nothing
    to do where no test compiled (torch._dynamo never imported)."""
    yield
    import sys

    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()
