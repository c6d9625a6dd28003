"""Activation memory and step time of sequence and context parallelism at a long sequence.

    python benchmarks/bench_long_context.py [--seq-length 4096 --hidden-size 128 --num-layers 2]

A GPT-2-shaped model (fp32, dropout off, selective recompute) on gloo CPU ranks
(OMP_NUM_THREADS=1 each), one microbatch of one sequence per rank and step:

- memory: the bytes autograd saves for backward inside the transformer layers during one
  microbatch's forward on rank 0 (saved-tensor hooks, unique storages, parameters
  excluded), per layer, beside megalite.planning.planner's selective-recompute formula at e = 4
  bytes: sbh(4e + 2 + 12e/t) = sbh(18 + 48/t), and (4e + 2 + 12e) sbh/t = 66 sbh/t with
  sequence parallelism (Korthikanti's 34 sbh/t at 2 bytes), divided by cp - for TP2
  without and with --sequence-parallel and for CP in {1, 2, 4}.
- time: median seconds per step (forward + backward + DP/CP grad reduction) of TP2 with
  SP over TP2 without; and CP n (n microbatches of one sequence) over DP n (one sequence
  per rank) - equal global tokens per step, same n ranks (and CP2 over CP1, one rank
  holding the whole sequence, at half the tokens per step).
Prints tables; asserts nothing. The machine's other load moves the times.
"""
import contextlib

import torch
from common import SavedBytes, benchmark_parser, machine_line, median_seconds

from megalite.config import ModelConfig
from megalite.distributed import DistributedDataParallel
from megalite.distributed.finalize import finalize_model_grads
from megalite.distributed.rank_pool import run_once
from megalite.models import GPTModel
from megalite.mpu import initialize_model_parallel, model_parallel_seed
from megalite.mpu import parallel_state as ps
from megalite.mpu.context_parallel import get_batch_on_this_cp_rank
from megalite.planning.activations import activation_bytes_per_layer

MiB = 2 ** 20
# name -> (world, tp, cp, sequence parallel, microbatches per step)
CASES = {"TP2": (2, 2, 1, False, 1), "TP2 + SP": (2, 2, 1, True, 1),
         "CP1": (1, 1, 1, False, 1), "DP2": (2, 1, 1, False, 1), "CP2": (2, 1, 2, False, 2),
         "DP4": (4, 1, 1, False, 1), "CP4": (4, 1, 4, False, 4)}


def _config(args) -> ModelConfig:
    return ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                       num_attention_heads=args.num_attention_heads, vocab_size=1000,
                       max_position_embeddings=args.seq_length, hidden_dropout=0.0,
                       attention_dropout=0.0, recompute_granularity="selective")


def _case(args, tp: int, cp: int, sp: bool, microbatches: int) -> dict:
    """On every rank: saved layer bytes of one microbatch, median step seconds."""
    initialize_model_parallel(tp, 1, context_parallel_size=cp)
    model_parallel_seed(1234, ps.get_tensor_model_parallel_rank())
    model = DistributedDataParallel(GPTModel(_config(args), sequence_parallel=sp))
    tokens = torch.randint(0, 1000, (1, args.seq_length + 1),
                           generator=torch.Generator().manual_seed(ps.get_data_parallel_rank()))
    inputs, labels, positions = get_batch_on_this_cp_rank(tokens[:, :-1], tokens[:, 1:])
    saved = SavedBytes(model.parameters(), model.module.encoder)

    def step(index: int) -> None:
        for micro in range(microbatches):
            with saved if index == micro == 0 else contextlib.nullcontext():
                loss = model(inputs, labels, positions).mean() / microbatches
            with model.no_sync() if micro < microbatches - 1 else contextlib.nullcontext():
                loss.backward()
        finalize_model_grads([model])
        model.zero_grad_buffer()
    seconds = median_seconds(step, args.steps, barrier=True)
    return {"layer bytes": saved.total("layers"), "time": seconds}


def main() -> None:
    parser = benchmark_parser(__doc__, steps=2, num_layers=2, hidden_size=128,
                              num_attention_heads=2, seq_length=4096)
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    args = parser.parse_args()
    print(machine_line())
    s, h, a, layers = args.seq_length, args.hidden_size, args.num_attention_heads, args.num_layers
    print(f"GPT-2 shape: {layers} layers, hidden {h}, {a} heads, seq {s}, micro batch 1, fp32, "
          f"selective recompute, gloo CPU ranks")
    print(f"{'layout':10} {'ranks':>5} {'measured MiB/layer':>19} {'formula MiB/layer':>18} "
          f"{'measured/formula':>17} {'s/step':>8}")
    results = {}
    for name in args.cases:
        world, tp, cp, sp, microbatches = CASES[name]
        result = run_once(world, _case, args, tp, cp, sp, microbatches, timeout=3000)[0]
        formula = activation_bytes_per_layer(s, 1, h, a, tp, 4, "selective", sp) / cp
        measured = result["layer bytes"] / layers
        results[name] = result
        print(f"{name:10} {world:5} {measured / MiB:19.2f} {formula / MiB:18.2f} "
              f"{measured / formula:17.3f} {result['time']:8.2f}", flush=True)
    ratios = [("TP2 + SP", "TP2"), ("CP2", "DP2"), ("CP4", "DP4"), ("CP2", "CP1")]
    print("step-time ratios (equal global tokens for CP n vs DP n):")
    for a_name, b_name in ratios:
        if a_name in results and b_name in results:
            print(f"  {a_name} / {b_name}: "
                  f"{results[a_name]['time'] / results[b_name]['time']:.3f}")


if __name__ == "__main__":
    main()
