"""One compact decoder-only transformer for the Llama family and Gemma 3 text.

Attention reads and writes K/V only through the cache: `plan = cache.plan(positions,
valid)` once per forward (the forward's attention metadata, a value), then
`cache.attend(layer, q, k, v, plan)` in every layer; the cache owns the storage layout and
the attention kernel that reads it.
Positions are always explicit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from decodelab.models.config import ModelConfig
from decodelab.models.errors import SetupError, raise_if
from decodelab.models.matmul import PackedWeight, impl_problems, native_mv_ready, project, resolve_impl, version_of


class RMSNorm(nn.Module):
    """x / rms(x) * (offset + w), computed in float32 (Gemma: offset 1, Llama: 0)."""

    #: computed by decodelab's native operator (`decodelab::rms_norm`, one order of arithmetic
    #: eager and in a compiled graph) instead of torch's ops: `Transformer.share_kernels`
    native = False

    def __init__(self, dim: int, eps: float, offset: float):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(dim) - offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            return torch.ops.decodelab.rms_norm(x, self.weight, self.eps, float(self.offset))  # (native.rms_norm)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:  # Gemma scales in float32, then casts
            return (h * (self.offset + self.weight.float())).type_as(x)
        return self.weight * h.type_as(x)  # Llama casts, then scales


class Proj(nn.Module):
    """y = x @ W (+ b) with W stored [in, out]: on CPU, MKL's kernels read this layout at
    up to 2x the bandwidth of nn.Linear's [out, in] for the one-row products of decoding
    (see experiments/README.md). Multi-row products take `models.matmul`'s `matmul` impl."""

    def __init__(self, n_in: int, n_out: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))  # [in, out]
        self.bias = nn.Parameter(torch.zeros(n_out)) if bias else None
        self.matmul = "reference"  # resolved impl, set by Transformer.set_matmul
        self.packed = PackedWeight()

    takes_norm = True  # forward(x, norm) computes norm(x) first (`normed`)

    def forward(self, x: torch.Tensor, norm=None) -> torch.Tensor:
        """y = x @ W (+ b); with `norm`, of norm(x) (a quantized projection may fuse the two)."""
        return project(x if norm is None else norm(x), self.weight, self.bias, self.matmul, self.packed)


def normed(proj, x: torch.Tensor, norm) -> torch.Tensor:
    """proj(norm(x)) (None: proj(x)), the norm handed to a projection that takes it (`takes_norm`:
    `Proj`, `QuantProj`, which may compute both in one operator); others (quanto's modules) get
    norm(x)."""
    if norm is None:
        return proj(x)
    return proj(x, norm) if getattr(proj, "takes_norm", False) else proj(norm(x))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos, sin [B, 1, T, D] for positions [B, T]; angles computed in float32."""
    angles = positions[..., None].float() * inv_freq  # [B, T, D/2]
    emb = torch.cat((angles, angles), dim=-1)[:, None]  # [B, 1, T, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D] rotated by the angles of its positions."""
    return x * cos + rotate_half(x) * sin


@dataclass
class Segment:
    """One padded batch of a forward over several (`Transformer.forward_segments`): ids and
    positions [B, T] of the cache `rows` [B], `valid` [B, T] (None: all), and where to
    compute logits (`logit_index` [B, K]; None: every position)."""

    ids: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor | None = None
    rows: list[int] | None = None
    logit_index: torch.Tensor | None = None


