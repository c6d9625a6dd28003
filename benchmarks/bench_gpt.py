"""Training throughput of megalite's GPTModel vs transformers' GPT2LMHeadModel (or, with
--model llama, LlamaForCausalLM), one process.

    python benchmarks/bench_gpt.py                  # reference config, fp32 and bf16, CPU
    python benchmarks/bench_gpt.py --model llama --precisions fp32  # 8 heads, 2 KV groups, FFN 1408
    python benchmarks/bench_gpt.py --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \\
        --vocab-size 50257 --seq-length 2048 --micro-batch-size 8 --precisions bf16 \\
        --device cuda                          # GPT-2 medium (~350M) on a GPU

Both models have the same config and the same random weights (the HF model is built from
a GPT2Config / LlamaConfig, `megalite.hf.load_hf` copies its state dict into megalite;
nothing is downloaded) and
train on the same batch with the same optimizer: AdamW (torch fused kernel), lr 1e-4,
weight decay 0.01 except biases and norms, global grad-norm clipping at 1.0, dropout off.
One step = zero grads, forward, loss, backward, clip, optimizer step.

- HF: what a Hugging Face user does: `model(input_ids, labels=input_ids).loss`, default
  attention (sdpa), fp32 params; bf16 = the same under `torch.autocast(bfloat16)`.
- megalite: its real path, `megalite.training.loop.train_step` on a 1-rank gloo group (TP = PP
  = DP = 1) with `DistributedDataParallel` (fp32 main_grad buffer) and `get_optimizer`
  (MixedPrecisionOptimizer); bf16 = bf16 params and activations with fp32 main grads and
  main params (Megatron's --bf16).

Steps alternate A/B (HF, megalite, megalite, HF, ...) after warm-up, all in this one run;
medians are reported. Model FLOPs per token (what MFU counts, causal masking not
discounted): 6 N + 12 L s a d, N = parameters without the position embedding, the tied
word embedding counted once (it is the LM head's matmul), a d = heads x head dim. The peak is measured here:
large square matmuls (n = --peak-size) in fp32 and bf16 with the same threads, 5 before
and 5 after the steps; the peak is the best of them (on a shared VM the median moves with
other tenants' load, the best does not). On CUDA the table's MFU also uses the H100 SXM
dense bf16 peak (989 TFLOP/s). Prints tables; asserts nothing except that the models
start from the same weights.

--profile PRECISION runs a few steps of each model under torch.profiler instead and prints
the top ops by self time.
"""
import argparse
import contextlib
import functools
import statistics

import torch
from common import benchmark_parser, machine_line, sync, timed, turn_order

from megalite.config import (CheckpointConfig, Configs, DataConfig, ModelConfig, OptimizerConfig,
                             ParallelConfig, PrecisionConfig, TrainConfig)
from megalite.device import init_distributed, reduced_precision_warning
from megalite.distributed import DistributedDataParallel
from megalite.hf import load_hf, to_gpt2_config, to_llama_config
from megalite.layout import RunLayout
from megalite.models import GPTModel, TransformerSpec
from megalite.mpu import initialize_model_parallel, model_parallel_seed
from megalite.optimizer import get_optimizer
from megalite.tasks import gpt as pretrain_gpt
from megalite.training.loop import train_step

H100_BF16_DENSE = 989e12
LR, WEIGHT_DECAY, CLIP = 1e-4, 0.01, 1.0


