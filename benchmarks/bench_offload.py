"""The offload tiers on CPU ranks: no offload, the optimizer's cpu and nvme tiers, and (ZeRO-3)
the nvme tiers of the optimizer and the parameters together.

    python benchmarks/bench_offload.py [--hidden-size 768 --num-layers 12 --vocab-size 32000
                                        --seq-length 64 --steps 3 --nvme-path /tmp]

A Llama-shaped model (RMSNorm, rope, SwiGLU, 2 KV groups, no dropout; 110M parameters at the
defaults) at DP `--ranks` (gloo, OMP_NUM_THREADS=1 per rank) with the distributed optimizer
(ZeRO-1; `--strategy` for another), fp32 and bf16, AdamW: each configuration in a fresh pool
of ranks, built as pretrain_gpt builds it, one warm-up step and `--steps` timed ones. Prints
one table; asserts nothing. Per configuration, on rank 0:

- s/step: median of the timed steps (ranks synchronised before each);
- peak RSS: the resident-set high-water mark (VmHWM, reset through /proc/self/clear_refs before
  the model is built) less the resident set at that moment: model, grads, optimizer, the
  tier's buffers, activations and transients; and the cpu tier's minus this one's in bytes per
  parameter of the rank's shard (the issue's target for nvme: at least 10); steady: the same
  over the timed steps only (the high-water mark reset after the warm-up step: the parameter
  tier's units start resident, so its saving shows only there);
- nvme+p (with `--strategy optim_grads_params` only): the optimizer's nvme tier and the
  parameter tier on nvme (`--param-offload-device nvme`): each FSDP unit's sharded
  parameters in a file between uses; on CPU ranks the shards are host memory, so its peak
  RSS shows them gone (FSDP2's gathered copies, the units in flight and the grads remain);
- tier I/O: bytes the nvme tiers read and wrote per step (the optimizer's file once each
  way; the parameters' read for forward, backward and the step, written once), and the
  time they take at the disk bandwidth measured in the same run: a `--probe-mib` file written
  with fsync and read back after posix_fadvise(DONTNEED) dropped it from the page cache (so
  both figures are the disk's). The tier's own reads are not kept out of the page cache: where
  its files fit in free memory the kernel serves them from there, and the step time shows the
  overlap of host work, not the disk; the I/O column is what the disk would have to carry.
"""
import functools
import os
import statistics
import tempfile
import time

import torch
from common import benchmark_parser, llama_shape_flags, machine_line, timed

from megalite.distributed.rank_pool import run_once

LLAMA = ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
         "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--weight-decay", "0",
         "--clip-grad", "1.0", "--lr-decay-style", "constant", "--lr-warmup-iters", "0"]


def _kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field))


def measure(argv: list[str], steps: int) -> dict:
    """On every rank: peak RSS rise, median step time, the tier's bytes per step."""
    from megalite.config import parse_configs
    from megalite.distributed.param_tier import close_param_tiers
    from megalite.layout import RunLayout
    from megalite.optimizer import get_optimizer
    from megalite.tasks import gpt as pretrain_gpt
    from megalite.training.loop import train_step
    from megalite.training.setup import build_model, setup_parallel
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    start = _kib("VmRSS:")
    configs = parse_configs(argv)
    layout = RunLayout.from_configs(configs, torch.distributed.get_world_size())
    setup_parallel(configs, layout)
    model = build_model(configs, functools.partial(pretrain_gpt.model_provider, configs))
    optimizer, _ = get_optimizer(configs.optimizer, configs.precision, model, 10)
    t = configs.train
    generator = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    tokens = torch.randint(0, configs.model.vocab_size, (t.micro_batch_size, t.seq_length + 1),
                           generator=generator)

    def step() -> float:
        return train_step(pretrain_gpt.forward_step, iter([{"tokens": tokens}]), model,
                          optimizer, layout)[0]
    tiers = [t for t in [optimizer.tier, *(getattr(c, "param_tier", None) for c in model)] if t]

    def io() -> tuple[int, int]:
        return sum(t.bytes_read for t in tiers), sum(t.bytes_written for t in tiers)
    step()
    first_peak, before = _kib("VmHWM:"), io()
    with open("/proc/self/clear_refs", "w") as clear:  # the timed steps' own high-water mark
        clear.write("5")
    times = [timed(step, barrier=True)[0] for _ in range(steps)]
    after, steady = io(), _kib("VmHWM:")
    close_param_tiers(model)  # as train() does: the scratch directories go now
    optimizer.close()
    return {"time": statistics.median(times), "rss": (max(first_peak, steady) - start) * 1024,
            "steady": (steady - start) * 1024,
            "shard": sum(f.grad.numel() for f in optimizer.fragments),
            "io": ((after[0] - before[0]) / steps, (after[1] - before[1]) / steps)}


