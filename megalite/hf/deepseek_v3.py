"""Hugging Face DeepSeek-V3 <-> megalite GPT with multi-head latent attention: config and weights.

Attention per layer (transformers -> megalite `self_attention.`): q_a_proj / q_a_layernorm /
q_b_proj (or q_proj) -> linear_q_down_proj / q_layernorm / linear_q_up_proj (linear_q_proj),
kv_a_proj_with_mqa / kv_a_layernorm / kv_b_proj -> linear_kv_down_proj / kv_layernorm /
linear_kv_up_proj, o_proj -> linear_proj. transformers' `rope_interleave=True` (DeepSeek's
checkpoints) rotates the RoPE dims as interleaved pairs; megalite rotates half-splits, so the
RoPE rows of q_b_proj (per head) and of kv_a_proj_with_mqa are permuted to [even; odd] on the
way in and back on the way out (the exported config keeps rope_interleave=True). Dense MLPs,
norms, embedding and head map as for Llama; an MoE layer's gate.weight and
e_score_correction_bias are the router's weight and expert_bias, the fused experts
gate_up_proj [E, 2 ffn, h] / down_proj [E, h, ffn] megalite's per-expert SwiGLU weights, and
shared_experts a SwiGLU MLP (`first_k_dense_replace` is the --moe-layer-freq pattern
[0]*k+[1]*(L-k)). transformers has no multi-token-prediction
modules: exporting drops megalite's `mtp.` weights, importing starts without them.
"""
from collections.abc import Callable

import torch

from megalite.config import ModelConfig
from megalite.hf.family import Family, State, from_pretrained
from megalite.hf.llama import _TOP_MAP, top_level_to_megalite
from megalite.hf.moe import deepseek_moe_block_state

_LAYER_MAP = {  # megalite suffix -> transformers suffix (same layout)
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
}
_ROPE_ROWS = {  # megalite suffix -> transformers suffix, rows [.., (nope, rope)] per head
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
}
LATENT_NORM_EPS = 1e-6  # transformers' q_a_layernorm / kv_a_layernorm (megalite: --norm-epsilon)


def deepseek_v3_config(hf_config) -> ModelConfig:
    """megalite ModelConfig equal to a transformers DeepseekV3Config; one ValueError naming the
    field for what megalite does not implement."""
    rope = dict(hf_config.rope_parameters or {})
    rope_type = rope.get("rope_type", "default")
    problems = [f"{field}" for field, bad in (
        (f"rope_type={rope_type!r} (supported: default, yarn)",
         rope_type not in ("default", "yarn")),
        ("attention_bias=True", hf_config.attention_bias),
        (f"hidden_act={hf_config.hidden_act!r} (megalite: silu)", hf_config.hidden_act != "silu"),
        (f"rms_norm_eps={hf_config.rms_norm_eps} (the latent norms use {LATENT_NORM_EPS})",
         hf_config.rms_norm_eps != LATENT_NORM_EPS),
        (f"num_key_value_heads={hf_config.num_key_value_heads} (MLA: one per head)",
         hf_config.num_key_value_heads != hf_config.num_attention_heads),
        ("n_shared_experts=0 (megalite maps DeepSeek-V3's shared expert)",
         hf_config.first_k_dense_replace < hf_config.num_hidden_layers
         and not hf_config.n_shared_experts)) if bad]
    if problems:
        raise ValueError(f"unsupported DeepSeek-V3 config: {problems[0]}")
    yarn = {}
    if rope_type == "yarn":
        yarn = dict(rotary_scaling_factor=rope["factor"],
                    rope_original_max_position_embeddings=rope[
                        "original_max_position_embeddings"],
                    beta_fast=rope.get("beta_fast") or 32.0, beta_slow=rope.get("beta_slow") or 1.0,
                    mscale=rope.get("mscale") or 0.0, mscale_all_dim=rope.get("mscale_all_dim")
                    or 0.0)
    return ModelConfig(
        **_moe_fields(hf_config),
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads,
        ffn_hidden_size=hf_config.intermediate_size, vocab_size=hf_config.vocab_size,
        max_position_embeddings=hf_config.max_position_embeddings, normalization="RMSNorm",
        norm_epsilon=hf_config.rms_norm_eps, position_embedding_type="rope",
        rotary_base=rope.get("rope_theta", 10000.0), **yarn, swiglu=True,
        disable_bias_linear=True, multi_latent_attention=True,
        q_lora_rank=hf_config.q_lora_rank, kv_lora_rank=hf_config.kv_lora_rank,
        qk_head_dim=hf_config.qk_nope_head_dim, qk_pos_emb_head_dim=hf_config.qk_rope_head_dim,
        v_head_dim=hf_config.v_head_dim,
        untie_embeddings_and_output_weights=not hf_config.tie_word_embeddings,
        hidden_dropout=0.0, attention_dropout=hf_config.attention_dropout or 0.0,
        init_method_std=hf_config.initializer_range)


