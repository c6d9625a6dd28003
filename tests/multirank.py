"""The tests' rank pools: one megalite.rank_pool.RankPool per world size, kept for the session.

Each pool starts once (import torch once, join one process group: 5 s for 4 ranks, 8 s for
8 on 2 cores) and then runs test task after task; a pool that failed is dropped and the
next task starts a fresh one. A task that loses gloo's connection mesh while the pool sets
up is tried once more. A process group that outlives its task keeps three gloo threads in
every worker and slows every later task on the 2 cores, so a pool whose workers hold more
than MAX_WORKER_THREADS threads after a task is replaced by a fresh one (a safety net: the
groups of a layout are destroyed when the next is initialised or the task ends, and DDP's
grad hooks do not keep the model alive, so no test is known to leave one behind).
"""
import os
import threading

from megalite.rank_pool import RankPool

TRANSPORT_FLAKE = "Gloo connectFullMesh failed"
TASK_TIMEOUT_S = float(os.environ.get("MEGALITE_TEST_TIMEOUT", 300))

MAX_WORKER_THREADS = 64

_POOLS: dict[int, RankPool] = {}


def thread_count() -> int:
    """OS threads of this process (Linux), or Python threads elsewhere."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def run_on_ranks(world_size: int, fn, *args, timeout: float = TASK_TIMEOUT_S, **kwargs) -> list:
    """Run `fn(*args, **kwargs)` on `world_size` ranks; return the per-rank results.

    `fn` must be a module-level function (it is sent to the workers by reference).
    """
    for attempt in (1, 2):
        pool = _POOLS.get(world_size)
        if pool is None or not pool.alive():
            pool = _POOLS[world_size] = RankPool(world_size, TASK_TIMEOUT_S)
        try:
            results = pool.run(fn, *args, timeout=timeout, **kwargs)
            if max(pool.run(thread_count)) > MAX_WORKER_THREADS:
                _POOLS.pop(world_size).close()
            return results
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
