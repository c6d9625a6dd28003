"""Host synchronisations of training steps, counted on CPU.

On a GPU every read of a device value by the host (`.item()`, `float()`, `int()`, `bool()`,
`.tolist()`), every op whose output shape depends on the data (boolean masks, `nonzero`,
`bincount`, `repeat_interleave` without `output_size`) and every tensor made from host data
(`torch.tensor(...)`: a copy from pageable memory) stalls the host until the device has caught
up. On CPU the same calls dispatch the ops counted here (in torch 2.13 `.item()`, `float()`,
`int()` and `bool()` dispatch `aten._local_scalar_dense`; `.tolist()` dispatches nothing and is
counted by wrapping it), so a CPU run counts what a GPU run would wait for.

Two training steps through the real loop (`training.train` with a task; the second step
logged) of a GPT whose layers are all MoE layers, at TP 2 x PP 2 and at PP 2 x EP 2 (DP 2,
with a capacity factor): one read per step, one more per logged step (the MoE routing stats)
and exactly one per MoE layer per microbatch on this rank (the all-to-all split sizes, which
gloo and NCCL take as host lists), whatever the number of microbatches, layers and experts.
"""
import contextlib
import itertools
import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megalite.tasks import gpt as pretrain_gpt
from megalite.config import parse_configs
from megalite.device import current_device
from megalite.models import GPTModel
from megalite.training.task import Task
from tests.helpers.multirank import run_on_ranks

aten = torch.ops.aten
READS = {aten._local_scalar_dense.default: "item", aten.equal.default: "equal"}
DATA_SHAPED = {aten.nonzero.default, aten.masked_select.default, aten._unique2.default,
               aten.unique_consecutive.default, aten.unique_dim.default, aten.bincount.default}
MASKED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}


class HostSyncCounter(TorchDispatchMode):
    """Counts the calls inside `counting()` that make the host wait for the device: `counts`
    by kind, `where` by (kind, innermost megalite file:line)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()
        self.where: Counter = Counter()

    def _hit(self, kind: str) -> None:
        self.counts[kind] += 1
        frames = [f for f in traceback.extract_stack() if "/megalite/" in f.filename]
        where = f"{frames[-1].filename.rsplit('/megalite/', 1)[1]}:{frames[-1].lineno}" \
            if frames else "outside megalite"
        self.where[kind, where] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in READS:
            self._hit(READS[func])
        elif func in DATA_SHAPED:
            self._hit(func.overloadpacket.__name__)
        elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self._hit("repeat_interleave")
        elif func in MASKED and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self._hit("boolean mask")
        elif func is aten.lift_fresh.default:
            self._hit("tensor from host data")
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def counting(self):
        original = torch.Tensor.tolist

        def tolist(tensor):
            self._hit("tolist")
            return original(tensor)
        torch.Tensor.tolist = tolist
        try:
            with self:
                yield self
        finally:
            torch.Tensor.tolist = original


def test_the_counter_sees_every_kind_of_host_read():
    t = torch.arange(6.0)
    reads = [lambda: t[0].item(), lambda: float(t[0]), lambda: int(t[0]), lambda: bool(t[0]),
             lambda: t.tolist(), lambda: t[t > 2], lambda: t.nonzero(),
             lambda: torch.bincount(t.long()), lambda: torch.tensor([1.0]),
             lambda: t.repeat_interleave(t.long())]
    counter = HostSyncCounter()
    with counter.counting():
        for read in reads:
            read()
        t.repeat_interleave(t.long(), output_size=15)
        torch.full((1,), 2.0).mul_(3.0)
    assert sum(counter.counts.values()) == len(reads), counter.counts


class _CountedTask(Task):
    """pretrain_gpt's model and forward step on random tokens; counts host syncs from the first
    step to the end of the last (the counter is entered on `stack`)."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self.counter, self._stack = HostSyncCounter(), stack

    def model_provider(self, configs, pre_process, post_process):
        return GPTModel(configs.model, pre_process=pre_process, post_process=post_process,
                        init_seed=configs.train.seed, device=current_device())

    def forward_step(self, data_iterator, model):
        return pretrain_gpt.forward_step(data_iterator, model)

    def batches(self, configs, layout, consumed):
        t, generator = configs.train, torch.Generator().manual_seed(0)
        shape = (t.micro_batch_size, t.seq_length + 1)
        return ({"tokens": torch.randint(0, configs.model.vocab_size, shape, generator=generator,
                                         device="cpu")}  # host batches, as a loader's
                for _ in itertools.count()), None

    def start(self, run) -> None:
        self._stack.enter_context(self.counter.counting())

    def finish(self, run) -> None:
        self._stack.close()


STEPS = 2
SIZES = ((2, 2, 4), (4, 2, 4), (2, 4, 4), (2, 2, 8))  # (microbatches, layers, experts)
LAYOUTS = (("--tp", "2", "--pp", "2"),
           ("--pp", "2", "--dp", "2", "--ep", "2", "--moe-expert-capacity-factor", "1.0"))


def _count(layout: tuple[str, ...], microbatches: int, layers: int, experts: int) -> dict:
    """Host syncs on this rank over STEPS steps (the last one logged)."""
    from megalite.training import train
    dp = int(layout[layout.index("--dp") + 1]) if "--dp" in layout else 1
    configs = parse_configs(
        ["--num-layers", str(layers), "--hidden-size", "32", "--num-attention-heads", "4",
         "--vocab-size", "97", "--seq-length", "16", "--max-position-embeddings", "16",
         "--micro-batch-size", "1", "--global-batch-size", str(microbatches * dp),
         "--train-iters", str(STEPS), "--log-interval", str(STEPS), "--eval-interval", "0",
         "--num-experts", str(experts), "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16",
         "--moe-aux-loss-coeff", "0.01", "--hidden-dropout", "0", "--attention-dropout", "0",
         *layout])
    with contextlib.ExitStack() as stack:
        task = _CountedTask(stack)
        train(configs, task)
    return {"total": sum(task.counter.counts.values()), "where": dict(task.counter.where)}


def _all_counts() -> dict:
    return {(layout, sizes): _count(layout, *sizes) for layout in LAYOUTS for sizes in SIZES}


def test_host_syncs_per_step_do_not_grow_with_microbatches_layers_or_experts():
    """Per step: one read of [loss, grad norm, found inf, SIGTERM flag]; per logged step one
    of the MoE routing stats; per MoE layer and microbatch one of the all-to-all sizes
    (in forward: backward reuses them). Nothing else."""
    results = run_on_ranks(4, _all_counts)
    for rank, per_rank in enumerate(results):
        for (layout, (m, layers, experts)), got in per_rank.items():
            moe_layers_here = layers // 2  # every layer is an MoE layer; 2 stages
            want = STEPS * (1 + moe_layers_here * m) + 1
            assert got["total"] == want, (rank, layout, m, layers, experts, got["where"])