def parse_args() -> argparse.Namespace:
    p = benchmark_parser(__doc__, device="cpu", warmup=2, num_layers=4, hidden_size=512,
                         num_attention_heads=8, vocab_size=8192, seq_length=512,
                         micro_batch_size=8)
    p.add_argument("--model", default="gpt2", choices=sorted(FAMILIES),
                   help="gpt2: GPT2LMHeadModel; llama: LlamaForCausalLM (RMSNorm, rope, SwiGLU, "
                        "GQA, untied head)")
    p.add_argument("--num-query-groups", type=int, default=2, help="llama: KV groups")
    p.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="MLP width (default: 4h for gpt2, 1408 for llama)")
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--reps", type=int, default=8, help="timed steps per model and precision")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (CPU)")
    p.add_argument("--peak-size", type=int, default=4096, help="n of the n x n peak matmuls")
    p.add_argument("--compile", action="store_true",
                   help="megalite's transformer layers wrapped in torch.compile (an experiment: "
                        "no gain on CPU here)")
    p.add_argument("--profile", choices=["fp32", "bf16"],
                   help="profile this precision (top ops) instead of timing")
    p.add_argument("--profile-rows", type=int, default=25)
    return p.parse_args()


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int, reps: int = 5) -> list[float]:
    """FLOP/s of n x n @ n x n matmuls (2 n^3 each), one figure per rep after one warm-up."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    rates = []
    for i in range(reps + 1):
        seconds, _ = timed(lambda: torch.mm(a, b, out=out), device)
        if i:
            rates.append(2 * n ** 3 / seconds)
    return rates


def flops_per_token(config: ModelConfig, seq: int) -> tuple[float, int]:
    """(6 N + 12 L s a d, N): N without position embeddings, tied LM head counted once."""
    spec = TransformerSpec.from_config(config)
    n = config.num_layers * spec.layer_params() + spec.non_layer_params(config.vocab_size, 0)
    return 6 * n + 12 * config.num_layers * seq * config.num_attention_heads * config.head_dim, n


def decay_groups(model: torch.nn.Module) -> list[dict]:
    """The HF Trainer's split: no weight decay on biases and LayerNorm weights (1-D)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.ndim > 1], "weight_decay": WEIGHT_DECAY},
            {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]


class HFRunner:
    """transformers GPT2LMHeadModel, fp32 params, optional bf16 autocast, fused AdamW."""

    def __init__(self, hf_model, precision: str, device: torch.device) -> None:
        self.model, self.device = hf_model, device
        self.autocast = precision == "bf16"
        self.optimizer = torch.optim.AdamW(decay_groups(hf_model), lr=LR, betas=(0.9, 0.95),
                                           eps=1e-8, fused=True)

    def step(self, tokens: torch.Tensor) -> float:
        inputs = tokens[:, :-1]
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            loss = self.model(input_ids=inputs, labels=inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.optimizer.step()
        return loss.detach()


class MegaliteRunner:
    """megalite GPTModel through megalite.training.loop.train_step: DDP wrapper + get_optimizer."""

    def __init__(self, family: str, config: ModelConfig, hf_state: dict, precision: str, seq: int,
                 micro: int, device: torch.device, compile_layers: bool = False) -> None:
        prec = PrecisionConfig(bf16=precision == "bf16")
        opt = OptimizerConfig(lr=LR, min_lr=LR, lr_decay_style="constant",
                              weight_decay=WEIGHT_DECAY, adam_beta1=0.9, adam_beta2=0.95,
                              clip_grad=CLIP)
        configs = Configs(config, ParallelConfig(), prec, opt,
                          TrainConfig(micro_batch_size=micro, seq_length=seq, train_iters=10 ** 6),
                          DataConfig(), CheckpointConfig())
        model = GPTModel(config, params_dtype=prec.params_dtype, device=device)
        FAMILIES[family][1](model, hf_state)
        if compile_layers:
            for layer in model.encoder.layers.values():
                layer.compile()
        self.model = [DistributedDataParallel(model, bucket_size=opt.ddp_bucket_size,
                                              overlap_grad_reduce=opt.overlap_grad_reduce)]
        self.optimizer, self.scheduler = get_optimizer(opt, prec, self.model, 10 ** 6)
        self.layout = RunLayout.from_configs(configs, 1)

    def step(self, tokens: torch.Tensor) -> float:
        loss, stepped, _ = train_step(pretrain_gpt.forward_step, iter([{"tokens": tokens}]),
                                      self.model, self.optimizer, self.layout)
        if stepped:
            self.scheduler.step()
        return loss


def _hf_gpt2(config: ModelConfig):
    from transformers import GPT2LMHeadModel
    hf_config = to_gpt2_config(config)
    hf_config.bos_token_id = hf_config.eos_token_id = config.vocab_size - 1
    return GPT2LMHeadModel(hf_config)


def _hf_llama(config: ModelConfig):
    from transformers import LlamaForCausalLM
    hf_config = to_llama_config(config)
    hf_config.bos_token_id = hf_config.eos_token_id = config.vocab_size - 1
    return LlamaForCausalLM(hf_config)


# family -> (HF model from a megalite config, loader of an HF state dict into megalite,
#            the family's flags over the shared shape)
FAMILIES = {
    "gpt2": (_hf_gpt2, load_hf, {}),
    "llama": (_hf_llama, load_hf, dict(
        normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
        group_query_attention=True, disable_bias_linear=True,
        untie_embeddings_and_output_weights=True)),
}


def build_config(args) -> ModelConfig:
    family_flags = dict(FAMILIES[args.model][2])
    if args.model == "llama":
        family_flags["num_query_groups"] = args.num_query_groups
    ffn = args.ffn_hidden_size or (1408 if args.model == "llama" else 4 * args.hidden_size)
    return ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                       num_attention_heads=args.num_attention_heads, vocab_size=args.vocab_size,
                       ffn_hidden_size=ffn, max_position_embeddings=args.seq_length,
                       hidden_dropout=0.0, attention_dropout=0.0, **family_flags)


