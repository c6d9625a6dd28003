"""Megalite's pipeline schedules vs torch.distributed.pipelining's, on one model split.

    python benchmarks/bench_pipeline.py [--hidden 256 --seq 128 --micro-batch 2 --microbatches 8]

The same GPT (megalite GPTModel chunks, same weights) over 4 gloo ranks, OMP_NUM_THREADS=1
per rank: megalite 1f1b and zb-h1 (one stage of 2 layers per rank), interleaved (2 chunks,
rank r holds stages r and r + 4) and zbv (2 chunks in V placement: stages r and 7 - r), and
pipelining's ScheduleInterleaved1F1B on the interleaved chunks, ScheduleInterleavedZeroBubble
on both the one-stage split (its ZB-H1 form, the peer of zb-h1) and the interleaved chunks,
and ScheduleZBVZeroBubble on the V chunks. All schedules take turns step by step, so
a changing machine load hits them alike (the grid is rebuilt when the placement changes).

Per schedule: the median step time (forward + backward of m microbatches after warm-up),
the measured bubble (mean over ranks of (step time - the rank's compute time) / its compute
time, compute = the time inside F, B and W), the bubble the table gives in the simulator
with the measured per-stage F, B, W times, the mean loss (all must agree) and the step-time
ratio to the peer. Prints figures; asserts nothing.
"""
import argparse
import functools
import os
import statistics
import time
from collections import defaultdict
from fractions import Fraction

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from common import benchmark_parser, machine_line
from torch import nn
from torch.distributed.pipelining import (PipelineStage, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)

from megalite.config import ModelConfig
from megalite.device import current_device, free_port, init_distributed
from megalite.distributed.finalize import sync_shared_embedding
from megalite.models import GPTModel
from megalite.models.stage import build_model_chunks
from megalite.mpu import destroy_model_parallel, initialize_model_parallel
from megalite.placement import INTERLEAVED, ONE_F_ONE_B, ZB_H1, ZBV
from megalite.schedules import SCHEDULE_KINDS, get_forward_backward_func
from megalite.schedules.accounting import bubble_fraction, schedule_bubble
from megalite.schedules.executor import observe_computes
from megalite.schedules.instructions import Instruction, Kind
from megalite.tasks import gpt as pretrain_gpt

P = 4
LAYOUTS = {"loop, v=1": (None, False), "loop, v=2": (2, False), "V, v=2": (2, True)}
OURS = {ONE_F_ONE_B: "loop, v=1", ZB_H1: "loop, v=1", INTERLEAVED: "loop, v=2", ZBV: "V, v=2"}
PEERS = {"Interleaved1F1B v=2": (ScheduleInterleaved1F1B, "loop, v=2"),
         "InterleavedZeroBubble v=1": (ScheduleInterleavedZeroBubble, "loop, v=1"),
         "InterleavedZeroBubble v=2": (ScheduleInterleavedZeroBubble, "loop, v=2"),
         "ZBVZeroBubble v=2": (ScheduleZBVZeroBubble, "V, v=2")}
PEER_OF = {INTERLEAVED: "Interleaved1F1B v=2", ZB_H1: "InterleavedZeroBubble v=1",
           ZBV: "ZBVZeroBubble v=2"}  # the peer on the same split
OUR_COMPUTE = {Kind.FORWARD: "F", Kind.BACKWARD: "B", Kind.BACKWARD_INPUT: "B",
               Kind.BACKWARD_WEIGHT: "W"}  # the fused backward counts as B
PEER_COMPUTE = {"forward_one_chunk": "F", "backward_one_chunk": "B",
                "backward_weight_one_chunk": "W"}


class PeerStage(nn.Module):
    """A megalite chunk as a pipelining stage: ids [b, s] or hidden [s, b, h] in;
    hidden [s, b, h] or logits [b, s, V] (last stage) out."""

    def __init__(self, chunk: GPTModel) -> None:
        super().__init__()
        self.chunk = chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.chunk.pre_process:
            self.chunk.set_input_tensor(x)
        return self.chunk(x)


def peer_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


