"""The mixed-precision optimizer: fp32 main params stepped with the DDP buffer's fp32 grads.

bf16/fp16 model params get an fp32 main copy; the torch optimizer steps the copies and
the result is copied back (rounded) into the model params. fp32 params are their own
main params (no copy). fp16 adds loss scaling: grads are unscaled and checked for
inf/NaN, and an overflow anywhere skips the step everywhere. In every precision a
non-finite loss or global grad norm skips the step (never applied to the weights). The
grad statistics stay on the device until the host reads them, once per step.
"""
import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megalite.config import OptimizerConfig, PrecisionConfig
from megalite.device import current_device
from megalite.mpu import parallel_state
from megalite.optimizer.grad_scaler import build_grad_scaler
from megalite.optimizer.grad_stats import (counts_toward_norm, found_inf_anywhere, global_grad_norm,
                                           nonfinite_anywhere)
from megalite.optimizer.kinds import OptimizerKind, optimizer_kind
from megalite.optimizer.nvme_tier import NvmeTier
from megalite.config.sharding import sharding_strategy


@dataclass
class Fragment:
    """A piece of one model parameter that this rank's optimizer updates.

    main: fp32 values the torch optimizer steps (aliases the model param when it is fp32);
    grad: its fp32 grad, a view into the DDP buffer; target: the model-dtype view the
    stepped values are copied into, None when `main` aliases it; offset: where `main`
    starts in the flattened model param (checkpoints map it to the global tensor).
    """

    model_param: nn.Parameter
    main: torch.Tensor
    grad: torch.Tensor
    target: torch.Tensor | None
    offset: int = 0

    @classmethod
    def of(cls, model_param: nn.Parameter, values: torch.Tensor, grad: torch.Tensor,
           offset: int = 0, host: bool = False, in_place: bool = False) -> "Fragment":
        """`values` is (a view of) the model param's data, from flat element `offset` on;
        `host`: the fp32 main copy lives in host memory (--optimizer-cpu-offload), even for
        fp32 params; `in_place`: no copy yet, `main` aliases `values` (the nvme tier moves
        the masters to its file, megalite.optimizer.nvme_tier)."""
        if in_place:
            return cls(model_param, values, grad,
                       None if values.dtype == torch.float32 else values, offset)
        if host:
            return cls(model_param, values.detach().to("cpu", torch.float32, copy=True), grad,
                       values, offset)
        if values.dtype == torch.float32:
            return cls(model_param, values, grad, None, offset)
        return cls(model_param, values.float(), grad, values, offset)


def build_torch_optimizer(kind: OptimizerKind, config: OptimizerConfig,
                          fragments: list[Fragment]) -> torch.optim.Optimizer:
    """`kind`'s torch optimizer over its param groups of the fragments' main params (by
    default two: with weight decay, and without for 1-D params: biases, norms)."""
    return kind.build(kind.param_groups(fragments, config), config)


# Keys of a param group that describe the implementation, not the optimization: left out
# of saved states so that apex FusedAdam and torch AdamW states load into each other.
IMPLEMENTATION_KEYS = frozenset({"foreach", "fused", "capturable", "differentiable",
                                 "adam_w_mode", "set_grad_none", "bias_correction", "step"})


