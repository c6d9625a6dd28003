"""PipeDream-2BW vs 1F1B and ZB-H1 at PP4 on 4 gloo ranks (CPU; one thread each): tokens/s and
the measured bubble at m = 4 and 8, then the lm-loss curve of 2bw vs 1f1b.

    python3 benchmarks/bench_2bw.py                     # the docs' run
    python3 benchmarks/bench_2bw.py --train-iters 60    # a shorter loss curve

Throughput: each schedule runs --warmup + --steps training steps (megalite.training.loop
.train_step: DP-free PP4, grads reduced, AdamW, no clipping, untied embeddings: the same flags
for all) of a GPT with random tokens; 2bw keeps its pipeline full across the steps (drained
after the last) and its stages meet only at the last step, as between log steps of a run;
"2bw aligned" clips (--clip-grad 1), which makes its stages meet at every step's end. Per
step and rank the executor's computes are timed (observe_computes): the measured bubble is
the median over steps of the rank mean of (step time - compute) / compute (each rank's own
step: with 2bw they overlap); the off-CPU bubble, the same median of rank means of the time
the stepping thread slept (neither on a CPU nor waiting for one: blocked on a message, from
Linux's schedstat) over its time on a CPU or waiting for one, is the one that four ranks
sharing fewer than four cores do not inflate with their waits for a core; the simulated one is the schedule's steady state with F = B = W
(megalite.schedules.accounting.schedule_bubble). Each measurement is repeated --repeats
times, the schedules taking turns, and the fastest kept.
Loss curve: pretrain_gpt on the built-in corpus under torchrun (4 ranks, PP4, m = 4, the same
seed) with --pipeline-schedule 1f1b and 2bw side by side, every step logged; --plot writes the
two curves (matplotlib). Asserts nothing.
"""
import functools
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from common import benchmark_parser, machine_line, plot_curves, schedstat, turn_order

SCHEDULES = ("1f1b", "zb-h1", "2bw", "2bw aligned")  # aligned: clipping (step_alignment)
LOSS = re.compile(r"iteration\s+(\d+)/.*?lm loss ([0-9.E+-]+)")


def model_flags(args, m: int, schedule: str) -> list[str]:
    return ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
            "--num-attention-heads", "4", "--seq-length", str(args.seq_length),
            "--max-position-embeddings", str(args.seq_length), "--micro-batch-size",
            str(args.micro_batch_size), "--global-batch-size", str(args.micro_batch_size * m),
            "--pp", "4", "--pipeline-schedule", schedule, "--hidden-dropout", "0",
            "--attention-dropout", "0", "--lr", "1e-3", "--seed", str(args.seed)]


def measure(args, m: int, schedule: str) -> dict:
    """On each of the 4 ranks: {"times": step seconds, "busy": compute seconds per step}."""
    from megalite.config import parse_configs
    from megalite.device import current_device
    from megalite.layout import RunLayout
    from megalite.models import GPTModel
    from megalite.mpu import destroy_model_parallel
    from megalite.optimizer import get_optimizer
    from megalite.optimizer.weight_versions import WeightVersions
    from megalite.schedules.executor import InFlight, observe_computes
    from megalite.training.loop import train_step
    from megalite.training.setup import build_model, setup_parallel

    schedule, _, aligned = schedule.partition(" ")
    configs = parse_configs(model_flags(args, m, schedule) + [
        "--vocab-size", "512", "--untie-embeddings-and-output-weights", "--clip-grad",
        "1.0" if aligned else "0"])
    layout = RunLayout.from_configs(configs, 4)
    setup_parallel(configs, layout)
    model = build_model(configs, lambda pre_process, post_process: GPTModel(
        configs.model, pre_process, post_process, device=current_device()))
    optimizer, _ = get_optimizer(configs.optimizer, configs.precision, model, 100)
    in_flight = InFlight(WeightVersions(model, optimizer)) if schedule == "2bw" else None
    gen = torch.Generator().manual_seed(args.seed)
    batches = iter(lambda: torch.randint(0, 512, (args.micro_batch_size, args.seq_length + 1),
                                         generator=gen), None)

    def forward_step(data_iterator, chunk):
        tokens = next(data_iterator)
        return chunk(tokens[:, :-1], tokens[:, 1:]), lambda out: (
            out.float().mean(), {"lm loss": out.float().mean().detach()})

    busy = [0.0]
    times, computes, sleeps = [], [], []
    total = args.warmup + args.steps
    with observe_computes(lambda ins, seconds: busy.__setitem__(0, busy[0] + seconds)):
        for step in range(total):
            if in_flight is not None:
                in_flight.drain = step == total - 1
                in_flight.aligned = in_flight.drain or bool(aligned)
            busy[0] = 0.0
            start, sched = time.perf_counter(), schedstat()
            train_step(forward_step, batches, model, optimizer, layout, in_flight=in_flight)
            if step >= args.warmup and step < total - 1:  # 2bw's last step drains
                times.append(time.perf_counter() - start)
                computes.append(busy[0])
                running, runnable = (b - a for a, b in zip(sched, schedstat()))
                sleeps.append((times[-1] - running - runnable) / (running + runnable))
    destroy_model_parallel()
    return {"times": times, "busy": computes, "sleeps": sleeps}


