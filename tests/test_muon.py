"""Muon (--optimizer muon, megalite.optimizer.muon).

One rank: megalite's optimizer steps a tiny GPT exactly as torch.optim.Muon (the same
hyper-parameters) on each hidden matrix, plus torch AdamW on the embeddings, norms and biases,
with the fused weights taken apart as separate matrices by the test itself: QKV rows are
[head: q, k, v], GQA's key_value [group: k, v], SwiGLU's first projection [gate; up]. Two
models: GPT-2-like (fused QKV, GeLU; Nesterov, shape_scaling = torch's "original") and
Llama-like (GQA 2 groups, SwiGLU, RMSNorm; plain momentum, spectral x 0.2 = torch's
"match_rms_adamw").

Layouts: pretrain_gpt's loss curve at PP2 x DP2, ZeRO-1 and ZeRO-3 (each at TP2 x DP2: the TP
gather and the DP pieces together) equals the single-process one (fp32 with fp32
Newton-Schulz, dropout off, 1e-5 relative: summation order; ~1e-7 seen, while orthogonalising
each TP shard on its own instead misses by 3e-3). The ZeRO-1 run, stopped by SIGTERM after
step 1 and resumed, continues bit for bit (momentum buffers and AdamW moments come back from
the checkpoint); its checkpoint loaded into ZeRO-3 at PP2 x DP2 (the state resharded from
TP-split flat ranges to FSDP row shards) continues the one-process curve (iteration 3's loss
depends on the momentum).
"""
import torch

from megalite.config import ModelConfig, PrecisionConfig
from megalite.device import current_device
from megalite.models import GPTModel
from tests.helpers.dp_reference import (VOCAB, batches, init_grid, opt_config, rank_group,
                                        train_step)
from tests.helpers.gpt_run import make_dataset, tiny_args, train
from tests.helpers.multirank import run_on_ranks
from tests.helpers.reference import rel_err

STEPS, SEQ = 4, 8
GPT2 = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                   max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0)
LLAMA = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                    max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0,
                    swiglu=True, group_query_attention=True, num_query_groups=2,
                    normalization="RMSNorm", position_embedding_type="rope",
                    disable_bias_linear=True)
# model -> (megalite flags, torch.optim.Muon's matching arguments)
CASES = {"gpt2": (GPT2, dict(muon_nesterov=True, muon_scale_mode="shape_scaling"),
                  dict(nesterov=True, adjust_lr_fn="original")),
         "llama": (LLAMA, dict(muon_nesterov=False, muon_scale_mode="spectral",
                               muon_extra_scale_factor=0.2),
                   dict(nesterov=False, adjust_lr_fn="match_rms_adamw"))}


def _split(name: str, tensor: torch.Tensor, config: ModelConfig) -> list[torch.Tensor]:
    """The separate matrices of a hidden weight (copies), by the test's reading of the layout."""
    heads, groups = config.num_attention_heads, config.num_query_groups or 0
    if name.endswith("query_key_value.weight"):
        return [t.reshape(-1, tensor.shape[1]).clone()
                for t in tensor.view(heads, 3, -1, tensor.shape[1]).unbind(1)]
    if name.endswith("key_value.weight"):
        return [t.reshape(-1, tensor.shape[1]).clone()
                for t in tensor.view(groups, 2, -1, tensor.shape[1]).unbind(1)]
    if name.endswith("dense_h_to_4h.weight") and config.swiglu:
        return [t.clone() for t in tensor.chunk(2)]
    return [tensor.clone()]


def _join(name: str, parts: list[torch.Tensor], config: ModelConfig) -> torch.Tensor:
    if len(parts) == 1 or name.endswith("dense_h_to_4h.weight"):
        return torch.cat(parts)
    blocks = config.num_attention_heads if name.endswith("query_key_value.weight") \
        else config.num_query_groups
    return torch.stack([p.view(blocks, -1, p.shape[1]) for p in parts], 1).reshape(
        -1, parts[0].shape[1])


def _reference_run(config: ModelConfig, opt, torch_muon: dict, tokens: list) -> dict:
    """Plain torch: the GPT on a group of its own, clip_grad_norm_, torch.optim.Muon on the
    parts of the hidden matrices and torch AdamW on the rest; the params after the steps."""
    model = GPTModel(config, layer_range=(0, config.num_layers), group=rank_group(1),
                     device=current_device())
    named = dict(model.named_parameters())
    hidden = [n for n, p in named.items()
              if p.ndim == 2 and "embedding" not in n and "output_layer" not in n]
    parts = {n: [torch.nn.Parameter(t) for t in _split(n, named[n].detach(), config)]
             for n in hidden}
    muon = torch.optim.Muon([p for n in hidden for p in parts[n]], lr=opt.lr,
                            weight_decay=opt.weight_decay, momentum=opt.muon_momentum,
                            ns_steps=opt.muon_num_ns_steps, **torch_muon)
    rest = [n for n in named if n not in hidden]
    adamw = torch.optim.AdamW(
        [{"params": [named[n] for n in rest if named[n].ndim > 1],
          "weight_decay": opt.weight_decay},
         {"params": [named[n] for n in rest if named[n].ndim <= 1], "weight_decay": 0.0}],
        lr=opt.lr, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps,
        fused=current_device().type in ("cpu", "cuda"))  # as megalite's AdamW: same rounding
    for batch in tokens:
        model.zero_grad()
        model(batch[:, :-1], batch[:, 1:]).mean().backward()
        if opt.clip_grad:
            torch.nn.utils.clip_grad_norm_(model.parameters(), opt.clip_grad)
        for n in hidden:
            for part, grad in zip(parts[n], _split(n, named[n].grad, config)):
                part.grad = grad
        muon.step()
        adamw.step()
        with torch.no_grad():
            for n in hidden:
                named[n].copy_(_join(n, [p.detach() for p in parts[n]], config))
    return {n: p.detach().clone() for n, p in named.items()}


