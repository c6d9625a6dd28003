"""The one place that picks the device and the distributed backend.

CUDA + NCCL when a GPU is visible, else CPU + gloo. Everything else asks here, as it asks
`cache_root()` for this machine's cache directory.
"""
import contextlib
import datetime
import functools
import os
import random
import resource
import socket
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

_timeout: datetime.timedelta | None = None


def cache_root() -> str:
    """This machine's megalite cache (the built-in corpus, the compiled host kernels of
    megalite.native): `$MEGALITE_CACHE` if set, else `~/.cache/megalite`."""
    return os.environ.get("MEGALITE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                            "megalite")


def process_group_timeout() -> datetime.timedelta | None:
    """The bound `init_distributed` put on collective waits (None before it ran); every
    process group megalite creates gets the same one."""
    return _timeout


def device_type() -> str:
    """'cuda' when a GPU is available, else 'cpu'."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def backend() -> str:
    """The torch.distributed backend matching `device_type()`."""
    return "nccl" if device_type() == "cuda" else "gloo"


def current_device() -> torch.device:
    """This process's device: its local GPU, or the CPU."""
    if device_type() == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for another process to listen on, picked below the
    kernel's ephemeral range: a port from bind(0) is free again once released, and the next
    bind(0) anywhere (gloo's listeners, a store) may take it before its new owner does."""
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
            low = int(ranges.read().split()[0])
    for port in random.SystemRandom().sample(range(max(1024, low - 8192), low), 64):
        with socket.socket() as sock, contextlib.suppress(OSError):
            sock.bind(("127.0.0.1", port))
            return port
    raise RuntimeError(f"no free TCP port below {low} on 127.0.0.1")


def init_distributed(rank: int | None = None, world_size: int | None = None,
                     init_method: str | None = None, timeout_s: float = 600.0) -> None:
    """Join the default process group (from torchrun's env unless given) and bind the device.

    `timeout_s` bounds every collective, so a dead peer ends the job instead of hanging it.
    """
    global _timeout
    if dist.is_initialized():
        return
    _timeout = datetime.timedelta(seconds=timeout_s)
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    device_id = None
    if device_type() == "cuda":  # one visible GPU per task (SLURM) or per local rank
        device_id = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) %
                                 torch.cuda.device_count())
        torch.cuda.set_device(device_id)
    if init_method is None and "MASTER_ADDR" not in os.environ:
        if world_size > 1:
            raise RuntimeError("init_distributed: WORLD_SIZE > 1 but no MASTER_ADDR "
                               "(launch with torchrun or tools/run_multinode.sh)")
        init_method = "tcp://127.0.0.1:0"  # a lone process: its store binds any free port
    dist.init_process_group(backend(), init_method=init_method, rank=rank, world_size=world_size,
                            timeout=_timeout, device_id=device_id)


def set_tf32(enabled: bool) -> None:
    """TF32 for fp32 matmuls and convolutions on CUDA (off: IEEE fp32, as on the CPU)."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def use_deterministic_kernels() -> None:
    """On CUDA, deterministic kernels where torch has them, for bitwise-repeatable runs: cuBLAS's
    fixed workspace (CUBLAS_WORKSPACE_CONFIG, read when cuBLAS first runs) and
    torch.use_deterministic_algorithms, warning for an op that has no such kernel. Nothing on
    the CPU, whose kernels already repeat."""
    if device_type() == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)


def matmul_slowdown(dtype: torch.dtype, n: int = 256, warmup: int = 1,
                    clock: Callable[[], float] = time.perf_counter,
                    matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.matmul
                    ) -> float:
    """Time of an n x n x n CPU matmul in `dtype` over the same in fp32 (best of 2 and of 10),
    each timed after `warmup` untimed calls: the first calls of a dtype include oneDNN's kernel
    JIT (bf16 on an AMX Xeon: 1.5-1.8x fp32 cold, 0.5x warm).

    About 0.1-0.3 s; > 1 means the CPU has no fast path for `dtype` (AVX2 without
    AVX512-BF16 / AMX runs bf16 matmuls up to ~100x slower than fp32). `clock` and `matmul`
    are for tests (a simulated CPU).
    """
    def best(dt: torch.dtype, reps: int) -> float:
        a = torch.randn(n, n, generator=torch.Generator().manual_seed(0)).to(dt)  # no global RNG
        for _ in range(warmup):
            matmul(a, a)
        times = []
        for _ in range(reps):
            start = clock()
            matmul(a, a)
            times.append(clock() - start)
        return min(times)
    return best(dtype, 2) / best(torch.float32, 10)


@functools.cache
def measured_slowdown(dtype: torch.dtype) -> float:
    """matmul_slowdown(dtype), measured once per process (~0.1-1 s on a CPU without bf16)."""
    return matmul_slowdown(dtype)


def reduced_precision_warning(dtype: torch.dtype, threshold: float = 2.0,
                              slowdown: Callable[[torch.dtype], float] = measured_slowdown
                              ) -> str | None:
    """One warning line when `dtype` matmuls are over `threshold` times slower than fp32 on
    this CPU (`slowdown(dtype)`, by default matmul_slowdown once per process), else None."""
    ratio = slowdown(dtype)
    if ratio <= threshold:
        return None
    name = str(dtype).removeprefix("torch.")
    return (f"warning: {name} matmuls run {ratio:.0f}x slower than fp32 on this CPU (capability "
            f"{torch.backends.cpu.get_cpu_capability()}, no native {name} support): training "
            f"with --{'bf16' if dtype == torch.bfloat16 else 'fp16'} here is slower, not "
            f"faster; drop the flag or use a GPU")


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated GPU memory, or the process's peak resident set on CPU, in MB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10
