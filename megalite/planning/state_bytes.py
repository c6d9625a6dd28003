"""Bytes of the model state per parameter per rank under each data-parallel sharding strategy.

The ZeRO rule (Rajbhandari et al. 2020): a strategy divides the components it shards -
`optim` the optimizer state, `optim_grads` also the gradients, `optim_grads_params` also the
parameters - by N, the ranks they are sharded over (DP x CP; experts over expert-DP). With
the paper's components (2-byte params and grads, 12 bytes of fp32 master + Adam m, v) that
is 2 + 2 + 12, 4 + 12/N, 2 + 14/N, 16/N; with fp32 (4 + 4 + 8) 16, 8 + 8/N, 4 + 12/N, 16/N.

What megalite holds: `no_shard` and `optim` run on megalite's gradient buffer, which
accumulates fp32 grads (Megatron's table: bf16 2 + 4 + 12). `optim_grads` and
`optim_grads_params` run on torch FSDP2: the sharded parameter is the fp32 master itself and
grads reduce (and stay) in fp32, so every precision keeps 4 + 4 + 8 sharded, 16/N, and
gathers compute-dtype copies of the parameters (`gather_bytes`). `--optimizer-cpu-offload`
moves the optimizer state to host memory, and under FSDP2 (CPUOffloadPolicy) the sharded
parameters and grads too: `StateBytes.host` of the total is then in host memory. The nvme
tier (`--optimizer-offload-device nvme`, megalite.optimizer.nvme_tier) moves the optimizer's
state and its separate fp32 masters (bf16/fp16 on the grad buffer) to a file:
`StateBytes.nvme`; host memory holds its buffers (`tier_host_bytes`), not per parameter.
The parameter tier (`--param-offload-device`, ZeRO-3, megalite.distributed.param_tier) moves
the sharded parameters (4/N) to host memory (cpu) or its file (nvme); the device keeps the
shards of the units in flight, counted with the gathered parameters (`gather_bytes`).

What a strategy shards, whether FSDP2 runs it and what offload moves are the fields of its
megalite.config.sharding record; the optimizer's state bytes (AdamW's m, v: 8; SGD's momentum: 4)
its megalite.optimizer.kinds record's.
"""
from dataclasses import dataclass

from megalite.config import OptimizerConfig
from megalite.optimizer.kinds import optimizer_kind
from megalite.config.sharding import NO_SHARD, ShardingStrategy, sharding_strategy

FP32 = 4
# Bytes per parameter of the model's parameters and of their grads in megalite's gradient
# buffer (Megatron's table; fp32 grads but for fp16's).
PARAM_GRAD_BYTES = {"fp32": (4, 4), "bf16": (2, 4), "fp16": (2, 2)}
# The optimizer's fp32 copies beside its state: masters (bf16, fp16) and fp16's fp32 grads.
MASTER_BYTES = {"fp32": 0, "bf16": 4, "fp16": 8}
COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class StateBytes:
    """Bytes of parameters, gradients and optimizer states (per parameter, or of a rank);
    `host` of their total lives in host memory (offload), the rest on the device."""

    params: float
    grads: float
    optimizer: float
    host: float = 0.0
    nvme: float = 0.0  # in the nvme tier's file

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def device(self) -> float:
        return self.total - self.host - self.nvme

    def __mul__(self, count: float) -> "StateBytes":
        return StateBytes(self.params * count, self.grads * count, self.optimizer * count,
                          self.host * count, self.nvme * count)

    def __add__(self, other: "StateBytes") -> "StateBytes":
        return StateBytes(self.params + other.params, self.grads + other.grads,
                          self.optimizer + other.optimizer, self.host + other.host,
                          self.nvme + other.nvme)


def optimizer_state_bytes(optimizer: OptimizerConfig | None = None) -> int:
    """Optimizer state bytes per parameter of --optimizer's record (default AdamW: m, v)."""
    config = optimizer or OptimizerConfig()
    return optimizer_kind(config.optimizer).state_bytes(config)


