"""The optimizers (`--optimizer`), one `OptimizerKind` record each.

A record says how to build the torch optimizer over megalite's parameter groups (by default
two: with and without weight decay), which per-element state it keeps per parameter (fp32,
beside the fp32 master: the planner's bytes per parameter and the checkpoint's "optim.<key>"
kinds) and which per-parameter scalars (saved in the checkpoint index), and how a DP bucket's
grads travel (`reducer`, megalite.distributed.reducers: a compressed all-reduce with error
feedback is a new reducer named here). An optimizer that needs whole weights (Muon,
megalite.optimizer.muon) groups the parameters its own way and gets, by `attach`, the
MixedPrecisionOptimizer that knows where each weight's pieces are. get_optimizer, the planner
(megalite.planning), the checkpoint state mapping (megalite.checkpoint.state), the DP
wrapper's set-up (megalite.training.setup) and the layout checks read the records; adding an
optimizer is one record in OPTIMIZER_KINDS plus its build function.

megalite.config sits below this package (tests/test_imports.py), so `--optimizer` takes any
name and `optimizer_kind` refuses an unknown one with one line: megalite.layout calls it
before any process group.
"""
import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megalite.distributed.reducers import ReducerFactory, default_reducer
from megalite.optimizer import muon
from megalite.optimizer.onebit import (MomentumReducer, build_onebit_adam, check_onebit_run,
                                       momentum_reducer_settings)
from megalite.optimizer.onebit_lamb import OnebitLamb, build_onebit_lamb
from megalite.optimizer.zero_one_adam import (ZeroOneAdam, ZeroOneReducer, build_zero_one_adam,
                                              check_zero_one_run, zero_one_reducer_settings)

FP32_BYTES = 4  # optimizer state is kept in fp32, like the masters it steps


def weight_decay_groups(fragments: list, config) -> list[dict]:
    """Two groups of the fragments' main params: with weight decay, and without for 1-D params
    (biases, norms)."""
    return [{"params": [f.main for f in fragments if f.model_param.ndim > 1],
             "weight_decay": config.weight_decay},
            {"params": [f.main for f in fragments if f.model_param.ndim <= 1],
             "weight_decay": 0.0}]


@dataclass(frozen=True)
class OptimizerKind:
    """One optimizer, as a record (see the module docstring). `config` is an OptimizerConfig."""

    name: str                                            # --optimizer
    build: Callable[[list[dict], object], torch.optim.Optimizer]  # (param groups, config)
    state_keys: Callable[[object], tuple[str, ...]]      # per-element state of a parameter
    scalar_keys: tuple[str, ...] = ()                    # per-parameter scalars (Adam's step)
    reducer: ReducerFactory = default_reducer            # how DP buckets' grads travel
    # (fragments, config) -> the param groups `build` takes (megalite.optimizer.optimizer's
    # Fragment: main, model_param); and, once built, `attach(torch optimizer, owner)` tells the
    # torch optimizer where its parameters live (the MixedPrecisionOptimizer `owner`)
    param_groups: Callable[[list, object], list[dict]] = weight_decay_groups
    attach: Callable[[torch.optim.Optimizer, object], None] = lambda optimizer, owner: None
    reducer_settings: Callable[[object], dict] | None = None  # reducer keywords from config
    check_run: Callable[[object, int], None] | None = None  # (Configs, DP x CP): refuse a run
    # fp32 bytes per parameter the reducer keeps on every rank over DP x CP = n, whatever the
    # sharding (the 1-bit family: momentum and worker error, server error / n)
    reducer_bytes: Callable[[int], float] = lambda n: 0.0
    # the reducer's result depends on the whole bucket (its 1-bit chunks): replicated params
    # (over TP; the tied embedding) get buckets of their own, so that their copies stay equal
    replicas_apart: bool = False
    # DP ranks may step different grads (0/1 Adam's local steps): a non-finite grad norm on
    # one of them must skip the step on all of them (MixedPrecisionOptimizer.grad_stats)
    grads_differ_over_dp: bool = False

    def make_reducer(self, config) -> ReducerFactory:
        """The DP buckets' ReducerFactory under `config`: `reducer`, given its settings."""
        if self.reducer_settings is None:
            return self.reducer
        return functools.partial(self.reducer, **self.reducer_settings(config))

    def state_bytes(self, config) -> int:
        """Bytes of optimizer state per parameter (fp32 per state key): Adam 8, SGD 4 with
        momentum, else 0."""
        return FP32_BYTES * len(self.state_keys(config))


