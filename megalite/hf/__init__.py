"""Hugging Face transformers interop (config and weight conversion)."""
from megalite.hf.gpt2 import (gpt2_config, gpt2_to_megalite, load_gpt2, megalite_to_gpt2,
                              to_gpt2_config)

__all__ = ["gpt2_config", "gpt2_to_megalite", "load_gpt2", "megalite_to_gpt2", "to_gpt2_config"]
