"""The transformers model holding the same weights as a native one: the oracle of tests,
`experiments.agree` and the side-by-side benchmarks."""

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


def hf_model_for(lm):
    """transformers' own model with the same weights (from the converted checkpoint when
    there is one, else built from the native weights), SDPA attention, on lm's device."""
    from transformers import AutoModelForCausalLM

    if lm.hf_dir is None:
        return hf_reference(lm.model, attn_implementation="sdpa")
    hf = AutoModelForCausalLM.from_pretrained(lm.hf_dir, dtype=lm.model.dtype, attn_implementation="sdpa")
    return hf.to(lm.model.device).eval()
