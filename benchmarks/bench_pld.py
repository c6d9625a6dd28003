"""Progressive layer dropping vs none: step time, layers computed and validation loss per
wall-clock second, pretrain_gpt on the built-in corpus, one process each (CPU + gloo unless
--device-flags say otherwise).

    python3 benchmarks/bench_pld.py                  # the docs' run
    python3 benchmarks/bench_pld.py --train-iters 60 --plot ''   # quicker

The runs have the same model, data, seed and flags, one thread each; none and pld run side by
side, so that both see the same load on a shared machine (a core each on an idle 2-core one),
then the third run below alone; the PLD run adds
--progressive-layer-drop --pld-theta THETA --pld-gamma GAMMA (γ scaled to the run's length,
DeepSpeed's 0.001 is for ~100k steps). Each run logs every step; the table compares the
median ms/iter over the second half of the run (θ(t) near θ̄ there) with the share of layers
computed (the embedding, output layer and optimizer step do not shrink) and with the FLOPs
per step the log counts (only the layers run): a step time in proportion to the work run has
the FLOPs' ratio. CPU ms/iter (the main thread's time on a CPU per step, from Linux's
schedstat) is the step time that other processes' load does not stretch.
A third run without dropping at half the depth (L / 2 layers) measures what a layer costs: the
layers' CPU time is twice (none - half depth), the rest is what does not shrink, and pld's CPU
time in proportion to the layers it computes is the rest plus the layers' time times that share
(each layer's optimizer update, which dropping does not skip, is counted with the layers).
--plot writes validation loss against wall-clock seconds of both runs (matplotlib).
Asserts nothing.
"""
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from common import benchmark_parser, machine_line, plot_curves, schedstat

ITERATION = re.compile(r"iteration\s+(\d+)/.*?(?:layers computed ([0-9.]+) \| )?ms/iter (\d+)"
                       r".*?TFLOP/s/device ([0-9.]+)")
VALIDATION = re.compile(r"validation at iteration (\d+) \| lm loss ([0-9.E+-]+)")


