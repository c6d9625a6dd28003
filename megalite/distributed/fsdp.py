"""Fully sharded data parallelism (ZeRO-2 / ZeRO-3) on torch FSDP2, composed with TP, PP, CP, EP.

`shard_model(chunk, strategy, param_dtype, cpu_offload)` shards one built model chunk with
`torch.distributed.fsdp.fully_shard`: one unit per transformer layer, per MoE layer's local
experts (over the expert-data-parallel group, grads still divided by the full DP size as
DistributedDataParallel does), the first stage's embedding (unless tied to this chunk's
head), then the chunk as the root (final norm, output layer); dense units over the DP x CP
group (`DeviceMesh.from_group`). megalite's TP layers keep their plain TP-local tensors,
which FSDP shards further along dim 0 over DP.

- optim_grads (ZeRO-2): `reshard_after_forward=False`, parameters stay gathered from forward
  to backward; grads are reduce-scattered and kept as shards.
- optim_grads_params (ZeRO-3): parameters resharded after forward and gathered again for
  backward. Under PP (as torchtitan) they stay gathered across the microbatches of a step:
  no reshard after forward, nor after any backward but the chunk's last of the step.
- Gradients are reduced once per step: `no_sync()` (the executor's, for every backward of a
  chunk but its last) turns off FSDP's gradient sync, so unsharded grads accumulate.
- bf16 / fp16: `MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32)`: the sharded
  parameters are the fp32 masters the optimizer steps (no second copy).
- `--optimizer-cpu-offload`: `CPUOffloadPolicy`: sharded params, grads and optimizer state
  on the host (pinned on CUDA), the optimizer steps there.
- `--param-offload-device cpu|nvme` (ZeRO-3): each unit's sharded parameters in host memory
  or a file between uses (megalite.distributed.param_tier, the chunk's `param_tier`).

Each sharded parameter keeps a grad shard for the whole run (FSDP adds each step's
reduce-scattered grads into it) and `main_grad`, its plain local tensor, so
`finalize_model_grads` (TP-partial grads, tied embedding, vocabulary padding) and the
optimizer read grads as they do under DistributedDataParallel: TP ranks and the two tied
embedding copies hold equal-shaped tensors split over equal-sized DP groups, so their local
DP shards cover the same elements.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from megalite import device
from megalite.distributed.param_tier import attach_param_tier
from megalite.distributed.wrapper import ChunkWrapper
from megalite.models.transformer import ParallelTransformerLayer
from megalite.moe.layer import MoELayer
from megalite.mpu import comm, parallel_state
from megalite.config.sharding import ShardingStrategy, sharding_strategy

if TYPE_CHECKING:  # imported where used: torch.distributed.tensor costs 0.7 s at start-up
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor


class FullyShardedChunk(ChunkWrapper):
    """One model chunk sharded by `shard_model`, with DistributedDataParallel's step interface
    (`no_sync`, `finish_grad_sync`, `zero_grad_buffer`); calls and unknown attributes go to
    the sharded module."""

    def __init__(self, module: nn.Module, strategy: ShardingStrategy, pipelined: bool,
                 data_parallel_group, param_dtype: torch.dtype) -> None:
        super().__init__()
        self.module, self.strategy, self.pipelined = module, strategy, pipelined
        self.param_dtype = param_dtype  # gathered and computed in; the shards stay fp32
        self.data_parallel_group = data_parallel_group  # DP x CP: the grad statistics
        self.param_tier = None  # --param-offload-device: set by shard_model
        self.zero_grad_buffer()

    def _set_last_backward(self, last: bool) -> None:
        self.module.set_requires_gradient_sync(last)
        self.module.set_is_last_backward(last)
        if self.pipelined:
            self.module.set_reshard_after_backward(last)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate unsharded grads (all but the last of a step)."""
        self._set_last_backward(False)
        try:
            yield
        finally:
            self._set_last_backward(True)

    def finish_grad_sync(self) -> None:
        """Nothing to wait for: FSDP finishes the reduce-scatters at the end of the chunk's
        last backward, accumulating into the persistent grad shards."""

    @torch.no_grad()
    def zero_grad_buffer(self) -> None:
        """Zero every grad shard for the next step (allocated once: FSDP adds into them, and
        `main_grad`, their local tensor, stays valid for the optimizer)."""
        for param in self.module.parameters():
            if param.grad is None:
                param.grad = torch.zeros_like(param)
                param.main_grad = param.grad.to_local()
            param.main_grad.zero_()


def _mesh(group) -> DeviceMesh:
    """A 1-D mesh over `group`. Named after the group: meshes over the same ranks compare
    equal, and DTensor's sharding caches would hand a later layout a mesh (and so a group)
    of an earlier one, already destroyed."""
    from torch.distributed.device_mesh import DeviceMesh
    return DeviceMesh.from_group(group, device.device_type(),
                                 mesh_dim_names=(f"group_{group.group_name}",))


