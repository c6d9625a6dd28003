"""Run schedule tables in simulated time and measure them.

Times are Fractions, so closed forms such as the bubble (p-1)/m compare exactly.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from fractions import Fraction
from itertools import groupby

from megalite.schedules.tables import COMPUTE, SENDS, Instruction, Kind, Table


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


def num_chunks(table: Table) -> int:
    """v, the number of model chunks per rank."""
    return 1 + max(ins.chunk for rank in table for ins in rank)


def simulate(table: Table, forward_time: float = 1, backward_time: float = 2) -> Timeline:
    """Execute all ranks' lists under the executor rule of `tables`.

    A chunk's forward takes forward_time / v and its backward backward_time / v,
    so a microbatch costs forward_time + backward_time per rank whatever v.
    Communication is free, but a batch completes only once every op in it has
    met its partner (rendezvous, as in an NCCL group): at the latest time at
    which one of them was posted. Raises DeadlockError if the ranks block each other and
    ValueError if the n-th message of a channel is not the same tensor on both
    ends.
    """
    v = num_chunks(table)
    duration = {Kind.FORWARD: Fraction(forward_time) / v, Kind.BACKWARD: Fraction(backward_time) / v}
    messages = _match_messages(table)
    steps = [_steps(rank) for rank in table]
    pc = [0] * len(table)
    clock = [Fraction(0)] * len(table)
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
    return Timeline(spans, max(clock))


def bubble_fraction(table: Table, forward_time: float = 1, backward_time: float = 2) -> Fraction:
    """Idle over compute time of a rank in the simulated run (mean over ranks):
    (p-1)/m for GPipe and 1F1B, (p-1)/(v*m) for interleaved 1F1B."""
    timeline = simulate(table, forward_time, backward_time)
    busy = [sum((s.end - s.start for s in spans), Fraction(0)) for spans in timeline.spans]
    return sum(((timeline.makespan - b) / b for b in busy), Fraction(0)) / len(busy)


def peak_inflight_activations(table: Table, rank: int) -> int:
    """Most (chunk, microbatch) pairs on `rank` whose forward ran but backward not yet."""
    live = peak = 0
    for ins in table[rank]:
        live += (ins.kind is Kind.FORWARD) - (ins.kind is Kind.BACKWARD)
        peak = max(peak, live)
    return peak


def peak_inflight_microbatches(table: Table, rank: int) -> Fraction:
    """peak_inflight_activations in whole-stage microbatches (a chunk holds 1/v of the rank's layers)."""
    return Fraction(peak_inflight_activations(table, rank), num_chunks(table))


def p2p_message_count(table: Table) -> int:
    """Point-to-point messages (each send has one matching recv)."""
    return sum(ins.kind in SENDS for rank in table for ins in rank)


def _steps(instructions: list[Instruction]) -> list[list[int]]:
    """Indices grouped into steps: one per compute, one per run of sends/recvs (a batch)."""
    steps: list[list[int]] = []
    for is_compute, group in groupby(range(len(instructions)), lambda i: instructions[i].kind in COMPUTE):
        steps.extend([[i] for i in group] if is_compute else [list(group)])
    return steps


def _tensor(ins: Instruction, rank: int, p: int) -> tuple[str, int, int]:
    """What a send/recv carries: (activation|grad, stage that sends it, microbatch)."""
    forward = ins.kind in (Kind.SEND_FORWARD, Kind.RECV_FORWARD)
    offset = {Kind.RECV_FORWARD: -1, Kind.RECV_BACKWARD: 1}.get(ins.kind, 0)
    return ("activation" if forward else "grad"), ins.chunk * p + rank + offset, ins.microbatch


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
                channels[side, src, dst].append(_tensor(ins, r, len(table)))
    for src, dst in {(src, dst) for _, src, dst in channels}:
        if channels["send", src, dst] != channels["recv", src, dst]:
            raise ValueError(f"table: rank {src} sends {channels['send', src, dst]} "
                             f"but rank {dst} receives {channels['recv', src, dst]}")
    return ids


def _partner(message: tuple) -> tuple:
    side, src, dst, n = message
    return ("recv" if side == "send" else "send", src, dst, n)