def run(flags: list[str]) -> dict:
    """One pretrain_gpt run, one thread (OMP_NUM_THREADS=1): per step (iteration, layers
    computed, ms, CPU ms, GFLOP), and (seconds since start, iteration, validation loss) of each
    evaluation. CPU ms: the main thread's time on a CPU between two log lines (read when each
    line arrives) per step between them: the step without its waits for a core."""
    start = time.time()
    process = subprocess.Popen([sys.executable, "pretrain_gpt.py", *flags],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    steps, validations, last = [], [], None
    for line in process.stdout:
        if match := ITERATION.search(line):
            iteration, cpu = int(match[1]), schedstat(process.pid)[0]
            cpu_ms = (cpu - last[1]) * 1e3 / (iteration - last[0]) if last else float("nan")
            last = iteration, cpu
            steps.append((iteration, float(match[2] or 1.0), float(match[3]), cpu_ms,
                          float(match[4]) * float(match[3])))
        elif match := VALIDATION.search(line):
            validations.append((time.time() - start, int(match[1]), float(match[2])))
    if process.wait():
        raise SystemExit(f"pretrain_gpt failed: {' '.join(flags)}")
    return {"steps": steps, "validations": validations, "seconds": time.time() - start}


def main() -> None:
    parser = benchmark_parser(__doc__, num_layers=8, hidden_size=128, seq_length=64)
    parser.add_argument("--train-iters", type=int, default=150)
    parser.add_argument("--theta", type=float, default=0.5)
    parser.add_argument("--gamma", type=float, default=0.03)
    parser.add_argument("--plot", default="docs/pld_validation.png")
    args = parser.parse_args()
    print(machine_line())
    with tempfile.TemporaryDirectory() as root:
        base = ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
                "--num-attention-heads", "4", "--seq-length", str(args.seq_length),
                "--max-position-embeddings", str(args.seq_length), "--micro-batch-size", "4",
                "--global-batch-size", "8", "--train-iters", str(args.train_iters),
                "--lr", "1e-3", "--lr-warmup-iters", "10", "--log-interval", "1",
                "--eval-interval", str(max(1, args.train_iters // 6)), "--eval-iters", "4",
                "--hidden-dropout", "0", "--attention-dropout", "0",
                "--data-cache-dir", f"{root}/cache"]
        half = base + ["--save", f"{root}/half"]
        half[half.index("--num-layers") + 1] = str(args.num_layers // 2)
        flags = {"none": base + ["--save", f"{root}/none"],
                 "pld": base + ["--save", f"{root}/pld", "--progressive-layer-drop",
                                "--pld-theta", str(args.theta), "--pld-gamma", str(args.gamma)],
                 "half depth": half}
        with ThreadPoolExecutor(2) as pool:  # none and pld side by side: the same load
            runs = dict(zip(flags, pool.map(run, [flags["none"], flags["pld"]])))
        runs["half depth"] = run(flags["half depth"])  # then alone: a core each, all three
    table = {}
    for name, result in runs.items():
        late = [s for s in result["steps"] if s[0] > args.train_iters // 2]
        table[name] = {"ms/iter": statistics.median(s[2] for s in late),
                       "CPU ms/iter": statistics.median(s[3] for s in late),
                       "GFLOP/iter": statistics.median(s[4] for s in late),
                       "layers computed": statistics.mean(s[1] for s in late),
                       "final validation": result["validations"][-1][2],
                       "seconds": result["seconds"]}
    none, pld, half = table["none"], table["pld"], table["half depth"]
    print(f"{args.num_layers} layers, hidden {args.hidden_size}, seq {args.seq_length}, "
          f"{args.train_iters} steps, theta {args.theta}, gamma {args.gamma}; second half:")
    print("| run | ms/iter | CPU ms/iter | GFLOP/iter | layers computed | final validation loss "
          "| run seconds |")
    print("|---|---|---|---|---|---|---|")
    for name, row in table.items():
        print(f"| {name} | {row['ms/iter']:.0f} | {row['CPU ms/iter']:.0f} | "
              f"{row['GFLOP/iter']:.2f} | {row['layers computed']:.3f} | "
              f"{row['final validation']:.4f} | {row['seconds']:.0f} |")
    ratios = {key: pld[key] / none[key] for key in ("ms/iter", "CPU ms/iter", "GFLOP/iter")}
    print(f"pld / none: step time {ratios['ms/iter']:.3f}, CPU time {ratios['CPU ms/iter']:.3f}, "
          f"FLOPs {ratios['GFLOP/iter']:.3f} (time in proportion to the work run: CPU time "
          f"{ratios['CPU ms/iter'] / ratios['GFLOP/iter'] - 1:+.1%} from it); layers computed "
          f"{pld['layers computed']:.3f}")
    layers_cpu = 2 * (none["CPU ms/iter"] - half["CPU ms/iter"])  # all L layers' CPU ms
    expected = none["CPU ms/iter"] - layers_cpu * (1 - pld["layers computed"])
    print(f"CPU ms/iter of the {args.num_layers} layers (twice none - half depth) "
          f"{layers_cpu:.0f}, of the rest {none['CPU ms/iter'] - layers_cpu:.0f}: pld's in "
          f"proportion to the layers computed {expected:.0f}, measured {pld['CPU ms/iter']:.0f} "
          f"({pld['CPU ms/iter'] / expected - 1:+.1%})")
    if args.plot:
        curves = {}
        for name in ("none", "pld"):
            seconds, _, losses = zip(*runs[name]["validations"])
            curves[name] = seconds, losses
        plot_curves(curves, "wall-clock seconds", "validation lm loss",
                    f"PLD (theta {args.theta}, gamma {args.gamma}) vs none", args.plot,
                    marker="o")


if __name__ == "__main__":
    main()
