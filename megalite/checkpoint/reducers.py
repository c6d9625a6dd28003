"""The DP buckets' reducer state (megalite.distributed.reducers: e.g. the 1-bit optimizers'
momentum and error buffers) in each rank's state file, beside its RNG states.

It belongs to one bucket of one rank, so it is restored under the saved layout only; under
another every reducer restarts at the checkpoint's iteration (one printed line) from the
optimizer's per-element state (`GradReducer.restart`: the 1-bit momentum from the loaded
exp_avg, the error buffers at zero).
"""
import torch
import torch.distributed as dist

from megalite.mpu import comm


def _buckets(model: list[torch.nn.Module]) -> list:
    return [bucket for chunk in model for bucket in getattr(chunk, "buckets", list)()]


def reducer_states(model: list[torch.nn.Module]) -> list[dict]:
    """Copies of every bucket's reducer state, in bucket order (empty dicts for stateless
    reducers; copies, so that an async save writes the state of its own step)."""
    return [{key: value.clone() if isinstance(value, torch.Tensor) else value
             for key, value in bucket.reducer.state_dict().items()}
            for bucket in _buckets(model)]


def bucket_state(chunk: torch.nn.Module, bucket, optimizer, key: str) -> torch.Tensor:
    """The optimizer's per-element state `key` of every parameter in `bucket`, laid out as
    the bucket's flat grads [n] (zeros where none); a sharded bucket's pieces are summed over
    its DP group (collective there), each element being stepped by one rank."""
    buffer = next(b for b in chunk.grad_buffers if bucket in b.buckets)
    flat = torch.zeros(bucket.end - bucket.start, device=bucket.grad_data.device)
    members = set(bucket.params)
    for fragment in optimizer.fragments:
        state = optimizer.optimizer.state.get(fragment.main, {})
        if fragment.model_param in members and key in state:
            start = buffer.ranges[fragment.model_param][0] - bucket.start + fragment.offset
            flat[start:start + fragment.main.numel()] = state[key].view(-1)
    if chunk.use_distributed_optimizer and bucket.dp > 1:
        comm.all_reduce(flat, bucket.group)
    return flat


def restore_reducers(model: list[torch.nn.Module], optimizer, states: list[dict] | None,
                     iteration: int) -> None:
    """Load `reducer_states` saved under this layout and bucket size, or (None, or other
    buckets) restart every reducer at `iteration` from the loaded optimizer state."""
    buckets = _buckets(model)
    sizes = [bucket.end - bucket.start for bucket in buckets]
    if states is not None and len(states) == len(buckets) and all(  # else other buckets
            ("momentum" not in state or state["momentum"].numel() == size)
            and state.get("elements", size) == size for state, size in zip(states, sizes)):
        for bucket, state in zip(buckets, states):
            bucket.reducer.load_state_dict(state, bucket.group)
        return
    for chunk in model:
        for bucket in getattr(chunk, "buckets", list)():
            bucket.reducer.restart(iteration, lambda key: bucket_state(chunk, bucket,
                                                                       optimizer, key))
    if any(bucket.reducer.state_dict() for bucket in buckets) and dist.get_rank() == 0:
        print(f"checkpoint saved under another layout or bucket size: the gradient reducers "
              f"restart at iteration {iteration} (1-bit: error buffers at zero, momentum "
              f"from the optimizer's exp_avg)", flush=True)
