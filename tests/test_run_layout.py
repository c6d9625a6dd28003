"""Every rule of the run layout (megalite.layout) through the entry script: a bad combination
of flags ends `pretrain_gpt.py` with exit code 2 and one line naming the flag, before any
process group exists."""
import pytest
import torch.distributed as dist

from megalite.tasks import gpt as pretrain_gpt

MOE = ["--num-experts", "4", "--num-layers", "2"]
CASES = [  # (world size, flags, the line's expected start)
    (2, ["--ep", "0"], "--expert-model-parallel-size must be >= 1, got 0"),
    (2, ["--tp", "0"], "--tensor-model-parallel-size must be >= 1, got 0"),
    (2, ["--pp", "-1"], "--pipeline-model-parallel-size must be >= 1, got -1"),
    (2, ["--cp", "0"], "--context-parallel-size must be >= 1, got 0"),
    (2, ["--pp", "2", "--vpp", "0"], "--virtual-pipeline-model-parallel-size (0) needs"),
    (2, ["--vpp", "2"], "--virtual-pipeline-model-parallel-size (2) needs"),
    (4, ["--tp", "3"], "world size 4 is not divisible by tensor (3)"),
    (4, ["--tp", "2", "--dp", "0"], "--dp 0 does not match world size 4"),
    (4, ["--tp", "2", "--dp", "4"], "--dp 4 does not match world size 4"),
    (6, ["--ep", "4", *MOE], "--expert-model-parallel-size (4) must divide the data-parallel "
                             "size (6)"),
    (2, ["--ep", "2"], "--expert-model-parallel-size 2 needs --num-experts"),
    (3, ["--ep", "3", *MOE], "--num-experts (4) must be divisible by "
                             "--expert-model-parallel-size (3)"),
    (4, ["--tp", "2", "--ep", "2", *MOE], "--expert-model-parallel-size > 1 with "
                                          "--tensor-model-parallel-size > 1 needs "
                                          "--sequence-parallel"),
    (1, ["--sequence-parallel"], "--sequence-parallel needs --tensor-model-parallel-size > 1"),
    (2, ["--cp", "2", "--seq-length", "66", "--attention-dropout", "0"],
     "--seq-length (66) must be divisible by 2 x --context-parallel-size (4)"),
    (4, ["--tp", "4", "--sequence-parallel", "--seq-length", "66"],
     "--sequence-parallel: --seq-length (66) / --context-parallel-size (1) must be divisible"),
    (2, ["--cp", "2", "--attention-dropout", "0.1"], "--context-parallel-size 2 needs "
                                                     "--attention-dropout 0 (got 0.1)"),
    (2, ["--pp", "2", "--num-layers", "3"], "--num-layers (3) must be divisible by --pp x "
                                           "--vpp = 2"),
    (3, ["--tp", "3"], "--num-attention-heads (4) must be divisible by the tensor-parallel "
                       "size (3)"),
    (4, ["--tp", "4", "--num-attention-heads", "8", "--group-query-attention",
         "--num-query-groups", "2", "--hidden-size", "256"],
     None),  # 2 KV groups over TP 4: replicated, legal (the control case)
    (4, ["--tp", "4", "--num-attention-heads", "12", "--group-query-attention",
         "--num-query-groups", "3", "--hidden-size", "192"],
     "--num-query-groups (3) must be a multiple or a divisor of the tensor-parallel size (4)"),
    (2, ["--tp", "2", "--ffn-hidden-size", "101"], "--ffn-hidden-size (101) must be divisible "
                                                   "by --tp (2)"),
    (1, ["--seq-length", "256"], "--seq-length (256) exceeds --max-position-embeddings (128)"),
    (2, ["--global-batch-size", "6", "--micro-batch-size", "4"],
     "--global-batch-size (6) must be divisible by --micro-batch-size (4) x data-parallel "
     "size (2)"),
    (2, ["--pp", "2", "--vpp", "2", "--pipeline-schedule", "gpipe"],
     "--pipeline-schedule gpipe runs one model chunk per rank: drop --vpp (2)"),
    (2, ["--pp", "2", "--vpp", "4", "--num-layers", "8", "--pipeline-schedule", "zbv"],
     "--pipeline-schedule zbv runs 2 model chunks per rank, got --vpp 4"),
    (2, ["--pp", "2", "--vpp", "2", "--global-batch-size", "24"],
     "interleaved schedule: microbatches per step (3 = --global-batch-size"),
    (2, ["--pp", "2", "--pipeline-schedule", "zb-h1"],
     "--pipeline-schedule zb-h1: microbatches per step (1 = --global-batch-size"),
    (1, ["--lr-warmup-iters", "200"], "--lr-decay-iters (150, default --train-iters) must "
                                      "exceed --lr-warmup-iters (200)"),
    (1, ["--num-experts", "4", "--moe-router-topk", "5"],
     "--moe-router-topk (5) must be between 1 and --num-experts (4)"),
    (1, ["--group-query-attention", "--num-query-groups", "3"],
     "--num-attention-heads (4) must be a multiple of --num-query-groups (3)"),
]


@pytest.mark.parametrize("world,flags,expected", [c for c in CASES if c[2]],
                         ids=[" ".join(c[1]) for c in CASES if c[2]])
def test_bad_layout_exits_with_one_line_before_any_process_group(
        world, flags, expected, monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(SystemExit) as exit_:
        pretrain_gpt.main(flags)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {expected}"), err
    assert not dist.is_initialized()


def test_the_control_layout_passes():
    """The legal neighbour of the cases above (replicated KV groups) builds a layout."""
    from megalite.config import parse_configs
    from megalite.layout import RunLayout
    flags = next(c[1] for c in CASES if c[2] is None)
    layout = RunLayout.from_configs(parse_configs(flags), 4)
    assert (layout.grid.tp, layout.data_parallel_size, layout.num_microbatches) == (4, 1, 1)


@pytest.mark.parametrize("flags,world,line", [
    ([], 1, "world 1 = TP 1 x PP 1 x DP 1 | sharding no_shard"),
    (["--ep", "2", *MOE, "--use-distributed-optimizer"], 4,
     "world 4 = TP 1 x PP 1 x DP 4 (EP 2) | sharding optim"),
    (["--tp", "2", "--sequence-parallel", "--cp", "2", "--attention-dropout", "0", "--pp", "2",
      "--vpp", "2", "--global-batch-size", "16"], 8,
     "world 8 = TP 2 x CP 2 x PP 2 (VPP 2) x DP 1 | sharding no_shard | seq 128, 32 per rank"),
])
def test_the_start_line_names_every_axis_and_the_sharding(flags, world, line):
    from megalite.config import parse_configs
    from megalite.layout import RunLayout
    assert RunLayout.from_configs(parse_configs(flags + ["--seq-length", "128"]),
                                  world).describe() == line
