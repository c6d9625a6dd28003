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
parameters and grads too: `StateBytes.host` of the total is then in host memory.
"""
from dataclasses import dataclass

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
SHARDED = {"no_shard": (), "optim": ("optimizer",), "optim_grads": ("grads", "optimizer"),
           "optim_grads_params": ("params", "grads", "optimizer")}
FSDP_STRATEGIES = ("optim_grads", "optim_grads_params")  # run on torch FSDP2

# Megatron's bytes per parameter on megalite's gradient buffer: (parameters, gradients,
# optimizer states: fp32 main params, fp16's fp32 main grads, Adam m, v).
STATE_BYTES = {"fp32": (4, 4, 8), "bf16": (2, 4, 12), "fp16": (2, 2, 16)}
FSDP_STATE_BYTES = (4, 4, 8)  # fp32 sharded master params, fp32 grads, Adam m, v
OFFLOADED_OPTIMIZER_BYTES = 12  # fp32 master params + Adam m, v in host memory
COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class StateBytes:
    """Bytes of parameters, gradients and optimizer states (per parameter, or of a rank);
    `host` of their total lives in host memory (offload), the rest on the device."""

    params: float
    grads: float
    optimizer: float
    host: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def device(self) -> float:
        return self.total - self.host

    def __mul__(self, count: float) -> "StateBytes":
        return StateBytes(self.params * count, self.grads * count, self.optimizer * count,
                          self.host * count)

    def __add__(self, other: "StateBytes") -> "StateBytes":
        return StateBytes(self.params + other.params, self.grads + other.grads,
                          self.optimizer + other.optimizer, self.host + other.host)


def check_strategy(strategy: str) -> None:
    if strategy not in SHARDED:
        raise ValueError(f"--data-parallel-sharding-strategy must be one of "
                         f"{', '.join(STRATEGIES)} (got {strategy!r})")


def zero_bytes(components: tuple[float, float, float], strategy: str, n: int,
               offloaded: tuple[str, ...] = ()) -> StateBytes:
    """The ZeRO rule: (params, grads, optimizer) bytes per parameter, the components
    `strategy` shards divided by `n`; `offloaded` components count as host bytes."""
    check_strategy(strategy)
    parts = {name: size / n if name in SHARDED[strategy] else size
             for name, size in zip(("params", "grads", "optimizer"), components)}
    return StateBytes(**parts, host=sum(parts[name] for name in offloaded))


def state_bytes_per_param(precision: str, strategy: str = "no_shard", n: int = 1,
                          offload: bool = False) -> StateBytes:
    """Model-state bytes per parameter on one rank, between steps, as megalite holds them:
    fp32 16 / 8 + 8/N, bf16 18 / 6 + 12/N on the gradient buffer (no_shard / optim), 16/N
    under FSDP2 (optim_grads, optim_grads_params) whatever the precision. Offloaded, the
    gradient buffer's optimizer keeps an fp32 master and Adam m, v on the host (12 or 12/N
    bytes, also for fp32 params); FSDP2 keeps all its 16/N there."""
    check_strategy(strategy)
    if strategy in FSDP_STRATEGIES:
        return zero_bytes(FSDP_STATE_BYTES, "optim_grads_params", n,
                          ("params", "grads", "optimizer") if offload else ())
    params, grads, optimizer = STATE_BYTES[precision]
    if offload:  # a host fp32 master copy even of fp32 params, beside Adam m, v
        return zero_bytes((params, grads, OFFLOADED_OPTIMIZER_BYTES), strategy, n,
                          ("optimizer",))
    return zero_bytes((params, grads, optimizer), strategy, n)


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
    check_strategy(strategy)
    if strategy not in FSDP_STRATEGIES:
        return 0
    e, accumulated = COMPUTE_BYTES[precision], 4 * stage_params if microbatches > 1 else 0
    if strategy == "optim_grads_params" and not pipeline:
        return (root + 2 * largest) * e + accumulated
    return stage_params * e + (accumulated or largest * e)


def describe(precision: str, strategy: str, n: int, ep: int, offload: bool, dense: int,
             expert: int, gather: int) -> str:
    """The start-up line: model-state bytes of `dense` params sharded over n ranks and
    `expert` params over n / ep, e.g. 'model state per rank: 110.0 MiB (12 B/param, sharding
    optim over 2 ranks); 20.0 MiB of it in host memory; + 10.0 MiB of gathered parameters
    at the peak'."""
    state = state_bytes_per_param(precision, strategy, n, offload) * dense \
        + state_bytes_per_param(precision, strategy, n // ep, offload) * expert
    mib = 2 ** 20
    per_param = state.total / (dense + expert)
    line = (f"model state per rank: {state.total / mib:,.1f} MiB ({per_param:.4g} B/param, "
            f"sharding {strategy} over {n} rank{'s' if n > 1 else ''})")
    if state.host:
        line += f"; {state.host / mib:,.1f} MiB of it in host memory"
    if gather:
        line += f"; + {gather / mib:,.1f} MiB of gathered parameters at the peak"
    return line