def _moe_fields(hf_config) -> dict:
    """The MoE flags of a DeepseekV3Config (none when every layer is dense): sigmoid scores
    with the selection bias, group-limited top-k, the routed scaling factor, one shared
    expert of n_shared_experts x moe_intermediate_size, the first k layers dense."""
    layers, dense = hf_config.num_hidden_layers, hf_config.first_k_dense_replace
    if dense >= layers:
        return {}
    groups = hf_config.n_group if hf_config.n_group and hf_config.n_group > 1 else None
    return dict(
        num_experts=hf_config.n_routed_experts, moe_router_topk=hf_config.num_experts_per_tok,
        moe_ffn_hidden_size=hf_config.moe_intermediate_size,
        moe_shared_expert_intermediate_size=hf_config.moe_intermediate_size
        * hf_config.n_shared_experts,
        moe_layer_freq=f"[0]*{dense}+[1]*{layers - dense}" if dense else 1,
        moe_router_score_function="sigmoid", moe_router_topk_renorm=hf_config.norm_topk_prob,
        moe_router_enable_expert_bias=True, moe_router_num_groups=groups,
        moe_router_group_topk=hf_config.topk_group if groups else None,
        moe_router_topk_scaling_factor=hf_config.routed_scaling_factor)


def check_deepseek_v3_spec(config: ModelConfig) -> None:
    """One ValueError when a megalite config has no DeepSeek-V3 equivalent."""
    problems = [flag for flag, bad in (
        ("--multi-latent-attention", not config.multi_latent_attention),
        ("--normalization RMSNorm", config.normalization != "RMSNorm"),
        ("--swiglu", not config.swiglu), ("--disable-bias-linear", not config.disable_bias_linear),
        (f"--norm-epsilon {LATENT_NORM_EPS}", config.norm_epsilon != LATENT_NORM_EPS),
        ("MoE layers: --moe-router-score-function sigmoid, --moe-router-enable-expert-bias, "
         "a shared expert without --moe-shared-expert-gate, no capacity factor, dense layers "
         "first", config.num_experts is not None and (
             config.moe_router_score_function != "sigmoid"
             or not config.moe_router_enable_expert_bias or config.moe_shared_expert_gate
             or not config.moe_shared_expert_intermediate_size
             or config.moe_expert_capacity_factor is not None
             or list(config.moe_layers) != sorted(config.moe_layers))),
        ("--causal, no --post-layernorm", not config.causal or config.post_layernorm)) if bad]
    if problems:
        raise ValueError(f"not a DeepSeek-V3 config: needs {', '.join(problems)}")


