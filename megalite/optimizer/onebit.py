"""1-bit Adam (`--optimizer onebit_adam`; Tang et al. 2021, arXiv 2102.02888, DeepSpeed's
OnebitAdam): AdamW for `--freeze-step` warm-up steps, then the variance frozen and the
momentum, not the grads, averaged over data parallelism by the 1-bit compressed all-reduce
with error feedback (megalite.distributed.compressed).

The work follows megalite's seam (megalite.distributed.reducers). Each DP bucket's reducer,
`MomentumReducer`, keeps the bucket's momentum m [n] (identical on every rank of its group):

    warm-up (its steps 1 .. freeze_step): all-reduce the grads (every element, also in a
        ZeRO-1 bucket); m = lerp(m, mean grad, 1 - beta1) - AdamW's exp_avg, computed twice
    compressed stage: m_r = lerp(m, g_r, 1 - beta1) from this rank's own grad g_r;
        m = the 1-bit average of the m_r over the group; the bucket's grads become m

`OnebitAdam` steps the masters: torch AdamW's arithmetic (foreach=False) in the warm-up, and
after it exp_avg = the grad it is handed (the averaged momentum) with exp_avg_sq frozen:

    p = p (1 - lr wd) - lr / (1 - beta1^t) * exp_avg / (sqrt(exp_avg_sq / (1 - beta2^F)) + eps)

(F = freeze step: the frozen variance keeps its bias correction). ZeRO-1 steps only this
rank's shard of the masters and of exp_avg, exp_avg_sq, as the distributed optimizer does;
the reducer's momentum and worker error are full-size on every rank (each rank compresses
its own m_r), the server error 1/DP. Both sides count steps from the start of the run.
"""
import torch

from megalite.distributed.compressed import CompressedAllReduce
from megalite.distributed.reducers import GradReducer
from megalite.mpu import comm


class MomentumReducer(GradReducer):
    """One DP bucket's reduction under a 1-bit optimizer (module docstring); synchronous.
    After it the bucket's flat grads hold, in every element, the mean grads (warm-up) or the
    1-bit averaged momentum (compressed stage)."""

    def __init__(self, sharded: bool, beta1: float, freeze_step: int, block: int = 0) -> None:
        self.beta1, self.freeze_step, self.block = beta1, freeze_step, block
        self.steps = 0
        self.momentum: torch.Tensor | None = None
        self.compressor: CompressedAllReduce | None = None
        self.sizes: list[int] | None = None  # the bucket's tensors (set_tensor_sizes)

    def compressing(self) -> bool:
        """Whether the next step is in the compressed stage."""
        return self.steps >= self.freeze_step

    def set_tensor_sizes(self, sizes: list[int]) -> None:
        self.sizes = sizes

    def stage(self) -> str:
        return "compressed" if self.compressing() else "warm-up"

    def stage_bytes(self, n: int, world: int) -> dict[str, int]:
        return {"warm-up": 4 * n,
                "compressed": CompressedAllReduce.payload_bytes(n, world, self.sizes,
                                                                self.block)}

    def start(self, flat: torch.Tensor, group) -> None:
        world = comm.world_size(group)
        if self.momentum is None:
            self.momentum = torch.zeros_like(flat)
        if self.compressor is None:
            self.compressor = CompressedAllReduce(flat.numel(), world, flat.device,
                                                  self.sizes, self.block)
        if not self.compressing():
            comm.all_reduce(flat, group)
            self.momentum.lerp_(flat, 1 - self.beta1)
        else:  # the bucket divided this rank's grads by the group size: g_r = flat * world
            self.momentum.lerp_(flat * world, 1 - self.beta1)
            self.compressor(self.momentum, group)
            flat.copy_(self.momentum)
        self.steps += 1
        return None

    def state_dict(self) -> dict:
        state = {"steps": self.steps}
        if self.momentum is not None:
            state["momentum"] = self.momentum
        if self.compressor is not None:
            state.update(worker_error=self.compressor.worker_error,
                         server_error=self.compressor.server_error)
        return state

    def restart(self, steps: int, optimizer_state) -> None:
        """The momentum is the optimizer's exp_avg (the same on every DP rank), the errors 0."""
        self.steps, self.momentum, self.compressor = steps, optimizer_state("exp_avg"), None

    def load_state_dict(self, state: dict, group) -> None:
        self.steps = state["steps"]
        self.momentum = state["momentum"].clone() if "momentum" in state else None
        self.compressor = None
        if "worker_error" in state:
            self.compressor = CompressedAllReduce(self.momentum.numel(), comm.world_size(group),
                                                  self.momentum.device, self.sizes, self.block)
            self.compressor.worker_error.copy_(state["worker_error"])
            self.compressor.server_error.copy_(state["server_error"])


