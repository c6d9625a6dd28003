"""What a rank really holds, to set against the planner's closed forms: the bytes of its model
state (each storage once) and FSDP2's unsharded buffers at this moment. Used by
`tools/plan.py --validate` and benchmarks/bench_fsdp.py."""
import torch
from torch.distributed.tensor import DTensor


def storage_bytes(tensors, seen: set) -> int:
    """Bytes of the storages of `tensors` (DTensors: their local shard) not in `seen`."""
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        tensor = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), str(tensor.device))
        if storage.nbytes() and key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def model_state_bytes(model: list, optimizer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer (fp32 main copies + state) on this rank,
    each storage once, for megalite's grad buffer and FSDP2 chunks alike."""
    seen: set = set()
    params = [p for chunk in model for p in chunk.parameters()]
    out = {"params": storage_bytes(params, seen)}
    out["grads"] = storage_bytes(
        [b.grad_data for chunk in model for b in getattr(chunk, "grad_buffers", [])]
        + [p.grad for p in params] + [getattr(p, "main_grad", None) for p in params], seen)
    state = [t for s in optimizer.optimizer.state.values() for t in s.values()
             if torch.is_tensor(t)]
    out["optimizer"] = storage_bytes([f.main for f in optimizer.fragments] + state, seen)
    return out


def fsdp_buffers(model: list) -> list[torch.Tensor]:
    """FSDP2's unsharded tensors of this rank's chunks at this moment: gathered parameters and
    unsharded (accumulated) grads (storages of size 0 once freed)."""
    from torch.distributed.fsdp import FSDPModule
    out = []
    for module in (m for chunk in model for m in chunk.modules() if isinstance(m, FSDPModule)):
        group = module._get_fsdp_state()._fsdp_param_group
        for param in group.fsdp_params if group else []:
            unsharded = getattr(param, "_unsharded_param", None)
            out += [t for t in (unsharded, getattr(unsharded, "grad", None),
                                param.unsharded_accumulated_grad) if t is not None]
    return out
