"""The instruction set of pipeline schedule tables, and how a per-rank compute order
becomes a table: one ordered instruction list per pipeline rank.

Rank r of p holds v model chunks; local chunk c is global stage c*p + r, so the
stage after (rank r, chunk c) is on rank r+1, and the last rank's chunk c feeds
rank 0's chunk c+1 (or the V placement of `megalite.placement.Placement`). Ranks,
chunks and microbatches count from 0.

Instructions (each carries the LOCAL chunk and the microbatch it belongs to):
  FORWARD, BACKWARD   compute; the last stage's backward starts from the loss.
  BACKWARD_INPUT      B of the split backward (zero-bubble): the input grad only; the
                      linear layers queue their weight-grad work.
  BACKWARD_WEIGHT     W: runs that queued work, any time after its B on the same rank.
  RECV_FORWARD        input activation, from the previous stage on `peer`.
  SEND_FORWARD        output activation, to the next stage on `peer`.
  RECV_BACKWARD       grad of the output, from the next stage on `peer`.
  SEND_BACKWARD       grad of the input, to the previous stage on `peer`.
The first global stage has no RECV_FORWARD/SEND_BACKWARD, the last no
SEND_FORWARD/RECV_BACKWARD; consecutive stages on one rank (V placement) hand
over without messages. A recv may come several computes before the one
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
from dataclasses import dataclass

from megalite.placement import Placement


class Kind(enum.Enum):
    FORWARD = enum.auto()
    BACKWARD = enum.auto()
    BACKWARD_INPUT = enum.auto()
    BACKWARD_WEIGHT = enum.auto()
    RECV_FORWARD = enum.auto()
    SEND_FORWARD = enum.auto()
    RECV_BACKWARD = enum.auto()
    SEND_BACKWARD = enum.auto()


COMPUTE = frozenset({Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT})
INPUT_GRAD = frozenset({Kind.BACKWARD, Kind.BACKWARD_INPUT})  # computes whose result goes back
SENDS = frozenset({Kind.SEND_FORWARD, Kind.SEND_BACKWARD})


@dataclass(frozen=True)
class Instruction:
    """One step of a rank's schedule; a send/recv names the other end: `peer` rank and the
    local chunk there (`peer_chunk`)."""

    kind: Kind
    chunk: int
    microbatch: int
    peer: int | None = None
    peer_chunk: int | None = None

    def __str__(self) -> str:
        peer = "" if self.peer is None else f", peer {self.peer} chunk {self.peer_chunk}"
        return f"{self.kind.name}(chunk {self.chunk}, microbatch {self.microbatch}{peer})"


Table = list[list[Instruction]]
Step = list[Instruction]  # computes run with no communication between them


def assemble(place: Placement, steps: list[list[Step]]) -> Table:
    """The table of per-rank compute `steps` on `place`: each step at its lockstep round, each
    followed by its round's batch of sends and recvs (the executor rule above)."""
    return _emit(steps, _rounds(steps, place), place)


def _input_key(op: Instruction, rank: int, place: Placement) -> tuple[str, int, int] | None:
    """(F|B, stage, microbatch) of the compute whose output `op` consumes (None: the data, the
    loss, or a W, whose B is earlier on the same rank)."""
    stage = place.stage(rank, op.chunk)
    if op.kind is Kind.FORWARD:
        return ("F", stage - 1, op.microbatch) if stage > 0 else None
    if op.kind in INPUT_GRAD:
        return ("B", stage + 1, op.microbatch) if stage < place.num_stages - 1 else None
    return None


def _output_key(op: Instruction, rank: int, place: Placement) -> tuple[str, int, int]:
    return ("F" if op.kind is Kind.FORWARD else "B" if op.kind in INPUT_GRAD else "W",
            place.stage(rank, op.chunk), op.microbatch)


def _rounds(steps: list[list[Step]], place: Placement) -> list[list[int]]:
    """Earliest round of every step: after the previous step of its rank and
    after the steps producing its inputs (on other ranks or its own)."""
    done: dict[tuple[str, int, int], int] = {}
    rounds: list[list[int]] = [[] for _ in steps]
    progress = True
    while progress:
        progress = False
        for rank, rank_steps in enumerate(steps):
            for step in rank_steps[len(rounds[rank]):]:
                inputs = [key for op in step if (key := _input_key(op, rank, place))]
                if any(key not in done for key in inputs):
                    break
                t = 1 + max([rounds[rank][-1] if rounds[rank] else -1, *(done[key] for key in inputs)])
                rounds[rank].append(t)
                done.update({_output_key(op, rank, place): t for op in step})
                progress = True
    if any(len(r) != len(s) for r, s in zip(rounds, steps)):
        raise RuntimeError("schedule builder: a compute waits for one that never runs")
    return rounds


def _message(op: Instruction, rank: int, place: Placement) -> tuple[int, Instruction, Instruction] | None:
    """What compute `op` hands to another rank: (that rank, the send, the recv there). None
    when nothing goes out, or the next stage is on the same rank (the executor hands it over)."""
    stage, mb = place.stage(rank, op.chunk), op.microbatch
    if op.kind is Kind.FORWARD and stage < place.num_stages - 1:
        to, kinds = stage + 1, (Kind.SEND_FORWARD, Kind.RECV_FORWARD)
    elif op.kind in INPUT_GRAD and stage > 0:
        to, kinds = stage - 1, (Kind.SEND_BACKWARD, Kind.RECV_BACKWARD)
    else:
        return None
    dst, dst_chunk = place.locate(to)
    if dst == rank:
        return None
    return (dst, Instruction(kinds[0], op.chunk, mb, dst, dst_chunk),
            Instruction(kinds[1], dst_chunk, mb, rank, op.chunk))


def _emit(steps: list[list[Step]], rounds: list[list[int]], place: Placement) -> Table:
    """Each rank's round-t step, then its round-t batch: the sends of what it
    computed in round t and the recvs of what its neighbours did. Messages are
    added in the sender's order on both ends, so channels stay in order."""
    p = place.p
    batches: list[dict[int, list[Instruction]]] = [{} for _ in range(p)]
    for rank in range(p):
        for step, t in zip(steps[rank], rounds[rank]):
            for op in step:
                if msg := _message(op, rank, place):
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
