"""The native transformer, its config, weight loading and the tokenizer wrapper."""

from models.config import ModelConfig, RopeConfig, from_hf_config, to_hf_config
from models.errors import SetupError
from models.loading import LoadedModel, load, load_gguf, load_hf_dir, random_model
from models.transformer import Transformer

__all__ = ["ModelConfig", "RopeConfig", "from_hf_config", "to_hf_config", "SetupError", "LoadedModel",
           "load", "load_gguf", "load_hf_dir", "random_model", "Transformer"]
