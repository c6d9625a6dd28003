"""How ranks agree on each collective, so a rank that has called `join()` can take part.

Horovod's coordinator negotiates every collective; here each data collective is announced by
one small all-reduce of int64 descriptors on the same group, issued just before it: an active
rank contributes [1, rank + 1, kind, dtype, numel, root, op, and each field times (rank + 1)],
a joined rank zeros. The sum tells a joined rank what to mirror (a buffer of the reduction's
identity, zero rows, a receive buffer) and how many ranks are active (Average divides by it),
and the weighted fields catch ranks that submitted different collectives (order, size, dtype)
with one clear error instead of a hang or garbage. Every rank takes part in every round, so
their round counts agree: `join()` uses that to name the rank that joined last.
"""
import dataclasses

import torch
import torch.distributed as dist

from megalite.horovod.basics import topology
from megalite.mpu import comm

# Horovod's reduction ops (hvd.Average, hvd.Sum, ...); Adasum is refused where it is asked for.
Average, Sum, Adasum, Min, Max, Product = range(6)
REDUCE_OPS = {Average: dist.ReduceOp.SUM, Sum: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN,
              Max: dist.ReduceOp.MAX, Product: dist.ReduceOp.PRODUCT}
KINDS = ("allreduce", "allgather", "broadcast")
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool)
FIELDS = ("kind", "dtype", "numel", "root", "op")

rounds = 0  # control rounds this process took part in (the same count on every rank)


@dataclasses.dataclass(frozen=True)
class Descriptor:
    """One collective: its kind, dtype, element count (allgather: per row), root and op."""

    kind: str
    dtype: torch.dtype
    numel: int
    root: int = 0
    op: int = Sum

    def codes(self) -> list[int]:
        if self.dtype not in DTYPES:
            raise TypeError(f"megalite.horovod: {self.kind} of {self.dtype} is not supported "
                            f"(supported: {', '.join(str(d) for d in DTYPES)})")
        return [KINDS.index(self.kind), DTYPES.index(self.dtype), self.numel, self.root, self.op]


@dataclasses.dataclass
class Announcement:
    """A control round in flight: its summed tensor and work (None in a group of one)."""

    control: torch.Tensor
    work: object

    def active_ranks(self, expected: Descriptor | None = None) -> int:
        """Wait for the round; the number of active ranks. Raises when the active ranks
        announced different collectives."""
        if self.work is not None:
            self.work.wait()
        active, weight, *sums = self.control.tolist()
        codes, weighted = sums[:len(FIELDS)], sums[len(FIELDS):]
        if active and any(c % active or w * active != c * weight
                          for c, w in zip(codes, weighted)):
            mine = f"; this rank: {expected}" if expected else ""
            raise RuntimeError(f"megalite.horovod: ranks submitted different collectives at "
                               f"control round {rounds} (every rank must issue the same "
                               f"collectives, same sizes and dtypes, in the same order){mine}")
        return active

    def descriptor(self) -> Descriptor | None:
        """The collective the active ranks announced (None when every rank has joined)."""
        active = self.active_ranks()
        if not active:
            return None
        kind, dtype, numel, root, op = (c // active for c in
                                        self.control.tolist()[2:2 + len(FIELDS)])
        return Descriptor(KINDS[kind], DTYPES[dtype], numel, root, op)


def announce(descriptor: Descriptor | None, async_op: bool = True) -> Announcement:
    """Start a control round: this rank's collective, or None from a joined rank."""
    global rounds
    topo = topology()
    control = torch.zeros(2 + 2 * len(FIELDS), dtype=torch.int64, device=topo.device)
    if topo.size == 1:
        control[:2] = 1
        return Announcement(control, None)
    if descriptor is not None:
        weight = topo.rank + 1
        codes = descriptor.codes()
        control.copy_(torch.tensor([1, weight, *codes, *(c * weight for c in codes)]))
    rounds += 1
    return Announcement(control, comm.all_reduce(control, topo.group, async_op=async_op))


def identity(op: int, dtype: torch.dtype) -> float | int | bool:
    """The value a joined rank contributes to a reduction `op`: it leaves the result as is."""
    if op in (Sum, Average):
        return 0
    if op == Product:
        return 1
    if dtype == torch.bool:
        return op == Min
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    return info.max if op == Min else info.min


def mirror(descriptor: Descriptor) -> None:
    """Take a joined rank's part in the collective the active ranks announced."""
    topo = topology()
    kind, dtype, device = descriptor.kind, descriptor.dtype, topo.device
    if kind == "allreduce":
        buffer = torch.full((descriptor.numel,), identity(descriptor.op, dtype), dtype=dtype,
                            device=device)
        comm.all_reduce(buffer, topo.group, op=REDUCE_OPS[descriptor.op])
    elif kind == "broadcast":
        comm.broadcast(torch.empty(descriptor.numel, dtype=dtype, device=device),
                       descriptor.root, topo.group)
    else:
        rows = gather_row_counts(0)
        gathered = torch.empty(topo.size * max(rows) * descriptor.numel, dtype=dtype,
                               device=device)
        comm.all_gather_into(gathered, torch.zeros(max(rows) * descriptor.numel, dtype=dtype,
                                                   device=device), topo.group)


def gather_row_counts(rows: int) -> list[int]:
    """Every rank's row count for an allgather (a joined rank gives 0)."""
    topo = topology()
    counts = torch.empty(topo.size, dtype=torch.int64, device=topo.device)
    comm.all_gather_into(counts, torch.tensor([rows], device=topo.device), topo.group)
    return counts.tolist()


def serve_until_all_joined() -> None:
    """A joined rank's loop: mirror every collective the active ranks announce, until none is
    left (the round in which the last rank joins)."""
    while (descriptor := announce(None, async_op=False).descriptor()) is not None:
        mirror(descriptor)
