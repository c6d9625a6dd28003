"""The run layout: every size of a training run, derived and checked once from the configs.

`RunLayout.from_configs(configs, world_size)` is the one place that answers "is this layout
legal, and what follows from it" (torchtitan's ParallelDims plus Megatron's derived sizes):
the process grid (TP x CP x DP x PP, EP carved out of DP, virtual chunks and their
placement), microbatches per step, the resolved pipeline schedule, and every cross-flag
rule between them and the model, each failing with one line naming the flag. It needs no
process group, so a bad flag ends every rank before any collective. Process groups
(`initialize_model_parallel(grid=...)`), the step function, the planner, checkpoint metadata
and the entry scripts read it; layer constructors keep only cheap asserts.
"""
from dataclasses import dataclass

from megalite.config import (Configs, ModelConfig, OptimizerConfig, ParallelConfig,
                             TrainConfig)
from megalite.distributed.reducers import default_reducer
from megalite.mpu.attention import check_attention_split
from megalite.mpu.parallel_state import GridLayout
from megalite.optimizer.kinds import optimizer_kind
from megalite.optimizer.scheduler import check_decay_iters
from megalite.schedules import ScheduleKind, resolve_schedule, schedule_kind
from megalite.config.sharding import STRATEGIES, ShardingStrategy, sharding_strategy


@dataclass(frozen=True)
class RunLayout:
    """The checked sizes of one run (build with `from_configs`)."""

    grid: GridLayout
    schedule: ScheduleKind     # the resolved pipeline schedule (1F1B when PP = 1)
    micro_batch_size: int      # sequences per microbatch per DP rank
    global_batch_size: int     # sequences per step, all DP ranks
    num_microbatches: int      # per step per DP rank
    seq_length: int
    sequence_parallel: bool
    sharding: str              # --data-parallel-sharding-strategy (a megalite.config.sharding record)
    cpu_offload: bool = False  # --optimizer-cpu-offload / --optimizer-offload-device cpu
    nvme_offload: bool = False  # --optimizer-offload-device nvme
    param_tier: str = "none"   # --param-offload-device

    @property
    def strategy(self) -> ShardingStrategy:
        return sharding_strategy(self.sharding)

    @property
    def world_size(self) -> int:
        return self.grid.world_size

    @property
    def data_parallel_size(self) -> int:
        return self.grid.dp

    @property
    def chunks_per_rank(self) -> int:
        return self.grid.vpp or 1

    @property
    def seq_length_per_rank(self) -> int:
        """Tokens of each sequence a rank holds between layers: s / CP (/ TP with SP)."""
        return self.seq_length // self.grid.cp // (self.grid.tp if self.sequence_parallel else 1)

    def describe(self) -> str:
        """'world 8 = TP 2 x PP 2 x DP 2 | sharding no_shard' (CP, EP and VPP named when used,
        and the tokens per rank when the sequence is split)."""
        g = self.grid
        cp = f"CP {g.cp} x " if g.cp > 1 else ""
        vpp = f" (VPP {g.vpp})" if g.vpp else ""
        ep = f" (EP {g.ep})" if g.ep > 1 else ""
        split = self.seq_length_per_rank
        tokens = f" | seq {self.seq_length}, {split} per rank" if split < self.seq_length else ""
        offload = ", CPU offload" if self.cpu_offload else \
            ", NVMe offload" if self.nvme_offload else ""
        if self.param_tier != "none":
            offload += f", parameters offloaded to {self.param_tier}"
        return (f"world {g.world_size} = TP {g.tp} x {cp}PP {g.pp}{vpp} x DP {g.dp}{ep} | "
                f"sharding {self.sharding}{offload}{tokens}")

    @classmethod
    def from_configs(cls, configs: Configs, world_size: int) -> "RunLayout":
        """The layout of `configs` on `world_size` ranks; ValueError (one line naming the
        flag) for the first rule it breaks."""
        p, m, t = configs.parallel, configs.model, configs.train
        pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size
        vpp = schedule_kind(p.pipeline_schedule).chunks_for(pp, vpp)
        schedule = resolve_schedule(p.pipeline_schedule, pp, vpp)
        grid = GridLayout.from_world(world_size, p.tensor_model_parallel_size, pp,
                                     p.context_parallel_size, p.expert_model_parallel_size, vpp,
                                     schedule.v_shape)
        if p.data_parallel_size is not None and p.data_parallel_size != grid.dp:
            raise ValueError(f"--dp {p.data_parallel_size} does not match world size "
                             f"{world_size} / (TP {grid.tp} x CP {grid.cp} x PP {grid.pp}) = "
                             f"{grid.dp}")
        check_sequence_split(t.seq_length, grid.tp, p.sequence_parallel, grid.cp)
        if t.seq_length > m.max_position_embeddings:
            raise ValueError(f"--seq-length ({t.seq_length}) exceeds --max-position-embeddings "
                             f"({m.max_position_embeddings})")
        _check_model_split(m, p, grid)
        if (requested := schedule_kind(p.pipeline_schedule)).across_steps:
            _check_across_steps(configs, requested, pp)
        global_batch = global_batch_size(t, grid.dp)
        microbatches = global_batch // (t.micro_batch_size * grid.dp)
        schedule.check_microbatches(grid.pp, microbatches)
        o = configs.optimizer
        check_decay_iters(o.lr_decay_style, o.lr_warmup_iters, o.lr_decay_iters or t.train_iters)
        check_sharding(o, schedule)
        if o.param_offload_device != "none":
            check_param_tier(o, sharding_strategy(o.sharding), configs.checkpoint.async_save)
        if optimizer_kind(o.optimizer).check_run is not None:
            optimizer_kind(o.optimizer).check_run(configs, grid.dp * grid.cp)
        return cls(grid, schedule, t.micro_batch_size, global_batch, microbatches, t.seq_length,
                   p.sequence_parallel, o.sharding, o.offload_device == "cpu",
                   o.offload_device == "nvme", o.param_offload_device)


