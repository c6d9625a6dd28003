"""Pipeline schedule tables, checked as pure data against closed forms.

v is the number of model chunks per rank: 1 for gpipe and 1f1b (each rank holds
one contiguous stage), 2 or 4 for interleaved (rank r holds stages r, r+p, ...).
"""

from collections import Counter
from fractions import Fraction
from functools import cache

import pytest

from megalite.config import parse_configs
from megalite.layout import RunLayout
from megalite.placement import PIPELINE_SCHEDULES
from megalite.schedules import SCHEDULE_KINDS, resolve_schedule
from megalite.schedules.accounting import (
    DeadlockError,
    bubble_fraction,
    num_chunks,
    peak_inflight_activations,
    peak_inflight_microbatches,
    simulate,
)
from megalite.schedules.instructions import Instruction, Kind
from megalite.schedules.tables import build_schedule, gpipe, interleaved_one_f_one_b, one_f_one_b
from tests.helpers.schedule_checks import assert_dependencies_hold

F, B = Kind.FORWARD, Kind.BACKWARD
SEND_F, RECV_F, SEND_B, RECV_B = Kind.SEND_FORWARD, Kind.RECV_FORWARD, Kind.SEND_BACKWARD, Kind.RECV_BACKWARD

GRID = [
    (name, p, v, m)
    for p in (2, 3, 4, 8)
    for m in (p, 2 * p, 3 * p)
    for name, vs in (("gpipe", (1,)), ("1f1b", (1,)), ("interleaved", (2, 4)))
    for v in vs
]
# m below p or not a multiple of it, and a single rank: allowed without interleaving.
EXTRA = [(name, p, 1, m) for name in ("gpipe", "1f1b") for p, m in ((4, 1), (4, 3), (3, 5), (1, 3))]
CASES = GRID + EXTRA
each_case = pytest.mark.parametrize("case", CASES, ids=[f"{n}-p{p}-v{v}-m{m}" for n, p, v, m in CASES])


@cache
def table(name, p, v, m):
    return build_schedule(name, p, m, v)


@cache
def timeline(name, p, v, m):
    return simulate(table(name, p, v, m))  # F = B = W = 1: backward 2


def stage(rank, chunk, p):
    return chunk * p + rank


@each_case
def test_every_chunk_and_microbatch_has_one_forward_and_one_backward(case):
    name, p, v, m = case
    for rank, instructions in enumerate(table(*case)):
        computes = Counter((i.kind, i.chunk, i.microbatch) for i in instructions if i.kind in (F, B))
        assert computes == Counter((k, c, mb) for k in (F, B) for c in range(v) for mb in range(m)), rank


@each_case
def test_every_send_has_one_matching_recv_in_posting_order(case):
    name, p, v, m = case
    sent, received = {}, {}  # (src, dst) -> [(kind, sending stage, microbatch)], in list order
    for rank, instructions in enumerate(table(*case)):
        for i in instructions:
            s = stage(rank, i.chunk, p)
            if i.kind in (SEND_F, SEND_B):
                to = s + 1 if i.kind is SEND_F else s - 1
                assert 0 <= to < p * v and i.peer == to % p, (rank, i)
                sent.setdefault((rank, i.peer), []).append((i.kind is SEND_F, s, i.microbatch))
            elif i.kind in (RECV_F, RECV_B):
                frm = s - 1 if i.kind is RECV_F else s + 1
                assert 0 <= frm < p * v and i.peer == frm % p, (rank, i)
                received.setdefault((i.peer, rank), []).append((i.kind is RECV_F, frm, i.microbatch))
    assert sent == received
    messages = [msg for channel in sent.values() for msg in channel]
    assert len(messages) == len(set(messages)) == 2 * m * (v * p - 1)


