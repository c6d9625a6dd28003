"""Model-parallel unit: process groups, tensor-parallel layers (linear, embedding, attention,
MLP), RNG and checkpoint. Generic: plain arguments, no model config."""
from megalite.mpu.attention import ParallelAttention
from megalite.mpu.cross_entropy import vocab_parallel_cross_entropy
from megalite.mpu.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                 pad_vocab_size)
from megalite.mpu.mappings import (copy_to_tensor_model_parallel_region,
                                   gather_from_tensor_model_parallel_region,
                                   reduce_from_tensor_model_parallel_region,
                                   scatter_to_tensor_model_parallel_region)
from megalite.mpu.mlp import ParallelMLP
from megalite.mpu.parallel_state import (destroy_model_parallel, initialize_model_parallel,
                                         model_parallel_is_initialized)
from megalite.mpu.random import checkpoint, get_rng_tracker, model_parallel_seed

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "pad_vocab_size",
    "vocab_parallel_cross_entropy", "copy_to_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region", "scatter_to_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region", "initialize_model_parallel",
    "destroy_model_parallel", "model_parallel_is_initialized", "checkpoint", "get_rng_tracker",
    "model_parallel_seed", "ParallelAttention", "ParallelMLP",
]
