"""A Mixtral-shaped MoE model trained through pretrain_gpt's flags (8 experts, top-2, shared
expert, aux and z losses on): the loss curve at EP2 x PP2 x DP2 on 8 ranks (TP 2 for the
attention, experts split over EP and TP) equals the single-process run on the same global
batches (fp32, dropout off; summation order differs, so 1e-5 relative); also with the
zero-bubble zb-h1 schedule (expert weight grads deferred too), and with interleaving (VPP 2),
the distributed optimizer and full recompute. In bf16 at EP2 x PP2 x DP2 (4 ranks) the curve
stays within 2e-2 of the fp32 one (bf16 keeps 8 bits of mantissa: ~4e-3 per rounding).
The logged MoE statistics (router losses, dropped choices, imbalance) at TP2+SP x CP2 are the
global batch's: those of one process."""
import pytest
import torch

from megalite import device
from megalite.moe.stats import MoEState, reduce_step_stats
from megalite.mpu import parallel_state as ps
from tests.helpers.gpt_run import make_dataset, tiny_args, train, train_with_grad_norms
from tests.helpers.multirank import run_on_ranks
from tests.helpers.reference import rel_err

MOE_FLAGS = ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
             "--ffn-hidden-size", "48", "--disable-bias-linear", "--num-experts", "8",
             "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24", "--moe-router-topk-renorm",
             "--moe-shared-expert-intermediate-size", "16", "--moe-aux-loss-coeff", "0.01",
             "--moe-z-loss-coeff", "0.001", "--moe-layer-freq", "2",
             "--hidden-dropout", "0", "--attention-dropout", "0"]


@pytest.fixture(scope="module")
def single_moe_curve(tmp_path_factory) -> tuple[str, dict[int, float]]:
    """(the dataset prefix, the single-process MoE loss curve of 3 iterations): once for the
    three layouts."""
    root = tmp_path_factory.mktemp("moe_single")
    prefix = make_dataset(str(root))
    return prefix, run_on_ranks(1, train, tiny_args(prefix, f"{root}/single", 3, *MOE_FLAGS))[0]


@pytest.mark.parametrize("layout,tolerance", [
    (["--tp", "2", "--sequence-parallel", "--pp", "2", "--dp", "2", "--ep", "2",
      "--pipeline-schedule", "zb-h1"], 1e-5),
    (["--tp", "2", "--sequence-parallel", "--pp", "2", "--dp", "2", "--ep", "2", "--vpp", "2",
      "--use-distributed-optimizer", "--recompute-granularity", "full"], 1e-5),
    (["--pp", "2", "--dp", "2", "--ep", "2", "--bf16"], 2e-2)])
def test_moe_loss_curve_ep2_pp2_dp2_equals_single_process(single_moe_curve, tmp_path, layout,
                                                          tolerance):
    prefix, single = single_moe_curve
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


def _train_logging_moe_stats(argv: list[str]) -> list[dict[str, float]]:
    """Train, logging every step; the MoE stats each logged line carried on this rank."""
    from megalite.training import logger
    logged = []

    def recording(*args, **kwargs):
        logged.append(reduce_step_stats(*args, **kwargs))
        return logged[-1]
    logger.reduce_step_stats = recording
    try:
        train(argv)
    finally:
        logger.reduce_step_stats = reduce_step_stats
    return logged


