"""A tree of draft tokens in one forward: who sees whom, and where each token is stored.

Speculative decoders that draft several continuations at once (Medusa, EAGLE, SpecInfer)
verify a tree of tokens in one forward. Token t of the forward has a parent among the
earlier tokens of the same forward (`parents[t] < t`), or -1: a root, whose parent is
the row's last cached token. Its position (RoPE) is its depth: a root sits at the row's
length L, a child one past its parent, so siblings share a position. The cache stores
token t at slot L + t (consecutive, like any forward), and a query sees:
- every key the row held before the forward (slots < L, which are their positions), by
  the usual rule at its own position (causal, inside the layer's window and sinks);
- of the forward's own tokens, exactly its ancestors and itself.
After verification the decoder keeps one branch (`KVCache.keep_branch`): its tokens move
to slots L, L + 1, ... (their positions) and the rest is dropped, so the row reads as if
the branch had been decoded token by token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decodelab.models.errors import SetupError


@dataclass(frozen=True)
class Tree:
    """The tree of a forward, per row of the forward."""

    positions: torch.Tensor  # [B, T] each token's position (its depth past the row's length)
    start: torch.Tensor  # [B] the row's length before the forward: token t is stored at slot start + t
    ancestors: torch.Tensor  # [B, T, T] bool: [b, t, u] = token u is token t or one of its ancestors


def parents_tensor(parents, B: int, T: int) -> torch.Tensor:
    """`parents` ([T] for every row, or [B, T]; a list or a tensor) as a [B, T] long tensor,
    refused unless each token's parent is an earlier token of the forward or -1 (a root)."""
    p = torch.as_tensor(parents, dtype=torch.long).cpu()
    if p.dim() == 1:
        p = p.expand(B, -1)
    if tuple(p.shape) != (B, T):
        raise SetupError(f"parents has shape {tuple(p.shape)}; a tree forward of {B} rows x {T} tokens needs "
                         f"[{T}] (one tree for every row) or [{B}, {T}]")
    t = torch.arange(T)
    if bool(((p < -1) | (p >= t)).any()):
        raise SetupError(f"parents {p.tolist()} must name, for each token t, an earlier token of the forward "
                         "(0 <= parent < t) or -1 for a root (a child of the row's last cached token)")
    return p


def build_tree(parents, start: torch.Tensor, positions: torch.Tensor | None = None) -> Tree:
    """The `Tree` of a forward whose rows held `start` [B] tokens, from `parents`
    (`parents_tensor`). Positions default to the depths (start + depth); given ones
    [B, T] are checked against them."""
    B, T = start.shape[0], (len(parents[0]) if _nested(parents) else len(parents))
    p = parents_tensor(parents, B, T)
    anc = torch.eye(T, dtype=torch.bool).expand(B, T, T).clone()  # [B, T, T]
    depth = torch.zeros(B, T, dtype=torch.long)
    for t in range(T):  # parents come first: their rows are complete
        par = p[:, t]
        has = par >= 0
        if bool(has.any()):
            b = has.nonzero().squeeze(1)
            anc[b, t] |= anc[b, par[b]]
            depth[b, t] = depth[b, par[b]] + 1
    want = start[:, None] + depth  # [B, T]
    if positions is not None and not torch.equal(positions.detach().cpu().long(), want):
        raise SetupError(f"a tree token's position is its row's length plus its depth: {want.tolist()} for these "
                         f"parents, got {positions.tolist()}")
    return Tree(want, start.clone(), anc)


def _nested(parents) -> bool:
    if isinstance(parents, torch.Tensor):
        return parents.dim() == 2
    return len(parents) > 0 and isinstance(parents[0], (list, tuple, torch.Tensor))


def tree_visible(tree: Tree, kpos: torch.Tensor, window: int | None, sinks: int = 0) -> torch.Tensor:
    """[B, T, S] bool: which keys at slots kpos [B, S] (-1: empty) each token of the tree
    forward sees. Held keys (slot < start): causal at the token's position, inside the
    window (or among the first `sinks`); the forward's own keys: its ancestors and itself,
    inside the window by their positions (or among the first `sinks`)."""
    q, k = tree.positions[:, :, None], kpos[:, None, :]  # [B, T, 1], [B, 1, S]
    start = tree.start[:, None, None]
    held = (k >= 0) & (k < start) & (k <= q)
    if window is not None:
        held &= (k > q - window) | (k < sinks)
    T = tree.positions.shape[1]
    own = (k >= start) & (k < start + T)  # [B, 1, S]
    idx = (k - start).clamp(0, T - 1)  # [B, 1, S] the tree index of each of the forward's own keys
    own = own & tree.ancestors.gather(2, idx.expand(-1, T, -1))
    if window is not None:  # by the keys' own positions (their depths), sinks kept
        kp = tree.positions.gather(1, idx[:, 0])[:, None, :]  # [B, 1, S]
        own &= (kp > q - window) | (kp < sinks)
    return held | own
