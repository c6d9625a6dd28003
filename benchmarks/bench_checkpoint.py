"""Save and load of distributed checkpoints against the previous format, on gloo CPU ranks.

    python benchmarks/bench_checkpoint.py [--ranks 8 --hidden-size 512 --num-layers 12]

For each layout (TP2 x PP2 x DP2 ZeRO-1, DP 8 ZeRO-1, DP 8 ZeRO-3) every rank builds its shard
of a GPT (32k vocabulary), takes one Adam step on random grads (so the optimizer state
exists) and then, between barriers:
- new save / new load: megalite.checkpoint (every rank writes and reads only its slices);
- old save / old load: the previous format, re-enacted here as a reference: one process per
  stage writes the TP-gathered stage, every rank its own optimizer file; on load every rank
  reads every stage file whole and its own optimizer file (not for ZeRO-3, which it had not);
- async: the time a save blocks the loop with --async-save (host copy) and the wait at the
  next save after one more step of busy work as long as the synchronous save, vs sync.
Wall time is the slowest rank's, the best of --repeats runs; peak host memory is the largest
rise of any rank's resident set over its level before the operation (sampled every 2 ms).
Prints a table; asserts nothing.
"""
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import PeakRss, benchmark_parser, machine_line, timed

from megalite import checkpoint
from megalite.checkpoint.files import load_state, read_tensors, save_state, write_tensors
from megalite.config import parse_configs
from megalite.device import current_device
from megalite.distributed.rank_pool import run_once
from megalite.layout import RunLayout
from megalite.models import GPTModel
from megalite.models.sharding import full_state_dict, load_full_state_dict
from megalite.mpu import parallel_state as ps
from megalite.optimizer import get_optimizer
from megalite.training.setup import build_model, setup_parallel

ZERO1, ZERO3 = ["--use-distributed-optimizer"], ["--data-parallel-sharding-strategy",
                                                 "optim_grads_params"]
LAYOUTS = {"TP2 x PP2 x DP2": ["--tp", "2", "--pp", "2", "--dp", "2", *ZERO1],
           "DP 8": ["--dp", "8", *ZERO1], "DP 8 ZeRO-3": ["--dp", "8", *ZERO3]}


def _timed(fn) -> tuple[float, int]:
    """(wall seconds between barriers, peak RSS rise) of fn() on this rank."""
    dist.barrier()
    with PeakRss() as rss:
        seconds, _ = timed(lambda: (fn(), dist.barrier()))
    return seconds, rss.rise


def _old_save(root: str, model, optimizer) -> None:
    """The previous format: TP-gathered weights per stage (written by TP rank 0 of DP rank 0)
    and every rank's optimizer state."""
    weights = {k: v for chunk in model for k, v in full_state_dict(chunk).items()}
    if ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0:
        write_tensors(os.path.join(root, f"model_pp{ps.get_pipeline_model_parallel_rank()}"),
                      weights)
    save_state(os.path.join(root, f"rank_{dist.get_rank()}"), {"optimizer": optimizer.state_dict()})


def _old_load(root: str, model, optimizer) -> None:
    """Every rank reads every stage file whole, then its own optimizer file."""
    full = {}
    for stage in range(ps.get_pipeline_model_parallel_world_size()):
        full.update(read_tensors(os.path.join(root, f"model_pp{stage}")))
    load_full_state_dict(model, full)
    optimizer.load_state_dict(load_state(os.path.join(root, f"rank_{dist.get_rank()}"))
                              ["optimizer"])


def _busy(seconds: float) -> None:
    """A stand-in for training steps: matmuls for `seconds`."""
    a = torch.randn(256, 256)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


