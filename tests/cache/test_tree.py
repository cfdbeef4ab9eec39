"""A tree of draft tokens verified in one forward through each backend's plan, one branch
kept (`keep_branch`): the row then decodes exactly as if the branch had been decoded
token by token (issue 28's tree check)."""

from __future__ import annotations

import functools

import pytest
import torch

from decodelab.cache.dense import DenseCache
from decodelab.cache.int4 import QuantizedCache
from decodelab.cache.paged import PagedCache
from decodelab.cache.sliding import SlidingCache
from decodelab.cache.tree import build_tree, tree_visible
from decodelab.models.errors import SetupError
from tests.conftest import cache_for, random_ids

PROMPT, AFTER = 40, 16  # past Gemma's 16-token windows and int4's 8-token residual; 16 tokens decoded after the tree
# int4: blocks of 8 quantized behind 8 exact tokens (the tree's 7 fit), a rollback of 8 (the tree drops 3)
BACKENDS = {"dense": DenseCache, "paged": functools.partial(PagedCache, block_size=4),
            "int4": functools.partial(QuantizedCache, residual=8, flush=8, group_size=32, key_axis="token",
                                      value_axis="token", rollback=8),
            "sliding": SlidingCache,  # Gemma: rings of its own 16-token windows; Llama: full storage
            "sliding-imposed": functools.partial(SlidingCache, window=12, sinks=2, rollback=8)}
# token i's parent; the tree: 0 -> {1 (wrong), 2 (right)}, 1 -> 3, 2 -> {4 (wrong), 5 (right)}, 5 -> 6 (right)
PARENTS = [-1, 0, 0, 1, 2, 2, 5]
DEPTHS = [0, 1, 1, 2, 2, 2, 3]
RIGHT = {0: 0, 2: 1, 5: 2, 6: 3}  # tree index -> which greedy token it is (0: the last sampled one)


def cases():
    # a window is imposed only on a model without its own (Llama)
    return [(name, b) for name in ("llama", "gemma3") for b in BACKENDS
            if not (name == "gemma3" and b == "sliding-imposed")]


@torch.no_grad()
def greedy_steps(m, cache, first: int, start: int, n: int) -> tuple[list[int], list[torch.Tensor]]:
    """n one-token greedy steps from `first` at position `start`: the tokens after it and
    the logits [V] of each step (the logits that chose them)."""
    tokens, logits, last = [], [], first
    for p in range(start, start + n):
        out = m(torch.tensor([[last]]), torch.tensor([[p]]), cache)[0, -1]
        last = int(out.argmax())
        tokens.append(last)
        logits.append(out)
    return tokens, logits


@pytest.mark.parametrize("name,backend", cases())
@torch.no_grad()
def test_a_tree_verified_in_one_forward_keeps_its_branch(tiny_models, name, backend):
    m = tiny_models[name].model
    factory = BACKENDS[backend]
    prompt = random_ids(PROMPT, m.cfg.vocab_size, seed=3)
    ids, pos = torch.tensor([prompt]), torch.arange(PROMPT)[None]
    # the reference: the same backend decoding one token at a time
    ref = cache_for(m, 1, 96, factory)
    first = int(m(ids, pos, ref)[0, -1].argmax())
    want, want_logits = greedy_steps(m, ref, first, PROMPT, 4 + AFTER)
    # the tree: the greedy path 0 -> 2 -> 5 -> 6 among wrong siblings and a wrong branch
    greedy = [first] + want[:3]
    wrong = [(t + 1 + i) % m.cfg.vocab_size for i, t in enumerate(greedy)]
    tokens = [greedy[0], wrong[0], greedy[1], wrong[1], wrong[2], greedy[2], greedy[3]]
    c = cache_for(m, 1, 96, factory)
    m(ids, pos, c)
    tpos = torch.tensor([[PROMPT + d for d in DEPTHS]])
    logits = m(torch.tensor([tokens]), tpos, c, plan=c.plan(tpos, parents=PARENTS))[0]  # [7, V]
    assert c.lengths.tolist() == [PROMPT + 7]
    # greedy verification: walk from the root while a child holds the target's choice
    path, node = [0], 0
    while True:
        nxt = int(logits[node].argmax())
        child = [t for t in range(len(tokens)) if PARENTS[t] == node and tokens[t] == nxt]
        if not child:
            break
        node = child[0]
        path.append(node)
    assert path == [0, 2, 5, 6]
    tol = dict(rtol=0, atol=2e-4 if backend == "int4" else 1e-5)
    for t in path:  # each accepted node's logits are the one-token step's at its position
        torch.testing.assert_close(logits[t], want_logits[RIGHT[t]], **tol)
    c.keep_branch(0, PROMPT, path, PARENTS)
    assert c.lengths.tolist() == [PROMPT + 4]
    got, got_logits = greedy_steps(m, c, int(logits[6].argmax()), PROMPT + 4, AFTER)
    assert got == want[4:]
    for a, b in zip(got_logits, want_logits[4:]):
        torch.testing.assert_close(a, b, **tol)
    for layer in range(m.cfg.n_layers):  # the row holds what one-token decoding left, position for position
        p, k, _ = c.read(layer, 0)
        q, k_ref, _ = ref.read(layer, 0)
        n = min(len(p), len(q))
        assert p[-n:].tolist() == q[-n:].tolist()


