"""Closed-form plan of a GPT training layout: memory per rank, FLOPs, bubble, communication.

The formulas are Megatron-LM's (REFERENCES.md): bytes per parameter of the model state
under the run's sharding strategy and offload (`megalite.planning.state_bytes`, the ZeRO rule) plus
FSDP's gathered parameters (`fsdp_units`), activations per layer after Korthikanti et al. 2022
(generalised to e-byte activations: masks stay 1 byte, so 2-byte sbh(34 + 5as/h) becomes
sbh(16e + 2 + (2e + 1)as/h)), the in-flight microbatches of the pipeline schedule,
Narayanan et al. 2021's FLOPs, the schedule's bubble (`accounting.schedule_bubble`), and
the bytes the TP, PP and DP collectives move, and the context-parallel ring
(`ring_attention_elements`). Sequence parallelism splits the norm/dropout/residual
activations over TP (sbh(34 + 5as/h)/t per layer at 2 bytes, 34 sbh/t selective) and turns
each TP all-reduce into an all-gather plus a reduce-scatter; context parallelism divides
every activation by cp. Byte counts are "payload" (the tensors handed to a collective, what
`megalite.mpu.comm` counts) and "wire" (what one rank sends on a ring: an all-reduce of S
bytes over n ranks sends 2(n-1)/n S, a reduce-scatter of S (n-1)/n S, an all-gather of
shards of S (n-1) S, a point-to-point message its size).
"""
import dataclasses
import math
from dataclasses import dataclass
from fractions import Fraction

from megalite.checkpoint.files import STREAM_BUFFER_BYTES
from megalite.config import Configs, OptimizerConfig
from megalite.layout import RunLayout
from megalite.models.spec import TransformerSpec
from megalite.mpu.layers import pad_vocab_size
from megalite.placement import GPIPE
from megalite.planning.activations import (ACTIVATION_BYTES, activation_bytes_per_layer,
                                           inflight_microbatches, moe_activation_delta,
                                           ring_attention_elements)
from megalite.planning.flops import flops_per_iteration
from megalite.planning.params import fsdp_units, stage_expert_params, stage_params
from megalite.planning.state_bytes import (FP32, PARAM_GRAD_BYTES, StateBytes, gather_bytes,
                                           optimizer_state_bytes, state_bytes_per_param,
                                           tier_host_bytes)
from megalite.schedules.accounting import schedule_bubble
from megalite.schedules.tables import step_alignment


def checkpoint_bytes_per_param(precision: str, optimizer: OptimizerConfig,
                               weight_versions: int = 1) -> tuple[int, int]:
    """(all, weights): bytes per parameter in a checkpoint, of weights (`weight_versions` of
    them: 2bw saves the previous weights too), fp32 masters (bf16, fp16) and the optimizer
    state of its megalite.optimizer.kinds record; and the weights'."""
    weights = PARAM_GRAD_BYTES[precision][0] * weight_versions
    masters = 0 if precision == "fp32" else FP32
    return weights + masters + optimizer_state_bytes(optimizer), weights


def checkpoint_shard_bytes(per_param: float, dense: int, expert: int, replicas: int,
                           ep: int) -> float:
    """Bytes one rank writes into a distributed checkpoint: its TP shard's share
    (megalite.checkpoint.state) at `per_param` bytes of `dense` params split over the DP x CP
    `replicas`, of `expert` params over the expert-DP ranks."""
    return per_param * (dense / replicas + expert * ep / replicas)


def save_host_bytes(shard: float, weight_share: float, async_save: bool, on_gpu: bool,
                    offload: bool) -> float:
    """Host memory a save of `shard` bytes adds on one rank: the streaming writer's bounded
    buffer (megalite.checkpoint.files: for tensors not contiguous in host memory) and, with
    `async_save` on GPUs, the reusable (pinned) host copy of the shard's GPU share: all of it,
    or the weights only (`weight_share` of the bytes) with CPU offload
    (megalite.checkpoint.staging; a CPU run's async writer reads the live tensors)."""
    staged = shard * (weight_share if offload else 1)
    return min(STREAM_BUFFER_BYTES, shard) + (staged if async_save and on_gpu else 0)



