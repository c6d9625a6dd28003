"""Hugging Face transformers interop (config and weight conversion)."""
from megalite.hf.bert import (bert_config, bert_to_megalite, load_bert, megalite_to_bert,
                              read_bert_dir, save_bert_dir, to_bert_config)
from megalite.hf.gguf import read_llama_gguf, smollm2_gguf_path
from megalite.hf.gpt2 import (gpt2_config, gpt2_to_megalite, load_gpt2, megalite_to_gpt2,
                              to_gpt2_config)
from megalite.hf.llama import (llama_config, llama_to_megalite, load_llama, megalite_to_llama,
                               save_llama_dir, to_llama_config)

__all__ = ["gpt2_config", "gpt2_to_megalite", "load_gpt2", "megalite_to_gpt2", "to_gpt2_config",
           "bert_config", "bert_to_megalite", "load_bert", "megalite_to_bert", "read_bert_dir",
           "save_bert_dir", "to_bert_config", "llama_config", "to_llama_config", "load_llama",
           "llama_to_megalite", "megalite_to_llama", "save_llama_dir", "read_llama_gguf",
           "smollm2_gguf_path"]
