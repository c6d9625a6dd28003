"""Plan a GPT layout: memory per GPU, FLOPs, bubble, communication and step time per step.

    python tools/plan.py --num-layers 96 --hidden-size 12288 --num-attention-heads 96 \\
        --vocab-size 51200 --seq-length 2048 --tp 8 --pp 16 --dp 8 --micro-batch-size 1 \\
        --global-batch-size 1536 --bf16 --recompute-granularity selective \\
        --use-distributed-optimizer --peak-tflops 312 --mfu 0.5
    python tools/plan.py --validate
    python tools/plan.py --num-layers 32 --hidden-size 4096 --num-attention-heads 32 \
        --vocab-size 51200 --seq-length 2048 --dp 8 --micro-batch-size 1 --bf16 \
        --data-parallel-sharding-strategy optim_grads_params --optimizer-offload-device nvme \
        --offload-nvme-path /nvme --param-offload-device nvme --max-model \
        --host-memory-gib 1024 --disk-gib 3500

Model, layout, precision and recompute flags are megalite's own (megalite.config); the
formulas are in megalite/planning/. `--validate` prints (a) the estimate against the
peak measured in real megalite training steps on CPU ranks and (b) published Megatron-LM
configurations. What (a) measures, per rank, in fresh gloo processes: the bytes of the
model state after the second step (parameters or their DP shards, grad buffers or shards,
fp32 main params, optimizer state: megalite.planning.measured, each storage once) plus
the high-water mark, during that step, of the bytes autograd holds for backward (unique
storages, parameters excluded, counted from the moment a tensor is saved until autograd
releases it) together with FSDP's gathered parameters and unsharded grads (sampled at
every save and every use of a saved tensor) - the quantities the planner estimates, for
each sharding strategy. Other transient buffers (grads of activations, logits before the
loss, communication buffers) are in neither. Layouts without recompute are left out of (a):
with attention dropout, torch's CPU attention (the SDPA math path) keeps scores,
probabilities and mask in fp32, about 13.5 as/h sbh per layer in bf16 where Megatron's
fused kernels keep Korthikanti's 5 as/h sbh; recompute avoids storing them.
"""
import argparse
import functools
import sys
import weakref
from collections import Counter

import torch
from torch.distributed.tensor import DTensor

from megalite.config import (CheckpointConfig, Configs, DataConfig, ModelConfig, OptimizerConfig,
                             ParallelConfig, PrecisionConfig, TrainConfig, build_parser,
                             config_from_args)
from megalite.distributed.rank_pool import run_once
from megalite.planning.activations import ACTIVATION_BYTES, ring_wire
from megalite.planning.measured import fsdp_buffers, model_state_bytes
from megalite.planning.node_fit import max_layers, node_bytes
from megalite.planning.planner import Plan, plan
from megalite.config.sharding import STRATEGY_NAMES

GIB = 2 ** 30
SECTIONS = (ModelConfig, ParallelConfig, PrecisionConfig, OptimizerConfig, TrainConfig)


def build_arg_parser() -> argparse.ArgumentParser:
    parser = build_parser(list(SECTIONS), __doc__.splitlines()[0])
    tool = parser.add_argument_group("planner")
    tool.add_argument("--peak-tflops", type=float, default=989.0,
                      help="dense peak per GPU (H100 SXM bf16 989, A100 bf16 312)")
    tool.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilisation")
    tool.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory per GPU")
    tool.add_argument("--ckpt-write-gbps", type=float, default=2.0,
                      help="checkpoint write bandwidth per rank (GB/s) for the save-time estimate")
    tool.add_argument("--host-memory-gib", type=float, default=1024.0,
                      help="host memory per node (the offload tiers' bytes)")
    tool.add_argument("--disk-gib", type=float, default=3500.0,
                      help="free space per node under --offload-nvme-path (the nvme tier)")
    tool.add_argument("--disk-gbps", type=float, default=3.0,
                      help="disk bandwidth per rank (GB/s) for the nvme tier's I/O time")
    tool.add_argument("--gpus-per-node", type=int, default=8,
                      help="ranks sharing a node's host memory and disk")
    tool.add_argument("--max-model", action="store_true",
                      help="the deepest model of this width (more --num-layers) that fits the "
                           "GPU memory, host memory and disk of a node")
    tool.add_argument("--validate", action="store_true",
                      help="estimate vs measured on CPU ranks, and published configurations")
    parser.set_defaults(max_position_embeddings=None, data_parallel_size=1)
    return parser