class OnebitAdam(torch.optim.Optimizer):
    """AdamW for `freeze_step` steps, then the compressed stage (module docstring). Each
    param's grad must be what its DP bucket's MomentumReducer left: the mean grads, then the
    averaged momentum. State per param: step (a float tensor), exp_avg, exp_avg_sq."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float = 0.0, freeze_step: int = 100) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      freeze_step=freeze_step))

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            freeze = group["freeze_step"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
                state["step"] += 1
                step, grad = float(state["step"]), param.grad
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                param.mul_(1 - lr * wd)
                if step <= freeze:
                    exp_avg.lerp_(grad, 1 - beta1)
                    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                else:
                    exp_avg.copy_(grad)
                bias_correction2 = 1 - beta2 ** min(step, freeze)
                denom = (exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(eps)
                param.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1 ** step))


def build_onebit_adam(groups: list[dict], config) -> torch.optim.Optimizer:
    return OnebitAdam(groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                      eps=config.adam_eps, freeze_step=config.freeze_step)


def momentum_reducer_settings(config) -> dict:
    """MomentumReducer's keywords from an OptimizerConfig."""
    return {"beta1": config.adam_beta1, "freeze_step": config.freeze_step,
            "block": config.onebit_block_size}


def check_onebit_run(configs, data_parallel_size: int) -> None:
    """`check_compressed_run` with `--freeze-step`."""
    check_compressed_run(configs, data_parallel_size, "--freeze-step",
                         configs.optimizer.freeze_step)


def check_compressed_run(configs, data_parallel_size: int, freeze_flag: str, freeze: int
                         ) -> None:
    """ValueError (one line naming the flag) for a run a 1-bit optimizer cannot make: no DP to
    compress, a warm-up (`freeze_flag` = `freeze` steps) as long as the run, a grad norm to
    clip (after the warm-up the DP reduction carries the momentum or nothing), fp16 (a
    skipped step would put the reducers' step count out of step with the optimizer's), MoE
    experts (reduced over another group). TP is fine: TP-replicated params get buckets of
    their own (OptimizerKind.replicas_apart)."""
    o, name = configs.optimizer, f"--optimizer {configs.optimizer.optimizer}"
    if data_parallel_size < 2:
        raise ValueError(f"{name} compresses the data-parallel reduction: it needs DP x CP >= 2 "
                         f"(got {data_parallel_size}; use adam)")
    if freeze >= configs.train.train_iters:
        raise ValueError(f"{freeze_flag} ({freeze}) must be below --train-iters "
                         f"({configs.train.train_iters}): the run would never leave {name}'s "
                         f"warm-up")
    if o.clip_grad > 0:
        raise ValueError(f"{name} does not send the grads over DP after its warm-up (1-bit "
                         f"momentum or local steps): there is no global grad norm to clip by "
                         f"(pass --clip-grad 0)")
    if configs.precision.fp16:
        raise ValueError(f"{name} cannot go with --fp16: a step skipped for overflow would "
                         f"desynchronise its compression stage (use --bf16)")
    if configs.model.num_experts is not None:
        raise ValueError(f"{name} cannot go with --num-experts: expert grads are reduced over "
                         f"the expert-data-parallel group, which its reducer does not handle")
