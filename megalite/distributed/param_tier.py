"""The parameter tier (`--param-offload-device {cpu,nvme}`, ZeRO-3 on FSDP2): between uses
each FSDP unit's sharded parameters live in host memory or in a file, not on the device.

ZeRO-Infinity's parameter offload (DeepSpeed's offload_param) on torch FSDP2, whose
FSDPParam keeps a unit's local shard as one padded 1-D tensor (`_sharded_param_data`; the
sharded DTensor's local tensor is a view of the same storage). The tier leaves FSDP2's
tensors as they are and swaps their STORAGE: `untyped_storage().resize_(0)` frees a unit's
shards, `resize_(nbytes)` and a read bring them back. Two of FSDP2's private methods per
unit (its FSDPParamGroup) are wrapped, on the instance:

- `unshard` (pre-forward, pre-backward and FSDP's own backward prefetch; the all-gather
  reads the shards): first the unit is made resident, waiting for its prefetch if one is in
  flight; then the unit that followed it last time in that pass (forward or backward, learnt
  as the run goes) starts loading on a reader thread while this one all-gathers and computes.
- `wait_for_unshard` (the all-gather has been consumed): the shards are freed. They are
  clean then: only the optimizer step and a checkpoint load change them, and write them back
  to the tier; the first use writes the initial values.

So the device holds the shards of the units in flight (the one gathering, the one being
read ahead) rather than all of them; FSDP2's gathered parameters are what they were.
Checkpoints and the in-memory optimizer's step bring all shards back inside
`params_resident(chunks)`; a step of the optimizer's nvme tier brings in those of the
sub-group it steps (`SteppedUnits`). "cpu": a host copy per unit (pinned on CUDA;
on a CPU machine the shards are host memory already: it moves them and saves nothing);
"nvme": one file per rank in a fresh directory under --offload-nvme-path, read and written
with os.preadv / os.pwritev (on CUDA through a pinned staging buffer per unit in flight).
`close()` (end of train) removes the directory; a killed run's is never read again.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

from megalite import device
from megalite.distributed.scratch_io import (pin_mmap_threshold, read_exactly, remove_scratch,
                                                trim_heap, write_all)


@dataclass(eq=False)
class Unit:
    """One FSDP unit (its FSDPParamGroup): where its shards are and its bytes' place in the
    tier (`offset`, `nbytes`: the padded shards, back to back)."""

    group: object
    offset: int
    nbytes: int
    resident: bool = True   # storage allocated (its data possibly still being read)
    dirty: bool = True      # the tier's copy is stale (start-up, after a step or a load)
    pending: Future | None = None
    staging: torch.Tensor | None = field(default=None, repr=False)

    def shards(self) -> list[torch.Tensor]:
        """The unit's padded 1-D local shards (read afresh: FSDP2 may replace them)."""
        return [p._sharded_param_data for p in self.group.fsdp_params]


def _scatter(host: torch.Tensor, shards: list[torch.Tensor]) -> None:
    """Bytes of `host` into the shards, back to back."""
    at = 0
    for t in shards:
        n = t.numel() * t.element_size()
        t.view(torch.uint8).copy_(host[at:at + n])
        at += n


def _gather(shards: list[torch.Tensor], host: torch.Tensor) -> None:
    """The shards' bytes into `host`, back to back."""
    at = 0
    for t in shards:
        n = t.numel() * t.element_size()
        host[at:at + n].copy_(t.view(torch.uint8))
        at += n


