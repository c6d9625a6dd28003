"""megalite against its real peers on the same model, weights and batches: DeepSpeed ZeRO-1/2/3
(with and without CPU offload) and Megatron-core tensor parallelism (TP 2), 2 gloo CPU ranks.

    pip install -r benchmarks/requirements-peers.txt   # in a venv: see that file
    DS_ACCELERATOR=cpu python3 benchmarks/bench_peers.py             # the docs' run
    DS_ACCELERATOR=cpu python3 benchmarks/bench_peers.py --quick     # ~2 minutes
    python3 benchmarks/bench_peers.py --quick --megalite-only        # megalite's side alone

The model: a Llama (RMSNorm, rope, SwiGLU, 2 KV groups, no biases, untied head), written once
by transformers (LlamaForCausalLM, seed 0) and loaded by every system; AdamW (no weight decay,
clipping at 1.0, constant lr), fp32. Each rank feeds its own batches (rows of arithmetic
progressions mod vocab: a learnable task), the same to every system; under TP both ranks see
rank 0's. One pool of 2 ranks (OMP_NUM_THREADS=1 each) holds both systems of a configuration
and runs their steps interleaved, each first every other step, so both see the same load.

Per configuration: the largest relative difference of the losses (mean over DP), the median
over runs of the median per-step ratio megalite / peer (< 1: megalite is faster), the peers'
median step seconds, per rank the rise of the resident set over each system's set-up and
first step and the process's peak resident set (MiB; the pool's processes serve several
configurations), and the machine's load average when it ended. The first step of each run is
not timed.

DeepSpeed runs with its CPU accelerator (DS_ACCELERATOR=cpu: gloo without oneCCL; it JIT-builds
its shared-memory comm op and, for offload, cpu_adam once, ~1.5 min, then cached), its torch
AdamW (fused) or DeepSpeedCPUAdam under offload. Megatron-core 0.19.2's GPTModel (local layer
spec, no Transformer Engine) runs with torch's fused AdamW and clip_grad_norm_ over both ranks'
shards; the CUDA calls its CPU path still makes are redirected to the CPU by `cpu_for_cuda`
(documented there). A peer that cannot be imported is skipped with one line.
"""
import functools
import gc
import os
import resource
import statistics
import tempfile
from collections.abc import Callable

import torch
from common import PeakRss, benchmark_parser, machine_line, timed, turn_order

from megalite.distributed.rank_pool import RankPool

Step = Callable[[torch.Tensor], float]
ZERO = {1: "optim", 2: "optim_grads", 3: "optim_grads_params"}  # DeepSpeed stage -> megalite
LR, BETAS, EPS, CLIP = 1e-3, (0.9, 0.95), 1e-8, 1.0


