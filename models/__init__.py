"""The native transformer, its config, weight loading and the tokenizer wrapper."""

from decodelab.models.config import ModelConfig, RopeConfig, from_hf_config, to_hf_config
from decodelab.models.errors import SetupError
from decodelab.models.loading import LoadedModel, load, load_gguf, load_hf_dir, random_model
from decodelab.models.quantize import WeightOptions
from decodelab.models.transformer import Transformer

__all__ = ["ModelConfig", "RopeConfig", "from_hf_config", "to_hf_config", "SetupError", "LoadedModel",
           "load", "load_gguf", "load_hf_dir", "random_model", "Transformer", "WeightOptions"]
