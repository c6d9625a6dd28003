"""The nvme tier (`--optimizer-offload-device nvme`): this rank's fp32 masters and optimizer
state in a scratch file, stepped in sub-groups through three reusable host buffers.

ZeRO-Infinity's optimizer tier (Rajbhandari et al. 2021) without an AIO library: the file is
read and written with os.preadv / os.pwritev by two threads (the calls release the GIL), so
while sub-group k is stepped on the host, k+1 is read into the next buffer and k-1 written
back from the previous one. Host memory holds the three buffers (pinned on CUDA), each
`--offload-sub-group-size` parameters' masters, state and grads, not the state.

What is in the file: per parameter piece the optimizer's per-element state (Adam's m, v:
its megalite.optimizer.kinds record's `state_keys`) and, where the master is a separate fp32
copy (bf16/fp16 under ZeRO-1), the master. An fp32 parameter under ZeRO-1 and an FSDP2
sharded parameter (ZeRO-2/3) are their own masters on the device: copied into the buffer for
the step and back. Per-parameter scalars (Adam's step) stay in memory.

The torch optimizer of --optimizer's record steps one empty `slot` tensor per fragment
(the fragment's `main`): for a sub-group the slots are pointed at the buffer (data, grad and
per-element state views) and the optimizer steps exactly those; a fragment split over two
sub-groups steps each piece from the same scalars (elementwise optimizers only, as all
megalite's are). State the optimizer creates lazily on its first step is copied into the
buffer and written with the rest.

The file lives in a fresh directory (tempfile.mkdtemp) under --offload-nvme-path, removed
by `close()` at the end of train (or when the optimizer goes or the process exits); a killed
run's directory has another name and is never read: a new run writes its file from the
model before the first step. Checkpoints
read the state through `resident()`: every fragment's master and state as whole host
tensors, the layout the in-memory optimizer has, written back to the file at its end.
"""
import contextlib
import os
import tempfile
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterator

import torch

from megalite import device
from megalite.distributed.scratch_io import (pin_mmap_threshold, read_exactly, remove_scratch,
                                                write_all)

FP32_BYTES = 4
BUFFERS = 3  # read-ahead k+1, step k, write-back k-1


@dataclass(frozen=True)
class Piece:
    """Elements [lo, hi) of fragment `index`, at buffer offsets: `master`, each state key's
    (`states`) and the grad's (`grad`)."""

    index: int
    lo: int
    hi: int
    master: int
    states: tuple[int, ...]
    grad: int


@dataclass
class Group:
    """A sub-group: its pieces, its bytes' place in the file and the buffer elements it uses
    (the first `file_numel` of them are the file's)."""

    pieces: list[Piece] = field(default_factory=list)
    file_offset: int = 0
    file_numel: int = 0
    numel: int = 0


def plan_groups(sizes: list[int], in_file: list[bool], n_states: int,
                group_size: int) -> list[Group]:
    """Split fragments of `sizes` elements into sub-groups of at most `group_size` elements
    (a fragment may span several), each laid out as [file fields | device masters | grads];
    a piece's file fields are its master when `in_file` and its `n_states` state keys."""
    spans: list[list[tuple[int, int, int]]] = [[]]
    room = group_size
    for index, size in enumerate(sizes):
        lo = 0
        while lo < size:
            if room == 0:
                spans.append([])
                room = group_size
            hi = min(size, lo + room)
            spans[-1].append((index, lo, hi))
            room -= hi - lo
            lo = hi
    groups, file_offset = [], 0
    for span in spans:
        if not span:
            continue
        file_fields = sum((hi - lo) * (n_states + in_file[i]) for i, lo, hi in span)
        at_file, at_staging = 0, file_fields
        at_grad = file_fields + sum(hi - lo for i, lo, hi in span if not in_file[i])
        group = Group(file_offset=file_offset, file_numel=file_fields)
        for i, lo, hi in span:
            n = hi - lo
            if in_file[i]:
                master, at_file = at_file, at_file + n
            else:
                master, at_staging = at_staging, at_staging + n
            states = tuple(at_file + k * n for k in range(n_states))
            at_file += n_states * n
            group.pieces.append(Piece(i, lo, hi, master, states, at_grad))
            at_grad += n
        group.numel = at_grad
        groups.append(group)
        file_offset += file_fields * FP32_BYTES
    return groups