def bench(flags: list[str], model_flags: list[str], root: str, repeats: int) -> dict:
    configs = parse_configs([*flags, *model_flags])
    setup_parallel(configs, RunLayout.from_configs(configs, dist.get_world_size()))

    def provider(pre_process: bool, post_process: bool) -> GPTModel:
        return GPTModel(configs.model, pre_process=pre_process, post_process=post_process,
                        device=current_device())
    model = build_model(configs, provider)
    optimizer, scheduler = get_optimizer(configs.optimizer, configs.precision, model, 10)
    for chunk in model:
        for param in chunk.parameters():
            param.main_grad.normal_(std=1e-3)
    optimizer.step()
    if dist.get_rank() == 0:
        os.makedirs(f"{root}/old", exist_ok=True)

    def save(async_save: bool = False, iteration: int = 1):
        return checkpoint.save(f"{root}/new", iteration, model, optimizer, scheduler, 0,
                               configs.model, async_save=async_save)
    ops = {"new save": save,
           "new load": lambda: checkpoint.load(f"{root}/new", model, optimizer, scheduler,
                                               configs.model)}
    if configs.optimizer.sharding == "optim":  # format 2 knew no FSDP
        ops.update({"old save": lambda: _old_save(f"{root}/old", model, optimizer),
                    "old load": lambda: _old_load(f"{root}/old", model, optimizer)})
    out = {}
    for _ in range(repeats):  # the fastest of each: the disk is shared with other work
        for name, op in ops.items():
            out[name] = min(out.get(name, (float("inf"), 0)), _timed(op))
    pending = []
    blocked = _timed(lambda: pending.append(save(async_save=True, iteration=2)))
    _busy(out["new save"][0])
    wait = _timed(lambda: pending[0].finish(current_device()))
    out["async blocked"] = (blocked[0] + wait[0], max(blocked[1], wait[1]))
    out["bytes"] = sum(os.path.getsize(p) for p in
                       Path(checkpoint.iteration_dir(f"{root}/new", 1)).glob("shard_*"))
    return out


def main() -> None:
    parser = benchmark_parser(__doc__, ranks=8, repeats=3, num_layers=12, hidden_size=512)
    args = parser.parse_args()
    print(machine_line())
    model_flags = ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
                   "--num-attention-heads", "8", "--vocab-size", "32000", "--seq-length", "128",
                   "--max-position-embeddings", "128", "--micro-batch-size", "1",
                   "--global-batch-size", str(args.ranks)]
    params = 12 * args.num_layers * args.hidden_size ** 2 + 32000 * args.hidden_size
    print(f"GPT {args.num_layers} layers, hidden {args.hidden_size}, ~{params / 1e6:.0f}M "
          f"parameters (fp32 weights ~{4 * params / 2**20:.0f} MiB), Adam; "
          f"{args.ranks} gloo CPU ranks; wall s of the slowest rank / peak RSS rise MiB of "
          f"the largest rank")
    print(f"{'layout':18} {'':14} {'save s':>7} {'MiB':>6} {'load s':>7} {'MiB':>6}")
    env = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    for name, flags in LAYOUTS.items():
        root = tempfile.mkdtemp(prefix="bench_ckpt_")
        try:
            results = run_once(args.ranks, bench, flags, model_flags, root, args.repeats,
                               env=env)
        finally:
            shutil.rmtree(root, ignore_errors=True)

        def worst(key: str) -> tuple[float, float]:
            return (max(r[key][0] for r in results), max(r[key][1] for r in results) / 2**20)
        for fmt in ("new", "old") if "old save" in results[0] else ("new",):
            (s, sm), (ld, lm) = worst(f"{fmt} save"), worst(f"{fmt} load")
            label = "sharded" if fmt == "new" else "previous format"
            print(f"{name:18} {label:14} {s:7.2f} {sm:6.0f} {ld:7.2f} {lm:6.0f}")
        blocked, _ = worst("async blocked")
        print(f"{name:18} {'--async-save':14} {blocked:7.2f}  (loop blocked: host copy + wait "
              f"at the next save after {worst('new save')[0]:.2f} s of work; sync "
              f"{worst('new save')[0]:.2f} s; {results[0]['bytes'] / 2**20:.0f} MiB of "
              f"shards)")


if __name__ == "__main__":
    main()
