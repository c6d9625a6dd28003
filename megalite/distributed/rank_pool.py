"""Run a function on N local ranks from one Python process: gloo on CPU, NCCL on GPUs.

`RankPool(n)` starts n workers that join one default process group (file-store
rendezvous: no free port needed, so concurrent pools cannot collide) and then run task
after task: `pool.run(fn, *args)` calls `fn(*args)` on every rank and returns the list
of per-rank results, their tensors moved to the CPU. Each task ends with
`destroy_model_parallel()`, so the next may initialise any layout. Used by the tests' rank
pools and by the multi-rank tools.

Workers are forked from multiprocessing's fork server, which imports torch and megalite
(PRELOAD) once, so a pool starts in about a second instead of each worker importing them
again (4 s of CPU per worker: 16 s for 8 ranks on 2 cores). The server holds no GPU context
and no process group; each worker starts as a spawned one would: with this process's sys.path,
working directory and __main__ (multiprocessing's preparation data) and its environment as
it is when the pool starts (sent with the worker's arguments), so it imports what this process
imports: the checkout under test, a script's own directory.

Devices: rank r uses GPU r with NCCL when the machine has a GPU for every rank (NCCL cannot
share one GPU between ranks); otherwise the workers see no GPU and run on the CPU with gloo.

Bounded failure: if any rank raises, the pool is killed at once and `run` raises with
that rank's traceback; ranks that do not answer within `timeout_s` are killed and named.
The workers are not daemonic, so a task may start processes of its own (a DataLoader's
workers); they stop when the pool closes, when this process exits, or when it is gone (end
of file on their pipe). They start them as a torchrun rank does, with the platform's default
start method: a forked worker inherits the fork server's, and would start a second, bare
server whose children import torch and megalite again (~8 s for 2 DataLoader workers here).
"""
import atexit
import contextlib
import multiprocessing as mp
import os
import tempfile
import time
import traceback
from collections.abc import Iterator
from multiprocessing.connection import wait
from typing import Any, Callable

# What workers import (torch; the compiler modules torch.optim and FSDP2 load on first use;
# megalite's training loop and GPT task), loaded once by the fork server from this process's
# sys.path when the first pool starts it. Nothing here may ask CUDA anything at import (a
# device count poisons forked children's CUDA): megalite asks when it runs.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.distributed.fsdp",
           "torch.distributed.tensor", "megalite.training", "megalite.tasks.gpt"]
_preload_also: list[str] = []


def preload_also(*modules: str) -> None:
    """More modules for the fork server to import once, when the first pool starts it (later
    calls are too late): e.g. a test session's transformers and Lightning, which its workers
    would otherwise import each (~4 and ~6 s of CPU per worker). A module that does not import
    is skipped (multiprocessing's preload ignores ImportError)."""
    _preload_also.extend(modules)


def on_gpus(world_size: int) -> bool:
    """Whether `world_size` local ranks run on GPUs: one visible GPU for each."""
    import torch
    return torch.cuda.is_available() and torch.cuda.device_count() >= world_size


def _tasks(conn) -> Iterator[tuple]:
    """The tasks the pool sends, until it sends None or its end of the pipe is gone."""
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        yield task


def _worker(rank: int, world_size: int, store_file: str, conn, timeout_s: float,
            env: dict[str, str]) -> None:
    os.environ.clear()  # the fork server's environment is that of the first pool's start
    os.environ.update(env)
    mp.set_start_method(None, force=True)  # the platform's default, not the fork server
    import torch
    from torch.utils._pytree import tree_map_only
    torch.set_num_threads(1)
    from megalite.device import init_distributed
    from megalite.mpu import parallel_state
    init_distributed(rank, world_size, f"file://{store_file}", timeout_s=timeout_s)
    for fn, args, kwargs in _tasks(conn):
        try:
            conn.send(("ok", tree_map_only(torch.Tensor, torch.Tensor.cpu, fn(*args, **kwargs))))
        except BaseException:  # report everything, including assertion failures
            conn.send(("error", traceback.format_exc()))
        finally:
            parallel_state.destroy_model_parallel()
    # Exit without destroy_process_group: every rank is leaving, and its teardown
    # handshake costs seconds per pool.
    os._exit(0)


class RankPool:
    """N processes joined in one default process group, running tasks on request."""

    def __init__(self, world_size: int, timeout_s: float = 300.0,
                 env: dict[str, str] | None = None, start_method: str = "forkserver") -> None:
        """`env`: variables the workers set before they start (e.g. TORCH_NCCL_BLOCKING_WAIT),
        over this process's environment. `start_method` "spawn": workers that start a fresh
        interpreter (for measures of a process's own memory: a forked one first touches
        library pages the server had loaded)."""
        ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            ctx.set_forkserver_preload(PRELOAD + _preload_also)  # when the server starts
        store_file = tempfile.mktemp(prefix=f"megalite_pool{world_size}_")
        self.world_size, self.timeout_s, self.store_file = world_size, timeout_s, store_file
        self.conns, self.procs = [], []
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               **({} if on_gpus(world_size) else {"CUDA_VISIBLE_DEVICES": ""}), **(env or {})}
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(
                rank, world_size, store_file, child, timeout_s, env))
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        atexit.register(self.close, kill=True)  # before multiprocessing's exit joins them

    def run(self, fn: Callable, *args, timeout: float | None = None, **kwargs) -> list:
        """`fn(*args, **kwargs)` on every rank (a module-level function: it is pickled by
        reference); the per-rank results in rank order."""
        timeout = self.timeout_s if timeout is None else timeout
        for conn in self.conns:
            conn.send((fn, args, kwargs))
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(results) < self.world_size:
            waiting = {c: r for r, c in enumerate(self.conns) if r not in results}
            sentinels = {self.procs[r].sentinel: r for r in waiting.values()}
            ready = wait(list(waiting) + list(sentinels), max(0.0, deadline - time.monotonic()))
            if not ready:
                self.close(kill=True)
                raise TimeoutError(f"{fn.__name__}: ranks {sorted(waiting.values())} gave no "
                                   f"answer within {timeout:.0f} s")
            for obj in ready:
                if obj in sentinels and obj not in waiting:
                    rank = sentinels[obj]
                    if not self.conns[rank].poll():
                        self.close(kill=True)
                        raise RuntimeError(f"{fn.__name__}: rank {rank} died "
                                           f"(exit code {self.procs[rank].exitcode})")
                    continue
                if obj not in waiting:
                    continue
                status, value = obj.recv()
                if status == "error":
                    self.close(kill=True)
                    raise AssertionError(f"{fn.__name__} failed on rank {waiting[obj]} of "
                                         f"{self.world_size}:\n{value}")
                results[waiting[obj]] = value
        return [results[r] for r in range(self.world_size)]

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, kill: bool = False) -> None:
        """Stop the workers: politely, or at once (`kill`) when some may be stuck; then remove
        the rendezvous file (the workers are gone, nothing reads it again)."""
        atexit.unregister(self.close)
        for conn, proc in zip(self.conns, self.procs):
            if kill:
                proc.kill()
            elif proc.is_alive():
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.store_file)


def run_once(world_size: int, fn: Callable, *args, env: dict[str, str] | None = None,
             start_method: str = "forkserver", **kwargs) -> list:
    """Start a pool of `world_size` ranks (workers with `env`, started by `start_method`), run
    one task on it, stop it; per-rank results."""
    pool = RankPool(world_size, env=env, start_method=start_method)
    try:
        return pool.run(fn, *args, **kwargs)
    finally:
        pool.close()
