"""Hugging Face Mixtral and Qwen2-MoE <-> megalite GPT with the Llama spec and MoE MLPs.

Attention, norms, embeddings and head map as for Llama (megalite.hf.llama). Per layer, the
router `mlp.gate.weight` [E, h] is megalite's `mlp.router.weight`; transformers' fused
`mlp.experts.gate_up_proj` [E, 2 ffn, h] ([gate; up] rows) and `down_proj` [E, h, ffn] are
megalite's per-expert `mlp.local_experts.{e}.dense_h_to_4h` / `dense_4h_to_h` weights.
Qwen2-MoE adds `shared_expert` (a SwiGLU MLP) and `shared_expert_gate` [1, h], QKV biases
and top-k weights without renormalisation (`norm_topk_prob=False`).

The load-balancing loss: transformers adds it (with `router_aux_loss_coef`) only when
`output_router_logits` is set, over the router logits of all layers pooled and without
dividing by k; megalite adds E * sum_e f_e P_e per layer with f normalised by T * k (1.0 when
balanced), so one layer's transformers value is k times megalite's.
"""
import dataclasses

import torch

from megalite.config import ModelConfig
from megalite.hf.family import Family
from megalite.hf.llama import check_llama_spec, llama_config, llama_to_megalite, \
    megalite_to_llama

FAMILIES = ("mixtral", "qwen2_moe")


def moe_config(hf_config) -> ModelConfig:
    """megalite ModelConfig equal to a transformers MixtralConfig or Qwen2MoeConfig."""
    family = getattr(hf_config, "model_type", None)
    if family not in FAMILIES:
        raise ValueError(f"unsupported MoE config: model_type={family!r} (supported: "
                         f"{', '.join(FAMILIES)})")
    if getattr(hf_config, "router_jitter_noise", 0.0):
        raise ValueError(f"unsupported Mixtral config: router_jitter_noise="
                         f"{hf_config.router_jitter_noise} (megalite routes without noise)")
    if family == "qwen2_moe" and (hf_config.decoder_sparse_step != 1
                                  or hf_config.mlp_only_layers):
        raise ValueError("unsupported Qwen2-MoE config: decoder_sparse_step "
                         f"{hf_config.decoder_sparse_step} / mlp_only_layers "
                         f"{hf_config.mlp_only_layers} (megalite: MoE on every layer)")
    base = llama_config(hf_config)
    qwen = family == "qwen2_moe"
    return dataclasses.replace(
        base, add_qkv_bias=qwen and hf_config.qkv_bias,
        num_experts=hf_config.num_experts if qwen else hf_config.num_local_experts,
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_ffn_hidden_size=hf_config.moe_intermediate_size if qwen
        else hf_config.intermediate_size,
        moe_shared_expert_intermediate_size=hf_config.shared_expert_intermediate_size
        if qwen else None,
        moe_shared_expert_gate=qwen, moe_router_topk_renorm=hf_config.norm_topk_prob
        if qwen else True,
        moe_aux_loss_coeff=hf_config.router_aux_loss_coef if hf_config.output_router_logits
        else 0.0)


def routing_problems(config: ModelConfig) -> list[str]:
    """The flags a megalite MoE config lacks for a softmax top-k router over dropless experts
    (Mixtral, Qwen2-MoE, Qwen3-MoE)."""
    return [flag for flag, bad in (
        ("--num-experts", config.num_experts is None),
        ("--moe-router-score-function softmax", config.moe_router_score_function != "softmax"),
        ("no --moe-expert-capacity-factor (dropless)",
         config.moe_expert_capacity_factor is not None),
        ("no DeepSeek-V3 routing flags (--moe-router-num-groups, "
         "--moe-router-topk-scaling-factor, --moe-router-enable-expert-bias)",
         config.moe_router_num_groups is not None or config.moe_router_enable_expert_bias
         or config.moe_router_topk_scaling_factor is not None)) if bad]


def moe_family(config: ModelConfig) -> str:
    """Which of Mixtral and Qwen2-MoE a megalite MoE config exports as; one ValueError if
    neither."""
    check_llama_spec(config)
    problems = routing_problems(config)
    if config.moe_layer_freq != 1:
        problems.append("--moe-layer-freq 1")
    if config.qk_layernorm:
        problems.append("no --qk-layernorm")
    shared = config.moe_shared_expert_intermediate_size is not None
    if shared and not config.moe_shared_expert_gate:
        problems.append("--moe-shared-expert-gate with a shared expert (Qwen2-MoE)")
    if not shared and (config.add_qkv_bias or not config.moe_router_topk_renorm):
        problems.append("--moe-router-topk-renorm and no QKV bias (Mixtral)")
    if problems:
        raise ValueError(f"not a Mixtral or Qwen2-MoE config: needs {', '.join(problems)}")
    return "qwen2_moe" if shared else "mixtral"


def to_moe_config(config: ModelConfig):
    """transformers MixtralConfig or Qwen2MoeConfig equal to a megalite MoE config."""
    from transformers import MixtralConfig, Qwen2MoeConfig
    family = moe_family(config)
    common = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.query_groups, head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.norm_epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": config.rotary_base},
        num_experts_per_tok=config.moe_router_topk,
        tie_word_embeddings=not config.untie_embeddings_and_output_weights,
        router_aux_loss_coef=config.moe_aux_loss_coeff,
        output_router_logits=config.moe_aux_loss_coeff > 0,
        attention_dropout=config.attention_dropout, initializer_range=config.init_method_std)
    if family == "mixtral":
        return MixtralConfig(intermediate_size=config.moe_ffn_hidden_size,
                             num_local_experts=config.num_experts, **common)
    return Qwen2MoeConfig(
        intermediate_size=config.ffn_hidden_size, moe_intermediate_size=config.moe_ffn_hidden_size,
        shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size,
        num_experts=config.num_experts, norm_topk_prob=config.moe_router_topk_renorm,
        qkv_bias=config.add_qkv_bias, **common)


