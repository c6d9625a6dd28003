"""Megalite's interleaved 1F1B vs torch.distributed.pipelining's ScheduleInterleaved1F1B.

    python tools/bench_pipeline.py [--hidden 256 --seq 128 --micro-batch 2 --microbatches 8]

The same GPT (megalite GPTModel chunks, same weights) split over 4 gloo ranks with
2 chunks each (rank r holds stages r and r + 4), OMP_NUM_THREADS=1 per rank. Prints
the median step time of each (forward + backward of m microbatches after warm-up; the
two take turns step by step, so a changing machine load hits both alike), their ratio,
whether the losses agree, and the simulated bubble against (p-1)/m and (p-1)/(v*m).
Prints figures; asserts nothing.
"""
import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
import pretrain_gpt  # noqa: E402
from megalite.config import ModelConfig  # noqa: E402
from megalite.device import init_distributed  # noqa: E402
from megalite.models import GPTModel  # noqa: E402
from megalite.models.stage import build_model_chunks, sync_shared_embedding  # noqa: E402
from megalite.mpu import destroy_model_parallel, initialize_model_parallel  # noqa: E402
from megalite.mpu import parallel_state  # noqa: E402
from megalite.schedules import get_forward_backward_func  # noqa: E402
from megalite.schedules.accounting import bubble_fraction  # noqa: E402
from megalite.schedules.tables import build_schedule  # noqa: E402

P, V = 4, 2


class PeerStage(nn.Module):
    """A megalite chunk as a pipelining stage: ids [b, s] or hidden [s, b, h] in;
    hidden [s, b, h] or logits [b, s, V] (last stage) out."""

    def __init__(self, chunk: GPTModel) -> None:
        super().__init__()
        self.chunk = chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.chunk.pre_process:
            self.chunk.set_input_tensor(x)
        return self.chunk(x)


def peer_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def timed(steps: dict, repeats: int, warmup: int, chunks: list[nn.Module]) -> dict:
    """Median wall time of each named step between barriers on all ranks; the steps take
    turns, so a changing machine load hits them alike."""
    times = {name: [] for name in steps}
    for i in range(warmup + repeats):
        for name, step in steps.items():
            for chunk in chunks:
                chunk.zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            step()
            dist.barrier()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def worker(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    torch.set_num_threads(1)
    init_distributed(rank, P, f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(1, P, V)
    config = ModelConfig(num_layers=args.layers, hidden_size=args.hidden,
                         num_attention_heads=args.heads, vocab_size=args.vocab,
                         max_position_embeddings=args.seq, hidden_dropout=0.0,
                         attention_dropout=0.0)
    chunks = build_model_chunks(lambda pre_process, post_process: GPTModel(
        config, pre_process, post_process, init_seed=args.seed))
    sync_shared_embedding(chunks)
    m, b = args.microbatches, args.micro_batch
    tokens = torch.randint(0, args.vocab, (m * b, args.seq + 1),
                           generator=torch.Generator().manual_seed(args.seed))
    last = rank == P - 1

    ours = get_forward_backward_func()
    our_losses = []

    def our_step():
        our_losses[:] = ours(forward_step_func=pretrain_gpt.forward_step,
                             data_iterator=({"tokens": t} for t in tokens.split(b)),
                             model=chunks, num_microbatches=m, seq_length=args.seq,
                             micro_batch_size=b)

    stages = [PipelineStage(PeerStage(chunk), c * P + rank, P * V, torch.device("cpu"),
                            group=parallel_state.get_pipeline_model_parallel_group())
              for c, chunk in enumerate(chunks)]
    schedule = ScheduleInterleaved1F1B(stages, m, loss_fn=peer_loss)
    peer_losses = []

    def peer_step():
        peer_losses.clear()
        if rank == 0:
            schedule.step(tokens[:, :-1])
        elif last:
            schedule.step(target=tokens[:, 1:], losses=peer_losses)
        else:
            schedule.step()

    times = timed({"ours": our_step, "peer": peer_step}, args.steps, args.warmup, chunks)
    if last:
        queue.put({
            **times,
            "our loss": torch.stack([d["lm loss"] for d in our_losses]).mean().item(),
            "peer loss": torch.stack(peer_losses).mean().item(),
        })
    dist.barrier()
    destroy_model_parallel()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="multiple of p*v = 8")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8, help="m, a multiple of p = 4")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()

    os.environ["OMP_NUM_THREADS"] = "1"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(rank, args, port, queue)) for rank in range(P)]
    for proc in procs:
        proc.start()
    result = queue.get()
    for proc in procs:
        proc.join()

    m = args.microbatches
    print(f"GPT {args.layers} layers, hidden {args.hidden}, seq {args.seq}, micro batch "
          f"{args.micro_batch}, m = {m}; p = {P} gloo ranks, v = {V} chunks each")
    print(f"megalite interleaved 1F1B:            {result['ours'] * 1e3:8.1f} ms/step (median)")
    print(f"pipelining ScheduleInterleaved1F1B:   {result['peer'] * 1e3:8.1f} ms/step (median)")
    print(f"ratio megalite / pipelining:          {result['ours'] / result['peer']:8.3f}")
    rel = abs(result["our loss"] - result["peer loss"]) / abs(result["peer loss"])
    print(f"losses: megalite {result['our loss']:.6f}, pipelining {result['peer loss']:.6f} "
          f"-> {'agree' if rel < 1e-5 else 'DIFFER'} (rel. diff {rel:.1e})")
    for name, v in (("1f1b", 1), ("interleaved", V)):
        simulated = float(bubble_fraction(build_schedule(name, P, m, v)))
        print(f"bubble {name} (v = {v}): simulated {simulated:.3f}, "
              f"closed form (p-1)/(v*m) = {(P - 1) / (v * m):.3f}")
    failed = [(rank, proc.exitcode) for rank, proc in enumerate(procs) if proc.exitcode]
    if failed:
        print(f"note: ranks exited abnormally after finishing (rank, exit code): {failed}")


if __name__ == "__main__":
    main()
