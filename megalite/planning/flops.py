"""Model FLOPs per iteration (Megatron's formula), for the planner and the logged TFLOP/s."""
from collections.abc import Sequence

from megalite.config import ModelConfig
from megalite.models.spec import TransformerSpec


def flops_per_iteration(config: ModelConfig, global_batch: int, seq_length: int,
                        padded_vocab: int, layer_shares: Sequence[float] | None = None) -> float:
    """Megatron-LM's training FLOPs per iteration (Narayanan et al. 2021, appendix), from the
    model's spec so GQA's smaller K/V, SwiGLU's third matrix and other widths count:
    3 x forward (4 x for the layers with full recompute); MoE layers count the active
    weights (router, k experts, shared expert). For GPT-2 shapes this is
    72 B s L h^2 (1 + s/(6h) + V/(12 L h)), and 96 B s L h^2 (1 + s/(6h) + V/(16 L h)).
    Each multi-token prediction depth adds 3 x (its layer, eh_proj [h, 2h] and the output
    layer) (not recomputed). `layer_shares`: per layer, the share of the batch it ran on
    (progressive layer dropping; default all 1).
    """
    spec = TransformerSpec.from_config(config)
    layer_passes = 4 if config.recompute_granularity == "full" else 3
    h = config.hidden_size
    mtp = sum(spec.layer_forward_flops(seq_length, layer) + 2 * 2 * h * h
              for layer in spec.mtp_layers(config.num_layers))
    shares = [1.0] * config.num_layers if layer_shares is None else layer_shares
    per_token = (layer_passes * sum(spec.layer_forward_flops(seq_length, layer) * shares[layer]
                                    for layer in range(config.num_layers))
                 + 3 * (1 + spec.mtp_num_layers) * spec.output_forward_flops(padded_vocab)
                 + 3 * mtp)
    return global_batch * seq_length * per_token