def check_sharding(o: OptimizerConfig, schedule: ScheduleKind) -> None:
    """One clear ValueError for an optimizer or sharding strategy the run cannot use (the
    rules read the megalite.config.sharding and megalite.optimizer.kinds records)."""
    strategy, kind = sharding_strategy(o.sharding), optimizer_kind(o.optimizer)
    flag = "--data-parallel-sharding-strategy"
    if o.use_distributed_optimizer and not strategy.shards_optimizer:
        raise ValueError(f"--use-distributed-optimizer shards the optimizer state: it cannot go "
                         f"with {flag} {strategy.name}")
    if o.offload_device and not strategy.offload:
        spelling = "--optimizer-cpu-offload" if o.optimizer_cpu_offload else \
            f"--optimizer-offload-device {o.offload_device}"
        raise ValueError(f"{spelling} needs a sharded {flag} ("
                         f"{_names(s for s in STRATEGIES if s.offload)})")
    if schedule.across_steps and strategy.fsdp:
        raise ValueError(f"--pipeline-schedule {schedule.name} keeps two versions of whole "
                         f"parameters on each rank: it needs {flag} "
                         f"{_names(s for s in STRATEGIES if not s.fsdp)} (got {strategy.name})")
    if schedule.split_backward and not strategy.split_backward:
        raise ValueError(f"{flag} {strategy.name} cannot run the {schedule.name} schedule: it "
                         f"defers weight gradients past the backward whose end FSDP "
                         f"reduce-scatters them at (use 1f1b or interleaved, or {flag} "
                         f"{_names(s for s in STRATEGIES if s.split_backward)})")
    if strategy.fsdp and kind.reducer is not default_reducer:
        raise ValueError(f"--optimizer {kind.name} sends gradients through its own reducer, "
                         f"which FSDP2 does not run: {flag} {strategy.name} cannot go with it "
                         f"(use {_names(s for s in STRATEGIES if not s.fsdp)})")


def check_param_tier(o: OptimizerConfig, strategy: ShardingStrategy,
                     async_save: bool = False) -> None:
    """--param-offload-device needs the parameters sharded between uses on FSDP2 (ZeRO-3),
    its own host placement (not FSDP2's CPUOffloadPolicy) and saves that read the weights
    while they are resident (not --async-save): one ValueError line."""
    flag = f"--param-offload-device {o.param_offload_device}"
    if not (strategy.fsdp and strategy.reshard_after_forward):
        raise ValueError(f"{flag} moves ZeRO-3's sharded parameters: it needs "
                         f"--data-parallel-sharding-strategy "
                         f"{_names(s for s in STRATEGIES if s.fsdp and s.reshard_after_forward)}"
                         f" (got {strategy.name})")
    if o.offload_device == "cpu":
        raise ValueError(f"{flag} cannot go with the cpu optimizer tier, which keeps the "
                         f"sharded parameters in host memory already (FSDP2's "
                         f"CPUOffloadPolicy)")
    if async_save:
        raise ValueError(f"{flag} cannot go with --async-save: a background save would read "
                         f"parameters the tier has moved off")


