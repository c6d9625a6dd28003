"""Hugging Face Llama <-> megalite GPT with the Llama spec: config and weight conversion.

transformers stores q_proj / k_proj / v_proj separately in the half-split RoPE layout
(`rotate_half`), which is megalite's. megalite fuses q, k, v head-major
[heads, (q, k, v), d] for multi-head attention, and keeps a query projection plus a key-value
projection [groups, (k, v), d] for grouped-query attention; gate_proj and up_proj become the
[gate; up] rows of the SwiGLU input projection.
"""
import os

import torch
from torch import nn

from megalite.checkpoint.files import write_tensors
from megalite.config import ModelConfig
from megalite.hf.gpt2 import qkv_from_head_major, qkv_to_head_major
from megalite.models.sharding import load_full_state_dict

_LAYER_MAP = {  # megalite suffix -> transformers suffix (same layout)
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.dense.weight": "self_attn.o_proj.weight",
    "mlp.dense_4h_to_h.weight": "mlp.down_proj.weight",
}
_TOP_MAP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_SUPPORTED_ROPE = ("default", "llama3")


def llama_config(hf_config) -> ModelConfig:
    """megalite ModelConfig equal to a transformers LlamaConfig (also Qwen2-style QKV bias).

    Features megalite does not implement (sliding-window attention, other RoPE scalings,
    activations other than SiLU) raise one ValueError naming the field.
    """
    if getattr(hf_config, "sliding_window", None) and getattr(hf_config, "use_sliding_window",
                                                              True):
        raise ValueError(f"unsupported Llama config: sliding_window={hf_config.sliding_window} "
                         "(megalite attends over the whole causal context)")
    if hf_config.hidden_act != "silu":
        raise ValueError(f"unsupported Llama config: hidden_act={hf_config.hidden_act!r} "
                         "(megalite's Llama MLP is SwiGLU)")
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type not in _SUPPORTED_ROPE:
        raise ValueError(f"unsupported Llama config: rope_type={rope_type!r} "
                         f"(supported: {', '.join(_SUPPORTED_ROPE)})")
    heads, groups = hf_config.num_attention_heads, hf_config.num_key_value_heads or \
        hf_config.num_attention_heads
    for field in ("attention_bias", "mlp_bias"):
        if getattr(hf_config, field, False):
            raise ValueError(f"unsupported Llama config: {field}=True (megalite has biases on "
                             "every linear layer, or on QKV alone as Qwen2 has them)")
    qkv_bias = getattr(hf_config, "model_type", "llama") == "qwen2"
    scaling = {}
    if rope_type == "llama3":
        scaling = dict(use_rope_scaling=True, rope_scaling_factor=rope["factor"],
                       rope_low_freq_factor=rope["low_freq_factor"],
                       rope_high_freq_factor=rope["high_freq_factor"],
                       rope_original_max_position_embeddings=rope[
                           "original_max_position_embeddings"])
    return ModelConfig(
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        num_attention_heads=heads, ffn_hidden_size=hf_config.intermediate_size,
        vocab_size=hf_config.vocab_size,
        max_position_embeddings=hf_config.max_position_embeddings,
        normalization="RMSNorm", norm_epsilon=hf_config.rms_norm_eps,
        position_embedding_type="rope", rotary_base=rope.get("rope_theta", 10000.0), **scaling,
        swiglu=True, group_query_attention=groups != heads,
        num_query_groups=groups if groups != heads else None,
        kv_channels=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        disable_bias_linear=True, add_qkv_bias=qkv_bias,
        untie_embeddings_and_output_weights=not hf_config.tie_word_embeddings,
        hidden_dropout=0.0, attention_dropout=getattr(hf_config, "attention_dropout", 0.0),
        init_method_std=hf_config.initializer_range)


def check_llama_spec(config: ModelConfig) -> None:
    """One ValueError when a megalite config has no Llama equivalent."""
    problems = [flag for flag, bad in (
        ("--normalization RMSNorm", config.normalization != "RMSNorm"),
        ("--position-embedding-type rope", config.position_embedding_type != "rope"),
        ("--swiglu", not config.swiglu), ("no --post-layernorm", config.post_layernorm),
        ("--causal", not config.causal), ("no token types", config.num_tokentypes),
        ("--disable-bias-linear", not config.disable_bias_linear)) if bad]
    if problems:
        raise ValueError(f"not a Llama config: needs {', '.join(problems)}")


def to_llama_config(config: ModelConfig):
    """transformers LlamaConfig equal to a megalite Llama-spec ModelConfig (no QKV bias)."""
    from transformers import LlamaConfig
    check_llama_spec(config)
    if config.add_qkv_bias:
        raise ValueError("--add-qkv-bias: a Qwen2-style model, not exportable as Llama")
    rope = {"rope_type": "default", "rope_theta": config.rotary_base}
    if config.use_rope_scaling:
        rope.update(rope_type="llama3", factor=config.rope_scaling_factor,
                    low_freq_factor=config.rope_low_freq_factor,
                    high_freq_factor=config.rope_high_freq_factor,
                    original_max_position_embeddings=config.rope_original_max_position_embeddings)
    return LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.query_groups, head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.norm_epsilon, rope_parameters=rope,
        attention_bias=False, mlp_bias=False,
        tie_word_embeddings=not config.untie_embeddings_and_output_weights,
        attention_dropout=config.attention_dropout, initializer_range=config.init_method_std)


