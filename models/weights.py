"""Weight names: transformers' checkpoint layout <-> the native fused layout.

The native model fuses q/k/v into `wqkv` and gate/up into `w_gate_up` (fewer, larger
matmuls); this module is the single place that knows how the names correspond.
"""

from __future__ import annotations

import torch

from decodelab.models.config import ModelConfig


def hf_names(cfg: ModelConfig) -> dict[str, list[tuple[str, int]]]:
    """native name -> [(transformers name, rows it contributes)], in concat order."""
    q, kv, inter = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.intermediate_size
    m = {"embed.weight": [("model.embed_tokens.weight", cfg.vocab_size)],
         "norm.weight": [("model.norm.weight", cfg.dim)]}
    if not cfg.tie_embeddings:
        m["lm_head.weight"] = [("lm_head.weight", cfg.vocab_size)]
    norms = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
    if cfg.sandwich_norm:
        norms = {"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
                 "mlp_norm": "pre_feedforward_layernorm", "mlp_post_norm": "post_feedforward_layernorm"}
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        a = theirs + "self_attn."
        m[ours + "attn.wqkv.weight"] = [(a + "q_proj.weight", q), (a + "k_proj.weight", kv), (a + "v_proj.weight", kv)]
        if cfg.qkv_bias:
            m[ours + "attn.wqkv.bias"] = [(a + "q_proj.bias", q), (a + "k_proj.bias", kv), (a + "v_proj.bias", kv)]
        m[ours + "attn.wo.weight"] = [(a + "o_proj.weight", cfg.dim)]
        if cfg.qk_norm:
            m[ours + "attn.q_norm.weight"] = [(a + "q_norm.weight", cfg.head_dim)]
            m[ours + "attn.k_norm.weight"] = [(a + "k_norm.weight", cfg.head_dim)]
        mlp = theirs + "mlp."
        m[ours + "mlp.w_gate_up.weight"] = [(mlp + "gate_proj.weight", inter), (mlp + "up_proj.weight", inter)]
        m[ours + "mlp.w_down.weight"] = [(mlp + "down_proj.weight", cfg.dim)]
        for ours_norm, hf_norm in norms.items():
            m[ours + ours_norm + ".weight"] = [(theirs + hf_norm + ".weight", cfg.dim)]
    return m


def _is_proj(name: str) -> bool:
    """Native projections store W as [in, out]: transposed relative to transformers."""
    return name.endswith(".weight") and any(k in name for k in ("wqkv", "wo.", "w_gate_up", "w_down", "lm_head"))


def from_hf_state(cfg: ModelConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Native state dict from a transformers one; lists every missing tensor at once."""
    from decodelab.models.errors import SetupError

    names = hf_names(cfg)
    missing = [h for parts in names.values() for h, _ in parts if h not in hf]
    if missing:
        raise SetupError(f"checkpoint lacks {len(missing)} tensor(s) the config needs, e.g. {missing[:3]}; "
                         "the weights do not match config.json")
    out = {}
    for ours, parts in names.items():
        w = torch.cat([hf[h] for h, _ in parts]) if len(parts) > 1 else hf[parts[0][0]]
        out[ours] = w.t().contiguous() if _is_proj(ours) else w
    return out


def to_hf_state(cfg: ModelConfig, ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers state dict holding the same weights as a native one."""
    out = {}
    for name, parts in hf_names(cfg).items():
        w = ours[name].t() if _is_proj(name) else ours[name]
        pieces = w.split([rows for _, rows in parts])
        out.update({h: p.contiguous().clone() for (h, _), p in zip(parts, pieces)})
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out