def held_components(precision: str, strategy: ShardingStrategy, offload: bool,
                    state: int) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per parameter as megalite holds them, unsharded: under
    FSDP2 fp32 masters as the parameters and fp32 grads; on the grad buffer the model's
    parameters and buffer grads, and the optimizer's copies (offloaded: an fp32 master on
    the host even of fp32 params) beside its `state`."""
    if strategy.fsdp:
        return FP32, FP32, state
    params, grads = PARAM_GRAD_BYTES[precision]
    return params, grads, (FP32 if offload else MASTER_BYTES[precision]) + state


def zero_bytes(components: tuple[float, float, float], strategy: str, n: int,
               offloaded: tuple[str, ...] = ()) -> StateBytes:
    """The ZeRO rule: (params, grads, optimizer) bytes per parameter, the components
    `strategy` shards divided by `n`; `offloaded` components count as host bytes."""
    parts = sharding_strategy(strategy).bytes_per_param(*components, n)
    return StateBytes(**parts, host=sum(parts[name] for name in offloaded))


def state_bytes_per_param(precision: str, strategy: str = NO_SHARD.name, n: int = 1,
                          offload: bool = False, optimizer: OptimizerConfig | None = None,
                          nvme: bool = False, param_tier: str = "none") -> StateBytes:
    """Model-state bytes per parameter on one rank, between steps, as megalite holds them
    (`optimizer`: whose state, default AdamW's 8 bytes): fp32 16 / 8 + 8/N, bf16 18 / 6 +
    12/N on the gradient buffer (no_shard / optim), 16/N under FSDP2 (optim_grads,
    optim_grads_params) whatever the precision. Offloaded, the gradient buffer's optimizer
    keeps an fp32 master and Adam m, v on the host (12 or 12/N bytes, also for fp32
    params); FSDP2 keeps all its 16/N there. The optimizer kind's reducer state (1-bit
    family: 8 + 4/N) is added to the optimizer's, on the device and unsharded. `nvme`: the
    optimizer's state, and its fp32 masters where they are a copy (bf16/fp16 on the grad
    buffer), in files: 12/N bf16, 8/N fp32 or under FSDP2 (its sharded parameters are the
    masters). `param_tier` cpu / nvme: the parameters' bytes in host memory / files."""
    record = sharding_strategy(strategy)
    state = optimizer_state_bytes(optimizer)
    components = held_components(precision, record, offload, state)
    parts = record.bytes_per_param(*components, n, held=True)
    parts["optimizer"] += optimizer_kind((optimizer or OptimizerConfig()).optimizer
                                         ).reducer_bytes(n)
    in_file = 0.0
    if nvme:
        masters = 0 if record.fsdp or precision == "fp32" else FP32
        in_file = (masters + state) / (n if record.shards_optimizer else 1)
    host = sum(parts[c] for c in record.offloaded) if offload else 0.0
    if param_tier == "cpu":
        host += parts["params"]
    elif param_tier == "nvme":
        in_file += parts["params"]
    return StateBytes(**parts, host=host, nvme=in_file)


def tier_host_bytes(sub_group_size: int, optimizer: OptimizerConfig | None = None) -> int:
    """Host memory of the nvme tier's buffers: 3 sub-groups of `sub_group_size` parameters,
    each an fp32 master, state and grad (megalite.optimizer.nvme_tier)."""
    return 3 * sub_group_size * (2 * FP32 + optimizer_state_bytes(optimizer))


def gather_bytes(precision: str, strategy: str, stage_params: int, root: int, largest: int,
                 pipeline: bool, microbatches: int = 1) -> int:
    """Device bytes of FSDP's gathered (unsharded) parameters and unsharded grads at the
    step's peak on one rank, in the compute dtype. ZeRO-3: the root unit (`root` params,
    gathered from its forward to its backward, which span all the others) and the `largest`
    other unit twice - the one computing and the next one prefetched, or in backward its
    own unsharded grads. ZeRO-2, and ZeRO-3 under PP (parameters stay gathered across the
    microbatches of a step): the whole stage from forward to backward, and the largest
    unit's unsharded grads before their reduce-scatter - or, with several microbatches,
    whose grads are reduced once per step, the stage's unsharded grads accumulated in fp32
    (in every strategy). Nothing for no_shard and optim (ZeRO-1 gathers into the
    parameters themselves)."""
    record = sharding_strategy(strategy)
    if not record.fsdp:
        return 0
    e, accumulated = COMPUTE_BYTES[precision], FP32 * stage_params if microbatches > 1 else 0
    if record.reshard_after_forward and not pipeline:
        return (root + 2 * largest) * e + accumulated
    return stage_params * e + (accumulated or largest * e)


def describe(precision: str, strategy: str, n: int, ep: int, offload: bool, dense: int,
             expert: int, gather: int, optimizer: OptimizerConfig | None = None,
             param_tier: str = "none") -> str:
    """The start-up line: model-state bytes of `dense` params sharded over n ranks and
    `expert` params over n / ep, e.g. 'model state per rank: 110.0 MiB (12 B/param, sharding
    optim over 2 ranks); 20.0 MiB of it in host memory; + 10.0 MiB of gathered parameters
    at the peak'; with `optimizer`, its name after the sharding ('..., optimizer muon');
    with `param_tier`, where the parameters are between uses ('; parameters in nvme ...')."""
    nvme = optimizer is not None and optimizer.offload_device == "nvme"
    state = state_bytes_per_param(precision, strategy, n, offload, optimizer, nvme,
                                  param_tier) * dense \
        + state_bytes_per_param(precision, strategy, n // ep, offload, optimizer, nvme,
                                param_tier) * expert
    mib = 2 ** 20
    per_param = state.total / (dense + expert)
    named = f", optimizer {optimizer.optimizer}" if optimizer is not None else ""
    line = (f"model state per rank: {state.total / mib:,.1f} MiB ({per_param:.4g} B/param, "
            f"sharding {strategy} over {n} rank{'s' if n > 1 else ''}{named})")
    if state.host:
        line += f"; {state.host / mib:,.1f} MiB of it in host memory"
    if state.nvme:
        line += f"; {state.nvme / mib:,.1f} MiB of it in files under --offload-nvme-path"
    if nvme:
        buffers = tier_host_bytes(optimizer.offload_sub_group_size, optimizer)
        line += f" (nvme tier; {buffers / mib:,.1f} MiB of host buffers)"
    if param_tier != "none":
        line += f"; parameters between uses in {param_tier} (param tier)"
    if gather:
        line += f"; + {gather / mib:,.1f} MiB of gathered parameters at the peak"
    return line