def _qkv_to_megalite(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: ModelConfig,
                     prefix: str, kind: str) -> dict[str, torch.Tensor]:
    """Full q [heads d, ...], k, v [groups d, ...] -> megalite's attention projection(s)."""
    heads, groups = config.num_attention_heads, config.query_groups
    if heads == groups:
        return {f"{prefix}query_key_value.{kind}": qkv_to_head_major(torch.cat([q, k, v]), heads)}
    kv = torch.stack([k.reshape(groups, -1, *k.shape[1:]), v.reshape(groups, -1, *v.shape[1:])],
                     dim=1)
    return {f"{prefix}query.{kind}": q, f"{prefix}key_value.{kind}": kv.reshape(-1, *k.shape[1:])}


def _qkv_from_megalite(state: dict[str, torch.Tensor], config: ModelConfig, prefix: str,
                       kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of _qkv_to_megalite: (q, k, v) full tensors."""
    heads, groups = config.num_attention_heads, config.query_groups
    if heads == groups:
        return qkv_from_head_major(state[f"{prefix}query_key_value.{kind}"], heads).chunk(3)
    kv = state[f"{prefix}key_value.{kind}"]
    kv = kv.reshape(groups, 2, -1, *kv.shape[1:])
    k, v = (t.reshape(-1, *kv.shape[3:]) for t in kv.unbind(1))
    return state[f"{prefix}query.{kind}"], k, v


def top_level_to_megalite(hf_state: dict[str, torch.Tensor], config: ModelConfig,
                          family: str) -> tuple[dict, dict]:
    """(the state dict with "model." prefixes, megalite's embedding, final norm and head) of a
    Llama-like `family` ForCausalLM (or its base model) state dict."""
    sd = {k if k.startswith(("model.", "lm_head.")) else "model." + k: v
          for k, v in hf_state.items()}
    out = {ours: sd[theirs] for ours, theirs in _TOP_MAP.items() if theirs in sd}
    if not config.untie_embeddings_and_output_weights:
        out.pop("output_layer.weight", None)
    elif "output_layer.weight" not in out:
        raise KeyError(f"untied {family} config but the state dict has no lm_head.weight")
    return sd, out


def llama_to_megalite(hf_state: dict[str, torch.Tensor], config: ModelConfig
                      ) -> dict[str, torch.Tensor]:
    """Full megalite state dict from a LlamaForCausalLM (or LlamaModel) state dict."""
    sd, out = top_level_to_megalite(hf_state, config, "Llama")
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"encoder.layers.{i}."
        out.update({dst + ours: sd[src + theirs] for ours, theirs in _LAYER_MAP.items()
                    if src + theirs in sd})
        for kind in ("weight", "bias") if config.add_qkv_bias else ("weight",):
            q, k, v = (sd[f"{src}self_attn.{n}_proj.{kind}"] for n in "qkv")
            out.update(_qkv_to_megalite(q, k, v, config, dst + "self_attention.", kind))
        if src + "mlp.gate_proj.weight" in sd:  # dense MLP (MoE layers: megalite.hf.moe)
            out[dst + "mlp.dense_h_to_4h.weight"] = torch.cat(
                [sd[src + "mlp.gate_proj.weight"], sd[src + "mlp.up_proj.weight"]])
    return {k: v.contiguous() for k, v in out.items()}


def megalite_to_llama(state: dict[str, torch.Tensor], config: ModelConfig
                      ) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM state dict from a full megalite state dict (all stages)."""
    out = {theirs: state[ours] for ours, theirs in _TOP_MAP.items() if ours in state}
    if not config.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = state["embedding.word_embeddings.weight"]
    for i in range(config.num_layers):
        src, dst = f"encoder.layers.{i}.", f"model.layers.{i}."
        out.update({dst + theirs: state[src + ours] for ours, theirs in _LAYER_MAP.items()
                    if src + ours in state})
        for kind in ("weight", "bias") if config.add_qkv_bias else ("weight",):
            for name, tensor in zip("qkv", _qkv_from_megalite(state, config,
                                                              src + "self_attention.", kind)):
                out[f"{dst}self_attn.{name}_proj.{kind}"] = tensor
        if src + "mlp.dense_h_to_4h.weight" in state:
            gate, up = state[src + "mlp.dense_h_to_4h.weight"].chunk(2)
            out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate, up
    return {k: v.contiguous() for k, v in out.items()}


def load_llama(model: nn.Module | list[nn.Module], hf_state: dict[str, torch.Tensor],
               config: ModelConfig | None = None) -> None:
    """Fill this rank's TP/PP(/VPP) shard of a Llama-spec GPTModel from a full HF state dict."""
    chunks = model if isinstance(model, list) else [model]
    config = config or getattr(chunks[0], "module", chunks[0]).config
    load_full_state_dict(model, llama_to_megalite(hf_state, config))


def save_llama_dir(directory: str, state: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """Write config.json + model.safetensors that `LlamaForCausalLM.from_pretrained` loads.

    `state` is a full megalite state dict of all stages (see `gather_pipeline_state_dict`).
    """
    write_hf_dir(directory, to_llama_config(config), "LlamaForCausalLM",
                 megalite_to_llama(state, config))


def write_hf_dir(directory: str, hf_config, architecture: str,
                 weights: dict[str, torch.Tensor]) -> None:
    """config.json (naming `architecture`) + model.safetensors of HF-named `weights` (the
    tied lm_head left out) in `directory`."""
    hf_config.architectures = [architecture]
    os.makedirs(directory, exist_ok=True)
    hf_config.save_pretrained(directory)
    if hf_config.tie_word_embeddings:
        weights.pop("lm_head.weight")
    write_tensors(os.path.join(directory, "model.safetensors"), weights, {"format": "pt"})