def _one_rank_errors() -> dict:
    from megalite.distributed import DistributedDataParallel
    from megalite.optimizer import get_optimizer
    errors = {}
    for case, (config, flags, torch_muon) in CASES.items():
        init_grid(1)
        opt = opt_config(optimizer="muon", lr=0.02, muon_coefficient_type="simple", **flags)
        tokens = batches(STEPS, 4)
        model = DistributedDataParallel(GPTModel(config, device=current_device()))
        optimizer, _ = get_optimizer(opt, PrecisionConfig(), model)
        for batch in tokens:
            assert train_step(model, optimizer, batch)[0]
        got = {n: p.detach() for n, p in model.module.named_parameters()}
        want = _reference_run(config, opt, torch_muon, tokens)
        errors[case] = {n: rel_err(got[n], want[n]) for n in want}
        errors[case]["moved"] = max(rel_err(want[n], p.detach()) for n, p in
                                    GPTModel(config, device=current_device()).named_parameters())
    return errors


def test_one_rank_equals_torch_muon_on_the_matrices_and_adamw_on_the_rest():
    errors = run_on_ranks(1, _one_rank_errors)[0]
    for case, errs in errors.items():
        moved = errs.pop("moved")
        print(case, "worst param error vs torch.optim.Muon + AdamW:", max(errs.values()),
              "moved:", moved)
        assert moved > 1e-2, case  # the steps are large enough to compare
        assert max(errs.values()) < 1e-5, (case, errs)


# fp32 Newton-Schulz: in bf16 the DP/TP summation-order differences of the grads (~1e-7) flip
# roundings that the iteration amplifies to ~1e-5 in the loss after 3 steps (measured)
MUON = ["--optimizer", "muon", "--lr", "0.02", "--lr-decay-style", "constant", "--clip-grad",
        "0", "--hidden-dropout", "0", "--attention-dropout", "0", "--lr-warmup-iters", "0",
        "--muon-fp32-matmul-prec", "highest"]
LAYOUTS = {"pp2 dp2": ["--pp", "2"],  # TP2 x DP2: the ZeRO layouts
           "zero1 tp2 dp2": ["--tp", "2", "--use-distributed-optimizer"],
           "zero3 tp2 dp2": ["--tp", "2", "--data-parallel-sharding-strategy",
                             "optim_grads_params"]}
RESUMED = "zero1 tp2 dp2"


RESHARDED = ["--pp", "2", "--data-parallel-sharding-strategy", "optim_grads_params"]


def _layout_runs(prefix: str, root: str) -> dict:
    """Each layout's loss curve over 3 iterations; the ZeRO-1 run again, stopped by SIGTERM
    during iteration 1 (on rank 1), then its checkpoint loaded into ZeRO-3 at PP2 x DP2 and
    resumed under its own layout."""
    import os
    curves = {name: train(tiny_args(prefix, f"{root}/{name}", 3, *MUON, *flags))
              for name, flags in LAYOUTS.items()}
    argv = tiny_args(prefix, f"{root}/resumed", 3, *MUON, *LAYOUTS[RESUMED])
    os.environ["MEGALITE_FAULT"] = "sigterm@1:1"
    try:
        curves["first"] = train(argv)
    finally:
        del os.environ["MEGALITE_FAULT"]
    curves["resharded"] = train(tiny_args(prefix, f"{root}/resharded", 3, *MUON, *RESHARDED,
                                          "--load", f"{root}/resumed"))
    curves["second"] = train([*argv, "--load", f"{root}/resumed"])
    return curves


def test_layouts_equal_one_process_and_resume_after_sigterm_is_exact(tmp_path):
    prefix = make_dataset(str(tmp_path))
    single = run_on_ranks(1, train, tiny_args(prefix, f"{tmp_path}/single", 3, *MUON))[0]
    curves = run_on_ranks(4, _layout_runs, prefix, str(tmp_path))[0]
    for name in [*LAYOUTS, "resharded"]:
        err = max(abs(curves[name][i] - single[i]) / abs(single[i]) for i in curves[name])
        print(f"muon {name}: loss curve vs one process, worst relative error {err:.1e}")
        assert err < 1e-5, (name, curves[name], single)
    straight, first, second = curves[RESUMED], curves["first"], curves["second"]
    assert sorted(first) == [1] and sorted(second) == sorted(curves["resharded"]) == [2, 3]
    assert [first[1], second[2], second[3]] == [straight[i] for i in (1, 2, 3)], (first, second)
