"""Pipeline schedules as data: the table builders, and one record per schedule kind.

A builder takes p pipeline ranks, m microbatches and v model chunks per rank and returns
one instruction list per rank (`megalite.schedules.instructions`); it raises ValueError
(one line naming the argument) when its record's rules reject (p, m, v). `SCHEDULE_KINDS`
holds the records (`ScheduleKind`): builder, chunks and placement, the microbatches needed,
split backward or not, the closed-form bubble; `resolve_schedule` picks the one a layout runs.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

from megalite.placement import (GPIPE, INTERLEAVED, ONE_F_ONE_B, PIPELINE_SCHEDULES, TWO_BW, ZB_H1,
                                ZBV, Placement)
from megalite.schedules.instructions import (COMPUTE, SENDS, Instruction, Kind, Step, Table,
                                             assemble)


def gpipe(p: int, m: int, v: int = 1) -> Table:
    """GPipe: every rank runs all m forwards, then all m backwards (microbatch order)."""
    kind = SCHEDULE_KINDS[GPIPE]
    kind.check_arguments(p, m, v)
    return assemble(kind.placement(p, v), [_loop_steps(p, m, 1, m, False) for _ in range(p)])


def one_f_one_b(p: int, m: int, v: int = 1) -> Table:
    """1F1B (PipeDream-Flush): rank r warms up with min(p-r-1, m) forwards, then
    alternates one forward and one backward, then cools down with backwards."""
    kind = SCHEDULE_KINDS[ONE_F_ONE_B]
    kind.check_arguments(p, m, v)
    return assemble(kind.placement(p, v),
                    [_loop_steps(p, m, 1, min(p - rank - 1, m), False) for rank in range(p)])


def interleaved_one_f_one_b(p: int, m: int, v: int) -> Table:
    """Megatron's interleaved 1F1B with v model chunks per rank.

    Microbatches go through the chunks in groups of p (depth-first); rank r
    warms up with min(2(p-r-1) + (v-1)p, m*v) forwards, then alternates, and
    its backwards walk the chunks in reverse order.
    """
    kind = SCHEDULE_KINDS[INTERLEAVED]
    kind.check_arguments(p, m, v)
    return assemble(kind.placement(p, v), [
        _loop_steps(p, m, v, min(2 * (p - rank - 1) + (v - 1) * p, m * v), True)
        for rank in range(p)])


def zero_bubble_h1(p: int, m: int, v: int = 1) -> Table:
    """ZB-H1 (Qi et al. 2024): 1F1B's forwards and input-grad backwards B, with each weight-grad
    W moved later to fill the cool-down bubble. Rank r warms up with p-r-1 forwards like 1F1B,
    then runs F B W steps whose W lags r microbatches behind its B, and ends with its last r
    W's. Same forwards in flight as 1F1B; bubble (p-1)(F+B-W) instead of (p-1)(F+B+W)."""
    kind = SCHEDULE_KINDS[ZB_H1]
    kind.check_arguments(p, m, v)
    return assemble(kind.placement(p, v), [_zb_h1_steps(p, m, rank) for rank in range(p)])


def zero_bubble_v(p: int, m: int, v: int = 2) -> Table:
    """ZBV: two chunks per rank in V placement (rank r holds stages r and 2p-1-r), split
    backward, built by list scheduling with unit F = B = W times: a rank runs a ready B
    first, else a ready F while fewer than 2p chunk-microbatches are between their F and
    their W (1F1B's peak activation memory: p microbatches of the whole rank), else the
    oldest pending W. With m < 2p it runs, but the bubble is no longer near zero."""
    kind = SCHEDULE_KINDS[ZBV]
    kind.check_arguments(p, m, v)
    place = kind.placement(p, v)
    return assemble(place, _list_schedule(place, m, 2 * p))


