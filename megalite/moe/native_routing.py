"""The router's top-k choice on the host (routing.c beside this file, built and loaded by
megalite.native): one pass over each token's scores where the torch ops sort them (twice with
expert groups) and run a dozen small kernels; fp32 CPU tensors only (CUDA keeps the torch
ops). Without a compiler `kernels()` is None after one warning and the router sorts."""
import ctypes
import functools
from pathlib import Path

import torch

from megalite.native import INT64, POINTER, check_host, load

SOURCE = Path(__file__).with_name("routing.c")
SIGNATURES = {"route": [POINTER, POINTER, INT64, INT64, INT64, INT64, INT64, POINTER]}


@functools.cache
def kernels() -> ctypes.CDLL | None:
    """routing.c's functions for this machine, built on first use; None where no C compiler
    builds them (one warning)."""
    return load(SOURCE, SIGNATURES, "the MoE router sorts with torch ops on the host")


def route(lib: ctypes.CDLL, scores: torch.Tensor, bias: torch.Tensor | None, topk: int,
          num_groups: int | None = None, group_topk: int | None = None) -> torch.Tensor:
    """scores [T, E] (fp32, contiguous), bias [E] or None -> the chosen experts [T, topk]
    (int64), as `megalite.moe.router.topk_routing` chooses them."""
    tokens, experts = scores.shape
    groups = num_groups or 1
    kept = group_topk or groups
    check_host("native_routing", experts % groups == 0 and 1 <= topk <= experts
               and 1 <= kept <= groups and (bias is None or bias.shape == (experts,)),
               scores=(scores, torch.float32), bias=(bias, torch.float32))
    order = torch.empty(tokens, topk, dtype=torch.int64)
    lib.route(scores.data_ptr(), None if bias is None else bias.data_ptr(), tokens, experts,
              groups, kept, topk, order.data_ptr())
    return order
