"""Pipeline schedules as data: one ordered instruction list per pipeline rank.

Rank r of p holds v model chunks; local chunk c is global stage c*p + r, so the
stage after (rank r, chunk c) is on rank r+1, and the last rank's chunk c feeds
rank 0's chunk c+1. Ranks, chunks and microbatches count from 0.

Instructions (each carries the LOCAL chunk and the microbatch it belongs to):
  FORWARD, BACKWARD   compute; the last stage's backward starts from the loss.
  RECV_FORWARD        input activation, from the previous stage on `peer`.
  SEND_FORWARD        output activation, to the next stage on `peer`.
  RECV_BACKWARD       grad of the output, from the next stage on `peer`.
  SEND_BACKWARD       grad of the input, to the previous stage on `peer`.
The first global stage has no RECV_FORWARD/SEND_BACKWARD, the last no
SEND_FORWARD/RECV_BACKWARD. A recv may come several computes before the one
that consumes it: the executor keeps received tensors by (chunk, microbatch).

Executor rule. Walk the list in order and run each compute. A maximal run of
consecutive send/recv instructions is one batch: make one P2POp per
instruction, in list order, post them with a single
torch.distributed.batch_isend_irecv and wait for all of them before going on.
This is deadlock-free even when every op blocks until its partner is posted
(NCCL group semantics), because the tables are built in lockstep rounds:
  * every compute step gets a round number, increasing along each rank and
    greater than the rounds of the steps producing its inputs;
  * the batch a rank posts after its round-t step holds the sends of what it
    computed in round t and the recvs of what its neighbours computed in round
    t, so round-t batches on neighbouring ranks hold exactly each other's
    partners and complete together, round after round (when a rank computes
    nothing between rounds its batches merge, which keeps this true);
  * inside a round, messages are listed in the sender's order on both ends,
    so for each ordered pair (src, dst) the n-th send src->dst and the n-th
    recv on dst from src are the same tensor: messages match in posting order
    (NCCL, or gloo with a single tag).
`megalite.schedules.accounting.simulate` runs tables under these semantics
and raises on a deadlock. A step is one compute, except in the interleaved
steady state where it is one forward + one backward, as in Megatron-LM
(send_forward_recv_backward after each compute without interleaving,
send_forward_backward_recv_forward_backward after each pair with it).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass


class Kind(enum.Enum):
    FORWARD = enum.auto()
    BACKWARD = enum.auto()
    RECV_FORWARD = enum.auto()
    SEND_FORWARD = enum.auto()
    RECV_BACKWARD = enum.auto()
    SEND_BACKWARD = enum.auto()


COMPUTE = frozenset({Kind.FORWARD, Kind.BACKWARD})
SENDS = frozenset({Kind.SEND_FORWARD, Kind.SEND_BACKWARD})


@dataclass(frozen=True)
class Instruction:
    """One step of a rank's schedule; `peer` is the other rank of a send/recv."""

    kind: Kind
    chunk: int
    microbatch: int
    peer: int | None = None

    def __str__(self) -> str:
        peer = "" if self.peer is None else f", peer {self.peer}"
        return f"{self.kind.name}(chunk {self.chunk}, microbatch {self.microbatch}{peer})"


Table = list[list[Instruction]]


def gpipe(p: int, m: int, v: int = 1) -> Table:
    """GPipe: every rank runs all m forwards, then all m backwards (microbatch
    order). No virtual chunks: v must be 1."""
    _check("gpipe", p, m, v)
    return _build(p, m, 1, lambda rank: m, paired=False)


def one_f_one_b(p: int, m: int, v: int = 1) -> Table:
    """1F1B (PipeDream-Flush): rank r warms up with min(p-r-1, m) forwards, then
    alternates one forward and one backward, then cools down with backwards.
    No virtual chunks: v must be 1."""
    _check("1f1b", p, m, v)
    return _build(p, m, 1, lambda rank: min(p - rank - 1, m), paired=False)


def interleaved_one_f_one_b(p: int, m: int, v: int) -> Table:
    """Megatron's interleaved 1F1B with v model chunks per rank.

    Microbatches go through the chunks in groups of p (depth-first); rank r
    warms up with min(2(p-r-1) + (v-1)p, m*v) forwards, then alternates, and
    its backwards walk the chunks in reverse order. Needs p >= 2, v >= 2 and m
    a multiple of p.
    """
    _check("interleaved", p, m, v)
    return _build(p, m, v, lambda rank: min(2 * (p - rank - 1) + (v - 1) * p, m * v), paired=True)


SCHEDULES: dict[str, Callable[..., Table]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_one_f_one_b,
}


