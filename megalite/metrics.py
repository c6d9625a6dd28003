"""Throughput accounting: model FLOPs per iteration (Megatron's formula) and peak memory."""
import resource
import sys

import torch

from megalite.config import ModelConfig


def flops_per_iteration(config: ModelConfig, global_batch: int, seq_length: int,
                        padded_vocab: int) -> float:
    """Megatron-LM's training FLOPs per iteration (Narayanan et al. 2021, appendix):

    72 B s L h^2 (1 + s/(6h) + V/(12 L h)), and 96 B s L h^2 (1 + s/(6h) + V/(16 L h)) with
    full recompute (one more forward). Assumes an MLP of 4h; other widths are scaled in.
    """
    b, s, layers, h, v = global_batch, seq_length, config.num_layers, config.hidden_size, \
        padded_vocab
    mlp = config.ffn_hidden_size / (4 * h)  # 1 for GPT-2 shapes
    dense = (4 + 8 * mlp) / 12  # attention projections 4h^2 + MLP 8h^2 per token, vs 12h^2
    if config.recompute_granularity == "full":
        return 96 * b * s * layers * h * h * (dense + s / (6 * h) + v / (16 * layers * h))
    return 72 * b * s * layers * h * h * (dense + s / (6 * h) + v / (12 * layers * h))


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated GPU memory, or the process's peak resident set on CPU, in MB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10
