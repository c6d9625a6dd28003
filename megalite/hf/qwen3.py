"""Hugging Face Qwen3 <-> megalite GPT with the Llama spec and per-head q/k RMSNorm.

Qwen3 is Llama with `self_attn.q_norm` / `k_norm` (RMSNorm over the head dim, eps
rms_norm_eps) applied to each head's q and k before RoPE: megalite's --qk-layernorm, whose
`self_attention.q_layernorm` / `k_layernorm` weights megalite.hf.llama maps. The head dim may
differ from hidden / heads; sliding-window attention and attention biases (on q, k, v and
the output) are refused.
"""
import dataclasses

from megalite.config import ModelConfig
from megalite.hf.family import Family
from megalite.hf.llama import llama_config, llama_config_fields, llama_to_megalite, \
    megalite_to_llama


def qwen3_config(hf_config) -> ModelConfig:
    """megalite ModelConfig equal to a transformers Qwen3Config (or a Qwen3MoeConfig's
    attention, norms and dense MLP)."""
    if getattr(hf_config, "attention_bias", False):
        raise ValueError("unsupported Qwen3 config: attention_bias=True (megalite has QKV "
                         "biases without an output bias, or biases on every linear layer)")
    return dataclasses.replace(llama_config(hf_config), qk_layernorm=True)


def qwen3_config_fields(config: ModelConfig, family: str) -> dict:
    """The transformers config fields of a Qwen3-style megalite config; one ValueError
    naming `family` and the flags it lacks."""
    problems = [flag for flag, bad in (
        ("--qk-layernorm", not config.qk_layernorm),
        ("no --add-qkv-bias", config.add_qkv_bias)) if bad]
    if problems:
        raise ValueError(f"not a {family} config: needs {', '.join(problems)}")
    return dict(llama_config_fields(config), attention_bias=False, use_sliding_window=False)


def to_qwen3_config(config: ModelConfig):
    """transformers Qwen3Config equal to a megalite config (inverse of qwen3_config)."""
    from transformers import Qwen3Config
    return Qwen3Config(**qwen3_config_fields(config, "Qwen3"))


QWEN3 = Family(
    name="qwen3", model_types=("qwen3",), hf_class="Qwen3ForCausalLM", from_hf=qwen3_config,
    to_hf=to_qwen3_config, state_from_hf=llama_to_megalite, state_to_hf=megalite_to_llama,
    exports=lambda c: c.causal and c.qk_layernorm and c.num_experts is None
    and not c.multi_latent_attention)