def parse(argv: list[str]) -> tuple[Configs, argparse.Namespace]:
    """Configs from planner flags; --max-position-embeddings defaults to --seq-length."""
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    try:
        sections = [config_from_args(cls, args) for cls in SECTIONS]
    except ValueError as error:
        parser.exit(2, f"error: {error}\n")
    return Configs(*sections, DataConfig(), CheckpointConfig()), args


def _size(n: float) -> str:
    for power, unit in ((3, "GiB"), (2, "MiB"), (1, "KiB")):
        if n >= 1024 ** power:
            return f"{n / 1024 ** power:.2f} {unit}"
    return f"{n:.0f} B"


def tier_report(p: Plan, args: argparse.Namespace) -> list[str]:
    """Where the optimizer and the parameters live, the tiers' host and file bytes per node
    and their I/O."""
    gpu, host, disk = node_bytes(p, args.gpus_per_node)
    tier = "nvme" if p.layout.nvme_offload else "cpu" if p.layout.cpu_offload else "none"
    ranks = min(args.gpus_per_node, p.layout.world_size)
    lines = [f"Offload tier {tier}, parameters {p.layout.param_tier}: per node ({ranks} "
             f"ranks) {_size(host)} of host memory (fits {args.host_memory_gib:g} GiB: "
             f"{'yes' if host <= args.host_memory_gib * GIB else 'NO'}), {_size(disk)} of "
             f"files (fits {args.disk_gib:g} GiB: {'yes' if disk <= args.disk_gib * GIB else 'NO'})"]
    if p.layout.nvme_offload or p.layout.param_tier == "nvme":
        io, seconds = p.tier_io_seconds(args.disk_gbps)
        lines.append(f"  nvme tiers' I/O per step per rank: {_size(io)} (the optimizer's file "
                     f"read and written once, the parameters' read 3 times and written once "
                     f"(2 reads under PP)), {seconds:.3g} s at {args.disk_gbps:g} GB/s")
    return lines


