"""An explicit mixture-of-experts reference: per-token Python loops over full weights.

Written from the definitions (not from megalite.moe): scores, top-k with ties to the lower
index, renormalisation, first-come capacity per expert, the load-balancing and z losses.
"""
import math

import torch
import torch.nn.functional as F


def route(logits: torch.Tensor, topk: int, score: str, renorm: bool):
    """logits [T, E] -> per token a list of (expert, weight), and the scores [T, E]."""
    scores = logits.softmax(-1) if score == "softmax" else logits.sigmoid()
    choices = []
    for t in range(logits.shape[0]):
        ranked = sorted(range(logits.shape[1]), key=lambda e: (-scores[t, e].item(), e))[:topk]
        weights = [scores[t, e] for e in ranked]
        if renorm:
            total = sum(weights)
            weights = [w / total for w in weights]
        choices.append(list(zip(ranked, weights)))
    return choices, scores


def group_limited_choice(choice: torch.Tensor, topk: int, num_groups: int, group_topk: int
                         ) -> list[list[int]]:
    """DeepSeek-V3's choice from biased scores [T, E] (fp32): per token the `topk` largest of
    the experts in its `group_topk` best groups (group score: the fp32 sum of its two
    largest), largest first; ties to the lower index (group), NaN above everything."""
    def rank(values: list[float]) -> list[int]:  # indices, largest first, stable, NaN first
        return sorted(range(len(values)), key=lambda i: (not math.isnan(values[i]),
                      -values[i] if not math.isnan(values[i]) else 0.0))
    chosen = []
    for row in choice.tolist():
        size = len(row) // num_groups
        groups = [row[g * size:(g + 1) * size] for g in range(num_groups)]
        group_scores = [float(torch.tensor([group[i] for i in rank(group)[:2]]).sum())
                        for group in groups]
        kept = set(rank(group_scores)[:group_topk])
        masked = [v if e // size in kept else -math.inf for e, v in enumerate(row)]
        chosen.append(rank(masked)[:topk])
    return chosen


def aux_loss(scores: torch.Tensor, choices: list, topk: int) -> torch.Tensor:
    """E * sum_e (choices to e / (T k)) * mean_t p_te, p = scores normalised per token."""
    tokens, experts = scores.shape
    probs = scores / scores.sum(-1, keepdim=True)
    counts = [sum(e == c for row in choices for c, _ in row) for e in range(experts)]
    return experts * sum(counts[e] / (tokens * topk) * probs[:, e].mean() for e in range(experts))


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    return sum(torch.log(torch.exp(row).sum()) ** 2 for row in logits) / logits.shape[0]


def expert_mlp(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor) -> torch.Tensor:
    """SwiGLU expert: w_in [2 ffn, h] = [gate; up], w_out [h, ffn]."""
    gate, up = w_in.chunk(2)
    return (F.silu(x @ gate.t()) * (x @ up.t())) @ w_out.t()


def moe_forward(x: torch.Tensor, weights: dict, topk: int, score: str = "softmax",
                renorm: bool = False, capacity_factor: float | None = None):
    """x [T, h] -> (out [T, h], aux loss, z loss, dropped choices). `weights`: router [E, h],
    experts: list of (w_in, w_out), optional shared (w_in, w_out) and shared_gate [1, h]."""
    logits = x @ weights["router"].t()
    choices, scores = route(logits, topk, score, renorm)
    experts = len(weights["experts"])
    capacity = math.ceil(x.shape[0] * topk / experts * capacity_factor) if capacity_factor \
        else None
    taken, dropped, rows = [0] * experts, 0, []
    for t, row in enumerate(choices):
        out = torch.zeros_like(x[t])
        for e, w in row:
            if capacity is not None and taken[e] >= capacity:
                dropped += 1
                continue
            taken[e] += 1
            out = out + w * expert_mlp(x[t:t + 1], *weights["experts"][e])[0]
        rows.append(out)
    out = torch.stack(rows)
    if "shared" in weights:
        shared = expert_mlp(x, *weights["shared"])
        if "shared_gate" in weights:
            shared = torch.sigmoid(x @ weights["shared_gate"].t()) * shared
        out = out + shared
    return out, aux_loss(scores, choices, topk), z_loss(logits), dropped
