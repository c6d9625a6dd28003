"""Choosing the next token from the last position's logits: greedy, temperature, top-k, top-p.

The processing order is that of `transformers` (temperature, then top-k, then top-p). Under
TP the logits are vocab-parallel [b, V/tp]: greedy takes a local max and gathers one (value,
index) pair per row and rank; sampling gathers the [b, V] logits of the last position only.
"""
from dataclasses import dataclass

import torch

from megalite.mpu import comm


@dataclass
class SamplingParams:
    """How to pick tokens. temperature 0 = greedy; top_k 0 and top_p 1 = no cut."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def validate(self) -> None:
        """One ValueError naming the first field out of range."""
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int = 0,
                  top_p: float = 1.0) -> torch.Tensor:
    """logits [b, V] -> logits / temperature with the tokens outside the top-k, then outside
    the smallest set whose probability reaches top_p, set to -inf (never fewer than one)."""
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Full logits [b, V] -> next tokens [b] (int64)."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits, params.temperature, params.top_k, params.top_p).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def tensor_parallel_argmax(local_logits: torch.Tensor, vocab_start: int, group) -> torch.Tensor:
    """Vocab-parallel logits [b, V/tp] -> global argmax [b] (first index on ties), gathering
    [b, 2] per rank on the TP group."""
    values, index = local_logits.float().max(dim=-1)
    if comm.world_size(group) == 1:
        return index
    pairs = comm.all_gather_stacked(torch.stack([values, (index + vocab_start).float()], -1),
                                    group)  # [tp, b, 2]; ranks in vocab order
    best_rank = pairs[..., 0].argmax(dim=0)  # first rank holding the max
    return pairs[..., 1].gather(0, best_rank.unsqueeze(0)).squeeze(0).long()


def next_tokens(local_logits: torch.Tensor, params: SamplingParams, vocab_size: int,
                vocab_start: int, group, generator: torch.Generator | None = None
                ) -> torch.Tensor:
    """Vocab-parallel logits of the last position [b, V_padded/tp] -> next tokens [b], the same
    on every rank of the TP `group` (sampling uses the same seeded generator on each)."""
    if params.greedy:
        return tensor_parallel_argmax(local_logits, vocab_start, group)
    full = comm.all_gather_last_dim(local_logits, group)[..., :vocab_size]
    return sample(full, params, generator)
