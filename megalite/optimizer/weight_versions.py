"""PipeDream-2BW's two weight versions per parameter (Narayanan et al., ICML 2021).

Step t's microbatches run forward and backward on the previous weights W(t-1) while the
optimizer moves the current ones, W(t+1) = W(t) - lr * grad f(W(t-1)) (W(-1) = W(0)), so the
next step's forwards that start before step t ends (no flush: megalite.schedules 2bw) run on
W(t), which the update leaves alone. Each parameter has two buffers that trade roles at every
update: the one that held W(t-1) takes a copy of W(t) and the optimizer steps it in place
(through every optimizer tensor that aliases the parameter); W(t) becomes the previous
version. Between steps the params hold the current weights (evaluation, checkpoints); the
previous ones are `param.previous_version`, which checkpoints save and load.
"""
import contextlib
from collections.abc import Iterator

import torch
from torch import nn


class WeightVersions:
    """W(t) and W(t-1) of every trained parameter of this rank's chunks (TP-local)."""

    def __init__(self, model: list[nn.Module], optimizer) -> None:
        self.params = [[p for p in chunk.parameters() if p.requires_grad] for chunk in model]
        self.current = [[p.data for p in params] for params in self.params]
        self.on_previous = [False] * len(model)
        self.aliases: dict[int, list[torch.Tensor]] = {}  # optimizer tensors on a param's buffer
        for fragment in optimizer.fragments:
            param = fragment.model_param
            for tensor in (fragment.main, fragment.target):
                if tensor is not None and tensor.data_ptr() == param.data_ptr():
                    if tensor.numel() != param.numel():
                        raise ValueError("2bw: an optimizer fragment covers part of a parameter "
                                         "(sharded optimizer); needs whole parameters")
                    self.aliases.setdefault(id(param), []).append(tensor)
        with torch.no_grad():
            for param in self.all_params():
                param.previous_version = param.data.clone()  # W(-1) = W(0)

    def all_params(self) -> Iterator[nn.Parameter]:
        return (p for params in self.params for p in params)

    def point(self, chunk: int, previous: bool) -> None:
        """Make chunk `chunk`'s params hold W(t-1) (`previous`) or W(t): a forward, and the
        backward of the same microbatch, must see the same version."""
        if self.on_previous[chunk] != previous:
            for param, current in zip(self.params[chunk], self.current[chunk]):
                param.data = param.previous_version if previous else current
            self.on_previous[chunk] = previous

    def point_all_current(self) -> None:
        for chunk in range(len(self.params)):
            self.point(chunk, previous=False)

    @contextlib.contextmanager
    @torch.no_grad()
    def update(self) -> Iterator[None]:
        """Around the optimizer step that ends a step: W(t-1)'s buffer takes a copy of W(t)
        and becomes the params (and their optimizer aliases), which the optimizer steps to
        W(t+1) (or leaves at W(t) when it skips); W(t) becomes the previous version.

        The in-place update goes to the other buffer than the one the next step's in-flight
        forwards saved, so the params' autograd version counters (which aliases made with
        detach() share) are set back afterwards."""
        self.point_all_current()
        params = list(self.all_params())
        versions = tuple(p._version for p in params)
        for c, chunk_params in enumerate(self.params):
            for i, param in enumerate(chunk_params):
                fresh, current = param.previous_version, self.current[c][i]
                fresh.copy_(current)
                param.previous_version, self.current[c][i] = current, fresh
                param.data = fresh
                for alias in self.aliases.get(id(param), ()):
                    alias.data = fresh
        yield
        torch._C._autograd._unsafe_set_version_counter(tuple(params), versions)
