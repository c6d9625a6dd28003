"""Run schedule tables in simulated time and measure them.

Times are Fractions, so closed forms such as the bubble (p-1)/m compare exactly.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from itertools import groupby

from megalite.schedules.instructions import COMPUTE, INPUT_GRAD, SENDS, Instruction, Kind, Table
from megalite.schedules.tables import SCHEDULE_KINDS, ScheduleKind, build_schedule, step_segment


class DeadlockError(RuntimeError):
    """No rank can make progress: batches wait on each other in a cycle."""


@dataclass(frozen=True)
class Span:
    """One compute instruction as it ran on a rank."""

    kind: Kind
    chunk: int
    microbatch: int
    start: Fraction
    end: Fraction


@dataclass(frozen=True)
class Timeline:
    spans: list[list[Span]]  # per rank, in execution order
    makespan: Fraction
    ends: tuple[Fraction, ...] = ()  # per rank: when its last instruction completed


def num_chunks(table: Table) -> int:
    """v, the number of model chunks per rank."""
    return 1 + max(ins.chunk for rank in table for ins in rank)


def durations(table: Table, forward_time: float = 1, input_grad_time: float = 1,
              weight_grad_time: float = 1) -> dict[Kind, Fraction]:
    """Time of one chunk's F, B (input grad), W (weight grad) and fused backward (B + W): the
    given per-microbatch times of the rank's whole stage over v chunks."""
    v = num_chunks(table)
    f, b, w = (Fraction(t) / v for t in (forward_time, input_grad_time, weight_grad_time))
    return {Kind.FORWARD: f, Kind.BACKWARD_INPUT: b, Kind.BACKWARD_WEIGHT: w, Kind.BACKWARD: b + w}


def simulate(table: Table, forward_time: float = 1, input_grad_time: float = 1,
             weight_grad_time: float = 1, start: Sequence[Fraction] | None = None) -> Timeline:
    """Execute all ranks' lists under the executor rule of `instructions`, rank r from time
    `start[r]` (default 0).

    Compute times per microbatch and rank: forward_time (F), input_grad_time (B),
    weight_grad_time (W), and their sum B + W for the fused BACKWARD of the schedules
    without split backward; a chunk takes 1/v of them, so a microbatch costs the same
    per rank whatever v.
    Communication is free, but a batch completes only once every op in it has
    met its partner (rendezvous, as in an NCCL group): at the latest time at
    which one of them was posted. Raises DeadlockError if the ranks block each other and
    ValueError if the n-th message of a channel is not the same tensor on both
    ends.
    """
    duration = durations(table, forward_time, input_grad_time, weight_grad_time)
    messages = _match_messages(table)
    steps = [_steps(rank) for rank in table]
    pc = [0] * len(table)
    clock = list(start) if start is not None else [Fraction(0)] * len(table)
    spans: list[list[Span]] = [[] for _ in table]
    posted: dict[tuple, Fraction] = {}
    progress = True
    while progress:
        progress = False
        for r, rank_steps in enumerate(steps):
            while pc[r] < len(rank_steps):
                step = rank_steps[pc[r]]
                ins = table[r][step[0]]
                if ins.kind in COMPUTE:
                    end = clock[r] + duration[ins.kind]
                    spans[r].append(Span(ins.kind, ins.chunk, ins.microbatch, clock[r], end))
                    clock[r] = end
                else:
                    for i in step:
                        if messages[r][i] not in posted:
                            posted[messages[r][i]] = clock[r]
                            progress = True
                    partners = [posted.get(_partner(messages[r][i])) for i in step]
                    if None in partners:
                        break
                    clock[r] = max(clock[r], *partners)
                pc[r] += 1
                progress = True
    blocked = [
        f"rank {r} waits at {table[r][i]}"
        for r, rank_steps in enumerate(steps) if pc[r] < len(rank_steps)
        for i in rank_steps[pc[r]] if _partner(messages[r][i]) not in posted
    ]
    if blocked:
        raise DeadlockError("deadlock: " + "; ".join(blocked))
    return Timeline(spans, max(clock), tuple(clock))


