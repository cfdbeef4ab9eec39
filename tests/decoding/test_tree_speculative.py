"""Greedy speculative decoding over a tree of prompt-lookup drafts
(decoding/tree_speculative.py): every backend's output is greedy decoding's, token for
token; the trees are built, walked and refused as documented."""

from __future__ import annotations

import functools

import pytest
import torch

from decodelab.cache.dense import DenseCache
from decodelab.cache.int4 import QuantizedCache
from decodelab.cache.paged import PagedCache
from decodelab.cache.sliding import SlidingCache
from decodelab.decoding import generate, greedy
from decodelab.decoding.drafters import PromptLookupDrafter, early_exit
from decodelab.decoding.tree_speculative import TreeSpeculativeDecoder, depths, greedy_path, trie
from decodelab.models.errors import SetupError
from tests.conftest import cache_for, random_ids

BACKENDS = {"dense": DenseCache, "paged": functools.partial(PagedCache, block_size=4),
            "int4": functools.partial(QuantizedCache, residual=16, flush=8, group_size=32, key_axis="token",
                                      value_axis="token", rollback=16),
            "sliding": functools.partial(SlidingCache, rollback=16),
            "sliding-imposed": functools.partial(SlidingCache, window=12, sinks=2, rollback=16)}


def prompts(vocab: int) -> list[list[int]]:
    """Two prompts that repeat themselves (prompt lookup finds matches) of unequal lengths."""
    a, b = random_ids(9, vocab, seed=1), random_ids(6, vocab, seed=2)
    return [a + a + a[:4], b + b + b + b[:2]]


@pytest.mark.parametrize("name,backend", [("llama", b) for b in BACKENDS] + [("gemma3", "sliding")])
def test_tree_decoding_is_greedy_decoding(tiny_models, name, backend):
    m = tiny_models[name].model
    ps = prompts(m.cfg.vocab_size)
    want = generate(m, cache_for(m, 2, 96, BACKENDS[backend]), greedy(), ps, 24).tokens
    decoder = TreeSpeculativeDecoder(PromptLookupDrafter(), depth=3, width=3)
    got = generate(m, cache_for(m, 2, 96, BACKENDS[backend]), decoder, ps, 24)
    assert got.tokens == want
    s = decoder.stats
    assert s["target_calls"] < 2 * 23  # fewer forwards than one per token of the longer row...
    assert s["acceptance_rate"] > 0  # ...because drafts were accepted


def test_compile_true_leaves_the_trees_eager(tiny_models):
    """generate(compile=True) with the tree decoder: its trees have no static step and stay
    eager (the flat graphs measured slower at batch 1); nothing is compiled, the output is
    greedy's."""
    m = tiny_models["llama"].model
    ps = prompts(m.cfg.vocab_size)
    want = generate(m, cache_for(m, 2, 96), greedy(), ps, 24).tokens
    got = generate(m, cache_for(m, 2, 96), TreeSpeculativeDecoder(PromptLookupDrafter(), depth=3), ps, 24,
                   compile=True)
    assert got.tokens == want and got.compiled_steps == 0 and got.compile_s == 0.0


def test_the_linear_and_the_tree_decoder_agree_with_greedy_in_their_own_way(tiny_models):
    """Width 1 is a linear draft: the same tokens, and acceptance no higher than width 3's."""
    m = tiny_models["llama"].model
    ps = prompts(m.cfg.vocab_size)
    runs = {w: TreeSpeculativeDecoder(PromptLookupDrafter(), depth=3, width=w) for w in (1, 3)}
    out = {w: generate(m, cache_for(m, 2, 96), d, ps, 24).tokens for w, d in runs.items()}
    assert out[1] == out[3] == generate(m, cache_for(m, 2, 96), greedy(), ps, 24).tokens
    assert runs[3].stats["tokens_per_target_call"] >= runs[1].stats["tokens_per_target_call"]


def test_a_trie_shares_prefixes_and_pads_under_the_root():
    tokens, parents = trie(7, [[1, 2, 3], [1, 2, 4], [5, 6, 7]], 10)
    assert tokens == [7, 1, 2, 3, 4, 5, 6, 7, 7, 7]
    assert parents == [-1, 0, 1, 2, 2, 0, 5, 6, 0, 0]
    assert depths(parents) == [0, 1, 2, 3, 3, 1, 2, 3, 1, 1]
    with pytest.raises(SetupError, match="a tree of 4 nodes does not fit the verify's 3"):
        trie(7, [[1, 2, 3]], 3)
    assert trie(7, [[1, 2, 3], [1, 5, 6]]) == ([7, 1, 2, 3, 5, 6], [-1, 0, 1, 2, 1, 4])  # unpadded


