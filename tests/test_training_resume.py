"""Exact resume of pretrain_gpt runs (fp32, dropout on), and the same batches whether or not
worker processes build them (resharding: tests/test_checkpoint_reshard.py)."""
import pytest

from tests.helpers.gpt_run import make_dataset, tiny_args, train
from tests.helpers.multirank import run_on_ranks


def _straight_and_resumed(prefix: str, root: str, layout: list[str]) -> tuple[dict, dict, dict]:
    straight = train(tiny_args(prefix, f"{root}/straight", 6, *layout))
    first = train(tiny_args(prefix, f"{root}/resumed", 6, "--exit-interval", "3", *layout))
    second = train(tiny_args(prefix, f"{root}/resumed", 6, "--load", f"{root}/resumed", *layout))
    return straight, first, second


@pytest.mark.parametrize("world,layout", [(1, []), (8, ["--tp", "2", "--pp", "2", "--dp", "2"])])
def test_exact_resume_is_bitwise_identical(tmp_path, world, layout):
    prefix = make_dataset(str(tmp_path))
    straight, first, second = run_on_ranks(world, _straight_and_resumed, prefix, str(tmp_path),
                                           layout)[0]
    assert sorted(second) == [4, 5, 6]
    assert [first[i] for i in (1, 2, 3)] == [straight[i] for i in (1, 2, 3)]
    assert [second[i] for i in (4, 5, 6)] == [straight[i] for i in (4, 5, 6)], (straight, second)
    assert straight[6] < straight[1]


def _with_and_without_workers(prefix: str, root: str) -> tuple[dict, dict]:
    return tuple(train(tiny_args(prefix, f"{root}/workers{n}", 3, "--pp", "2", "--num-workers",
                                 str(n))) for n in (0, 2))


def test_worker_processes_feed_the_same_batches_in_the_same_order(tmp_path):
    """PP 2: the first stage reads the inputs, the last the labels, each from its loader."""
    prefix = make_dataset(str(tmp_path))
    without, with_workers = run_on_ranks(2, _with_and_without_workers, prefix, str(tmp_path))[0]
    assert with_workers == without and sorted(without) == [1, 2, 3]
