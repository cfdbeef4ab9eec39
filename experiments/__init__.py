"""Hydra entry points: generate (CLI), baseline (vs transformers)."""
