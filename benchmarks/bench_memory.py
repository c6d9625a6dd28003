"""Memory per rank of a small GPT under data parallelism, and the step time with overlap on/off.

    python benchmarks/bench_memory.py [--ranks 2 --hidden-size 256 --num-layers 4 --seq-length 256]

Each configuration runs in a fresh group of `--ranks` gloo processes (DP = ranks,
OMP_NUM_THREADS=1, model flags as pretrain_gpt.py) for one warm-up and `--steps` timed
training steps. Prints tables; asserts nothing. What is measured (CPU torch keeps no
allocator statistics):

- model state, counted: bytes of the tensors that live through training on rank 0 -
  model params, the DDP grad buffer (fp32 main_grad), fp32 main params (separate copies
  only), torch optimizer state (exp_avg, exp_avg_sq, step) - per parameter, beside
  Megatron's bytes-per-parameter table (fp32 16 vs 8 + 8/d, bf16 18 vs 6 + 12/d, fp16
  20 vs 4 + 16/d) and megalite's own (fp16 grads are accumulated in fp32 here, as bf16,
  so fp16 costs what bf16 does).
- activations, counted: bytes autograd saves for backward in one microbatch's forward
  (torch.autograd.graph.saved_tensors_hooks; unique storages, parameters excluded), for
  the transformer layers (per layer) and for the rest (embedding, LM head, loss), beside
  Korthikanti et al. 2022 per layer: sbh(34 + 5as/h) with 2-byte activations and no
  recompute, 34 sbh selective, 2 sbh full (the layer input). With 4-byte activations
  every 2-byte term doubles and the 1-byte dropout masks do not: sbh(66 + 9as/h), 66 sbh,
  4 sbh. (On CPU, attention with dropout runs SDPA's math path, which keeps q, k, v, the
  probabilities and a float dropout mask in fp32, and F.dropout keeps its mask in the
  activation dtype: bf16 counts exceed the formula by that much.)
- peak RSS: the process's resident-set high-water mark (getrusage ru_maxrss) minus its
  resident set just before the model was built: an independent measure that also holds
  transient grads, allocator slack and gloo buffers.
- step time: median over the timed steps, overlap_grad_reduce on vs off, with buckets of
  --ddp-bucket-size elements (default here 1M, so that there are several to overlap).
"""
import contextlib
import functools
import os
import resource

import torch
import torch.multiprocessing as mp
from common import SavedBytes, add_standard_flags, machine_line, median_seconds, rss_bytes

from megalite.config import (ModelConfig, OptimizerConfig, PrecisionConfig, TrainConfig,
                             build_parser, config_from_args)
from megalite.device import free_port, init_distributed
from megalite.distributed import DistributedDataParallel
from megalite.models import GPTModel
from megalite.mpu import initialize_model_parallel, model_parallel_seed
from megalite.optimizer import get_optimizer

PRECISIONS = {"fp32": PrecisionConfig(), "bf16": PrecisionConfig(bf16=True),
              "fp16": PrecisionConfig(fp16=True, initial_loss_scale=2.0 ** 16)}
MEGATRON_BYTES = {"fp32": (16, 8, 8), "bf16": (18, 6, 12), "fp16": (20, 4, 16)}  # plain, a + b/d


def _state_bytes(model: DistributedDataParallel, optimizer) -> dict[str, int]:
    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    return {"params": sum(size(p) for p in model.parameters()),
            "grads": sum(size(b.grad_data) for b in model.grad_buffers),
            "main": sum(size(f.main) for f in optimizer.fragments if f.target is not None),
            "optim": sum(size(t) for s in optimizer.optimizer.state.values()
                         for t in s.values() if torch.is_tensor(t))}


def _step(model, optimizer, tokens: torch.Tensor, saved: SavedBytes, index: int) -> None:
    """One training step; the first (index 0) counts the bytes autograd saves."""
    model.zero_grad_buffer()
    optimizer.zero_grad()
    with saved if index == 0 else contextlib.nullcontext():
        loss = model(tokens[:, :-1], tokens[:, 1:]).float().mean()
    (loss * optimizer.loss_scale).backward()
    model.finish_grad_sync()
    optimizer.step()