def model_flags(args) -> list[str]:
    """megalite's flags of the compared Llama."""
    h = args.hidden_size
    ffn = (8 * h // 3 + 15) // 16 * 16  # 688 at h 256
    return ["--num-layers", str(args.num_layers), "--hidden-size", str(h),
            "--num-attention-heads", str(args.num_attention_heads),
            "--ffn-hidden-size", str(ffn), "--vocab-size", str(args.vocab_size),
            "--make-vocab-size-divisible-by", "1", "--seq-length", str(args.seq_length),
            "--max-position-embeddings", str(args.seq_length),
            "--micro-batch-size", str(args.micro_batch_size),
            "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
            "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
            "--untie-embeddings-and-output-weights", "--hidden-dropout", "0",
            "--attention-dropout", "0",
            "--lr", str(LR), "--adam-beta1", str(BETAS[0]), "--adam-beta2", str(BETAS[1]),
            "--adam-eps", str(EPS), "--weight-decay", "0", "--clip-grad", str(CLIP),
            "--lr-decay-style", "constant", "--lr-warmup-iters", "0"]


def write_init(flags: list[str], directory: str) -> None:
    """The shared initial weights: transformers' Llama of megalite's config (seed 0)."""
    from transformers import LlamaForCausalLM

    from megalite.config import parse_configs
    from megalite.hf import to_llama_config
    torch.manual_seed(0)
    LlamaForCausalLM(to_llama_config(parse_configs(flags).model)).save_pretrained(directory)


def batches(rank: int, steps: int, vocab: int, seq: int, mbs: int) -> list[torch.Tensor]:
    """This rank's token batches [mbs, seq + 1], one per step: each row an arithmetic
    progression mod vocab."""
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(steps):
        start = torch.randint(0, vocab, (mbs, 1), generator=g)
        stride = torch.randint(1, 9, (mbs, 1), generator=g)
        out.append((start + stride * torch.arange(seq + 1)) % vocab)
    return out


def hf_state(init_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(os.path.join(init_dir, "model.safetensors"))


def dp_mean(loss: torch.Tensor) -> float:
    """The loss's mean over all ranks (the DP mean: the ranks hold different batches)."""
    mean = loss.detach().float().reshape(1).clone()
    torch.distributed.all_reduce(mean)
    return mean.item() / torch.distributed.get_world_size()


def setup_megalite(flags: list[str], init_dir: str) -> Step:
    """megalite as pretrain_gpt builds it (its DP wrapper, optimizer and train_step) from the
    shared weights; step(tokens) -> the loss, mean over DP."""
    from megalite import device
    from megalite.config import parse_configs
    from megalite.hf import load_hf
    from megalite.layout import RunLayout
    from megalite.models import GPTModel
    from megalite.optimizer import get_optimizer
    from megalite.tasks import gpt
    from megalite.training.loop import train_step
    from megalite.training.setup import build_model, setup_parallel
    configs = parse_configs(flags)
    layout = RunLayout.from_configs(configs, torch.distributed.get_world_size())
    setup_parallel(configs, layout)
    state = hf_state(init_dir)

    def provider(pre_process: bool, post_process: bool) -> GPTModel:
        model = GPTModel(configs.model, pre_process=pre_process, post_process=post_process,
                         device=device.current_device())
        load_hf(model, state, configs.model)
        return model
    model = build_model(configs, provider)
    optimizer, _ = get_optimizer(configs.optimizer, configs.precision, model, 10**6)

    def step(tokens: torch.Tensor) -> float:
        return train_step(gpt.forward_step, iter([{"tokens": tokens}]), model, optimizer,
                          layout)[0]
    return step


def setup_deepspeed(stage: int, offload: bool, micro_batch: int, init_dir: str) -> Step:
    """transformers' Llama in a DeepSpeed engine (ZeRO `stage`, optimizer offloaded to the
    CPU with DeepSpeedCPUAdam when `offload`); step(tokens) -> the loss, mean over DP."""
    import deepspeed
    from transformers import LlamaForCausalLM
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    deepspeed.init_distributed(dist_backend="gloo")  # joins the pool's process group
    model = LlamaForCausalLM.from_pretrained(init_dir, dtype=torch.float32).train()
    zero = {"stage": stage, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    params = {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": 0.0,
              **({} if offload else {"torch_adam": True, "fused": True})}
    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
              "gradient_clipping": CLIP, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": params},
              "steps_per_print": 10**9, "wall_clock_breakdown": False}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)

    def step(tokens: torch.Tensor) -> float:
        logits = engine(input_ids=tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                 tokens[:, 1:].flatten())
        engine.backward(loss)
        engine.step()
        return dp_mean(loss)
    return step


def cpu_for_cuda() -> None:
    """Redirect the four CUDA calls Megatron-core 0.19.2 makes on its CPU path to the CPU:
    `torch.cuda.current_device` (its rotary embedding places the frequencies there) and the
    model-parallel RNG tracker's get/set of the CUDA RNG state (and its seeding) -> the CPU
    generator. Process-wide: run it only in processes that are done with CUDA."""
    import megatron.core.tensor_parallel.random as mcore_random
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.manual_seed = lambda seed: None
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    mcore_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)


