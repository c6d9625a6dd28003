"""0/1 Adam (`--optimizer zero_one_adam`; Lu et al. 2022, arXiv 2202.06009, DeepSpeed's
ZeroOneAdam): Adam whose variance is updated only on steps that grow exponentially apart,
whose other steps average the grads 1-bit compressed, and which after `--var-freeze-step`
takes local steps on each DP rank, averaging the accumulated update 1-bit compressed on an
interval that grows too. F = var freeze step, t the step (from 1), lr the step's rate:

    variance steps (t <= F, `variance_step`): the interval starts at 1 and doubles after every
        `--var-update-scaler` variance steps; on them the grads are all-reduced in fp32 and
        v = beta2 v + (1 - beta2) g^2; on the other steps t <= F, g = the 1-bit average
    t <= F: m = lerp(m, g, 1 - beta1); p -= lr (m / (sqrt(v) + eps) + wd p)
    t > F (v frozen; each rank its own grads g_r, no DP traffic): at t = F + 1 the anchor
        a = p (the same on every rank) and the error buffers restart at 0; then
        m = lerp(m, g_r, 1 - beta1); s += lr; p -= lr (m / (sqrt(v) + eps) + wd p)
    synchronisation (t > F, `sync_step`: the interval starts at 1, doubles after every
        `--local-step-scaler` steps, at most `--local-step-clipper`; t a multiple of it):
        u = the 1-bit average of (p - a) (sqrt(v) + eps); m = -u / s;
        p = a = a + u / (sqrt(v) + eps); s = 0

Elements whose variance is 0 (no nonzero grad on any variance step yet: vocabulary padding
rows, tokens not seen) keep m = 0 and take no part of u: a 1-bit value there would step by
1 / eps (DeepSpeed's user-given exp_avg_mask, derived here). No bias correction (as
DeepSpeed). Between synchronisations p and m differ across DP ranks; a, v and s do not.
Each DP bucket's `ZeroOneReducer` (the megalite.distributed.reducers seam) moves the grads
of the steps t <= F and holds the bucket's compressed all-reduce, with which the optimizer
synchronises the bucket's elements (`attach` tells it where they are).
Differences from DeepSpeed: its first step only initialises (no update), which shifts its
counts by one; it recovers the anchor as p minus the accumulated update (rounding apart on
each rank), here the anchor is kept (4 bytes per parameter) so that every DP rank holds the
same bits after a synchronisation; a 1-bit scale per piece of a tensor in a chunk of a DP
bucket (megalite.distributed.compressed; DeepSpeed: one per tensor at the worker).
Needs whole parameters on every DP rank: no ZeRO (`check_zero_one_run`).
"""
from collections.abc import Callable

import torch

from megalite.config.sharding import sharding_strategy
from megalite.distributed.compressed import CompressedAllReduce
from megalite.distributed.reducers import GradReducer
from megalite.mpu import comm
from megalite.optimizer.onebit import check_compressed_run


