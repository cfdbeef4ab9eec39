"""Speculative decoding: a drafter proposes gamma tokens, the target verifies them in
one forward over gamma + 1 positions through the same `cache.attend` path, a prefix is
accepted by rejection sampling (Leviathan et al. 2023, Chen et al. 2023), and both
caches roll back with `truncate`.

Greedy is the same math at temperature 0: p and q are one-hot, so a draft token is
accepted iff it is the target's argmax and the resample is the target's argmax.
"""

from __future__ import annotations

import time

import torch

from decodelab.decoding.generate import sync
from decodelab.decoding.sampling import SamplingParams, logits_to_probs
from decodelab.decoding.decoders import not_begun, runner_problems
from decodelab.models import native
from decodelab.models.errors import raise_if


def rejection_sample(
    p: torch.Tensor,  # [B, G + 1, V] target probs at each draft position and the bonus one
    q: torch.Tensor,  # [B, G, V] draft probs the draft tokens were drawn from
    draft: torch.Tensor,  # [B, G] proposed tokens
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accepted count n [B] (0..G) and the next token [B]: x_i is accepted with
    probability min(1, p_i(x)/q_i(x)); at the first rejection the token is resampled
    from normalize(max(0, p_i - q_i)); when all G are accepted, a bonus from p_G."""
    B, G = draft.shape
    px = p[:, :G].gather(-1, draft[..., None]).squeeze(-1)  # [B, G]
    qx = q.gather(-1, draft[..., None]).squeeze(-1)  # [B, G]
    u = torch.rand(B, G, generator=generator, device=p.device)
    accept = u * qx < px  # q <= p: always; q > p: with probability p / q
    n = accept.long().cumprod(-1).sum(-1)  # [B] length of the accepted prefix
    rows = torch.arange(B, device=p.device)
    at = n.clamp(max=G - 1)
    residual = (p[rows, at] - q[rows, at]).clamp_min(0)  # [B, V]
    dist = torch.where((n == G)[:, None], p[:, G], residual)
    mass = dist.sum(-1, keepdim=True)
    dist = torch.where(mass > 0, dist / mass.clamp_min(1e-30), p[rows, at])  # p == q: nothing to fix
    nxt = torch.multinomial(dist, 1, generator=generator).squeeze(-1)
    return n, nxt


def greedy_accept(
    best: torch.Tensor,  # [B, G + 1] the target's argmax at each draft position and the bonus one
    draft: torch.Tensor,  # [B, G] proposed tokens
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rejection_sample` at temperature 0, without building distributions: with one-hot
    p and q, x_i is accepted iff it is the target's argmax, and the next token is the
    argmax after the accepted prefix (the resample, or the bonus when all G are accepted)."""
    n = (draft == best[:, :-1]).long().cumprod(-1).sum(-1)  # [B]
    return n, best.gather(1, n[:, None]).squeeze(1)


def overlap(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """sum_x min(p(x), q(x)) per position: the acceptance probability alpha."""
    return torch.minimum(p, q).sum(-1)


def leviathan_speedup(alpha: float, gamma: float, c: float, verify_cost: float = 1.0) -> float:
    """Expected speedup (1 - a^(g+1)) / ((1 - a)(g c + v)); c = draft step / target step.

    Leviathan et al. assume v = 1: the target scores gamma + 1 tokens in the time of one
    decode step (true on a GPU for small gamma). `verify_cost` v = verify call / decode
    step, measured, gives the prediction for hardware where that is not so."""
    tokens = gamma + 1 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return tokens / (gamma * c + verify_cost)


def predicted_speedups(stats: list[dict], step_s: float) -> dict:
    """From the statistics of speculative runs and the time of one plain decode step
    (measured side by side): the cost ratios c_draft and c_verify in units of that step,
    and the speedups Leviathan's formula predicts with c_verify = 1 and with the measured
    c_verify."""
    calls = sum(s["target_calls"] for s in stats)
    steps = sum(s["target_calls"] * s["mean_gamma"] for s in stats)  # draft steps
    c = sum(s["time_draft_s"] for s in stats) / steps / step_s
    v = sum(s["time_verify_s"] for s in stats) / calls / step_s
    alpha = sum(s["alpha"] * s["target_calls"] for s in stats) / calls
    gamma = steps / calls
    return {"alpha": alpha, "c_draft": c, "c_verify": v, "predicted_leviathan": leviathan_speedup(alpha, gamma, c),
            "predicted_this_hw": leviathan_speedup(alpha, gamma, c, verify_cost=v)}


def speedup_over_greedy(spec_s: float, plain_s: float, plain_steps: int, stats: list[dict]) -> dict:
    """A speculative setup's measured speedup over plain greedy decoded side by side
    (`spec_s`, `plain_s`: their decode seconds over the same prompts, `plain_steps`: greedy's
    decode steps in `plain_s`), and the prediction from the setup's own statistics
    (`predicted_speedups`): c_draft, c_verify, both predictions and the efficiency
    (measured over predicted on this hardware)."""
    m = {"speedup_vs_greedy": plain_s / spec_s if spec_s else None}
    if m["speedup_vs_greedy"] and plain_steps and stats:
        pred = predicted_speedups(stats, plain_s / plain_steps)
        m |= {k: pred[k] for k in ("alpha", "c_draft", "c_verify", "predicted_leviathan", "predicted_this_hw")}
        m["efficiency"] = m["speedup_vs_greedy"] / pred["predicted_this_hw"]
    return m


class SpeculativeStats:
    """Acceptance per draft position, tokens per target call, alpha, and the time split.

    Two kinds of numbers, kept apart on purpose (`summary` returns both):
    - the drafter's quality, over every draft position the target verified, including
      positions whose tokens fall past the end of the output (the target did score them):
      `acceptance_per_position` (accepted / verified at draft position i),
      `acceptance_rate` (all accepted / all verified), `alpha` (mean overlap
      sum_x min(p, q) over the visited positions, see `record`), `mean_gamma` (drafts per
      call) and `predicted_speedup` (Leviathan's formula from alpha, mean_gamma and
      `draft_cost_ratio`: the expected speedup on an output long enough that no call is
      cut short);
    - the output, counting only what the loop emitted (a call's tokens past EOS, a stop
      string or max_new_tokens are dropped, so not counted): `emitted_tokens` (every
      row's output, its first token from the prefill included: the result's new_tokens)
      and `tokens_per_target_call` (the tokens the verify calls added to the output, per
      active row and call: at most gamma + 1, and at most what the output had left)."""

    def __init__(self, gamma_max: int, rows: int = 0):
        self.proposed = [0] * gamma_max  # times draft position i was verified
        self.accepted = [0] * gamma_max  # times it was accepted
        self.calls = self.rows = self.draft_steps = 0  # rows: active rows summed over calls
        self.first_tokens = rows  # one per row, chosen from the prefill (no target call)
        self.emitted = 0  # tokens of the verify calls that the output kept
        self.alpha_sum, self.alpha_n = 0.0, 0
        self.draft_s = self.verify_s = self.other_s = 0.0
        self.gammas: list[int] = []

    def record(self, n: torch.Tensor, active: torch.Tensor, gamma: int, alpha: torch.Tensor) -> None:
        """n [B] accepted, active [B] bool, alpha [B, G] overlaps.

        alpha is averaged over the draft positions whose prefix is the text decoding
        really produced: the accepted ones and the first rejected one (positions
        0..n). Leviathan's alpha is E[beta] over the prefixes the process visits;
        behind a rejection the draft was scored against a prefix that was thrown away,
        and for drafts whose errors come in runs (prompt lookup copying a passage) the
        overlaps there overstate it (experiments/README.md, "alpha over visited
        positions")."""
        visited = (torch.arange(gamma)[None] <= n[:, None].cpu())[active]  # [b, G]
        n, act = n[active].tolist(), int(active.sum())
        self.calls += 1
        self.rows += act
        for i in range(gamma):
            self.proposed[i] += act
            self.accepted[i] += sum(1 for x in n if x > i)
        self.alpha_sum += float(alpha[active].cpu()[visited].sum())
        self.alpha_n += int(visited.sum())
        self.gammas.append(gamma)

    def kept(self, counts: list[int]) -> None:
        """How many of the last call's tokens (accepted drafts + the next token) each row's
        output kept: all of them, or fewer where the row stopped."""
        self.emitted += sum(counts)

    def summary(self) -> dict:
        alpha = self.alpha_sum / max(1, self.alpha_n)
        gamma = sum(self.gammas) / max(1, len(self.gammas))
        c = (self.draft_s / max(1, self.draft_steps)) / (self.verify_s / self.calls) if self.verify_s else 0.0
        return {
            "acceptance_per_position": [a / p if p else None for a, p in zip(self.accepted, self.proposed)],
            "acceptance_rate": sum(self.accepted) / max(1, sum(self.proposed)),
            "tokens_per_target_call": self.emitted / max(1, self.rows),
            "emitted_tokens": self.first_tokens + self.emitted,
            "alpha": alpha, "mean_gamma": gamma, "target_calls": self.calls, "draft_cost_ratio": c,
            "predicted_speedup": leviathan_speedup(alpha, gamma, c) if self.calls else None,
            "time_draft_s": self.draft_s, "time_verify_s": self.verify_s, "time_overhead_s": self.other_s,
        }


class SpeculativeDecoder:
    """Draft with `drafter`, verify with the target, accept by rejection sampling.

    Adaptive gamma (`adaptive=True`): after each step, when every active row accepted
    all gamma tokens, gamma grows by 1; when the rows accepted under half of them on
    average, it shrinks by 1; always within [gamma_min, gamma_max]."""

    needs_drafter = True  # the `draft` config group builds it
    lossless_at_temperature_0 = True  # greedy verification keeps the target's argmax
    #: generate's compile=True compiles the drafter's one-token steps (a draft model's) and,
    #: where `verify_tokens` is fixed, the verify (`compiled_verify`, run by `ModelRunner.verify`)
    compiles_drafter = True

    def __init__(self, drafter, gamma: int | None = None, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, min_p: float = 0.0, seed: int = 0, adaptive: bool = False, gamma_min: int = 1,
                 gamma_max: int | None = None):
        self.drafter, self.seed, self.adaptive = drafter, seed, adaptive
        self.params = SamplingParams(temperature, top_k, top_p, min_p)
        if gamma is None:  # the drafter's own best measured lookahead (decoding/drafters.py), else 4
            gamma = getattr(drafter, "gamma", None) or 4
        self.gamma0, self.gamma_min = gamma, gamma_min
        self.gamma_max = gamma_max if gamma_max is not None else (2 * gamma if adaptive else gamma)
        raise_if(self._own_problems())
        self.lookahead = self.gamma_max + 1
        self.generator: torch.Generator | None = None
        self._stats = SpeculativeStats(max(1, self.gamma_max))

    def __repr__(self) -> str:
        return f"SpeculativeDecoder({self.drafter!r}, gamma={self.gamma0}, adaptive={self.adaptive}, {self.params})"

    def _own_problems(self) -> list[str]:
        p = self.params.problems()
        if not isinstance(self.gamma0, int) or self.gamma0 < 1:
            p.append(f"gamma must be an integer >= 1, got {self.gamma0}")
        elif self.adaptive and not (1 <= self.gamma_min <= self.gamma0 <= self.gamma_max):
            p.append(f"adaptive gamma needs 1 <= gamma_min ({self.gamma_min}) <= gamma ({self.gamma0}) "
                     f"<= gamma_max ({self.gamma_max})")
        return p

    def problems(self, model, cache) -> list[str]:
        """Everything that makes this setup unable to run, for `check_inputs`."""
        p = self._own_problems()
        if cache.rollback_limit < self.gamma_max:
            p.append(f"cache {type(cache).__name__} can roll back {cache.rollback_limit} tokens but gamma "
                     f"{self.gamma_max} needs {self.gamma_max}; lower gamma or raise the cache's rollback")
        return p + self.drafter.problems(model, cache.batch_size, self.gamma_max)

    @property
    def stats(self) -> dict:
        return self._stats.summary()

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target's hidden states the drafter reads (its `hidden_layers`; none for most):
        the prefill's and each verify's are handed to its `observe(hidden, start)`, the
        states of the tokens each row now holds ({layer: [h_b [n_b, dim]]}, row b's from
        position start[b])."""
        return tuple(getattr(self.drafter, "hidden_layers", ()))

    @property
    def rollback_needed(self) -> int:
        """Tokens a round may roll a row back: its drafts (the cache's `rollback_limit` must allow)."""
        return self.gamma_max

    @property
    def verify_tokens(self) -> int | None:
        """Tokens per row of every full verify (gamma + 1), where that number is fixed: not
        with adaptive gamma, nor with a drafter that reads the target's hidden states (its
        verify returns them, which a compiled step does not); None there. A compiled verify
        step is built for this many (`compiled_verify`)."""
        return None if self.adaptive or self.hidden_layers else self.gamma0 + 1

    @property
    def compile_s(self) -> float:
        """Seconds the last `begin` spent compiling the drafter's step (0 without one)."""
        return getattr(self.drafter, "compile_s", 0.0)

    def begin(self, device: torch.device, prompts: list[list[int]], capacity: int, compile: bool = False) -> None:
        """Fresh generator and statistics; the drafter starts from the prompts (`compile`:
        a draft model's one-token steps compiled first)."""
        self.generator = torch.Generator(device=device).manual_seed(self.seed)
        self.gamma = self.gamma0
        self._stats = SpeculativeStats(self.gamma_max, rows=len(prompts))
        if hasattr(self.drafter, "lookahead"):  # a draft with a cache of its own rolls back up to gamma_max
            self.drafter.lookahead = self.gamma_max
        self.drafter.begin(prompts, capacity, **({"compile": True} if compile else {}))

    def start(self, logits: torch.Tensor, hidden: dict | None = None) -> torch.Tensor:
        """The first tokens [B] from the prefill's last logits [B, V]; the prompts' hidden
        states ({layer: [h_b]}, from position 0) go to a drafter that reads them."""
        from decodelab.decoding.sampling import choose

        raise_if(not_begun(self, "start"))
        if hidden is not None and self.hidden_layers:
            self.drafter.observe(hidden, [0] * logits.shape[0])
        return choose(logits, self.params, self.generator)

    def admit(self, row: int, tokens: list[int]) -> None:
        """A serving engine starts a new sequence (`tokens` so far) in cache row `row`: the
        drafter starts that row over from them (a draft model prefills its own cache row)."""
        raise_if(not_begun(self, "admit"))
        self.drafter.admit(row, tokens)

    def release(self, row: int) -> None:
        """The request in cache row `row` left (finished or preempted): the drafter empties
        that row, so that it drafts from nothing there until the next `admit`."""
        self.drafter.release(row)

    # -- the drafter's KV (a draft model's own cache), which a serving engine charges ------
    def held_bytes(self, rows: list[int]) -> int:
        """K/V bytes the drafter's cache holds for these rows (0 for a drafter that declares none)."""
        return getattr(self.drafter, "held_bytes", lambda rows: 0)(rows)

    def row_bytes(self, tokens: int) -> int:
        """K/V bytes the drafter's cache takes for one row of `tokens` tokens."""
        return getattr(self.drafter, "row_bytes", lambda tokens: 0)(tokens)

    def budget_bytes(self, batch_size: int, capacity: int) -> int:
        """The most K/V bytes the drafter's cache holds beside a target cache of these sizes."""
        return getattr(self.drafter, "budget_bytes", lambda b, c: 0)(batch_size, capacity)

    @torch.no_grad()
    def step(self, runner, last: torch.Tensor, done: list[bool] | None = None,
             left: int | None = None) -> list[list[int]]:
        """One draft-and-verify round; rows in `done` are frozen (their caches do not grow).
        With `left` tokens at most still to emit, no more than `left - 1` are drafted (a round
        emits the accepted drafts and one more): drafting past the output is wasted work.
        The verify is `runner.verify` (the compiled verify where it fits; a serving engine's
        shares its step's forward with other rows' prefill chunks). A frozen row keeps
        whatever length it has after that forward."""
        raise_if(not_begun(self, "step") + runner_problems(runner))
        cache, dev = runner.cache, runner.model.device
        t0 = time.perf_counter()
        G, B = self.gamma if left is None else max(1, min(self.gamma, left - 1)), last.shape[0]
        active = ~torch.tensor(done if done is not None else [False] * B)
        draft, q = self.drafter.propose(last, G, self.params, self.generator)  # [B, G], [B, G, V]
        sync(dev)  # the split draft / verify / other times the work, not its launch
        t1 = time.perf_counter()
        L = cache.lengths.clone()
        ids = torch.cat([last[:, None], draft], dim=1)  # [B, G + 1]
        # a frozen row's tokens are padding: kept inside the row (a finished row may sit at its capacity)
        positions = torch.where(active[:, None], L[:, None] + torch.arange(G + 1),
                                L.clamp(max=cache.capacity - 1)[:, None]).to(dev)  # [B, G + 1]
        valid = active[:, None].expand(-1, G + 1).to(dev)  # frozen rows are padding: nothing stored
        layers = self.hidden_layers
        out = runner.verify(ids, positions, valid, layers)
        logits, hidden = out if layers else (out, None)  # [B, G + 1, V], {layer: [B, G + 1, dim]}
        sync(dev)
        t2 = time.perf_counter()
        if self.params.greedy:  # one-hot p and q: sum_x min(p, q) is 1 iff the draft is the argmax
            best = native.argmax(logits)  # [B, G + 1]
            n, nxt = greedy_accept(best, draft)
            alpha = (draft == best[:, :G]).float()
        else:
            p = logits_to_probs(logits, self.params)  # [B, G + 1, V]
            n, nxt = rejection_sample(p, q, draft, self.generator)
            alpha = overlap(p[:, :G], q)  # [B, G]
        n_cpu = torch.where(active, n.cpu(), torch.zeros_like(n.cpu()))
        # keep last + the accepted drafts; frozen rows keep exactly what they had
        cache.truncate(torch.where(active, L + 1 + n_cpu, cache.lengths))
        self.drafter.commit(n_cpu, nxt, active)
        if hidden is not None:  # the states of what each row kept: last and its accepted drafts
            keep = [int(n_cpu[b]) + 1 if bool(active[b]) else 0 for b in range(B)]
            self.drafter.observe({layer: [h[b, :keep[b]] for b in range(B)] for layer, h in hidden.items()},
                                 L.tolist())
        self._stats.record(n_cpu, active, G, alpha)
        out = [draft[b, : n_cpu[b]].tolist() + [int(nxt[b])] for b in range(B)]
        self._adapt(n_cpu, active, G)
        t3 = time.perf_counter()
        s = self._stats
        s.draft_s, s.verify_s, s.other_s = s.draft_s + t1 - t0, s.verify_s + t2 - t1, s.other_s + t3 - t2
        s.draft_steps += G
        return out

    def output_kept(self, kept: list[int]) -> None:
        """How many of the last step's tokens each row's output kept (the loop stops rows
        at EOS, a stop string or max_new_tokens): `tokens_per_target_call` counts these."""
        self._stats.kept(kept)

    def _adapt(self, n: torch.Tensor, active: torch.Tensor, drafted: int) -> None:
        if not self.adaptive or not bool(active.any()):
            return
        frac = (n[active].float() / drafted).mean().item()
        if frac == 1.0:
            self.gamma = min(self.gamma + 1, self.gamma_max)
        elif frac < 0.5:
            self.gamma = max(self.gamma - 1, self.gamma_min)
