"""Sharding strategies through pretrain_gpt's flags on 8 ranks: ZeRO-3 (optim_grads_params) at
DP 8, TP2 x DP4 with SP, TP2 x PP2 x DP2 (1F1B and interleaved), TP2 x CP2 x DP2, a MoE
Llama-flag model at TP2 x DP4 x EP2; ZeRO-2 (optim_grads) at TP2 x PP2 x DP2;
--optimizer-cpu-offload with ZeRO-1 and ZeRO-3; full and selective recompute. Each loss curve
and global grad-norm curve (before clipping: every shard counted once over DP, TP, PP and EP)
equals the single-process run on the same global batches (fp32, dropout off; summation order
differs, so 1e-5 relative). Most layouts train with SGD at a large constant learning rate,
whose steps scale with the gradients (Adam's barely do): a wrong DP mean, a missed TP or
expert reduction would move the curve. Clipping is active in the Adam runs and the SP, CP
and MoE ones (grad norm ~1.2, clip 0.05 / 0.3): a norm counting a shard twice or missing one
would change the step.

Checkpoints: the ZeRO-3 TP2 x PP2 x DP2 run resumes under its own layout (optimizer state
restored: the curve goes on as the single run's), and ZeRO-3 at DP 8 starts from the
single-process checkpoint (weights into another layout and strategy: its first loss is that
of the single process loading the same weights alone). bf16 ZeRO-3 at DP 8 stays within 2e-2
of the fp32 curve (bf16 keeps 8 bits of mantissa: ~4e-3 per rounding, a few roundings per
layer; the MoE bf16 test allows the same); so does fp16 ZeRO-3 at TP2 x DP4 with the dynamic
loss scaler (11 bits of mantissa, finer still; fp16 gather and compute, fp32 reduction).

Gradients after reduction of a Llama model at TP2 x DP4 ZeRO-3 equal transformers' on the
whole batch, compared per DP shard of each TP shard. Bad combinations are one line from the
run layout, which needs no process group.
"""
import pytest
import torch

from megalite.config import parse_configs
from megalite.layout import RunLayout
from tests.helpers.gpt_run import make_dataset, tiny_args, train, train_with_grad_norms
from tests.helpers.multirank import run_on_ranks
from tests.helpers.reference import rel_err
from tests.test_moe_training import MOE_FLAGS

NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0", "--global-batch-size", "16",
              "--lr-warmup-iters", "0"]  # every step moves the weights
SGD = ["--optimizer", "sgd", "--lr", "0.5", "--lr-decay-style", "constant", "--clip-grad", "0"]
SGD_CLIPPED = SGD + ["--clip-grad", "0.3"]  # the grad norm: ~1.2
ADAM_CLIPPED = ["--clip-grad", "0.05"]
ZERO3 = ["--data-parallel-sharding-strategy", "optim_grads_params"]
ZERO2 = ["--data-parallel-sharding-strategy", "optim_grads"]
TP2_PP2 = ["--tp", "2", "--pp", "2"]
# name -> (reference curve, flags); all on 8 ranks, ITERS[reference curve] iterations
LAYOUTS = {
    "zero3 dp8 offload": ("adam", ZERO3 + ["--optimizer-cpu-offload"]),
    "zero3 tp2 dp4 sp": ("sgd clipped", ZERO3 + ["--tp", "2", "--sequence-parallel"]),
    "zero3 tp2 pp2 dp2 1f1b": ("sgd", ZERO3 + TP2_PP2),
    "zero3 tp2 pp2 vpp2 dp2 recompute": ("sgd", ZERO3 + TP2_PP2 + [
        "--vpp", "2", "--recompute-granularity", "full"]),
    "zero3 tp2 cp2 dp2 recompute": ("sgd clipped", ZERO3 + [
        "--tp", "2", "--cp", "2", "--recompute-granularity", "selective"]),
    "zero2 tp2 pp2 dp2": ("sgd", ZERO2 + TP2_PP2),
    "zero1 tp2 dp4 offload": ("adam", ["--use-distributed-optimizer", "--optimizer-cpu-offload",
                                       "--tp", "2"]),
    "moe zero3 tp2 dp4 ep2 sp": ("moe", ZERO3 + ["--tp", "2", "--ep", "2", "--sequence-parallel"]),
    "bf16 zero3 dp8": ("adam", ZERO3 + ["--bf16"]),
    "fp16 zero3 tp2 dp4": ("adam", ZERO3 + ["--fp16", "--initial-loss-scale", "4096",
                                            "--tp", "2"]),
}
REFERENCES = {"sgd": SGD, "sgd clipped": SGD_CLIPPED, "adam": ADAM_CLIPPED,
              "moe": SGD_CLIPPED + MOE_FLAGS}