def disk_bandwidth(path: str, mib: int) -> tuple[float, float]:
    """(write, read) GB/s of a `mib` MiB file under `path`: written and fsynced, dropped from the
    page cache (posix_fadvise DONTNEED), read back."""
    block = os.urandom(2 ** 20)
    fd, name = tempfile.mkstemp(dir=path)
    try:
        start = time.perf_counter()
        for _ in range(mib):
            os.write(fd, block)
        os.fsync(fd)
        write = mib * 2 ** 20 / (time.perf_counter() - start) / 1e9
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.lseek(fd, 0, os.SEEK_SET)
        start = time.perf_counter()
        while os.read(fd, 2 ** 24):
            pass
        return write, mib * 2 ** 20 / (time.perf_counter() - start) / 1e9
    finally:
        os.close(fd)
        os.unlink(name)


def main() -> None:
    parser = benchmark_parser(__doc__, ranks=2, steps=3, num_layers=12, hidden_size=768,
                              vocab_size=32000, seq_length=64, micro_batch_size=1)
    parser.add_argument("--strategy", default="optim", help="--data-parallel-sharding-strategy")
    parser.add_argument("--nvme-path", default=tempfile.gettempdir(),
                        help="--offload-nvme-path (and where the disk is measured)")
    parser.add_argument("--sub-group-size", type=int, default=1_000_000,
                        help="--offload-sub-group-size")
    parser.add_argument("--probe-mib", type=int, default=512, help="disk probe file size")
    parser.add_argument("--precisions", default="fp32,bf16",
                        help="comma-separated, of fp32 and bf16 (bf16 matmuls are ~160x slower "
                             "than fp32 on AVX2-only CPUs)")
    args = parser.parse_args()
    precisions = args.precisions.split(",")
    if not set(precisions) <= {"fp32", "bf16"}:
        raise SystemExit(f"error: --precisions takes fp32 and bf16 (got {args.precisions!r})")
    print(machine_line())
    h = args.hidden_size
    model = [*llama_shape_flags(args.num_layers, h, args.vocab_size),
             "--seq-length", str(args.seq_length), "--max-position-embeddings",
             str(args.seq_length), "--micro-batch-size", str(args.micro_batch_size),
             "--data-parallel-sharding-strategy", args.strategy, *LLAMA]
    tiers = {"none": [], "cpu": ["--optimizer-offload-device", "cpu"],
             "nvme": ["--optimizer-offload-device", "nvme", "--offload-nvme-path",
                      args.nvme_path, "--offload-sub-group-size", str(args.sub_group_size)]}
    if args.strategy == "optim_grads_params":
        tiers["nvme+p"] = tiers["nvme"] + ["--param-offload-device", "nvme"]
    write, read = disk_bandwidth(args.nvme_path, args.probe_mib)
    print(f"disk under {args.nvme_path}: write {write:.2f} GB/s (fsync), read {read:.2f} GB/s "
          f"(page cache dropped), {args.probe_mib} MiB probe")
    print(f"Llama-shaped, {args.num_layers} layers, hidden {h}, vocab {args.vocab_size}, seq "
          f"{args.seq_length}, micro batch {args.micro_batch_size}; DP {args.ranks} "
          f"{args.strategy}; sub-group {args.sub_group_size:,} params; rank 0\n")
    print(f"{'precision':9} {'tier':6} {'s/step':>7} {'vs cpu':>7} {'peak RSS MiB':>12} "
          f"{'cpu-this B/param':>16} {'steady MiB':>10} {'read MiB/step':>13} {'written':>8} "
          f"{'disk s':>7}")
    mib = 2 ** 20
    for precision in precisions:
        results = {}
        for tier, flags in tiers.items():
            argv = model + flags + (["--bf16"] if precision == "bf16" else [])
            results[tier] = run_once(args.ranks, measure, argv, args.steps, timeout=3600,
                                     env={"OMP_NUM_THREADS": "1"})[0]
        cpu = results["cpu"]
        for tier, r in results.items():
            saved = (cpu["rss"] - r["rss"]) / r["shard"]
            disk = r["io"][0] / (read * 1e9) + r["io"][1] / (write * 1e9)
            print(f"{precision:9} {tier:6} {r['time']:7.3f} {r['time'] / cpu['time']:6.2f}x "
                  f"{r['rss'] / mib:12.1f} {saved:16.2f} {r['steady'] / mib:10.1f} "
                  f"{r['io'][0] / mib:13.1f} "
                  f"{r['io'][1] / mib:8.1f} {disk:7.2f}", flush=True)


if __name__ == "__main__":
    main()