def build_hf(family: str, config: ModelConfig, device: torch.device):
    torch.manual_seed(0)
    return FAMILIES[family][0](config).to(device).train()


def check_same_weights(hf, ours: MegaliteRunner, tokens: torch.Tensor, precision: str) -> float:
    """Relative difference of the two models' logits before training (fp32: ~1e-6)."""
    with torch.no_grad(), torch.autocast(tokens.device.type, dtype=torch.bfloat16,
                                         enabled=precision == "bf16"):
        want = hf(input_ids=tokens[:, :-1]).logits.float()
        got = ours.model[0](tokens[:, :-1]).float()[..., :want.shape[-1]]  # drop vocab padding
    return ((got - want).abs().max() / want.abs().max()).item()


def run_models(args, config: ModelConfig, precision: str, device: torch.device, tokens):
    hf = build_hf(args.model, config, device)
    ours = MegaliteRunner(args.model, config, hf.state_dict(), precision, args.seq_length,
                          args.micro_batch_size, device, getattr(args, "compile", False))
    err = check_same_weights(hf, ours, tokens, precision)
    limit = 1e-4 if precision == "fp32" else 5e-2
    if not err < limit:
        raise SystemExit(f"{precision}: megalite and HF logits differ ({err:.2e}): not the same "
                         "model")
    return HFRunner(hf, precision, device), ours, err


