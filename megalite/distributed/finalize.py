"""Gradient finalisation after the backward of a step: DP reduction of every chunk's buckets,
TP-partial grads (layer norms under SP, replicated down-projections), the tied embedding's
grads over the embedding group (first and last pipeline stage) and vocabulary padding.
"""
import torch
from torch import nn

from megalite.models.stage import shared_embedding_params
from megalite.mpu import comm, parallel_state
from megalite.mpu.layers import allreduce_tp_partial_grads, zero_vocab_padding_grads


@torch.no_grad()
def sync_shared_embedding(model: nn.Module | list[nn.Module]) -> None:
    """Copy the first stage's word embedding to the last stage (broadcast on the embedding
    group, or a local copy when this rank holds both, as rank 0 in V placement)."""
    weights = shared_embedding_params(model)
    if len(weights) == 2:
        weights[1].copy_(weights[0])
        return
    for weight in weights:
        comm.broadcast(weight.data, parallel_state.get_embedding_ranks()[0],
                       parallel_state.get_embedding_group())



def allreduce_shared_embedding_grads(model: nn.Module | list[nn.Module]) -> None:
    """Sum the tied embedding's grad over first and last stage (embedding group, or locally
    when this rank holds both)."""
    grads = [weight.main_grad if hasattr(weight, "main_grad") else weight.grad
             for weight in shared_embedding_params(model)]
    if len(grads) == 2:
        total = grads[0] + grads[1]
        for grad in grads:
            grad.copy_(total)
        return
    for grad in grads:
        if grad is not None:
            comm.all_reduce(grad, parallel_state.get_embedding_group())



def finalize_model_grads(model: list[nn.Module]) -> None:
    """Make every grad final after the last backward of a step (Megatron's name): finish the
    data-parallel reduction of wrapped chunks, sum the grads that TP ranks hold only in part
    (KV groups replicated for GQA; TP group), and the tied embedding's (embedding group);
    zero the vocabulary padding rows' grads."""
    for chunk in model:
        if hasattr(chunk, "finish_grad_sync"):
            chunk.finish_grad_sync()
    params = [p for chunk in model for p in chunk.parameters()]
    allreduce_tp_partial_grads(params)
    allreduce_shared_embedding_grads(model)
    zero_vocab_padding_grads(params)
