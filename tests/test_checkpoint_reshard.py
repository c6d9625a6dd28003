"""Distributed checkpoints reshard weights and optimizer state: a run stopped after every step
and resumed each time under another layout and data-parallel sharding (no_shard, ZeRO-1,
ZeRO-2, ZeRO-3, CPU offload) continues the loss curve of the uninterrupted single-process
run (fp32, dropout off; the layouts differ in summation order only, so 1e-5 relative). Adam's
moments and step must come along: a resume that restarts them updates the weights differently,
and the next hop's loss is off by 1e-4 (measured by disabling their load)."""
import json
import os

import torch

from tests.helpers.gpt_run import make_dataset, tiny_args, train
from tests.helpers.multirank import run_on_ranks
from tests.helpers.reference import rel_err
from tests.test_moe_training import MOE_FLAGS

NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
CHAIN_FLAGS = [*NO_DROPOUT, "--micro-batch-size", "1"]  # global batch 8 splits over DP 8
ZERO1 = "--use-distributed-optimizer"
ZERO2, ZERO3 = (["--data-parallel-sharding-strategy", s] for s in ("optim_grads",
                                                                   "optim_grads_params"))
ITERS = 8  # the whole curve; every hop runs 1 step (--exit-interval 1)
# (layout, extra flags) of each hop; the saves of some hops run in the background
CHAIN_8 = [["--tp", "2", "--pp", "2", "--vpp", "2", "--dp", "2", ZERO1, "--async-save"],
           ["--pp", "4", "--dp", "2"],                       # 1F1B, no_shard
           ["--dp", "8", *ZERO3, "--async-save"],
           ["--tp", "2", "--pp", "2", "--dp", "2"],          # no_shard
           ["--tp", "2", "--pp", "2", "--dp", "2", ZERO1]]
CHAIN_4 = [["--dp", "4", *ZERO3, "--optimizer-cpu-offload"], ["--cp", "2", "--dp", "2", *ZERO2],
           ["--tp", "4"]]


def _hops(prefix: str, root: str, chain: list[list[str]], first: int, flags: list[str],
          iters: int = ITERS) -> dict[int, float]:
    """Run each hop of `chain` for one step, resuming from the previous hop's checkpoint
    (the first from `root`/hop<first - 1> when `first` > 0); the losses of every step."""
    losses = {}
    for n, layout in enumerate(chain, start=first):
        load = ["--load", f"{root}/hop{n - 1}"] if n else []
        losses.update(train(tiny_args(prefix, f"{root}/hop{n}", iters, "--exit-interval", "1",
                                      *load, *flags, *layout)))
    return losses


# DeepSeek-V3's expert bias (a checkpointed buffer) on; EP2 saves grouped (stacked) experts,
# EP4 (ZeRO-3, expert-DP 1) loads them as looped ones. These two-hop runs take one step, then
# two after the resume: the second shows the restored Adam moments.
MOE = [*MOE_FLAGS, "--moe-router-enable-expert-bias"]


def _moe_ep2_to_ep4(prefix: str, root: str) -> dict[int, float]:
    flags = [*MOE, "--dp", "4"]
    losses = train(tiny_args(prefix, f"{root}/ep2", 3, "--exit-interval", "1", "--ep", "2",
                             ZERO1, "--moe-grouped-gemm", *flags))
    losses.update(train(tiny_args(prefix, f"{root}/ep4", 3, "--load", f"{root}/ep2", "--ep",
                                  "4", *ZERO3, *flags)))  # ZeRO-3 experts on 1-rank meshes
    return losses


def _bf16_pp2_dp2_to_dp4(prefix: str, root: str) -> dict[int, float]:
    flags = ["--bf16", *NO_DROPOUT]
    losses = train(tiny_args(prefix, f"{root}/bf16a", 3, "--exit-interval", "1", "--pp", "2",
                             "--dp", "2", ZERO1, *flags))
    losses.update(train(tiny_args(prefix, f"{root}/bf16b", 3, "--load", f"{root}/bf16a",
                                  "--dp", "4", *ZERO3, *flags)))  # fp32 masters as the params
    return losses


def _four_rank_hops(prefix: str, root: str) -> tuple[dict, dict, dict]:
    return (_hops(prefix, root, CHAIN_4, len(CHAIN_8), CHAIN_FLAGS),
            _moe_ep2_to_ep4(prefix, root), _bf16_pp2_dp2_to_dp4(prefix, root))


