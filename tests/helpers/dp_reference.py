"""Shared set-up for the data-parallel, optimizer and precision tests (holds no tests).

A tiny GPT (hidden 32, 2 layers, 4 heads, vocabulary 97, sequence 8, dropout off), its
batches, the wrapped model + optimizer under test, and an independent single-process
reference: the same GPT (weights do not depend on the layout) trained with plain torch
AdamW or SGD + clip_grad_norm_ on the concatenated batch.
"""
import contextlib
import functools

import torch
import torch.distributed as dist
from torch import nn

from megalite.config import ModelConfig, OptimizerConfig, PrecisionConfig
from megalite.device import current_device
from megalite.distributed import DistributedDataParallel
from megalite.distributed.finalize import allreduce_shared_embedding_grads
from megalite.models import GPTModel
from megalite.mpu import initialize_model_parallel, model_parallel_seed
from megalite.mpu import parallel_state as ps
from megalite.mpu.layers import gather_tensor_parallel
from megalite.optimizer import get_optimizer
from tests.helpers.reference import rel_err

VOCAB, SEQ, LR = 97, 8, 1e-3
CONFIG = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                     max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0)


def opt_config(**kw) -> OptimizerConfig:
    """Constant LR, weight decay 0.01, clipping at 1.0 (active on this model); AdamW unless
    `optimizer="sgd"`."""
    return OptimizerConfig(**{"lr": LR, "lr_decay_style": "constant", "clip_grad": 1.0, **kw})


def batches(steps: int, size: int, seed: int = 1) -> list[torch.Tensor]:
    """`steps` global batches of tokens [size, SEQ + 1] (inputs [:-1], labels [1:]), on this
    rank's device."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (size, SEQ + 1), generator=gen).to(current_device())
            for _ in range(steps)]


def init_grid(tp: int, pp: int = 1) -> None:
    initialize_model_parallel(tp, pp)
    model_parallel_seed(0, ps.get_tensor_model_parallel_rank(),
                        ps.get_pipeline_model_parallel_rank())


@functools.cache
def rank_group(size: int):
    """This rank's group of `size` consecutive ranks, created once per worker (every rank
    creates every group, in the same order). Size 1: a process of its own."""
    mine = None
    for start in range(0, dist.get_world_size(), size):
        group = dist.new_group(list(range(start, start + size)))
        if start <= dist.get_rank() < start + size:
            mine = group
    return mine


def build(precision: PrecisionConfig = PrecisionConfig(), group=None,
          opt: OptimizerConfig | None = None) -> tuple[DistributedDataParallel, object]:
    """(wrapped whole-model GPT, optimizer) on the current grid; DDP settings from `opt`."""
    opt = opt or opt_config()
    model = DistributedDataParallel(
        GPTModel(CONFIG, params_dtype=precision.params_dtype, device=current_device()),
        bucket_size=opt.ddp_bucket_size,
        overlap_grad_reduce=opt.overlap_grad_reduce,
        use_distributed_optimizer=opt.use_distributed_optimizer, data_parallel_group=group)
    optimizer, _ = get_optimizer(opt, precision, model)
    return model, optimizer


def local_slice(tokens: torch.Tensor, group) -> torch.Tensor:
    """This DP rank's equal share of a global batch."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    return tokens.chunk(size)[rank]


def train_step(model: DistributedDataParallel, optimizer, tokens: torch.Tensor,
               microbatches: int = 1) -> tuple[bool, float | None]:
    """The documented step order on a PP=1 grid; the first microbatches run in no_sync()."""
    compute_grads(model, optimizer, tokens, microbatches)
    return optimizer.step()


def compute_grads(model: DistributedDataParallel, optimizer, tokens: torch.Tensor,
                  microbatches: int = 1) -> float:
    """Everything of `train_step` before `optimizer.step()`: main_grad holds the DP mean.
    Returns this rank's mean loss."""
    model.zero_grad_buffer()
    optimizer.zero_grad()
    total = 0.0
    for i, mb in enumerate(tokens.chunk(microbatches)):
        loss = model(mb[:, :-1], mb[:, 1:]).float().mean() / microbatches
        total += loss.item()
        with model.no_sync() if i < microbatches - 1 else contextlib.nullcontext():
            (loss * optimizer.loss_scale).backward()
    model.finish_grad_sync()
    allreduce_shared_embedding_grads(model)
    return total


def full_params(model: nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """name -> full fp32 parameter, or its main_grad (gathered over TP, collective on the TP
    group; vocabulary padding dropped)."""
    return {n: gather_tensor_parallel((p.main_grad if grads else p.detach()).float(), p).clone()
            for n, p in model.module.named_parameters()}


class Reference:
    """Single-process GPT with torch AdamW or SGD (no decay on 1-D params), clip_grad_norm_.

    Its layers run on a group of this rank alone, but its cross entropy on parallel_state's
    TP group: build and run it under a TP = 1 grid.
    """

    def __init__(self, config: OptimizerConfig = opt_config()) -> None:
        self.group = rank_group(1)
        self.model = GPTModel(CONFIG, layer_range=(0, CONFIG.num_layers), group=self.group,
                              device=current_device())
        params = list(self.model.parameters())
        self.clip = config.clip_grad
        groups = [{"params": [p for p in params if p.ndim > 1],
                   "weight_decay": config.weight_decay},
                  {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]
        if config.optimizer == "sgd":
            self.optimizer = torch.optim.SGD(groups, lr=config.lr, momentum=config.sgd_momentum)
        else:
            self.optimizer = torch.optim.AdamW(groups, lr=config.lr, eps=config.adam_eps,
                                               betas=(config.adam_beta1, config.adam_beta2))

    def grads(self, tokens: torch.Tensor) -> tuple[float, dict[str, torch.Tensor], float]:
        """(loss, grads by name, grad norm) of the mean loss over `tokens`."""
        self.optimizer.zero_grad()
        loss = self.model(tokens[:, :-1], tokens[:, 1:]).mean()
        loss.backward()
        grads = {n: p.grad for n, p in self.model.named_parameters()}
        norm = torch.nn.utils.get_total_norm(list(grads.values())).item()
        return loss.item(), self._unpadded(grads), norm

    def step(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()

    def params(self) -> dict[str, torch.Tensor]:
        return self._unpadded({n: p.detach() for n, p in self.model.named_parameters()})

    def _unpadded(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copies without the vocabulary padding rows (as full_params returns them)."""
        params = dict(self.model.named_parameters())
        return {n: gather_tensor_parallel(t, params[n], self.group).clone()
                for n, t in tensors.items()}


def max_rel_err(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """max over names of max|got - want| / max|want|."""
    assert got.keys() == want.keys(), set(got) ^ set(want)
    return max(rel_err(got[n], want[n]) for n in want)