def to_deepseek_v3_config(config: ModelConfig):
    """transformers DeepseekV3Config equal to a megalite MLA config (MTP modules not kept)."""
    from transformers import DeepseekV3Config
    check_deepseek_v3_spec(config)
    rope = {"rope_type": "default", "rope_theta": config.rotary_base}
    if config.rotary_scaling_factor != 1.0:
        rope.update(rope_type="yarn", factor=config.rotary_scaling_factor,
                    original_max_position_embeddings=config.rope_original_max_position_embeddings,
                    beta_fast=config.beta_fast, beta_slow=config.beta_slow, mscale=config.mscale,
                    mscale_all_dim=config.mscale_all_dim)
    moe = {}
    if config.num_experts is not None:
        shared = config.moe_shared_expert_intermediate_size or 0
        if shared % config.moe_ffn_hidden_size:
            raise ValueError(f"not a DeepSeek-V3 config: --moe-shared-expert-intermediate-size "
                             f"({shared}) must be a multiple of --moe-ffn-hidden-size "
                             f"({config.moe_ffn_hidden_size})")
        moe = dict(n_routed_experts=config.num_experts,
                   num_experts_per_tok=config.moe_router_topk,
                   moe_intermediate_size=config.moe_ffn_hidden_size,
                   n_shared_experts=shared // config.moe_ffn_hidden_size,
                   first_k_dense_replace=config.moe_layers.index(True),
                   n_group=config.moe_router_num_groups or 1,
                   topk_group=config.moe_router_group_topk or 1,
                   norm_topk_prob=config.moe_router_topk_renorm,
                   routed_scaling_factor=config.moe_router_topk_scaling_factor or 1.0)
    dense = dict(first_k_dense_replace=config.num_layers, n_routed_experts=1,
                 num_experts_per_tok=1, n_group=1, topk_group=1)
    return DeepseekV3Config(
        **(moe or dense),
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_attention_heads, q_lora_rank=config.q_lora_rank or None,
        kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_head_dim,
        qk_rope_head_dim=config.qk_pos_emb_head_dim, v_head_dim=config.v_head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.norm_epsilon, rope_parameters=rope, rope_interleave=True,
        tie_word_embeddings=not config.untie_embeddings_and_output_weights,
        attention_bias=False, attention_dropout=config.attention_dropout,
        initializer_range=config.init_method_std, num_nextn_predict_layers=0)


def reorder_rope_rows(weight: torch.Tensor, blocks: int, rope: int, inverse: bool
                      ) -> torch.Tensor:
    """Rows of `blocks` equal blocks, each ending with `rope` RoPE rows: those from
    interleaved pairs to [even; odd] (transformers' rope_interleave -> megalite), or back."""
    order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    if inverse:
        order = order.argsort()
    view = weight.reshape(blocks, -1, *weight.shape[1:])
    return torch.cat([view[:, :-rope], view[:, -rope:][:, order]], dim=1).reshape(weight.shape)


def convert_layers(state: dict[str, torch.Tensor], config: ModelConfig, to_hf: bool,
                    interleave: bool) -> dict[str, torch.Tensor]:
    """The per-layer weights renamed one way or the other (RoPE rows reordered when
    `interleave`), SwiGLU's [gate; up] split or joined."""
    out, heads = {}, config.num_attention_heads
    for i in range(config.num_layers):
        ours, theirs = f"encoder.layers.{i}.", f"model.layers.{i}."
        src, dst = (ours, theirs) if to_hf else (theirs, ours)
        for a, b in _LAYER_MAP.items():
            a, b = (a, b) if to_hf else (b, a)
            if src + a in state:
                out[dst + b] = state[src + a]
        for name, hf_name in _ROPE_ROWS.items():
            a, b = (name, hf_name) if to_hf else (hf_name, name)
            if src + a in state:
                blocks = 1 if name.endswith("kv_down_proj.weight") else heads
                out[dst + b] = reorder_rope_rows(state[src + a], blocks,
                                                 config.qk_pos_emb_head_dim, to_hf) \
                    if interleave else state[src + a]
        convert_mlp = _moe_to_hf if to_hf else _moe_from_hf
        out.update(convert_mlp(state, src + "mlp.", dst + "mlp.", config.num_experts or 0))
    return out


