"""One compact decoder-only transformer for the Llama family and Gemma 3 text.

Attention reads and writes K/V only through the cache: `cache.prepare(positions, valid)`
once per forward, then `cache.attend(layer, q, k, v)` in every layer; the cache owns the
storage layout and the attention kernel that reads it.
Positions are always explicit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from decodelab.models.config import ModelConfig
from decodelab.models.errors import raise_if
from decodelab.models.matmul import PackedWeight, impl_problems, project, resolve_impl, version_of


class RMSNorm(nn.Module):
    """x / rms(x) * (offset + w), computed in float32 (Gemma: offset 1, Llama: 0)."""

    def __init__(self, dim: int, eps: float, offset: float):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(dim) - offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.bias, self.matmul, self.packed)


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


class Packed:
    """The valid tokens of a padded [B, T] batch as rows [N] of the flat [B * T] one: the
    position-wise work (norms, projections, MLP, head) runs on those N rows only, and
    attention, which the cache runs on padded [B, T] batches, sees them unpacked (zeros at
    padding). A batch whose rows are mostly padding (a serving engine's decode step with
    idle rows, chunks of different lengths) then costs what its tokens cost."""

    def __init__(self, valid: torch.Tensor):  # [B, T] bool
        self.B, self.T = valid.shape
        self.idx = valid.reshape(-1).nonzero().squeeze(1)  # [N]

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] -> [N, ...]"""
        return x.reshape(self.B * self.T, *x.shape[2:]).index_select(0, self.idx)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[N, ...] -> [B, T, ...], zeros at padding."""
        out = x.new_zeros(self.B * self.T, *x.shape[1:])
        return out.index_copy_(0, self.idx, x).view(self.B, self.T, *x.shape[1:])


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

    def forward(self, x: torch.Tensor, rope: tuple, cache, packed: Packed | None = None) -> torch.Tensor:
        """x [B, T, dim] (or its valid tokens [N, dim] with `packed`) -> the same shape."""
        qkv = self.wqkv(x)
        if packed is not None:
            qkv = packed.unpack(qkv)  # [B, T, q + 2 kv]
        B, T, _ = qkv.shape
        D = self.cfg.head_dim
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(B, T, -1, D).transpose(1, 2)  # [B, Hq, T, D]
        k = k.view(B, T, -1, D).transpose(1, 2)  # [B, Hkv, T, D]
        v = v.view(B, T, -1, D).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = cache.attend(self.layer, q, k, v).transpose(1, 2).reshape(B, T, self.q_size)  # [B, T, Hq * D]
        return self.wo(out if packed is None else packed.pack(out))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.w_gate_up = Proj(cfg.dim, 2 * cfg.intermediate_size)
        self.w_down = Proj(cfg.intermediate_size, cfg.dim)
        self.act = F.silu if cfg.activation == "silu" else _gelu_tanh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).split(self.inter, dim=-1)
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

    def forward(self, x, rope, cache, packed: Packed | None = None):
        h = self.attn(self.attn_norm(x), rope, cache, packed)
        if self.attn_post_norm is not None:
            h = self.attn_post_norm(h)
        x = x + h
        h = self.mlp(self.mlp_norm(x))
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
    ) -> torch.Tensor:
        """Logits [B, T, V] (or [B, K, V] with `logit_index`)."""
        if rows is None:
            cache.prepare(positions, valid)
        else:
            cache.prepare(positions, valid, rows=rows)
        # mostly padding: the position-wise work runs on the valid tokens only
        packed = Packed(valid) if valid is not None and 2 * int(valid.sum()) <= valid.numel() else None
        x = self.embed(ids if packed is None else packed.pack(ids))  # [B, T, dim] or [N, dim]
        if self.cfg.embed_scale != 1.0:
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        ropes = {r: rope_cos_sin(self.inv_freq(r, x.device), positions, x.dtype) for r in set(self._rope_keys)}
        for layer, block in enumerate(self.layers[:n_layers]):
            x = block(x, ropes[self._rope_keys[layer]], cache, packed)
        if logit_index is not None:
            x = x if packed is None else packed.unpack(x)
            x = x.gather(1, logit_index[..., None].expand(-1, -1, x.shape[-1]))
            return self.head(self.norm(x))
        logits = self.head(self.norm(x))
        return logits if packed is None else packed.unpack(logits)  # [B, T, V], zeros at padding

    def inv_freq(self, rope, device: torch.device) -> torch.Tensor:
        """float32 inverse frequencies [head_dim / 2] of one RoPE on one device (memoized)."""
        key = (rope, device)
        if key not in self._inv_freq:
            self._inv_freq[key] = rope.inv_freq(self.cfg.head_dim).to(device)
        return self._inv_freq[key]

    def set_matmul(self, impl: str) -> "Transformer":
        """Every projection (and the tied head) computes with `impl` (models.matmul.IMPLS)."""
        raise_if(impl_problems(impl, self.dtype, self.device))
        self.matmul = resolve_impl(impl, self.dtype, self.device)
        for m in self.modules():
            if isinstance(m, Proj):
                m.matmul = self.matmul
                m.packed.clear()
        self._head_packed.clear()
        return self

    def tied_head_t(self) -> torch.Tensor:
        """[D, V] contiguous copy of the tied embedding, for the CPU's faster layout
        (rebuilt whenever the embedding's storage, dtype or device changes)."""
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