def simulate_steps(tables: list[Table], microbatches: int, aligned: bool = True) -> Timeline:
    """Consecutive training steps `simulate`d one after the other, step i's microbatches
    numbered from i * `microbatches` (2bw: `tables.step_segment` per step). `aligned`: each
    step starts once every rank has finished the one before (a collective over all stages
    ends each step: grad norm, loss, SIGTERM flag); else each rank goes on as soon as it has
    finished its own part (2bw between log steps: no collective spans the stages)."""
    spans: list[list[Span]] = [[] for _ in tables[0]]
    clock = [Fraction(0)] * len(tables[0])
    for step, table in enumerate(tables):
        timeline = simulate(table, start=clock)
        for rank, rank_spans in enumerate(timeline.spans):
            spans[rank] += [dataclasses.replace(s, microbatch=s.microbatch + step * microbatches)
                            for s in rank_spans]
        clock = _next_start(timeline, aligned)
    return Timeline(spans, max(clock), tuple(clock))


def _next_start(timeline: Timeline, aligned: bool) -> list[Fraction]:
    """Per rank, when the next step starts after `timeline`: when every rank has finished
    (`aligned`: a collective over all stages ends the step), else when this rank has."""
    return [timeline.makespan] * len(timeline.ends) if aligned else list(timeline.ends)


def steady_state_bubble(p: int, m: int, aligned: bool, steps: int = 4) -> Fraction:
    """2bw's bubble (idle over compute, F = B = W) per step in its steady state: the time a
    rank takes from the end of one step to the end of the next over the compute of a step,
    less one (mean over ranks), between the last two of `steps` consecutive steady-state
    steps (`step_segment` with carried-in forwards; periodic by then, as the closed forms in
    the tests check: 0, and 2(p-1)/(3m) when `aligned`: the stages meet at each step's end)."""
    segment = step_segment(p, m, starts=False, drains=False)
    clock, previous = [Fraction(0)] * p, []
    for _ in range(steps):
        timeline, previous = simulate(segment, start=clock), clock
        clock = _next_start(timeline, aligned)
    busy = [sum((s.end - s.start for s in spans), Fraction(0)) for spans in timeline.spans]
    return sum(((b - a - c) / c for a, b, c in zip(previous, clock, busy)), Fraction(0)) / p


def idle_over_compute(timeline: Timeline) -> Fraction:
    """Idle over compute time of a rank (mean over ranks)."""
    busy = [sum((s.end - s.start for s in spans), Fraction(0)) for spans in timeline.spans]
    return sum(((timeline.makespan - b) / b for b in busy), Fraction(0)) / len(busy)


def bubble_fraction(table: Table, forward_time: float = 1, input_grad_time: float = 1,
                    weight_grad_time: float = 1) -> Fraction:
    """Idle over compute time of a rank in the simulated run (mean over ranks); with F = B = W
    the closed form of the schedule's record where it has one (`schedule_bubble`)."""
    return idle_over_compute(simulate(table, forward_time, input_grad_time, weight_grad_time))


@functools.lru_cache(maxsize=64)
def schedule_bubble(kind: ScheduleKind, p: int, m: int, v: int = 1,
                    aligned: bool = False) -> Fraction:
    """The bubble (idle over compute, F = B = W) of schedule `kind` on p ranks, m microbatches,
    v chunks: its closed form, else its table in the simulator (about a second at p = 16,
    m = 128). A schedule without a flush between steps (2bw): its steady state across steps,
    with the stages meeting at every step's end when `aligned` (`tables.step_alignment`).
    Raises the builder's ValueError on (p, m, v) the schedule does not take."""
    kind.check_arguments(p, m, v)
    if kind.across_steps:
        return steady_state_bubble(p, m, aligned)
    if kind.closed_bubble is not None:
        return kind.closed_bubble(p, m, v)
    return bubble_fraction(kind.builder(p, m, v))


def peak_inflight_activations(table: Table, rank: int) -> int:
    """Most (chunk, microbatch) pairs on `rank` whose forward ran but whose (input-grad)
    backward not yet: the activations a backward needs, all of which it frees except
    what a pending weight grad keeps (see peak_pending_weight_grads)."""
    return _peak(table[rank], Kind.FORWARD, INPUT_GRAD)


def peak_pending_weight_grads(table: Table, rank: int) -> int:
    """Most (chunk, microbatch) pairs on `rank` whose B ran but W not yet: each keeps its
    linear layers' inputs and output grads (Qi et al.'s M_W, less than a forward's M_B)."""
    return _peak(table[rank], Kind.BACKWARD_INPUT, frozenset({Kind.BACKWARD_WEIGHT}))