def build_schedule(name: str, p: int, m: int, v: int = 1) -> Table:
    """The table of schedule `name` (a key of SCHEDULES) for p ranks, m microbatches, v chunks."""
    _require("name", name, name in SCHEDULES, f"one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name](p, m, v)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _require(arg: str, value: object, ok: bool, expected: str) -> None:
    if not ok:
        raise ValueError(f"{arg}: expected {expected}, got {value!r}")


def _check(schedule: str, p: int, m: int, v: int) -> None:
    if schedule == "interleaved":
        _require("p", p, _is_int(p) and p >= 2, "an int >= 2 pipeline ranks for interleaved")
        _require("m", m, _is_int(m) and m >= 1 and m % p == 0, f"a positive multiple of p={p} microbatches")
        _require("v", v, _is_int(v) and v >= 2, "an int >= 2 model chunks per rank for interleaved")
    else:
        _require("p", p, _is_int(p) and p >= 1, "an int >= 1 pipeline ranks")
        _require("m", m, _is_int(m) and m >= 1, "an int >= 1 microbatches")
        _require("v", v, _is_int(v) and v == 1, f"1 model chunk per rank for {schedule} (more need interleaved)")


def _build(p: int, m: int, v: int, warmup: Callable[[int], int], paired: bool) -> Table:
    steps = [_compute_steps(p, m, v, warmup(rank), paired) for rank in range(p)]
    return _emit(steps, _rounds(steps, p, v), p, v)


Step = list[Instruction]  # computes run with no communication between them


def _virtual(k: int, p: int, v: int, forward: bool) -> tuple[int, int]:
    """(chunk, microbatch) of the k-th forward (or backward) on a rank: groups of
    p microbatches visit chunk 0, 1, ..., v-1 (backwards: v-1, ..., 0)."""
    chunk = k % (p * v) // p
    microbatch = k // (p * v) * p + k % p
    return (chunk if forward else v - 1 - chunk), microbatch


def _compute_steps(p: int, m: int, v: int, warmup: int, paired: bool) -> list[Step]:
    """Warm-up forwards, then forward/backward pairs (one step each if `paired`,
    else two), then cool-down backwards."""
    total = m * v
    fwd = [Instruction(Kind.FORWARD, *_virtual(k, p, v, True)) for k in range(total)]
    bwd = [Instruction(Kind.BACKWARD, *_virtual(k, p, v, False)) for k in range(total)]
    pairs = [list(fb) for fb in zip(fwd[warmup:], bwd)]
    steady = pairs if paired else [[op] for pair in pairs for op in pair]
    return [[f] for f in fwd[:warmup]] + steady + [[b] for b in bwd[total - warmup:]]


def _input_key(op: Instruction, rank: int, p: int, v: int) -> tuple[Kind, int, int] | None:
    """(kind, stage, microbatch) of the compute on another rank whose output `op` consumes."""
    stage = op.chunk * p + rank
    if op.kind is Kind.FORWARD:
        return (op.kind, stage - 1, op.microbatch) if stage > 0 else None
    return (op.kind, stage + 1, op.microbatch) if stage < p * v - 1 else None


def _rounds(steps: list[list[Step]], p: int, v: int) -> list[list[int]]:
    """Earliest round of every step: after the previous step of its rank and
    after the steps producing its inputs on other ranks."""
    done: dict[tuple[Kind, int, int], int] = {}
    rounds: list[list[int]] = [[] for _ in steps]
    progress = True
    while progress:
        progress = False
        for rank, rank_steps in enumerate(steps):
            for step in rank_steps[len(rounds[rank]):]:
                inputs = [key for op in step if (key := _input_key(op, rank, p, v))]
                if any(key not in done for key in inputs):
                    break
                t = 1 + max([rounds[rank][-1] if rounds[rank] else -1, *(done[key] for key in inputs)])
                rounds[rank].append(t)
                done.update({(op.kind, op.chunk * p + rank, op.microbatch): t for op in step})
                progress = True
    return rounds


def _message(op: Instruction, rank: int, p: int, v: int) -> tuple[int, Instruction, Instruction] | None:
    """What compute `op` hands to another rank: (that rank, the send, the recv there)."""
    stage, mb = op.chunk * p + rank, op.microbatch
    if op.kind is Kind.FORWARD and stage < p * v - 1:
        to, kinds = stage + 1, (Kind.SEND_FORWARD, Kind.RECV_FORWARD)
    elif op.kind is Kind.BACKWARD and stage > 0:
        to, kinds = stage - 1, (Kind.SEND_BACKWARD, Kind.RECV_BACKWARD)
    else:
        return None
    return to % p, Instruction(kinds[0], op.chunk, mb, to % p), Instruction(kinds[1], to // p, mb, rank)


def _emit(steps: list[list[Step]], rounds: list[list[int]], p: int, v: int) -> Table:
    """Each rank's round-t step, then its round-t batch: the sends of what it
    computed in round t and the recvs of what its neighbours did. Messages are
    added in the sender's order on both ends, so channels stay in order."""
    batches: list[dict[int, list[Instruction]]] = [{} for _ in range(p)]
    for rank in range(p):
        for step, t in zip(steps[rank], rounds[rank]):
            for op in step:
                if msg := _message(op, rank, p, v):
                    dst, send, recv = msg
                    batches[rank].setdefault(t, []).append(send)
                    batches[dst].setdefault(t, []).append(recv)
    table: Table = []
    for rank in range(p):
        computes = dict(zip(rounds[rank], steps[rank]))
        table.append([
            ins for t in sorted(computes.keys() | batches[rank].keys())
            for ins in computes.get(t, []) + batches[rank].get(t, [])
        ])
    return table
