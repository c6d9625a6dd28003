"""Gradient reducers: how a DP bucket's flat fp32 grads travel over its data-parallel group.

A bucket of megalite's grad buffer (megalite.distributed.grad_buffer) owns one reducer. It
divides its flat grads for the DP mean, calls `start(flat, group)` as soon as its last grad
lands (overlap_grad_reduce) or at `finish_grad_sync`, and `wait(handle)` at
`finish_grad_sync`; a group of one rank skips both. After `wait` the flat grads hold the sum
over the group, of every element, or, for a `sharded` bucket (the distributed optimizer's),
at least of this rank's 1/n of them (group rank r: elements [r n/size, (r + 1) n/size)).

The defaults are an all-reduce and, for sharded buckets, a reduce-scatter, both async and
counted by megalite.mpu.comm. An optimizer kind replaces them through its `reducer` field
(megalite.optimizer.kinds), a `ReducerFactory`: a compressed all-reduce with error feedback
is one new GradReducer subclass (its per-bucket state lives on the instance). FSDP2's
strategies reduce-scatter inside torch and have no buckets.
"""
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
import torch.distributed as dist

from megalite.mpu import comm


class GradReducer(ABC):
    """Reduces one bucket's flat fp32 grads [n] in place over a DP group (n divisible by the
    group's size for sharded buckets)."""

    @abstractmethod
    def start(self, flat: torch.Tensor, group) -> object:
        """Launch the reduction of `flat` over `group` (async where it can); return a handle
        for `wait` (None: already done)."""

    def wait(self, handle: object) -> None:
        """Block until the reduction `start` returned `handle` for is complete."""
        if handle is not None:
            handle.wait()

    def set_tensor_sizes(self, sizes: list[int]) -> None:
        """Told once by its bucket: the element counts of the tensors its flat grads
        concatenate, in order (any rest is padding); a per-tensor reduction keeps them."""

    def state_dict(self) -> dict:
        """State carried from step to step (error buffers; checkpointed per rank): none."""
        return {}

    def load_state_dict(self, state: dict, group) -> None:
        """Restore `state_dict()` of the same bucket under the same layout."""

    def restart(self, steps: int, optimizer_state: Callable[[str], torch.Tensor]) -> None:
        """Continue at step `steps` of a checkpoint saved under another layout, whose own
        state is lost; `optimizer_state(key)` gives the optimizer's loaded per-element state
        `key` (e.g. "exp_avg") as this bucket's flat [n] (a collective over its group)."""

    def stage_bytes(self, n: int, world: int) -> dict[str, int]:
        """Payload bytes (megalite.mpu.comm's count) one reduction of n fp32 elements over
        `world` ranks sends, per stage of the reducer (one stage, "": 4 n)."""
        return {"": 4 * n}

    def stage(self) -> str:
        """The stage the next reduction is in (a key of `stage_bytes`)."""
        return ""


class AllReduce(GradReducer):
    """Sum over the group into every element (no_shard; tied-embedding buckets)."""

    def start(self, flat: torch.Tensor, group) -> object:
        return comm.all_reduce(flat, group, async_op=True)


class ReduceScatter(GradReducer):
    """Sum over the group into this rank's 1/size of `flat` (the distributed optimizer steps
    that shard); the other elements keep this rank's own values, or, on the CPU, hold the
    sum too: there it all-reduces, since gloo's reduce-scatter takes 1.2-2x its all-reduce
    of the same tensor (0.5-7M fp32 elements over 2 ranks, docs/performance.md)."""

    def start(self, flat: torch.Tensor, group) -> object:
        if flat.device.type == "cpu":
            return comm.all_reduce(flat, group, async_op=True)
        n, rank = flat.numel() // comm.world_size(group), dist.get_rank(group)
        return comm.reduce_scatter(flat[rank * n:(rank + 1) * n], flat, group, async_op=True)


ReducerFactory = Callable[[bool], GradReducer]  # (bucket is sharded) -> that bucket's reducer


def default_reducer(sharded: bool) -> GradReducer:
    """A reduce-scatter for a sharded bucket, else an all-reduce."""
    return ReduceScatter() if sharded else AllReduce()
