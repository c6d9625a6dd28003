"""Hugging Face transformers interop (config and weight conversion)."""
from megalite.hf.bert import (bert_config, bert_to_megalite, load_bert, megalite_to_bert,
                              read_bert_dir, save_bert_dir, to_bert_config)
from megalite.hf.gpt2 import (gpt2_config, gpt2_to_megalite, load_gpt2, megalite_to_gpt2,
                              to_gpt2_config)

__all__ = ["gpt2_config", "gpt2_to_megalite", "load_gpt2", "megalite_to_gpt2", "to_gpt2_config",
           "bert_config", "bert_to_megalite", "load_bert", "megalite_to_bert", "read_bert_dir",
           "save_bert_dir", "to_bert_config"]