_SHARED = {"shared_experts.dense_4h_to_h.weight": "shared_expert.down_proj.weight",
           "shared_expert_gate": "shared_expert_gate.weight"}


def moe_to_megalite(hf_state: dict[str, torch.Tensor], config: ModelConfig
                    ) -> dict[str, torch.Tensor]:
    """Full megalite state dict from a MixtralForCausalLM / Qwen2MoeForCausalLM (or
    Qwen3MoeForCausalLM: dense layers where `config.moe_layers` says) state dict."""
    sd = {k if k.startswith(("model.", "lm_head.")) else "model." + k: v
          for k, v in hf_state.items()}
    out = llama_to_megalite(sd, config)
    for i in (i for i, moe in enumerate(config.moe_layers) if moe):
        src, dst = f"model.layers.{i}.mlp.", f"encoder.layers.{i}.mlp."
        out[dst + "router.weight"] = sd[src + "gate.weight"]
        for e in range(config.num_experts):
            expert = f"{dst}local_experts.{e}."
            out[expert + "dense_h_to_4h.weight"] = sd[src + "experts.gate_up_proj"][e]
            out[expert + "dense_4h_to_h.weight"] = sd[src + "experts.down_proj"][e]
        if config.moe_shared_expert_intermediate_size:
            out[dst + "shared_experts.dense_h_to_4h.weight"] = torch.cat(
                [sd[src + "shared_expert.gate_proj.weight"],
                 sd[src + "shared_expert.up_proj.weight"]])
            out.update({dst + ours: sd[src + theirs] for ours, theirs in _SHARED.items()})
    return {k: v.contiguous() for k, v in out.items()}


def megalite_to_moe(state: dict[str, torch.Tensor], config: ModelConfig
                    ) -> dict[str, torch.Tensor]:
    """MixtralForCausalLM / Qwen2MoeForCausalLM (/ Qwen3MoeForCausalLM) state dict from a full
    megalite state dict."""
    out = megalite_to_llama(state, config)
    for i in (i for i, moe in enumerate(config.moe_layers) if moe):
        src, dst = f"encoder.layers.{i}.mlp.", f"model.layers.{i}.mlp."
        out[dst + "gate.weight"] = state[src + "router.weight"]
        experts = [f"{src}local_experts.{e}." for e in range(config.num_experts)]
        out[dst + "experts.gate_up_proj"] = torch.stack(
            [state[e + "dense_h_to_4h.weight"] for e in experts])
        out[dst + "experts.down_proj"] = torch.stack(
            [state[e + "dense_4h_to_h.weight"] for e in experts])
        if config.moe_shared_expert_intermediate_size:
            gate, up = state[src + "shared_experts.dense_h_to_4h.weight"].chunk(2)
            out[dst + "shared_expert.gate_proj.weight"] = gate
            out[dst + "shared_expert.up_proj.weight"] = up
            out.update({dst + theirs: state[src + ours] for ours, theirs in _SHARED.items()})
    return {k: v.contiguous() for k, v in out.items()}


def deepseek_moe_block_state(state: dict[str, torch.Tensor], num_experts: int
                             ) -> dict[str, torch.Tensor]:
    """transformers' DeepseekV3MoE state dict from one megalite MoE layer's full state dict
    (names relative to the layer: router with expert bias, per-expert weights, shared
    expert): the block-level mapping of the DeepSeek-V3 family."""
    gate, up = state["shared_experts.dense_h_to_4h.weight"].chunk(2)
    return {
        "gate.weight": state["router.weight"],
        "gate.e_score_correction_bias": state["router.expert_bias"],
        "experts.gate_up_proj": torch.stack([state[f"local_experts.{e}.dense_h_to_4h.weight"]
                                             for e in range(num_experts)]),
        "experts.down_proj": torch.stack([state[f"local_experts.{e}.dense_4h_to_h.weight"]
                                          for e in range(num_experts)]),
        "shared_experts.gate_proj.weight": gate, "shared_experts.up_proj.weight": up,
        "shared_experts.down_proj.weight": state["shared_experts.dense_4h_to_h.weight"]}


def _exports(shared: bool):
    """Whether a megalite config is an MoE Llama without q/k norms, with a shared expert
    (Qwen2-MoE) or without (Mixtral)."""
    return lambda c: c.causal and c.num_experts is not None and not c.multi_latent_attention \
        and not c.qk_layernorm and (c.moe_shared_expert_intermediate_size is not None) == shared


MIXTRAL = Family(
    name="mixtral", model_types=("mixtral",), hf_class="MixtralForCausalLM", from_hf=moe_config,
    to_hf=to_moe_config, state_from_hf=moe_to_megalite, state_to_hf=megalite_to_moe,
    exports=_exports(shared=False))
QWEN2_MOE = Family(
    name="qwen2_moe", model_types=("qwen2_moe",), hf_class="Qwen2MoeForCausalLM",
    from_hf=moe_config, to_hf=to_moe_config, state_from_hf=moe_to_megalite,
    state_to_hf=megalite_to_moe, exports=_exports(shared=True))