class Packed:
    """The valid tokens of one or several padded [B, T] batches (segments) as rows [N] of
    one flat batch, segment after segment: the position-wise work (norms, projections,
    MLP, head) runs on those N rows only, once for all segments, and attention, which the
    cache runs on padded [B, T] batches, sees each segment unpacked (zeros at padding). A
    batch with padding (a serving engine's decode step with idle rows, chunks of different
    lengths) then costs what its tokens cost, and a decode step and a prefill chunk share
    one read of the weights."""

    def __init__(self, valid: torch.Tensor | list[torch.Tensor]):  # [B, T] bool, or one per segment
        valids = [valid] if isinstance(valid, torch.Tensor) else list(valid)
        self.shapes = [tuple(v.shape) for v in valids]
        self.idx = [v.reshape(-1).nonzero().squeeze(1) for v in valids]  # [N_s] per segment
        self.full = [int(i.numel()) == v.numel() for i, v in zip(self.idx, valids)]  # no padding at all
        counts = [int(i.numel()) for i in self.idx]
        self.bounds = [sum(counts[:s]) for s in range(len(counts) + 1)]  # segment s: rows [bounds[s], bounds[s + 1])

    def pack(self, x: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        """[B, T, ...] (or one per segment) -> [N, ...]"""
        xs = [x] if isinstance(x, torch.Tensor) else x
        parts = [self.pack_one(t, s) for s, t in enumerate(xs)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def pack_one(self, x: torch.Tensor, s: int) -> torch.Tensor:
        """Segment s's [B, T, ...] -> its valid rows [N_s, ...]"""
        B, T = self.shapes[s]
        flat = x.reshape(B * T, *x.shape[2:])
        return flat if self.full[s] else flat.index_select(0, self.idx[s])

    def unpack(self, x: torch.Tensor, s: int = 0) -> torch.Tensor:
        """Segment s's rows of [N, ...] -> [B, T, ...], zeros at padding."""
        return self.unpack_own(x[self.bounds[s]:self.bounds[s + 1]], s)

    def unpack_own(self, mine: torch.Tensor, s: int) -> torch.Tensor:
        """Segment s's own rows [N_s, ...] -> [B, T, ...], zeros at padding."""
        B, T = self.shapes[s]
        if self.full[s]:
            return mine.reshape(B, T, *mine.shape[1:])
        out = mine.new_zeros(B * T, *mine.shape[1:])
        return out.index_copy_(0, self.idx[s], mine).view(B, T, *mine.shape[1:])


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.cfg = layer, cfg
        self.q_size, self.kv_size = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.wqkv = Proj(cfg.dim, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.wo = Proj(self.q_size, cfg.dim)
        norm_offset = cfg.norm_offset
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, norm_offset) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, norm_offset) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, rope, cache, plan, packed: Packed | None = None, norm=None,
                fused: bool = False) -> torch.Tensor:
        """x [B, T, dim] (or its valid tokens [N, dim] with `packed`) -> the same shape. With
        several segments (`plan` and `rope`: a list, one per segment), each segment attends
        on its own, through its own plan. `norm`: x is the block's input and this RMSNorm of
        it what the projection reads (`Block._around`). `fused` (`Block.fuses`): the norm,
        the qkv product and RoPE in one operator where each row's angles line up with it (no
        packing), and the output before `wo` ([..., Hq * D]), which the block's next operator
        multiplies."""
        out = _same if fused else self.wo
        if packed is None:
            roped = self._qkv_roped(x, norm, rope) if fused else None
            if roped is not None:
                return self._attend(roped, None, cache, plan)
            return out(self._attend(normed(self.wqkv, x, norm), rope, cache, plan))
        qkv = normed(self.wqkv, x, norm)
        if not isinstance(plan, list):
            return out(packed.pack(self._attend(packed.unpack(qkv), rope, cache, plan)))
        outs = [packed.pack_one(self._attend(packed.unpack(qkv, s), rope[s], cache, p), s) for s, p in enumerate(plan)]
        return out(torch.cat(outs))

    def flat(self, x: torch.Tensor, rope: tuple, attend, norm=None, fused: bool = False) -> torch.Tensor:
        """x [N, dim] of a flat token batch (`Transformer.flat_hidden`) -> [N, dim]: the
        projections, q/k norms and RoPE (cos, sin [N, 1, D]) per token, the attention
        through `attend(layer, q [N, Hq, D], k, v [N, Hkv, D]) -> [N, Hq, D]`. `fused` as
        `forward`'s: the output before `wo`."""
        N, D = x.shape[0], self.cfg.head_dim
        roped = self._qkv_roped(x, norm, rope) if fused else None
        qkv = normed(self.wqkv, x, norm) if roped is None else roped
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k, v = q.view(N, -1, D), k.view(N, -1, D), v.view(N, -1, D)
        if roped is None:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        a = attend(self.layer, q, k, v).reshape(N, self.q_size)
        return a if fused else self.wo(a)

    def _qkv_roped(self, x: torch.Tensor, norm, rope: tuple) -> torch.Tensor | None:
        """qkv of norm(x) with RoPE applied to q and k, by one operator (`decodelab::int4_qkv_rope`:
        the same bits as the steps one by one), for x [..., dim] whose rows each have their own
        angles in rope's cos, sin (one [D] row per row of x); None where they do not (a rope
        broadcast over rows): the caller runs the steps."""
        cos, sin = rope
        D, rows = self.cfg.head_dim, x.numel() // x.shape[-1]
        if cos.numel() != rows * D or sin.numel() != rows * D:
            return None
        w = self.wqkv
        y = torch.ops.decodelab.int4_qkv_rope(  # (models/native.py: int4_qkv_rope)
            x.reshape(rows, -1), norm.weight, norm.eps, float(norm.offset), w.codes, w.scales, w.shifts,
            w.group_size, w.bias, cos.reshape(rows, D), sin.reshape(rows, D), self.q_size, self.kv_size, D)
        return y.view(*x.shape[:-1], -1)

    def _attend(self, qkv: torch.Tensor, rope: tuple | None, cache, plan) -> torch.Tensor:
        """qkv [B, T, q + 2 kv] -> attention output [B, T, Hq * D] (K/V stored by the cache);
        rope None: q and k already rotated (`_qkv_roped`)."""
        B, T, _ = qkv.shape
        D = self.cfg.head_dim
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(B, T, -1, D).transpose(1, 2)  # [B, Hq, T, D]
        k = k.view(B, T, -1, D).transpose(1, 2)  # [B, Hkv, T, D]
        v = v.view(B, T, -1, D).transpose(1, 2)
        if rope is not None:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return cache.attend(self.layer, q, k, v, plan).transpose(1, 2).reshape(B, T, self.q_size)  # [B, T, Hq * D]


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.w_gate_up = Proj(cfg.dim, 2 * cfg.intermediate_size)
        self.w_down = Proj(cfg.intermediate_size, cfg.dim)
        self.act = F.silu if cfg.activation == "silu" else _gelu_tanh

    def forward(self, x: torch.Tensor, norm=None) -> torch.Tensor:
        gate, up = normed(self.w_gate_up, x, norm).split(self.inter, dim=-1)
        return self.w_down(self.act(gate) * up)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        norm = lambda: RMSNorm(cfg.dim, cfg.norm_eps, cfg.norm_offset)  # noqa: E731
        self.attn, self.mlp = Attention(cfg, layer), MLP(cfg)
        self.attn_norm, self.mlp_norm = norm(), norm()
        self.attn_post_norm = norm() if cfg.sandwich_norm else None
        self.mlp_post_norm = norm() if cfg.sandwich_norm else None

    #: where `fuses` holds, run the block as two operators around its attention (False: the
    #: steps one by one, the same bits; tests and A/B runs compare the two)
    fuse = True

    def forward(self, x, rope, cache, plan, packed: Packed | None = None):
        return self._around(x, lambda h, norm=None, fused=False: self.attn(h, rope, cache, plan, packed, norm, fused))

    def flat(self, x: torch.Tensor, rope: tuple, attend) -> torch.Tensor:
        """x [N, dim] of a flat token batch, attending through `attend` (`Attention.flat`)."""
        return self._around(x, lambda h, norm=None, fused=False: self.attn.flat(h, rope, attend, norm, fused))

    def fuses(self, x: torch.Tensor) -> bool:
        """Whether this block runs as two operators around its attention for x [..., dim]: a
        shared-kernels model's (`Transformer.share_kernels`) Llama-style block (pre-norms only,
        no q/k norms, SiLU, no bias but qkv's) whose four projections are native int4 and take
        x's rows through the kernel (`QuantProj.max_kernel_rows`, any in a compiled graph), where
        no gradient is asked for:
        `decodelab::int4_qkv_rope` (the norm, the qkv product, RoPE) and
        `decodelab::int4_block_out` (wo, the residual, the norm, gate_up, SiLU x up, down, the
        residual), the same bits as the steps one by one with fewer operator calls and output
        buffers per block (what that buys: experiments/README.md, "Batch-1 decode at the memory
        roofline")."""
        a, m = self.attn, self.mlp
        projs = (a.wqkv, a.wo, m.w_gate_up, m.w_down)
        if not (self.fuse and self.attn_norm.native and self.mlp_norm.native and self.attn_post_norm is None
                and self.mlp_post_norm is None and a.q_norm is None and m.act is F.silu
                and all(getattr(p, "kernel", None) == "native-int4" for p in projs)
                and all(p.bias is None for p in projs[1:]) and a.cfg.head_dim % 2 == 0 and a.cfg.head_dim <= 512):
            return False
        if torch.is_grad_enabled() and x.requires_grad:  # the operators have no autograd: the steps keep it
            return False
        rows = x.numel() // x.shape[-1]
        return rows <= a.wqkv.max_kernel_rows or torch.compiler.is_compiling()

    def _around(self, x, attention):
        """The block around its attention: norms, residuals, the MLP. Each norm goes to the
        projection that reads it (`normed`: a shared-kernels model's int4 product computes both
        in one operator, `QuantProj.forward`); where `fuses` holds, two operators around the
        attention do all of it."""
        if self.fuses(x):
            a = attention(x, norm=self.attn_norm, fused=True)  # [..., Hq * D], before wo
            wo, gu, dn, n = self.attn.wo, self.mlp.w_gate_up, self.mlp.w_down, self.mlp_norm
            y = torch.ops.decodelab.int4_block_out(  # (models/native.py: int4_block_out)
                a.reshape(-1, a.shape[-1]), x.reshape(-1, x.shape[-1]), wo.codes, wo.scales, wo.shifts,
                wo.group_size, n.weight, n.eps, float(n.offset), gu.codes, gu.scales, gu.shifts, gu.group_size,
                dn.codes, dn.scales, dn.shifts, dn.group_size)
            return y.view(x.shape)
        h = attention(x, norm=self.attn_norm)
        if self.attn_post_norm is not None:
            h = self.attn_post_norm(h)
        x = x + h
        h = self.mlp(x, norm=self.mlp_norm)
        if self.mlp_post_norm is not None:
            h = self.mlp_post_norm(h)
        return x + h


