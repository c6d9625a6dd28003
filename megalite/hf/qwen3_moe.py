"""Hugging Face Qwen3-MoE <-> megalite GPT with the Llama spec, per-head q/k RMSNorm and MoE.

Attention and norms as Qwen3 (megalite.hf.qwen3), experts and router as Mixtral
(megalite.hf.moe: softmax top-k, renormalised when norm_topk_prob, no shared expert, fused
gate_up_proj / down_proj per layer). A layer is MoE unless it is in `mlp_only_layers` or
(its index + 1) is not a multiple of `decoder_sparse_step`: megalite's --moe-layer-freq
pattern; the other layers have a dense SwiGLU MLP of `intermediate_size`. The exported config
lists the dense layers in `mlp_only_layers` with decoder_sparse_step 1.
"""
import dataclasses

from megalite.config import ModelConfig
from megalite.hf.family import Family
from megalite.hf.moe import megalite_to_moe, moe_to_megalite, routing_problems
from megalite.hf.qwen3 import qwen3_config, qwen3_config_fields


def qwen3_moe_config(hf_config) -> ModelConfig:
    """megalite ModelConfig equal to a transformers Qwen3MoeConfig."""
    layers, step = hf_config.num_hidden_layers, hf_config.decoder_sparse_step
    pattern = [int(i not in hf_config.mlp_only_layers and (i + 1) % step == 0)
               for i in range(layers)]
    if not hf_config.num_experts or not any(pattern):
        raise ValueError(f"unsupported Qwen3-MoE config: no MoE layer (num_experts "
                         f"{hf_config.num_experts}, decoder_sparse_step {step}, mlp_only_layers "
                         f"{hf_config.mlp_only_layers}); a dense model converts as qwen3")
    return dataclasses.replace(
        qwen3_config(hf_config), num_experts=hf_config.num_experts,
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_ffn_hidden_size=hf_config.moe_intermediate_size,
        moe_router_topk_renorm=hf_config.norm_topk_prob,
        moe_layer_freq=1 if all(pattern) else str(pattern).replace(" ", ""),
        moe_aux_loss_coeff=hf_config.router_aux_loss_coef if hf_config.output_router_logits
        else 0.0)


def to_qwen3_moe_config(config: ModelConfig):
    """transformers Qwen3MoeConfig equal to a megalite config (inverse of qwen3_moe_config)."""
    from transformers import Qwen3MoeConfig
    problems = routing_problems(config)
    if config.moe_shared_expert_intermediate_size is not None:
        problems.append("no --moe-shared-expert-intermediate-size")
    if problems:
        raise ValueError(f"not a Qwen3-MoE config: needs {', '.join(problems)}")
    return Qwen3MoeConfig(
        **qwen3_config_fields(config, "Qwen3-MoE"),
        moe_intermediate_size=config.moe_ffn_hidden_size, num_experts=config.num_experts,
        num_experts_per_tok=config.moe_router_topk, norm_topk_prob=config.moe_router_topk_renorm,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i, moe in enumerate(config.moe_layers) if not moe],
        router_aux_loss_coef=config.moe_aux_loss_coeff,
        output_router_logits=config.moe_aux_loss_coeff > 0)


QWEN3_MOE = Family(
    name="qwen3_moe", model_types=("qwen3_moe",), hf_class="Qwen3MoeForCausalLM",
    from_hf=qwen3_moe_config, to_hf=to_qwen3_moe_config, state_from_hf=moe_to_megalite,
    state_to_hf=megalite_to_moe,
    exports=lambda c: c.causal and c.qk_layernorm and c.num_experts is not None
    and not c.multi_latent_attention)
