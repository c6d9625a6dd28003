"""Multi-head latent attention vs grouped-query attention at equal parameter count: decode
speed and KV-cache bytes per token, one process, greedy, fp32.

  python benchmarks/bench_mla.py [--batch-sizes 1 8] [--prompt-len 128] [--new-tokens 32]

Both are megalite GPT models (RMSNorm, RoPE, SwiGLU) of --layers x --hidden with --heads
heads. GQA: --groups KV groups of head dim hidden / heads. MLA: latent --kv-lora-rank, RoPE
key --rope-dim, no-RoPE q/k dim --qk-dim, value dim hidden / heads, and the query compression
rank chosen so that the attention has the GQA attention's parameter count (printed). The
MLA cache holds the latent and the RoPE key per layer, attended with W_uk absorbed into the
query (no expansion of the cached positions). Decode tokens/s: new tokens after the first
over their time, best of --repeats.
"""

import torch
from common import benchmark_parser, machine_line

from megalite.config import ModelConfig
from megalite.device import current_device, init_distributed
from megalite.inference import SamplingParams, generate
from megalite.inference.generation import GenerationStats
from megalite.models import GPTModel
from megalite.models.spec import TransformerSpec
from megalite.mpu import initialize_model_parallel


def configs(args) -> dict[str, ModelConfig]:
    """GQA and MLA configs whose attention parameter counts agree (the MLA query rank
    solved for it)."""
    common = dict(num_layers=args.layers, hidden_size=args.hidden,
                  num_attention_heads=args.heads, vocab_size=args.vocab,
                  max_position_embeddings=args.prompt_len + args.new_tokens,
                  normalization="RMSNorm", norm_epsilon=1e-6, position_embedding_type="rope",
                  swiglu=True, disable_bias_linear=True, hidden_dropout=0.0,
                  attention_dropout=0.0)
    gqa = ModelConfig(**common, group_query_attention=True, num_query_groups=args.groups)
    head = args.hidden // args.heads
    mla = dict(multi_latent_attention=True, kv_lora_rank=args.kv_lora_rank,
               qk_head_dim=args.qk_dim, qk_pos_emb_head_dim=args.rope_dim, v_head_dim=head)
    target = attention_params(gqa)
    rest = attention_params(ModelConfig(**common, **mla, q_lora_rank=1))
    per_rank = args.hidden + 1 + args.heads * (args.qk_dim + args.rope_dim)
    rank = 1 + round((target - rest) / per_rank)
    return {"GQA": gqa, "MLA": ModelConfig(**common, **mla, q_lora_rank=rank)}


def attention_params(config: ModelConfig) -> int:
    spec = TransformerSpec.from_config(config)
    return spec.layer_params() - spec.mlp_params() - 2 * spec.norm_params(config.hidden_size)


def decode(models: list, prompts: list[list[int]], new: int, repeats: int
           ) -> list[tuple[float, int]]:
    """Per model: (decode tokens/s, best of `repeats`; KV-cache bytes per token). The models
    take turns, so a busy machine slows them alike."""
    best, cache = [0.0] * len(models), [0] * len(models)
    for _ in range(repeats):
        for i, model in enumerate(models):
            stats = GenerationStats()
            generate(model, prompts, SamplingParams(new), stats=stats)
            best[i] = max(best[i], (stats.new_tokens - len(prompts)) / stats.decode_s)
            cache[i] = stats.kv_cache_bytes_per_token
    return list(zip(best, cache))


def main() -> None:
    parser = benchmark_parser(__doc__, repeats=3, batch_sizes=[1, 8], prompt_len=128,
                              new_tokens=32)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--kv-lora-rank", type=int, default=128)
    parser.add_argument("--qk-dim", type=int, default=48)
    parser.add_argument("--rope-dim", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=8000)
    args = parser.parse_args()
    print(machine_line())
    init_distributed()
    initialize_model_parallel(1, 1)
    models = {}
    for name, config in configs(args).items():
        model = GPTModel(config, device=current_device()).eval()
        models[name] = model, sum(p.numel() for p in model.parameters()), \
            attention_params(config)
    print(f"device {current_device()}, {torch.get_num_threads()} threads, {args.layers} layers, "
          f"hidden {args.hidden}, {args.heads} heads, prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, greedy, fp32; MLA q rank "
          f"{models['MLA'][0].config.q_lora_rank}")
    print(f"{'attention':>9} {'params':>10} {'attn params':>11} {'batch':>5} | "
          f"{'KV bytes/token':>14} | {'decode tok/s':>12}")
    for batch in args.batch_sizes:
        prompts = torch.randint(0, args.vocab, (batch, args.prompt_len),
                                generator=torch.Generator().manual_seed(batch)).tolist()
        results = decode([model for model, _, _ in models.values()], prompts,
                         args.new_tokens, args.repeats)
        for (name, (_, params, attention)), (rate, cache_bytes) in zip(models.items(), results):
            print(f"{name:>9} {params:>10,} {attention:>11,} {batch:>5} | "
                  f"{cache_bytes:>14,} | {rate:>12.1f}", flush=True)


if __name__ == "__main__":
    main()