def test_moe_stats_under_sequence_split_equal_single_process(tmp_path):
    """The logged load-balancing loss, z-loss, dropped choices (none: dropless) and expert
    imbalance of 4 MoE layers at TP2+SP x CP2 (each rank routes a quarter of every sequence)
    are the whole batch's, on every rank: those one process logs (one TP rank's were load
    balancing 4.0200, z 17.429, imbalance 1.375 where one process logs 4.0205, 17.433, 1.625)."""
    prefix = make_dataset(str(tmp_path))
    flags = [*MOE_FLAGS, "--moe-layer-freq", "1", "--log-interval", "1"]
    layout = ["--tp", "2", "--sequence-parallel", "--cp", "2"]
    single = run_on_ranks(1, _train_logging_moe_stats,
                          tiny_args(prefix, f"{tmp_path}/single", 2, *flags))[0]
    parallel = run_on_ranks(4, _train_logging_moe_stats,
                            tiny_args(prefix, f"{tmp_path}/parallel", 2, *flags, *layout))
    assert len(single) == 2, single
    for rank_stats in parallel:
        for want, got in zip(single, rank_stats, strict=True):
            assert sorted(got) == sorted(want)
            for name in want:
                assert rel_err(torch.tensor(got[name]), torch.tensor(want[name])) < 1e-5, \
                    (name, single, rank_stats)
    print("MoE stats single vs", *layout, single, parallel)


def _train_counting_router_losses(argv: list[str]) -> tuple[list[dict[str, float]], int]:
    """_train_logging_moe_stats, and how many times the MoE layers computed router losses."""
    from megalite.moe.layer import MoELayer
    calls, compute = [0], MoELayer._router_losses

    def counting(self, *args):
        calls[0] += 1
        return compute(self, *args)
    MoELayer._router_losses = counting
    try:
        return _train_logging_moe_stats(argv), calls[0]
    finally:
        MoELayer._router_losses = compute


def test_logged_only_router_losses_are_computed_in_logged_steps_only(tmp_path):
    """With the aux and z coefficients 0 the router losses are only logged: logging every
    second of 3 steps, the layers compute them in steps 2 and 3 (the last) only, and those
    lines carry what a run logging every step logs (the expert loads still count every step:
    the bias update reads them)."""
    prefix = make_dataset(str(tmp_path))
    flags = [*MOE_FLAGS, "--moe-aux-loss-coeff", "0", "--moe-z-loss-coeff", "0"]
    runs = [run_on_ranks(1, _train_counting_router_losses,
                         tiny_args(prefix, f"{tmp_path}/{n}", 3, *flags, "--log-interval",
                                   str(n)))[0] for n in (1, 2)]
    (every, every_calls), (sparse, sparse_calls) = runs
    assert len(every) == 3 and every_calls > 0 and sparse_calls * 3 == every_calls * 2
    assert sparse == every[1:], (every, sparse)


def _stats_of_two_sequence_shards() -> dict[str, float]:
    """TP2 under sequence parallelism: each rank routes half of the tokens of one microbatch
    through one layer of 2 experts; rank 0's 4 choices go 3 to expert 0 and 1 to expert 1,
    rank 1's the other way round; aux loss 1.0 / 1.2, z-loss 2 / 4, one dropped choice each."""
    ps.initialize_model_parallel(2)
    rank = ps.get_tensor_model_parallel_rank()
    state = MoEState()
    on = device.current_device()
    state.record(0, (torch.tensor(1.0 + 0.2 * rank, device=on),
                     torch.tensor(2.0 + 2 * rank, device=on)), torch.tensor(1, device=on),
                 torch.tensor([3, 1] if rank == 0 else [1, 3], device=on))
    return reduce_step_stats([state], 1, 2, 1, device.current_device(),
                             ps.get_pipeline_model_parallel_group(),
                             ps.get_data_parallel_group(with_context_parallel=True),
                             ps.get_tensor_model_parallel_group())


def test_moe_stats_of_sequence_shards_are_global():
    """Means of the shards' losses, totals of the dropped choices, and the imbalance of the
    total loads (4 and 4: 1.0), not of one shard's (3 and 1: 1.5), on both ranks."""
    want = {"load balancing loss": 1.1, "z loss": 3.0, "dropped tokens": 2.0,
            "expert imbalance": 1.0}
    for got in run_on_ranks(2, _stats_of_two_sequence_shards):
        assert got == pytest.approx(want, rel=1e-6), got
