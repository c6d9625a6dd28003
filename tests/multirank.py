"""Run test functions on N ranks: gloo on CPU, NCCL on GPUs, unchanged.

A pool of N worker processes per world size is started once per test session (import
torch once, join one process group) and then runs task after task: `run(fn, *args)`
calls `fn(*args)` on every rank and returns the list of per-rank results. Each task
runs between `destroy_model_parallel()` calls so it may initialise any layout.

Bounded failure: if any rank raises, the pool is killed at once and the test fails
with that rank's traceback; if ranks do not answer within `timeout` seconds the pool
is killed and the test fails naming them. The next task starts a fresh pool.
"""
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait

TRANSPORT_FLAKE = "Gloo connectFullMesh failed"
TASK_TIMEOUT_S = float(os.environ.get("MEGALITE_TEST_TIMEOUT", 300))


def _worker(rank: int, world_size: int, store_file: str, conn, sys_path: list[str]) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    sys.path[:0] = [p for p in sys_path if p not in sys.path]
    import torch
    torch.set_num_threads(1)
    from megalite.device import init_distributed
    from megalite.mpu import parallel_state
    init_distributed(rank, world_size, f"file://{store_file}", timeout_s=TASK_TIMEOUT_S)
    while (task := conn.recv()) is not None:
        fn, args, kwargs = task
        try:
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException:  # report everything, including assertion failures
            conn.send(("error", traceback.format_exc()))
        finally:
            parallel_state.destroy_model_parallel()
    # Exit without destroy_process_group: every rank is leaving, and its teardown
    # handshake costs seconds per pool.
    os._exit(0)


class RankPool:
    """N processes joined in one default process group, running tasks on request."""

    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        # A file store needs no free port, so concurrent test runs cannot collide.
        store_file = tempfile.mktemp(prefix=f"megalite_pool{world_size}_")
        self.world_size = world_size
        self.conns, self.procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, world_size, store_file, child, sys.path),
                               daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def run(self, fn, *args, timeout: float = TASK_TIMEOUT_S, **kwargs) -> list:
        for conn in self.conns:
            conn.send((fn, args, kwargs))
        results: dict[int, object] = {}
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
        """Stop the workers: politely, or at once (`kill`) when some may be stuck."""
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


_POOLS: dict[int, RankPool] = {}


def run_on_ranks(world_size: int, fn, *args, timeout: float = TASK_TIMEOUT_S, **kwargs) -> list:
    """Run `fn(*args, **kwargs)` on `world_size` ranks; return the per-rank results.

    `fn` must be a module-level function (it is sent to the workers by reference).
    """
    for attempt in (1, 2):
        pool = _POOLS.get(world_size)
        if pool is None or not pool.alive():
            pool = _POOLS[world_size] = RankPool(world_size)
        try:
            return pool.run(fn, *args, timeout=timeout, **kwargs)
        except BaseException as error:
            _POOLS.pop(world_size, None)
            # gloo's socket mesh set-up can drop a connection on an overloaded 2-core
            # machine; that is the transport, not the code under test: one fresh try.
            if attempt == 2 or TRANSPORT_FLAKE not in str(error):
                raise


def close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