def test_the_greedy_path_follows_the_argmax_through_the_first_matching_child():
    tokens, parents = trie(7, [[1, 2, 3], [1, 2, 4], [5, 6, 7]], 10)
    best = [1, 2, 4, 0, 9, 0, 0, 0, 0, 0]  # after 7: 1; after 7 1: 2; after 7 1 2: 4 (node 4), after it: 9
    assert greedy_path(tokens, parents, best) == [0, 1, 2, 4]
    assert greedy_path(tokens, parents, [8] + best[1:]) == [0]  # no child holds the argmax: nothing accepted


def test_prompt_lookup_proposes_distinct_candidates_latest_first():
    d = PromptLookupDrafter(max_ngram=2, min_ngram=1)
    d.begin([[1, 2, 3, 9, 1, 2, 4, 8, 1, 2, 3, 5]], 64)
    (cands,) = d.propose_tree(torch.tensor([1]), 2, 3)  # history ... 5, 1: the 1-gram [1] matched at 8, 4, 0
    assert cands == [[2, 3], [2, 4]]  # distinct only: [2, 3] twice is one candidate
    d.accept([[2]], torch.tensor([True]))
    assert d.history[0][-3:] == [5, 1, 2]
    assert d._lookup(d.history[0], 3) == [3, 5, 1]  # the linear draft: the first of the tree's candidates


def test_bad_tree_setups_are_refused(tiny_models):
    lm = tiny_models["llama"]
    m = lm.model
    ps = prompts(m.cfg.vocab_size)
    with pytest.raises(SetupError, match="tree width must be an integer >= 1"):
        TreeSpeculativeDecoder(PromptLookupDrafter(), depth=3, width=0)
    with pytest.raises(SetupError, match="proposes no tree .*draft=prompt-lookup"):
        generate(m, cache_for(m, 2, 96), TreeSpeculativeDecoder(early_exit(lm, 1), depth=3), ps, 4)
    small = functools.partial(SlidingCache, window=12, sinks=2, rollback=8)
    with pytest.raises(SetupError, match="a tree of 13 nodes .* needs 12"):
        generate(m, cache_for(m, 2, 96, small), TreeSpeculativeDecoder(PromptLookupDrafter(), depth=4), ps, 4)


@pytest.mark.parametrize("backend", ["dense", "paged"])
@pytest.mark.parametrize("tree", [False, True])
def test_a_finished_row_at_its_capacity_beside_a_running_one(tiny_models, backend, tree):
    """Row 0's drafts are always right (it finishes early, its output ending at the cache's
    last slots), row 1's always wrong (it runs on): the finished row, frozen, must not be
    fed past its capacity (a cache sized exactly prompt + max_new_tokens + lookahead, as
    generate_text sizes it); both decoders, output still greedy's."""
    from decodelab.decoding import SpeculativeDecoder

    m = tiny_models["llama"].model
    V = m.cfg.vocab_size
    ps = [random_ids(8, V, 1), random_ids(8, V, 2)]
    want = generate(m, cache_for(m, 2, 64), greedy(), ps, 20).tokens

    def oracle(h: list[int], b: int, n: int) -> list[int]:
        k = len(h) - len(ps[b])  # output tokens in the history
        nxt = (want[b][k:k + n] + [0] * n)[:n]
        return nxt if b == 0 else [(x + 1) % V for x in nxt]

    class Oracle(PromptLookupDrafter):
        def propose(self, last, gamma, params, generator):
            self._row = iter(range(len(self.history)))
            return super().propose(last, gamma, params, generator)

        def _lookup(self, h, gamma):
            return oracle(h, next(self._row), gamma)

        def propose_tree(self, last, depth, width):
            for h, t in zip(self.history, last.tolist()):
                h.append(t)
            return [[oracle(h, b, depth)] for b, h in enumerate(self.history)]

    dec = TreeSpeculativeDecoder(Oracle(), depth=3, width=1) if tree else SpeculativeDecoder(Oracle(), gamma=3)
    got = generate(m, cache_for(m, 2, 8 + 10 + dec.lookahead, BACKENDS[backend]), dec, ps, 10)
    assert got.tokens == [w[:10] for w in want]
