"""The transformers model holding the same weights as a native one: the test oracle."""

from __future__ import annotations

import torch

from decodelab.models.config import to_hf_config
from decodelab.models.weights import to_hf_state


def hf_reference(model, attn_implementation: str = "eager"):
    """transformers' own `LlamaForCausalLM` / `Gemma3ForCausalLM` / ... with the native
    model's weights, dtype and device, in eval mode."""
    from transformers import AutoModelForCausalLM

    cfg = to_hf_config(model.cfg)
    cfg._attn_implementation = attn_implementation
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    state = to_hf_state(model.cfg, {k: v.detach().float().cpu() for k, v in model.state_dict().items()})
    hf.load_state_dict(state, strict=True)
    return hf.to(device=model.device, dtype=model.dtype).eval()
