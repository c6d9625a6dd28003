"""The mixed-precision optimizer: fp32 main params stepped with the DDP buffer's fp32 grads.

bf16/fp16 model params get an fp32 main copy; the torch optimizer steps the copies and
the result is copied back (rounded) into the model params. fp32 params are their own
main params (no copy). fp16 adds loss scaling: grads are unscaled and checked for
inf/NaN, and an overflow anywhere skips the step everywhere.
"""
from dataclasses import dataclass

import torch
from torch import nn

from megalite.config import OptimizerConfig, PrecisionConfig
from megalite.mpu import parallel_state
from megalite.optimizer.grad_scaler import build_grad_scaler
from megalite.optimizer.grad_stats import counts_toward_norm, found_inf_anywhere, global_grad_norm


@dataclass
class Fragment:
    """A piece of one model parameter that this rank's optimizer updates.

    main: fp32 values the torch optimizer steps (aliases the model param when it is fp32);
    grad: its fp32 grad, a view into the DDP buffer; target: the model-dtype view the
    stepped values are copied into, None when `main` aliases it.
    """

    model_param: nn.Parameter
    main: torch.Tensor
    grad: torch.Tensor
    target: torch.Tensor | None

    @classmethod
    def of(cls, model_param: nn.Parameter, values: torch.Tensor,
           grad: torch.Tensor) -> "Fragment":
        """`values` is (a view of) the model param's data."""
        if values.dtype == torch.float32:
            return cls(model_param, values, grad, None)
        return cls(model_param, values.float(), grad, values)


def build_torch_optimizer(config: OptimizerConfig,
                          fragments: list[Fragment]) -> torch.optim.Optimizer:
    """AdamW (apex FusedAdam on CUDA if importable, else torch fused where the device has it,
    else foreach) or SGD, over two groups: with weight decay, and without for 1-D params
    (biases, norms)."""
    groups = [{"params": [f.main for f in fragments if f.model_param.ndim > 1],
               "weight_decay": config.weight_decay},
              {"params": [f.main for f in fragments if f.model_param.ndim <= 1],
               "weight_decay": 0.0}]
    if config.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.sgd_momentum)
    kw = dict(lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps)
    if fragments and fragments[0].main.is_cuda:
        try:
            from apex.optimizers import FusedAdam
            return FusedAdam(groups, adam_w_mode=True, **kw)
        except ImportError:
            pass
    try:
        return torch.optim.AdamW(groups, fused=True, **kw)
    except RuntimeError:  # the device has no fused kernel
        return torch.optim.AdamW(groups, foreach=True, **kw)


class MixedPrecisionOptimizer:
    """Steps the params of `model_chunks` (DistributedDataParallel-wrapped: grads are read from
    `param.main_grad`). `step()` -> (stepped, grad norm or None when clipping is off)."""

    def __init__(self, model_chunks: list[nn.Module], config: OptimizerConfig,
                 precision: PrecisionConfig) -> None:
        self.model_chunks, self.clip_grad = model_chunks, config.clip_grad
        self.scaler = build_grad_scaler(precision)
        self.fragments = self._build_fragments()
        self.optimizer = build_torch_optimizer(config, self.fragments)

    def _build_fragments(self) -> list[Fragment]:
        return [Fragment.of(p, p.detach(), p.main_grad)
                for chunk in self.model_chunks for p in chunk.parameters() if p.requires_grad]

    def _stats_groups(self) -> list:
        """Where grad statistics are reduced: every rank of this model replica."""
        return [parallel_state.get_model_parallel_group()]

    def _expert_stats_groups(self) -> list:
        """Where the experts' part is reduced first: the EP group (other experts)."""
        return [parallel_state.get_expert_model_parallel_group()]

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def loss_scale(self) -> float:
        """Multiply the loss by this before backward (1.0 without fp16 loss scaling)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def zero_grad(self) -> None:
        """Drop the main params' grad links (the buffer itself is zeroed by zero_grad_buffer)."""
        for f in self.fragments:
            f.main.grad = None

    def _device(self) -> torch.device:
        return self.fragments[0].grad.device if self.fragments else torch.device("cpu")

    def _unscale_and_check(self) -> bool:
        """Divide the grads by the loss scale; True if any rank found inf/NaN."""
        found_inf = torch.zeros(1, dtype=torch.float32, device=self._device())
        if self.fragments:
            inv_scale = torch.full((1,), 1.0 / self.scaler.scale, device=self._device())
            torch._amp_foreach_non_finite_check_and_unscale_(
                [f.grad for f in self.fragments], found_inf, inv_scale)
        return found_inf_anywhere(found_inf, self._expert_stats_groups() + self._stats_groups())

    @torch.no_grad()
    def step(self) -> tuple[bool, float | None]:
        """Unscale and check (fp16), clip, step, copy back. Returns (stepped, grad norm)."""
        for f in self.fragments:
            f.main.grad = f.grad
        if self.scaler is not None:
            found_inf = self._unscale_and_check()
            self.scaler.update(found_inf)
            if found_inf:
                return False, None
        grad_norm = None
        if self.clip_grad > 0:
            counted = [f for f in self.fragments if counts_toward_norm(f.model_param)]
            expert = [getattr(f.model_param, "expert_parallel", False) for f in counted]
            grad_norm = global_grad_norm(
                [f.grad for f, e in zip(counted, expert) if not e], self._stats_groups(),
                self._device(), [f.grad for f, e in zip(counted, expert) if e],
                self._expert_stats_groups())
            if not self.clip_grad / (grad_norm + 1e-6) >= 1.0:  # scale only when clipping (or NaN)
                torch.nn.utils.clip_grads_with_norm_([f.main for f in self.fragments],
                                                     self.clip_grad, torch.tensor(grad_norm))
        self.optimizer.step()
        self._copy_main_to_model()
        return True, grad_norm

    def _copy_main_to_model(self) -> None:
        pairs = [(f.target, f.main) for f in self.fragments if f.target is not None]
        if pairs:
            torch._foreach_copy_(*map(list, zip(*pairs)))

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Refresh the fp32 main params from the model params (after loading weights)."""
        for f in self.fragments:
            if f.target is not None:
                f.main.copy_(f.target)

    def state_dict(self) -> dict:
        """This rank's optimizer state, fp32 main params (separate copies only) and scaler."""
        return {"optimizer": self.optimizer.state_dict(),
                "main_params": [f.main for f in self.fragments if f.target is not None],
                "scaler": self.scaler.state_dict() if self.scaler is not None else None}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        mains = [f.main for f in self.fragments if f.target is not None]
        shapes = [tuple(t.shape) for t in state["main_params"]]
        if shapes != [tuple(t.shape) for t in mains]:
            raise ValueError(f"optimizer state holds {len(shapes)} main params that do not "
                             f"match this optimizer's {len(mains)} (different model or layout)")
        self.optimizer.load_state_dict(state["optimizer"])
        for main, saved in zip(mains, state["main_params"]):
            main.copy_(saved)
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])
