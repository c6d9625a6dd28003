"""Top-k router: scores over E experts, the chosen k per token, and the auxiliary losses.

Ties between equal scores go to the lower expert index (a stable sort), so the choice is
deterministic on every device and every EP rank computes the same routing.
"""
import torch
import torch.nn.functional as F
from torch import nn

from megalite.mpu.layers import init_method_normal, set_tensor_model_parallel_attributes

SCORE_FUNCTIONS = ("softmax", "sigmoid")


def topk_routing(logits: torch.Tensor, topk: int, score_function: str = "softmax",
                 renormalize: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k], expert indices [T, k], scores [T, E]), fp32.

    softmax: scores = softmax(logits); sigmoid: scores = sigmoid(logits). The weights are the
    top-k scores, divided by their sum when `renormalize` (Mixtral; softmax + renormalize
    equals a softmax over the top-k logits).
    """
    logits = logits.float()
    scores = logits.softmax(-1) if score_function == "softmax" else logits.sigmoid()
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :topk]
    weights = scores.gather(-1, order)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, order, scores


def tokens_per_expert(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Expert indices [T, k] -> how many of the T * k choices went to each expert [E].

    A scatter-add, not bincount: bincount reads the indices' range on the host (two device
    syncs on GPUs)."""
    flat = indices.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


def load_balancing_loss(scores: torch.Tensor, indices: torch.Tensor, topk: int) -> torch.Tensor:
    """Switch/GShard loss E * sum_e f_e * P_e (1.0 for perfectly uniform routing).

    f_e: share of the T * k choices routed to e; P_e: mean over tokens of e's score (sigmoid
    scores are normalised to sum to 1 per token first). Gradient flows through P only.
    """
    num_tokens, num_experts = scores.shape
    probs = scores / scores.sum(-1, keepdim=True)
    share = tokens_per_expert(indices, num_experts).to(probs.dtype) / (num_tokens * topk)
    return num_experts * (share * probs.mean(0)).sum()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Router z-loss (ST-MoE): mean over tokens of logsumexp(logits)^2. logits [T, E]."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


class TopKRouter(nn.Module):
    """Linear h -> E (no bias, replicated on every TP rank) and top-k routing.

    forward(x [T, h]) -> (weights [T, k], indices [T, k], scores [T, E], logits [T, E]).
    """

    def __init__(self, hidden_size: int, num_experts: int, topk: int,
                 score_function: str = "softmax", renormalize: bool = False,
                 init_std: float = 0.02, params_dtype: torch.dtype = torch.float32,
                 device=None) -> None:
        super().__init__()
        if score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"--moe-router-score-function {score_function!r} is not one of "
                             f"{SCORE_FUNCTIONS}")
        if not 1 <= topk <= num_experts:
            raise ValueError(f"--moe-router-topk ({topk}) must be between 1 and --num-experts "
                             f"({num_experts})")
        self.topk, self.score_function, self.renormalize = topk, score_function, renormalize
        weight = torch.empty(num_experts, hidden_size, dtype=torch.float32)
        init_method_normal(init_std)(weight)
        self.weight = nn.Parameter(weight.to(device=device, dtype=params_dtype))
        set_tensor_model_parallel_attributes(self.weight, False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = F.linear(x, self.weight)
        weights, indices, scores = topk_routing(logits, self.topk, self.score_function,
                                                self.renormalize)
        return weights, indices, scores, logits
