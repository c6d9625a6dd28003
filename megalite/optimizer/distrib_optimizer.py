"""The distributed optimizer (ZeRO-1): fp32 main params and optimizer state sharded over DP.

DP rank r owns shard r of every bucket of the DDP grad buffers (a contiguous range of
each bucket; with the default bucket size one bucket, so one range of the whole
buffer). After the buckets' reduce-scatter the owned range holds the DP-mean grads;
this rank steps only the pieces of parameters inside it (one Fragment per piece, so
1-D params still skip weight decay), writes them into the param buffer and all-gathers
every bucket's params over DP. Grad statistics (norm, overflow) are reduced over the
DP group and then the model-parallel group, since each rank sees only its shard.
FullyShardedOptimizer steps the shards of fully sharded chunks (ZeRO-2/3) in place.
"""
from torch import nn

from megalite.distributed.fsdp import fsdp_shard_start
from megalite.distributed.param_tier import SteppedUnits, params_resident
from megalite.optimizer.optimizer import Fragment, MixedPrecisionOptimizer, replica_group


class DistributedOptimizer(MixedPrecisionOptimizer):
    """MixedPrecisionOptimizer over this DP rank's shard; chunks must be wrapped with
    `DistributedDataParallel(..., use_distributed_optimizer=True)`."""

    def _build_fragments(self) -> list[Fragment]:
        fragments = []
        for chunk in self.model_chunks:
            for buffer in chunk.grad_buffers:
                for bucket in buffer.buckets:
                    lo, hi = bucket.shard_range()
                    for param in bucket.params:
                        start, end = buffer.ranges[param]
                        a, b = max(start, lo), min(end, hi)
                        if a < b:
                            fragments.append(Fragment.of(param, buffer.param_data[a:b],
                                                         buffer.grad_data[a:b], a - start,
                                                         self.host, self.in_place))
        return fragments

    def param_shards(self) -> list[tuple[nn.Parameter, object]]:
        """Each bucket's params with the bucket's DP group (its ranks own disjoint ranges)."""
        return [(param, bucket.group) for chunk in self.model_chunks
                for buffer in chunk.grad_buffers for bucket in buffer.buckets
                for param in bucket.params]

    def _stats_groups(self, within_stage: bool = False) -> list:
        return [self.model_chunks[0].data_parallel_group, replica_group(within_stage)]

    def _expert_stats_groups(self) -> list:
        """None: expert shards lie over expert-DP x EP = the DP group, reduced with the rest."""
        return []

    def _copy_main_to_model(self) -> None:
        super()._copy_main_to_model()
        for chunk in self.model_chunks:
            for bucket in chunk.buckets():
                bucket.gather_params()


class FullyShardedOptimizer(DistributedOptimizer):
    """The optimizer of fully sharded chunks (megalite.distributed.fsdp, ZeRO-2/3): steps each
    parameter's local DP shard, the fp32 master itself (on the host with CPU offload), with
    the grad shard FSDP reduce-scattered; FSDP gathers the params again at the next forward.
    Grad statistics as the distributed optimizer's (expert shards lie over expert-DP x EP =
    the DP group)."""

    def _build_fragments(self) -> list[Fragment]:
        return [Fragment(p, p.detach().to_local(), p.main_grad, None,
                         fsdp_shard_start(p, flat=True))
                for chunk in self.model_chunks for p in chunk.parameters() if p.requires_grad]

    def param_shards(self) -> list[tuple[nn.Parameter, object]]:
        """Each parameter with its FSDP mesh's group (DP x CP; experts: expert-DP)."""
        return [(p, p.device_mesh.get_group()) for chunk in self.model_chunks
                for p in chunk.parameters() if p.requires_grad]

    def apply(self, grad_norm: float, found_inf: bool, loss_is_finite: bool = True
              ) -> tuple[bool, float | None]:
        """MixedPrecisionOptimizer.apply with the parameter tier's shards resident (written
        back to the tier after the step; megalite.distributed.param_tier): all of them, or
        with the optimizer's nvme tier those of the sub-group stepping."""
        if self.tier is None:
            with params_resident(self.model_chunks, changed=True):
                return super().apply(grad_norm, found_inf, loss_is_finite)
        if any(getattr(c, "param_tier", None) for c in self.model_chunks):
            self.tier.params = SteppedUnits(
                self.model_chunks, [f.model_param for f in self.fragments],
                [[p.index for p in group.pieces] for group in self.tier.groups])
        return super().apply(grad_norm, found_inf, loss_is_finite)

    def _copy_main_to_model(self) -> None:
        """Nothing: the masters are the sharded params."""
