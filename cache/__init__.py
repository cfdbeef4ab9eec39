"""KV-cache backends: the `KVCache` contract and its implementations."""

from decodelab.cache.base import CacheLayout, KVCache, StaticView, attention_mask, reference_attention
from decodelab.cache.dense import DenseCache

__all__ = ["CacheLayout", "KVCache", "StaticView", "attention_mask", "reference_attention", "DenseCache"]
