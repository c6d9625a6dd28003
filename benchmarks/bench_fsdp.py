"""Data-parallel sharding strategies on CPU ranks: model-state memory, step time, and ZeRO-3
against transformers' Llama on torch FSDP2.

    python benchmarks/bench_fsdp.py [--hidden-size 256 --num-layers 4 --seq-length 128 --steps 8]

One pool of gloo ranks per DP size (OMP_NUM_THREADS=1 per rank) runs every configuration
in turn through megalite's own set-up (`megalite.training.setup.build_model`,
`get_optimizer`, `megalite.training.loop.train_step`) on a Llama-shaped model (RMSNorm,
rope, SwiGLU, 2 KV groups, head tied to the embedding, no dropout). Prints three tables; asserts nothing.

1. Model state per rank at DP 2 and 4, fp32 and bf16, each strategy (and optim /
   optim_grads_params with --optimizer-cpu-offload at DP 2): the bytes of the distinct
   storages that live between steps on rank 0, counted after a step - parameters (the local
   shard of a DTensor), gradients (grad buffers, grad shards), the optimizer's fp32 main
   copies and its state (exp_avg, exp_avg_sq, step) - against the planner's closed form
   (megalite.planning.state_bytes for the planner's parameter count).
2. Step time of each strategy at DP 2 in fp32 (median of --steps after a warm-up, ranks
   synchronised before each step) over no_shard's.
3. megalite ZeRO-3 against transformers `LlamaForCausalLM` with `fully_shard` on each
   decoder layer and the root, which holds the tied embedding and head (torchtitan's
   recipe; megalite wraps the same units) at DP 2:
   the same weights (megalite.hf.load_hf), the same batch on each DP rank, AdamW with the
   same settings (no weight decay, no clipping, constant lr), steps interleaved (each one
   first every other step); the loss of each step (mean over DP) and the median step time
   of each, their ratio.
"""
import functools
import statistics

import torch
from common import (benchmark_parser, llama_shape_flags, machine_line, median_seconds, timed,
                    turn_order)

from megalite.distributed.rank_pool import RankPool
from megalite.planning.measured import model_state_bytes
from megalite.config.sharding import STRATEGY_NAMES as STRATEGIES
from megalite.training.loop import train_step
from megalite.training.setup import build_model, setup_parallel

LLAMA = ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
         "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
         "--hidden-dropout", "0", "--attention-dropout", "0"]
OPTIMIZER = ["--weight-decay", "0", "--clip-grad", "0", "--lr-decay-style", "constant",
             "--lr-warmup-iters", "0", "--lr", "1e-3"]


def _batches(configs, steps: int) -> list[torch.Tensor]:
    """This DP rank's token batches [b, s + 1], one per step."""
    from megalite.mpu import parallel_state as ps
    t = configs.train
    generator = torch.Generator().manual_seed(100 + ps.get_data_parallel_rank())
    return [torch.randint(0, configs.model.vocab_size, (t.micro_batch_size, t.seq_length + 1),
                          generator=generator) for _ in range(steps)]


def _setup(argv: list[str], provider=None):
    """(configs, layout, model chunks, optimizer) built as pretrain_gpt builds them."""
    from megalite.config import parse_configs
    from megalite.layout import RunLayout
    from megalite.optimizer import get_optimizer
    from megalite.tasks import gpt as pretrain_gpt
    configs = parse_configs(argv)
    layout = RunLayout.from_configs(configs, torch.distributed.get_world_size())
    setup_parallel(configs, layout)
    model = build_model(configs, provider or functools.partial(
        pretrain_gpt.model_provider, configs))
    optimizer, _ = get_optimizer(configs.optimizer, configs.precision, model, 10)
    return configs, layout, model, optimizer


def _train_step(configs, layout, model, optimizer, tokens: torch.Tensor) -> float:
    from megalite.tasks import gpt as pretrain_gpt
    return train_step(pretrain_gpt.forward_step, iter([{"tokens": tokens}]), model, optimizer,
                      layout)[0]


def measure(argv: list[str], steps: int) -> dict:
    """On every rank: a warm-up step and `steps` timed ones; the model state after them."""
    configs, layout, model, optimizer = _setup(argv)
    batches = _batches(configs, steps + 1)
    seconds = median_seconds(lambda i: _train_step(configs, layout, model, optimizer, batches[i]),
                             steps, barrier=True)
    return {"state": model_state_bytes(model, optimizer),
            "params": sum(p.numel() for chunk in model for p in chunk.parameters()),
            "time": seconds}


def closed_form(argv: list[str], world: int) -> float:
    """The planner's model-state bytes of rank 0 (first stage) for `argv` on `world` ranks."""
    from megalite.config import parse_configs
    from megalite.planning.planner import plan
    configs = parse_configs(argv)
    configs.parallel.data_parallel_size = world
    return plan(configs).stages["first"].state_bytes.total


