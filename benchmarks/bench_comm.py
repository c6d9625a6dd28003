"""Bytes moved by megalite's TP and PP collectives, and the measured pipeline bubble.

    python benchmarks/bench_comm.py [--ranks 4 --hidden-size 256 --seq-length 128 \\
        --micro-batch-size 2]

On `--ranks` gloo CPU ranks (OMP_NUM_THREADS=1 each). Prints figures; asserts nothing.

- TP: payload bytes of the collectives issued in one forward + backward of a GPT on
  TP = ranks, counted by megalite.mpu.comm.count_bytes, for L and 2L layers: the
  difference over L is the bytes per layer per microbatch, set against the closed form
  4 all-reduces of b s h (2 forward, 2 backward; 6 with full recompute, which repeats the
  forward), and what is left over against the embedding's forward all-reduce + the LM
  head's backward all-reduce of b s h + cross entropy's 3 fp32 all-reduces of s b.
- PP: send bytes summed over ranks in one pipeline step of m microbatches on PP = ranks,
  per microbatch per stage boundary, against b s h each way (2 b s h); interleaving has
  p v - 1 boundaries instead of p - 1.
- Bubble: each rank times its compute (every F and B the executor runs, reported by
  megalite.schedules.executor.observe_computes) between barriers; bubble = (step time -
  compute) / compute, the mean over ranks, median over steps, against (p-1)/m and
  (p-1)/(v m). Ranks share the machine's cores: with more ranks than cores, computes slow
  down when more ranks are busy, which shrinks the measured bubble.
"""
import functools
import itertools
import statistics
import time

import torch
import torch.distributed as dist
from common import benchmark_parser, machine_line

from megalite.config import ModelConfig
from megalite.distributed.finalize import sync_shared_embedding
from megalite.distributed.rank_pool import run_once
from megalite.models import GPTModel
from megalite.models.stage import build_model_chunks
from megalite.mpu import (comm, destroy_model_parallel, initialize_model_parallel,
                          model_parallel_seed)
from megalite.mpu import parallel_state as ps
from megalite.placement import ONE_F_ONE_B
from megalite.schedules import get_forward_backward_func, resolve_schedule
from megalite.schedules.accounting import schedule_bubble
from megalite.schedules.executor import observe_computes
from megalite.schedules.instructions import COMPUTE
from megalite.tasks import gpt as pretrain_gpt

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
VOCAB = 256  # small, so that the first and last stage cost about what the others do


def _config(args: dict, layers: int, recompute: str | None = None) -> ModelConfig:
    return ModelConfig(num_layers=layers, hidden_size=args["hidden"], num_attention_heads=4,
                       vocab_size=VOCAB, max_position_embeddings=args["seq"],
                       hidden_dropout=0.0, attention_dropout=0.0,
                       recompute_granularity=recompute)


def _tokens(args: dict, count: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (count * args["micro"], args["seq"] + 1),
                         generator=torch.Generator().manual_seed(0))


def tp_bytes(args: dict, cases: list[tuple[str, str | None]]) -> dict:
    """Counted bytes per kind of one forward + backward, per (precision, recompute, layers)."""
    initialize_model_parallel(dist.get_world_size(), 1)
    model_parallel_seed(1234, ps.get_tensor_model_parallel_rank())
    tokens, counts = _tokens(args), {}
    for precision, recompute in cases:
        for layers in (args["layers"], 2 * args["layers"]):
            model = GPTModel(_config(args, layers, recompute), params_dtype=DTYPES[precision])
            with comm.count_bytes() as counted:
                model(tokens[:, :-1], tokens[:, 1:]).float().mean().backward()
            counts[precision, recompute, layers] = dict(counted)
    return counts


def pipeline(args: dict, cases: list[tuple[int, int]], steps: int) -> dict:
    """Per (v, m): this rank's send/recv bytes in the first step, and (step time, compute
    time) of each later step."""
    p, out = dist.get_world_size(), {}
    for v, m in cases:
        initialize_model_parallel(1, p, v if v > 1 else None)
        model_parallel_seed(1234, 0, ps.get_pipeline_model_parallel_rank())
        config = _config(args, args["pipeline_layers"])
        chunks = build_model_chunks(lambda pre_process, post_process: GPTModel(
            config, pre_process, post_process))
        sync_shared_embedding(chunks)
        tokens, compute = _tokens(args, m), []

        def forward_step(data_iterator, chunk):
            batch = next(data_iterator)
            return chunk(batch[:, :-1], batch[:, 1:]), functools.partial(pretrain_gpt.loss_func,
                                                                         None, None)

        def step():
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(tokens.split(args["micro"])),
                model=chunks if v > 1 else chunks[0], num_microbatches=m,
                seq_length=args["seq"], micro_batch_size=args["micro"])
        timings, first_step = [], {}
        for i in range(steps + 1):
            for chunk in chunks:
                chunk.zero_grad(set_to_none=True)
            compute.clear()
            dist.barrier()
            start = time.perf_counter()
            with observe_computes(lambda ins, seconds: compute.append(seconds)), \
                    comm.count_bytes() as counted_step:
                step()
            dist.barrier()
            if i == 0:
                first_step = dict(counted_step)
            else:
                timings.append((time.perf_counter() - start, sum(compute)))
        out[v, m] = {"bytes": first_step, "timings": timings}
        destroy_model_parallel()
    return out


