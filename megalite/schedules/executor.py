"""Run one pipeline rank's schedule table: `get_forward_backward_func()`, `forward_backward(...)`.

The table (of any `megalite.schedules.tables.ScheduleKind`) is walked in order: each
FORWARD / BACKWARD runs a model chunk, each maximal run of
sends/recvs is one batch posted on the pipeline group and waited for (the
executor rule in instructions.py, deadlock-free for every p >= 2). With p = 1 the 1F1B
table is F B F B ...: plain gradient accumulation. Split-backward schedules (zero bubble)
run BACKWARD_INPUT inside `weight_grad.defer_weight_grads()`, keeping the queued
weight-grad work by (chunk, microbatch) until its BACKWARD_WEIGHT applies it.
`observe_computes` lets a benchmark time every compute.

Megatron semantics: `forward_step_func(data_iterator, model_chunk)` returns
`(output_tensor, loss_func)`; on the last stage `loss_func(output_tensor)` returns
`(loss, {"lm loss": detached value, ...})` and the loss is multiplied by
`loss_scale / num_microbatches` before backward, so gradients are the mean over
the global batch (times the fp16 loss scale). Other stages send their output
[s, b, h] on and, in backward, the grad of their received input back.
"""
import contextlib
import functools
import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from megalite.models.layer_drop import layer_drop_states
from megalite.models.sharding import unwrap
from megalite.models.transformer_stage import moe_states
from megalite.moe import training_step
from megalite.mpu import comm, parallel_state
from megalite.mpu.weight_grad import apply_weight_grads, defer_weight_grads
from megalite.placement import ONE_F_ONE_B, Placement
from megalite.schedules.instructions import COMPUTE, Instruction, Kind
from megalite.schedules.p2p import Channel
from megalite.schedules.tables import SCHEDULE_KINDS, ScheduleKind, resolve_schedule, step_segment

LossDict = dict[str, torch.Tensor]
BACKWARD_KINDS = frozenset({Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT,
                            Kind.SEND_BACKWARD, Kind.RECV_BACKWARD})


@functools.lru_cache(maxsize=32)
def rank_table(schedule: ScheduleKind, p: int, m: int, v: int, rank: int,
               forward_only: bool) -> tuple[Instruction, ...]:
    """This rank's instructions; forward_only drops backwards and grad messages (the rounds of
    the remaining forwards are unchanged, so the batching rule stays deadlock-free)."""
    table = schedule.builder(p, m, v)[rank]
    return tuple(ins for ins in table if not (forward_only and ins.kind in BACKWARD_KINDS))


def free_output(tensor: torch.Tensor) -> None:
    """Release a sent activation's storage while autograd keeps its graph (Megatron's
    deallocate_output_tensor): a stride-0 view of one element keeps the [s, b, h] shape
    that torch.autograd.backward checks against the incoming grad."""
    if tensor._base is None:
        tensor.data = torch.empty(1, dtype=tensor.dtype, device=tensor.device).expand(tensor.shape)


def _chunk_iterators(data_iterator, v: int) -> list:
    """One iterator per chunk: a list is taken as is; one iterator is tee'd so that every
    chunk sees microbatches 0, 1, ... in order."""
    if isinstance(data_iterator, list):
        if len(data_iterator) != v:
            raise ValueError(f"data_iterator: expected one per model chunk ({v}), "
                             f"got {len(data_iterator)}")
        return data_iterator
    if data_iterator is None or v == 1:
        return [data_iterator] * v
    return list(itertools.tee(data_iterator, v))


class InFlight:
    """What a schedule without a flush between steps (2bw) carries from one training step to
    the next on this rank: the next step's forwards that ran before this step ended (their
    received inputs and their outputs, by (chunk, microbatch of the next step)), and the two
    weight versions (`megalite.optimizer.weight_versions.WeightVersions`, or None to run on
    the params as they are). Set by the caller before each step: `drain`, let the pipeline
    empty at the end of this step (at the end of training, before an evaluation or a save);
    `aligned`, the step ends with collectives over all stages (the loss shared with every
    rank): otherwise the losses stay on the last stage and each rank goes on with the next
    step as soon as its part is done, 1F1B's steady state continuing across the steps."""

    def __init__(self, versions=None) -> None:
        self.versions, self.drain, self.aligned = versions, True, True
        self.running = False  # the previous step left the next one's forwards in flight
        # the training loop's (megalite.training.loop) for the steps since the last aligned
        # one: their values on the device, what their log line needs, and at the aligned step
        # their (loss, grad norm)
        self.pending: list = []
        self.unrecorded: list = []
        self.resolved: list = []
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}