def _units(module: nn.Module) -> list[tuple[nn.Module, bool]]:
    """(submodule, over expert-DP) to shard as units before the root, inner ones first: MoE
    local experts, transformer layers, and the first stage's embedding unless this chunk's
    head or its multi-token prediction reads it too (a unit runs one forward per step). The
    output layer (read through `lm_logits`, not its forward) and a tied copy stay in the root
    unit, gathered for the whole chunk."""
    units = []
    for sub in module.modules():
        if isinstance(sub, ParallelTransformerLayer):
            units += [(moe.local_experts, True) for moe in sub.modules()
                      if isinstance(moe, MoELayer)]
            units.append((sub, False))
    tied_here = getattr(module, "share_embeddings_and_output_weights", False) and \
        getattr(module, "post_process", False)
    read_twice = getattr(module, "mtp", None) is not None  # multi-token prediction embeds too
    if getattr(module, "pre_process", False) and not tied_here and not read_twice:
        units.append((module.embedding, False))
    return units


def shard_model(chunk: nn.Module, strategy: str, param_dtype: torch.dtype,
                cpu_offload: bool = False, param_tier: str = "none",
                nvme_path: str | None = None) -> FullyShardedChunk:
    """Shard `chunk` (built in `param_dtype` on this rank's device, process grid initialised)
    for the strategy named `strategy` (one whose record runs on FSDP2: optim_grads,
    optim_grads_params), with the host offload when `cpu_offload` and the units' sharded
    parameters in `param_tier` ("cpu", or "nvme" under `nvme_path`: the chunk's
    `param_tier`, megalite.distributed.param_tier); see the module docstring.
    Parameters become fp32 DTensors sharded on dim 0 over DP x CP (experts: expert-DP);
    megalite's parameter attributes (TP split, tied copy, expert) are kept on them."""
    record = sharding_strategy(strategy)
    if not record.fsdp:
        raise ValueError(f"shard_model: strategy {strategy!r} does not run on FSDP2")
    from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy,
                                        fully_shard)
    # the chunk's per-token loss is a transposed view; nothing changes it in place
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    pipelined = parallel_state.get_pipeline_model_parallel_world_size() > 1
    attributes = {name: dict(p.__dict__) for name, p in chunk.named_parameters()}
    for param in chunk.parameters():
        param.data = param.data.float()  # the fp32 masters; gathered in param_dtype
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=device.device_type() == "cuda") \
        if cpu_offload else OffloadPolicy()
    dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    dp_size = comm.world_size(dp_group)
    dense, experts = _mesh(dp_group), _mesh(parallel_state.get_expert_data_parallel_group())
    reshard = record.reshard_after_forward and not pipelined
    units = _units(chunk)
    for unit, expert in units:
        fully_shard(unit, mesh=experts if expert else dense, reshard_after_forward=reshard,
                    mp_policy=policy, offload_policy=offload)
        if expert:  # each expert's grad sums its whole EP group's tokens: mean over all DP,
            unit.set_gradient_divide_factor(float(dp_size))  # divided around a plain sum
            # (gloo has no PREMUL_SUM); on a 1-rank mesh torch 2.13 would divide twice
            unit.set_force_sum_reduction_for_comms(experts.size() > 1)
    fully_shard(chunk, mesh=dense, reshard_after_forward=reshard, mp_policy=policy,
                offload_policy=offload)
    if device.device_type() == "cpu":
        for unit in [u for u, _ in units] + [chunk]:
            unit.set_custom_reduce_scatter(_all_reduce_scatter())
    for name, param in chunk.named_parameters():
        param.__dict__.update(attributes[name])
        _localise_padding_rows(param)
    sharded = FullyShardedChunk(chunk, record, pipelined, dp_group, param_dtype)
    if param_tier != "none":  # after the grad shards: they stay on the device
        sharded.param_tier = attach_param_tier(chunk, [u for u, _ in units], param_tier,
                                               nvme_path)
    return sharded


def _all_reduce_scatter():
    """FSDP2's reduce-scatter for the CPU: an all-reduce of its input [size * n] (gloo's
    reduce-scatter takes 1.2-2x its all-reduce of the same tensor, docs/performance.md), then
    this rank's n elements; AVG (gloo's all-reduce has none) as the sum divided by the size."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    class AllReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group,
                     op, async_op: bool = False) -> None:
            average = op == dist.ReduceOp.AVG
            dist.all_reduce(input_tensor, dist.ReduceOp.SUM if average else op, group=group)
            output_tensor.copy_(input_tensor.view(group.size(), -1)[group.rank()])
            if average:
                output_tensor.div_(group.size())
    return AllReduceScatter()


def _localise_padding_rows(param: DTensor) -> None:
    """`local_padding_rows` (vocabulary padding: the last rows of the TP-local tensor) of this
    DP shard: rows [lo, lo + local) of n hold the last max(0, lo + local - (n - rows))."""
    rows = getattr(param, "local_padding_rows", 0)
    if rows:
        n, local = param.shape[0], param.to_local().shape[0]
        lo = fsdp_shard_start(param)
        param.local_padding_rows = max(0, min(local, lo + local - (n - rows)))


def fsdp_shard_start(param: DTensor, flat: bool = False) -> int:
    """First dim-0 row of this rank's shard (FSDP splits like torch.chunk); `flat`: its first
    element in the flattened (TP-local) parameter."""
    rank = param.device_mesh.get_local_rank()
    per = -(-param.shape[0] // param.device_mesh.size())
    row = min(rank * per, param.shape[0])
    return row * (math.prod(param.shape[1:]) if flat else 1)