def variance_step(step: int, scaler: int) -> bool:
    """Whether step `step` (from 1) updates the variance: every step of the first `scaler`,
    then every 2nd for `scaler` more, every 4th, ... (0/1 Adam's T_v; below the freeze)."""
    last, interval = 0, 1  # the last step of the previous interval's run
    while step > (end := (last // interval + scaler) * interval):
        last, interval = end, 2 * interval
    return step % interval == 0


def sync_step(step: int, freeze: int, scaler: int, clipper: int) -> bool:
    """Whether step `step` > `freeze` synchronises: its interval is 1 for the first `scaler`
    steps after the freeze, then doubles every `scaler` steps up to `clipper` (T_u)."""
    return step % min(clipper, 2 ** ((step - freeze - 1) // scaler)) == 0


class ZeroOneReducer(GradReducer):
    """One DP bucket under 0/1 Adam (module docstring). After `start` the bucket's flat grads
    hold the fp32 mean (variance steps), the 1-bit mean (other steps up to the freeze) or
    this rank's own grads (after it). `sync` averages the optimizer's accumulated update
    with the same compressed all-reduce. `local`, set by ZeroOneAdam.attach, reads and writes
    the bucket's per-rank params and momentum (they differ across DP after the freeze; each
    rank's checkpoint state file keeps them)."""

    def __init__(self, sharded: bool, freeze: int, var_scaler: int, local_scaler: int,
                 local_clipper: int, block: int = 0) -> None:
        self.freeze, self.var_scaler, self.block = freeze, var_scaler, block
        self.local_scaler, self.local_clipper = local_scaler, local_clipper
        self.steps = 0
        self.compressor: CompressedAllReduce | None = None
        self.sizes: list[int] | None = None  # the bucket's tensors (set_tensor_sizes)
        self.local: tuple[Callable[[], dict], Callable[[dict], None]] | None = None

    def set_tensor_sizes(self, sizes: list[int]) -> None:
        self.sizes = sizes

    def stage(self) -> str:
        step = self.steps + 1
        if step <= self.freeze:
            return "fp32" if variance_step(step, self.var_scaler) else "1-bit"
        return "1-bit" if sync_step(step, self.freeze, self.local_scaler,
                                    self.local_clipper) else "local"

    def stage_bytes(self, n: int, world: int) -> dict[str, int]:
        return {"fp32": 4 * n, "local": 0,
                "1-bit": CompressedAllReduce.payload_bytes(n, world, self.sizes, self.block)}

    def _compress(self, flat: torch.Tensor, group) -> None:
        if self.compressor is None:
            self.compressor = CompressedAllReduce(flat.numel(), comm.world_size(group),
                                                  flat.device, self.sizes, self.block)
        self.compressor(flat, group)

    def start(self, flat: torch.Tensor, group) -> None:
        step, world = self.steps + 1, comm.world_size(group)
        self.steps = step
        if step <= self.freeze and variance_step(step, self.var_scaler):
            comm.all_reduce(flat, group)
            return None
        flat.mul_(world)  # the bucket divided this rank's grads by the group size
        if step <= self.freeze:
            self._compress(flat, group)
        elif step == self.freeze + 1 and self.compressor is not None:
            self.compressor.worker_error.zero_()  # they held grads, now accumulated updates
            self.compressor.server_error.zero_()
        return None

    def sync(self, flat: torch.Tensor, group) -> None:
        """Replace `flat` (the bucket's accumulated update) by its 1-bit average over `group`."""
        self._compress(flat, group)

    def state_dict(self) -> dict:
        state = {"steps": self.steps}
        if self.compressor is not None:
            state.update(elements=self.compressor.n, worker_error=self.compressor.worker_error,
                         server_error=self.compressor.server_error)
        if self.local is not None and self.steps > self.freeze:
            state["local"] = self.local[0]()
        return state

    def restart(self, steps: int, optimizer_state) -> None:
        """Errors at 0; the params and momentum are the checkpoint's (between two
        synchronisations: each piece as the DP rank that wrote it had it)."""
        self.steps, self.compressor = steps, None

    def load_state_dict(self, state: dict, group) -> None:
        self.steps, self.compressor = state["steps"], None
        if "worker_error" in state:
            self.compressor = CompressedAllReduce(state["elements"], comm.world_size(group),
                                                  state["worker_error"].device, self.sizes,
                                                  self.block)
            self.compressor.worker_error.copy_(state["worker_error"])
            self.compressor.server_error.copy_(state["server_error"])
        if "local" in state and self.local is not None:
            self.local[1](state["local"])


class ZeroOneAdam(torch.optim.Optimizer):
    """0/1 Adam over whole parameters (module docstring). Each param's grad must be what its
    DP bucket's ZeroOneReducer left. State per param: step and lr_sum (s; float tensors),
    exp_avg, exp_avg_sq, anchor."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float,
                 var_freeze_step: int, var_update_scaler: int = 16,
                 local_step_scaler: int = 32678, local_step_clipper: int = 16,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.freeze, self.var_scaler = var_freeze_step, var_update_scaler
        self.local_scaler, self.local_clipper = local_step_scaler, local_step_clipper
        self.buckets: list | None = None  # [(bucket, [(fragment, start, end) in it])]

    @staticmethod
    def attach(optimizer: "ZeroOneAdam", owner) -> None:
        """Read from `owner` (a MixedPrecisionOptimizer over DDP chunks, no ZeRO: every
        fragment a whole param) which bucket holds each fragment, and where; give each
        bucket's reducer its `local` read and write of the per-rank params and momentum."""
        optimizer.buckets = []
        for chunk in owner.model_chunks:
            for buffer in chunk.grad_buffers:
                for bucket in buffer.buckets:
                    members = set(bucket.params)
                    entries = []
                    for f in owner.fragments:
                        if f.model_param in members:
                            start = buffer.ranges[f.model_param][0] - bucket.start
                            entries.append((f, start, start + f.main.numel()))
                    optimizer.buckets.append((bucket, entries))
                    bucket.reducer.local = (
                        lambda b=bucket, e=entries: optimizer._read_local(b, e),
                        lambda state, e=entries: optimizer._write_local(state, e))

    @torch.no_grad()
    def step(self, closure=None) -> None:
        assert closure is None, "ZeroOneAdam takes no closure"
        step = None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state.update(step=torch.tensor(0.0), lr_sum=torch.tensor(0.0),
                                 exp_avg=torch.zeros_like(param),
                                 exp_avg_sq=torch.zeros_like(param),
                                 anchor=torch.zeros_like(param))
                state["step"] += 1
                step, grad = int(state["step"]), param.grad
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.lerp_(grad, 1 - beta1)
                if step <= self.freeze and variance_step(step, self.var_scaler):
                    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                exp_avg.mul_(exp_avg_sq > 0)  # v = 0: no step of m / eps (docstring)
                if step == self.freeze + 1:
                    state["anchor"].copy_(param)
                    state["lr_sum"].zero_()
                if step > self.freeze:
                    state["lr_sum"] += lr
                update = exp_avg / (exp_avg_sq.sqrt() + eps)
                if wd > 0:
                    update.add_(param, alpha=wd)
                param.add_(update, alpha=-lr)
        if step is not None and step > self.freeze and sync_step(
                step, self.freeze, self.local_scaler, self.local_clipper):
            self._synchronise()

    def _synchronise(self) -> None:
        """Every bucket: its accumulated update (p - a)(sqrt(v) + eps), 1-bit averaged over
        the bucket's DP group (counted in the bucket's bytes), sets m, p and a (docstring)."""
        assert self.buckets is not None, "ZeroOneAdam synchronises through attach's buckets"
        eps = self.defaults["eps"]
        for bucket, entries in self.buckets:
            flat = torch.zeros(bucket.end - bucket.start, device=bucket.grad_data.device)
            for f, a, b in entries:
                state = self.state[f.main]
                flat[a:b] = ((f.main - state["anchor"]) * (state["exp_avg_sq"].sqrt() + eps)
                             ).view(-1)
            with comm.count_bytes() as moved:
                bucket.reducer.sync(flat, bucket.group)
            bucket.bytes_sent += sum(moved.values())
            for f, a, b in entries:
                state = self.state[f.main]
                averaged = flat[a:b].view_as(f.main) * (state["exp_avg_sq"] > 0)
                state["exp_avg"].copy_(averaged / -state["lr_sum"])
                f.main.copy_(state["anchor"] + averaged / (state["exp_avg_sq"].sqrt() + eps))
                state["anchor"].copy_(f.main)
                state["lr_sum"].zero_()

    def _read_local(self, bucket, entries: list) -> dict:
        """This rank's params and momentum of `bucket`, flat in its layout."""
        out = {key: torch.zeros(bucket.end - bucket.start, device=bucket.grad_data.device)
               for key in ("params", "exp_avg")}
        for f, a, b in entries:
            out["params"][a:b] = f.main.view(-1)
            out["exp_avg"][a:b] = self.state[f.main]["exp_avg"].view(-1)
        return out

    @torch.no_grad()
    def _write_local(self, local: dict, entries: list) -> None:
        """`_read_local`'s output back into the masters, the model params and the momentum."""
        for f, a, b in entries:
            f.main.copy_(local["params"][a:b].view_as(f.main))
            self.state[f.main]["exp_avg"].copy_(local["exp_avg"][a:b].view_as(f.main))
            if f.target is not None:
                f.target.copy_(f.main)


def build_zero_one_adam(groups: list[dict], config) -> torch.optim.Optimizer:
    return ZeroOneAdam(groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                       eps=config.adam_eps, var_freeze_step=config.var_freeze_step,
                       var_update_scaler=config.var_update_scaler,
                       local_step_scaler=config.local_step_scaler,
                       local_step_clipper=config.local_step_clipper)


def zero_one_reducer_settings(config) -> dict:
    """ZeroOneReducer's keywords from an OptimizerConfig."""
    return {"freeze": config.var_freeze_step, "var_scaler": config.var_update_scaler,
            "local_scaler": config.local_step_scaler, "local_clipper": config.local_step_clipper,
            "block": config.onebit_block_size}


def check_zero_one_run(configs, data_parallel_size: int) -> None:
    """The 1-bit family's refusals (megalite.optimizer.onebit.check_compressed_run) with
    `--var-freeze-step`, and any sharding of the optimizer over DP."""
    o = configs.optimizer
    check_compressed_run(configs, data_parallel_size, "--var-freeze-step", o.var_freeze_step)
    if sharding_strategy(o.sharding).shards_optimizer:
        raise ValueError(f"--optimizer zero_one_adam cannot shard the optimizer over DP "
                         f"(--data-parallel-sharding-strategy {o.sharding}): its local steps "
                         f"update every parameter on every DP rank from that rank's own grads, "
                         f"so each rank needs whole masters and moments (use no_shard)")
