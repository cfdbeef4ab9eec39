"""Cache backends by name: conf/cache/<name>.yaml (its `_target_` and options) as a factory.

A backend exists when it has an import path and a yaml in conf/cache (DESIGN: `_target_`
is the only registry), so the library and the command line build the same cache from the
same defaults: `backend("paged")` is `cache=paged`, `backend("paged", block_size=32)` is
`cache=paged cache.block_size=32`. A backend class itself is a factory too
(`DenseCache`, `functools.partial(PagedCache, block_size=32)`), with its own defaults.
"""

from __future__ import annotations

from typing import Callable

from decodelab.cache.base import KVCache
from decodelab.models.errors import raise_if

CacheFactory = Callable[..., KVCache]  # (layout, batch_size, capacity) -> cache


def backend_names() -> list[str]:
    """The cache backends: one per conf/cache/*.yaml, sorted (dense, int4, paged, sliding)."""
    from decodelab.models.loading import config_options

    return config_options("cache")


def backend(name: str, **options) -> CacheFactory:
    """The factory `(layout, batch_size, capacity) -> KVCache` of backend `name`
    (conf/cache/<name>.yaml: its class, with the yaml's option values as defaults and
    `options` over them), for `make_cache(model, batch_size, capacity, backend(...))` or
    the serving engine. An unknown name, or an option the backend does not take, is refused
    with a SetupError naming the ones there are."""
    from decodelab.models.loading import instantiate_option

    names = backend_names()
    raise_if([] if name in names else [f"no cache backend {name!r}; the backends are {', '.join(names)} "
                                       "(conf/cache/*.yaml)"])
    return instantiate_option("cache", name, **options)