class _Run:
    """State of one step on one rank; tensors are kept by (local chunk, microbatch)."""

    def __init__(self, forward_step_func: Callable, iterators: list, chunks: list[nn.Module],
                 num_microbatches: int, channel: Channel, forward_only: bool,
                 loss_scale: float, place: Placement, versions=None) -> None:
        self.forward_step_func, self.iterators, self.chunks = forward_step_func, iterators, chunks
        self.place, self.rank = place, parallel_state.get_pipeline_model_parallel_rank()
        self.m, self.channel = num_microbatches, channel
        self.forward_only, self.loss_scale = forward_only, loss_scale
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}        # received activations
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}       # outputs, or scaled losses
        self.output_grads: dict[tuple[int, int], torch.Tensor] = {}  # received grads
        self.input_grads: dict[tuple[int, int], torch.Tensor] = {}   # grads to send back
        self.weight_work: dict[tuple[int, int], list] = {}           # deferred by B, for W
        self.backwards: Counter = Counter()  # by (B or W, chunk)
        self.losses: list[LossDict] = []
        self.layer_drops = [layer_drop_states(chunk) for chunk in chunks]
        self.versions = versions  # 2bw: this step's microbatches run on the previous weights

    def _local_previous(self, key: tuple[int, int]) -> tuple[int, int] | None:
        """(chunk, microbatch) of the previous stage when it is on this rank (V placement)."""
        stage = self.place.stage(self.rank, key[0])
        if stage == 0:
            return None
        rank, chunk = self.place.locate(stage - 1)
        return (chunk, key[1]) if rank == self.rank else None

    def forward(self, key: tuple[int, int]) -> None:
        chunk = self.chunks[key[0]]
        stage = self.place.stage(self.rank, key[0])
        first, last = stage == 0, stage == self.place.num_stages - 1
        if (previous := self._local_previous(key)) is not None:
            handed = self.outputs.pop(previous) if self.forward_only else self.outputs[previous]
            self.inputs[key] = handed.detach().requires_grad_(not self.forward_only)
        unwrap(chunk).set_input_tensor(None if first else self.inputs[key])
        for state in self.layer_drops[key[0]]:  # progressive layer dropping draws per microbatch
            state.microbatch = key[1]
        output, loss_func = self.forward_step_func(self.iterators[key[0]], chunk)
        unwrap(chunk).set_input_tensor(None)  # the graph, and self.inputs, keep what is needed
        if last:
            loss, loss_dict = loss_func(output)
            self.losses.append(loss_dict)
            output = loss * (self.loss_scale / self.m)
        if self.forward_only:
            self.inputs.pop(key, None)
            if last:
                return
        self.outputs[key] = output

    def _sync_on_last(self, chunk: nn.Module, key: tuple[int, int], kind: str):
        """`chunk.no_sync()` (when it has one) unless this is the chunk's last B (or W) of the
        step, so DP grad reductions start once, when the last grad of a bucket lands."""
        self.backwards[kind, key[0]] += 1
        no_sync = getattr(chunk, "no_sync", None)
        last_of_chunk = self.backwards[kind, key[0]] == self.m
        return contextlib.nullcontext() if last_of_chunk or no_sync is None else no_sync()

    def backward(self, key: tuple[int, int], kind: Kind) -> None:
        """BACKWARD (fused) or BACKWARD_INPUT (weight grads deferred) of one chunk and
        microbatch; the grad of its input goes back (or to the previous stage on this rank)."""
        chunk = self.chunks[key[0]]
        received = self.inputs.pop(key, None)
        output, grad = self.outputs.pop(key), self.output_grads.pop(key, None)
        split = kind is Kind.BACKWARD_INPUT
        with self._sync_on_last(chunk, key, "B"), \
                defer_weight_grads() if split else contextlib.nullcontext() as work:
            torch.autograd.backward(output, grad_tensors=grad)
        if split:
            self.weight_work[key] = work
        if received is not None:
            previous = self._local_previous(key)
            if previous is None:
                self.input_grads[key] = received.grad
            else:
                self.output_grads[previous] = received.grad

    def weight_grads(self, key: tuple[int, int]) -> None:
        """BACKWARD_WEIGHT: the weight grads that the BACKWARD_INPUT of `key` deferred."""
        chunk = self.chunks[key[0]]
        with self._sync_on_last(chunk, key, "W"):
            apply_weight_grads(self.weight_work.pop(key))

    def compute(self, ins: Instruction) -> None:
        key = (ins.chunk, ins.microbatch)
        if self.versions is not None:  # the next step's forwards (microbatch >= m): current
            self.versions.point(ins.chunk, previous=ins.microbatch < self.m)
        if ins.kind is Kind.FORWARD:
            self.forward(key)
        elif ins.kind is Kind.BACKWARD_WEIGHT:
            self.weight_grads(key)
        else:
            self.backward(key, ins.kind)

    def communicate(self, batch: list[Instruction]) -> None:
        ops = []
        for ins in batch:
            key = (ins.chunk, ins.microbatch)
            if ins.kind is Kind.SEND_FORWARD:
                sent = self.outputs.pop(key) if self.forward_only else self.outputs[key]
                ops.append(("send", sent, ins.peer))
            elif ins.kind is Kind.SEND_BACKWARD:
                ops.append(("send", self.input_grads.pop(key), ins.peer))
            else:
                ops.append(("recv", None, ins.peer))
        received = self.channel.exchange(ops)
        for ins, (_, sent, _), tensor in zip(batch, ops, received):
            key = (ins.chunk, ins.microbatch)
            if ins.kind is Kind.SEND_FORWARD and not self.forward_only:
                free_output(sent)
            elif ins.kind is Kind.RECV_FORWARD:
                self.inputs[key] = tensor.requires_grad_(not self.forward_only)
            elif ins.kind is Kind.RECV_BACKWARD:
                self.output_grads[key] = tensor