@each_case
def test_recv_before_its_compute_and_send_after_it(case):
    for instructions in table(*case):
        where = {(i.kind, i.chunk, i.microbatch): n for n, i in enumerate(instructions)}
        for (kind, chunk, mb), n in where.items():
            if kind in (RECV_F, RECV_B):
                assert n < where[F if kind is RECV_F else B, chunk, mb]
            if kind in (SEND_F, SEND_B):
                assert n > where[F if kind is SEND_F else B, chunk, mb]


@each_case
def test_simulated_timeline_respects_dependencies(case):
    name, p, v, m = case
    spans = {(s.kind, stage(rank, s.chunk, p), s.microbatch): s for rank, rs in enumerate(timeline(*case).spans) for s in rs}
    assert_dependencies_hold(spans, p * v - 1)


@each_case
def test_bubble_fraction_matches_closed_form(case):
    name, p, v, m = case
    expected = Fraction(p - 1, v * m) if name == "interleaved" else Fraction(p - 1, m)
    assert bubble_fraction(table(*case)) == expected
    assert timeline(*case).makespan == (m + Fraction(p - 1, v)) * 3


def leading_forwards(instructions):
    computes = [i.kind for i in instructions if i.kind in (F, B)]
    return computes.index(B)


@each_case
def test_warmup_and_peak_inflight(case):
    name, p, v, m = case
    t = table(*case)
    for rank in range(p):
        # Forwards before the first backward: the warm-up plus, when backwards
        # remain for the steady state, its first forward.
        if name == "gpipe":
            warmup, steady = m, False
        elif name == "1f1b":
            warmup = min(p - rank - 1, m)
            steady = warmup < m
        else:
            warmup = min(2 * (p - rank - 1) + (v - 1) * p, m * v)
            steady = warmup < m * v
        assert leading_forwards(t[rank]) == warmup + steady
        assert peak_inflight_activations(t, rank) == warmup + steady
    peak0 = {"gpipe": m, "1f1b": min(p, m), "interleaved": Fraction(min((v + 1) * p - 1, m * v), v)}[name]
    assert peak_inflight_microbatches(t, 0) == peak0
    if name == "interleaved" and m >= 2 * p:  # Megatron: p * (1 + (p-1)/(p*v))
        assert peak_inflight_microbatches(t, 0) == p * (1 + Fraction(p - 1, p * v))


def test_simulator_detects_deadlock():
    good = one_f_one_b(2, 1)
    assert good[0] == [
        Instruction(F, 0, 0), Instruction(SEND_F, 0, 0, 1, 0), Instruction(RECV_B, 0, 0, 1, 0), Instruction(B, 0, 0)
    ]
    simulate(good)
    # Rank 0 waits for the grad before running the forward rank 1 needs.
    broken = [[good[0][2], good[0][0], good[0][1], good[0][3]], good[1]]
    with pytest.raises(DeadlockError, match="rank 0 .*RECV_BACKWARD"):
        simulate(broken)


def test_simulator_rejects_messages_out_of_order():
    t = one_f_one_b(2, 2)
    sends = [n for n, i in enumerate(t[0]) if i.kind is SEND_F]
    t[0][sends[0]], t[0][sends[1]] = t[0][sends[1]], t[0][sends[0]]
    with pytest.raises(ValueError, match="rank 0 sends"):
        simulate(t)


@pytest.mark.parametrize(
    "build, arg",
    [
        (lambda: interleaved_one_f_one_b(4, 8, 1), "v"),
        (lambda: interleaved_one_f_one_b(4, 6, 2), "m"),
        (lambda: interleaved_one_f_one_b(1, 4, 2), "p"),
        (lambda: one_f_one_b(4, 8, 2), "v"),
        (lambda: gpipe(4, 8, 2), "v"),
        (lambda: gpipe(0, 8), "p"),
        (lambda: one_f_one_b(4, 0), "m"),
        (lambda: one_f_one_b(4, 2.0), "m"),
        (lambda: one_f_one_b("4", 8), "p"),
        (lambda: build_schedule("zero-bubble-h3", 4, 8, 1), "name"),
    ],
)
def test_invalid_arguments_raise_one_clear_line(build, arg):
    with pytest.raises(ValueError) as err:
        build()
    message = str(err.value)
    assert message.startswith(f"{arg}: expected ") and "\n" not in message


