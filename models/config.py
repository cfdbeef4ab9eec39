"""`ModelConfig`: every shape and switch the native transformer needs, and the mapping
to and from transformers' configs (Llama family and Gemma 3 text)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from decodelab.models.errors import SetupError, raise_if

ACTIVATIONS = ("silu", "gelu_tanh")
ROPE_TYPES = ("default", "linear", "llama3")
# transformers model_type -> our family; the family picks the reference class in tests
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")


@dataclass(frozen=True)
class RopeConfig:
    """RoPE frequencies: base theta plus an optional scaling rule (transformers' names)."""

    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def inv_freq(self, head_dim: int):
        """Inverse frequencies [head_dim // 2] (float32), scaled as `kind` says."""
        import torch

        inv = 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if self.kind == "linear":
            return inv / self.factor
        if self.kind == "llama3":
            return _llama3_scale(inv, self)
        return inv


def _llama3_scale(inv, rope: RopeConfig):
    """Llama 3.1 frequency rescaling: long wavelengths / factor, short kept, smooth between."""
    import torch

    low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and architecture switches of one decoder-only transformer."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    family: str = "llama"
    norm_eps: float = 1e-5
    rope: RopeConfig = field(default_factory=RopeConfig)
    local_rope: RopeConfig | None = None  # RoPE of windowed layers (Gemma 3: base 10k)
    windows: tuple[int | None, ...] = ()  # per layer: sliding window or None (full)
    max_seq_len: int = 2048
    tie_embeddings: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    norm_offset: float = 0.0  # Gemma stores norm weights as w - 1: scale by (offset + w)
    sandwich_norm: bool = False  # Gemma 3: extra norms after attention and after the MLP
    activation: str = "silu"
    embed_scale: float = 1.0  # Gemma: sqrt(dim)
    attn_scale: float | None = None  # softmax scale; None -> head_dim ** -0.5
    attn_softcap: float | None = None
    final_softcap: float | None = None
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    pad_id: int | None = None

    def __post_init__(self):
        if not self.windows:
            object.__setattr__(self, "windows", (None,) * self.n_layers)
        object.__setattr__(self, "windows", tuple(self.windows))
        object.__setattr__(self, "eos_ids", tuple(self.eos_ids))
        raise_if(self.problems())

    def problems(self) -> list[str]:
        """Every inconsistency in this config (empty when it is usable)."""
        p = []
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                     "intermediate_size", "max_seq_len"):
            if getattr(self, name) < 1:
                p.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_kv_heads >= 1 and self.n_heads % self.n_kv_heads:
            p.append(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if len(self.windows) != self.n_layers:
            p.append(f"windows has {len(self.windows)} entries for {self.n_layers} layers")
        if any(w is not None and w < 1 for w in self.windows):
            p.append(f"every window must be None or >= 1, got {self.windows}")
        if self.activation not in ACTIVATIONS:
            p.append(f"activation {self.activation!r} unknown; use one of {ACTIVATIONS}")
        if self.family not in FAMILIES:
            p.append(f"family {self.family!r} unknown; use one of {FAMILIES}")
        for r in (self.rope, self.local_rope):
            if r is not None and r.kind not in ROPE_TYPES:
                p.append(f"rope type {r.kind!r} unsupported; use one of {ROPE_TYPES}")
        return p

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    def rope_for(self, layer: int) -> RopeConfig:
        """The RoPE of one layer: windowed layers use `local_rope` when the model has one."""
        if self.windows[layer] is not None and self.local_rope is not None:
            return self.local_rope
        return self.rope

    def with_(self, **changes) -> "ModelConfig":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        d["rope"] = RopeConfig(**d["rope"])
        if d.get("local_rope") is not None:
            d["local_rope"] = RopeConfig(**d["local_rope"])
        return cls(**d)


def _rope_from_hf(params: dict | None, default_theta: float = 10000.0) -> RopeConfig:
    params = dict(params or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise SetupError(f"rope_type {kind!r} is not supported; supported: {ROPE_TYPES}")
    return RopeConfig(
        theta=float(params.get("rope_theta", default_theta)),
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _eos_tuple(eos) -> tuple[int, ...]:
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def from_hf_config(hf) -> ModelConfig:
    """Our config from a transformers config (Llama, Mistral, Qwen2, Qwen3, Gemma 3 text)."""
    kind = getattr(hf, "model_type", None)
    if kind == "gemma3":  # the multimodal wrapper: take its text part
        hf, kind = hf.text_config, "gemma3_text"
    if kind not in (*LLAMA_LIKE, "gemma3_text"):
        raise SetupError(f"model_type {kind!r} is not supported; supported: {(*LLAMA_LIKE, 'gemma3_text')}")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    common = dict(
        vocab_size=hf.vocab_size, dim=hf.hidden_size, n_layers=hf.num_hidden_layers,
        n_heads=hf.num_attention_heads, n_kv_heads=hf.num_key_value_heads or hf.num_attention_heads,
        head_dim=head_dim, intermediate_size=hf.intermediate_size, norm_eps=hf.rms_norm_eps,
        max_seq_len=hf.max_position_embeddings, tie_embeddings=bool(hf.tie_word_embeddings),
        bos_id=hf.bos_token_id, eos_ids=_eos_tuple(hf.eos_token_id), pad_id=hf.pad_token_id,
    )
    if kind == "gemma3_text":
        return _gemma3_from_hf(hf, common)
    windows = _hf_windows(hf)
    rp = hf.rope_parameters
    return ModelConfig(
        family=kind, rope=_rope_from_hf(rp), windows=windows,
        qkv_bias=bool(getattr(hf, "attention_bias", False)) or kind == "qwen2",
        qk_norm=kind == "qwen3", **common,
    )


def _hf_windows(hf) -> tuple[int | None, ...]:
    """Per-layer windows of a Llama-like config (Mistral / Qwen sliding windows)."""
    window = getattr(hf, "sliding_window", None)
    if window is None or not getattr(hf, "use_sliding_window", True):
        return (None,) * hf.num_hidden_layers
    types = getattr(hf, "layer_types", None) or ["sliding_attention"] * hf.num_hidden_layers
    return tuple(window if t == "sliding_attention" else None for t in types)


def _gemma3_from_hf(hf, common: dict) -> ModelConfig:
    rp = hf.rope_parameters
    types = hf.layer_types
    return ModelConfig(
        family="gemma3",
        rope=_rope_from_hf(rp["full_attention"]),
        local_rope=_rope_from_hf(rp["sliding_attention"]),
        windows=tuple(hf.sliding_window if t == "sliding_attention" else None for t in types),
        qkv_bias=bool(hf.attention_bias), qk_norm=True, norm_offset=1.0, sandwich_norm=True,
        activation="gelu_tanh", embed_scale=hf.hidden_size**0.5,
        attn_scale=hf.query_pre_attn_scalar**-0.5,
        attn_softcap=hf.attn_logit_softcapping, final_softcap=hf.final_logit_softcapping,
        **common,
    )


def _rope_to_hf(r: RopeConfig) -> dict:
    d = {"rope_type": r.kind, "rope_theta": r.theta}
    if r.kind in ("linear", "llama3"):
        d["factor"] = r.factor
    if r.kind == "llama3":
        d.update(low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor,
                 original_max_position_embeddings=r.original_max_position_embeddings)
    return d


def to_hf_config(cfg: ModelConfig):
    """The transformers config of the reference model that holds the same weights."""
    import transformers as tf

    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size, rms_norm_eps=cfg.norm_eps,
        max_position_embeddings=cfg.max_seq_len, tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=cfg.bos_id, eos_token_id=list(cfg.eos_ids) or None, pad_token_id=cfg.pad_id,
    )
    if cfg.family == "gemma3":
        window = next((w for w in cfg.windows if w is not None), 4096)
        types = ["sliding_attention" if w else "full_attention" for w in cfg.windows]
        local = cfg.local_rope or cfg.rope
        return tf.Gemma3TextConfig(
            **common, layer_types=types, sliding_window=window,
            rope_parameters={"full_attention": _rope_to_hf(cfg.rope), "sliding_attention": _rope_to_hf(local)},
            query_pre_attn_scalar=round(cfg.softmax_scale**-2), attention_bias=cfg.qkv_bias,
            attn_logit_softcapping=cfg.attn_softcap, final_logit_softcapping=cfg.final_softcap,
            attn_implementation="eager",
        )
    classes = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config,
               "qwen3": tf.Qwen3Config}
    extra = {"attention_bias": cfg.qkv_bias} if cfg.family in ("llama", "qwen3") else {}
    return classes[cfg.family](**common, rope_parameters=_rope_to_hf(cfg.rope), **extra)