def build_adamw(groups: list[dict], config) -> torch.optim.Optimizer:
    """AdamW: apex FusedAdam on CUDA if importable, else torch fused where the device has
    it, else foreach."""
    kw = dict(lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps)
    params = [p for group in groups for p in group["params"]]
    if params and params[0].is_cuda:
        apex_adam = apex_fused_adam(groups, kw)
        if apex_adam is not None:
            return apex_adam
    try:
        return torch.optim.AdamW(groups, fused=True, **kw)
    except RuntimeError:  # the device has no fused kernel
        return torch.optim.AdamW(groups, foreach=True, **kw)


def apex_fused_adam(groups: list[dict], kw: dict) -> torch.optim.Optimizer | None:
    """apex's FusedAdam in AdamW mode, or None: apex not installed, or installed without its
    CUDA extensions (a RuntimeError at construction; warned about, torch's AdamW is used)."""
    try:
        from apex.optimizers import FusedAdam
    except ImportError:
        return None
    try:
        return FusedAdam(groups, adam_w_mode=True, **kw)
    except RuntimeError as error:
        warnings.warn(f"apex is installed but FusedAdam cannot be built ({error}); falling back "
                      f"to torch's fused AdamW", stacklevel=2)
        return None


def build_sgd(groups: list[dict], config) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=config.lr, momentum=config.sgd_momentum)


ADAM = OptimizerKind("adam", build_adamw, lambda config: ("exp_avg", "exp_avg_sq"),
                     scalar_keys=("step",))
SGD = OptimizerKind("sgd", build_sgd,
                    lambda config: ("momentum_buffer",) if config.sgd_momentum else ())


class MuonKind(OptimizerKind):
    """Muon's record: its state is the momentum of the 2-D hidden weights (4 bytes per
    parameter, the planner's figure) and AdamW's two moments of the rest (embeddings, output
    layer, norms, biases: 8 bytes each, which the per-parameter figure leaves out)."""

    def state_bytes(self, config) -> int:
        return FP32_BYTES


def build_muon(groups: list[dict], config) -> torch.optim.Optimizer:
    return muon.Muon(groups, config, build_adamw)


MUON = MuonKind("muon", build_muon, lambda config: ("momentum_buffer", "exp_avg", "exp_avg_sq"),
                scalar_keys=("step",), param_groups=muon.muon_param_groups,
                attach=muon.Muon.attach)

ONEBIT_ADAM = OptimizerKind("onebit_adam", build_onebit_adam,
                            lambda config: ("exp_avg", "exp_avg_sq"), scalar_keys=("step",),
                            reducer=MomentumReducer, reducer_settings=momentum_reducer_settings,
                            check_run=check_onebit_run, replicas_apart=True,
                            reducer_bytes=lambda n: FP32_BYTES * (2 + 1 / n))
# LAMB's trust ratio needs whole weights: `attach` tells it where each weight's pieces are
ONEBIT_LAMB = OptimizerKind("onebit_lamb", build_onebit_lamb,
                            lambda config: ("exp_avg", "exp_avg_sq", "exp_avg_sq_fresh"),
                            scalar_keys=("step", "coeff_freeze", "last_factor"),
                            attach=OnebitLamb.attach, reducer=MomentumReducer,
                            reducer_settings=momentum_reducer_settings,
                            check_run=check_onebit_run, replicas_apart=True,
                            reducer_bytes=lambda n: FP32_BYTES * (2 + 1 / n))
# local steps: p and m differ over DP between synchronisations, the anchor a does not
ZERO_ONE_ADAM = OptimizerKind("zero_one_adam", build_zero_one_adam,
                              lambda config: ("exp_avg", "exp_avg_sq", "anchor"),
                              scalar_keys=("step", "lr_sum"), attach=ZeroOneAdam.attach,
                              reducer=ZeroOneReducer, reducer_settings=zero_one_reducer_settings,
                              check_run=check_zero_one_run, replicas_apart=True,
                              grads_differ_over_dp=True,
                              reducer_bytes=lambda n: FP32_BYTES * (1 + 1 / n))
OPTIMIZER_KINDS = (ADAM, SGD, MUON, ONEBIT_ADAM, ONEBIT_LAMB, ZERO_ONE_ADAM)


def optimizer_kind(name: str) -> OptimizerKind:
    """The record named `name`; ValueError (one line naming the flag) for an unknown one."""
    for kind in OPTIMIZER_KINDS:
        if kind.name == name:
            return kind
    raise ValueError(f"--optimizer must be one of {', '.join(k.name for k in OPTIMIZER_KINDS)} "
                     f"(got {name!r})")
