"""Pipeline schedules: pure tables (`tables`), their accounting, and the executor that runs them.

This package's top level stays light (the names and the placement are read by
megalite.config and megalite.mpu, which the executor imports), so the executor is imported
when a step function is asked for.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

from megalite.placement import PIPELINE_SCHEDULES
CHUNKED = frozenset({"interleaved", "zbv"})  # schedules that run several chunks per rank


def resolve_schedule(pipeline_schedule: str, pp: int, vpp: int | None) -> str:
    """The schedule a grid of `pp` pipeline ranks with `vpp` chunks each runs for
    --pipeline-schedule `pipeline_schedule`: 1f1b (plain accumulation) when pp = 1,
    interleaved when chunks are asked for with a one-chunk schedule, else the one named."""
    if pipeline_schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"pipeline_schedule: expected one of {', '.join(PIPELINE_SCHEDULES)}, "
                         f"got {pipeline_schedule!r}")
    if pp == 1:
        return "1f1b"  # with p = 1: F B F B ..., no communication
    return "interleaved" if vpp and pipeline_schedule not in CHUNKED else pipeline_schedule


def get_forward_backward_func(pipeline_schedule: str = "1f1b") -> Callable[..., list[dict]]:
    """The step function for the current grid (megalite.mpu.parallel_state).

    PP = 1: gradient accumulation over the microbatches (whatever the schedule). PP > 1:
    `pipeline_schedule` (ParallelConfig.pipeline_schedule); with VPP and a schedule that runs
    one chunk per rank, interleaved 1F1B. zbv needs the grid built with 2 chunks per rank in
    V placement (initialize_model_parallel(..., 2, v_shape_placement=True)).
    The callable takes the keywords forward_step_func, data_iterator, model, num_microbatches,
    seq_length, micro_batch_size, forward_only (and optional loss_scale) and returns the
    per-microbatch loss dicts on every rank (see `executor.forward_backward`).
    """
    from megalite.mpu import parallel_state
    from megalite.schedules.executor import forward_backward
    schedule = resolve_schedule(pipeline_schedule,
                                parallel_state.get_pipeline_model_parallel_world_size(),
                                parallel_state.get_virtual_pipeline_model_parallel_world_size())
    if (schedule == "zbv") != parallel_state.is_pipeline_v_shape():
        raise ValueError(f"pipeline_schedule: {schedule} on a grid "
                         f"{'with' if parallel_state.is_pipeline_v_shape() else 'without'} V "
                         "placement (zbv, and only zbv, needs initialize_model_parallel(..., 2, "
                         "v_shape_placement=True))")
    return functools.partial(forward_backward, schedule=schedule)


__all__ = ["get_forward_backward_func", "resolve_schedule", "PIPELINE_SCHEDULES"]
