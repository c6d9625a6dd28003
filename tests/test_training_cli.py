"""pretrain_gpt.py and the tools from the command line: bad input gives one clear line and a
non-zero exit without touching existing checkpoints; an interrupted save never wins. The
script itself runs once (a missing data path); the other bad inputs go through its main() in
a rank, which is all the script calls (a process start costs ~3 s)."""
import contextlib
import io
import os
import subprocess
import sys

import pytest

from megalite import checkpoint
from megalite.config import Configs, parse_configs
from megalite.layout import RunLayout
from tests.helpers.gpt_run import make_dataset, tiny_args, train
from tests.helpers.multirank import run_on_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _main(argv: list[str]) -> tuple[int, str]:
    """pretrain_gpt.py's main(argv) in this rank: (exit status, what it wrote to stderr)."""
    from megalite.tasks import gpt as pretrain_gpt
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            pretrain_gpt.main(argv)
            code = 0
        except SystemExit as exit_:
            code = exit_.code
    return code, stderr.getvalue()


def run_main(*argv: str) -> subprocess.CompletedProcess:
    """`run_script("pretrain_gpt.py", *argv)` in a rank of the 1-rank pool."""
    code, stderr = run_on_ranks(1, _main, list(argv))[0]
    return subprocess.CompletedProcess(["pretrain_gpt.py", *argv], code, "", stderr)


def error_line(result: subprocess.CompletedProcess) -> str:
    """The run must fail with exactly one line on stderr."""
    assert result.returncode != 0, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return make_dataset(str(tmp_path_factory.mktemp("data")))


def test_missing_data_path(tmp_path, data):
    line = error_line(run_script("pretrain_gpt.py", *tiny_args(str(tmp_path / "nope"),
                                                               str(tmp_path / "ck"), 2)))
    assert "nope.idx" in line and "no such file" in line
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("damage,expected", [
    (lambda b: b"NOTMAGIC!" + b[9:], "magic"),
    (lambda b: b[:len(b) // 2], "truncated"),
])
def test_corrupt_idx(tmp_path, data, damage, expected):
    prefix = str(tmp_path / "bad")
    for ext in (".bin", ".idx"):
        blob = open(data + ext, "rb").read()
        open(prefix + ext, "wb").write(damage(blob) if ext == ".idx" else blob)
    line = error_line(run_main(*tiny_args(prefix, str(tmp_path / "ck"), 2)))
    assert "bad.idx" in line and expected in line.lower()


def _configs(data: str, *argv: str) -> Configs:
    return parse_configs(tiny_args(data, "unused", 4, *argv))


@pytest.mark.parametrize("argv,world,flag", [
    (["--global-batch-size", "6", "--micro-batch-size", "2"], 2, "--global-batch-size"),
    (["--pp", "2", "--vpp", "3"], 2, "--num-layers"),
    (["--pp", "3"], 3, "--num-layers"),
    (["--tp", "3"], 4, "world size 4 is not divisible"),
    (["--dp", "4", "--tp", "2"], 4, "--dp 4 does not match"),
    (["--pp", "2", "--vpp", "2", "--global-batch-size", "6", "--micro-batch-size", "2"], 2,
     "multiple of --pp"),
    (["--lr-warmup-iters", "10"], 1, "--lr-decay-iters"),
    (["--pp", "4", "--global-batch-size", "4", "--pipeline-schedule", "zb-h1"], 4,
     "must be >= --pp"),
    (["--pp", "2", "--vpp", "2", "--pipeline-schedule", "zb-h1"], 2, "drop --vpp"),
    (["--pp", "2", "--vpp", "4", "--num-layers", "8", "--pipeline-schedule", "zbv"], 2,
     "2 model chunks per rank"),
])
def test_invalid_layouts_are_rejected_before_any_collective(data, argv, world, flag):
    with pytest.raises(ValueError, match=flag) as error:
        RunLayout.from_configs(_configs(data, *argv), world)
    assert "\n" not in str(error.value)


def test_global_batch_error_from_the_command_line(tmp_path, data):
    line = error_line(run_main(*tiny_args(data, str(tmp_path / "ck"), 2,
                                          "--global-batch-size", "7")))
    assert line.startswith("error: --global-batch-size (7)")


def test_load_with_other_hidden_size_keeps_checkpoint(tmp_path, data):
    ck = str(tmp_path / "ck")
    run_on_ranks(1, train, tiny_args(data, ck, 2))
    before = {f: os.path.getmtime(os.path.join(dp, f)) for dp, _, fs in os.walk(ck) for f in fs}
    line = error_line(run_main(*tiny_args(data, ck, 4, "--load", ck, "--hidden-size", "64")))
    assert "hidden_size=32" in line and "--hidden-size 64" in line
    after = {f: os.path.getmtime(os.path.join(dp, f)) for dp, _, fs in os.walk(ck) for f in fs}
    assert before == after


def _interrupted_save(data: str, root: str) -> tuple[int, float, float]:
    """Save at iteration 2, crash while writing iteration 4, then resume from 2."""
    ck = f"{root}/ck"
    train(tiny_args(data, ck, 4, "--exit-interval", "2"))
    real_save, calls = checkpoint.saving.save_state, []

    def failing_save(path, tree):  # the rank's state, written after its model file
        calls.append(path)
        raise OSError("disk full (simulated)")
    checkpoint.saving.save_state = failing_save
    try:
        train(tiny_args(data, ck, 4, "--load", ck))
    except OSError:
        pass
    finally:
        checkpoint.saving.save_state = real_save
    resumed = train(tiny_args(data, f"{root}/again", 3, "--load", ck))
    return checkpoint.latest_iteration(ck), min(resumed), len(calls)


def test_interrupted_save_leaves_previous_checkpoint_loadable(tmp_path, data):
    latest, first_resumed_iteration, calls = run_on_ranks(1, _interrupted_save, data,
                                                          str(tmp_path))[0]
    assert calls == 1
    assert latest == 2 and first_resumed_iteration == 3
    assert (tmp_path / "ck" / "iter_0000004.tmp").exists()  # the partial write, never published
