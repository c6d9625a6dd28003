"""Truthful start messages and checkpoints that do not fill the disk: a first run with --load
says it starts from scratch, a finished one that there is nothing left to do, and
--keep-latest-checkpoints N keeps the N newest iterations (a resume from them works)."""
import contextlib
import io
import os

import pytest

from megalite import checkpoint
from tests.helpers.gpt_run import make_dataset, tiny_args, train
from tests.helpers.multirank import run_on_ranks


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return make_dataset(str(tmp_path_factory.mktemp("data")))


def _runs(data: str, ck: str) -> list[tuple[str, list[int], list[int]]]:
    """Three pretrain_gpt runs on `ck` (5 steps, the same again, on to 7), keeping 2
    checkpoints: (log, iterations trained, iteration directories after it) of each."""
    results = []
    for iters in (5, 5, 7):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            losses = train(tiny_args(data, ck, iters, "--load", ck, "--save-interval", "1",
                                     "--keep-latest-checkpoints", "2"))
        results.append((out.getvalue(), sorted(losses), sorted(os.listdir(ck))))
    return results


def test_messages_and_kept_checkpoints(data, tmp_path):
    ck = str(tmp_path / "ck")
    first, again, longer = run_on_ranks(1, _runs, data, ck)[0]
    log, trained, files = first
    assert f"starting from scratch (no checkpoint in {ck} yet)" in log and "resumed" not in log
    assert trained == [1, 2, 3, 4, 5]
    assert [f for f in files if f.startswith("iter_")] == ["iter_0000004", "iter_0000005"]
    log, trained, files = again
    assert f"{ck} is at iteration 5, --train-iters is 5: nothing left to do" in log
    assert trained == [] and "saved checkpoint" not in log
    log, trained, files = longer
    assert f"resumed from {ck} at iteration 5" in log and trained == [6, 7]
    assert [f for f in files if f.startswith("iter_")] == ["iter_0000006", "iter_0000007"]
    assert checkpoint.latest_iteration(ck) == 7


def test_pruning_never_deletes_the_iteration_just_written(tmp_path):
    for i in (3, 8, 9):
        os.makedirs(checkpoint.iteration_dir(str(tmp_path), i))
    os.makedirs(checkpoint.iteration_dir(str(tmp_path), 2) + ".tmp")
    assert checkpoint.prune_checkpoints(str(tmp_path), 1, 3) == [8]
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002.tmp", "iter_0000003", "iter_0000009"]
