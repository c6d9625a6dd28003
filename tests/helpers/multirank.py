"""The tests' rank pools: one megalite.distributed.rank_pool.RankPool per world size, kept for the session.

Each pool starts once (workers forked from the session's fork server, which imported torch
and megalite once, join one process group: about a second) and then runs test task after
task; a pool that failed is dropped and the next task starts a fresh one. A task that loses gloo's connection mesh while the pool sets
up is tried once more. A pool runs on GPUs with NCCL when there is one per rank, else on
the CPU with gloo (megalite.distributed.rank_pool); on GPUs its workers compute in IEEE fp32 (TF32
off) with deterministic kernels, as the parity and bitwise tests need.

A process group that outlives its task keeps threads in every worker (gloo: three) and
slows every later task on the 2 cores. The groups of a layout are destroyed when the next is
initialised or the task ends, but a fully sharded (FSDP2) model is freed only by the
garbage collector (reference cycles), and its groups' threads with it: a pool whose workers
hold more than EXTRA_WORKER_THREADS threads beyond their count at start after a task
collects garbage (0.25 s), and is replaced by a fresh one only if that does not bring them
back under.

The fork server also imports transformers (the references some tasks build on the ranks:
its lazy top level, modeling_utils and the model classes of the families megalite converts)
and Lightning (tests/test_lightning.py's ranks) once, instead of every worker of every pool
that uses them importing them again (~4, ~1 and ~6 s of CPU per worker).
"""
import gc
import os
import threading

from megalite.distributed.rank_pool import RankPool, preload_also

TRANSPORT_FLAKE = "Gloo connectFullMesh failed"
TASK_TIMEOUT_S = float(os.environ.get("MEGALITE_TEST_TIMEOUT", 300))

EXTRA_WORKER_THREADS = 60

HF_MODELS = ("bert", "gpt2", "llama", "mistral", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe",
             "deepseek_v3")
preload_also("transformers", "transformers.modeling_utils",  # before the session's first pool
             *(f"transformers.models.{m}.modeling_{m}" for m in HF_MODELS), "pytorch_lightning")

_POOLS: dict[int, tuple[RankPool, int]] = {}  # world size -> (pool, its workers' threads at start)


def thread_count() -> int:
    """OS threads of this process (Linux), or Python threads elsewhere."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _collected_thread_count() -> int:
    gc.collect()
    return thread_count()


def _prepare_worker() -> int:
    """IEEE fp32 and deterministic kernels on CUDA (nothing changes on the CPU); the worker's
    thread count."""
    from megalite.device import set_tf32, use_deterministic_kernels
    set_tf32(False)
    use_deterministic_kernels()
    return thread_count()


def _pool(world_size: int) -> tuple[RankPool, int]:
    entry = _POOLS.get(world_size)
    if entry is None or not entry[0].alive():
        pool = RankPool(world_size, TASK_TIMEOUT_S)
        _POOLS[world_size] = entry = pool, max(pool.run(_prepare_worker))
    return entry


def run_on_ranks(world_size: int, fn, *args, timeout: float = TASK_TIMEOUT_S, **kwargs) -> list:
    """Run `fn(*args, **kwargs)` on `world_size` ranks; return the per-rank results (tensors
    on the CPU).

    `fn` must be a module-level function (it is sent to the workers by reference).
    """
    for attempt in (1, 2):
        try:
            pool, threads_at_start = _pool(world_size)
            results = pool.run(fn, *args, timeout=timeout, **kwargs)
            limit = threads_at_start + EXTRA_WORKER_THREADS
            if max(pool.run(thread_count)) > limit and \
                    max(pool.run(_collected_thread_count)) > limit:
                _POOLS.pop(world_size)[0].close()
            return results
        except BaseException as error:
            _POOLS.pop(world_size, None)
            # gloo's socket mesh set-up can drop a connection on an overloaded 2-core
            # machine; that is the transport, not the code under test: one fresh try.
            if attempt == 2 or TRANSPORT_FLAKE not in str(error):
                raise


def close_pools() -> None:
    for pool, _ in _POOLS.values():
        pool.close()
    _POOLS.clear()