def report(p: Plan, peak_tflops: float, mfu: float, capacity_gib: float,
           ckpt_write_gbps: float = 2.0) -> str:
    """The plan as text."""
    c, par = p.configs, p.configs.parallel
    tp, pp, v = p.layout.grid.tp, p.layout.grid.pp, p.layout.chunks_per_rank
    m, t = c.model, c.train
    lines = [
        f"GPT {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads, ffn "
        f"{m.ffn_hidden_size}, vocab {m.vocab_size} (padded {p.padded_vocab}), seq "
        f"{t.seq_length}: {p.total_params / 1e9:.2f} B parameters",
        f"TP {tp} x CP {par.context_parallel_size} x PP {pp}{f' x VPP {v}' if v > 1 else ''} x "
        f"DP {p.layout.data_parallel_size} = {p.layout.world_size} GPUs; micro "
        f"batch {t.micro_batch_size}, global batch {p.layout.global_batch_size} = {p.layout.num_microbatches} "
        f"microbatches per DP rank; {p.layout.schedule.name}; {p.precision}, recompute "
        f"{m.recompute_granularity or 'none'}, sharding {p.layout.sharding}"
        f"{' with optimizer CPU offload' if p.layout.cpu_offload else ''}"
        f"{' with the optimizer on NVMe' if p.layout.nvme_offload else ''}"
        f"{f', parameters in {p.layout.param_tier}' if p.layout.param_tier != 'none' else ''}"
        f"{', sequence parallel' if p.sequence_parallel else ''}",
        "", f"Memory per GPU (GiB)                  {'first stage':>12} {'last stage':>12}"]
    first, last = p.stages["first"], p.stages["last"]
    state = first.state
    lines.insert(2, f"Model state per rank: {state.total:.4g} B/param ({state.params:.4g} params + "
                    f"{state.grads:.4g} grads + {state.optimizer:.4g} optimizer; "
                    f"{state.device:.4g} on the GPU, {state.host:.4g} in host memory)")
    rows = [(f"parameters ({state.params:.4g} B/param)", lambda s: s.state_bytes.params),
            (f"gradients ({state.grads:.4g} B/param)", lambda s: s.state_bytes.grads),
            (f"optimizer states ({state.optimizer:.4g} B/param)",
             lambda s: s.state_bytes.optimizer),
            ("  of which in host memory (offload)", lambda s: -s.state_bytes.host),
            ("  of which in files (nvme tier)", lambda s: -s.state_bytes.nvme),
            ("gathered params (FSDP, largest unit)", lambda s: s.gather),
            ("activations of the layers", lambda s: s.layer_activations),
            ("embedding / LM head + logits", lambda s: s.extra_activations),
            ("recompute working set", lambda s: s.recompute_working),
            ("total", lambda s: s.total)]
    lines += [f"  {name:36}{get(first) / GIB:12.2f} {get(last) / GIB:12.2f}" for name, get in rows]
    lines += [f"  {'microbatches in flight':36}{float(first.inflight):12.3g} "
              f"{float(last.inflight):12.3g}",
              f"  fits {capacity_gib:g} GiB: "
              f"{'yes' if max(first.total, last.total) <= capacity_gib * GIB else 'NO'}", ""]
    lines.append(f"Pipeline bubble: {float(p.bubble):.4f} = {p.layout.schedule.bubble_form} (F = B = W)")
    lines.append(f"FLOPs per step: {p.flops:.4e} (Megatron's "
                 f"{'96' if m.recompute_granularity == 'full' else '72'} B s L h^2 formula)")
    step = p.step_time(peak_tflops, mfu)
    lines.append(f"At {mfu:.0%} MFU of {peak_tflops:g} TFLOP/s per GPU: {step:.4g} s/step, "
                 f"{p.layout.global_batch_size * t.seq_length / step:,.0f} tokens/s, "
                 f"{peak_tflops * mfu:.1f} TFLOP/s per GPU")
    per_rank = max(p.checkpoint_bytes(stage) for stage in p.stages)
    lines.append(f"Checkpoint save: {_size(per_rank)} per rank (every rank writes its slices at "
                 f"once), {p.save_time(ckpt_write_gbps):.3g} s at {ckpt_write_gbps:g} GB/s per rank")
    lines.append(f"  host memory a save adds per rank: {_size(p.save_host_bytes(False))} (the "
                 f"streaming writer's buffer), {_size(p.save_host_bytes(True))} with --async-save "
                 f"(+ a pinned host copy of the GPU's share, allocated once)")
    message = (t.seq_length // par.context_parallel_size * t.micro_batch_size * m.hidden_size
               * ACTIVATION_BYTES[p.precision])
    lines += ["", f"Communication: a b s h message is {message / 2**20:.2f} MiB; per microbatch "
              f"each layer all-reduces {6 if m.recompute_granularity == 'full' else 4} of them "
              "over TP and each stage boundary carries one each way",
              "per step per GPU: payload handed to the collective | ring wire bytes sent"]
    for stage in ("first", "last") if pp > 1 else ("first",):
        for name, (kind, payload, n) in p.comm(stage).items():
            lines.append(f"  {stage + ' stage' if pp > 1 else '':12}{name:32}{_size(payload):>11}"
                         f" {_size(ring_wire(kind, payload, n)):>11}  ({kind} over {n})")
    return "\n".join(lines)


# --- validation (a): estimate vs measured on CPU ranks --------------------------------------

SMALL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
         "--vocab-size", "1000", "--seq-length", "128", "--micro-batch-size", "4"]
