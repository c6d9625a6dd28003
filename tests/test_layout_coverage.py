"""Layout combinations run end to end through pretrain_gpt's providers: the loss curve equals
the single-process run on the same global batch (fp32: 1e-5 relative), and exact resume
(bitwise, CPU fp32/fp16) with the distributed optimizer, VPP and fp16, plus a ZeRO
checkpoint resumed under other layouts."""
import pytest
import torch

from tests.helpers.gpt_run import make_dataset, tiny_args, train
from tests.helpers.multirank import run_on_ranks
from tests.helpers.reference import rel_err
from tests.test_training_resume import _straight_and_resumed

NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
# a loss scale from which the first steps already apply (2^32 would skip them all)
FP16 = ["--fp16", "--initial-loss-scale", "4096"]
ITERS = 3


@pytest.fixture(scope="module")
def prefix(tmp_path_factory) -> str:
    return make_dataset(str(tmp_path_factory.mktemp("data")))


@pytest.fixture(scope="module")
def single(prefix, tmp_path_factory) -> dict[str, dict[int, float]]:
    """Single-process loss curves per precision (the references)."""
    root = tmp_path_factory.mktemp("single")
    return {precision: run_on_ranks(1, train, tiny_args(prefix, f"{root}/{precision or 'fp32'}",
                                                        ITERS, *NO_DROPOUT, *flags))[0]
            for precision, flags in (("fp32", []), ("bf16", ["--bf16"]), ("fp16", ["--fp16"]))}


# PP x DP with VPP, ZeRO-1 and 1F1B at 4 and 8 ranks: the hops of test_checkpoint_reshard,
# each a loss curve against the single-process run
@pytest.mark.parametrize("world,layout,precision,tolerance", [
    (2, ["--pp", "2", "--pipeline-schedule", "gpipe"], "fp32", 1e-5),
    # bf16/fp16 messages between stages. The tied embedding's two grads are summed in
    # bf16/fp16 by autograd in one process but in fp32 over the two stages; Adam's first
    # steps (about lr x sign) amplify that rounding (measured up to 2e-4 at step 3)
    (2, ["--pp", "2", "--bf16"], "bf16", 1e-3),
    (2, ["--pp", "2", *FP16], "fp16", 1e-3),
])
def test_loss_curve_equals_single_process(prefix, single, tmp_path, world, layout, precision,
                                          tolerance):
    losses = run_on_ranks(world, train, tiny_args(prefix, str(tmp_path / "ck"), ITERS,
                                                  *NO_DROPOUT, *layout))[0]
    reference = single[precision]
    assert sorted(losses) == sorted(reference)
    for i, loss in losses.items():
        assert rel_err(torch.tensor(loss), torch.tensor(reference[i])) < tolerance, (
            i, loss, reference[i])
    assert losses[ITERS] < losses[1]


@pytest.mark.parametrize("world,layout", [
    (2, ["--dp", "2", "--use-distributed-optimizer"]),
    (2, ["--pp", "2", "--vpp", "2"]),
    (1, FP16),
])
def test_exact_resume(tmp_path, prefix, world, layout):
    (straight, valid), _, (second, second_valid) = run_on_ranks(
        world, _straight_and_resumed, prefix, str(tmp_path), layout)[0]
    assert sorted(second) == [4, 5, 6]
    assert [second[i] for i in (4, 5, 6)] == [straight[i] for i in (4, 5, 6)], (straight, second)
    assert second_valid == {4: valid[4], 6: valid[6]}, (valid, second_valid)


def _first_loss_after_load(prefix: str, root: str, name: str, layout: list[str]) -> float:
    """One more step from the ZeRO checkpoint: its loss is computed before any update."""
    return train(tiny_args(prefix, f"{root}/{name}", 4, "--load", f"{root}/zero", *layout,
                           *NO_DROPOUT))[4]


def test_zero_checkpoint_resumes_under_other_layouts(tmp_path, prefix):
    zero = ["--dp", "2", "--use-distributed-optimizer"]
    run_on_ranks(2, train, tiny_args(prefix, str(tmp_path / "zero"), 3, *zero, *NO_DROPOUT))
    same = run_on_ranks(2, _first_loss_after_load, prefix, str(tmp_path), "same", zero)[0]
    others = [run_on_ranks(1, _first_loss_after_load, prefix, str(tmp_path), "single", [])[0],
              run_on_ranks(4, _first_loss_after_load, prefix, str(tmp_path), "tp2",
                           ["--tp", "2", *zero])[0]]
    for loss in others:
        assert rel_err(torch.tensor(loss), torch.tensor(same)) < 1e-5, (loss, same)