def share_losses(losses: list[LossDict], num_microbatches: int, device: torch.device,
                 keys: Sequence[str] | None = None) -> list[LossDict]:
    """The last stage's per-microbatch loss dicts on every pipeline rank (only `keys`, when
    given), values kept on the device.

    One broadcast from the last stage on the pipeline group of float32 values [m, keys]: no
    host sync when the caller names the `keys`; otherwise their names travel first
    (`_share_names`: two host reads on the other ranks).
    """
    group = parallel_state.get_pipeline_model_parallel_group()
    if comm.world_size(group) == 1:
        return losses if keys is None else [{k: d[k] for k in keys} for d in losses]
    place = parallel_state.get_pipeline_placement()
    src = parallel_state.get_pipeline_model_parallel_ranks()[place.locate(place.num_stages - 1)[0]]
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    if keys is None:
        keys = _share_names(list(losses[0]) if last else None, src, group, device)
    if last and keys:
        values = torch.stack([torch.stack([d[k].float().reshape(()) for k in keys])
                              for d in losses])
    else:
        values = torch.empty(num_microbatches, len(keys), dtype=torch.float32, device=device)
    comm.broadcast(values, src, group)
    return [dict(zip(keys, row.unbind(0))) for row in values]


def _share_names(names: list[str] | None, src: int, group, device: torch.device) -> list[str]:
    """The `names` of global rank `src` on every rank of `group` (None elsewhere): a size
    broadcast, then the '\\0'-terminated names as bytes; both are read on the host there."""
    data = "".join(f"{name}\0" for name in names).encode() if names is not None else b""
    size = torch.full((1,), len(data), dtype=torch.int64, device=device)
    comm.broadcast(size, src, group)
    if names is not None:
        payload = torch.tensor(list(data), dtype=torch.uint8, device=device)
    else:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    comm.broadcast(payload, src, group)
    return names if names is not None else bytes(payload.tolist()).decode().split("\0")[:-1]


def _sequence_split(model: nn.Module) -> int:
    """Ranks one sequence is split over between stages: CP, times TP with sequence parallelism."""
    tp = parallel_state.get_tensor_model_parallel_world_size() \
        if getattr(model, "sequence_parallel", False) else 1
    return tp * parallel_state.get_context_parallel_world_size()


