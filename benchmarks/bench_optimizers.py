"""Optimizers' convergence: pretrain_gpt on the built-in corpus at DP 4 (gloo ranks of one rank
pool), the same seed, data and flags for every optimizer but its own: validation loss along
the run, the final one, and the bytes the collectives moved (megalite.mpu.comm's accounting,
payload bytes per rank summed over the run; at DP 4 with TP = PP = 1 every collective is a DP
one: the grad reductions, the ZeRO gathers, the step's loss and grad-norm reductions).

    python3 benchmarks/bench_optimizers.py                         # the docs' run (600 steps)
    python3 benchmarks/bench_optimizers.py --train-iters 200 --optimizers adam,muon

An optimizer this build does not know is skipped with one line. Muon runs with
--muon-scale-mode spectral --muon-extra-scale-factor 0.2 (its update's RMS matched to AdamW's,
so it shares AdamW's learning rate: Moonshot's recipe); the 1-bit optimizers freeze after
--freeze-share of the run (DeepSpeed's 15 %; zero_one_adam's variance there, its interval
between synchronisations doubling every fifth of that up to 16), with a scale per
--onebit-block-size elements (onebit_lamb at lr 3e-3, LAMB's own scale); every optimizer
with --adam-eps. --plot writes the validation
curves (matplotlib).
Asserts nothing.
"""
import contextlib
import io
import re
import tempfile

from common import benchmark_parser, machine_line, plot_curves

VALIDATION = re.compile(r"validation at iteration (\d+) \| lm loss ([0-9.E+-]+)")
OWN_FLAGS = {"muon": lambda freeze: ["--muon-scale-mode", "spectral",
                                     "--muon-extra-scale-factor", "0.2"],
             "onebit_adam": lambda freeze: ["--freeze-step", str(freeze)],
             # LAMB's trust ratio wants a larger rate (at AdamW's 1e-3: +6 % at 600 steps)
             "onebit_lamb": lambda freeze: ["--freeze-step", str(freeze), "--lr", "3e-3",
                                            "--min-lr", "3e-4"],
             # DeepSpeed's --local-step-scaler (32678) is for runs of 10^5 steps and more
             "zero_one_adam": lambda freeze: ["--var-freeze-step", str(freeze),
                                              "--local-step-scaler", str(max(1, freeze // 5))]}
ONEBIT_FAMILY = ("onebit_adam", "onebit_lamb", "zero_one_adam")  # take --onebit-block-size


def train_counted(argv: list[str]) -> dict:
    """On every rank: pretrain_gpt with `argv`; rank 0's validations [(iteration, loss)] (read
    from its log) and the payload bytes its collectives moved."""
    import torch.distributed as dist

    from megalite.mpu import comm
    from megalite.tasks import gpt
    out = io.StringIO()
    with contextlib.redirect_stdout(out), comm.count_bytes() as moved:
        gpt.run(argv)
    validations = [(int(m[1]), float(m[2])) for m in VALIDATION.finditer(out.getvalue())]
    return {"validations": validations, "bytes": sum(moved.values()), "rank": dist.get_rank()}


def known(name: str) -> bool:
    from megalite.optimizer.kinds import optimizer_kind
    try:
        optimizer_kind(name)
    except ValueError:
        return False
    return True


def main() -> None:
    parser = benchmark_parser(__doc__, ranks=4, num_layers=4, hidden_size=64, seq_length=64,
                              micro_batch_size=4, seed=1234)
    parser.add_argument("--train-iters", type=int, default=600)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--optimizers",
                        default="adam,onebit_adam,zero_one_adam,onebit_lamb,muon")
    parser.add_argument("--freeze-share", type=float, default=0.15)
    # every optimizer: with 1e-8, 1-bit values divided by the sqrt(v) of rare tokens' rows
    # (about 1e-5) blow up (docs/optimizers.md)
    parser.add_argument("--adam-eps", type=float, default=1e-5)
    parser.add_argument("--onebit-block-size", type=int, default=32,
                        help="the 1-bit family's elements per scale (0: DeepSpeed's per tensor)")
    parser.add_argument("--plot", default="docs/optimizer_curves.png")
    args = parser.parse_args()
    print(machine_line())
    from megalite.distributed.rank_pool import RankPool
    freeze = max(1, round(args.freeze_share * args.train_iters))
    names = []
    for name in args.optimizers.split(","):
        if known(name):
            names.append(name)
        else:
            print(f"skipping {name}: this build has no --optimizer {name}")
    pool = RankPool(args.ranks, timeout_s=7200)
    runs = {}
    with tempfile.TemporaryDirectory() as root:
        base = ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
                "--num-attention-heads", "4", "--seq-length", str(args.seq_length),
                "--max-position-embeddings", str(args.seq_length),
                "--micro-batch-size", str(args.micro_batch_size),
                "--global-batch-size", str(args.micro_batch_size * args.ranks),
                "--train-iters", str(args.train_iters), "--lr", str(args.lr),
                "--min-lr", str(args.lr / 10), "--lr-warmup-iters", str(args.train_iters // 20),
                "--seed", str(args.seed), "--log-interval", str(args.train_iters),
                "--eval-interval", str(max(1, args.train_iters // 12)), "--eval-iters", "8",
                "--hidden-dropout", "0", "--attention-dropout", "0",
                "--clip-grad", "0",  # every run alike: the 1-bit family has no global grad norm
                "--adam-eps", str(args.adam_eps), "--data-cache-dir", f"{root}/cache"]
        for name in names:
            flags = base + ["--optimizer", name, "--save", f"{root}/{name}",
                            *OWN_FLAGS.get(name, lambda f: [])(freeze)]
            if name in ONEBIT_FAMILY:
                flags += ["--onebit-block-size", str(args.onebit_block_size)]
            runs[name] = pool.run(train_counted, flags)[0]
            print(f"{name}: final validation loss {runs[name]['validations'][-1][1]:.4f}",
                  flush=True)
    pool.close()
    print(f"{args.num_layers} layers, hidden {args.hidden_size}, seq {args.seq_length}, global "
          f"batch {args.micro_batch_size * args.ranks}, DP {args.ranks}, {args.train_iters} "
          f"steps, lr {args.lr} (cosine to lr/10), adam eps {args.adam_eps}, 1-bit freeze "
          f"{freeze}, block {args.onebit_block_size}:")
    print("| optimizer | final validation loss | vs adam | DP bytes per rank (MiB) | bytes vs adam "
          "| first validation at or below adam's final |")
    print("|---|---|---|---|---|---|")
    adam = runs.get("adam")
    for name, run in runs.items():
        final, total = run["validations"][-1][1], run["bytes"]
        vs_loss = vs_bytes = reached = "-"
        if adam:
            adam_final = adam["validations"][-1][1]
            vs_loss, vs_bytes = f"{final / adam_final - 1:+.2%}", f"{total / adam['bytes']:.3f}"
            reached = next((str(i) for i, loss in run["validations"] if loss <= adam_final), "-")
        print(f"| {name} | {final:.4f} | {vs_loss} | {total / 2 ** 20:,.1f} | {vs_bytes} | "
              f"{reached} |")
    if args.plot and runs:
        plot_curves({name: tuple(zip(*run["validations"])) for name, run in runs.items()},
                    "iteration", "validation lm loss",
                    f"DP {args.ranks}, built-in corpus, same seed and data", args.plot,
                    marker="o", markersize=3)


if __name__ == "__main__":
    main()