def _check_across_steps(configs: Configs, schedule: ScheduleKind, pp: int) -> None:
    """The flags a schedule without a flush between steps (2bw) cannot run with: one line."""
    name = f"--pipeline-schedule {schedule.name}"
    if pp < 2:
        raise ValueError(f"{name} pipelines steps over stages: it needs --pp >= 2 (got {pp})")
    if configs.model.num_experts is not None:
        raise ValueError(f"{name} cannot run MoE layers (--num-experts): their per-step "
                         f"statistics would mix two steps")
    if configs.train.progressive_layer_drop:
        raise ValueError(f"{name} cannot run with --progressive-layer-drop: the next step's "
                         f"forwards would draw this step's decisions")


def _names(strategies) -> str:
    """'a, b or c'."""
    names = [s.name for s in strategies]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def global_batch_size(train: TrainConfig, data_parallel_size: int) -> int:
    """Sequences per step: --global-batch-size (default micro batch x DP); ValueError unless a
    multiple of micro batch x DP."""
    micro, dp = train.micro_batch_size, data_parallel_size
    global_batch = train.global_batch_size or micro * dp
    if global_batch % (micro * dp):
        raise ValueError(f"--global-batch-size ({global_batch}) must be divisible by "
                         f"--micro-batch-size ({micro}) x data-parallel size ({dp})")
    return global_batch


def check_sequence_split(seq_length: int, tensor_model_parallel_size: int,
                         sequence_parallel: bool, context_parallel_size: int) -> None:
    """One clear ValueError when --seq-length cannot be split as asked."""
    tp, cp = tensor_model_parallel_size, context_parallel_size
    if sequence_parallel and tp == 1:
        raise ValueError("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if cp > 1 and seq_length % (2 * cp):
        raise ValueError(f"--seq-length ({seq_length}) must be divisible by 2 x "
                         f"--context-parallel-size ({2 * cp}) (load-balanced chunks)")
    if sequence_parallel and (seq_length // cp) % tp:
        raise ValueError(f"--sequence-parallel: --seq-length ({seq_length}) / "
                         f"--context-parallel-size ({cp}) must be divisible by "
                         f"--tensor-model-parallel-size ({tp})")


def _check_model_split(m: ModelConfig, p: ParallelConfig, grid: GridLayout) -> None:
    """The model's layers, heads, FFN and experts over the grid."""
    grid.placement.layers_per_stage(m.num_layers)
    check_attention_split(m.num_attention_heads, m.query_groups, grid.tp)
    if m.ffn_hidden_size % grid.tp:
        raise ValueError(f"--ffn-hidden-size ({m.ffn_hidden_size}) must be divisible by --tp "
                         f"({grid.tp})")
    if grid.cp > 1 and m.attention_dropout:
        raise ValueError(f"--context-parallel-size {grid.cp} needs --attention-dropout 0 "
                         f"(got {m.attention_dropout})")
    if m.mtp_num_layers and grid.cp > 1:
        raise ValueError(f"--mtp-num-layers needs --context-parallel-size 1 (got {grid.cp}): "
                         "the shifted tokens would live on other CP ranks")
    if m.num_experts is None:
        if grid.ep > 1:
            raise ValueError(f"--expert-model-parallel-size {grid.ep} needs --num-experts")
        return
    if m.num_experts % grid.ep:
        raise ValueError(f"--num-experts ({m.num_experts}) must be divisible by "
                         f"--expert-model-parallel-size ({grid.ep})")
    if grid.tp > 1 and grid.ep > 1 and not p.sequence_parallel:  # Megatron's rule
        raise ValueError("--expert-model-parallel-size > 1 with --tensor-model-parallel-size "
                         "> 1 needs --sequence-parallel")