def test_tree_visibility_by_hand():
    """A row holding 3 tokens, tree 0 -> {1, 2}, 1 -> 3: positions 3, 4, 4, 5 at slots 3..6;
    each token sees the held keys and its ancestors, never a sibling or a cousin."""
    tree = build_tree([-1, 0, 0, 1], torch.tensor([3]))
    assert tree.positions.tolist() == [[3, 4, 4, 5]]
    seen = tree_visible(tree, torch.arange(7)[None], None)[0].int().tolist()
    assert seen == [[1, 1, 1, 1, 0, 0, 0],
                    [1, 1, 1, 1, 1, 0, 0],
                    [1, 1, 1, 1, 0, 1, 0],
                    [1, 1, 1, 1, 1, 0, 1]]
    # a window of 2 at position 5 (token 3): held keys at positions > 3 only; its ancestors stay visible
    assert tree_visible(tree, torch.arange(7)[None], 2)[0, 3].int().tolist() == [0, 0, 0, 0, 1, 0, 1]


@pytest.mark.parametrize("parents,positions,msg", [
    ([-1, 1], [3, 4], "earlier token"),
    ([-1, 0, -2], [3, 4, 3], "earlier token"),
    ([-1, 0], [3, 5], "depth"),
    ([[-1, 0]], [3, 4], r"shape \(1, 2\)"),
])
def test_bad_trees_are_refused(parents, positions, msg):
    c = DenseCache(CacheLayoutFor(), 2, 16)
    c.plan(torch.arange(3).expand(2, -1))
    with pytest.raises(SetupError, match=msg):
        c.plan(torch.tensor([positions, positions]), parents=parents)
    assert c.lengths.tolist() == [3, 3]


def test_keep_branch_refuses_what_is_not_a_path():
    """Tree 0 -> {1, 2}: [0, 2] is a path; two siblings, a wrong order, an index past the
    tree, or a branch not starting at a root are not (each would leave the row corrupt)."""
    c = DenseCache(CacheLayoutFor(), 1, 16)
    c.plan(torch.arange(3)[None])
    parents = [-1, 0, 0]
    c.plan(torch.tensor([[3, 4, 4]]), parents=parents)
    for bad in ([1, 2], [0, 2, 1], [0, 3], [2]):
        with pytest.raises(SetupError, match="must be a path from a root"):
            c.keep_branch(0, 3, bad, parents)
    assert c.lengths.tolist() == [6]  # refused before anything moved
    c.keep_branch(0, 3, [0, 2], parents)
    assert c.lengths.tolist() == [5]


@torch.no_grad()
def test_a_tree_keeps_its_sink_tokens_past_the_window(tiny_models):
    """A 1-token prompt, then a chain of 6 tree tokens through a 4-token window with 2 sinks:
    the tree's own tokens at positions below the sinks stay visible to later ones, as they
    do in one-token decoding."""
    m = tiny_models["llama"].model
    factory = functools.partial(SlidingCache, window=4, sinks=2, rollback=8)
    ids = random_ids(7, m.cfg.vocab_size, seed=4)
    ref = cache_for(m, 1, 16, factory)
    want = torch.cat([m(torch.tensor([[t]]), torch.tensor([[p]]), ref)[0] for p, t in enumerate(ids)])  # [7, V]
    c = cache_for(m, 1, 16, factory)
    m(torch.tensor([ids[:1]]), torch.tensor([[0]]), c)
    pos = torch.arange(1, 7)[None]
    got = m(torch.tensor([ids[1:]]), pos, c, plan=c.plan(pos, parents=[-1, 0, 1, 2, 3, 4]))[0]  # [6, V]
    torch.testing.assert_close(got, want[1:], rtol=0, atol=1e-5)


def CacheLayoutFor():
    from decodelab.cache.base import CacheLayout

    return CacheLayout(1, 1, 4, torch.float32, torch.device("cpu"), (None,), 0.5)
