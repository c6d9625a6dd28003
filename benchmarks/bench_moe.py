"""MoE training step: megalite vs transformers' Mixtral, and vs the dense model with the same
active parameters (fp32, one process, CPU or one GPU); with --deepseek-block, the
DeepSeek-V3 MoE block alone: megalite's grouped experts vs its per-expert loop vs
transformers' DeepseekV3MoE (each of its expert implementations that runs), same weights.

    python benchmarks/bench_moe.py                 # 2 layers, h 256, 8 experts, top-2
    python benchmarks/bench_moe.py --device cuda --hidden-size 1024 --seq-length 1024
    python benchmarks/bench_moe.py --deepseek-block --num-experts 64 --topk 6 \\
        --moe-ffn-hidden-size 128

Same random weights in all MoE models (a transformers MixtralForCausalLM built from a config,
copied into megalite with megalite.hf.moe; nothing is downloaded); transformers runs twice:
its default grouped-matmul experts and its per-expert loop (`experts_implementation` eager). The dense model is the
Llama spec with an MLP of k x the expert size (the active expert parameters; the router's
E h is the only difference). One step = zero grads, forward, loss, backward, AdamW step
(torch.optim.AdamW on plain models: the same optimizer for all). Steps alternate
after warm-up; medians are reported. The routing and permutation share is measured apart:
router (linear, scores, top-k, aux and z losses) and plan + dispatch + combine around an
identity expert, forward and backward, on one layer's tokens, times the MoE layers, over
megalite's step time. The DeepSeek-V3 block steps with torch's fused AdamW (each system's
default), megalite's layer as in a training step between log lines (no logged-only router
losses), and once more as in a logging step. Prints figures; asserts only that the models
agree at the start.
--cpu-time times the CPU time of the stepping thread instead of wall-clock time (with
OMP_NUM_THREADS=1: on a shared, loaded machine, wall-clock steps mostly measure the load).
"""
import argparse
import statistics
import time

import torch
from common import benchmark_parser, machine_line, median_seconds, sync, timed, turn_order

from megalite.hf.moe import deepseek_moe_block_state, moe_config, moe_to_megalite
from megalite.models import GPTModel
from megalite.models.sharding import full_state_dict, load_full_state_dict
from megalite.moe import MoELayer
from megalite.moe.dispatcher import combine, dispatch, plan_dispatch
from megalite.moe.router import load_balancing_loss, z_loss


def parse_args() -> argparse.Namespace:
    p = benchmark_parser(__doc__, device="cuda" if torch.cuda.is_available() else "cpu", steps=6,
                         warmup=2, num_layers=2, hidden_size=256, num_attention_heads=4,
                         vocab_size=4096, seq_length=256, micro_batch_size=4)
    p.add_argument("--moe-ffn-hidden-size", type=int, default=512)
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--deepseek-block", action="store_true",
                   help="time the DeepSeek-V3 MoE block alone (sigmoid, groups, shared expert)")
    p.add_argument("--num-groups", type=int, default=8, help="--deepseek-block: n_group")
    p.add_argument("--group-topk", type=int, default=4, help="--deepseek-block: topk_group")
    p.add_argument("--cpu-time", action="store_true",
                   help="--deepseek-block: CPU time of the stepping thread, not wall-clock")
    return p.parse_args()


