"""THE prefill path: every setup (every cache, every decoder, target and draft) uses it."""

from __future__ import annotations

import operator

import torch

from decodelab.models.errors import SetupError, raise_if
from decodelab.models.transformer import Segment


def token_id_problems(prompts, vocab_size: int) -> list[str]:
    """Every reason `prompts` [B][n_b] are not token ids of a `vocab_size`-token model.

    A row is a non-empty list of Python ints (or a 1-D integer tensor or array) in
    [0, vocab_size). A float id (3.7, and 3.0 too), a float tensor or a bool is refused
    here, where ids enter the library: converting it would truncate 3.7 to 3 or read
    True as 1, and generate from a prompt nobody wrote."""
    p = []
    for b, ids in enumerate(prompts):
        try:
            row = torch.as_tensor(ids)
        except (TypeError, ValueError, RuntimeError) as e:
            p.append(f"prompt {b} cannot be read as token ids ({e}): give a list of ints")
            continue
        if row.dim() != 1:
            p.append(f"prompt {b} is a {row.dim()}-d {type(ids).__name__}, not one sequence of token ids: "
                     "give a list of ints per prompt")
        elif row.numel() == 0:
            p.append(f"prompt {b} is empty: give at least one token")
        elif not _integer_ids(ids, row):
            p.append(f"prompt {b} has token ids that are not integers ({_describe(ids, row)}); token ids are "
                     "refused, not truncated: pass ints (e.g. [int(t) for t in ids] after checking they are "
                     "whole, or tensor.long().tolist())")
        else:
            bad = row[(row < 0) | (row >= vocab_size)]
            if bad.numel():
                p.append(f"prompt {b} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5].tolist()}")
    return p


def _integer_ids(ids, row: torch.Tensor) -> bool:
    """An integer dtype, and no Python bool among a list's ints (as_tensor reads [1, True] as int64)."""
    if row.dtype == torch.bool or row.dtype.is_floating_point or row.dtype.is_complex:
        return False
    return not (isinstance(ids, (list, tuple)) and any(isinstance(t, bool) for t in ids))


def _describe(ids, row: torch.Tensor) -> str:
    """What the non-integer ids are: a tensor's dtype, or a list's offending elements."""
    if not isinstance(ids, (list, tuple)):
        return f"a {type(ids).__name__} of dtype {row.dtype}, e.g. {row[:3].tolist()}"
    wrong = [t for t in ids if isinstance(t, bool) or not _is_index(t)]
    kinds = sorted({type(t).__name__ for t in wrong})
    return f"{len(wrong)} of type {', '.join(kinds)}, e.g. {wrong[:3]}"


def _is_index(t) -> bool:
    try:
        operator.index(t)  # int, numpy and 0-d integer tensor ids; not floats
    except TypeError:
        return False
    return True


