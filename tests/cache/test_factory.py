"""`decodelab.cache.backend(name, **options)`: a conf/cache option as the library's cache
factory, with the yaml's defaults (the command line's `cache=<name>`), and every backend
class a config names exported from `decodelab.cache`. The yaml files are enumerated."""

from __future__ import annotations

import inspect

import pytest
from hydra.utils import get_object
from omegaconf import OmegaConf

import decodelab.cache
from decodelab.cache import CacheLayout, backend, backend_names
from decodelab.decoding import generate, greedy, make_cache
from decodelab.models.errors import SetupError
from decodelab.models.loading import CONF_DIR
from tests.conftest import random_ids

YAMLS = sorted((CONF_DIR / "cache").glob("*.yaml"))


def options(path) -> dict:
    spec = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    return {k: v for k, v in spec.items() if not k.startswith("_")}


def test_the_backends_are_the_yaml_files():
    assert backend_names() == sorted(p.stem for p in YAMLS) and {"dense", "paged", "int4", "sliding"} <= set(backend_names())


@pytest.mark.parametrize("path", YAMLS, ids=[p.stem for p in YAMLS])
def test_each_backend_builds_its_yaml_class_with_the_yaml_options(path, tiny_llama):
    cls = get_object(OmegaConf.load(path)._target_)
    assert cls.__name__ in decodelab.cache.__all__ and getattr(decodelab.cache, cls.__name__) is cls
    factory = backend(path.stem)
    assert factory.keywords == options(path)  # the yaml's values, the same as cache=<name> on the command line
    built = factory(CacheLayout.of(tiny_llama.model), 2, 32)  # (layout, batch_size, capacity)
    assert type(built) is cls and built.batch_size == 2 and built.capacity >= 32
    sig = inspect.signature(cls).parameters  # every yaml option is one the class takes
    assert set(options(path)) <= set(sig)


def test_options_override_the_yaml_and_the_factory_serves_make_cache(tiny_llama):
    m = tiny_llama.model
    paged = make_cache(m, 2, 40, backend("paged", block_size=4, prefix_caching=False))
    assert paged.block_size == 4
    ids = [random_ids(7, seed=1), random_ids(12, seed=2)]
    dense = make_cache(m, 2, 40, backend("dense"))
    assert generate(m, paged, greedy(), ids, 8).tokens == generate(m, dense, greedy(), ids, 8).tokens


def test_an_unknown_backend_or_option_is_refused_with_the_ones_there_are():
    with pytest.raises(SetupError, match="no cache backend 'pagd'; the backends are dense, dense-bf16, dense-fp16, dense-fp8, int4, paged, paged-fp8, sliding"):
        backend("pagd")
    with pytest.raises(SetupError, match="takes no option 'block_sizee'; did you mean block_size"):
        backend("paged", block_sizee=4)


def test_the_harness_builds_caches_through_it():
    from decodelab.experiments.harness import cache_factory

    for name in backend_names():
        assert cache_factory(name).func is backend(name).func and cache_factory(name).keywords == backend(name).keywords
    assert cache_factory("paged", block_size=4).keywords == backend("paged", block_size=4).keywords