def portable_state_dict(optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state with Adam's step per parameter (apex keeps it per group) and no
    implementation keys, loadable by `load_portable_state_dict` into either optimizer."""
    state = optimizer.state_dict()
    for group in state["param_groups"]:
        if "step" in group:
            for index in group["params"]:
                state["state"].setdefault(index, {}).setdefault(
                    "step", torch.tensor(float(group["step"])))
        for key in IMPLEMENTATION_KEYS & group.keys():
            del group[key]
    return state


def load_portable_state_dict(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a `portable_state_dict`, keeping this optimizer's implementation keys. Each group
    also gets `step` (the largest of its parameters' steps) for optimizers that count steps
    per group (apex FusedAdam); torch's optimizers ignore it."""
    own = optimizer.state_dict()["param_groups"]
    groups = [{**{k: v for k, v in mine.items() if k in IMPLEMENTATION_KEYS}, **saved}
              for mine, saved in zip(own, state["param_groups"])]
    optimizer.load_state_dict({"state": state["state"], "param_groups": groups})
    for group, saved in zip(optimizer.param_groups, state["param_groups"]):
        steps = [state["state"].get(i, {}).get("step") for i in saved["params"]]
        group["step"] = int(max((float(s) for s in steps if s is not None), default=0))


def optimizer_settings(config: OptimizerConfig) -> dict:
    """What the saved optimizer state means: stored with checkpoints, compared on load (the
    sharding and offload keys only when they differ from DDP / ZeRO-1 without offload, so
    checkpoints written before they existed still resume: ZeRO-1 is the grad buffer's
    strategy that shards the optimizer)."""
    strategy = sharding_strategy(config.sharding)
    settings = {"optimizer": config.optimizer,
                "use_distributed_optimizer": strategy.shards_optimizer and not strategy.fsdp}
    if strategy.fsdp:
        settings["sharding"] = strategy.name
    if config.offload_device:
        settings["cpu_offload"] = True  # host or file: the state is stepped on the host
    return settings


def replica_group(within_stage: bool):
    """TP x PP ranks of this model replica, or `within_stage` the TP ranks of its stage."""
    return parallel_state.get_tensor_model_parallel_group() if within_stage else \
        parallel_state.get_model_parallel_group()


class MixedPrecisionOptimizer:
    """Steps the params of `model_chunks` (DistributedDataParallel-wrapped: grads are read from
    `param.main_grad`). `step()` -> (stepped, grad norm or None when clipping is off)."""

    def __init__(self, model_chunks: list[nn.Module], config: OptimizerConfig,
                 precision: PrecisionConfig) -> None:
        self.model_chunks, self.clip_grad, self.config = model_chunks, config.clip_grad, config
        self.scaler = build_grad_scaler(precision)
        self.host = config.offload_device == "cpu"
        self.in_place = config.offload_device == "nvme"  # fragments alias the model
        self.kind = optimizer_kind(config.optimizer)
        self.fragments = self._build_fragments()
        self.tier = NvmeTier(self.fragments, self.kind.state_keys(config),
                             config.offload_nvme_path, config.offload_sub_group_size,
                             dist.get_rank() if dist.is_initialized() else 0) \
            if self.in_place else None
        self.optimizer = build_torch_optimizer(self.kind, config, self.fragments)
        self.kind.attach(self.optimizer, self)
        self._grad_norm: torch.Tensor | None = None  # on the device, from grad_stats()

    def _build_fragments(self) -> list[Fragment]:
        return [Fragment.of(p, p.detach(), p.main_grad)
                for chunk in self.model_chunks for p in chunk.parameters() if p.requires_grad]

    def param_shards(self) -> list[tuple[nn.Parameter, object]]:
        """Every trainable parameter of this rank's chunks, in an order the DP ranks share, with
        the DP group its fragments are split over (None: this rank steps it whole)."""
        return [(p, None) for chunk in self.model_chunks for p in chunk.parameters()
                if p.requires_grad]

    def _stats_groups(self, within_stage: bool = False) -> list:
        """Where grad statistics are reduced: every rank of this model replica (TP x PP), or
        `within_stage` its pipeline stage's (TP)."""
        return [replica_group(within_stage)]

    def settings(self) -> dict:
        return optimizer_settings(self.config)

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
        """Where the grads are (the host with FSDP's CPU offload); their statistics are
        reduced on the rank's device (current_device), which NCCL needs."""
        return self.fragments[0].grad.device if self.fragments else torch.device("cpu")

    def _unscale_and_check(self) -> torch.Tensor:
        """Divide the grads by the loss scale; [1] nonzero if any rank found inf/NaN."""
        found_inf = torch.zeros(1, dtype=torch.float32, device=self._device())
        if self.fragments:
            inv_scale = torch.full((1,), 1.0 / self.scaler.scale, device=self._device())
            torch._amp_foreach_non_finite_check_and_unscale_(
                [f.grad for f in self.fragments], found_inf, inv_scale)
        return found_inf_anywhere(found_inf.to(current_device()),
                                  self._expert_stats_groups() + self._stats_groups())

    @torch.no_grad()
    def grad_stats(self, within_stage: bool = False) -> torch.Tensor:
        """First half of `step`: unscale the grads (fp16) and reduce their statistics over every
        rank holding a piece of the model (`within_stage`: of this pipeline stage only, the
        norm of its grads; PipeDream-2BW between aligned steps). Returns [global grad norm,
        found inf/NaN (fp16; always 0 otherwise)], fp32 on the device; `apply` takes their
        host values."""
        for f in self.fragments if self.tier is None else ():
            f.main.grad = f.grad
        found_inf = self._unscale_and_check() if self.scaler is not None else \
            torch.zeros(1, dtype=torch.float32, device=current_device())
        counted = [f for f in self.fragments if counts_toward_norm(f.model_param)]
        expert = [getattr(f.model_param, "expert_parallel", False) for f in counted]
        self._grad_norm = global_grad_norm(
            [f.grad for f, e in zip(counted, expert) if not e],
            self._stats_groups(within_stage), current_device(),
            [f.grad for f, e in zip(counted, expert) if e], self._expert_stats_groups())
        if self.kind.grads_differ_over_dp:  # one rank's non-finite norm skips every rank
            self._grad_norm = nonfinite_anywhere(
                self._grad_norm, parallel_state.get_data_parallel_group(with_context_parallel=True))
        return torch.cat([self._grad_norm.reshape(1), found_inf])

    @torch.no_grad()
    def apply(self, grad_norm: float, found_inf: bool, loss_is_finite: bool = True
              ) -> tuple[bool, float | None]:
        """Second half of `step`, given the host values of `grad_stats()`: update the loss
        scale (fp16), then clip, step and copy back, or skip. Returns (stepped, grad norm)."""
        if self.scaler is not None:
            found_inf = found_inf or not loss_is_finite
            self.scaler.update(found_inf)
            if found_inf:
                return False, None
        if not loss_is_finite:
            return False, None
        if not math.isfinite(grad_norm):
            return False, grad_norm
        clipping = self.clip_grad > 0 and self.clip_grad / (grad_norm + 1e-6) < 1.0
        if self.tier is not None:
            coef = torch.clamp(self.clip_grad / (self._grad_norm + 1e-6), max=1.0) \
                if clipping else None  # as clip_grads_with_norm_
            self.tier.step(self.optimizer, coef)
            self._copy_main_to_model()
            return True, grad_norm
        for f in self.fragments:  # main params in host memory (offload): grads to the host
            if f.main.device != f.grad.device:
                f.main.grad = f.grad.to(f.main.device)
        if clipping:  # scale only when clipping
            torch.nn.utils.clip_grads_with_norm_([f.main for f in self.fragments],
                                                 self.clip_grad, self._grad_norm)
        self.optimizer.step()
        self._copy_main_to_model()
        return True, grad_norm

    def step(self, loss_is_finite: bool = True) -> tuple[bool, float | None]:
        """Unscale and check (fp16), clip, step, copy back. Returns (stepped, grad norm).

        The step is skipped (False) on an fp16 overflow, when `loss_is_finite` is False (the
        caller passes the same value on every rank) or when the global grad norm, reduced
        over every rank holding a piece of the model, is not finite: every rank agrees.
        The host reads the grad statistics once (`grad_stats`, then `apply`); a training
        step reads them together with its loss (megalite.training.loop.train_step).
        """
        grad_norm, found_inf = self.grad_stats().tolist()
        return self.apply(grad_norm, found_inf > 0, loss_is_finite)

    def _copy_main_to_model(self) -> None:
        """The stepped masters into the model's values (the nvme tier copies them as it steps)."""
        pairs = [(f.target, f.main) for f in self.fragments
                 if f.target is not None and self.tier is None]
        if pairs:
            torch._foreach_copy_(*map(list, zip(*pairs)))

    def resident(self) -> contextlib.AbstractContextManager:
        """Within it every fragment's `main` and torch optimizer state are whole tensors (a
        checkpoint reads and fills them); the nvme tier loads them from its file and writes
        them back, the in-memory optimizers hold them anyway."""
        return self.tier.resident(self.optimizer) if self.tier else contextlib.nullcontext()

    def close(self) -> None:
        """Remove the nvme tier's scratch files now (end of the run): FSDP2's reference
        cycles would keep them until a garbage collection. No step after this."""
        if self.tier is not None:
            self.tier.close()

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Refresh the fp32 main params from the model params (after loading weights)."""
        if self.tier is not None:
            return self.tier.write_masters()
        for f in self.fragments:
            if f.target is not None:
                f.main.copy_(f.target)

    def state_dict(self) -> dict:
        """This rank's optimizer state, fp32 main params (separate copies only) and scaler."""
        with self.resident():
            return {"optimizer": portable_state_dict(self.optimizer),
                    "main_params": [f.main.data for f in self.fragments if f.target is not None],
                    "scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load_state_dict(self, state: dict) -> None:
        with self.resident():
            self._load_state_dict(state)

    @torch.no_grad()
    def _load_state_dict(self, state: dict) -> None:
        mains = [f.main for f in self.fragments if f.target is not None]
        shapes = [tuple(t.shape) for t in state["main_params"]]
        if shapes != [tuple(t.shape) for t in mains]:
            raise ValueError(f"optimizer state holds {len(shapes)} main params that do not "
                             f"match this optimizer's {len(mains)} (different model or layout)")
        load_portable_state_dict(self.optimizer, state["optimizer"])
        for main, saved in zip(mains, state["main_params"]):
            main.copy_(saved)
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])