def pad_prompts(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T] and their lengths [B] (on `device`)."""
    lengths = torch.tensor([len(p) for p in prompts])
    ids = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.as_tensor(p, dtype=torch.long)
    return ids.to(device), lengths


@torch.no_grad()
def prefill(model, cache, prompts: list[list[int]], chunk_size: int | None = None,
            rows: list[int] | None = None, hidden_layers: tuple[int, ...] = ()):
    """Run the prompts [B][n_b] through the model after what each row already holds
    (`cache.lengths`); return the logits [B, V] of each row's last prompt position. With
    `rows` [B], the prompts go to those cache rows only (the others are not touched: a
    serving engine prefills an admitted request's row, or its next chunk).

    Rows are right-padded; padding is marked invalid, sits at later positions than any
    real token of its row, and is overwritten by the first decode step, so it never
    changes a result. With `chunk_size`, the prompt runs in chunks of that many
    positions (same logits as one pass, smaller peak memory). A backend with a prefix
    cache maps already-cached prompt blocks first; only the rest is computed.

    With `hidden_layers` (`Transformer.forward`'s), the pair (logits, {layer: [h_b]}): each
    row's hidden states [n_b, dim] at its prompt positions, for a drafter that reads the
    target's states; every prompt position is then computed (no cached prefix is mapped)."""
    raise_if(token_id_problems(prompts, model.cfg.vocab_size))  # before the cache is touched
    held = cache.lengths if rows is None else cache.lengths[list(rows)]
    fresh = bool((held == 0).all()) and not hidden_layers  # from position 0: a prefix cache applies
    reused = cache.reuse_prefix(prompts, rows) if fresh else [0] * len(prompts)
    logits = _run(model, cache, [p[r:] for p, r in zip(prompts, reused)], chunk_size, rows, hidden_layers)
    if fresh:
        cache.remember_prefix(prompts, rows)
    return logits


def _padded(model, cache, prompts: list[list[int]], rows=None):
    """Right-padded ids [B, T] on the device, lengths n [B], positions and valid [B, T]
    after what each row holds: padding sits after its row's tokens, never at a valid
    position (a backend may write padding slots), within the capacity (a padded row needs
    one free slot after its tokens)."""
    ids, n = pad_prompts(prompts, model.device)
    B, T = ids.shape
    offsets = torch.arange(T)
    held = cache.lengths if rows is None else cache.lengths[list(rows)]
    valid = offsets[None, :] < n[:, None]  # [B, T]
    full = (held + n >= cache.capacity) & (n < T)  # [B]
    if bool(full.any()):
        raise SetupError(f"rows {torch.nonzero(full).flatten().tolist()} would fill the cache to its capacity "
                         f"({cache.capacity}) in a padded forward, leaving no slot for their padding; prefill them "
                         "alone or build the cache one token larger")
    positions = torch.where(valid, held[:, None] + offsets, (held[:, None] + offsets).clamp(max=cache.capacity - 1))
    return ids, n, positions.to(model.device), valid.to(model.device)


def prompt_segment(model, cache, prompts: list[list[int]], rows: list[int]) -> Segment:
    """The prompts' tokens for the cache `rows`, after what each holds, as one segment of a
    forward over several (`Transformer.forward_segments`: a serving engine runs prefill
    chunks and decode rows in one read of the weights), padded and placed as `prefill`
    places them; its logits are each row's last prompt position [B, 1, V]."""
    raise_if(token_id_problems(prompts, model.cfg.vocab_size))
    ids, n, positions, valid = _padded(model, cache, prompts, rows)
    return Segment(ids, positions, None if bool(valid.all()) else valid, list(rows), (n - 1)[:, None].to(model.device))


def _run(model, cache, prompts: list[list[int]], chunk_size: int | None, rows=None, hidden_layers=()):
    ids, n, positions, valid = _padded(model, cache, prompts, rows)
    T = ids.shape[1]
    step = chunk_size or T
    last, states = None, {layer: [] for layer in hidden_layers}
    kw = {} if rows is None else {"rows": list(rows)}
    if hidden_layers:
        kw["hidden_layers"] = tuple(hidden_layers)
    for s in range(0, T, step):
        e = min(s + step, T)
        inside = (n - 1 >= s) & (n - 1 < e)  # [B] rows whose last token is in this chunk
        at = (n - 1 - s).clamp(0, e - s - 1)[:, None].to(model.device)  # [B, 1]
        chunk_valid = None if bool(valid[:, s:e].all()) else valid[:, s:e]
        out = model(ids[:, s:e], positions[:, s:e], cache, valid=chunk_valid, logit_index=at, **kw)
        logits, hidden = out if hidden_layers else (out, {})
        for layer, h in hidden.items():  # [B, e - s, dim]
            states[layer].append(h)
        logits = logits[:, 0]
        last = logits if last is None else torch.where(inside[:, None].to(model.device), logits, last)
    if not hidden_layers:
        return last
    whole = {layer: torch.cat(parts, 1) for layer, parts in states.items()}  # [B, T, dim]
    return last, {layer: [h[b, :int(n[b])] for b in range(len(prompts))] for layer, h in whole.items()}
