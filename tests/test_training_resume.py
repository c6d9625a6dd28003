"""Exact resume of pretrain_gpt runs (fp32, dropout on), and the same batches whether or not
worker processes build them (resharding: tests/test_checkpoint_reshard.py)."""
import pytest

from tests.helpers.gpt_run import make_dataset, tiny_args, train
from tests.helpers.multirank import run_on_ranks


def _straight_and_resumed(prefix: str, root: str, layout: list[str]) -> list[tuple[dict, dict]]:
    """(losses, validation losses) of a straight 6-step run, validating every 2 steps, and of
    the same run stopped after step 3 and resumed."""
    from megalite.tasks import gpt as pretrain_gpt
    flags = ["--eval-interval", "2", "--eval-iters", "1", *layout]
    results = [pretrain_gpt.run(tiny_args(prefix, f"{root}/{name}", 6, *extra, *flags))
               for name, extra in (("straight", []), ("resumed", ["--exit-interval", "3"]),
                                   ("resumed", ["--load", f"{root}/resumed"]))]
    return [(result.losses, result.validation_losses) for result in results]


@pytest.mark.parametrize("world,layout", [(1, []), (8, ["--tp", "2", "--pp", "2", "--dp", "2"])])
def test_exact_resume_is_bitwise_identical(tmp_path, world, layout):
    """The losses, and the validation losses (the resumed part's validations read the valid
    samples after those of the first part's, as the straight run's do)."""
    prefix = make_dataset(str(tmp_path))
    (straight, valid), (first, first_valid), (second, second_valid) = run_on_ranks(
        world, _straight_and_resumed, prefix, str(tmp_path), layout)[0]
    assert sorted(second) == [4, 5, 6]
    assert [first[i] for i in (1, 2, 3)] == [straight[i] for i in (1, 2, 3)]
    assert [second[i] for i in (4, 5, 6)] == [straight[i] for i in (4, 5, 6)], (straight, second)
    assert straight[6] < straight[1]
    assert sorted(valid) == [2, 4, 6] and first_valid == {2: valid[2]}
    assert second_valid == {4: valid[4], 6: valid[6]}, (valid, second_valid)


def _with_and_without_workers(prefix: str, root: str) -> tuple[dict, dict]:
    return tuple(train(tiny_args(prefix, f"{root}/workers{n}", 3, "--pp", "2", "--num-workers",
                                 str(n))) for n in (0, 2))


def test_worker_processes_feed_the_same_batches_in_the_same_order(tmp_path):
    """PP 2: the first stage reads the inputs, the last the labels, each from its loader."""
    prefix = make_dataset(str(tmp_path))
    without, with_workers = run_on_ranks(2, _with_and_without_workers, prefix, str(tmp_path))[0]
    assert with_workers == without and sorted(without) == [1, 2, 3]