MEASURED = {  # name -> (world size, flags)
    "fp32, selective, 2 microbatches": (1, SMALL + ["--recompute-granularity", "selective",
                                                    "--global-batch-size", "8"]),
    "bf16 TP2 x DP2, selective, dist. optimizer": (4, SMALL + [
        "--bf16", "--tp", "2", "--dp", "2", "--recompute-granularity", "selective",
        "--use-distributed-optimizer", "--global-batch-size", "16"]),
    "fp32 PP2 x VPP2 (interleaved), selective": (2, SMALL + [
        "--pp", "2", "--vpp", "2", "--recompute-granularity", "selective",
        "--global-batch-size", "32"]),
    "fp32 PP2 1F1B, full recompute, 8 layers": (2, SMALL + [
        "--num-layers", "8", "--num-attention-heads", "2", "--pp", "2",
        "--recompute-granularity", "full", "--global-batch-size", "16"]),
    **{f"fp32 DP2 {strategy}, selective": (2, SMALL + [
        "--dp", "2", "--recompute-granularity", "selective",
        "--data-parallel-sharding-strategy", strategy])
       for strategy in STRATEGY_NAMES},
    "bf16 DP2 optim_grads_params, selective": (2, SMALL + [
        "--bf16", "--dp", "2", "--recompute-granularity", "selective",
        "--data-parallel-sharding-strategy", "optim_grads_params"]),
    "fp32 PP2 x DP2 optim_grads_params, selective": (4, SMALL + [
        "--pp", "2", "--dp", "2", "--recompute-granularity", "selective",
        "--global-batch-size", "16", "--data-parallel-sharding-strategy", "optim_grads_params"]),
}


class LiveSavedBytes:
    """Bytes of the storages autograd holds for backward, and their high-water mark; with FSDP
    also the bytes of its gathered parameters and unsharded grads (`gathered`, sampled at
    every pack and unpack) and the high-water mark of both together.

    A saved tensor is wrapped on pack; when autograd drops the wrapper the storage's count
    drops, and the storage stops counting with its last wrapper. Parameters (FSDP's gathered
    ones included) are excluded.
    """

    class _Saved:
        def __init__(self, tensor: torch.Tensor) -> None:
            self.tensor = tensor

    def __init__(self, params, gathered=lambda: []) -> None:
        self.excluded = {(p.to_local() if isinstance(p, DTensor) else p).untyped_storage()
                         .data_ptr() for p in params}
        self.gathered = gathered
        self.refs: Counter = Counter()
        self.live = self.peak = self.peak_gathered = self.peak_total = 0

    def _sample(self) -> set:
        """Storages of FSDP's unsharded tensors now; the peaks updated."""
        storages = {s.data_ptr(): s.nbytes() for s in (t.untyped_storage()
                                                         for t in self.gathered()) if s.nbytes()}
        gathered = sum(storages.values())
        self.peak_gathered = max(self.peak_gathered, gathered)
        self.peak_total = max(self.peak_total, self.live + gathered)
        return set(storages)

    def pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        ptr, size = storage.data_ptr(), storage.nbytes()
        if ptr in self.excluded or ptr in self._sample() or size == 0:
            return tensor
        if not self.refs[ptr]:
            self.live += size
            self.peak = max(self.peak, self.live)
            self._sample()
        self.refs[ptr] += 1
        saved = self._Saved(tensor)
        weakref.finalize(saved, self._release, ptr, size)
        return saved

    def _release(self, ptr: int, size: int) -> None:
        self.refs[ptr] -= 1
        if not self.refs[ptr]:
            self.live -= size

    def unpack(self, saved) -> torch.Tensor:
        self._sample()
        return saved if isinstance(saved, torch.Tensor) else saved.tensor


