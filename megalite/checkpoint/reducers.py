"""The DP buckets' reducer state (megalite.distributed.reducers: e.g. the 1-bit optimizers'
momentum and error buffers) in each rank's state file, beside its RNG states.

It belongs to one bucket of one rank, so it is restored under the saved layout only; under
another the reducers restart from zero at the checkpoint's iteration (one printed line).
"""
import torch
import torch.distributed as dist


def _buckets(model: list[torch.nn.Module]) -> list:
    return [bucket for chunk in model for bucket in getattr(chunk, "buckets", list)()]


def reducer_states(model: list[torch.nn.Module]) -> list[dict]:
    """Copies of every bucket's reducer state, in bucket order (empty dicts for stateless
    reducers; copies, so that an async save writes the state of its own step)."""
    return [{key: value.clone() if isinstance(value, torch.Tensor) else value
             for key, value in bucket.reducer.state_dict().items()}
            for bucket in _buckets(model)]


def restore_reducers(model: list[torch.nn.Module], states: list[dict] | None,
                     iteration: int) -> None:
    """Load `reducer_states` saved under this layout, or (None) restart every reducer at
    `iteration` with fresh state."""
    buckets = _buckets(model)
    if states is not None:
        for bucket, state in zip(buckets, states, strict=True):
            bucket.reducer.load_state_dict(state, bucket.group)
        return
    for bucket in buckets:
        bucket.reducer.restart(iteration)
    if any(bucket.reducer.state_dict() for bucket in buckets) and dist.get_rank() == 0:
        print(f"checkpoint saved under another layout: the gradient reducers' state (1-bit "
              f"momentum and error buffers) restarts at zero at iteration {iteration}",
              flush=True)
