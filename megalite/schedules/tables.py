"""Pipeline schedules as data: one ordered instruction list per pipeline rank.

Rank r of p holds v model chunks; local chunk c is global stage c*p + r, so the
stage after (rank r, chunk c) is on rank r+1, and the last rank's chunk c feeds
rank 0's chunk c+1 (the zbv schedule uses the V placement instead, see
`Placement`). Ranks, chunks and microbatches count from 0.

Instructions (each carries the LOCAL chunk and the microbatch it belongs to):
  FORWARD, BACKWARD   compute; the last stage's backward starts from the loss.
  BACKWARD_INPUT      B of the split backward (zb-h1, zbv): the input grad only; the
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
from collections.abc import Callable
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


def gpipe(p: int, m: int, v: int = 1) -> Table:
    """GPipe: every rank runs all m forwards, then all m backwards (microbatch
    order). No virtual chunks: v must be 1."""
    _check("gpipe", p, m, v)
    return _build(Placement(p, 1), [_loop_steps(p, m, 1, m, False) for _ in range(p)])


def one_f_one_b(p: int, m: int, v: int = 1) -> Table:
    """1F1B (PipeDream-Flush): rank r warms up with min(p-r-1, m) forwards, then
    alternates one forward and one backward, then cools down with backwards.
    No virtual chunks: v must be 1."""
    _check("1f1b", p, m, v)
    return _build(Placement(p, 1),
                  [_loop_steps(p, m, 1, min(p - rank - 1, m), False) for rank in range(p)])


def interleaved_one_f_one_b(p: int, m: int, v: int) -> Table:
    """Megatron's interleaved 1F1B with v model chunks per rank.

    Microbatches go through the chunks in groups of p (depth-first); rank r
    warms up with min(2(p-r-1) + (v-1)p, m*v) forwards, then alternates, and
    its backwards walk the chunks in reverse order. Needs p >= 2, v >= 2 and m
    a multiple of p.
    """
    _check("interleaved", p, m, v)
    return _build(Placement(p, v), [
        _loop_steps(p, m, v, min(2 * (p - rank - 1) + (v - 1) * p, m * v), True)
        for rank in range(p)])


def zero_bubble_h1(p: int, m: int, v: int = 1) -> Table:
    """ZB-H1 (Qi et al. 2024): 1F1B's forwards and input-grad backwards B, with each weight-grad
    W moved later to fill the cool-down bubble. Rank r warms up with p-r-1 forwards like 1F1B,
    then runs F B W steps whose W lags r microbatches behind its B, and ends with its last r
    W's. Same forwards in flight as 1F1B; bubble (p-1)(F+B-W) instead of (p-1)(F+B+W).
    Needs p >= 2, m >= p and v = 1."""
    _check("zb-h1", p, m, v)
    return _build(Placement(p, 1), [_zb_h1_steps(p, m, rank) for rank in range(p)])


def zero_bubble_v(p: int, m: int, v: int = 2) -> Table:
    """ZBV: two chunks per rank in V placement (rank r holds stages r and 2p-1-r), split
    backward, built by list scheduling with unit F = B = W times: a rank runs a ready B
    first, else a ready F while fewer than 2p chunk-microbatches are between their F and
    their W (1F1B's peak activation memory: p microbatches of the whole rank), else the
    oldest pending W. Needs p >= 2, v = 2 and m >= 2p (with fewer microbatches it runs,
    but the bubble is no longer near zero)."""
    _check("zbv", p, m, v)
    return _build(Placement(p, 2, v_shape=True), _list_schedule(Placement(p, 2, True), m, 2 * p))


SCHEDULES: dict[str, Callable[..., Table]] = {
    "1f1b": one_f_one_b,
    "gpipe": gpipe,
    "interleaved": interleaved_one_f_one_b,
    "zb-h1": zero_bubble_h1,
    "zbv": zero_bubble_v,
}
SPLIT_BACKWARD = frozenset({"zb-h1", "zbv"})  # schedules with separate B and W instructions


def placement(name: str, p: int, v: int) -> Placement:
    """Where schedule `name` puts the stages (V for zbv, loop for the others)."""
    return Placement(p, v, v_shape=name == "zbv")


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
    multi = schedule in ("interleaved", "zb-h1", "zbv")
    _require("p", p, _is_int(p) and p >= (2 if multi else 1),
             f"an int >= 2 pipeline ranks for {schedule}" if multi else "an int >= 1 pipeline ranks")
    if schedule == "interleaved":
        _require("m", m, _is_int(m) and m >= 1 and m % p == 0, f"a positive multiple of p={p} microbatches")
        _require("v", v, _is_int(v) and v >= 2, "an int >= 2 model chunks per rank for interleaved")
    elif schedule == "zbv":
        _require("m", m, _is_int(m) and m >= 1, "an int >= 1 microbatches")
        _require("v", v, v == 2, "2 model chunks per rank for zbv")
    else:
        least = p if schedule == "zb-h1" else 1
        _require("m", m, _is_int(m) and m >= least, f"an int >= {least} microbatches"
                 + (f" (p={p}) for zb-h1" if least > 1 else ""))
        _require("v", v, _is_int(v) and v == 1,
                 f"1 model chunk per rank for {schedule} (more need interleaved or zbv)")


Step = list[Instruction]  # computes run with no communication between them


def _virtual(k: int, p: int, v: int, forward: bool) -> tuple[int, int]:
    """(chunk, microbatch) of the k-th forward (or backward) on a rank: groups of
    p microbatches visit chunk 0, 1, ..., v-1 (backwards: v-1, ..., 0)."""
    chunk = k % (p * v) // p
    microbatch = k // (p * v) * p + k % p
    return (chunk if forward else v - 1 - chunk), microbatch


def _loop_steps(p: int, m: int, v: int, warmup: int, paired: bool) -> list[Step]:
    """Warm-up forwards, then forward/backward pairs (one step each if `paired`,
    else two), then cool-down backwards."""
    total = m * v
    fwd = [Instruction(Kind.FORWARD, *_virtual(k, p, v, True)) for k in range(total)]
    bwd = [Instruction(Kind.BACKWARD, *_virtual(k, p, v, False)) for k in range(total)]
    pairs = [list(fb) for fb in zip(fwd[warmup:], bwd)]
    steady = pairs if paired else [[op] for pair in pairs for op in pair]
    return [[f] for f in fwd[:warmup]] + steady + [[b] for b in bwd[total - warmup:]]


def _zb_h1_steps(p: int, m: int, rank: int) -> list[Step]:
    warmup = p - rank - 1
    order = [Instruction(Kind.FORWARD, 0, k) for k in range(warmup)]
    for k in range(m):
        if warmup + k < m:
            order.append(Instruction(Kind.FORWARD, 0, warmup + k))
        order.append(Instruction(Kind.BACKWARD_INPUT, 0, k))
        if k >= rank:
            order.append(Instruction(Kind.BACKWARD_WEIGHT, 0, k - rank))
    order += [Instruction(Kind.BACKWARD_WEIGHT, 0, k) for k in range(m - rank, m)]
    return [[op] for op in order]


def _list_schedule(place: Placement, m: int, limit: int) -> list[list[Step]]:
    """Per-rank compute order from a unit-time simulation (see zero_bubble_v): at each time
    step every idle rank starts a ready B, else a ready F within `limit` chunk-microbatches
    between F and W, else its oldest pending W. Inputs from another rank arrive when their
    producer ends."""
    p, last = place.p, place.num_stages - 1
    done: dict[tuple[str, int, int], int] = {}  # (F|B, stage, mb) -> end time
    next_f = [[0] * place.v for _ in range(p)]
    next_b = [[0] * place.v for _ in range(p)]
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    live = [0] * p
    order: list[list[Step]] = [[] for _ in range(p)]
    t, remaining = 0, 3 * m * place.num_stages
    while remaining:
        for rank in range(p):
            op = _pick(place, rank, m, t, done, next_f[rank], next_b[rank], pending_w[rank],
                       live[rank] < limit, last)
            if op is None:
                continue
            kind, chunk, mb = op
            stage = place.stage(rank, chunk)
            if kind is Kind.FORWARD:
                next_f[rank][chunk] += 1
                live[rank] += 1
                done["F", stage, mb] = t + 1
            elif kind is Kind.BACKWARD_INPUT:
                next_b[rank][chunk] += 1
                pending_w[rank].append((chunk, mb))
                done["B", stage, mb] = t + 1
            else:
                pending_w[rank].pop(0)
                live[rank] -= 1
            order[rank].append([Instruction(kind, chunk, mb)])
            remaining -= 1
        t += 1
        if t > 12 * m * place.num_stages:
            raise RuntimeError("list scheduling made no progress")  # a bug, not bad input
    return order


def _pick(place: Placement, rank: int, m: int, t: int, done: dict, next_f: list[int],
          next_b: list[int], pending_w: list, may_forward: bool, last: int
          ) -> tuple[Kind, int, int] | None:
    """The op `rank` starts at time t: the oldest ready B, else the oldest ready F (deeper
    chunk first on ties), else the oldest W."""
    def ready(key: tuple[str, int, int]) -> bool:
        return done.get(key, t + 1) <= t

    backwards = [(mb, -chunk) for chunk, mb in enumerate(next_b) if mb < m and
                 ready(("F", s := place.stage(rank, chunk), mb)) and
                 (s == last or ready(("B", s + 1, mb)))]
    if backwards:
        mb, chunk = min(backwards)
        return Kind.BACKWARD_INPUT, -chunk, mb
    forwards = [(mb, -chunk) for chunk, mb in enumerate(next_f) if mb < m and
                ((s := place.stage(rank, chunk)) == 0 or ready(("F", s - 1, mb)))]
    if forwards and may_forward:
        mb, chunk = min(forwards)
        return Kind.FORWARD, -chunk, mb
    if pending_w:
        return Kind.BACKWARD_WEIGHT, *pending_w[0]
    return None


def _build(place: Placement, steps: list[list[Step]]) -> Table:
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