class ComputeClock:
    """Seconds spent in F, B and W on this rank: megalite's executor reports its computes
    (`observe`, for executor.observe_computes), pipelining's stage methods are wrapped."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    def observe(self, ins: Instruction, seconds: float) -> None:
        self.add(OUR_COMPUTE[ins.kind], seconds)

    def add(self, kind: str, seconds: float) -> None:
        self.seconds[kind] += seconds
        self.counts[kind] += 1

    def wrap(self, owner: object, methods: dict[str, str]) -> None:
        for name, kind in methods.items():
            setattr(owner, name, self._timed(getattr(owner, name), kind))

    def _timed(self, method, kind: str):
        @functools.wraps(method)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.add(kind, time.perf_counter() - start)
        return timed

    def reset(self) -> None:
        self.seconds.clear()
        self.counts.clear()


def use_layout(layout: str) -> None:
    destroy_model_parallel()
    v, v_shape = LAYOUTS[layout]
    initialize_model_parallel(1, P, v, v_shape_placement=v_shape)


def worker(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    torch.set_num_threads(1)
    init_distributed(rank, P, f"tcp://127.0.0.1:{port}")
    config = ModelConfig(num_layers=args.layers, hidden_size=args.hidden,
                         num_attention_heads=args.heads, vocab_size=args.vocab,
                         max_position_embeddings=args.seq, hidden_dropout=0.0,
                         attention_dropout=0.0)
    chunks = {}
    for layout in LAYOUTS:
        use_layout(layout)
        chunks[layout] = build_model_chunks(lambda pre_process, post_process: GPTModel(
            config, pre_process, post_process, init_seed=args.seed, device=current_device()))
        sync_shared_embedding(chunks[layout])
    m, b = args.microbatches, args.micro_batch
    tokens = torch.randint(0, args.vocab, (m * b, args.seq + 1),
                           generator=torch.Generator().manual_seed(args.seed)).to(current_device())
    clock = ComputeClock()
    steps, losses = {}, {}

    def our_step(name: str) -> None:
        with observe_computes(clock.observe):
            out = get_forward_backward_func(name)(
                forward_step_func=pretrain_gpt.forward_step, model=chunks[OURS[name]],
                data_iterator=({"tokens": t} for t in tokens.split(b)), num_microbatches=m,
                seq_length=args.seq, micro_batch_size=b)
        losses[name] = torch.stack([d["lm loss"] for d in out]).mean().item()

    for name, layout in OURS.items():
        steps[name] = (layout, functools.partial(our_step, name))

    def peer_step(name: str, schedule) -> None:
        peer_losses = []
        if any(stage.is_first for stage in schedule._stages):
            schedule.step(tokens[:, :-1], target=tokens[:, 1:], losses=peer_losses)
        else:
            schedule.step(target=tokens[:, 1:], losses=peer_losses)
        if peer_losses:
            losses[name] = torch.stack(peer_losses).mean().item()

    for name, (cls, layout) in PEERS.items():
        v_shape = LAYOUTS[layout][1]
        stages = [PipelineStage(PeerStage(chunk), (2 * P - 1 - rank if v_shape else P + rank)
                                if c else rank, P * len(chunks[layout]), current_device())
                  for c, chunk in enumerate(chunks[layout])]
        for stage in stages:
            clock.wrap(stage, PEER_COMPUTE)
        try:
            schedule = cls(stages, m, loss_fn=peer_loss)
            steps["peer " + name] = (layout, functools.partial(peer_step, "peer " + name, schedule))
        except Exception as error:  # noqa: BLE001 - reported, the benchmark goes on
            if rank == 0:
                print(f"peer {name}: cannot run here: {str(error).splitlines()[0]}", flush=True)

    order = list(LAYOUTS)  # group the steps by placement: fewer grid rebuilds
    steps = dict(sorted(steps.items(), key=lambda item: order.index(item[1][0])))
    times = {name: [] for name in steps}
    busy = {name: [] for name in steps}
    per_kind = {name: defaultdict(list) for name in steps}
    failed, current = {}, None
    for i in range(args.warmup + args.steps):
        for name, (layout, step) in steps.items():
            if name in failed:
                continue
            if layout != current:
                use_layout(current := layout)
            for chunk in chunks[layout]:
                chunk.zero_grad(set_to_none=True)
            clock.reset()
            dist.barrier()
            start = time.perf_counter()
            try:
                step()
            except Exception as error:  # noqa: BLE001 - reported, the benchmark goes on
                failed[name] = str(error).splitlines()[0]
            dist.barrier()
            if i >= args.warmup and name not in failed:
                times[name].append(time.perf_counter() - start)
                busy[name].append(sum(clock.seconds.values()))
                for kind, seconds in clock.seconds.items():
                    per_kind[name][kind].append(seconds / clock.counts[kind])
    result = {"times": times, "busy": busy, "losses": losses, "failed": failed,
              "per_kind": {name: {kind: statistics.median(s) for kind, s in kinds.items()}
                           for name, kinds in per_kind.items()}}
    gathered = [None] * P
    dist.all_gather_object(gathered, result)
    if rank == 0:
        queue.put(gathered)
    destroy_model_parallel()
    dist.destroy_process_group()


def measured_bubble(ranks: list[dict], name: str) -> float:
    """Median over steps of the mean over ranks of (step time - compute) / compute."""
    per_step = zip(*([(t - c) / c for t, c in zip(r["times"][name], r["busy"][name])]
                     for r in ranks))
    return statistics.median(statistics.mean(step) for step in per_step)


def simulated_bubble(ranks: list[dict], name: str, m: int, v: int) -> Fraction:
    """The table's bubble in the simulator with the measured whole-stage F, B, W (rank mean;
    the fused backward of 1f1b/interleaved is B + W) from the zb-h1 run."""
    kinds = [statistics.mean(r["per_kind"][ZB_H1][k] for r in ranks) for k in "FBW"]
    f, b, w = (Fraction(round(t * 1e5)) for t in kinds)
    return bubble_fraction(SCHEDULE_KINDS[name].builder(P, m, v), f, b, w)


def main() -> None:
    parser = benchmark_parser(__doc__, steps=5, warmup=1, seed=1234)
    parser.add_argument("--layers", type=int, default=8, help="multiple of 2p = 8")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8, help="m, a multiple of p = 4")
    args = parser.parse_args()
    print(machine_line())

    os.environ["OMP_NUM_THREADS"] = "1"
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(rank, args, port, queue)) for rank in range(P)]
    for proc in procs:
        proc.start()
    ranks = queue.get()
    for proc in procs:
        proc.join()
    report(ranks, args)


def report(ranks: list[dict], args: argparse.Namespace) -> None:
    m = args.microbatches
    print(f"GPT {args.layers} layers, hidden {args.hidden}, seq {args.seq}, vocab {args.vocab}, "
          f"micro batch {args.micro_batch}, m = {m}; p = {P} gloo ranks; median of "
          f"{args.steps} steps after {args.warmup} warm-up")
    for name, error in ranks[0]["failed"].items():
        print(f"{name}: failed: {error}")
    kinds = {k: statistics.mean(r["per_kind"][ZB_H1][k] for r in ranks) for k in "FBW"}
    print("measured per-stage times in zb-h1 (rank mean): " + ", ".join(
        f"{k} {t * 1e3:.1f} ms" for k, t in kinds.items()))
    losses = {name: loss for r in ranks for name, loss in r["losses"].items()}
    reference = losses[ONE_F_ONE_B]
    print(f"{'schedule':36}{'ms/step':>9}{'bubble':>8}{'table':>8}{'loss':>11}"
          f"{'vs 1f1b':>9}{'/ peer':>8}")
    step_ms = {name: statistics.median(ranks[0]["times"][name]) * 1e3
               for name in ranks[0]["times"] if name not in ranks[0]["failed"]}
    for name, ms in step_ms.items():
        ours = name in OURS
        v = SCHEDULE_KINDS[name].min_chunks if ours else 0
        table = f"{float(simulated_bubble(ranks, name, m, v)):.3f}" if ours else "-"
        peer = "peer " + PEER_OF[name] if name in PEER_OF else None
        ratio = f"{ms / step_ms[peer]:.3f}" if peer in step_ms else "-"
        rel = abs(losses[name] - reference) / abs(reference)
        label = f"megalite {name}" if ours else f"pipelining {name[5:]}"
        print(f"{label:36}{ms:9.1f}{measured_bubble(ranks, name):8.3f}{table:>8}"
              f"{losses[name]:11.6f}{rel:9.1e}{ratio:>8}")
    h1 = measured_bubble(ranks, ZB_H1)
    base = measured_bubble(ranks, ONE_F_ONE_B)
    print(f"target ZB-H1 bubble <= 0.5 x 1F1B's at m = {m} (2p = {2 * P}): {h1:.3f} vs "
          f"0.5 x {base:.3f} = {0.5 * base:.3f} -> {'met' if h1 <= 0.5 * base else 'NOT met'}")
    for name in (ZB_H1, ZBV):
        peer = "peer " + PEER_OF[name]
        if peer in step_ms:
            ok = step_ms[name] <= step_ms[peer]
            print(f"target megalite {name} step time <= pipelining {PEER_OF[name]}: "
                  f"{step_ms[name]:.1f} vs {step_ms[peer]:.1f} ms -> {'met' if ok else 'NOT met'}")
    print("schedules' bubbles (F = B = W): " + ", ".join(
        f"{name} {kind.bubble_form} = {float(schedule_bubble(kind, P, m, kind.min_chunks)):.3f}"
        for name, kind in SCHEDULE_KINDS.items() if name in OURS))


if __name__ == "__main__":
    main()