def test_one_record_per_schedule_name_agrees_with_its_table():
    assert list(SCHEDULE_KINDS) == list(PIPELINE_SCHEDULES)
    p, m = 4, 8
    for name, kind in SCHEDULE_KINDS.items():
        t = kind.builder(p, m, kind.min_chunks)
        assert kind.name == name and num_chunks(t) == kind.min_chunks
        assert kind.split_backward == any(i.kind is Kind.BACKWARD_INPUT for rank in t for i in rank)
        if kind.closed_bubble is not None:
            assert kind.closed_bubble(p, m, kind.min_chunks) == bubble_fraction(t), name


@pytest.mark.parametrize("requested, pp, vpp, runs", [
    ("zbv", 1, None, "1f1b"), ("gpipe", 1, None, "1f1b"), ("1f1b", 4, None, "1f1b"),
    ("1f1b", 4, 2, "interleaved"), ("gpipe", 4, 2, "interleaved"), ("interleaved", 4, 2, "interleaved"),
    ("zb-h1", 4, None, "zb-h1"), ("zbv", 4, 2, "zbv"),
])
def test_resolve_schedule(requested, pp, vpp, runs):
    assert resolve_schedule(requested, pp, vpp) is SCHEDULE_KINDS[runs]


def test_resolve_schedule_rejects_unknown_names():
    with pytest.raises(ValueError, match="^pipeline_schedule: expected one of 1f1b, gpipe, "):
        resolve_schedule("zero-bubble-h3", 4, None)


PER_STEP = "microbatches per step ({} = --global-batch-size / (--micro-batch-size x DP))"


def run_layout(requested: str, pp: int, vpp: int | None, m: int) -> RunLayout:
    """The run layout of --pipeline-schedule `requested` on pp ranks (DP 1), m microbatches."""
    flags = ["--pp", str(pp), "--pipeline-schedule", requested, "--num-layers", "8",
             "--micro-batch-size", "1", "--global-batch-size", str(m)]
    return RunLayout.from_configs(parse_configs(flags + (["--vpp", str(vpp)] if vpp else [])),
                                  pp)


@pytest.mark.parametrize("requested, pp, vpp, m, message", [
    ("zb-h1", 2, 2, 4, "--pipeline-schedule zb-h1 runs one model chunk per rank: drop --vpp (2) "
                       "or choose interleaved or zbv"),
    ("gpipe", 2, 2, 4, "--pipeline-schedule gpipe runs one model chunk per rank: drop --vpp (2) "
                       "or choose interleaved or zbv"),
    ("zbv", 2, 4, 4, "--pipeline-schedule zbv runs 2 model chunks per rank, got --vpp 4"),
    ("interleaved", 2, None, 4, "--pipeline-schedule interleaved runs at least 2 model chunks per "
                                "rank, got no --vpp"),
    ("1f1b", 2, 2, 3, f"interleaved schedule: {PER_STEP.format(3)} must be a multiple of --pp (2)"),
    ("zb-h1", 4, None, 2, f"--pipeline-schedule zb-h1: {PER_STEP.format(2)} must be >= --pp (4)"),
])
def test_layout_check_raises_one_line_naming_the_flag(requested, pp, vpp, m, message):
    with pytest.raises(ValueError) as err:
        run_layout(requested, pp, vpp, m)
    assert str(err.value) == message


@pytest.mark.parametrize("requested, pp, vpp, m", [
    ("1f1b", 1, None, 1), ("gpipe", 4, None, 3), ("1f1b", 4, 2, 8), ("interleaved", 2, 4, 2),
    ("zb-h1", 4, None, 4), ("zbv", 4, 2, 1),
])
def test_layout_check_accepts_what_the_tables_build(requested, pp, vpp, m):
    layout = run_layout(requested, pp, vpp, m)
    layout.schedule.builder(pp, m, layout.chunks_per_rank)