def rank_mean_median(ranks: list[list[float]]) -> float:
    """The median over steps of the mean over ranks of a per-step figure."""
    return statistics.median(statistics.mean(step) for step in zip(*ranks))


def throughput(args) -> dict:
    """{(schedule, m): (tokens/s, measured bubble, off-CPU bubble)}, the best of --repeats
    runs each."""
    from megalite.distributed.rank_pool import RankPool
    pool = RankPool(4, 3600)
    best: dict = {}
    try:
        for repeat in range(args.repeats):
            for m in (4, 8):
                for schedule in turn_order(SCHEDULES, repeat):
                    ranks = pool.run(measure, args, m, schedule)
                    seconds = statistics.median(ranks[0]["times"])
                    bubble = rank_mean_median([[(t - c) / c for t, c in zip(
                        r["times"], r["busy"])] for r in ranks])
                    sleeping = rank_mean_median([r["sleeps"] for r in ranks])
                    tokens = args.micro_batch_size * m * args.seq_length / seconds
                    if tokens > best.get((schedule, m), (0,))[0]:
                        best[schedule, m] = (tokens, bubble, sleeping)
    finally:
        pool.close()
    return best


def loss_curve(args, schedule: str, root: str) -> dict[int, float]:
    """pretrain_gpt under torchrun (4 ranks, PP4, m = 4): the lm loss of every step."""
    flags = model_flags(args, 4, schedule) + [
        "--train-iters", str(args.train_iters), "--lr-warmup-iters",
        str(min(10, args.train_iters // 10)), "--log-interval", "1",
        "--eval-interval", "0", "--data-cache-dir", f"{root}/cache-{schedule}"]
    process = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
         "pretrain_gpt.py", *flags], capture_output=True, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    if process.returncode:
        raise SystemExit(f"pretrain_gpt {schedule} failed:\n{process.stdout[-3000:]}"
                         f"{process.stderr[-3000:]}")
    return {int(m[1]): float(m[2]) for m in LOSS.finditer(process.stdout + process.stderr)}


def main() -> None:
    parser = benchmark_parser(__doc__, steps=8, warmup=2, repeats=2, seed=1234, num_layers=8,
                              hidden_size=128, seq_length=64, micro_batch_size=2)
    parser.add_argument("--train-iters", type=int, default=300, help="steps of the loss curve")
    parser.add_argument("--plot", default="docs/2bw_loss.png")
    args = parser.parse_args()
    print(machine_line())
    from megalite.schedules import SCHEDULE_KINDS
    from megalite.schedules.accounting import schedule_bubble
    best = throughput(args)
    print(f"PP4, {args.num_layers} layers, hidden {args.hidden_size}, seq {args.seq_length}, "
          f"micro-batch {args.micro_batch_size}; median of {args.steps} steps, best of "
          f"{args.repeats}")
    print("| schedule | m | tokens/s | measured bubble | off-CPU bubble | simulated bubble "
          "(F = B = W) |")
    print("|---|---|---|---|---|---|")
    for m in (4, 8):
        for schedule in SCHEDULES:
            tokens, bubble, sleeping = best[schedule, m]
            name, _, aligned = schedule.partition(" ")
            simulated = schedule_bubble(SCHEDULE_KINDS[name], 4, m, aligned=bool(aligned))
            print(f"| {schedule} | {m} | {tokens:,.0f} | {bubble:.3f} | {sleeping:.3f} | "
                  f"{float(simulated):.3f} |")
    print(machine_line())
    if not args.train_iters:
        return
    with tempfile.TemporaryDirectory() as root, ThreadPoolExecutor(2) as threads:
        curves = dict(zip(("1f1b", "2bw"), threads.map(
            functools.partial(loss_curve, args, root=root), ("1f1b", "2bw"))))
    last = max(curves["1f1b"])
    tail = {name: statistics.mean(c[i] for i in c if i > last - 20) for name, c in curves.items()}
    print(f"lm loss, mean of the last 20 of {last} steps: 1f1b {tail['1f1b']:.4f}, "
          f"2bw {tail['2bw']:.4f}; step 1: 1f1b {curves['1f1b'][1]:.4f}, 2bw "
          f"{curves['2bw'][1]:.4f}")
    print(machine_line())
    if args.plot:
        plot_curves({name: (list(c), list(c.values())) for name, c in curves.items()},
                    "iteration", "training lm loss",
                    "PP4, m = 4: 2bw (one-step-delayed update) vs 1f1b", args.plot,
                    linewidth=0.8)


if __name__ == "__main__":
    main()
