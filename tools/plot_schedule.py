"""Draw a pipeline schedule's simulated timeline as a PNG (F = B = W = 1 time unit; a fused backward 2).

    python tools/plot_schedule.py --schedule interleaved --pp 4 --vpp 2 --microbatches 8 --out schedule.png
    python tools/plot_schedule.py --schedule zb-h1 --pp 4 --microbatches 8 --out zb-h1.png
    python tools/plot_schedule.py --schedule 2bw --pp 4 --microbatches 4 --steps 4 --out 2bw.png

One row per pipeline rank (rank 0 on top); forwards blue, backwards green (split backward:
input grads B orange, weight grads W purple), darker for later model chunks; microbatches are
numbered from 1, as in the papers. Prints the bubble and, per rank, the peak in-flight
activations (microbatches between F and B) and pending weight grads (between B and W).
--steps draws that many consecutive training steps, each starting once every rank has
finished the one before (the step's collectives); a schedule without a flush (2bw) runs its
steady state across them (its first step starts empty, its last drains), microbatches
numbered on across steps, each rank going on with the next step as soon as it has finished
its part (no collective spans the stages between log steps), or with --aligned the stages
meeting at each step's end (as with clipping, fp16 or tied embeddings: step_alignment).
"""

import argparse

import matplotlib
import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from megalite.placement import ONE_F_ONE_B, PIPELINE_SCHEDULES
from megalite.schedules import SCHEDULE_KINDS
from megalite.schedules.accounting import (idle_over_compute, num_chunks,
                                           peak_inflight_activations, peak_pending_weight_grads,
                                           schedule_bubble, simulate_steps)
from megalite.schedules.instructions import Kind
from megalite.schedules.tables import step_segment

matplotlib.use("Agg")  # files, no display

COLORS = {Kind.FORWARD: plt.cm.Blues, Kind.BACKWARD: plt.cm.Greens,
          Kind.BACKWARD_INPUT: plt.cm.Oranges, Kind.BACKWARD_WEIGHT: plt.cm.Purples}


def color(kind: Kind, chunk: int, v: int):
    return COLORS[kind](0.35 + 0.4 * chunk / max(v - 1, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", choices=PIPELINE_SCHEDULES, default=ONE_F_ONE_B)
    parser.add_argument("--pp", type=int, default=4, help="pipeline ranks p")
    parser.add_argument("--vpp", type=int, default=None,
                        help="model chunks per rank v (default: the schedule's least)")
    parser.add_argument("--microbatches", type=int, default=8, help="microbatches m")
    parser.add_argument("--steps", type=int, default=1, help="consecutive training steps")
    parser.add_argument("--aligned", action="store_true",
                        help="2bw: the stages meet at each step's end (clipping, fp16, tied "
                        "embeddings)")
    parser.add_argument("--out", default="schedule.png")
    args = parser.parse_args()
    p, m, kind = args.pp, args.microbatches, SCHEDULE_KINDS[args.schedule]
    v = args.vpp or kind.min_chunks
    try:
        table = kind.builder(p, m, v)
    except ValueError as err:
        parser.error(str(err))
    if args.steps < 1:
        parser.error(f"--steps: expected an int >= 1, got {args.steps}")
    steps = [step_segment(p, m, i == 0, i == args.steps - 1) if kind.across_steps else table
             for i in range(args.steps)]
    timeline = simulate_steps(steps, m, aligned=args.aligned or not kind.across_steps)
    bubble = idle_over_compute(timeline)
    closed = schedule_bubble(kind, p, m, v, aligned=args.aligned)
    print(f"bubble fraction: {args.steps} step(s) {float(bubble):.4f} ({bubble}), schedule's "
          f"record (steady state) {float(closed):.4f} ({closed} = {kind.bubble_form})")
    for rank in range(p):
        print(f"rank {rank}: peak in-flight activations "
              f"{peak_inflight_activations(table, rank) / num_chunks(table):g} microbatches, "
              f"peak pending weight grads {peak_pending_weight_grads(table, rank) / v:g}")

    makespan = float(timeline.makespan)
    fig, ax = plt.subplots(figsize=(min(max(8, 0.2 * makespan * (1 + v)), 40), 1.2 + 0.5 * p))
    for rank, spans in enumerate(timeline.spans):
        for s in spans:
            ax.barh(rank, float(s.end - s.start), left=float(s.start), height=0.8,
                    color=color(s.kind, s.chunk, v), edgecolor="black", linewidth=0.5)
            ax.text(float(s.start + s.end) / 2, rank, str(s.microbatch + 1),
                    ha="center", va="center", fontsize=7)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_xlim(0, makespan)
    ax.set_xlabel("time (per rank and microbatch: F = B = W = 1, fused backward B+W = 2)")
    ax.set_title(f"{args.schedule}: p={p}, v={v}, m={m}, {args.steps} step(s), bubble = {bubble} "
                 f"= {float(bubble):.3f}")
    ax.legend(handles=[Patch(color=color(kind, c, v), label=f"{kind.name.lower()} chunk {c}")
                       for kind in COLORS for c in range(v)
                       if any(s.kind is kind for spans in timeline.spans for s in spans)],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