# SGD keeps no state: its second loss shows the first update. Adam's third shows the moments.
ITERS = {"sgd": 2, "sgd clipped": 2, "adam": 3, "moe": 2}


def _llama_grad_errors(config, weights: dict, want: dict, tokens: torch.Tensor) -> dict:
    """TP2 x DP4 ZeRO-3 Llama (`config`, full megalite `weights`) on this DP rank's 2 of the 8
    sequences of `tokens` vs `want`, transformers' grads on all 8 (megalite names): relative
    error of each reduced grad shard, and the reference grads megalite has no parameter for
    ("missing"). The reference is computed by the caller: the ranks never import transformers."""
    from torch.distributed.tensor import distribute_tensor

    from megalite.device import current_device
    from megalite.distributed.finalize import finalize_model_grads
    from megalite.distributed.fsdp import shard_model
    from megalite.models import GPTModel
    from megalite.models.sharding import load_full_state_dict
    from megalite.mpu import initialize_model_parallel, model_parallel_seed
    from megalite.mpu import parallel_state as ps
    from megalite.mpu.layers import shard_tensor_parallel
    initialize_model_parallel(2, 1)
    model_parallel_seed(0, ps.get_tensor_model_parallel_rank())
    model = GPTModel(config, device=current_device())
    load_full_state_dict(model, weights)
    chunk = shard_model(model, "optim_grads_params", torch.float32)
    dp = ps.get_data_parallel_rank()
    mine = tokens[2 * dp:2 * dp + 2].to(current_device())
    chunk(mine[:, :-1], mine[:, 1:]).mean().backward()  # FSDP: the mean over DP of rank means
    finalize_model_grads([chunk])
    errors = {"missing": sorted(set(want) - {n for n, _ in chunk.module.named_parameters()})}
    for name, param in chunk.module.named_parameters():
        tp_local = shard_tensor_parallel(want[name], param).to(param.device)
        shard = distribute_tensor(tp_local, param.device_mesh, param.placements,
                                  src_data_rank=None).to_local()
        errors[name] = rel_err(param.main_grad, shard) if shard.abs().max() > 0 else \
            param.main_grad.abs().max().item()
    return errors


def test_llama_grads_at_tp2_dp4_zero3_equal_transformers_per_shard():
    """GQA (2 groups), untied head, vocabulary 203 padded: transformers' grads of the mean
    loss over 8 sequences, here, against the ranks' reduced shards."""
    from megalite.hf import llama_config
    from megalite.hf.llama import llama_to_megalite
    from tests.helpers.reference import hf_token_loss
    from tests.test_llama_hf_parity import SEQ, VOCAB, tiny_llama
    hf = tiny_llama(num_key_value_heads=2)
    config = llama_config(hf.config)
    tokens = torch.randint(0, VOCAB, (8, SEQ + 1), generator=torch.Generator().manual_seed(1))
    hf_token_loss(hf, tokens).backward()
    want = llama_to_megalite({n: p.grad for n, p in hf.named_parameters()}, config)
    results = run_on_ranks(8, _llama_grad_errors, config,
                           llama_to_megalite(hf.state_dict(), config), want, tokens)
    assert not any(errors.pop("missing") for errors in results), results
    worst = max(max(errors.values()) for errors in results)
    print("Llama TP2 x DP4 ZeRO-3 grads vs transformers, worst shard:", worst)
    assert worst < 1e-5, results


def _args(prefix: str, save: str, iters: int, *extra: str) -> list[str]:
    return tiny_args(prefix, save, iters, *NO_DROPOUT, *extra)