def hf_versus_megalite(argv: list[str], steps: int) -> dict:
    """On every rank: megalite ZeRO-3 and FSDP2-wrapped transformers Llama from the same
    weights, the same batches, steps interleaved; losses (mean over DP) and median times."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    from megalite import device
    from megalite.config import parse_configs
    from megalite.hf import load_hf, to_llama_config
    from megalite.models import GPTModel
    from megalite.mpu import comm
    from megalite.mpu import parallel_state as ps
    model_config = parse_configs(argv).model
    torch.manual_seed(0)
    hf = LlamaForCausalLM(to_llama_config(model_config)).to(device.current_device())

    def provider(pre_process: bool, post_process: bool):
        model = GPTModel(model_config, pre_process=pre_process, post_process=post_process,
                         device=device.current_device())
        load_hf(model, hf.state_dict(), model_config)
        return model
    configs, layout, model, optimizer = _setup(argv, provider)
    group = ps.get_data_parallel_group(with_context_parallel=True)
    mesh = DeviceMesh.from_group(group, device.device_type())
    for layer in hf.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(hf, mesh=mesh)  # the root: tied embedding and head, final norm
    o = configs.optimizer
    hf_optimizer = torch.optim.AdamW(hf.parameters(), lr=o.lr, betas=(o.adam_beta1, o.adam_beta2),
                                     eps=o.adam_eps, weight_decay=0.0)

    def transformers_step(tokens: torch.Tensor) -> float:
        tokens = tokens.to(device.current_device())
        logits = hf(input_ids=tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                 tokens[:, 1:].flatten())
        loss.backward()
        hf_optimizer.step()
        hf_optimizer.zero_grad()
        mean = loss.detach().reshape(1)
        comm.all_reduce(mean, group)
        return mean.item() / comm.world_size(group)

    steps_of = {"megalite": functools.partial(_train_step, configs, layout, model, optimizer),
                "transformers": transformers_step}
    losses, times = {name: [] for name in steps_of}, {name: [] for name in steps_of}
    for i, tokens in enumerate(_batches(configs, steps + 1)):
        for name in turn_order(steps_of, i):
            seconds, loss = timed(functools.partial(steps_of[name], tokens), barrier=True)
            losses[name].append(loss)
            times[name].append(seconds)
    return {"losses": losses, "time": {k: statistics.median(v[1:]) for k, v in times.items()}}


def main() -> None:
    parser = benchmark_parser(__doc__, steps=8, num_layers=4, hidden_size=256, vocab_size=2048,
                              seq_length=128, micro_batch_size=4)
    args = parser.parse_args()
    print(machine_line())
    h = args.hidden_size
    model = [*llama_shape_flags(args.num_layers, h, args.vocab_size),
             "--max-position-embeddings", str(args.seq_length), *LLAMA, *OPTIMIZER]
    timed = model + ["--seq-length", str(args.seq_length), "--micro-batch-size",
                     str(args.micro_batch_size)]
    small = model + ["--seq-length", "16", "--micro-batch-size", "1"]  # memory only: cheap bf16
    mib = 2 ** 20
    print(f"Llama-shaped, {args.num_layers} layers, hidden {h}, vocab {args.vocab_size}; "
          f"gloo CPU ranks, OMP_NUM_THREADS=1\n")
    print("1. Model state per rank, rank 0 (MiB): counted | closed form "
          "(megalite.planning.state_bytes)")
    print(f"{'DP':>2} {'precision':9} {'strategy':32} {'params':>7} {'grads':>7} {'optim.':>7} "
          f"{'total':>7} {'B/param':>7} {'closed':>7} {'ratio':>6}")
    timing = {}
    for world in (2, 4):
        pool = RankPool(world, timeout_s=1200)
        try:
            runs = [(precision, strategy, offload) for precision in ("fp32", "bf16")
                    for strategy in STRATEGIES for offload in (False, True)
                    if not offload or (world == 2 and strategy in ("optim", "optim_grads_params"))]
            for precision, strategy, offload in runs:
                flags = small + ["--data-parallel-sharding-strategy", strategy] + \
                    (["--bf16"] if precision == "bf16" else []) + \
                    (["--optimizer-cpu-offload"] if offload else [])
                r = pool.run(measure, flags, 1)[0]
                state, closed = r["state"], closed_form(flags, world)
                total = sum(state.values())
                name = strategy + (" + CPU offload" if offload else "")
                print(f"{world:2} {precision:9} {name:32} " + " ".join(
                    f"{state[k] / mib:7.2f}" for k in ("params", "grads", "optimizer"))
                    + f" {total / mib:7.2f} {total / r['params']:7.3f} {closed / mib:7.2f}"
                    f" {total / closed:6.3f}", flush=True)
            if world == 2:
                for strategy in STRATEGIES:
                    flags = timed + ["--data-parallel-sharding-strategy", strategy]
                    timing[strategy] = pool.run(measure, flags, args.steps)[0]["time"]
                versus = pool.run(hf_versus_megalite, timed + [
                    "--data-parallel-sharding-strategy", "optim_grads_params"], args.steps)[0]
        finally:
            pool.close()
    print(f"\n2. Step time at DP 2, fp32, seq {args.seq_length}, micro batch "
          f"{args.micro_batch_size} (median of {args.steps} steps)")
    print(f"{'strategy':20} {'s/step':>7} {'vs no_shard':>11}")
    for strategy, seconds in timing.items():
        print(f"{strategy:20} {seconds:7.3f} {seconds / timing['no_shard']:10.2f}x")
    print("\n3. ZeRO-3 at DP 2, fp32: megalite vs transformers LlamaForCausalLM + fully_shard")
    print(f"{'step':>4} {'megalite loss':>14} {'transformers':>14} {'rel. diff':>10}")
    for step, (ours, theirs) in enumerate(zip(versus["losses"]["megalite"],
                                              versus["losses"]["transformers"])):
        print(f"{step:4} {ours:14.7f} {theirs:14.7f} {abs(ours - theirs) / abs(theirs):10.2e}")
    ours, theirs = versus["time"]["megalite"], versus["time"]["transformers"]
    print(f"s/step: megalite {ours:.3f}, transformers {theirs:.3f}; transformers / megalite = "
          f"{theirs / ours:.2f}x")


if __name__ == "__main__":
    main()