class NvmeTier:
    """The file and buffers of one rank's optimizer (see the module docstring).

    `fragments` are megalite.optimizer.optimizer.Fragments built in place (`main` aliases
    the model's values, `target` is set where they are not fp32); their `main` becomes the
    empty slot the torch optimizer steps. `state_keys`: the optimizer's per-element state.
    """

    def __init__(self, fragments: list, state_keys: tuple[str, ...], path: str,
                 group_size: int, rank: int = 0) -> None:
        self.state_keys, self.fragments = state_keys, fragments
        self.sources = [f.main.detach().view(-1) for f in fragments]  # device masters / values
        self.in_file = [f.target is not None for f in fragments]
        for f in fragments:
            f.main = torch.empty(0, dtype=torch.float32)
        self.groups = plan_groups([s.numel() for s in self.sources], self.in_file,
                                  len(state_keys), group_size)
        self.initialized = [False] * len(fragments)
        self.bytes_read = self.bytes_written = 0
        os.makedirs(path, exist_ok=True)
        self.directory = tempfile.mkdtemp(prefix=f"megalite-rank{rank}-", dir=path)
        self.fd = os.open(os.path.join(self.directory, "optimizer.bin"),
                          os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self._cleanup = weakref.finalize(self, remove_scratch, self.fd, self.directory)
        self.file_bytes = sum(g.file_numel for g in self.groups) * FP32_BYTES
        pin_mmap_threshold()
        pin = device.device_type() == "cuda"
        numel = max((g.numel for g in self.groups), default=0)
        self.buffers = [torch.empty(numel, dtype=torch.float32, pin_memory=pin)
                        for _ in range(BUFFERS)]
        self.reader, self.writer = ThreadPoolExecutor(1), ThreadPoolExecutor(1)
        self.params = None  # megalite.distributed.param_tier.SteppedUnits, with the param tier
        self.write_masters(fresh=True)

    def close(self) -> None:
        """Stop the I/O threads, close the file and remove the directory now (not when the
        garbage collector frees the tier); the optimizer cannot step afterwards."""
        self.reader.shutdown(wait=True)
        self.writer.shutdown(wait=True)
        self._cleanup()

    def _submit_read(self, group: Group, buffer: torch.Tensor) -> Future:
        self.bytes_read += group.file_numel * FP32_BYTES
        return self.reader.submit(read_exactly, self.fd, buffer[:group.file_numel],
                                  group.file_offset, f"nvme tier: the file in {self.directory}")

    def _submit_write(self, group: Group, buffer: torch.Tensor) -> Future:
        self.bytes_written += group.file_numel * FP32_BYTES
        return self.writer.submit(write_all, self.fd, buffer[:group.file_numel],
                                  group.file_offset)

    @torch.no_grad()
    def write_masters(self, fresh: bool = False) -> None:
        """The file's masters from the model's values (start-up, after loading weights);
        `fresh`: the file is new, its state zero."""
        buffer = self.buffers[0]
        for group in self.groups:
            if fresh:
                buffer[:group.file_numel].zero_()
            else:
                self._submit_read(group, buffer).result()
            for p in group.pieces:
                if self.in_file[p.index]:
                    buffer[p.master:p.master + p.hi - p.lo].copy_(self.sources[p.index][p.lo:p.hi])
            self._submit_write(group, buffer).result()

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer, clip_coef: torch.Tensor | None) -> None:
        """One optimizer step of every fragment: its grad (`fragment.grad`, times `clip_coef`
        when given) applied to its master and state, sub-group by sub-group, the stepped
        masters copied into the model's values."""
        if clip_coef is not None:  # one device-to-host read, not one per piece
            clip_coef = clip_coef.cpu()
        before = [{k: v.clone() for k, v in optimizer.state[f.main].items()}
                  for f in self.fragments]
        after: list[dict] = [{} for _ in self.fragments]
        reads: dict[int, Future] = {}
        writes: dict[int, Future] = {}
        params, left = self.params, dict(self.params.left) if self.params else {}
        if self.groups:
            reads[0] = self._submit_read(self.groups[0], self.buffers[0])
        for k, group in enumerate(self.groups):
            reads.pop(k).result()
            if k + 1 < len(self.groups):
                if k - 2 in writes:  # the next buffer's previous sub-group is written
                    writes.pop(k - 2).result()
                reads[k + 1] = self._submit_read(self.groups[k + 1],
                                                 self.buffers[(k + 1) % BUFFERS])
                if params:
                    params.ahead(k + 1)
            if params:
                params.need(k)
            buffer = self.buffers[k % BUFFERS]
            self._step_group(optimizer, group, buffer, clip_coef, before, after)
            if params:
                params.done(k, left)
            writes[k] = self._submit_write(group, buffer)
        for future in writes.values():
            future.result()
        if params:
            params.finish()
        for i, f in enumerate(self.fragments):
            if self.sources[i].numel():  # an empty shard is never stepped
                optimizer.state[f.main] = after[i]
                self.initialized[i] = True

    def _step_group(self, optimizer, group: Group, buffer: torch.Tensor, clip_coef,
                    before: list[dict], after: list[dict]) -> None:
        for p in group.pieces:
            n, fragment = p.hi - p.lo, self.fragments[p.index]
            master = buffer[p.master:p.master + n]
            if not self.in_file[p.index]:
                master.copy_(self.sources[p.index][p.lo:p.hi])
            grad = buffer[p.grad:p.grad + n]
            grad.copy_(fragment.grad.reshape(-1)[p.lo:p.hi])
            if clip_coef is not None:
                grad.mul_(clip_coef)
            fragment.main.data, fragment.main.grad = master, grad
            state = {k: v.clone() for k, v in before[p.index].items()}
            if self.initialized[p.index]:
                state.update({key: buffer[at:at + n]
                              for key, at in zip(self.state_keys, p.states)})
            optimizer.state[fragment.main] = state
        optimizer.step()
        for p in group.pieces:
            n, fragment = p.hi - p.lo, self.fragments[p.index]
            state = optimizer.state[fragment.main]
            if not self.initialized[p.index]:  # created by this step: into the buffer
                for key, at in zip(self.state_keys, p.states):
                    buffer[at:at + n].copy_(state[key].view(-1))
            # the scalars only: holding the per-element state to the end of the step would
            # keep every fragment's lazily created m, v resident on the first step
            after[p.index] = {k: v for k, v in state.items() if k not in self.state_keys}
            values = fragment.target.reshape(-1) if self.in_file[p.index] \
                else self.sources[p.index]
            values[p.lo:p.hi].copy_(buffer[p.master:p.master + n])
            fragment.main.grad = None
            fragment.main.data = torch.empty(0, dtype=torch.float32)
            optimizer.state[fragment.main] = {}

    @contextlib.contextmanager
    def resident(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """Every fragment's master (`main`) and state as whole fp32 host tensors, the in-memory
        optimizer's layout, for a checkpoint to read or fill; written back at the end."""
        whole = [torch.empty(s.numel(), dtype=torch.float32) for s in self.sources]
        states = [{key: torch.empty(s.numel(), dtype=torch.float32) for key in self.state_keys}
                  for s in self.sources]
        buffer = self.buffers[0]
        with torch.no_grad():
            for group in self.groups:
                self._submit_read(group, buffer).result()
                for p in group.pieces:
                    source = buffer if self.in_file[p.index] else self.sources[p.index]
                    at = p.master if self.in_file[p.index] else p.lo
                    whole[p.index][p.lo:p.hi].copy_(source[at:at + p.hi - p.lo])
                    for key, s in zip(self.state_keys, p.states):
                        states[p.index][key][p.lo:p.hi].copy_(buffer[s:s + p.hi - p.lo])
        for i, f in enumerate(self.fragments):
            f.main.data = whole[i].view(self.sources[i].shape)
            if self.initialized[i]:
                optimizer.state[f.main].update(states[i])
        try:
            yield
        finally:
            self._write_resident(optimizer)

    @torch.no_grad()
    def _write_resident(self, optimizer: torch.optim.Optimizer) -> None:
        buffer = self.buffers[0]
        for i, f in enumerate(self.fragments):
            self.initialized[i] = all(k in optimizer.state[f.main] for k in self.state_keys)
        for group in self.groups:
            buffer[:group.file_numel].zero_()
            for p in group.pieces:
                f, n = self.fragments[p.index], p.hi - p.lo
                if self.in_file[p.index]:
                    buffer[p.master:p.master + n].copy_(f.main.data.view(-1)[p.lo:p.hi])
                if self.initialized[p.index]:
                    state = optimizer.state[f.main]
                    for key, at in zip(self.state_keys, p.states):
                        buffer[at:at + n].copy_(state[key].reshape(-1)[p.lo:p.hi])
            self._submit_write(group, buffer).result()
        for f in self.fragments:
            optimizer.state[f.main] = {k: v for k, v in optimizer.state[f.main].items()
                                       if k not in self.state_keys}
            f.main.data = torch.empty(0, dtype=torch.float32)