class ParamTier:
    """The parameter tier of one rank's FSDP2 units `groups` (FSDPParamGroups, in any order)
    on `where` ("cpu" or "nvme"; `path`: the nvme directory). See the module docstring."""

    def __init__(self, groups: list, where: str, path: str | None = None, rank: int = 0) -> None:
        self.units, offset = [], 0
        for group in groups:
            nbytes = sum(t.numel() * t.element_size() for t in
                         (p._sharded_param_data for p in group.fsdp_params))
            self.units.append(Unit(group, offset, nbytes))
            offset += nbytes
        self.bytes_read = self.bytes_written = 0
        self.successor: dict[tuple[int, str], int] = {}  # (unit, pass) -> unit used next
        self.last: tuple[int, str] | None = None
        self.first: int | None = None  # the first unit a step used
        self.pin = device.device_type() == "cuda"
        if not self.pin:  # host shards: freed ones leave the process (glibc)
            pin_mmap_threshold()
        self.reader, self.directory, self.fd = ThreadPoolExecutor(1), None, None
        if where == "nvme":
            os.makedirs(path, exist_ok=True)
            self.directory = tempfile.mkdtemp(prefix=f"megalite-params-rank{rank}-", dir=path)
            self.fd = os.open(os.path.join(self.directory, "params.bin"),
                              os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            self._cleanup = weakref.finalize(self, remove_scratch, self.fd, self.directory)
        else:
            self.host = torch.empty(offset, dtype=torch.uint8, pin_memory=self.pin)
        for index, unit in enumerate(self.units):
            self._wrap(index, unit)

    def _wrap(self, index: int, unit: Unit) -> None:
        """Wrap the unit's FSDPParamGroup `unshard` and `wait_for_unshard` (instance attrs)."""
        group = unit.group
        unshard, wait_for_unshard = group.unshard, group.wait_for_unshard

        def unshard_resident(*args, **kwargs):
            if group._all_gather_result is None and not group.is_unsharded:
                self._use(index, group._training_state.name)
            return unshard(*args, **kwargs)

        def wait_then_free(*args, **kwargs):
            gathered = group._all_gather_result is not None
            result = wait_for_unshard(*args, **kwargs)
            if gathered:
                self._free(unit)
            return result
        group.unshard, group.wait_for_unshard = unshard_resident, wait_then_free

    def _use(self, index: int, phase: str) -> None:
        """Unit `index` resident for an all-gather in pass `phase`; read ahead the next."""
        key = (index, phase)
        if self.last is not None:
            self.successor[self.last] = index
        elif self.first is None:
            self.first = index
        self.last = key
        self._wait(self.units[index])
        following = self.successor.get(key)
        if following is not None:
            self._load(self.units[following])

    def _load(self, unit: Unit) -> None:
        """Allocate the unit's shards and start reading them (nothing if resident)."""
        if unit.resident:
            return
        shards = unit.shards()
        for t in shards:
            t.untyped_storage().resize_(t.numel() * t.element_size())
        unit.resident = True
        self.bytes_read += unit.nbytes
        unit.pending = self.reader.submit(self._read, unit, shards)

    def _wait(self, unit: Unit) -> None:
        self._load(unit)
        if unit.pending is not None:
            unit.pending.result()
            unit.pending = None

    def _read(self, unit: Unit, shards: list[torch.Tensor]) -> None:
        """(reader thread) The unit's bytes from the tier into its allocated shards."""
        host, staged = self._host_side(unit, shards)
        at = unit.offset
        for t in host:
            n = t.numel()
            if self.fd is None:
                t.copy_(self.host[at:at + n])
            else:
                read_exactly(self.fd, t, at, f"param tier: the file in {self.directory}")
            at += n
        if staged:
            _scatter(host[0], shards)

    def _write(self, unit: Unit) -> None:
        """The unit's shards into the tier."""
        shards = unit.shards()
        host, staged = self._host_side(unit, shards)
        if staged:
            _gather(shards, host[0])
        at = unit.offset
        for t in host:
            n = t.numel()
            if self.fd is None:
                self.host[at:at + n].copy_(t)
            else:
                write_all(self.fd, t, at)
            at += n
        self.bytes_written += unit.nbytes
        unit.dirty = False

    def _host_side(self, unit: Unit, shards: list[torch.Tensor]
                   ) -> tuple[list[torch.Tensor], bool]:
        """(the unit's bytes as tensors the tier copies or reads and writes, staged): its
        shards themselves (as bytes) for the cpu tier or on the host, else one (pinned)
        staging buffer kept while the unit is in flight."""
        if self.fd is None or all(t.device.type == "cpu" for t in shards):
            return [t.view(torch.uint8) for t in shards], False
        if unit.staging is None:
            unit.staging = torch.empty(unit.nbytes, dtype=torch.uint8, pin_memory=self.pin)
        return [unit.staging], True

    def _free(self, unit: Unit) -> None:
        """Write the unit if its copy is stale, then free its shards' storage."""
        self._wait(unit)
        if unit.dirty:
            self._write(unit)
        for t in unit.shards():
            t.untyped_storage().resize_(0)
        unit.resident, unit.staging = False, None

    @contextlib.contextmanager
    def resident(self, changed: bool = False) -> Iterator[None]:
        """Every unit's shards resident inside; `changed` (they are written): the tier's
        copies are refreshed on exit. All freed on exit, the first unit of the next pass
        read ahead."""
        for unit in self.units:
            self._load(unit)
        for unit in self.units:
            self._wait(unit)
        try:
            yield
        finally:
            for unit in self.units:
                unit.dirty = unit.dirty or changed
                self._free(unit)
            self.next_pass()

    def next_pass(self) -> None:
        """Between passes (after a step): read ahead the first unit the last step used; on
        CPU hand the heap's free pages back to the system (the shards allocated before the
        mmap threshold was pinned came from the heap, and freeing them left holes there)."""
        if not self.pin:
            trim_heap()
        self.last = None
        if self.first is not None:
            self._load(self.units[self.first])

    def close(self) -> None:
        """Every unit's shards back on the device, FSDP2's methods unwrapped, the reader
        stopped and the nvme directory removed: an ordinary FSDP2 model again."""
        for unit in self.units:
            self._load(unit)
        for unit in self.units:
            self._wait(unit)
            unit.staging = None
            for name in ("unshard", "wait_for_unshard"):
                vars(unit.group).pop(name, None)
        self.reader.shutdown(wait=True)
        if self.fd is not None:
            self._cleanup()


def attach_param_tier(root: nn.Module, units: list[nn.Module], where: str,
                      path: str | None) -> ParamTier:
    """A ParamTier over the FSDP2 units `units` and `root` (fully_shard'ed), each with
    parameters; this rank's (torch.distributed) rank names its nvme directory."""
    import torch.distributed as dist
    groups = [g for g in (m._get_fsdp_state()._fsdp_param_group for m in [*units, root])
              if g is not None]
    return ParamTier(groups, where, path, dist.get_rank() if dist.is_initialized() else 0)


class SteppedUnits:
    """The parameter tiers' side of a step the optimizer's nvme tier takes sub-group by
    sub-group (megalite.optimizer.nvme_tier.NvmeTier.step): the units holding a sub-group's
    parameters are made resident before it steps (`need`; read ahead with the sub-group
    before it, `ahead`), and each is written back and freed once its last piece has stepped
    (`done`), so the device holds a few units, not all, during the step.

    `chunks`: the model chunks (their `param_tier`s); `params[i]`: fragment i's parameter;
    `pieces[k]`: the fragment index of each piece of sub-group k."""

    def __init__(self, chunks: list[nn.Module], params: list[nn.Parameter],
                 pieces: list[list[int]]) -> None:
        where = {id(p.sharded_param): (tier, unit)
                 for tier in (getattr(c, "param_tier", None) for c in chunks) if tier
                 for unit in tier.units for p in unit.group.fsdp_params}
        self.tiers = {id(tier): tier for tier, _ in where.values()}.values()
        self.units = [[where[id(params[i])] for i in group if id(params[i]) in where]
                      for group in pieces]
        self.left: dict[int, int] = {}
        for group in self.units:
            for _, unit in group:
                self.left[id(unit)] = self.left.get(id(unit), 0) + 1

    def ahead(self, k: int) -> None:
        for tier, unit in self.units[k]:
            tier._load(unit)

    def need(self, k: int) -> None:
        for tier, unit in self.units[k]:
            tier._wait(unit)

    def done(self, k: int, left: dict[int, int]) -> None:
        """Sub-group k stepped; `left`: each unit's pieces still to step (this step's)."""
        for tier, unit in self.units[k]:
            left[id(unit)] -= 1
            if left[id(unit)] == 0:
                unit.dirty = True
                tier._free(unit)

    def finish(self) -> None:
        for tier in self.tiers:
            tier.next_pass()


def close_param_tiers(chunks: list[nn.Module]) -> None:
    """Close and detach every chunk's parameter tier (ParamTier.close)."""
    for chunk in chunks:
        if (tier := getattr(chunk, "param_tier", None)) is not None:
            tier.close()
            chunk.param_tier = None


def params_resident(chunks: list[nn.Module], changed: bool = False
                    ) -> contextlib.AbstractContextManager:
    """Every chunk's parameter tier (`param_tier`, when it has one) resident inside; see
    ParamTier.resident."""
    stack = contextlib.ExitStack()
    for chunk in chunks:
        if (tier := getattr(chunk, "param_tier", None)) is not None:
            stack.enter_context(tier.resident(changed))
    return stack
