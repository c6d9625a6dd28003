"""Wall time and bytes of the 1-bit compressed all-reduce against fp32 DP reductions.

    python benchmarks/bench_compressed_allreduce.py [--ranks 8 --elements 25000000]
    python benchmarks/bench_compressed_allreduce.py --profile [--ranks 8 --elements ...]

On `--ranks` gloo CPU ranks (OMP_NUM_THREADS=1 each), one flat fp32 gradient of `--elements`
per rank, reduced by:

- the fp32 all-reduce (megalite's no_shard bucket reduction, one bucket);
- the bucketed reduce-scatter (the distributed optimizer's, `--bucket-size` buckets);
- the 1-bit compressed all-reduce with error feedback (megalite.distributed.compressed), its
  host work in the native kernels (signs.c) and in torch ops (as on CUDA, or with no C
  compiler).

Bytes are megalite.mpu.comm's payload counts per rank per reduction; seconds the median of
`--steps` reductions after `--warmup` (the ranks start together), the best of two rounds;
peak MiB the largest resident set of a rank (the gradient is a view of the reduce-scatter's
padded buckets). Prints figures; asserts nothing.

--profile: one rank's share of the compute instead, in this process on one thread: each stage
of a call (the collectives left out, this rank's own payload standing for the w received),
the best of `--steps`, in ms, native kernels and torch ops side by side.
"""
import resource

import torch
import torch.distributed as dist
from common import benchmark_parser, machine_line, median_seconds, timed, turn_order

from megalite.distributed.compressed import CompressedAllReduce, Pieces
from megalite.distributed.rank_pool import RankPool
from megalite.mpu import comm


def measure(elements: int, bucket_size: int, steps: int, warmup: int) -> dict:
    """{method: (median seconds, bytes counted per reduction)} on this rank."""
    group, world = dist.group.WORLD, dist.get_world_size()
    per_bucket = -(-min(bucket_size, elements) // world) * world
    padded = torch.zeros(-(-elements // per_bucket) * per_bucket)
    flat = padded[:elements]
    flat.normal_(generator=torch.Generator().manual_seed(dist.get_rank()))
    native, torch_ops = (CompressedAllReduce(elements, world, flat.device, native=flag)
                         for flag in (True, False))

    def reduce_scatter() -> None:
        rank = dist.get_rank()
        for bucket in padded.split(per_bucket):
            shard = bucket.numel() // world
            comm.reduce_scatter(bucket[rank * shard:(rank + 1) * shard], bucket, group)

    methods = {"fp32 all-reduce": lambda: comm.all_reduce(flat, group),
               "bucketed reduce-scatter": reduce_scatter,
               "1-bit compressed (native)": lambda: native(flat, group),
               "1-bit compressed (torch ops)": lambda: torch_ops(flat, group)}
    results = {}
    for round_index in range(2):
        for name in turn_order(methods, round_index):
            with comm.count_bytes() as moved:
                seconds = median_seconds(lambda _: methods[name](), steps, warmup,
                                         barrier=True)
            best = results.get(name, (float("inf"), 0))[0]
            results[name] = (min(best, seconds), sum(moved.values()) // (steps + warmup))
    results["peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return results


def profile(elements: int, world: int, steps: int) -> None:
    """Print the best seconds of each stage of one rank's compute on `elements`, through the
    native kernels and through the torch ops."""
    torch.set_num_threads(1)
    device = torch.device("cpu")
    x = torch.randn(elements)
    columns = []
    for native in (True, False):
        reducer = CompressedAllReduce(elements, world, device, native=native)
        row = reducer.lengths[0]
        received, alone = (Pieces([row] * world, reducer.per_row, device, native),
                           Pieces([row], reducer.per_row, device, native))
        payload = reducer.pieces.compress_(reducer.worker_error.view(world, -1))
        mean = received.decompress_mean(payload).clone()
        stages = {
            "worker: x added, compressed": lambda: reducer.pieces.compress_(
                reducer.worker_error.view(world, -1), added=x),
            "server: mean of w decompressed chunks": lambda: received.decompress_mean(payload),
            "server: mean added, compressed": lambda: alone.compress_(
                reducer.server_error.view(1, -1), added=mean),
            "all: the gathered decompressed into x": lambda: reducer.pieces.decompress(
                payload, x)}
        columns.append({name: min(timed(stage)[0] for _ in range(steps))
                        for name, stage in stages.items()})
    print(f"one rank's compute of DP {world} on {elements:,} elements, 1 thread, best of "
          f"{steps}, ms")
    print(f"{'stage':40} {'native':>9} {'torch ops':>10}")
    for name in [*columns[0], "total"]:
        native, ops = (column.get(name, sum(column.values())) for column in columns)
        print(f"{name:40} {native * 1e3:9.1f} {ops * 1e3:10.1f}")


def main() -> None:
    parser = benchmark_parser(__doc__, ranks=8, steps=3, warmup=1)
    parser.add_argument("--elements", type=int, default=25_000_000,
                        help="fp32 gradient elements per rank")
    parser.add_argument("--timeout", type=float, default=1800,
                        help="seconds the ranks may take (a loaded 2-core machine is slow)")
    parser.add_argument("--bucket-size", type=int, default=40_000_000,
                        help="elements per reduce-scatter bucket (--ddp-bucket-size)")
    parser.add_argument("--profile", action="store_true",
                        help="time one rank's compute per stage, in this process")
    args = parser.parse_args()
    print(machine_line())
    if args.profile:
        profile(args.elements, args.ranks, args.steps)
        return
    pool = RankPool(args.ranks)
    try:
        results = pool.run(measure, args.elements, args.bucket_size, args.steps, args.warmup,
                           timeout=args.timeout)
    finally:
        pool.close()
    peak = max(r.pop("peak") for r in results)
    seconds = {name: max(r[name][0] for r in results) for name in results[0]}
    base_bytes = results[0]["fp32 all-reduce"][1]
    print(f"DP {args.ranks} gloo, {args.elements:,} fp32 elements per rank "
          f"({args.elements * 4 / 2 ** 20:.0f} MiB); bytes counted per rank per reduction; "
          f"peak {peak / 2 ** 20:.0f} MiB resident per rank")
    print(f"{'method':28} {'seconds':>8} {'MiB':>9} {'bytes vs fp32 AR':>17} "
          f"{'time vs fp32 AR':>16}")
    for name in seconds:
        sent = results[0][name][1]
        print(f"{name:28} {seconds[name]:8.3f} {sent / 2 ** 20:9.2f} "
              f"{base_bytes / sent:16.1f}x {seconds['fp32 all-reduce'] / seconds[name]:15.2f}x")


if __name__ == "__main__":
    main()
