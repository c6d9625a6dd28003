"""Context parallelism's data layout: which tokens of a sequence each CP rank holds.

A sequence of s tokens is cut into 2 cp chunks of s / (2 cp); CP rank r holds chunks r and
2 cp - 1 - r (in that order), so under a causal mask every rank attends to the same number
of earlier tokens (Megatron's load balancing). Inputs, labels and positions are sliced the
same way; everything per token (loss, norms, MLP) is unchanged, attention is ring
attention (megalite.mpu.ring_attention).
"""
import torch

from megalite.mpu import parallel_state


def check_sequence_split(seq_length: int, tensor_model_parallel_size: int,
                         sequence_parallel: bool, context_parallel_size: int) -> None:
    """One clear ValueError when --seq-length cannot be split as asked (no collective)."""
    tp, cp = tensor_model_parallel_size, context_parallel_size
    if sequence_parallel and tp == 1:
        raise ValueError("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if cp > 1 and seq_length % (2 * cp):
        raise ValueError(f"--seq-length ({seq_length}) must be divisible by 2 x "
                         f"--context-parallel-size ({2 * cp}) (load-balanced chunks)")
    if sequence_parallel and (seq_length // cp) % tp:
        raise ValueError(f"--sequence-parallel: --seq-length ({seq_length}) / "
                         f"--context-parallel-size ({cp}) must be divisible by "
                         f"--tensor-model-parallel-size ({tp})")


def chunk_positions(seq_length: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions [s / cp] held by CP rank `rank`: chunks rank and 2 cp - 1 - rank."""
    check_sequence_split(seq_length, 1, False, cp)
    chunk = seq_length // (2 * cp)
    starts = (rank * chunk, (2 * cp - 1 - rank) * chunk)
    return torch.cat([torch.arange(s, s + chunk, device=device) for s in starts])


def get_batch_on_this_cp_rank(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Slice every [b, s] tensor (tokens, labels, masks) to this CP rank's [b, s / cp] and
    append the matching position_ids [1, s / cp]. Without CP: the tensors, then None."""
    cp = parallel_state.get_context_parallel_world_size()
    if cp == 1:
        return (*tensors, None)
    index = chunk_positions(tensors[0].shape[1], cp, parallel_state.get_context_parallel_rank(),
                            tensors[0].device)
    return (*(t.index_select(1, index) for t in tensors), index.unsqueeze(0))