def pipedream_2bw(p: int, m: int, v: int = 1) -> Table:
    """PipeDream-2BW (Narayanan et al. 2021) in steady state: one training step of 1F1B run
    without a flush between steps (`step_segment` between two other steps); run one after
    the other without the stages meeting, they are 1F1B over all steps' microbatches."""
    SCHEDULE_KINDS[TWO_BW].check_arguments(p, m, v)
    return step_segment(p, m, starts=False, drains=False)


@functools.lru_cache(maxsize=32)
def step_segment(p: int, m: int, starts: bool, drains: bool) -> Table:
    """One training step of 1F1B over consecutive steps' microbatches with no flush: each
    rank's part of the 1F1B table of the previous, this and the next step (3m microbatches)
    from the end of the previous step's batch that follows its last backward to the end of
    this step's. Microbatches 0..m-1 are this step's, m.. the next step's forwards a rank runs
    before this step's last backward (p-1-r on rank r); the forwards of this step's first
    microbatches ran in the previous segment. `starts`: nothing is in flight before (no
    previous step); `drains`: the pipeline empties at the end (no next step): with both, it
    is 1F1B. RuntimeError if a message would cross a step's end (it never does for m >= p):
    the optimizer step (and, at some steps, collectives over all stages) runs between a
    rank's segments, so a segment's messages must all pair up within it."""
    before, after = int(not starts), int(not drains)
    table = assemble(Placement(p, 1), [_loop_steps(p, (before + 1 + after) * m, 1,
                                                   p - rank - 1, False) for rank in range(p)])
    segment = []
    for ops in table:
        start = _step_end(ops, before * m - 1) if before else 0
        end = _step_end(ops, (before + 1) * m - 1) if after else len(ops)
        segment.append([dataclasses.replace(ins, microbatch=ins.microbatch - before * m)
                        for ins in ops[start:end]])
    sends = {(r, ins.peer, ins.kind.name[5:], ins.microbatch)
             for r, ops in enumerate(segment) for ins in ops if ins.kind in SENDS}
    recvs = {(ins.peer, r, ins.kind.name[5:], ins.microbatch)
             for r, ops in enumerate(segment) for ins in ops
             if ins.kind not in COMPUTE and ins.kind not in SENDS}
    if sends != recvs:
        raise RuntimeError(f"2bw segment (p={p}, m={m}): a message crosses a step boundary")
    return segment


def _step_end(ops: list[Instruction], last_microbatch: int) -> int:
    """Index in a rank's list just after the batch that follows the backward of
    `last_microbatch`."""
    i = 1 + next(i for i, ins in enumerate(ops)
                 if ins.kind is Kind.BACKWARD and ins.microbatch == last_microbatch)
    while i < len(ops) and ops[i].kind not in COMPUTE:
        i += 1
    return i


def _one(p: int) -> int:
    return 1