def _swiglu_to_hf(state: dict, src: str, dst: str) -> dict:
    """megalite `{src}dense_h_to_4h` [gate; up] / `dense_4h_to_h` -> transformers'
    `{dst}gate_proj` / `up_proj` / `down_proj` (none if absent)."""
    if src + "dense_h_to_4h.weight" not in state:
        return {}
    gate, up = state[src + "dense_h_to_4h.weight"].chunk(2)
    return {dst + "gate_proj.weight": gate, dst + "up_proj.weight": up,
            dst + "down_proj.weight": state[src + "dense_4h_to_h.weight"]}


def _swiglu_from_hf(state: dict, src: str, dst: str) -> dict:
    if src + "gate_proj.weight" not in state:
        return {}
    return {dst + "dense_h_to_4h.weight": torch.cat([state[src + "gate_proj.weight"],
                                                      state[src + "up_proj.weight"]]),
            dst + "dense_4h_to_h.weight": state[src + "down_proj.weight"]}


def _moe_to_hf(state: dict, src: str, dst: str, experts: int) -> dict:
    """One layer's MLP (dense, or router + bias + experts + shared expert) to transformers'."""
    if src + "router.weight" not in state:
        return _swiglu_to_hf(state, src, dst)
    layer = {k.removeprefix(src): v for k, v in state.items() if k.startswith(src)}
    return {dst + k: v for k, v in deepseek_moe_block_state(layer, experts).items()}


def _moe_from_hf(state: dict, src: str, dst: str, experts: int) -> dict:
    out = _swiglu_from_hf(state, src, dst) | _swiglu_from_hf(state, src + "shared_experts.",
                                                            dst + "shared_experts.")
    if src + "gate.weight" in state:
        out[dst + "router.weight"] = state[src + "gate.weight"]
        out[dst + "router.expert_bias"] = state[src + "gate.e_score_correction_bias"]
        for e in range(experts):
            out[f"{dst}local_experts.{e}.dense_h_to_4h.weight"] = \
                state[src + "experts.gate_up_proj"][e]
            out[f"{dst}local_experts.{e}.dense_4h_to_h.weight"] = \
                state[src + "experts.down_proj"][e]
    return out


def deepseek_v3_to_megalite(hf_state: dict[str, torch.Tensor], config: ModelConfig,
                            rope_interleave: bool = True) -> dict[str, torch.Tensor]:
    """Full megalite state dict from a DeepseekV3ForCausalLM state dict (its config's
    `rope_interleave`)."""
    sd, out = top_level_to_megalite(hf_state, config, "DeepSeek-V3")
    out.update(convert_layers(sd, config, to_hf=False, interleave=rope_interleave))
    return {k: v.contiguous() for k, v in out.items()}


def megalite_to_deepseek_v3(state: dict[str, torch.Tensor], config: ModelConfig
                            ) -> dict[str, torch.Tensor]:
    """DeepseekV3ForCausalLM state dict (rope_interleave=True) from a full megalite state dict
    (its `mtp.` weights left out)."""
    out = {theirs: state[ours] for ours, theirs in _TOP_MAP.items() if ours in state}
    if not config.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = state["embedding.word_embeddings.weight"]
    out.update(convert_layers(state, config, to_hf=True, interleave=True))
    return {k: v.contiguous() for k, v in out.items()}


def _read(family: Family, src: str, log: Callable[[str], None]) -> tuple[ModelConfig, State]:
    """A DeepseekV3ForCausalLM directory (either RoPE layout: its config's rope_interleave)."""
    hf = from_pretrained(family.transformers_class(), src)
    config = family.config_from_hf(hf.config)
    return config, deepseek_v3_to_megalite(hf.state_dict(), config, hf.config.rope_interleave)


DEEPSEEK_V3 = Family(
    name="deepseek_v3", model_types=("deepseek_v3",), hf_class="DeepseekV3ForCausalLM",
    from_hf=deepseek_v3_config, to_hf=to_deepseek_v3_config,
    state_from_hf=deepseek_v3_to_megalite, state_to_hf=megalite_to_deepseek_v3,
    exports=lambda c: c.causal and c.multi_latent_attention, reader=_read)