def mcore_state(hf: dict[str, torch.Tensor], heads: int, groups: int, tp: int,
                rank: int) -> dict[str, torch.Tensor]:
    """This TP rank's Megatron-core GPTModel (local spec) state from a transformers Llama
    state: QKV interleaved per query group, gate and up stacked per rank, vocab rows split."""
    def split(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return t.chunk(tp, dim)[rank]
    out = {"embedding.word_embeddings.weight": split(hf["model.embed_tokens.weight"]),
           "decoder.final_layernorm.weight": hf["model.norm.weight"],
           "output_layer.weight": split(hf["lm_head.weight"])}
    layers = {int(k.split(".")[2]) for k in hf if k.startswith("model.layers.")}
    for i in sorted(layers):
        p, q = f"model.layers.{i}.", f"decoder.layers.{i}."
        wq, wk, wv = (hf[p + f"self_attn.{n}_proj.weight"] for n in "qkv")
        head_dim = wk.shape[0] // groups
        per_group = [wq.view(groups, heads // groups * head_dim, -1),
                     wk.view(groups, head_dim, -1), wv.view(groups, head_dim, -1)]
        qkv = torch.cat(per_group, dim=1)  # [groups, (q heads + 2) * head_dim, hidden]
        out[q + "self_attention.linear_qkv.weight"] = split(qkv).flatten(0, 1)
        out[q + "self_attention.linear_proj.weight"] = split(hf[p + "self_attn.o_proj.weight"], 1)
        out[q + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"]
        out[q + "pre_mlp_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
        out[q + "mlp.linear_fc1.weight"] = torch.cat(
            [split(hf[p + "mlp.gate_proj.weight"]), split(hf[p + "mlp.up_proj.weight"])])
        out[q + "mlp.linear_fc2.weight"] = split(hf[p + "mlp.down_proj.weight"], 1)
    return out


def setup_mcore(flags: list[str], init_dir: str) -> Step:
    """Megatron-core's GPTModel at TP 2 (the local layer spec) from the shared weights, with
    torch's fused AdamW and the global-norm clip; step(tokens) -> the loss."""
    cpu_for_cuda()
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megalite.config import parse_configs
    m = parse_configs(flags).model
    parallel_state.destroy_model_parallel()  # an earlier run in this pool's processes
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups,
        ffn_hidden_size=m.ffn_hidden_size, kv_channels=m.hidden_size // m.num_attention_heads,
        tensor_model_parallel_size=2, use_cpu_initialization=True,
        normalization="RMSNorm", layernorm_epsilon=m.norm_epsilon, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, params_dtype=torch.float32, pipeline_dtype=torch.float32)
    model = GPTModel(config, transformer_layer_spec=get_gpt_layer_local_spec(
        normalization="RMSNorm"), vocab_size=m.vocab_size,
        max_sequence_length=m.max_position_embeddings, position_embedding_type="rope",
        rotary_base=int(m.rotary_base), share_embeddings_and_output_weights=False)
    state = mcore_state(hf_state(init_dir), m.num_attention_heads, m.num_query_groups, 2,
                        parallel_state.get_tensor_model_parallel_rank())
    missing, unexpected = model.load_state_dict(state, strict=False)
    if [k for k in missing if not k.endswith("_extra_state")] or unexpected:
        raise RuntimeError(f"Megatron-core state: missing {missing}, unexpected {unexpected}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS,
                                  weight_decay=0.0, fused=True)
    # without sequence parallelism each rank holds the norms' full grads; the rest is split
    duplicated = [p for n, p in model.named_parameters() if "layernorm" in n]
    sharded = [p for n, p in model.named_parameters() if "layernorm" not in n]
    s = parse_configs(flags).train.seq_length
    position = torch.arange(s).unsqueeze(0)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), 1)

    def step(tokens: torch.Tensor) -> float:
        model.zero_grad(set_to_none=True)
        loss = model(tokens[:, :-1], position.expand(len(tokens), -1), mask,
                     labels=tokens[:, 1:]).float().mean()
        loss.backward()
        squares = torch.stack([p.grad.pow(2).sum() for p in sharded])
        total = squares.sum().reshape(1)
        torch.distributed.all_reduce(total, group=parallel_state.get_tensor_model_parallel_group())
        total += sum(p.grad.pow(2).sum() for p in duplicated)
        scale = (CLIP / (total.sqrt() + 1e-6)).clamp(max=1.0).squeeze()
        torch._foreach_mul_([p.grad for p in model.parameters()], scale)
        optimizer.step()
        return loss.item()
    return step


def interleaved(setups: dict[str, Callable[[], Step]], tokens: list[torch.Tensor]) -> dict:
    """On every rank: each system set up, then its steps on `tokens` interleaved (each first
    every other step): losses, seconds per step, the RSS rise (MiB) of its set-up and first
    step, and this process's peak RSS (MiB)."""
    steps, rise = {}, {}
    for name, setup in setups.items():
        with PeakRss() as rss:
            steps[name] = setup()
            gc.collect()
        rise[name] = rss.rise
    losses, times = {n: [] for n in steps}, {n: [] for n in steps}
    for i, batch in enumerate(tokens):
        for name in turn_order(steps, i):
            with PeakRss() as rss:
                seconds, loss = timed(functools.partial(steps[name], batch), barrier=True)
            if i == 0:
                rise[name] += rss.rise
            losses[name].append(loss)
            times[name].append(seconds)
    del steps
    gc.collect()
    return {"losses": losses, "times": times, "rise_mib": {k: v / 2**20 for k, v in rise.items()},
            "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _batches(flags: list[str], rank: int, steps: int) -> list[torch.Tensor]:
    from megalite.config import parse_configs
    configs = parse_configs(flags)
    t = configs.train
    return batches(rank, steps, configs.model.vocab_size, t.seq_length, t.micro_batch_size)


def zero_task(flags: list[str], stage: int, offload: bool, steps: int, init_dir: str,
              megalite_only: bool) -> dict:
    """One run of ZeRO `stage` (+ offload) on every rank: megalite and DeepSpeed."""
    ours = flags + ["--data-parallel-sharding-strategy", ZERO[stage]] + \
        (["--optimizer-cpu-offload"] if offload else [])
    setups = {"megalite": functools.partial(setup_megalite, ours, init_dir)}
    if not megalite_only:
        micro_batch = int(flags[flags.index("--micro-batch-size") + 1])
        setups["DeepSpeed"] = functools.partial(setup_deepspeed, stage, offload, micro_batch,
                                                init_dir)
    return interleaved(setups, _batches(flags, torch.distributed.get_rank(), steps + 1))


def tp_task(flags: list[str], steps: int, init_dir: str, megalite_only: bool) -> dict:
    """One run at TP 2 on every rank: megalite and Megatron-core, rank 0's batches."""
    setups = {"megalite": functools.partial(setup_megalite, flags + ["--tp", "2"], init_dir)}
    if not megalite_only:
        setups["Megatron-core"] = functools.partial(setup_mcore, flags, init_dir)
    return interleaved(setups, _batches(flags, 0, steps + 1))


def importable(module: str) -> str | None:
    """None when `module` imports, else one line saying why not."""
    try:
        __import__(module)
        return None
    except Exception as error:  # a peer's import can fail in many ways (CUDA, versions)
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def report(name: str, runs: list[dict]) -> None:
    """One line per configuration: loss agreement, step-time ratio, peer seconds, RSS."""
    systems = list(runs[0]["losses"])
    ours = runs[0]["times"]["megalite"][1:]
    line = f"| {name} | {statistics.median(ours):.3f} |"
    if len(systems) == 2:
        peer = systems[1]
        diff = max(abs(a - b) / abs(b) for r in runs for a, b in
                   zip(r["losses"]["megalite"], r["losses"][peer]))
        ratios = [statistics.median(a / b for a, b in zip(r["times"]["megalite"][1:],
                                                          r["times"][peer][1:])) for r in runs]
        line += (f" {statistics.median(statistics.median(r['times'][peer][1:]) for r in runs):.3f}"
                 f" | **{statistics.median(ratios):.2f}** ({', '.join(f'{x:.2f}' for x in ratios)})"
                 f" | {diff:.1e} |")
    else:
        line += " - | - | - |"
    rise = " / ".join(",".join(f"{r['rise_mib'][s]:.0f}" for r in runs[0]["per_rank"])
                      for s in systems)
    peak = ",".join(f"{r['peak_mib']:.0f}" for r in runs[-1]["per_rank"])
    print(f"{line} {rise} | {peak} | {os.getloadavg()[0]:.1f} |", flush=True)


def main(argv: list[str] | None = None, run_on: Callable[..., list] | None = None) -> None:
    """`run_on(world, fn, *args)` runs fn on `world` ranks (default: a RankPool per peer)."""
    parser = benchmark_parser(__doc__, steps=12, repeats=3, num_layers=4, hidden_size=256,
                              num_attention_heads=4, vocab_size=8192, seq_length=256,
                              micro_batch_size=4)
    parser.add_argument("--quick", action="store_true",
                        help="one run of at most 4 steps of each configuration, seq at most 128")
    parser.add_argument("--megalite-only", action="store_true",
                        help="megalite's side only (no peer imported): a smoke test")
    parser.add_argument("--only", nargs="+", default=None,
                        help="configurations to run, e.g. zero2 zero2+offload tp2")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeats, args.seq_length = min(args.steps, 4), 1, min(args.seq_length, 128)
    print(machine_line())
    flags = model_flags(args)
    configs = {f"zero{s}{'+offload' if o else ''}": (zero_task, flags, s, o)
               for o in (False, True) for s in (1, 2, 3)} | {"tp2": (tp_task, flags)}
    peers = {"DeepSpeed": "deepspeed", "Megatron-core": "megatron.core"}
    if not args.megalite_only:
        for peer, module in peers.items():
            if why := importable(module):
                print(f"{peer} skipped: `import {module}` failed ({why}); see "
                      f"benchmarks/requirements-peers.txt")
                peers[peer] = None
    print(f"Llama {args.num_layers} layers, hidden {args.hidden_size}, vocab {args.vocab_size}, "
          f"seq {args.seq_length}, micro batch {args.micro_batch_size}, fp32, AdamW; 2 gloo "
          f"ranks; {args.steps} timed steps, {args.repeats} runs; torch {torch.__version__}\n")
    print("| configuration | megalite s/step | peer s/step | megalite / peer (runs) | "
          "max rel. loss diff | RSS rise MiB ranks 0,1: megalite / peer | "
          "peak RSS MiB ranks 0,1 | load (1 min) |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as init_dir:
        write_init(flags, init_dir)
        for name, (task, *task_args) in configs.items():
            if args.only and name not in args.only:
                continue
            peer = "Megatron-core" if task is tp_task else "DeepSpeed"
            alone = args.megalite_only or peers[peer] is None
            runs = []
            for _ in range(args.repeats):
                per_rank = (run_on or _pool_run)(2, task, *task_args, args.steps, init_dir, alone)
                runs.append({**per_rank[0], "per_rank": per_rank})
            report(f"{name} vs {'-' if alone else peer}", runs)
    _close_pool()


_POOL: list[tuple[str, RankPool]] = []  # (the task it runs, the pool)


def _pool_run(world: int, fn: Callable, *args) -> list:
    """fn on a pool of `world` ranks kept for the tasks of the same function: Megatron-core's
    redirections (cpu_for_cuda) are process-wide, so its task gets a pool of its own."""
    if _POOL and _POOL[0][0] != fn.__name__:
        _close_pool()
    if not _POOL:
        env = {"DS_ACCELERATOR": "cpu", "DS_BUILD_OPS": "0"}
        _POOL.append((fn.__name__, RankPool(world, timeout_s=1800, env=env)))
    return _POOL[0][1].run(fn, *args)


def _close_pool() -> None:
    while _POOL:
        _POOL.pop()[1].close()


if __name__ == "__main__":
    main()