def _single_curves(prefix: str, root: str) -> dict:
    """The single-process curves: (losses, grad norms) of ITERS iterations of each reference,
    the SGD losses resumed to 3."""
    curves = {name: train_with_grad_norms(_args(prefix, f"{root}/single_{name}", ITERS[name],
                                                *flags))
              for name, flags in REFERENCES.items()}
    curves["sgd"][0].update(train(_args(prefix, f"{root}/single_sgd_3", 3, "--load",
                                        f"{root}/single_sgd", *SGD)))
    # a weights-only load (other optimizer settings): optimizer state and RNG start fresh
    curves["weights only"] = train(_args(prefix, f"{root}/single_weights", 3, "--load",
                                         f"{root}/single_sgd", *SGD, "--use-distributed-optimizer"))
    return curves


def _parallel_curves(prefix: str, root: str) -> dict:
    """Every layout's (losses, grad norms), then the checkpoint runs' losses (see the module
    docstring)."""
    curves = {name: train_with_grad_norms(_args(prefix, f"{root}/{name}", ITERS[ref],
                                                *REFERENCES[ref], *flags))
              for name, (ref, flags) in LAYOUTS.items()}
    resumed = f"{root}/zero3 tp2 pp2 dp2 1f1b"
    curves["resumed"] = train(_args(prefix, resumed, 3, "--load", resumed,
                                    *SGD, *ZERO3, *TP2_PP2))
    curves["from single"] = train(_args(prefix, f"{root}/from_single", 3, "--load",
                                        f"{root}/single_sgd", *SGD, *ZERO3))
    return curves


@pytest.fixture(scope="module")
def curves(tmp_path_factory) -> tuple[dict, dict]:
    """(single-process curves, 8-rank curves), one rank-pool task each."""
    root = str(tmp_path_factory.mktemp("fsdp"))
    prefix = make_dataset(root)
    single = run_on_ranks(1, _single_curves, prefix, root)[0]
    return single, run_on_ranks(8, _parallel_curves, prefix, root)[0]


def test_sharded_loss_curves_on_8_ranks_equal_single_process(curves):
    """The loss curve and the global grad-norm curve (before clipping) of every layout."""
    single, parallel = curves
    errors = {(name, kind): max(rel_err(torch.tensor(parallel[name][kind][it]),
                                        torch.tensor(single[ref][kind][it]))
                              for it in range(1, ITERS[ref] + 1))
              for name, (ref, _) in LAYOUTS.items() for kind in (0, 1)}
    print("relative error of each loss (0) and grad-norm (1) curve vs single process:", errors)
    for (name, kind), error in errors.items():
        assert error < (2e-2 if name.startswith(("bf16", "fp16")) else 1e-5), \
            (name, kind, single, parallel)
    resumed = parallel["resumed"]
    assert sorted(resumed) == [3], resumed
    assert max(rel_err(torch.tensor(v), torch.tensor(single["sgd"][0][it]))
               for it, v in resumed.items()) < 1e-5, (resumed, single["sgd"])
    assert sorted(parallel["from single"]) == [3]
    assert rel_err(torch.tensor(parallel["from single"][3]),
                   torch.tensor(single["weights only"][3])) < 1e-5, (parallel, single)


@pytest.mark.parametrize("flags,line", [
    (ZERO3 + ["--pp", "2", "--pipeline-schedule", "zb-h1"],
     "--data-parallel-sharding-strategy optim_grads_params cannot run the zb-h1 schedule"),
    (ZERO2 + ["--pp", "2", "--pipeline-schedule", "zbv"],
     "--data-parallel-sharding-strategy optim_grads cannot run the zbv schedule"),
    (["--optimizer-cpu-offload"], "--optimizer-cpu-offload needs a sharded"),
    (["--use-distributed-optimizer", "--data-parallel-sharding-strategy", "no_shard"],
     "--use-distributed-optimizer shards the optimizer state"),
])
def test_bad_sharding_combinations_are_one_line_from_the_run_layout(flags, line):
    """RunLayout needs no process group: the line comes before any collective."""
    configs = parse_configs(flags + ["--num-layers", "4", "--global-batch-size", "16"])
    with pytest.raises(ValueError) as error:
        RunLayout.from_configs(configs, 4)
    assert line in str(error.value) and "\n" not in str(error.value)
