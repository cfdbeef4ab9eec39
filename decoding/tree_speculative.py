"""Greedy speculative decoding over a tree of drafts (SpecInfer's token tree, Medusa's and
EAGLE's verification), through the caches' tree plans (cache/tree.py).

Each round the drafter proposes up to `width` continuations of `depth` tokens per row
(`propose_tree`: prompt lookup's latest matches of its n-grams, distinct ones first). They
are merged into a trie under the row's last token (candidates that share a prefix share
its nodes) and verified in ONE forward (`cache.plan(positions, parents=)`: each token sees
its ancestors and what the row held); every row's tree is padded to the largest row's
number of nodes (at most 1 + width x depth) with leaves under the root. The target's
argmax is walked from the root while a child holds it; that path is kept (`cache.keep_branch`: its K/V moved to
consecutive slots, the rest dropped) and the target's next token follows it. Every token
kept is the target's greedy choice after the ones before it, so the output is greedy
decoding's (lossless at temperature 0; sampling is refused).

A linear draft of the same depth is the tree of width 1; a wider tree verifies more
tokens per forward for a better chance that one of the candidates continues the text.
"""

from __future__ import annotations

import time

import torch

from decodelab.decoding.decoders import not_begun, runner_problems
from decodelab.decoding.generate import sync
from decodelab.decoding.speculative import SpeculativeDecoder
from decodelab.models.errors import SetupError, raise_if


def trie(root: int, candidates: list[list[int]], size: int | None = None) -> tuple[list[int], list[int]]:
    """Tokens and parents of the tree: node 0 the root token (parent -1), each candidate a
    chain under it sharing the nodes of an earlier candidate's equal prefix, then leaves
    under the root (repeating the root token) up to `size` nodes (a larger tree is
    refused; None: no padding)."""
    tokens, parents, child = [root], [-1], {}
    for chain in candidates:
        at = 0
        for t in chain:
            if (at, t) not in child:
                child[at, t] = len(tokens)
                tokens.append(t)
                parents.append(at)
            at = child[at, t]
    return (tokens, parents) if size is None else padded((tokens, parents), size)


def padded(tree: tuple[list[int], list[int]], size: int) -> tuple[list[int], list[int]]:
    """A tree (tokens, parents) with leaves under the root (repeating the root token) up to
    `size` nodes; a larger tree is refused."""
    tokens, parents = tree
    if len(tokens) > size:
        raise SetupError(f"a tree of {len(tokens)} nodes does not fit the verify's {size}")
    pad = size - len(tokens)
    return tokens + [tokens[0]] * pad, parents + [0] * pad


def depths(parents: list[int]) -> list[int]:
    """Each node's depth below the root (parents come before their children)."""
    d = []
    for p in parents:
        d.append(0 if p < 0 else d[p] + 1)
    return d


def greedy_path(tokens: list[int], parents: list[int], best: list[int]) -> list[int]:
    """The tree indices from the root along which every child is the target's argmax
    (`best[t]`: the argmax after node t), the first such child where several are."""
    path, node = [0], 0
    while True:
        nxt = next((t for t in range(node + 1, len(tokens)) if parents[t] == node and tokens[t] == best[node]), None)
        if nxt is None:
            return path
        path.append(nxt)
        node = nxt