LOSS_BYTES = 4  # logits, softmax and cross-entropy all-reduces are fp32 whatever the precision



def precision_name(configs: Configs) -> str:
    return "bf16" if configs.precision.bf16 else "fp16" if configs.precision.fp16 else "fp32"



@dataclass(frozen=True)
class StageMemory:
    """Peak bytes on one rank of a pipeline stage."""

    params: int                 # parameter count
    state: StateBytes           # bytes per parameter
    inflight: Fraction          # microbatches held at the peak (whole-stage units)
    layer_activations: float    # stored by the rank's layers, all in-flight microbatches
    extra_activations: float    # embedding dropout mask / final LayerNorm, LM head and logits
    recompute_working: float    # what the backward of one recomputed group adds transiently
    expert_params: int = 0      # MoE experts among `params`
    expert_state: StateBytes | None = None  # their bytes per parameter (sharded over expert-DP)
    gather: int = 0             # FSDP's gathered params (and unsharded grads) at the peak

    @property
    def activations(self) -> float:
        return self.layer_activations + self.extra_activations + self.recompute_working

    @property
    def state_bytes(self) -> StateBytes:
        """Bytes of parameters, gradients and optimizer states on this rank (device + host)."""
        expert = self.expert_state or self.state
        return self.state * (self.params - self.expert_params) + expert * self.expert_params

    @property
    def total(self) -> float:
        """Peak device bytes: the model state not offloaded, gather buffers, activations."""
        return self.state_bytes.device + self.gather + self.activations



