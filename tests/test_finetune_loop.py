"""finetune_bert.py through the training loop of pretraining: SIGTERM, --exit-interval and
--save-interval, and a resumed run that continues the uninterrupted one's loss curve,
accuracies, best epoch and export (tiny random BERT, PP 2 x DP 2, fp32, dropout on).
Its parser offers only the flags it honours."""
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from megalite.tasks import bert as finetune_bert
from megalite.tasks import gpt as pretrain_gpt
from megalite import checkpoint
from tests.helpers.multirank import run_on_ranks
from tests.test_finetune_run import task_args, write_task_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUT = ["--pp", "2", "--dp", "2"]
STEPS = 8  # per epoch: 64 examples / global batch 8


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> str:
    return write_task_dir(str(tmp_path_factory.mktemp("finetune_loop")))


def _finetune(argv: list[str], fault: str = "") -> dict:
    """finetune_bert on this rank, with MEGALITE_FAULT=fault."""
    os.environ["MEGALITE_FAULT"] = fault
    try:
        result = finetune_bert.finetune(finetune_bert.parse(argv))
    finally:
        del os.environ["MEGALITE_FAULT"]
    return {"losses": result.losses, "counts": result.counts, "best_epoch": result.best_epoch}


def _straight_and_interrupted(root: str, out: str) -> tuple[dict, ...]:
    """An uninterrupted run; the same run stopped by SIGTERM during step 5, resumed and
    stopped by --exit-interval 20 (after the best epoch, 2), then resumed to the end."""
    straight = _finetune(task_args(root, *LAYOUT, "--save", f"{out}/straight",
                                   "--export-dir", f"{out}/straight_hf"))
    ck = f"{out}/resumed"
    argv = task_args(root, *LAYOUT, "--save", ck, "--save-interval", "3", "--export-dir",
                     f"{out}/resumed_hf")
    first = _finetune(argv, fault="sigterm@5:3")
    second = _finetune([*argv, "--load", ck, "--exit-interval", "20"])
    third = _finetune([*argv, "--load", ck])
    return straight, first, second, third


@pytest.fixture(scope="module")
def runs(task_dir, tmp_path_factory) -> tuple[str, tuple[dict, ...]]:
    out = str(tmp_path_factory.mktemp("runs"))
    return out, run_on_ranks(4, _straight_and_interrupted, task_dir, out)[0]


def test_resumed_run_continues_the_same_loss_curve(runs):
    _, (straight, first, second, third) = runs
    assert sorted(straight["losses"]) == list(range(1, 3 * STEPS + 1))
    assert sorted(first["losses"]) == [1, 2, 3, 4, 5]
    assert sorted(second["losses"]) == list(range(6, 21))
    assert sorted(third["losses"]) == list(range(21, 25))
    resumed = {**first["losses"], **second["losses"], **third["losses"]}
    worst = max(abs(resumed[i] - loss) / abs(loss) for i, loss in straight["losses"].items())
    assert worst < 1e-6, (worst, straight["losses"], resumed)
    assert straight["best_epoch"] == 2  # so the best epoch's weights come back from disk
    assert third["counts"] == straight["counts"] and third["best_epoch"] == 2


def test_resumed_run_saves_and_exports_the_best_epoch(runs):
    out, _ = runs
    ck = f"{out}/resumed"
    saved = sorted(int(d.removeprefix("iter_")) for d in os.listdir(ck) if d.startswith("iter_"))
    # SIGTERM at 5, every 3rd step, the best epoch (16; epoch 1's 8 was superseded),
    # --exit-interval 20, the end (24); the best is what --load picks when the run ends
    assert saved == [3, 5, 6, 9, 12, 15, 16, 18, 20, 21, 24]
    assert checkpoint.latest_iteration(ck) == 2 * STEPS
    assert checkpoint.read_meta(ck)["task"]["best_epoch"] == 2
    want = load_file(f"{out}/straight_hf/model.safetensors")
    got = load_file(f"{out}/resumed_hf/model.safetensors")
    assert want.keys() == got.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_resume_with_other_batches_is_one_line(runs, task_dir, capsys):
    out, _ = runs
    with pytest.raises(SystemExit) as exit_info:
        finetune_bert.main(task_args(task_dir, "--global-batch-size", "4", "--load",
                                     f"{out}/resumed"))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        f"error: --load {out}/resumed: saved by a run of 64 training / 21 held-out examples "
        f"and 8 steps per epoch, this run has 64 / 21 and 16: resume with the same data and "
        f"batch, or pass another --save\n")


def test_sigterm_saves_and_exits_0(tmp_path, task_dir):
    ck = str(tmp_path / "ck")
    job = subprocess.run([sys.executable, "finetune_bert.py", *task_args(task_dir, "--save", ck)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "MEGALITE_FAULT": "sigterm@3"})
    assert job.returncode == 0, job.stderr[-2000:]
    assert "exiting at iteration 3: received SIGTERM" in job.stdout
    assert checkpoint.latest_iteration(ck) == 3


@pytest.mark.parametrize("flag", [["--data-path", "x"], ["--tokenizer", "t"], ["--split", "1,1,0"],
                                  ["--data-cache-dir", "c"], ["--hidden-size", "64"],
                                  ["--num-layers", "2"], ["--train-iters", "5"],
                                  ["--eval-interval", "5"], ["--eval-iters", "2"], ["--ep", "2"]])
def test_flags_finetuning_ignores_are_refused(flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        finetune_bert.parse(flag)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        f"error: unrecognized arguments: {' '.join(flag)}")


def test_each_script_offers_its_own_flags(capsys):
    configs = finetune_bert.parse(["--recompute-granularity", "full", "--tp", "2",
                                   "--exit-interval", "4", "--save-interval", "2"])
    assert (configs.model.recompute_granularity, configs.parallel.tensor_model_parallel_size,
            configs.train.exit_interval, configs.checkpoint.save_interval) == ("full", 2, 4, 2)
    with pytest.raises(SystemExit):
        finetune_bert.parse(["--help"])
    groups = [line for line in capsys.readouterr().out.splitlines() if line.endswith("Config:")]
    assert groups == ["ModelConfig:", "ParallelConfig:", "PrecisionConfig:", "OptimizerConfig:",
                      "TrainConfig:", "CheckpointConfig:", "FinetuneConfig:"]
    with pytest.raises(SystemExit) as exit_info:
        pretrain_gpt.main(["--epochs", "2"])
    assert exit_info.value.code == 2