def report_tp(args: dict, world: int) -> None:
    cases = [("fp32", None), ("fp32", "selective"), ("fp32", "full"), ("bf16", None)]
    counts = run_once(world, tp_bytes, args, cases)[0]
    s, b, h, n = args["seq"], args["micro"], args["hidden"], args["layers"]
    kib = 1024
    print(f"TP = {world}: all-reduce payload bytes of one forward + backward (KiB), "
          f"b {b}, s {s}, h {h}; layers = difference between {2 * n} and {n} layers, over {n}")
    print(f"{'precision':9} {'recompute':9} {'per layer':>10} {'closed':>10} {'x b s h':>8} "
          f"{'outside layers':>15} {'closed':>10}  other kinds")
    for precision, recompute in cases:
        small, large = counts[precision, recompute, n], counts[precision, recompute, 2 * n]
        e = DTYPES[precision].itemsize
        per_layer = (large["all_reduce"] - small["all_reduce"]) / n
        closed = (6 if recompute == "full" else 4) * b * s * h * e
        outside = small["all_reduce"] - n * per_layer
        outside_closed = 2 * b * s * h * e + 3 * s * b * 4
        others = {k: v for k, v in small.items() if k != "all_reduce"}
        print(f"{precision:9} {str(recompute):9} {per_layer / kib:10.2f} {closed / kib:10.2f} "
              f"{per_layer / (b * s * h * e):8.2f} {outside / kib:15.2f} "
              f"{outside_closed / kib:10.2f}  {others or '-'}")


def report_pipeline(args: dict, world: int, steps: int) -> None:
    p, m, v = world, args["microbatches"], args["vpp"]
    cases = [(1, p), (1, m), (v, m)]
    results = run_once(world, pipeline, args, cases, steps)
    s, b, h = args["seq"], args["micro"], args["hidden"]
    message = s * b * h * 4
    print(f"\nPP = {p}: send bytes of one step summed over ranks, per microbatch per boundary "
          f"(KiB); closed form b s h each way = {2 * message / 1024:.2f}")
    for case in cases:
        sent = sum(r[case]["bytes"].get("send", 0) for r in results)
        received = sum(r[case]["bytes"].get("recv", 0) for r in results)
        boundaries = p * case[0] - 1
        print(f"  v {case[0]}, m {case[1]:3}: sent {sent / (case[1] * boundaries) / 1024:8.2f}, "
              f"received {received / (case[1] * boundaries) / 1024:8.2f} over {boundaries} "
              "boundaries")
    print(f"\nPP = {p}: measured bubble (idle / compute, mean over ranks, median of {steps} "
          "steps) vs closed form; idle per p2p batch (each one a wait on a neighbour)")
    for v_case, m_case in cases:
        kind = resolve_schedule(ONE_F_ONE_B, p, v_case if v_case > 1 else None)
        per_step = [[(t - c) / c for t, c in step]
                    for step in zip(*(r[v_case, m_case]["timings"] for r in results))]
        idle = statistics.median(statistics.mean(t - c for t, c in step) for step in
                                 zip(*(r[v_case, m_case]["timings"] for r in results)))
        step_time = statistics.median(t for t, _ in results[0][v_case, m_case]["timings"])
        table = kind.builder(p, m_case, v_case)
        batches = statistics.mean(sum(not compute for compute, _ in itertools.groupby(
            rank, lambda ins: ins.kind in COMPUTE)) for rank in table)
        closed = schedule_bubble(kind, p, m_case, v_case)
        print(f"  {kind.name:11} v {v_case}, m {m_case:3}: measured "
              f"{statistics.median(statistics.mean(s) for s in per_step):.3f}, closed form "
              f"{kind.bubble_form} = {float(closed):.3f}  (step {step_time * 1e3:.0f} ms, "
              f"{batches:.0f} p2p batches per rank, {idle / batches * 1e3:.1f} ms idle each)")


def main() -> None:
    parser = benchmark_parser(__doc__, ranks=4, steps=9, hidden_size=256, seq_length=128,
                              micro_batch_size=2)
    parser.add_argument("--num-layers", type=int, default=2, help="L for the TP count")
    parser.add_argument("--microbatches", type=int, default=8, help="m, a multiple of --ranks")
    parser.add_argument("--vpp", type=int, default=2, help="chunks per rank, interleaved")
    a = parser.parse_args()
    args = {"hidden": a.hidden_size, "seq": a.seq_length, "micro": a.micro_batch_size,
            "layers": a.num_layers, "microbatches": a.microbatches, "vpp": a.vpp,
            "pipeline_layers": 2 * a.ranks * a.vpp}
    print(machine_line() + "\n")
    report_tp(args, a.ranks)
    report_pipeline(args, a.ranks, a.steps)


if __name__ == "__main__":
    main()