@dataclass(frozen=True)
class ScheduleKind:
    """One pipeline schedule, as data: how to build its table and which layouts it runs."""

    name: str                                   # one of megalite.placement.PIPELINE_SCHEDULES
    builder: Callable[[int, int, int], Table]   # (p, m, v) -> table, checked against this record
    min_chunks: int = 1                         # model chunks per rank v: at least this many,
    max_chunks: int | None = 1                  # and at most this many (None: no bound)
    v_shape: bool = False                       # V placement of the stages (else loop)
    split_backward: bool = False                # B and W instructions instead of one backward
    min_ranks: int = 1                          # pipeline ranks p
    min_microbatches: Callable[[int], int] = _one   # least m, of p
    microbatches_multiple_of_p: bool = False
    interleaves_with_vpp: bool = False          # one chunk, but with --vpp it runs interleaved
    across_steps: bool = False                  # no flush between steps: the builder's table is
                                                # one steady-state step (`step_segment`)
    weight_versions: int = 1                    # copies of the weights a rank holds
    closed_bubble: Callable[[int, int, int], Fraction] | None = None  # (p, m, v), F = B = W
    bubble_form: str = "its simulated table"    # the bubble (idle / compute) as a formula

    def placement(self, p: int, v: int) -> Placement:
        """Where the p * v stages sit (rank, local chunk)."""
        return Placement(p, v, v_shape=self.v_shape)

    def runs_chunks(self, v: int) -> bool:
        """Whether it runs v model chunks per rank."""
        return self.min_chunks <= v and (self.max_chunks is None or v <= self.max_chunks)

    def check_arguments(self, p: int, m: int, v: int) -> None:
        """Raise ValueError ("p|m|v: expected ..., got ...") unless the builder takes (p, m, v)."""
        _require("p", p, _is_int(p) and p >= self.min_ranks, f"an int >= {self.min_ranks} "
                 f"pipeline ranks{f' for {self.name}' if self.min_ranks > 1 else ''}")
        if self.microbatches_multiple_of_p:
            _require("m", m, _is_int(m) and m >= 1 and m % p == 0,
                     f"a positive multiple of p={p} microbatches")
        else:
            least = self.min_microbatches(p)
            _require("m", m, _is_int(m) and m >= least, f"an int >= {least} microbatches"
                     + (f" (p={p}) for {self.name}" if least > 1 else ""))
        more = f" (more need {_chunked_names()})" if self.max_chunks == 1 else ""
        _require("v", v, _is_int(v) and self.runs_chunks(v),
                 f"{self._chunks('an int >= ')} per rank for {self.name}{more}")

    def chunks_for(self, pp: int, vpp: int | None) -> int | None:
        """--vpp as a run asking for this schedule on `pp` ranks uses it: a schedule with a
        fixed number of chunks > 1 gets it by default (zbv: 2); ValueError (`check_chunks`)
        unless the schedule that runs takes it. One stage: any schedule is plain accumulation
        (the grid checks --vpp)."""
        if pp == 1:
            return vpp
        if vpp is None and self.min_chunks == self.max_chunks > 1:
            vpp = self.min_chunks
        self.check_chunks(pp, vpp)
        return vpp

    def check_chunks(self, pp: int, vpp: int | None) -> None:
        """The chunk rules (they need no batch sizes): --vpp with a one-chunk schedule, and the
        chunks of the schedule that runs."""
        if vpp and self.max_chunks == 1 and not self.interleaves_with_vpp:
            raise ValueError(f"--pipeline-schedule {self.name} runs one model chunk per rank: "
                             f"drop --vpp ({vpp}) or choose {_chunked_names()}")
        kind = resolve_schedule(self.name, pp, vpp)
        if not kind.runs_chunks(vpp or 1):
            raise ValueError(f"--pipeline-schedule {kind.name} runs {kind._chunks()} per rank, "
                             + (f"got --vpp {vpp}" if vpp else "got no --vpp"))

    def check_microbatches(self, pp: int, microbatches: int) -> None:
        """The microbatch rules of this (resolved) schedule running on `pp` ranks."""
        per_step = (f"microbatches per step ({microbatches} = --global-batch-size / "
                    "(--micro-batch-size x DP))")
        if self.microbatches_multiple_of_p and microbatches % pp:
            raise ValueError(f"{self.name} schedule: {per_step} must be a multiple of --pp ({pp})")
        least = self.min_microbatches(pp)
        if microbatches < least:
            raise ValueError(f"--pipeline-schedule {self.name}: {per_step} must be >= "
                             + (f"--pp ({pp})" if least == pp else str(least)))

    def _chunks(self, at_least: str = "at least ") -> str:
        if self.max_chunks is None:
            return f"{at_least}{self.min_chunks} model chunks"
        return f"{self.max_chunks} model chunk{'s' if self.max_chunks > 1 else ''}"


