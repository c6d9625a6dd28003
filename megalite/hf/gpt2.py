"""Hugging Face GPT-2 <-> megalite GPT: config and weight conversion.

GPT-2 stores Conv1D weights as [in, out] (transposed vs nn.Linear), fuses c_attn as
[q | k | v] along the output, while megalite's fused QKV is head-major
[heads, (q, k, v), head_dim] so that a TP split keeps whole heads.
"""
import torch

from megalite.checkpoint.files import save_pretrained
from megalite.config import ModelConfig
from megalite.hf.family import Family, State

_LAYER_MAP = {  # megalite suffix -> (GPT-2 suffix, is a Conv1D weight)
    "input_layernorm.weight": ("ln_1.weight", False),
    "input_layernorm.bias": ("ln_1.bias", False),
    "self_attention.dense.weight": ("attn.c_proj.weight", True),
    "self_attention.dense.bias": ("attn.c_proj.bias", False),
    "post_attention_layernorm.weight": ("ln_2.weight", False),
    "post_attention_layernorm.bias": ("ln_2.bias", False),
    "mlp.dense_h_to_4h.weight": ("mlp.c_fc.weight", True),
    "mlp.dense_h_to_4h.bias": ("mlp.c_fc.bias", False),
    "mlp.dense_4h_to_h.weight": ("mlp.c_proj.weight", True),
    "mlp.dense_4h_to_h.bias": ("mlp.c_proj.bias", False),
}
_TOP_MAP = {
    "embedding.word_embeddings.weight": "wte.weight",
    "embedding.position_embeddings.weight": "wpe.weight",
    "final_layernorm.weight": "ln_f.weight",
    "final_layernorm.bias": "ln_f.bias",
}


def gpt2_config(hf_config) -> ModelConfig:
    """megalite ModelConfig equal to a transformers GPT2Config."""
    if hf_config.activation_function not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
        raise ValueError(f"unsupported GPT-2 activation {hf_config.activation_function!r}")
    return ModelConfig(
        num_layers=hf_config.n_layer, hidden_size=hf_config.n_embd,
        num_attention_heads=hf_config.n_head, ffn_hidden_size=hf_config.n_inner or 4 * hf_config.n_embd,
        vocab_size=hf_config.vocab_size, max_position_embeddings=hf_config.n_positions,
        norm_epsilon=hf_config.layer_norm_epsilon, hidden_dropout=hf_config.resid_pdrop,
        attention_dropout=hf_config.attn_pdrop, init_method_std=hf_config.initializer_range,
        activation="gelu" if hf_config.activation_function == "gelu" else "gelu_tanh")


def to_gpt2_config(config: ModelConfig):
    """transformers GPT2Config equal to a megalite ModelConfig (inverse of gpt2_config)."""
    from transformers import GPT2Config
    return GPT2Config(
        n_layer=config.num_layers, n_embd=config.hidden_size, n_head=config.num_attention_heads,
        n_inner=config.ffn_hidden_size, vocab_size=config.vocab_size,
        n_positions=config.max_position_embeddings, layer_norm_epsilon=config.norm_epsilon,
        resid_pdrop=config.hidden_dropout, embd_pdrop=config.hidden_dropout,
        attn_pdrop=config.attention_dropout, initializer_range=config.init_method_std,
        activation_function="gelu_new" if config.activation == "gelu_tanh" else "gelu")


def qkv_to_head_major(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[3h, ...] ordered [q | k | v] -> [3h, ...] ordered [heads, (q, k, v), head_dim]."""
    return t.reshape(3, heads, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def qkv_from_head_major(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of qkv_to_head_major."""
    return t.reshape(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _strip(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.removeprefix("transformer."): v for k, v in hf_state.items()}


def gpt2_to_megalite(hf_state: dict[str, torch.Tensor], config: ModelConfig
                     ) -> dict[str, torch.Tensor]:
    """Full megalite state dict from a GPT2Model / GPT2LMHeadModel state dict."""
    sd, heads = _strip(hf_state), config.num_attention_heads
    out = {ours: sd[theirs] for ours, theirs in _TOP_MAP.items()}
    for i in range(config.num_layers):
        src, dst = f"h.{i}.", f"encoder.layers.{i}."
        for ours, (theirs, conv1d) in _LAYER_MAP.items():
            out[dst + ours] = sd[src + theirs].t() if conv1d else sd[src + theirs]
        out[dst + "self_attention.query_key_value.weight"] = qkv_to_head_major(
            sd[src + "attn.c_attn.weight"].t(), heads)
        out[dst + "self_attention.query_key_value.bias"] = qkv_to_head_major(
            sd[src + "attn.c_attn.bias"], heads)
    return {k: v.contiguous() for k, v in out.items()}


def megalite_to_gpt2(state: dict[str, torch.Tensor], config: ModelConfig
                     ) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel state dict from a full megalite state dict (all layers)."""
    heads = config.num_attention_heads
    out = {"transformer." + theirs: state[ours] for ours, theirs in _TOP_MAP.items()}
    for i in range(config.num_layers):
        src, dst = f"encoder.layers.{i}.", f"transformer.h.{i}."
        for ours, (theirs, conv1d) in _LAYER_MAP.items():
            out[dst + theirs] = state[src + ours].t() if conv1d else state[src + ours]
        out[dst + "attn.c_attn.weight"] = qkv_from_head_major(
            state[src + "self_attention.query_key_value.weight"], heads).t()
        out[dst + "attn.c_attn.bias"] = qkv_from_head_major(
            state[src + "self_attention.query_key_value.bias"], heads)
    out["lm_head.weight"] = state["embedding.word_embeddings.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def _write(family: Family, directory: str, state: State, config: ModelConfig) -> None:
    """Through GPT2LMHeadModel (its tied head and attention-mask buffers made by transformers)."""
    from transformers import GPT2LMHeadModel
    model = GPT2LMHeadModel(family.config_to_hf(config))
    missing, unexpected = model.load_state_dict(megalite_to_gpt2(state, config), strict=False)
    if unexpected or any("lm_head" not in k and not k.endswith(".attn.bias") for k in missing):
        raise ValueError(f"{directory}: weights do not fit GPT2LMHeadModel: missing {missing}, "
                         f"unexpected {unexpected}")
    model.tie_weights()
    save_pretrained(model, directory)


GPT2 = Family(
    name="gpt", model_types=("gpt2",), hf_class="GPT2LMHeadModel", from_hf=gpt2_config,
    to_hf=to_gpt2_config, state_from_hf=gpt2_to_megalite, state_to_hf=megalite_to_gpt2,
    exports=lambda c: c.causal and c.normalization == "LayerNorm" and c.num_experts is None
    and not c.multi_latent_attention and not c.qk_layernorm, writer=_write)
