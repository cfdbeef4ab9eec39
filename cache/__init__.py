"""KV-cache backends: the `KVCache` contract and its implementations."""

from decodelab.cache.base import CacheLayout, KVCache, StaticView, attention_mask, reference_attention
from decodelab.cache.dense import DenseCache
from decodelab.cache.factory import CacheFactory, backend, backend_names
from decodelab.cache.int4 import QuantizedCache
from decodelab.cache.paged import PagedCache
from decodelab.cache.sliding import SlidingCache

__all__ = ["CacheLayout", "KVCache", "StaticView", "attention_mask", "reference_attention", "DenseCache",
           "PagedCache", "QuantizedCache", "SlidingCache", "CacheFactory", "backend", "backend_names"]