_KINDS = (
    ScheduleKind(ONE_F_ONE_B, one_f_one_b, interleaves_with_vpp=True,
                 closed_bubble=lambda p, m, v: Fraction(p - 1, m), bubble_form="(p-1)/m"),
    ScheduleKind(GPIPE, gpipe, closed_bubble=lambda p, m, v: Fraction(p - 1, m),
                 bubble_form="(p-1)/m"),
    ScheduleKind(INTERLEAVED, interleaved_one_f_one_b, min_chunks=2, max_chunks=None,
                 min_ranks=2, microbatches_multiple_of_p=True,
                 closed_bubble=lambda p, m, v: Fraction(p - 1, v * m), bubble_form="(p-1)/(v m)"),
    ScheduleKind(ZB_H1, zero_bubble_h1, split_backward=True, min_ranks=2,
                 min_microbatches=lambda p: p,  # closed form: (p-1)(F+B-W) / (m(F+B+W))
                 closed_bubble=lambda p, m, v: Fraction(p - 1, 3 * m), bubble_form="(p-1)/(3m)"),
    ScheduleKind(ZBV, zero_bubble_v, min_chunks=2, max_chunks=2, v_shape=True,
                 split_backward=True, min_ranks=2),  # no closed form for every (p, m)
    ScheduleKind(TWO_BW, pipedream_2bw, min_ranks=2, min_microbatches=lambda p: p,
                 across_steps=True, weight_versions=2,  # bubble: accounting.schedule_bubble
                 bubble_form="0 in the steady state across steps, 2(p-1)/(3m) when the stages "
                 "meet at each step's end (step_alignment)"),
)
SCHEDULE_KINDS: dict[str, ScheduleKind] = {kind.name: kind for kind in _KINDS}


def step_alignment(configs) -> list[str]:
    """What makes the stages of a schedule without a flush (2bw) meet at every step's end (a
    collective over all stages before the update), as flags: gradient clipping (the global
    norm), fp16 loss scaling (the overflow check) and the tied word embedding (its grads
    summed over the first and last stage). Empty: they meet only at log steps, evaluations,
    saves and the end."""
    model = configs.model
    return ([f"--clip-grad {configs.optimizer.clip_grad:g}"] * (configs.optimizer.clip_grad > 0)
            + ["--fp16"] * bool(configs.precision.fp16)
            + ["tied embeddings (no --untie-embeddings-and-output-weights)"]
            * (not model.untie_embeddings_and_output_weights))


def resolve_schedule(pipeline_schedule: str, pp: int, vpp: int | None) -> ScheduleKind:
    """The schedule a grid of `pp` pipeline ranks with `vpp` chunks each runs for
    --pipeline-schedule `pipeline_schedule`: 1F1B (plain accumulation) when pp = 1,
    interleaved when chunks are asked for with a one-chunk schedule, else the one named."""
    kind = schedule_kind(pipeline_schedule)
    if pp == 1:
        return SCHEDULE_KINDS[ONE_F_ONE_B]  # with p = 1: F B F B ..., no communication
    return SCHEDULE_KINDS[INTERLEAVED] if vpp and kind.max_chunks == 1 else kind


def build_schedule(name: str, p: int, m: int, v: int = 1) -> Table:
    """The table of schedule `name` (a SCHEDULE_KINDS key): p ranks, m microbatches, v chunks."""
    return schedule_kind(name, "name").builder(p, m, v)


def schedule_kind(name: str, arg: str = "pipeline_schedule") -> ScheduleKind:
    """The record of schedule `name`; ValueError naming `arg` for an unknown name."""
    _require(arg, name, name in SCHEDULE_KINDS, f"one of {', '.join(PIPELINE_SCHEDULES)}")
    return SCHEDULE_KINDS[name]


def _chunked_names() -> str:
    return " or ".join(k.name for k in SCHEDULE_KINDS.values() if k.max_chunks != 1)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _require(arg: str, value: object, ok: bool, expected: str) -> None:
    if not ok:
        raise ValueError(f"{arg}: expected {expected}, got {value!r}")


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