def _peak(instructions: list[Instruction], up: Kind, down: frozenset) -> int:
    """Most pairs between their `up` and `down` op, counting those whose `up` ran before the
    list (a step of a schedule without a flush: 2bw's forwards carried in)."""
    seen: set[tuple[int, int]] = set()
    carried = 0
    for ins in instructions:
        key = (ins.chunk, ins.microbatch)
        carried += ins.kind in down and key not in seen
        if ins.kind is up:
            seen.add(key)
    live = peak = carried
    for ins in instructions:
        live += (ins.kind is up) - (ins.kind in down)
        peak = max(peak, live)
    return peak


def peak_inflight_microbatches(table: Table, rank: int) -> Fraction:
    """peak_inflight_activations in whole-stage microbatches (a chunk holds 1/v of the rank's
    layers)."""
    return Fraction(peak_inflight_activations(table, rank), num_chunks(table))


def pipeline_summary(schedule: str, p: int, m: int, v: int = 1,
                     alignment: Sequence[str] = ()) -> str:
    """One line for the start-up log: the schedule, p, v, m, the simulated bubble (idle over
    compute, F = B = W) and the peak in-flight microbatches of each rank, from the table.
    A schedule without a flush (2bw): its steady state across steps, and `alignment`, the
    flags that make its stages meet at every step's end (`tables.step_alignment`)."""
    table = build_schedule(schedule, p, m, v)
    peaks = ", ".join(f"{float(peak_inflight_microbatches(table, r)):g}" for r in range(p))
    kind, where = SCHEDULE_KINDS[schedule], ""
    bubble = schedule_bubble(kind, p, m, v, aligned=bool(alignment)) if kind.across_steps \
        else bubble_fraction(table)
    if kind.across_steps:
        where = (f" per step, the stages meeting at each step's end ({', '.join(alignment)})"
                 if alignment else " in the steady state across steps (the stages meet only "
                 "at log steps, evaluations, saves and the end)")
    return (f"pipeline: schedule {schedule} | p {p}, v {v}, m {m} microbatches | bubble "
            f"{float(bubble):.1%} of compute (simulated, F = B = W){where} | peak "
            f"in-flight microbatches per rank: {peaks}")


def _steps(instructions: list[Instruction]) -> list[list[int]]:
    """Indices grouped into steps: one per compute, one per run of sends/recvs (a batch)."""
    steps: list[list[int]] = []
    for is_compute, group in groupby(range(len(instructions)),
                                     lambda i: instructions[i].kind in COMPUTE):
        steps.extend([[i] for i in group] if is_compute else [list(group)])
    return steps


def _tensor(ins: Instruction, rank: int) -> tuple[str, int, int, int]:
    """What a send/recv carries: (activation|grad, rank and chunk that send it, microbatch)."""
    forward = ins.kind in (Kind.SEND_FORWARD, Kind.RECV_FORWARD)
    sender = (rank, ins.chunk) if ins.kind in SENDS else (ins.peer, ins.peer_chunk)
    return ("activation" if forward else "grad"), *sender, ins.microbatch


def _match_messages(table: Table) -> list[dict[int, tuple]]:
    """Per rank, instruction index -> (side, src, dst, n): the n-th message on channel src->dst."""
    ids: list[dict[int, tuple]] = [{} for _ in table]
    channels: dict[tuple, list[tuple[str, int, int]]] = defaultdict(list)
    for r, rank in enumerate(table):
        for i, ins in enumerate(rank):
            if ins.kind not in COMPUTE:
                side = "send" if ins.kind in SENDS else "recv"
                src, dst = (r, ins.peer) if side == "send" else (ins.peer, r)
                ids[r][i] = (side, src, dst, len(channels[side, src, dst]))
                channels[side, src, dst].append(_tensor(ins, r))
    for src, dst in {(src, dst) for _, src, dst in channels}:
        if channels["send", src, dst] != channels["recv", src, dst]:
            raise ValueError(f"table: rank {src} sends {channels['send', src, dst]} "
                             f"but rank {dst} receives {channels['recv', src, dst]}")
    return ids


def _partner(message: tuple) -> tuple:
    side, src, dst, n = message
    return ("recv" if side == "send" else "send", src, dst, n)
