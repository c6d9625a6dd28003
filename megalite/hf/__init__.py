"""Hugging Face transformers interop: one Family record per transformers family (config and
weight conversion both ways, reading and writing directories) and their registry."""
from megalite.hf.bert import BERT
from megalite.hf.deepseek_v3 import DEEPSEEK_V3
from megalite.hf.families import FAMILIES, family_of_config, family_of_source, load_hf, \
    read_source
from megalite.hf.family import Family
from megalite.hf.gguf import read_llama_gguf, smollm2_gguf_path
from megalite.hf.gpt2 import GPT2, gpt2_config, gpt2_to_megalite, megalite_to_gpt2, \
    to_gpt2_config
from megalite.hf.llama import LLAMA, llama_config, llama_to_megalite, megalite_to_llama, \
    to_llama_config
from megalite.hf.moe import MIXTRAL, QWEN2_MOE
from megalite.hf.qwen3 import QWEN3
from megalite.hf.qwen3_moe import QWEN3_MOE

__all__ = ["Family", "FAMILIES", "family_of_config", "family_of_source", "load_hf",
           "read_source", "GPT2", "BERT", "LLAMA", "QWEN3", "MIXTRAL", "QWEN2_MOE", "QWEN3_MOE",
           "DEEPSEEK_V3", "gpt2_config", "gpt2_to_megalite", "megalite_to_gpt2",
           "to_gpt2_config", "llama_config", "to_llama_config", "llama_to_megalite",
           "megalite_to_llama", "read_llama_gguf", "smollm2_gguf_path"]