def measure_rank(argv: list[str]) -> dict:
    """On every rank of a fresh process group: two real training steps of the configs in
    `argv`; the model state and the peak of saved-for-backward bytes in the second."""
    from megalite.layout import RunLayout
    from megalite.mpu import parallel_state as ps
    from megalite.optimizer import get_optimizer
    from megalite.tasks import gpt as pretrain_gpt
    from megalite.training.loop import train_step
    from megalite.training.setup import build_model, setup_parallel
    configs, _ = parse(argv)
    layout = RunLayout.from_configs(configs, torch.distributed.get_world_size())
    setup_parallel(configs, layout)
    model = build_model(configs, functools.partial(pretrain_gpt.model_provider, configs))
    optimizer, _ = get_optimizer(configs.optimizer, configs.precision, model, 10)
    t = configs.train
    generator = torch.Generator().manual_seed(ps.get_data_parallel_rank())
    data = iter(lambda: {"tokens": torch.randint(0, configs.model.vocab_size,
                                                 (t.micro_batch_size, t.seq_length + 1),
                                                 generator=generator)}, None)
    step = functools.partial(train_step, pretrain_gpt.forward_step, data, model, optimizer,
                             layout)
    step()  # allocates the optimizer state
    saved = LiveSavedBytes([q for chunk in model for q in chunk.parameters()],
                           functools.partial(fsdp_buffers, model))
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        step()
    return {"tp": ps.get_tensor_model_parallel_rank(), "dp": ps.get_data_parallel_rank(),
            "pp": ps.get_pipeline_model_parallel_rank(),
            "state": model_state_bytes(model, optimizer), "activations": saved.peak,
            "gathered": saved.peak_gathered, "peak": saved.peak_total}


def validate_memory() -> None:
    mib = 2 ** 20
    print("(a) Peak memory per rank (MiB): model state + saved activations + FSDP's gathered "
          "params, estimate | measured")
    print(f"{'':48} {'state':>13} {'activations':>13} {'gathered':>13} {'total':>13}")
    print(f"{'configuration':42} {'stage':>5}" + "   est.  meas." * 4 + "  est/meas")
    for name, (world, argv) in MEASURED.items():
        results = run_once(world, measure_rank, argv)
        estimate = plan(parse(argv)[0])
        last = max(r["pp"] for r in results)
        for r in results:
            if r["tp"] or r["dp"] or 0 < r["pp"] < last:
                continue
            stage = estimate.stages["first" if r["pp"] == 0 else "last"]
            state = sum(r["state"].values())
            pairs = ((stage.state_bytes.total, state),
                     (stage.activations, r["activations"]),
                     (stage.gather, r["gathered"]),
                     (stage.total, state + r["peak"]))
            print(f"{name:42} {r['pp']:5} " + " ".join(f"{a / mib:6.1f} {b / mib:6.1f}"
                                                       for a, b in pairs)
                  + f" {stage.total / (state + r['peak']):6.3f}")


# --- validation (b): published Megatron-LM configurations -----------------------------------

def _gpt(layers: int, hidden: int, heads: int, tp: int, pp: int, dp: int, micro: int,
         batch: int, *extra: str) -> list[str]:
    return ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads",
            str(heads), "--vocab-size", "51200", "--seq-length", "2048", "--tp", str(tp),
            "--pp", str(pp), "--dp", str(dp), "--micro-batch-size", str(micro),
            "--global-batch-size", str(batch), *extra]


SELECTIVE = ("--bf16", "--recompute-granularity", "selective")
KORTHIKANTI = SELECTIVE + ("--sequence-parallel",)
A100 = 312.0
# name -> (flags, published: (iteration seconds, MFU) | (aggregate PFLOP/s, fraction of peak))
PUBLISHED = {
    "GPT-3 175B TP8 PP16 DP8, dist. opt.": (
        _gpt(96, 12288, 96, 8, 16, 8, 1, 1536, *SELECTIVE, "--use-distributed-optimizer"), None),
    "GPT-3 175B TP8 PP16 DP8, plain opt.": (_gpt(96, 12288, 96, 8, 16, 8, 1, 1536, *SELECTIVE),
                                            None),
    "GPT-3 175B, no parallelism": (_gpt(96, 12288, 96, 1, 1, 1, 1, 1, *SELECTIVE), None),
    "22B TP8 [K]": (_gpt(48, 6144, 64, 8, 1, 1, 4, 4, *KORTHIKANTI), ("time", 1.10, 0.415)),
    "175B TP8 PP8 VPP3 [K]": (_gpt(96, 12288, 96, 8, 8, 1, 1, 64, "--vpp", "3", *KORTHIKANTI),
                              ("time", 13.75, 0.514)),
    "530B TP8 PP35 VPP3 [K]": (_gpt(105, 20480, 128, 8, 35, 1, 1, 280, "--vpp", "3",
                                    *KORTHIKANTI), ("time", 37.83, 0.560)),
    "1T TP8 PP64 [K]": (_gpt(128, 25600, 160, 8, 64, 1, 1, 512, *KORTHIKANTI),
                        ("time", 71.49, 0.563)),
    "1T TP8 PP64 DP6, full recompute [N]": (
        _gpt(128, 25600, 160, 8, 64, 6, 1, 3072, "--fp16", "--recompute-granularity", "full"),
        ("rate", 502.0, 0.52)),
}


