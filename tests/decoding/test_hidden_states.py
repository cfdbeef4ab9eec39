"""The target's hidden states for drafters that read them (EAGLE, Medusa): the forward
returns the states of chosen layers, the prefill and every verify hand a drafter the
states of exactly the tokens each row holds, and a drafter written against that protocol
alone (no other module touched) speculates losslessly."""

from __future__ import annotations

import pytest
import torch

from decodelab.decoding import Request, SpeculativeDecoder, generate, greedy, serve
from decodelab.models.errors import SetupError
from tests.conftest import cache_for, random_ids


@pytest.mark.parametrize("name", ["llama", "gemma3"])
@torch.no_grad()
def test_the_forward_returns_the_states_of_chosen_layers(tiny_models, name):
    """Block outputs and the final norm's, at every position, zeros at padding; the logits
    are the plain forward's and the head over the final state gives them."""
    m = tiny_models[name].model
    L = m.cfg.n_layers
    ids = torch.tensor([random_ids(9, seed=1), random_ids(9, seed=2)])
    pos = torch.arange(9).expand(2, -1)
    valid = pos < torch.tensor([[9], [6]])  # row 1 padded: its valid tokens packed
    plain = m(ids, pos, cache_for(m, 2, 16), valid=valid)
    logits, hidden = m(ids, pos, cache_for(m, 2, 16), valid=valid, hidden_layers=(0, L))
    assert torch.equal(logits, plain) and sorted(hidden) == [0, L]
    assert hidden[0].shape == hidden[L].shape == (2, 9, m.cfg.dim)
    head = m.head(hidden[L])
    torch.testing.assert_close(head[valid], plain[valid], rtol=0, atol=1e-5)
    assert bool((hidden[0][1, 6:] == 0).all())
    one = m(ids[:1, :4], pos[:1, :4], cache_for(m, 1, 16), n_layers=1)  # block 0 alone, row 0's first 4
    torch.testing.assert_close(m.head(m.norm(hidden[0][:1, :4])), one, rtol=0, atol=1e-5)
    with pytest.raises(SetupError, match=r"hidden_layers \[%d\] are not layers" % (L + 1)):
        m(ids, pos, cache_for(m, 2, 16), hidden_layers=(L + 1,))


class FeatureDrafter:
    """A drafter that reads only the target's final hidden state: it proposes, gamma times,
    the token the target's head gives from the state of the last position it was shown
    (the token just emitted: right wherever the output repeats itself), and records every
    state it is handed by position."""

    def __init__(self, model):
        self.model, self.hidden_layers = model, (model.cfg.n_layers,)
        self.seen: list[dict[int, torch.Tensor]] = []

    def problems(self, target, batch_size: int, gamma: int) -> list[str]:
        return []

    def begin(self, prompts, capacity: int, compile: bool = False) -> None:
        self.seen = [{} for _ in prompts]

    def observe(self, hidden: dict, start: list[int]) -> None:
        for b, h in enumerate(hidden[self.model.cfg.n_layers]):
            for i in range(h.shape[0]):
                assert start[b] + i not in self.seen[b], f"row {b}: position {start[b] + i} handed over twice"
                self.seen[b][start[b] + i] = h[i].clone()

    def propose(self, last, gamma: int, params, generator):
        states = torch.stack([row[max(row)] for row in self.seen])  # [B, dim] the newest state of each row
        x = self.model.head(states).argmax(-1)  # [B]
        draft = x[:, None].expand(-1, gamma)  # [B, G]
        q = torch.nn.functional.one_hot(draft, self.model.cfg.vocab_size).float()  # [B, G, V]: greedy drafts
        return draft, q

    def commit(self, n, nxt, active) -> None:
        pass


@pytest.mark.parametrize("name", ["llama", "gemma3"])
@torch.no_grad()
def test_a_drafter_of_hidden_states_is_lossless_and_sees_each_kept_token_once(tiny_models, name):
    m = tiny_models[name].model
    prompts = [random_ids(7, m.cfg.vocab_size, seed=5), random_ids(12, m.cfg.vocab_size, seed=6)]
    want = generate(m, cache_for(m, 2, 64), greedy(), prompts, 24)
    drafter = FeatureDrafter(m)
    dec = SpeculativeDecoder(drafter, gamma=3)
    got = generate(m, cache_for(m, 2, 64), dec, prompts, 24)
    assert got.tokens == want.tokens
    assert dec.stats["tokens_per_target_call"] > 1.0  # its drafts were accepted
    L = m.cfg.n_layers
    for b, (p, out) in enumerate(zip(prompts, got.tokens)):
        seq = p + out[:-1]  # every token the target's cache came to hold (the last is never fed)
        _, ref = m(torch.tensor([seq]), torch.arange(len(seq))[None], cache_for(m, 1, 64), hidden_layers=(L,))
        seen = drafter.seen[b]
        assert sorted(seen) == list(range(len(seen))) and len(seen) >= len(seq)  # no gap, no position twice
        # the last round may keep accepted drafts past max_new_tokens (held by the cache, cut from the output)
        assert len(seen) <= len(seq) + dec.gamma_max
        for at in range(len(seq)):  # each state at its own position, as one teacher-forced pass gives it
            torch.testing.assert_close(seen[at], ref[L][0, at], rtol=0, atol=1e-4)


def test_the_engine_refuses_a_drafter_of_hidden_states(tiny_models):
    m = tiny_models["llama"].model
    with pytest.raises(SetupError, match="drafts from the target's hidden states"):
        serve(m, cache_for(m, 2, 64), SpeculativeDecoder(FeatureDrafter(m), gamma=3), [Request([1, 2, 3], 4)])