def hf_mixtral(args):
    from transformers import MixtralConfig, MixtralForCausalLM
    cfg = MixtralConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                        intermediate_size=args.moe_ffn_hidden_size,
                        num_hidden_layers=args.num_layers,
                        num_attention_heads=args.num_attention_heads,
                        num_key_value_heads=args.num_attention_heads,
                        num_local_experts=args.num_experts, num_experts_per_tok=args.topk,
                        max_position_embeddings=args.seq_length)
    torch.manual_seed(0)
    model = MixtralForCausalLM(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 3:
                param.normal_(0, 0.02)  # transformers leaves the fused experts uninitialised
    return model


def step_fn(model, tokens, hf: bool):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        if hf:
            logits = model(input_ids=inputs).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        else:
            loss = model(inputs, labels).mean()
        loss.backward()
        opt.step()
        return loss.item()
    return step


def routing_time(layer, x, device, repeats: int = 5) -> float:
    """Median seconds of router + plan + dispatch + combine (identity experts), fwd + bwd."""
    router = layer.router

    def once():
        tokens = x.detach().requires_grad_()
        weights, indices, scores, logits = router(tokens)
        plan = plan_dispatch(indices, weights, layer.num_experts)
        out = combine(dispatch(tokens, plan), plan, tokens.shape[0])
        (out.sum() + load_balancing_loss(scores, indices, layer.topk) + z_loss(logits)
         ).backward()
    return median_seconds(lambda _: once(), repeats, device=device)  # after one warm-up


def deepseek_block(args, device) -> None:
    """Step (forward, backward of <out, g>, AdamW) of one DeepSeek-V3 MoE block on b x s
    tokens: megalite grouped vs looped experts vs transformers' DeepseekV3MoE."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    h, experts, ffn = args.hidden_size, args.num_experts, args.moe_ffn_hidden_size
    kw = dict(score_function="sigmoid", renormalize=True, num_groups=args.num_groups,
              group_topk=args.group_topk, topk_scaling_factor=2.5, expert_bias=True,
              shared_expert_size=ffn, device=device)
    ours = {}
    for name, grouped, logging in (("megalite grouped experts", True, False),
                                   ("megalite grouped experts, logging step", True, True),
                                   ("megalite looped experts", False, False)):
        torch.manual_seed(0)
        ours[name] = MoELayer(h, experts, ffn, args.topk, grouped_gemm=grouped, **kw)
        # a training step between log lines computes no logged-only router losses
        ours[name].moe_state.log_router_losses = logging
    backend = "torch._grouped_mm" if ours["megalite grouped experts"].local_experts \
        .use_grouped_mm else "padded batched matmul or loop"
    state = deepseek_moe_block_state(full_state_dict(ours["megalite looped experts"]), experts)
    theirs = {}
    for impl in ("grouped_mm", "eager"):  # batched_mm gathers [k, ffn, h] per token: slow
        config = DeepseekV3Config(hidden_size=h, moe_intermediate_size=ffn,
                                  n_routed_experts=experts, num_experts_per_tok=args.topk,
                                  n_group=args.num_groups, topk_group=args.group_topk,
                                  n_shared_experts=1, routed_scaling_factor=2.5,
                                  norm_topk_prob=True, experts_implementation=impl)
        block = DeepseekV3MoE(config)
        block.load_state_dict(state)
        theirs[f"transformers DeepseekV3MoE {impl}"] = block.to(device)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.seq_length, args.micro_batch_size, h, generator=gen).to(device)
    g = torch.randn(args.seq_length, args.micro_batch_size, h, generator=gen).to(device)

    clock = time.thread_time if args.cpu_time else time.perf_counter

    def step_of(module, transpose: bool):
        # the AdamW both use by default: megalite's build_adamw and transformers' Trainer
        # (adamw_torch_fused) take torch's fused one where the device has it
        try:
            opt = torch.optim.AdamW(module.parameters(), lr=1e-4, fused=True)
        except RuntimeError:
            opt = torch.optim.AdamW(module.parameters(), lr=1e-4, foreach=True)
        inp, grad = (x.transpose(0, 1).contiguous(), g.transpose(0, 1).contiguous()) \
            if transpose else (x, g)

        def step() -> tuple[float, float, torch.Tensor]:
            """(seconds of forward + backward, of the whole step, the output [s, b, h])."""
            sync(device)
            start = clock()
            opt.zero_grad(set_to_none=True)
            out = module(inp)
            (out * grad).sum().backward()
            sync(device)
            middle = clock()
            opt.step()
            sync(device)
            return middle - start, clock() - start, out.transpose(0, 1) if transpose else out
        return step
    steps = {**{n: step_of(m, False) for n, m in ours.items()},
             **{n: step_of(m, True) for n, m in theirs.items()}}
    first, errors = {}, {}
    for name in list(steps):
        try:
            first[name] = steps[name]()[2].detach()
        except RuntimeError as error:  # e.g. grouped_mm's backward on CPU
            errors[name] = str(error).splitlines()[0][:60]
            del steps[name]
    ref = first["megalite looped experts"]
    times = {name: ([], []) for name in steps}  # (forward + backward, whole step) seconds
    for _ in range(args.warmup):
        for step in steps.values():
            step()
    for i in range(args.steps):
        for name in turn_order(steps, i):
            for column, seconds in zip(times[name], steps[name]()[:2]):
                column.append(seconds)
    tokens = args.seq_length * args.micro_batch_size
    print(f"device {device}, threads {torch.get_num_threads()}, fp32 | DeepSeek-V3 MoE block: "
          f"h {h}, {experts} experts top-{args.topk} of {args.group_topk}/{args.num_groups} "
          f"groups, expert ffn {ffn}, 1 shared | {tokens} tokens | megalite grouped backend: "
          f"{backend} | {'CPU time of the stepping thread' if args.cpu_time else 'wall clock'}, "
          f"median of {args.steps} alternating steps")
    print(f"{'block':40s} {'ms/step':>9s} {'fwd+bwd ms':>11s} {'tokens/s':>10s} "
          f"{'out rel err':>12s}")
    median = {name: tuple(statistics.median(column) for column in t) for name, t in times.items()}
    for name, (fwd_bwd, step_seconds) in median.items():
        err = ((first[name] - ref).abs().max() / ref.abs().max()).item()
        print(f"{name:40s} {1000 * step_seconds:9.1f} {1000 * fwd_bwd:11.1f} "
              f"{tokens / step_seconds:10.0f} {err:12.1e}")
    for name, error in errors.items():
        print(f"{name:40s} fails: {error}")
    ours = median["megalite grouped experts"]
    best = [min(t[i] for n, t in median.items() if n.startswith("transformers")) for i in (0, 1)]
    print(f"megalite grouped / fastest transformers tokens/s: step {best[1] / ours[1]:.2f}x, "
          f"forward + backward {best[0] / ours[0]:.2f}x (target >= 1.1x); grouped / looped step: "
          f"{median['megalite looped experts'][1] / ours[1]:.2f}x")


def main() -> None:
    args = parse_args()
    print(machine_line())
    device = torch.device(args.device)
    if args.deepseek_block:
        deepseek_block(args, device)
        return
    hf = hf_mixtral(args)
    hf.config._attn_implementation = "sdpa"
    hf_loop = hf_mixtral(args)  # the same weights, experts run one by one
    hf_loop.config._attn_implementation = "sdpa"
    hf_loop.set_experts_implementation("eager")
    config = moe_config(hf.config)
    megalite = GPTModel(config)
    load_full_state_dict(megalite, moe_to_megalite(hf.state_dict(), config))
    dense_config = moe_config(hf.config)
    dense_config.num_experts = None
    dense_config.ffn_hidden_size = args.topk * args.moe_ffn_hidden_size
    dense = GPTModel(dense_config)
    hf, hf_loop, megalite, dense = (m.to(device).train() for m in (hf, hf_loop, megalite, dense))
    tokens = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length + 1),
                           generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        ours = megalite(tokens[:, :-1])[..., :args.vocab_size]  # [b, s, V]
        theirs = hf(input_ids=tokens[:, :-1]).logits
        err = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    assert err < 1e-4, f"models differ at the start: {err:.2e}"
    steps = {"transformers Mixtral": step_fn(hf, tokens, True),
             "transformers Mixtral, eager experts": step_fn(hf_loop, tokens, True),
             "megalite MoE": step_fn(megalite, tokens, False),
             "megalite dense (same active params)": step_fn(dense, tokens, False)}
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    times = {name: [] for name in steps}
    for i in range(args.steps):
        for name in turn_order(steps, i):
            times[name].append(timed(steps[name], device)[0])
    tokens_per_step = args.micro_batch_size * args.seq_length
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"device {device}, threads {torch.get_num_threads()}, fp32 | {args.num_layers} layers,"
          f" h {args.hidden_size}, {args.num_experts} experts top-{args.topk}, expert ffn "
          f"{args.moe_ffn_hidden_size}, batch {args.micro_batch_size} x {args.seq_length} | "
          f"logits rel err at start {err:.1e}")
    print(f"{'model':40s} {'ms/step':>9s} {'tokens/s':>10s}")
    for name, t in median.items():
        print(f"{name:40s} {1000 * t:9.1f} {tokens_per_step / t:10.0f}")
    ratio = median["transformers Mixtral"] / median["megalite MoE"]
    print(f"megalite MoE / transformers Mixtral tokens/s: {ratio:.2f}x (target >= 1.2x; "
          f"transformers' default experts run as grouped matmuls)")
    print(f"megalite MoE / transformers Mixtral with its per-expert loop: "
          f"{median['transformers Mixtral, eager experts'] / median['megalite MoE']:.2f}x")
    print(f"megalite MoE / dense same-active tokens/s: "
          f"{median['megalite dense (same active params)'] / median['megalite MoE']:.2f}x")
    layer = megalite.encoder.layers["0"].mlp
    x = torch.randn(tokens_per_step, args.hidden_size, device=device)
    route = routing_time(layer, x, device) * args.num_layers
    print(f"routing + permutation (fwd + bwd, {args.num_layers} layers): {1000 * route:.1f} ms "
          f"= {100 * route / median['megalite MoE']:.1f}% of megalite's step")


if __name__ == "__main__":
    main()