def published_table(capacity_gib: float) -> None:
    print(f"\n(b) Published Megatron-LM configurations (seq 2048, vocab 51200, A100 80 GB, "
          f"{A100:g} TFLOP/s bf16 dense)")
    print("[K] Korthikanti et al. 2022 Tables 3 and 5 (selective recompute + sequence "
          "parallel, DP 1): published iteration time and MFU; the planner's MFU is its FLOPs "
          "over that time.")
    print("[N] Narayanan et al. 2021 / Megatron-LM README: 502 PFLOP/s on 3072 GPUs = 52% of "
          "peak (96-formula FLOPs); the planner's step time and tokens/s at that rate "
          "(fp16 and micro batch 1 assumed: not in the sources here).")
    print(f"{'configuration':38} {'GPUs':>5} {'params':>7} {'GiB/GPU':>8} {'fits':>4}  "
          f"{'published':28} planner")
    for name, (argv, published) in PUBLISHED.items():
        p = plan(*_parsed(argv))
        peak = max(s.total for s in p.stages.values()) / GIB
        fits = "yes" if peak <= capacity_gib else "no"
        tokens = p.layout.global_batch_size * p.configs.train.seq_length
        if published is None:
            pub, ours = "-", f"{p.step_time(A100, 0.5):.2f} s/step at 50% MFU"
        elif published[0] == "time":
            _, seconds, mfu = published
            pub = f"{seconds:.2f} s/iter, MFU {mfu:.1%}"
            ours = f"MFU {p.flops / (seconds * p.layout.world_size * A100 * 1e12):.1%}"
        else:
            _, pflops, fraction = published
            step = p.flops / (pflops * 1e15)
            pub = f"{pflops:g} PFLOP/s = {pflops * 1e3 / p.layout.world_size:.0f} TFLOP/s/GPU ({fraction:.0%})"
            ours = (f"MFU {pflops * 1e3 / p.layout.world_size / A100:.1%}: {step:.1f} s/step, "
                    f"{tokens / step:,.0f} tokens/s")
        print(f"{name:38} {p.layout.world_size:5} {p.total_params / 1e9:6.0f}B {peak:8.1f} {fits:>4}  "
              f"{pub:28} {ours}")


def _parsed(argv: list[str]) -> tuple[Configs, bool]:
    configs, args = parse(argv)
    return configs, args.sequence_parallel


def main(argv: list[str] | None = None) -> None:
    configs, args = parse(sys.argv[1:] if argv is None else argv)
    if args.validate:
        validate_memory()
        published_table(args.gpu_memory_gib)
        return
    try:
        result = plan(configs, args.sequence_parallel)
    except ValueError as error:
        sys.exit(f"error: {error}")
    if args.max_model:
        budgets = (args.gpu_memory_gib * GIB, args.host_memory_gib * GIB, args.disk_gib * GIB)
        result, limit = max_layers(configs, args.gpus_per_node, budgets, args.sequence_parallel)
        if result is None:
            sys.exit(f"error: not even {configs.parallel.pipeline_model_parallel_size} layer(s) "
                     f"of this width fit the node ({limit})")
        print(f"Largest model of this width that fits: {result.configs.model.num_layers} layers, "
              f"{result.total_params / 1e9:.2f} B parameters (one more step of layers exceeds "
              f"the {limit})\n")
    print(report(result, args.peak_tflops, args.mfu, args.gpu_memory_gib, args.ckpt_write_gbps))
    print("\n".join(tier_report(result, args)))


if __name__ == "__main__":
    main()
