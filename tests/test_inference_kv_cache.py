"""KV-cached decoding vs recomputing the whole sequence without a cache.

A batch of three prompts of different lengths (left-padded) is prefilled, then six forced
tokens are decoded one at a time with the cache. At every step each row's next-token
logits must equal those of that row alone (no padding, no mask, no cache) recomputed over
its whole sequence so far: GPT-2, Llama (RMSNorm, RoPE, SwiGLU, GQA, untied), Qwen3 (Llama
with per-head q/k norms, head dim 12) and a DeepSeek-V3
style MoE (dense first layer, sigmoid group-limited routing, grouped experts, shared expert)
specs, at TP 1, TP 2 and PP 2 on two ranks, fp32, within 1e-5 relative.
"""
import torch

from megalite.config import ModelConfig
from megalite.device import current_device
from megalite.inference.generation import BatchDecoder, pipeline_forward
from megalite.models import GPTModel
from megalite.mpu import initialize_model_parallel, model_parallel_seed
from megalite.mpu import parallel_state as ps
from tests.helpers.multirank import run_on_ranks
from tests.helpers.reference import rel_err

VOCAB, STEPS, LENGTHS = 101, 6, (5, 2, 7)
SPECS = {
    "gpt2": dict(),
    "llama": dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
                  group_query_attention=True, num_query_groups=2, disable_bias_linear=True,
                  untie_embeddings_and_output_weights=True),
    "qwen3": dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
                  group_query_attention=True, num_query_groups=2, disable_bias_linear=True,
                  kv_channels=12, qk_layernorm=True),
    "deepseek-moe": dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
                         disable_bias_linear=True, num_experts=8, moe_ffn_hidden_size=16,
                         moe_layer_freq="[0]+[1]", moe_router_score_function="sigmoid",
                         moe_router_topk_renorm=True, moe_router_num_groups=4,
                         moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5,
                         moe_router_enable_expert_bias=True, moe_grouped_gemm=True,
                         moe_shared_expert_intermediate_size=16),
}


def tiny_config(spec: str) -> ModelConfig:
    return ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                       max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0,
                       init_method_std=0.2, make_vocab_size_divisible_by=8, **SPECS[spec])


def _worst_error(spec: str, tp: int, pp: int) -> float | None:
    initialize_model_parallel(tp, pp)
    model_parallel_seed(0, ps.get_tensor_model_parallel_rank())
    model = GPTModel(tiny_config(spec), pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage(), init_seed=7,
                     device=current_device()).eval()
    data, dev = torch.Generator().manual_seed(1), current_device()
    prompts = [torch.randint(0, VOCAB, (n,), generator=data).tolist() for n in LENGTHS]
    forced = torch.randint(0, VOCAB, (STEPS, len(prompts)), generator=data).to(dev)
    decoder = BatchDecoder(model, prompts, max_new=STEPS, pad_id=3)
    cached = [decoder.prefill()] + [decoder.decode(forced[t]) for t in range(STEPS - 1)]
    errors = []
    for t, logits in enumerate(cached):
        for row, prompt in enumerate(prompts):
            seq = torch.tensor(prompt + forced[:t, row].tolist(), device=dev).unsqueeze(0)
            positions = torch.arange(seq.shape[1], device=dev).unsqueeze(0)
            full = pipeline_forward(model, seq, positions, None, None)
            if full is not None:
                real = full[0, -1].isfinite()  # not the vocabulary padding
                errors.append(rel_err(logits[row, real], full[0, -1, real]))
    return max(errors) if errors else None


def _all_layouts() -> dict:
    return {(spec, tp, pp): _worst_error(spec, tp, pp)
            for spec in SPECS for tp, pp in ((1, 1), (2, 1), (1, 2))}


def test_cached_decoding_matches_recompute_tp2_pp2():
    results = run_on_ranks(2, _all_layouts)
    checked = 0
    for per_rank in results:
        for key, error in per_rank.items():
            if error is not None:
                assert error < 1e-5, (key, error)
                checked += 1
    assert checked == len(SPECS) * (2 + 2 + 1)  # PP 2: only the last stage holds logits
    print("worst cached-vs-recompute error per (spec, tp, pp):", results[0])
