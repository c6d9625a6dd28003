"""Attention restricted to the documents of packed sequences (Megatron's --reset-attention-mask).

A token attends to the tokens of its own document up to itself. `DocumentMask` carries the
document id of every token of the whole sequence, [b, s] (also under context parallelism,
where a CP rank holds s/cp of the queries). Without CP the attention core builds from it,
once per microbatch, one boolean [b, 1, s, s] mask that every head and layer shares and
SDPA takes; ring attention masks each of its blocks from the ids of the block's positions.
(FlexAttention's block mask has no backward on the CPU in torch 2.13, and per-document
SDPA calls need the boundaries on the host: docs/performance.md "Packing and the document
mask" has the figures.)
"""
import functools
from dataclasses import dataclass

import torch


@dataclass(eq=False)
class DocumentMask:
    """document_ids [b, s] (int): equal ids = one document; ids never repeat after a change."""

    document_ids: torch.Tensor

    def block(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        """[b, 1, len(q), len(k)] bool, True = attend: same document and key not after query."""
        ids = self.document_ids
        same = ids[:, q_positions, None] == ids[:, None, k_positions]
        return (same & (q_positions[:, None] >= k_positions[None, :])).unsqueeze(1)

    @functools.cached_property
    def dense(self) -> torch.Tensor:
        """[b, 1, s, s] bool over the whole sequence, built once."""
        positions = torch.arange(self.document_ids.shape[1], device=self.document_ids.device)
        return self.block(positions, positions)
