"""Top-k router: scores over E experts, the chosen k per token, and the auxiliary losses.

Ties between equal scores go to the lower expert index (a stable sort), so the choice is
deterministic on every device and every EP rank computes the same routing.
"""
import torch
import torch.nn.functional as F
from torch import nn

from megalite.moe import native_routing
from megalite.mpu.layers import init_method_normal, set_tensor_model_parallel_attributes

SCORE_FUNCTIONS = ("softmax", "sigmoid")


def topk_routing(logits: torch.Tensor, topk: int, score_function: str = "softmax",
                 renormalize: bool = False, expert_bias: torch.Tensor | None = None,
                 num_groups: int | None = None, group_topk: int | None = None,
                 scaling_factor: float | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k], expert indices [T, k], scores [T, E]), fp32.

    softmax: scores = softmax(logits); sigmoid: scores = sigmoid(logits). The choice ranks
    scores + `expert_bias` [E] (DeepSeek-V3's balancing bias: selection only); with
    `num_groups`, only the experts of the `group_topk` groups with the best sums of their top-2
    choice scores compete. The weights are the chosen experts' scores (bias-free), divided by
    their sum when `renormalize` (Mixtral; softmax + renormalize equals a softmax over the
    top-k logits), times `scaling_factor`. On the host the choice runs in C (native_routing),
    elsewhere as a stable sort.
    """
    logits = logits.float()
    scores = logits.softmax(-1) if score_function == "softmax" else logits.sigmoid()
    choice = scores.detach()  # selection only: no autograd graph
    lib = native_routing.kernels() if choice.device.type == "cpu" else None
    if lib is not None:
        bias = None if expert_bias is None else expert_bias.float()  # a bf16 model's buffer
        order = native_routing.route(lib, choice.contiguous(), bias, topk, num_groups,
                                     group_topk)
    else:
        order = _sorted_choice(choice, topk, expert_bias, num_groups, group_topk)
    weights = scores.gather(-1, order)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    if scaling_factor is not None:
        weights = weights * scaling_factor
    return weights, order, scores


def _sorted_choice(choice: torch.Tensor, topk: int, expert_bias: torch.Tensor | None,
                   num_groups: int | None, group_topk: int | None) -> torch.Tensor:
    """topk_routing's choice [T, k] by torch ops: a stable sort of each token's scores."""
    if expert_bias is not None:
        choice = choice + expert_bias
    if num_groups is not None:
        choice = _keep_best_groups(choice, num_groups, group_topk)
    return torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :topk]


def _keep_best_groups(choice: torch.Tensor, num_groups: int, group_topk: int) -> torch.Tensor:
    """choice [T, E] with -inf outside each token's `group_topk` best groups (group score: the
    sum of its top-2 entries; ties to the lower group)."""
    grouped = choice.view(choice.shape[0], num_groups, -1)
    best = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
    kept = torch.sort(best, dim=-1, descending=True, stable=True).indices[:, :group_topk]
    mask = torch.zeros_like(best, dtype=torch.bool).scatter_(1, kept, True)
    return grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view_as(choice)


def tokens_per_expert(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Expert indices [T, k] -> how many of the T * k choices went to each expert [E].

    A scatter-add, not bincount: bincount reads the indices' range on the host (two device
    syncs on GPUs)."""
    flat = indices.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


def sequence_counts(indices: torch.Tensor, num_experts: int, sequences: int = 1
                    ) -> torch.Tensor:
    """Expert indices [T, k] of tokens in [s, b] order -> choices per expert of each of the
    `sequences` (b) sequences [b, E]; `sequences` 1: of all T tokens [1, E]."""
    num_tokens, topk = indices.shape
    sequence = torch.arange(num_tokens, device=indices.device) % sequences
    flat = (sequence.unsqueeze(-1) * num_experts + indices).reshape(-1)
    counts = torch.zeros(sequences * num_experts, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat)).view(sequences, num_experts)


def load_balancing_loss(scores: torch.Tensor, indices: torch.Tensor, topk: int,
                        sequences: int = 1, counts: torch.Tensor | None = None,
                        shards: int = 1) -> torch.Tensor:
    """Switch/GShard loss E * sum_e f_e * P_e (1.0 for perfectly uniform routing), averaged
    over `sequences` (b, tokens in [s, b] order: DeepSeek-V3's sequence-wise loss; 1: over
    the whole microbatch).

    f_e: share of a sequence's choices routed to e; P_e: mean over its tokens of e's score
    (sigmoid scores are normalised to sum to 1 per token first). Gradient flows through P
    only. When the sequences are split over `shards` ranks (SP, CP), `counts` [b, E] are
    the choices of all shards (`sequence_counts` summed over them) and P is this rank's: the
    mean of the result over the shards is the loss of the whole sequences.
    """
    num_tokens, num_experts = scores.shape
    if counts is None:
        counts = sequence_counts(indices, num_experts, sequences)
    probs = scores / scores.sum(-1, keepdim=True)
    share = counts.to(probs.dtype) / (num_tokens // sequences * shards * topk)
    mean_probs = probs.view(-1, sequences, num_experts).mean(0)
    return num_experts * (share * mean_probs).sum(-1).mean()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Router z-loss (ST-MoE): mean over tokens of logsumexp(logits)^2. logits [T, E]."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


class TopKRouter(nn.Module):
    """Linear h -> E (no bias, replicated on every TP rank) and top-k routing (see
    `topk_routing`); with `expert_bias`, the fp32 buffer `expert_bias` [E] (zeros; moved by
    `megalite.moe.balancing.update_expert_bias` after each step, saved in checkpoints).

    forward(x [T, h]) -> (weights [T, k], indices [T, k], scores [T, E], logits [T, E]).
    """

    def __init__(self, hidden_size: int, num_experts: int, topk: int,
                 score_function: str = "softmax", renormalize: bool = False,
                 init_std: float = 0.02, params_dtype: torch.dtype = torch.float32,
                 device=None, expert_bias: bool = False, num_groups: int | None = None,
                 group_topk: int | None = None, scaling_factor: float | None = None) -> None:
        super().__init__()
        if score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"--moe-router-score-function {score_function!r} is not one of "
                             f"{SCORE_FUNCTIONS}")
        if not 1 <= topk <= num_experts:
            raise ValueError(f"--moe-router-topk ({topk}) must be between 1 and --num-experts "
                             f"({num_experts})")
        self.topk, self.score_function, self.renormalize = topk, score_function, renormalize
        self.num_groups, self.group_topk = num_groups, group_topk
        self.scaling_factor = scaling_factor
        self.register_buffer("expert_bias", torch.zeros(num_experts, device=device)
                             if expert_bias else None)
        weight = torch.empty(num_experts, hidden_size, dtype=torch.float32)
        init_method_normal(init_std)(weight)
        self.weight = nn.Parameter(weight.to(device=device, dtype=params_dtype))
        set_tensor_model_parallel_attributes(self.weight, False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = F.linear(x, self.weight)
        weights, indices, scores = topk_routing(
            logits, self.topk, self.score_function, self.renormalize, self.expert_bias,
            self.num_groups, self.group_topk, self.scaling_factor)
        return weights, indices, scores, logits
