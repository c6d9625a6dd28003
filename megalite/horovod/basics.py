"""Start-up and topology of megalite.horovod: `init`, `rank`, `size` and the node layout.

`init()` joins torch.distributed's default group (from torchrun's or tools/horovodrun's env, or
from SLURM's or Open MPI's rank variables), or adopts it when the script already joined one.
Ranks sharing a host name (HOROVOD_HOSTNAME, which tools/horovodrun sets per host, else the
machine's name) form a node: local rank and size come from one all-gather of the names at
`init`, the way Horovod derives them, so they hold under any launcher.
"""
import dataclasses
import os
import socket
from collections import Counter

import torch
import torch.distributed as dist

from megalite.device import current_device, init_distributed

# (rank, world size, local rank) variables of the launchers, in the order they are tried.
LAUNCHER_ENV = [("RANK", "WORLD_SIZE", "LOCAL_RANK"),  # torchrun, tools/horovodrun
                ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK"),
                ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),  # srun, one task per GPU
                ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")]
DEFAULT_TIMEOUT_S = 600.0


@dataclasses.dataclass
class Topology:
    """Where this process sits: global, node-local and cross-node (same local rank) ranks."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    group: dist.ProcessGroup  # every collective of megalite.horovod runs on it
    device: torch.device  # where collectives stage their buffers (the GPU under NCCL)
    owns_group: bool  # init() joined the default group, so shutdown() leaves it


_topology: Topology | None = None


def _launcher_env() -> None:
    """Export RANK, WORLD_SIZE and LOCAL_RANK from the first launcher whose variables are set."""
    for rank, size, local in LAUNCHER_ENV:
        if rank in os.environ and size in os.environ:
            os.environ.setdefault("RANK", os.environ[rank])
            os.environ.setdefault("WORLD_SIZE", os.environ[size])
            if local in os.environ:
                os.environ.setdefault("LOCAL_RANK", os.environ[local])
            return


def timeout_s() -> float:
    """The bound on every collective wait: HOROVOD_STALL_SHUTDOWN_TIME_SECONDS when set above 0
    (Horovod's stall shutdown), else 600 s."""
    value = float(os.environ.get("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", 0) or 0)
    return value if value > 0 else DEFAULT_TIMEOUT_S


def node_layout(hosts: list[str], rank: int) -> tuple[int, int, int, int]:
    """(local_rank, local_size, cross_rank, cross_size) of `rank` given every rank's host.

    A node is the ranks on one host, in rank order; the cross group of a rank is the ranks with
    its local rank, one per node, in node order (Horovod's cross communicator).
    """
    per_host: Counter = Counter()
    local_ranks = []
    for host in hosts:
        local_ranks.append(per_host[host])
        per_host[host] += 1
    cross = [r for r, local in enumerate(local_ranks) if local == local_ranks[rank]]
    return local_ranks[rank], per_host[hosts[rank]], cross.index(rank), len(cross)


def init(comm=None, process_sets=None) -> None:
    """Join (or adopt) the default process group and learn the node layout; idempotent.

    `comm` (an MPI communicator) and `process_sets` are Horovod arguments megalite does not
    support: every collective runs on all ranks.
    """
    global _topology
    if comm is not None or process_sets is not None:
        raise NotImplementedError("megalite.horovod.init: comm= and process_sets= are not "
                                  "supported; every collective runs on all ranks")
    if _topology is not None:
        return
    owns = not dist.is_initialized()
    if owns:
        _launcher_env()
        init_distributed(timeout_s=timeout_s())
    hosts: list = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname())
    rank = dist.get_rank()
    device = current_device() if "nccl" in str(dist.get_backend()) else torch.device("cpu")
    _topology = Topology(rank, len(hosts), *node_layout(hosts, rank), dist.group.WORLD, device,
                         owns)


def topology() -> Topology:
    """This process's Topology; ValueError before `init()` (as Horovod raises)."""
    if _topology is None:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return _topology


def leave() -> None:
    """Forget the layout; leave the default group if `init` joined it."""
    global _topology
    if _topology is not None and _topology.owns_group and dist.is_initialized():
        dist.destroy_process_group()
    _topology = None


def is_initialized() -> bool:
    return _topology is not None


def rank() -> int:
    """This process's rank in [0, size())."""
    return topology().rank


def size() -> int:
    """The number of processes."""
    return topology().size


def local_rank() -> int:
    """This process's rank among the processes on its node (pick the GPU with it)."""
    return topology().local_rank


def local_size() -> int:
    """The number of processes on this process's node."""
    return topology().local_size


def cross_rank() -> int:
    """This process's node among the nodes holding a process of its local rank."""
    return topology().cross_rank


def cross_size() -> int:
    """The number of processes with this process's local rank (the nodes, when even)."""
    return topology().cross_size


def is_homogeneous() -> bool:
    """Whether every node runs the same number of processes."""
    return topology().cross_size * topology().local_size == topology().size


def mpi_threads_supported() -> bool:
    return False


def mpi_enabled() -> bool:
    return False


def mpi_built() -> bool:
    return False


def gloo_enabled() -> bool:
    return "gloo" in str(dist.get_backend())


def gloo_built() -> bool:
    return dist.is_gloo_available()


def nccl_built() -> bool:
    return dist.is_nccl_available()


def cuda_built() -> bool:
    return torch.backends.cuda.is_built()


def rocm_built() -> bool:
    return torch.version.hip is not None