def forward_backward(*, schedule: ScheduleKind, forward_step_func: Callable,
                     data_iterator: Iterator | list | None, model: nn.Module | list[nn.Module],
                     num_microbatches: int, seq_length: int, micro_batch_size: int,
                     forward_only: bool = False, loss_scale: float = 1.0,
                     loss_keys: Sequence[str] | None = None,
                     in_flight: InFlight | None = None) -> list[LossDict]:
    """One step of schedule `schedule` on this rank.

    model: this rank's chunk, or its list of v chunks. data_iterator: one
    iterator (tee'd across chunks) or a list of one per chunk. Inter-stage tensors are
    [seq_length, micro_batch_size, hidden_size] in the model's parameter dtype (seq_length
    divided by CP, and by TP when the model is sequence parallel).
    forward_only runs the forwards under no_grad (evaluation); otherwise the call is one
    training step of the chunks' MoE layers (`moe.training_step`: their stats start empty,
    their aux losses get loss_scale / num_microbatches in backward, as the loss does).
    Returns the per-microbatch loss dicts of the last stage on EVERY pipeline rank
    (`share_losses`: only `loss_keys` when given, which spares the other ranks a host sync),
    as float32 scalars when PP > 1, on the device. Invalid (p, m, v) raise the tables'
    ValueError before any communication. A schedule without a flush between steps (2bw) runs
    one step of its steady state with `in_flight` (what the previous call left in flight;
    it drains when `in_flight.drain`; unless `in_flight.aligned` the losses are returned on
    the last stage only, [] elsewhere), and a flushed 1F1B step without it.
    """
    chunks = model if isinstance(model, list) else [model]
    p = parallel_state.get_pipeline_model_parallel_world_size()
    v = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    rank = parallel_state.get_pipeline_model_parallel_rank()
    carry = in_flight if schedule.across_steps and not forward_only else None
    if carry is not None:
        schedule.check_arguments(p, num_microbatches, v)
        table = step_segment(p, num_microbatches, not carry.running, carry.drain)[rank]
    else:  # 2bw without InFlight, or evaluating: a flushed step (1F1B)
        table = rank_table(SCHEDULE_KINDS[ONE_F_ONE_B] if schedule.across_steps else schedule,
                           p, num_microbatches, v, rank, forward_only)
    if len(chunks) != v:
        raise ValueError(f"model: expected {v} model chunk(s) on this rank, got {len(chunks)}")
    param = next(chunks[0].parameters())
    shape = (seq_length // _sequence_split(unwrap(chunks[0])), micro_batch_size,
             unwrap(chunks[0]).config.hidden_size)
    run = _Run(forward_step_func, _chunk_iterators(data_iterator, v), chunks, num_microbatches,
               Channel(shape, param.dtype, param.device), forward_only, loss_scale,
               schedule.placement(p, v), carry and carry.versions)
    if carry is not None:
        run.inputs, run.outputs = carry.inputs, carry.outputs
    with torch.no_grad() if forward_only else \
            training_step(moe_states(chunks), loss_scale / num_microbatches):
        for is_compute, group in itertools.groupby(table, lambda ins: ins.kind in COMPUTE):
            if not is_compute:
                run.communicate(list(group))
                continue
            for ins in group:
                start = time.perf_counter()
                run.compute(ins)
                for observer in _observers:
                    observer(ins, time.perf_counter() - start)
    if carry is not None:
        _carry_over(run, carry)
        if not carry.aligned:  # no collective across the stages: only the last one has them
            return run.losses
    return share_losses(run.losses, num_microbatches, param.device, loss_keys)


def _carry_over(run: _Run, carry: InFlight) -> None:
    """Keep the next step's in-flight forwards (renumbered from 0) and point the params at the
    current weights again."""
    m, carry.running = run.m, not carry.drain
    carry.inputs = {(c, mb - m): t for (c, mb), t in run.inputs.items()}
    carry.outputs = {(c, mb - m): t for (c, mb), t in run.outputs.items()}
    if any(mb < 0 for _, mb in carry.outputs) or run.output_grads or run.input_grads:
        raise RuntimeError("2bw: a step ended with its own microbatches in flight")  # a bug
    if carry.versions is not None:
        carry.versions.point_all_current()


def get_forward_backward_func(pipeline_schedule: str = ONE_F_ONE_B
                              ) -> Callable[..., list[LossDict]]:
    """The step function for the current grid (megalite.mpu.parallel_state).

    PP = 1: gradient accumulation over the microbatches (whatever the schedule). PP > 1:
    `pipeline_schedule` (ParallelConfig.pipeline_schedule) as `tables.resolve_schedule`
    resolves it with the grid's VPP; a schedule in V placement needs the grid built with it
    (initialize_model_parallel(..., v_shape_placement=True)), and only such a schedule.
    The callable takes the keywords forward_step_func, data_iterator, model, num_microbatches,
    seq_length, micro_batch_size, forward_only (and optional loss_scale, loss_keys) and
    returns the per-microbatch loss dicts on every rank (see `forward_backward`).
    """
    kind = resolve_schedule(pipeline_schedule,
                            parallel_state.get_pipeline_model_parallel_world_size(),
                            parallel_state.get_virtual_pipeline_model_parallel_world_size())
    v_shape = parallel_state.is_pipeline_v_shape()
    if kind.v_shape != v_shape:
        v_shaped = ", ".join(k.name for k in SCHEDULE_KINDS.values() if k.v_shape)
        raise ValueError(f"pipeline_schedule: {kind.name} on a grid "
                         f"{'with' if v_shape else 'without'} V placement (initialize_model_"
                         f"parallel(..., v_shape_placement=True) is for {v_shaped}, and only it)")
    return functools.partial(forward_backward, schedule=kind)


_observers: list[Callable[[Instruction, float], None]] = []


@contextlib.contextmanager
def observe_computes(observer: Callable[[Instruction, float], None]) -> Iterator[None]:
    """Inside the block, call `observer(instruction, seconds)` after every compute (F, B, W)
    that `forward_backward` runs on this rank: how benchmarks set compute against step time."""
    _observers.append(observer)
    try:
        yield
    finally:
        _observers.remove(observer)
