"""PipeDream-2BW's two weight versions per parameter (Narayanan et al., ICML 2021).

Step t's microbatches run forward and backward on the previous weights W(t-1) while the
optimizer moves the current ones, W(t+1) = W(t) - lr * grad f(W(t-1)) (W(-1) = W(0)), so the
next step's forwards that start before step t ends (no flush: megalite.schedules 2bw) run on
W(t), which the update leaves alone. The weights are held in blocks with two buffers each that
trade roles at every update: a parameter's own (no_shard), or under the distributed optimizer
(ZeRO-1) a grad buffer's flat param buffer, whose params, buckets and optimizer shards are all
views of it (the optimizer's all-gather then writes the new version). At the update the buffer
that held W(t-1) takes a copy of W(t) and every view of the block is moved onto it, so the
optimizer (and the all-gather) step it in place; W(t) becomes the previous version. Between
steps the params hold the current weights (evaluation, checkpoints); the previous ones are
`param.previous_version` (a view of the other buffer), which checkpoints save and load.
"""
import contextlib
from collections.abc import Iterator

import torch
from torch import nn


class _Block:
    """Flat weights with two buffers: `members` (param, lo, hi) and `aliases` (tensor, lo, hi)
    are views of elements [lo, hi) of the current one; params can point at either."""

    def __init__(self, flat: torch.Tensor, members: list[tuple[nn.Parameter, int, int]]) -> None:
        self.current, self.previous = flat.detach(), flat.clone()  # W(-1) = W(0)
        self.members, self.aliases = members, []
        self._bind_previous()

    def holds(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        """[lo, hi) of `tensor` in the current buffer, or None when it is not a view of it."""
        if tensor.untyped_storage().data_ptr() != self.current.untyped_storage().data_ptr():
            return None
        lo = tensor.storage_offset() - self.current.storage_offset()
        hi = lo + tensor.numel()
        return (lo, hi) if 0 <= lo and hi <= self.current.numel() else None

    def point(self, previous: bool) -> None:
        flat = self.previous if previous else self.current
        for param, lo, hi in self.members:
            param.data = flat[lo:hi].view_as(param)

    def swap(self) -> None:
        """The previous buffer takes a copy of the current one and becomes current, with every
        view of the block on it; the old current one becomes the previous version."""
        self.previous.copy_(self.current)
        self.current, self.previous = self.previous, self.current
        self.point(previous=False)
        for alias, lo, hi in self.aliases:
            alias.data = self.current[lo:hi].view_as(alias)
        self._bind_previous()

    def _bind_previous(self) -> None:
        for param, lo, hi in self.members:
            param.previous_version = self.previous[lo:hi].view_as(param)


class WeightVersions:
    """W(t) and W(t-1) of every trained parameter of this rank's chunks (TP-local)."""

    def __init__(self, model: list[nn.Module], optimizer) -> None:
        with torch.no_grad():
            self.blocks = [_chunk_blocks(chunk) for chunk in model]
        self.params = [[p for block in blocks for p, _, _ in block.members]
                       for blocks in self.blocks]
        self.on_previous = [False] * len(model)
        candidates = [t for f in optimizer.fragments for t in (f.main, f.target)
                      if t is not None]
        candidates += [t for chunk in model for buffer in getattr(chunk, "grad_buffers", ())
                       if buffer.param_data is not None
                       for t in (buffer.param_data, *(b.param_data for b in buffer.buckets))]
        for tensor in candidates:
            for block in (b for blocks in self.blocks for b in blocks):
                if (span := block.holds(tensor)) is not None:
                    block.aliases.append((tensor, *span))
                    break

    def all_params(self) -> Iterator[nn.Parameter]:
        return (p for params in self.params for p in params)

    def point(self, chunk: int, previous: bool) -> None:
        """Make chunk `chunk`'s params hold W(t-1) (`previous`) or W(t): a forward, and the
        backward of the same microbatch, must see the same version."""
        if self.on_previous[chunk] != previous:
            for block in self.blocks[chunk]:
                block.point(previous)
            self.on_previous[chunk] = previous

    def point_all_current(self) -> None:
        for chunk in range(len(self.blocks)):
            self.point(chunk, previous=False)

    @contextlib.contextmanager
    @torch.no_grad()
    def update(self) -> Iterator[None]:
        """Around the optimizer step that ends a step: W(t-1)'s buffer takes a copy of W(t)
        and becomes the params (and their optimizer and all-gather views), which the
        optimizer steps to W(t+1) (or leaves at W(t) when it skips); W(t) becomes the
        previous version.

        The in-place update goes to the other buffer than the one the next step's in-flight
        forwards saved, so the params' autograd version counters (which aliases made with
        detach() share) are set back afterwards."""
        self.point_all_current()
        params = list(self.all_params())
        versions = tuple(p._version for p in params)
        for blocks in self.blocks:
            for block in blocks:
                block.swap()
        yield
        torch._C._autograd._unsafe_set_version_counter(tuple(params), versions)


def _chunk_blocks(chunk: nn.Module) -> list[_Block]:
    """One block per sharded grad buffer (its flat param buffer: the distributed optimizer)
    and one per other trained parameter of `chunk`."""
    blocks, covered = [], set()
    for buffer in getattr(chunk, "grad_buffers", ()):
        if buffer.param_data is not None:
            members = [(p, lo, hi) for p, (lo, hi) in buffer.ranges.items()]
            blocks.append(_Block(buffer.param_data, members))
            covered.update(id(p) for p, _, _ in members)
    for param in chunk.parameters():
        if param.requires_grad and id(param) not in covered:
            blocks.append(_Block(param.data.view(-1), [(param, 0, param.numel())]))
    return blocks
