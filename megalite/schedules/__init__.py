"""Pipeline schedules: pure tables (`tables`), their accounting, and the executor that runs them."""
import functools
from collections.abc import Callable

from megalite.mpu import parallel_state
from megalite.schedules.executor import LossDict, forward_backward

PIPELINE_SCHEDULES = ("1f1b", "gpipe")


def get_forward_backward_func(pipeline_schedule: str = "1f1b") -> Callable[..., list[LossDict]]:
    """The step function for the current grid (megalite.mpu.parallel_state).

    PP = 1: gradient accumulation over the microbatches; PP > 1 with VPP: interleaved 1F1B;
    PP > 1 without: `pipeline_schedule` (ParallelConfig.pipeline_schedule, "1f1b" or "gpipe").
    The callable takes the keywords forward_step_func, data_iterator, model, num_microbatches,
    seq_length, micro_batch_size, forward_only (and optional loss_scale) and returns the
    per-microbatch loss dicts on every rank (see `executor.forward_backward`).
    """
    if pipeline_schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"pipeline_schedule: expected one of {', '.join(PIPELINE_SCHEDULES)}, "
                         f"got {pipeline_schedule!r}")
    if parallel_state.get_virtual_pipeline_model_parallel_world_size():
        schedule = "interleaved"
    elif parallel_state.get_pipeline_model_parallel_world_size() == 1:
        schedule = "1f1b"  # with p = 1: F B F B ..., no communication
    else:
        schedule = pipeline_schedule
    return functools.partial(forward_backward, schedule=schedule)


__all__ = ["get_forward_backward_func", "forward_backward", "PIPELINE_SCHEDULES"]