class Transformer(nn.Module):
    """Decoder-only transformer; `forward(ids, positions, cache) -> logits`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.norm_offset)
        self.lm_head = None if cfg.tie_embeddings else Proj(cfg.dim, cfg.vocab_size)
        self._rope_keys = [cfg.rope_for(i) for i in range(cfg.n_layers)]
        # float32 inverse frequencies per (RoPE, device); not buffers, so that casting
        # the model to bf16 never rounds them
        self._inv_freq: dict = {}
        self._head_t: tuple | None = None  # (source key, [D, V] copy of a tied embedding)
        self.matmul = "reference"  # resolved `models.matmul` impl of every projection
        self._head_packed = PackedWeight()

    #: the norms, the RoPE angles and a dense cache's decode attention computed by the same
    #: kernels in eager code and in a compiled step (`share_kernels`)
    shared_kernels = False

    def share_kernels(self) -> "Transformer":
        """Compute what feeds the projections with kernels that give the same bits eager and
        compiled: every RMSNorm through `decodelab::rms_norm`, the RoPE angles' cos and
        sin through `decodelab::rope_cos_sin` (models/native.py), and a dense cache's decode-sized
        attention through the native kernel its compiled step runs (`CacheLayout.native_decode`,
        read by caches made after this). Elsewhere the compiled graph's fused norms and angles
        differ from eager's in the last bit, which an int4 product, quantizing its
        activations to int8, turns into different codes: int4 weights on the native kernel
        set this (`WeightOptions.apply`), so that their compiled text is their eager text.
        Needs the native kernels, float32 and a CPU (else refused). Not shared (the bits may
        still differ): a sliding cache's ring layers (SDPA eager, a masked product compiled),
        attention the native kernel does not serve (a logit softcap, a head size not a multiple
        of 8), and products of more than 32 rows (a batch x verify of that many tokens, a flat
        bucket of 64), which eager code dequantizes and a compiled step sends to the kernel."""
        from decodelab.models import native

        why = native.problem() or (None if self.dtype == torch.float32 and self.device.type == "cpu" else
                                   f"the model is {self.dtype} on {self.device}")
        if why:
            raise SetupError(f"cannot share the eager and compiled kernels of this model: {why} (they need "
                             "decodelab's native kernels, a float32 model and a CPU)")
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.native = True
        self.shared_kernels = True
        return self

    def _cos_sin(self, rope, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, T, D] of one RoPE at positions [B, T] (`rope_cos_sin`; with
        `shared_kernels` through the native operator, eager and compiled alike)."""
        inv = self.inv_freq(rope, x.device)
        if self.shared_kernels:
            return torch.ops.decodelab.rope_cos_sin(inv, positions)  # (models/native.py `rope_cos_sin`)
        return rope_cos_sin(inv, positions, x.dtype)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def forward(
        self,
        ids: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T]
        cache,
        valid: torch.Tensor | None = None,  # [B, T] bool: False marks padding (not cached)
        logit_index: torch.Tensor | None = None,  # [B, K]: compute logits only at these t
        n_layers: int | None = None,  # run only the first n layers (early-exit self-draft)
        rows: list[int] | None = None,  # [B] the cache rows these rows are (None: all, in order)
        plan=None,  # the forward's attention plan, when the caller made it (None: cache.plan(...) here)
        hidden_layers: tuple[int, ...] = (),  # also return these hidden states (`hidden_states`)
    ):
        """Logits [B, T, V] (or [B, K, V] with `logit_index`); with `hidden_layers`, the pair
        (logits, {layer: [B, T, dim]}): for i < n_layers the residual stream after block i,
        for i = n_layers the final norm's output (what the head reads), at every position
        of the forward (at padding: zeros where the valid tokens were packed, else what was
        computed there, never meaningful), for a drafter that reads the target's states."""
        raise_if(self.hidden_problems(hidden_layers))
        if plan is None:
            plan = cache.plan(positions, valid) if rows is None else cache.plan(positions, valid, rows=rows)
        # the position-wise work runs on the valid tokens only: on a CPU whenever there is
        # padding (compute-bound: a serving engine's decode step with idle rows among its
        # rows, prompts of different lengths), elsewhere when at least half is padding
        # (a GPU's products cost about the same for a few more rows; not measured there)
        n_valid = None if valid is None else int(valid.sum())
        pack = n_valid is not None and (n_valid < valid.numel() if valid.device.type == "cpu"
                                        else 2 * n_valid <= valid.numel())
        packed = Packed(valid) if pack else None
        x = self._embed(ids if packed is None else packed.pack(ids))  # [B, T, dim] or [N, dim]
        ropes = {r: self._cos_sin(r, positions, x) for r in set(self._rope_keys)}
        hidden = {}
        for layer, block in enumerate(self.layers[:n_layers]):
            x = block(x, ropes[self._rope_keys[layer]], cache, plan, packed)
            if layer in hidden_layers:
                hidden[layer] = x if packed is None else packed.unpack(x)
        if hidden_layers:
            if self.cfg.n_layers in hidden_layers:
                hidden[self.cfg.n_layers] = self.norm(x if packed is None else packed.unpack(x))
            return self._logits(x, packed, logit_index), hidden
        return self._logits(x, packed, logit_index)

    def _logits(self, x: torch.Tensor, packed: Packed | None, logit_index: torch.Tensor | None) -> torch.Tensor:
        """The head over the final hidden states x [B, T, dim] (or the valid tokens [N, dim]):
        at `logit_index` [B, K], else at every position (zeros at padding)."""
        if logit_index is not None:
            x = x if packed is None else packed.unpack(x)
            x = x.gather(1, logit_index[..., None].expand(-1, -1, x.shape[-1]))
            return self.head(self.norm(x))
        logits = self.head(self.norm(x))
        return logits if packed is None else packed.unpack(logits)  # [B, T, V], zeros at padding

    def forward_segments(self, segments: list[Segment], cache, n_layers: int | None = None) -> list[torch.Tensor]:
        """One forward over several padded batches of distinct cache rows (a serving
        engine's decode rows and the prefill chunks of other rows, each a `Segment` of its
        own shape): the position-wise work runs once on all their valid tokens, so the
        weights are read once, and each segment attends on its own (the cache plans every
        segment, and each attends through its own plan in every layer), so a one-token
        decode row never computes a chunk's queries. Logits per segment, as `forward` returns them
        for that segment alone ([B, K, V] with its `logit_index`, else [B, T, V], zeros at
        padding); equal to running the segments one by one up to float rounding (the
        products see a different number of rows)."""
        if len(segments) == 1:
            s = segments[0]
            return [self.forward(s.ids, s.positions, cache, s.valid, s.logit_index, n_layers, s.rows)]
        valids = [s.valid if s.valid is not None else torch.ones(s.ids.shape, dtype=torch.bool, device=s.ids.device)
                  for s in segments]
        plans = self.plan_segments(cache, segments)
        packed = Packed(valids)
        x = self._embed(packed.pack([s.ids for s in segments]))  # [N, dim]
        ropes = [{r: self._cos_sin(r, s.positions, x) for r in set(self._rope_keys)} for s in segments]
        for layer, block in enumerate(self.layers[:n_layers]):
            key = self._rope_keys[layer]
            x = block(x, [r[key] for r in ropes], cache, plans, packed)
        return self.segment_logits(x, packed, segments)

    def segment_logits(self, x: torch.Tensor, packed: Packed, segments: list[Segment],
                       normed: bool = False) -> list[torch.Tensor]:
        """Each segment's logits from the last hidden states x [N, dim] of its packed valid
        tokens (`normed`: the final norm already applied): the head once, on the rows every
        segment asks for (its `logit_index`, else all its tokens)."""
        picked, shapes = [], []
        for i, s in enumerate(segments):
            if s.logit_index is None:
                picked.append(x[packed.bounds[i]:packed.bounds[i + 1]])
                shapes.append(None)
            else:
                h = packed.unpack(x, i)  # [B, T, dim]
                h = h.gather(1, s.logit_index[..., None].expand(-1, -1, h.shape[-1]))  # [B, K, dim]
                picked.append(h.reshape(-1, h.shape[-1]))
                shapes.append(tuple(h.shape[:2]))
        rows = torch.cat(picked)
        logits = self.head(rows if normed else self.norm(rows))
        out, at = [], 0
        for i, shape in enumerate(shapes):
            n = picked[i].shape[0]
            part = logits[at:at + n]
            at += n
            out.append(packed.unpack_own(part, i) if shape is None else part.view(*shape, -1))
        return out

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        if self.cfg.embed_scale != 1.0:
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        return x

    def flat_hidden(self, ids: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """The final-normed hidden states [N, dim] of a flat token batch: ids, positions [N]
        (any rows' tokens in any order, padding included), every layer attending through
        `attend(layer, q, k, v)` (`Attention.flat`), which knows which token belongs to
        which row (decoding/runner.py). Everything else is per token, so one traced graph of
        N tokens serves decode rows, prefill chunks and verifies alike."""
        x = self._embed(ids)  # [N, dim]
        ropes = {}
        for r in set(self._rope_keys):
            cos, sin = self._cos_sin(r, positions[None], x)  # [1, 1, N, D]
            ropes[r] = (cos.view(-1, 1, cos.shape[-1]), sin.view(-1, 1, sin.shape[-1]))  # [N, 1, D]
        for layer, block in enumerate(self.layers):
            x = block.flat(x, ropes[self._rope_keys[layer]], attend)
        return self.norm(x)

    @staticmethod
    def plan_segments(cache, segments: list[Segment]) -> list:
        """`cache.plan` every segment (each on its own rows): one plan each. A segment the
        cache refuses (a paged pool out of blocks) rolls the earlier ones back (`truncate`),
        so the refused forward leaves the rows as they were."""
        rows = [list(s.rows) if s.rows is not None else None for s in segments]
        if any(r is None for r in rows):
            raise SetupError("every segment of a forward over several segments names its cache rows (Segment.rows)")
        flat = [r for rs in rows for r in rs]
        if len(set(flat)) != len(flat):
            raise SetupError(f"segments share cache rows ({rows}): each row can take part in one segment of a forward")
        before, plans = cache.lengths.clone(), []
        for s, r in zip(segments, rows):
            try:
                plans.append(cache.plan(s.positions, s.valid, rows=r))
            except SetupError:
                if plans:
                    cache.truncate(torch.minimum(cache.lengths, before))
                raise
        return plans

    def hidden_problems(self, hidden_layers) -> list[str]:
        """Why `hidden_layers` cannot be returned (each in [0, n_layers]: n_layers is the final norm)."""
        n = self.cfg.n_layers
        bad = [i for i in hidden_layers if not isinstance(i, int) or not 0 <= i <= n]
        return [f"hidden_layers {bad} are not layers of this model: each is 0..{n - 1} (a block's output) or "
                f"{n} (the final norm's output)"] if bad else []

    def inv_freq(self, rope, device: torch.device) -> torch.Tensor:
        """float32 inverse frequencies [head_dim / 2] of one RoPE on one device (memoized)."""
        key = (rope, device)
        if key not in self._inv_freq:
            self._inv_freq[key] = rope.inv_freq(self.cfg.head_dim).to(device)
        return self._inv_freq[key]

    def memoize_rope(self, device: torch.device) -> None:
        """Every layer's RoPE frequencies on `device` memoized now: a compiled step traced
        before the model's first forward would otherwise see the memo empty, guard on that,
        and compile again on its first step after any eager forward (a prefill) fills it."""
        for r in set(self._rope_keys):
            self.inv_freq(r, device)

    def set_matmul(self, impl: str) -> "Transformer":
        """Every projection (and the tied head) computes with `impl` (models.matmul.IMPLS)."""
        raise_if(impl_problems(impl, self.dtype, self.device))
        self.matmul = resolve_impl(impl, self.dtype, self.device)
        if self.matmul == "onednn":
            native_mv_ready()  # one-row products on the native kernel: built now, not in a first decode step
        for m in self.modules():
            if isinstance(m, Proj):
                m.matmul = self.matmul
                m.packed.clear()
        self._head_packed.clear()
        return self

    def pack_weights(self) -> "Transformer":
        """Build oneDNN's packed copy of every projection (and of a tied head) now, where the
        matmul is `onednn`, so that the first multi-row product (the first prompt's prefill)
        does not pay for it in its TTFT (the copies are the ones `PackedWeight.get` keeps)."""
        if self.matmul != "onednn":
            return self
        with torch.no_grad():
            for m in self.modules():
                if type(m) is Proj and m.matmul == "onednn" and m.weight.dtype == torch.float32:
                    m.packed.get(m.weight)
            if self.lm_head is None and self.device.type == "cpu":
                self._head_packed.get(self.embed.weight, out_in=True)
        return self

    def weight_read_bytes(self, batch: int = 1) -> int:
        """Weight bytes one decode step of `batch` rows must read, as stored: every parameter,
        a quantized projection's codes and scales as its one-row kernel reads them
        (`QuantProj.step_bytes`), and of the embedding `batch` rows, or all of it where the
        head is the tied fp embedding (a quantized head reads its own codes). The
        numerator of a batch-1 roofline: bytes per token over the memory bandwidth."""
        total = 0
        for m in self.modules():
            step = getattr(m, "step_bytes", None)
            if step is not None:
                total += step()
            elif m is self.embed:
                e = m.weight
                rows = e.shape[0] if self.lm_head is None else min(batch, e.shape[0])
                total += rows * e.shape[1] * e.element_size()
            else:
                total += sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
        return total

    def tied_head_t(self) -> torch.Tensor:
        """[D, V] contiguous copy of the tied embedding, for the CPU's faster layout
        (rebuilt whenever the embedding's storage, dtype or device changes). Traced by
        torch.compile, the copy made before compiling (a compiled step makes it first)."""
        if torch.compiler.is_compiling() and self._head_t is not None:
            return self._head_t[1]
        w = self.embed.weight
        key = (w.data_ptr(), w.dtype, w.device, version_of(w))
        if self._head_t is None or self._head_t[0] != key:
            self._head_t = (key, w.detach().t().contiguous())
        return self._head_t[1]

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final projection to vocabulary logits (tied or separate), with softcapping."""
        if self.lm_head is not None:
            logits = self.lm_head(x)
        elif x.device.type == "cpu":
            logits = project(x, self.tied_head_t(), None, self.matmul, self._head_packed, self.embed.weight)
        else:
            logits = F.linear(x, self.embed.weight)
        if self.cfg.final_softcap:
            logits = torch.tanh(logits / self.cfg.final_softcap) * self.cfg.final_softcap
        return logits