def profile(args, config, device, tokens) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    hf_runner, ours, _ = run_models(args, config, args.profile, device, tokens)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    for name, runner in (("HF", hf_runner), ("megalite", ours)):
        for _ in range(args.warmup):
            runner.step(tokens)
        steps = 2
        with torch_profile(activities=activities) as prof:
            for _ in range(steps):
                runner.step(tokens)
            sync(device)
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events) / steps / 1e6
        print(f"\n== {name} {args.profile}: top ops by self time, per step "
              f"(total self CPU {total:.2f} s/step) ==")
        print(events.table(sort_by=sort, row_limit=args.profile_rows, max_name_column_width=50))


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    init_distributed(0, 1)
    initialize_model_parallel(1, 1)
    model_parallel_seed(1234, 0)
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()

    config = build_config(args)
    s, b = args.seq_length, args.micro_batch_size
    torch.manual_seed(1)
    tokens = torch.randint(0, args.vocab_size, (b, s + 1), device=device)
    fpt, n_params = flops_per_token(config, s)
    import transformers
    print(f"{args.model}: L {config.num_layers}, h {config.hidden_size}, a "
          f"{config.num_attention_heads}, KV groups {config.query_groups}, ffn "
          f"{config.ffn_hidden_size}, V {config.vocab_size}, s {s}, b {b} ({b * s} tokens/step); "
          f"N = {n_params / 1e6:.2f} M (w/o position embeddings, tied head once); model "
          f"FLOPs/token 6N + 12Lsad = {fpt / 1e6:.1f} M")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, device "
          f"{device.type}" + (f", {torch.get_num_threads()} threads" if device.type == "cpu"
                              else f" ({torch.cuda.get_device_name()})") + f"; {machine_line()}")
    if args.profile:
        profile(args, config, device, tokens)
        return

    slow_bf16 = device.type == "cpu" and "bf16" in args.precisions and \
        reduced_precision_warning(torch.bfloat16)
    if slow_bf16:
        print(f"{slow_bf16}\nbf16 skipped: its peak measurement alone would take tens of "
              f"minutes on this CPU", flush=True)
        args.precisions = [p for p in args.precisions if p != "bf16"]
    peaks = {"fp32": torch.float32, "bf16": torch.bfloat16}
    peak_rates = {k: matmul_peak(device, dt, args.peak_size) for k, dt in peaks.items()
                  if k in args.precisions}
    results = {}
    for precision in args.precisions:
        hf_runner, ours, err = run_models(args, config, precision, device, tokens)
        runners = {"HF": hf_runner, "megalite": ours}
        first = {}
        for name, runner in runners.items():
            for i in range(args.warmup):
                _, loss = timed(functools.partial(runner.step, tokens), device)
                if i == 0:
                    first[name] = float(loss)
        times = {name: [] for name in runners}
        for rep in range(args.reps):
            for name in turn_order(runners, rep):
                times[name].append(timed(functools.partial(runners[name].step, tokens), device)[0])
        results[precision] = times
        print(f"{precision}: start logits rel. diff {err:.1e}; first-step loss HF "
              f"{first['HF']:.4f} megalite {first['megalite']:.4f}; step times (s) "
              + "; ".join(f"{n} " + " ".join(f"{t:.3f}" for t in ts) for n, ts in times.items()),
              flush=True)
        del hf_runner, ours, runners
    for k, dt in peaks.items():
        if k in peak_rates:
            peak_rates[k] += matmul_peak(device, dt, args.peak_size)

    tokens_per_step = b * s
    print(f"\nmatmul peak ({args.peak_size}^3, best of {len(next(iter(peak_rates.values())))}"
          f", before and after the steps): " + ", ".join(
              f"{k} {max(v) / 1e9:.0f} GFLOP/s (median {statistics.median(v) / 1e9:.0f}, min "
              f"{min(v) / 1e9:.0f})" for k, v in peak_rates.items()))
    header = (f"{'precision':9} {'model':9} {'step s':>7} {'tokens/s':>9} {'GFLOP/s':>8} "
              f"{'MFU':>6} {'x HF':>6}")
    if device.type == "cuda":
        header += f" {'MFU H100':>9}"
    print(header)
    for precision, times in results.items():
        peak = max(peak_rates[precision])
        hf_tps = tokens_per_step / statistics.median(times["HF"])
        for name, ts in times.items():
            step = statistics.median(ts)
            tps = tokens_per_step / step
            flops = tps * fpt
            line = (f"{precision:9} {name:9} {step:7.3f} {tps:9,.0f} {flops / 1e9:8.1f} "
                    f"{flops / peak:6.1%} {tps / hf_tps:6.2f}")
            if device.type == "cuda":
                line += f" {flops / H100_BF16_DENSE:9.1%}"
            print(line)
    print(f"({machine_line()})")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
