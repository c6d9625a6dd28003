"""`hvd.DistributedOptimizer`: the wrapped optimizer steps on gradients reduced over all ranks.

Each parameter's gradient is submitted for an asynchronous all-reduce as soon as autograd has
accumulated it for the `backward_passes_per_step`-th time (a post-accumulate-grad hook), so the
all-reduces of full fusion buffers overlap the rest of backward; `step()` (or `synchronize()`)
submits what is left (a parameter without a gradient sends zeros: another rank may have one),
waits, and writes the reduced gradients back before the wrapped optimizer's own step. Local
accumulation over the passes sums, as in Horovod: scale the loss by 1/backward_passes_per_step
for a mean.
"""
import contextlib
import warnings
from collections.abc import Iterable, Iterator

import torch

from megalite.horovod import ops
from megalite.horovod.compression import Compression
from megalite.horovod.fusion import Handle
from megalite.horovod.protocol import Adasum, Average


class _DistributedOptimizer:
    """Mixed in before the wrapped optimizer's class; the state lives in the `_hvd_*` fields."""

    def _hvd_setup(self, named_parameters: list[tuple[str, torch.nn.Parameter]] | None,
                   compression, backward_passes_per_step: int, op: int,
                   gradient_predivide_factor: float, sparse_as_dense: bool) -> None:
        params = [p for group in self.param_groups for p in group["params"]]
        names = {id(p): name for name, p in named_parameters or []}
        if named_parameters is not None and any(id(p) not in names for p in params):
            raise ValueError("hvd.DistributedOptimizer: named_parameters was given but does not "
                             "name every parameter of the optimizer")
        self._hvd_names = {p: names.get(id(p), f"param.{i}") for i, p in enumerate(params)}
        self._hvd_compression = compression
        self._hvd_passes = backward_passes_per_step
        self._hvd_op = op
        self._hvd_scale = (1.0 / gradient_predivide_factor, gradient_predivide_factor) \
            if op == Average else (1.0, 1.0)
        self._hvd_sparse_as_dense = sparse_as_dense
        self._hvd_delay = {p: backward_passes_per_step for p in params if p.requires_grad}
        self._hvd_handles: dict[torch.nn.Parameter, tuple[Handle, object, torch.Tensor]] = {}
        self._hvd_should_synchronize = True
        self._hvd_synchronized = False
        self._hvd_hooks = [p.register_post_accumulate_grad_hook(self._hvd_grad_ready)
                           for p in self._hvd_delay]

    def _hvd_grad_ready(self, param: torch.nn.Parameter) -> None:
        if self._hvd_delay[param] <= 0:
            raise AssertionError(
                f"hvd.DistributedOptimizer: the gradient of {self._hvd_names[param]} was "
                f"computed more than backward_passes_per_step={self._hvd_passes} times before "
                f"step() or synchronize(); raise backward_passes_per_step to accumulate locally")
        self._hvd_delay[param] -= 1
        if self._hvd_delay[param] == 0:
            self._hvd_submit(param)

    def _hvd_submit(self, param: torch.nn.Parameter) -> None:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        elif param.grad.is_sparse:
            if not self._hvd_sparse_as_dense:
                raise ValueError(f"hvd.DistributedOptimizer: {self._hvd_names[param]} has a "
                                 f"sparse gradient; pass sparse_as_dense=True")
            param.grad = param.grad.to_dense()
        sent, ctx = self._hvd_compression.compress(param.grad)
        prescale, postscale = self._hvd_scale
        handle = ops.allreduce_async_(sent, op=self._hvd_op, prescale_factor=prescale,
                                      postscale_factor=postscale)
        self._hvd_handles[param] = (handle, ctx, sent)

    def synchronize(self) -> None:
        """Submit the gradients not yet submitted (in parameter order), wait for all, and write
        the reduced values into `.grad`."""
        for param in self._hvd_delay:
            if param not in self._hvd_handles:
                self._hvd_submit(param)
        for param, (handle, ctx, _) in self._hvd_handles.items():
            reduced = self._hvd_compression.decompress(ops.synchronize(handle), ctx)
            if reduced is not param.grad:
                param.grad.copy_(reduced)
        self._hvd_handles.clear()
        self._hvd_delay = dict.fromkeys(self._hvd_delay, self._hvd_passes)
        self._hvd_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside, `step()` does not synchronize (call `synchronize()` first, e.g. to clip)."""
        self._hvd_should_synchronize = False
        try:
            yield
        finally:
            self._hvd_should_synchronize = True

    def step(self, closure=None):
        if self._hvd_should_synchronize:
            if self._hvd_synchronized:
                warnings.warn("optimizer.step() called after optimizer.synchronize() outside "
                              "optimizer.skip_synchronize(): the gradients were reduced twice")
            self.synchronize()
        self._hvd_synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._hvd_handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize(): the "
                                 "gradients are still being reduced")
        return super().zero_grad(set_to_none)


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
                         compression=Compression.none, backward_passes_per_step: int = 1,
                         op: int = Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups=None, sparse_as_dense: bool = False,
                         process_set=None) -> torch.optim.Optimizer:
    """`optimizer` reducing its gradients over all ranks: an instance of a subclass of its class
    sharing its param_groups and state (LR schedulers and checkpoints work on it unchanged).

    op: hvd.Average (divide by the ranks; `gradient_predivide_factor` f divides by f before the
    sum and by size/f after) or hvd.Sum. Adasum, explicit fusion groups and process sets are
    refused with a reason.
    """
    if op == Adasum:
        raise NotImplementedError(ops.ADASUM_REFUSED)
    ops.reduce_op(None, op)
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("hvd.DistributedOptimizer: gradient_predivide_factor needs "
                         "op=hvd.Average")
    if backward_passes_per_step < 1:
        raise ValueError(f"hvd.DistributedOptimizer: backward_passes_per_step="
                         f"{backward_passes_per_step}: expected >= 1")
    if num_groups or groups is not None:
        raise NotImplementedError("hvd.DistributedOptimizer: num_groups= and groups= are not "
                                  "supported; Tensor Fusion packs the gradients by "
                                  "HOROVOD_FUSION_THRESHOLD")
    ops.all_ranks(process_set)
    cls = type(type(optimizer).__name__, (_DistributedOptimizer, type(optimizer)), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped._hvd_setup(list(named_parameters) if named_parameters is not None else None,
                       compression, backward_passes_per_step, op, gradient_predivide_factor,
                       sparse_as_dense)
    return wrapped
