"""A Mixtral-shaped MoE model trained through pretrain_gpt's flags (8 experts, top-2, shared
expert, aux and z losses on): the loss curve at EP2 x PP2 x DP2 on 8 ranks (TP 2 for the
attention, experts split over EP and TP) equals the single-process run on the same global
batches (fp32, dropout off; summation order differs, so 1e-5 relative); also with the
zero-bubble zb-h1 schedule (expert weight grads deferred too), and with interleaving (VPP 2),
the distributed optimizer and full recompute. In bf16 at EP2 x PP2 x DP2 (4 ranks) the curve
stays within 2e-2 of the fp32 one (bf16 keeps 8 bits of mantissa: ~4e-3 per rounding)."""
import pytest
import torch

from tests.helpers.gpt_run import make_dataset, tiny_args, train, train_with_grad_norms
from tests.helpers.multirank import run_on_ranks
from tests.helpers.reference import rel_err

MOE_FLAGS = ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
             "--ffn-hidden-size", "48", "--disable-bias-linear", "--num-experts", "8",
             "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24", "--moe-router-topk-renorm",
             "--moe-shared-expert-intermediate-size", "16", "--moe-aux-loss-coeff", "0.01",
             "--moe-z-loss-coeff", "0.001", "--moe-layer-freq", "2",
             "--hidden-dropout", "0", "--attention-dropout", "0"]


@pytest.mark.parametrize("layout,tolerance", [
    (["--tp", "2", "--sequence-parallel", "--pp", "2", "--dp", "2", "--ep", "2",
      "--pipeline-schedule", "zb-h1"], 1e-5),
    (["--tp", "2", "--sequence-parallel", "--pp", "2", "--dp", "2", "--ep", "2", "--vpp", "2",
      "--use-distributed-optimizer", "--recompute-granularity", "full"], 1e-5),
    (["--pp", "2", "--dp", "2", "--ep", "2", "--bf16"], 2e-2)])
def test_moe_loss_curve_ep2_pp2_dp2_equals_single_process(tmp_path, layout, tolerance):
    prefix = make_dataset(str(tmp_path))
    single = run_on_ranks(1, train, tiny_args(prefix, f"{tmp_path}/single", 3, *MOE_FLAGS))[0]
    world = 8 if "--tp" in layout else 4
    parallel = run_on_ranks(world, train, tiny_args(prefix, f"{tmp_path}/parallel", 3,
                                                    *MOE_FLAGS, *layout))[0]
    assert sorted(single) == sorted(parallel) == [1, 2, 3]
    for it in single:
        assert rel_err(torch.tensor(parallel[it]), torch.tensor(single[it])) < tolerance, \
            (single, parallel)
    print("MoE loss curve single vs", " ".join(layout), single, parallel)


DEEPSEEK_FLAGS = ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
                  "--ffn-hidden-size", "48", "--disable-bias-linear", "--num-experts", "8",
                  "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16",
                  "--moe-shared-expert-intermediate-size", "16", "--moe-layer-freq",
                  "[0]*2+[1]*2", "--moe-router-score-function", "sigmoid",
                  "--moe-router-topk-renorm", "--moe-router-topk-scaling-factor", "2.5",
                  "--moe-router-num-groups", "4", "--moe-router-group-topk", "2",
                  "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.05",
                  "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff",
                  "0.01", "--moe-grouped-gemm", "--hidden-dropout", "0",
                  "--attention-dropout", "0"]


# steps proportional to the gradients (Adam's barely depend on their scale): a wrong expert
# reduction moves the curve
SGD = ["--optimizer", "sgd", "--lr", "0.5", "--lr-decay-style", "constant", "--clip-grad", "0",
       "--lr-warmup-iters", "0"]


def test_deepseek_moe_loss_curve_cp2_ep2_equals_single_process(tmp_path):
    """DeepSeek-V3 routing (first 2 of 4 layers dense, sigmoid group-limited top-2, scaling,
    expert bias moved by 0.05 a step, so later steps route differently, sequence-wise aux
    loss, grouped experts) at CP2 x DP2 x EP2 and at DP4 x EP4 ZeRO-3 (4 ranks): the loss and
    global gradient-norm curves of one process. The norms catch a wrong expert reduction that
    barely moves the loss (experts' grads 1/4 too small at DP4 x EP4 ZeRO-3 change the third
    loss by 3e-6 but the first norm by 1e-3)."""
    prefix = make_dataset(str(tmp_path))
    flags = [*DEEPSEEK_FLAGS, *SGD]
    single = run_on_ranks(1, train_with_grad_norms,
                          tiny_args(prefix, f"{tmp_path}/single", 3, *flags))[0]
    for n, layout in enumerate((["--cp", "2", "--ep", "2"],
                   # ZeRO-3 with one expert-DP rank: each expert's FSDP mesh has one rank
                   ["--ep", "4", "--data-parallel-sharding-strategy", "optim_grads_params"])):
        parallel = run_on_ranks(4, train_with_grad_norms,
                                tiny_args(prefix, f"{tmp_path}/parallel{n}", 3, *flags,
                                          *layout))[0]
        for want, got in zip(single, parallel):
            assert sorted(want) == sorted(got) == [1, 2, 3]
            for it in want:
                assert rel_err(torch.tensor(got[it]), torch.tensor(want[it])) < 1e-5, \
                    (layout, single, parallel)
        print("DeepSeek MoE loss and grad-norm curves single vs", *layout, single, parallel)