def _single(prefix: str, root: str) -> tuple[dict, dict, dict]:
    return (train(tiny_args(prefix, f"{root}/single", ITERS, *CHAIN_FLAGS)),
            train(tiny_args(prefix, f"{root}/single_moe", 3, *MOE)),
            train(tiny_args(prefix, f"{root}/single_bf16", 3, "--bf16", *NO_DROPOUT)))


def _assert_curve(got: dict, want: dict, tolerance: float) -> None:
    assert sorted(got) == sorted(want), (got, want)
    errors = {i: rel_err(torch.tensor(got[i]), torch.tensor(want[i])) for i in want}
    assert max(errors.values()) < tolerance, (errors, got, want)
    print("resume errors", {i: f"{e:.1e}" for i, e in errors.items()})


def test_resumes_into_other_layouts_and_shardings_continue_the_single_process_curve(tmp_path):
    prefix, root = make_dataset(str(tmp_path)), str(tmp_path)
    single, single_moe, single_bf16 = run_on_ranks(1, _single, prefix, root)[0]
    eight = run_on_ranks(8, _hops, prefix, root, CHAIN_8, 0, CHAIN_FLAGS)[0]
    four, moe, bf16 = run_on_ranks(4, _four_rank_hops, prefix, root)[0]
    _assert_curve({**eight, **four}, single, 1e-5)
    _assert_curve(moe, single_moe, 1e-5)
    moe_index = json.load(open(os.path.join(root, "ep2", "iter_0000001", "index.json")))
    assert "encoder.layers.0.mlp.router.expert_bias" in moe_index["model"]
    # bf16 rounds every weight update to 8 mantissa bits, differently under another
    # summation order: the curves agree to about one bf16 ulp of the loss (2^-8)
    _assert_curve(bf16, single_bf16, 2 ** -8)
    index = json.load(open(os.path.join(root, "hop2", "iter_0000003", "index.json")))
    # DP 8 ZeRO-3: the 8 ranks wrote disjoint parts of the weights and the Adam moments
    assert len({p[0] for e in index["optim.exp_avg"].values() for p in e["pieces"]}) == 8
    assert {s["step"] for s in index["scalars"].values()} == {3.0}


def test_slices_of_tp_shards_are_the_global_tensors_elements():
    """checkpoint.slices against the TP split itself (mpu.layers._split_shards): every flat
    range of every rank's shard (strided SwiGLU blocks, GQA replicas, vocabulary padding) maps
    to global boxes holding exactly its values, and the ranks' boxes tile the global tensor."""
    from torch import nn

    from megalite.checkpoint.slices import (box_slices, flat_boxes, global_shape, to_global,
                                            writes_param)
    from megalite.mpu.layers import _split_shards, set_tensor_model_parallel_attributes
    cases = [((16, 6), 0, 2, 1, None), ((5, 8), 1, 1, 1, None), ((12, 3), 0, 1, 2, None),
             ((7, 3), 0, 1, 1, 8)]  # (global shape, dim, stride, replicas, padded rows)
    tp = 4
    for shape, dim, stride, replicas, padded in cases:
        full = torch.arange(torch.Size(shape).numel()).reshape(shape)
        source = torch.cat([full, full.new_zeros(padded - shape[0], shape[1])]) if padded \
            else full
        covered = torch.zeros(shape, dtype=torch.long)
        for rank in range(tp):
            local = _split_shards(source, dim, stride, tp // replicas)[rank // replicas]
            param = nn.Parameter(local.float())
            set_tensor_model_parallel_attributes(param, True, dim, stride, replicas)
            if padded:
                param.unpadded_rows = shape[0]
            assert global_shape(param, tp) == shape
            n = local.numel()
            for start, end in [(0, n), (1, n - 1), (n // 3, n // 2 + 1)]:
                for a, b, box in flat_boxes(tuple(local.shape), start, end):
                    values = local.reshape(-1)[a:b].view(box[1])
                    for (lo, ln), glob in to_global(param, box, rank, tp):
                        sub = tuple(slice(o - p, o - p + m) for o, p, m in zip(lo, box[0], ln))
                        assert torch.equal(values[sub], full[box_slices(glob)])
                        if (start, end) == (0, n) and writes_param(param, rank, tp):
                            covered[box_slices(glob)] += 1
        assert bool((covered == 1).all()), (shape, covered)