def _worker(rank: int, world: int, port: int, run: dict, queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    init_distributed(rank, world, f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(1, 1)
    model_parallel_seed(1234, 0)
    results = {}
    for name, (model_config, precision, opt) in run["configs"].items():
        baseline = rss_bytes()
        model = DistributedDataParallel(
            GPTModel(model_config, params_dtype=precision.params_dtype),
            bucket_size=opt.ddp_bucket_size, overlap_grad_reduce=opt.overlap_grad_reduce,
            use_distributed_optimizer=opt.use_distributed_optimizer)
        optimizer, _ = get_optimizer(opt, precision, model, train_iters=100)
        tokens = torch.randint(0, model_config.vocab_size,
                               (run["micro_batch_size"], run["seq_length"] + 1))
        saved = SavedBytes(model.parameters(), model.module.encoder)
        seconds = median_seconds(functools.partial(_step, model, optimizer, tokens, saved),
                                 run["steps"], barrier=True)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline
        results[name] = {"state": _state_bytes(model, optimizer),
                         "n_params": sum(p.numel() for p in model.parameters()),
                         "layers": saved.total("layers"), "other": saved.total("other"),
                         "rss": peak, "time": seconds}
        del model, optimizer
    if rank == 0:
        queue.put(results)
    torch.distributed.destroy_process_group()


def _launch(world: int, run: dict) -> dict:
    """Run `run` on `world` fresh processes; rank 0's results."""
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(world, free_port(), run, queue), nprocs=world)
    return queue.get()


def _korthikanti(model: ModelConfig, s: int, b: int, two_byte: bool) -> dict[str | None, float]:
    """Activation bytes per layer by recompute granularity (None: no recompute)."""
    h, a = model.hidden_size, model.num_attention_heads
    sbh = s * b * h
    if two_byte:
        return {None: sbh * (34 + 5 * a * s / h), "selective": 34 * sbh, "full": 2 * sbh}
    return {None: sbh * (66 + 9 * a * s / h), "selective": 66 * sbh, "full": 4 * sbh}


def _with(config, **changes):
    return type(config)(**{**config.__dict__, **changes})


def main() -> None:
    parser = build_parser([ModelConfig, TrainConfig, OptimizerConfig], __doc__.splitlines()[0])
    add_standard_flags(parser, ranks=2, steps=3)
    parser.set_defaults(ddp_bucket_size=1_000_000)
    args = parser.parse_args()
    print(machine_line())
    model, train, opt = (config_from_args(c, args) for c in (ModelConfig, TrainConfig,
                                                             OptimizerConfig))
    d, s, b = args.ranks, train.seq_length, train.micro_batch_size
    run = {"steps": args.steps, "seq_length": s, "micro_batch_size": b}
    mib = 2 ** 20

    print(f"GPT {model.num_layers} layers, h {model.hidden_size}, a "
          f"{model.num_attention_heads}, V {model.vocab_size}, s {s}, b {b}; DP d = {d}\n")
    memory = {}
    for precision in PRECISIONS:
        for sharded in (False, True):
            for recompute in ([None, "selective", "full"] if precision == "bf16" else [None]):
                configs = {"run": (_with(model, recompute_granularity=recompute),
                                   PRECISIONS[precision],
                                   _with(opt, use_distributed_optimizer=sharded))}
                memory[(precision, sharded, recompute)] = _launch(d, {**run,
                                                                      "configs": configs})["run"]

    print("Model state per parameter on rank 0 (bytes): counted | Megatron | megalite closed form")
    print(f"{'precision':9} {'optimizer':11} {'params':>7} {'grads':>6} {'main':>5} "
          f"{'optim':>6} {'total':>6} {'Megatron':>9} {'megalite':>9}")
    for precision, (plain, fixed, shared) in MEGATRON_BYTES.items():
        for sharded in (False, True):
            r = memory[(precision, sharded, None)]
            per = {k: v / r["n_params"] for k, v in r["state"].items()}
            p_bytes = PRECISIONS[precision].params_dtype.itemsize
            main = 0 if p_bytes == 4 else 4
            megatron = fixed + shared / d if sharded else plain
            ours = p_bytes + 4 + ((main + 8) / d if sharded else main + 8)
            print(f"{precision:9} {'distributed' if sharded else 'plain':11} "
                  f"{per['params']:7.2f} {per['grads']:6.2f} {per['main']:5.2f} "
                  f"{per['optim']:6.2f} {sum(per.values()):6.2f} {megatron:9.2f} {ours:9.2f}")

    print("\nActivations saved in one microbatch's forward (MiB): counted | Korthikanti")
    print(f"{'precision':9} {'recompute':9} {'per layer':>9} {'formula':>8} {'ratio':>6} "
          f"{'outside layers':>14}")
    for precision in ("bf16", "fp32", "fp16"):
        formula = _korthikanti(model, s, b, precision != "fp32")
        for recompute in formula:
            r = memory.get((precision, False, recompute))
            if r is None:
                continue
            per_layer = r["layers"] / model.num_layers
            print(f"{precision:9} {str(recompute):9} {per_layer / mib:9.2f} "
                  f"{formula[recompute] / mib:8.2f} {per_layer / formula[recompute]:6.2f} "
                  f"{r['other'] / mib:14.2f}")

    print("\nPeak memory per rank, bf16 (MiB): counted state + activations | closed form | RSS")
    print(f"{'optimizer':11} {'recompute':9} {'state':>7} {'activ.':>7} {'sum':>7} "
          f"{'closed':>7} {'RSS peak':>9}")
    for sharded in (False, True):
        for recompute in (None, "selective", "full"):
            r = memory[("bf16", sharded, recompute)]
            state = sum(r["state"].values())
            activ = r["layers"] + r["other"]
            _, fixed, shared = MEGATRON_BYTES["bf16"]
            closed = r["n_params"] * (fixed + shared / d if sharded else 18) + \
                model.num_layers * _korthikanti(model, s, b, True)[recompute]
            print(f"{'distributed' if sharded else 'plain':11} {str(recompute):9} "
                  f"{state / mib:7.1f} {activ / mib:7.1f} {(state + activ) / mib:7.1f} "
                  f"{closed / mib:7.1f} {r['rss'] / mib:9.1f}")

    print(f"\nStep time on {d} ranks, fp32, buckets of {opt.ddp_bucket_size:,} elements "
          f"(median of {args.steps} steps, s)")
    configs = {(sharded, overlap): (model, PRECISIONS["fp32"],
                                    _with(opt, use_distributed_optimizer=sharded,
                                          overlap_grad_reduce=overlap))
               for sharded in (False, True) for overlap in (True, False)}
    timing = _launch(d, {**run, "configs": configs})
    print(f"{'optimizer':11} {'overlap on':>10} {'overlap off':>11} {'off / on':>8}")
    for sharded in (False, True):
        on, off = timing[(sharded, True)]["time"], timing[(sharded, False)]["time"]
        print(f"{'distributed' if sharded else 'plain':11} {on:10.3f} {off:11.3f} "
              f"{off / on:8.2f}")


if __name__ == "__main__":
    main()
