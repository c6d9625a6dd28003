"""Draw a pipeline schedule's simulated timeline as a PNG (forward 1, backward 2 time units).

    python tools/plot_schedule.py --schedule interleaved --pp 4 --vpp 2 --microbatches 8 --out schedule.png

One row per pipeline rank (rank 0 on top); forwards blue, backwards green, darker
for later model chunks; microbatches are numbered from 1, as in the papers.
"""

import argparse
import sys
from fractions import Fraction
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from megalite.schedules.accounting import bubble_fraction, simulate  # noqa: E402
from megalite.schedules.tables import SCHEDULES, Kind, build_schedule  # noqa: E402

FORWARD_TIME, BACKWARD_TIME = 1, 2
COLORS = {Kind.FORWARD: plt.cm.Blues, Kind.BACKWARD: plt.cm.Greens}


def color(kind: Kind, chunk: int, v: int):
    return COLORS[kind](0.35 + 0.4 * chunk / max(v - 1, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", choices=list(SCHEDULES), default="1f1b")
    parser.add_argument("--pp", type=int, default=4, help="pipeline ranks p")
    parser.add_argument("--vpp", type=int, default=1, help="model chunks per rank v (interleaved only)")
    parser.add_argument("--microbatches", type=int, default=8, help="microbatches m")
    parser.add_argument("--out", default="schedule.png")
    args = parser.parse_args()
    p, v, m = args.pp, args.vpp, args.microbatches
    try:
        table = build_schedule(args.schedule, p, m, v)
    except ValueError as err:
        parser.error(str(err))
    timeline = simulate(table, FORWARD_TIME, BACKWARD_TIME)
    bubble, closed = bubble_fraction(table, FORWARD_TIME, BACKWARD_TIME), Fraction(p - 1, v * m)
    print(f"bubble fraction: table {float(bubble):.4f} ({bubble}), closed form (p-1)/(v*m) {float(closed):.4f} ({closed})")

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
    ax.set_xlabel(f"time (a microbatch's forward = {FORWARD_TIME}, backward = {BACKWARD_TIME} per rank)")
    ax.set_title(f"{args.schedule}: p={p}, v={v}, m={m}, bubble = {bubble} = {float(bubble):.3f}")
    ax.legend(handles=[Patch(color=color(kind, c, v), label=f"{kind.name.lower()} chunk {c}")
                       for kind in COLORS for c in range(v)],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
