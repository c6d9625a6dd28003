"""Context parallelism's data layout: which tokens of a sequence each CP rank holds.

A sequence of s tokens is cut into 2 cp chunks of s / (2 cp); CP rank r holds chunks r and
2 cp - 1 - r (in that order), so under a causal mask every rank attends to the same number
of earlier tokens (Megatron's load balancing). Inputs, labels and positions are sliced the
same way; everything per token (loss, norms, MLP) is unchanged, attention is ring
attention (megalite.mpu.ring_attention).
"""
import torch

from megalite.mpu import parallel_state


def chunk_positions(seq_length: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions [s / cp] held by CP rank `rank`: chunks rank and 2 cp - 1 - rank."""
    assert seq_length % (2 * cp) == 0, "the run layout checks --seq-length against 2 x CP"
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