class TreeSpeculativeDecoder(SpeculativeDecoder):
    """Greedy speculative decoding over a tree of `width` draft continuations of `depth`
    tokens (module docstring). `depth` None: the drafter's own gamma. The drafter needs
    `propose_tree(last, depth, width)` and `accept(tokens, active)` (prompt lookup)."""

    #: a tree's verify runs in a forward of its own (`ModelRunner.tree`): the serving engine
    #: runs a step's prefill chunks just before it; there is no static compiled step of a
    #: tree (their sizes vary): the engine's flat graphs (`compile_flat`) verify them
    verifies_tree = True

    def __init__(self, drafter, depth: int | None = None, width: int = 3, seed: int = 0):
        self.width = width
        super().__init__(drafter, gamma=depth, temperature=0.0, seed=seed)
        self.lookahead = self.nodes  # a verify writes every node past the output

    def __repr__(self) -> str:
        return f"TreeSpeculativeDecoder({self.drafter!r}, depth={self.gamma0}, width={self.width})"

    @property
    def nodes(self) -> int:
        """Tokens per row of a full verify: the root and width x depth drafts."""
        return 1 + self.width * self.gamma_max

    @property
    def rollback_needed(self) -> int:
        """A row that keeps only the root of its tree drops every other node."""
        return self.nodes - 1

    @property
    def verify_tokens(self) -> None:
        """No compiled verify: a tree plan's visibility is not a fixed-shape step's."""
        return None

    def _own_problems(self) -> list[str]:
        p = super()._own_problems()
        if not isinstance(self.width, int) or isinstance(self.width, bool) or self.width < 1:
            p.append(f"tree width must be an integer >= 1 (draft continuations per row), got {self.width!r}")
        return p

    def problems(self, model, cache) -> list[str]:
        p = self._own_problems()
        if not p and cache.rollback_limit < self.rollback_needed:
            p.append(f"cache {type(cache).__name__} can roll back {cache.rollback_limit} tokens but a tree of "
                     f"{self.nodes} nodes (1 + width {self.width} x depth {self.gamma_max}) needs "
                     f"{self.rollback_needed}; lower depth or width, or raise the cache's rollback")
        if cache.batch_size > 1 and not getattr(cache, "serves_row_subsets", False):
            p.append(f"the {type(cache).__name__} backend cannot run a forward over some of its rows, which the "
                     "tree decoder needs once a row of the batch has finished: decode one prompt at a time")
        if not (callable(getattr(self.drafter, "propose_tree", None)) and callable(getattr(self.drafter, "accept",
                                                                                          None))):
            p.append(f"drafter {self.drafter!r} proposes no tree (propose_tree / accept): the tree decoder drafts "
                     "with prompt lookup (draft=prompt-lookup)")
        return p + self.drafter.problems(model, cache.batch_size, self.gamma_max)

    @torch.no_grad()
    def step(self, runner, last: torch.Tensor, done: list[bool] | None = None,
             left: int | None = None) -> list[list[int]]:
        """One round: draft the trees, verify them in one forward (`runner.tree`), keep each
        row's greedy path (module docstring); rows in `done` are frozen (no part in the
        forward: their caches do not change)."""
        raise_if(not_begun(self, "step") + runner_problems(runner))
        cache, dev = runner.cache, runner.model.device
        t0 = time.perf_counter()
        D, B = self.gamma if left is None else max(1, min(self.gamma, left - 1)), last.shape[0]
        active = ~torch.tensor(done if done is not None else [False] * B)
        candidates = self.drafter.propose_tree(last, D, self.width)  # per row: up to width lists of D tokens
        rows = active.nonzero().squeeze(1).tolist()  # the frozen rows take no part in the forward
        if not rows:
            self.drafter.accept([[] for _ in range(B)], active)
            return [[int(t)] for t in last.tolist()]
        bare = {b: trie(int(last[b]), candidates[b]) for b in rows}
        T = max(len(tokens) for tokens, _ in bare.values())  # <= 1 + width x depth
        trees = {b: padded(tree, T) for b, tree in bare.items()}  # every row padded to the largest
        t1 = time.perf_counter()
        L = cache.lengths.clone()
        parents = torch.tensor([trees[b][1] for b in rows])  # [b, T]
        ids = torch.tensor([trees[b][0] for b in rows], device=dev)  # [b, T]
        positions = L[rows][:, None] + torch.tensor([depths(trees[b][1]) for b in rows])  # [b, T]: at their depths
        logits = runner.tree(ids, positions, parents, None if len(rows) == B else rows)  # [b, T, V]
        sync(dev)
        t2 = time.perf_counter()
        best = dict(zip(rows, logits.argmax(-1).tolist()))  # row -> [T]
        out, kept, n = [], [], torch.zeros(B, dtype=torch.long)
        for b in range(B):
            if b not in trees:  # frozen: nothing stored, nothing kept
                out.append([int(last[b])])
                kept.append([])
                continue
            tokens, par = trees[b]
            path = greedy_path(tokens, par, best[b])
            cache.keep_branch(b, int(L[b]), path, par)
            drafts = [tokens[t] for t in path[1:]]
            n[b] = len(drafts)
            kept.append(drafts)
            out.append(drafts + [best[b][path[-1]]])
        self.drafter.accept(kept, active)
        self._stats.record(n, active, D, (torch.arange(D)[None] < n[:, None]).float())
        t3 = time.perf_counter()
        s = self._stats
        s.draft_s, s.verify_s, s.other_s = s.draft_s + t1 - t0, s.verify_s + t2 - t1, s.other_s + t3 - t2
        return out