@dataclass(frozen=True)
class Plan:
    """Everything `plan` derives from one set of configs; stages are "first" and "last"."""

    configs: Configs
    layout: RunLayout
    precision: str
    sequence_parallel: bool
    padded_vocab: int
    stages: dict[str, StageMemory]

    @property
    def total_params(self) -> int:
        model = self.configs.model
        spec = TransformerSpec.from_config(model)
        layers = range(model.num_layers + spec.mtp_num_layers)  # multi-token prediction's too
        return (sum(spec.layer_params(1, layer) for layer in layers)
                + spec.non_layer_params(self.padded_vocab, model.max_position_embeddings))

    @property
    def flops(self) -> float:
        """Megatron's FLOPs per step (megalite.planning.flops; the 96 form with full recompute)."""
        return flops_per_iteration(self.configs.model, self.layout.global_batch_size,
                                   self.configs.train.seq_length, self.padded_vocab)

    @property
    def bubble(self) -> Fraction:
        layout = self.layout
        return schedule_bubble(layout.schedule, layout.grid.pp, layout.num_microbatches,
                               layout.chunks_per_rank, bool(step_alignment(self.configs)))

    def checkpoint_bytes(self, stage: str) -> float:
        """Bytes one rank of `stage` writes into a distributed checkpoint: its TP shard's
        share (megalite.checkpoint.state) of weights, fp32 masters (bf16/fp16) and optimizer
        state (its megalite.optimizer.kinds record's), split over the DP x CP ranks (experts
        over the expert-DP ranks)."""
        grid, s = self.layout.grid, self.stages[stage]
        per_param, _ = checkpoint_bytes_per_param(self.precision, self.configs.optimizer,
                                                  self.layout.schedule.weight_versions)
        return checkpoint_shard_bytes(per_param, s.params - s.expert_params, s.expert_params,
                                      grid.dp * grid.cp, grid.ep)

    def save_host_bytes(self, async_save: bool) -> float:
        """Host memory a save adds on the rank of the largest shard (`save_host_bytes`)."""
        shard = max(self.checkpoint_bytes(stage) for stage in self.stages)
        per_param, weights = checkpoint_bytes_per_param(self.precision, self.configs.optimizer,
                                                        self.layout.schedule.weight_versions)
        return save_host_bytes(shard, weights / per_param, async_save, True,
                               self.layout.cpu_offload)

    def save_time(self, write_gbps: float) -> float:
        """Seconds of a save when every rank writes its bytes at `write_gbps` GB/s at once."""
        return max(self.checkpoint_bytes(stage) for stage in self.stages) / (write_gbps * 1e9)

    def tier_bytes(self) -> tuple[float, float]:
        """(bytes in the nvme tiers' files, host bytes of the tiers: the optimizer's nvme
        buffers, the cpu tiers' state or parameters) on the rank of the largest share."""
        o = self.configs.optimizer
        nvme = max(s.state_bytes.nvme for s in self.stages.values())
        host = max(s.state_bytes.host for s in self.stages.values())
        if self.layout.nvme_offload:
            host += tier_host_bytes(o.offload_sub_group_size, o)
        return nvme, host

    def param_tier_bytes(self) -> float:
        """Bytes the parameter tier holds (host or file) on the rank of the largest share."""
        if self.layout.param_tier == "none":
            return 0.0
        return max(s.state_bytes.params for s in self.stages.values())

    def tier_io_seconds(self, disk_gbps: float) -> tuple[float, float]:
        """(bytes the nvme tiers read plus write per step on one rank; the seconds they take
        at `disk_gbps` GB/s, not counting their overlap with the step's compute): the
        optimizer's file once each way; the parameter tier's read for the forward, for the
        backward (ZeRO-3 without PP gathers again) and for the optimizer step, and written
        after the step."""
        params = self.param_tier_bytes() if self.layout.param_tier == "nvme" else 0.0
        reads = 3 if self.layout.grid.pp == 1 else 2
        io = 2 * (self.tier_bytes()[0] - params) + (reads + 1) * params
        return io, io / (disk_gbps * 1e9)

    def step_time(self, peak_tflops: float, mfu: float) -> float:
        """Seconds per step if every GPU sustains `mfu` of `peak_tflops` on `flops`."""
        return self.flops / (self.layout.world_size * peak_tflops * 1e12 * mfu)

    def comm(self, stage: str) -> dict[str, tuple[str, float, int]]:
        """Per step on one rank of `stage`: name -> (collective kind, payload bytes, group size).

        TP: per microbatch 2 all-reduces of b s h in forward and 2 in backward per layer (2 more
        forward with full recompute), the embedding's forward and the LM head's backward
        all-reduce of b s h, and cross entropy's 3 fp32 all-reduces of s b. Sequence
        parallel: each layer all-reduce becomes an all-gather of the b s h / t shard and a
        reduce-scatter of b s h; the LM head all-gathers in forward and reduce-scatters in
        backward, the embedding output's scatter all-gathers its grad. CP: s is s / cp
        everywhere, plus the ring's K/V and dK/dV sends (`ring_attention_elements`; the
        forward ring again with recompute). PP: b s h (/ t with SP) per microbatch per
        boundary each way (v times the messages interleaved). DP: the grads all-reduced over
        DP x CP, or reduce-scattered and the params all-gathered (distributed optimizer), and
        the tied word embedding's grad all-reduced between first and last stage.
        """
        model, t, par = self.configs.model, self.configs.train, self.configs.parallel
        tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
        v, cp = self.layout.chunks_per_rank, par.context_parallel_size
        first, last = stage == "first" or pp == 1, stage == "last" or pp == 1
        e, (_, grad_bytes) = ACTIVATION_BYTES[self.precision], PARAM_GRAD_BYTES[self.precision]
        sb = t.seq_length // cp * t.micro_batch_size
        m, sbh, params = self.layout.num_microbatches, sb * model.hidden_size, self.stages[stage].params
        layers, forwards = model.num_layers // pp, 1 + (model.recompute_granularity == "full")
        layer_collectives = layers * (2 * forwards + 2) * sbh * e
        loss_reduces = last * 3 * sb * LOSS_BYTES
        out = {}
        if tp > 1 and not self.sequence_parallel:
            out["TP all-reduce"] = ("all_reduce", m * (layer_collectives + (first + last) * sbh
                                                       * e + loss_reduces), tp)
        elif tp > 1:
            out["TP all-reduce"] = ("all_reduce", m * (first * sbh * e + loss_reduces), tp)
            out["SP all-gather"] = ("all_gather", m * (layer_collectives + (first + last) * sbh
                                                       * e) / tp, tp)
            out["SP reduce-scatter"] = ("reduce_scatter", m * (layer_collectives
                                                               + last * sbh * e), tp)
        if cp > 1:
            kv_fwd, kv_bwd, grads = ring_attention_elements(
                t.seq_length, t.micro_batch_size, max(model.query_groups // tp, 1),
                model.head_dim, cp)
            again = 1 + (model.recompute_granularity is not None)
            out["CP ring send"] = ("send", m * layers * ((again * kv_fwd + kv_bwd) * e
                                                         + grads * LOSS_BYTES), 2)
        if pp > 1:  # forwards to the next stage and grads to the previous, per chunk
            message = sbh * e / (tp if self.sequence_parallel else 1)
            out["PP send"] = ("send", m * (2 * v - (first or last)) * message, 2)
        dp, strategy = self.layout.data_parallel_size * cp, self.layout.strategy
        if dp > 1 and strategy.fsdp:  # FSDP2: fp32 reduction, gathers in e bytes
            out["DP grad reduce-scatter"] = ("reduce_scatter", params * LOSS_BYTES, dp)
            gathers = 2 if strategy.reshard_after_forward and pp == 1 else 1
            out["DP param all-gather"] = ("all_gather", gathers * params * e / dp, dp)
        elif dp > 1 and strategy.shards_optimizer:
            out["DP grad reduce-scatter"] = ("reduce_scatter", params * grad_bytes, dp)
            out["DP param all-gather"] = ("all_gather", params * e / dp, dp)
        elif dp > 1:
            out["DP grad all-reduce"] = ("all_reduce", params * grad_bytes, dp)
        if pp > 1 and not model.untie_embeddings_and_output_weights:
            word = self.padded_vocab * model.hidden_size // tp
            out["tied embedding grad all-reduce"] = ("all_reduce", word * grad_bytes, 2)
        return out



def _extras(configs: Configs, act_bytes: int, tp: int, sp: bool, padded_vocab: int,
            first: bool, last: bool, embedding_inflight: int, logits_inflight: int) -> float:
    """Activations outside the layers: the embedding's 1-byte dropout mask per in-flight
    microbatch on the first stage; the final LayerNorm's and LM head's inputs and the fp32
    logits (s b V/t) of the microbatches between forward and backward on the last."""
    s, b, h = configs.train.seq_length, configs.train.micro_batch_size, configs.model.hidden_size
    split = tp if sp else 1
    extra = 0.0
    if first:
        extra += embedding_inflight * s * b * h / split
    if last:
        extra += logits_inflight * (2 * act_bytes * s * b * h / split
                                    + LOSS_BYTES * s * b * padded_vocab / tp)
    return extra



def _layer_stack(configs: Configs, layers_per_chunk: int, act_bytes: int, tp: int,
                 sp: bool) -> tuple[float, float]:
    """(bytes one microbatch leaves in a chunk until its backward, bytes the backward of one
    recomputed group adds at its peak) for megalite's recompute modes.

    Full: a group re-creates all its layers' activations. Selective: one layer's attention
    core re-creates its s^2 terms after that layer's backward has freed its MLP and
    output-projection activations (MLP input, GeLU in/out, LayerNorm-2 input, two dropout
    masks: (2e + 2) sbh replicated + 9e sbh split over TP).
    """
    model, t = configs.model, configs.train
    per = lambda mode: activation_bytes_per_layer(  # noqa: E731
        t.seq_length, t.micro_batch_size, model.hidden_size, model.num_attention_heads, tp,
        act_bytes, mode, sp)
    mode, n = model.recompute_granularity, model.recompute_num_layers
    moe = 0.0
    if model.num_experts and mode != "full":  # the chunk's MoE layers (at most this many)
        pattern = model.moe_layers  # the most MoE layers any chunk of this many layers holds
        most = max(sum(pattern[i:i + layers_per_chunk]) for i in range(len(pattern)))
        moe = most * moe_activation_delta(
            t.seq_length, t.micro_batch_size, model.hidden_size, tp, act_bytes, model)
    if mode is None:
        return layers_per_chunk * per(None) + moe, 0.0
    if mode == "selective":
        sbh, e = t.seq_length * t.micro_batch_size * model.hidden_size, act_bytes
        freed = (2 * e + 2) * sbh / (tp if sp else 1) + 9 * e * sbh / tp
        return layers_per_chunk * per(mode) + moe, max(0.0, per(None) - per(mode) - freed)
    group = min(n, layers_per_chunk)
    if model.recompute_method == "uniform":
        return math.ceil(layers_per_chunk / n) * per("full"), group * per(None)
    return per("full") + (layers_per_chunk - group) * per(None), group * per(None)



def plan(configs: Configs, sequence_parallel: bool | None = None) -> Plan:
    """The plan of `configs`, checked by `megalite.layout.RunLayout` for a world
    of TP x CP x PP x DP ranks (DP defaults to 1). `sequence_parallel` (default: the
    --sequence-parallel flag) splits the norm/dropout activations over TP too; CP divides
    every activation by cp."""
    if sequence_parallel is None:
        sequence_parallel = configs.parallel.sequence_parallel
    par = configs.parallel
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    dp = par.data_parallel_size or 1
    cp = par.context_parallel_size
    layout = RunLayout.from_configs(configs, tp * pp * dp * cp)
    m, schedule, v = layout.num_microbatches, layout.schedule, layout.chunks_per_rank
    precision = precision_name(configs)
    e = ACTIVATION_BYTES[precision]
    padded_vocab = pad_vocab_size(configs.model.vocab_size,
                                  configs.model.make_vocab_size_divisible_by, tp)
    ep, sharding = par.expert_model_parallel_size, layout.sharding
    offload, nvme, tier = layout.cpu_offload, layout.nvme_offload, layout.param_tier
    state = state_bytes_per_param(precision, sharding, dp * cp, offload, configs.optimizer, nvme,
                                  tier)
    if schedule.weight_versions > 1:  # 2bw: the previous weights, whole on every rank
        state = dataclasses.replace(state, params=state.params * schedule.weight_versions)
    expert_state = state_bytes_per_param(precision, sharding, dp * cp // ep, offload,
                                         configs.optimizer, nvme, tier)
    stored, working = _layer_stack(configs, configs.model.num_layers // (pp * v), e, tp,
                                   sequence_parallel)
    gpipe = schedule.name == GPIPE
    stages = {}
    for name, rank in (("first", 0), ("last", pp - 1)):
        inflight = inflight_microbatches(schedule.name, pp, m, v, rank)
        extras = _extras(configs, e, tp, sequence_parallel, padded_vocab, rank == 0,
                         rank == pp - 1, m if gpipe else min(pp, m), m if gpipe else 1)
        params = stage_params(configs.model, padded_vocab, tp, pp, rank, v, ep)
        root, units = fsdp_units(configs.model, padded_vocab, tp, pp, rank, v, ep)
        gather = gather_bytes(precision, sharding, params, root, max(units), pp > 1, m)
        stages[name] = StageMemory(params, state, inflight, float(inflight * v * stored) / cp,
                                   extras / cp, working / cp,
                                   stage_expert_params(configs.model, tp, pp, rank, v, ep),
                                   expert_state, gather)
    return Plan(configs, layout, precision, sequence_parallel, padded_vocab, stages)


def run_plan(configs: Configs, layout: RunLayout) -> Plan:
    """The plan of a training run's `configs` on its checked `layout` (DP from the world)."""
    parallel = dataclasses.replace(configs.parallel, data_parallel_size=layout.grid.dp)
    return plan(dataclasses.replace(configs, parallel=parallel))
