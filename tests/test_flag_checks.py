"""No silent wrong numbers from flags: --min-lr defaults to 0 and never exceeds --lr, every
float flag is finite, Adam's betas and eps are in range, and a --split with no train share is
refused before any work (also on the built-in corpus) -- one line naming the flag each."""
import contextlib
import dataclasses
import io
import re
import typing

import pytest

from megalite.config import TASK_SECTIONS, Configs, OptimizerConfig, parse_configs
from megalite.tasks import gpt as pretrain_gpt
from tests.helpers.gpt_run import make_dataset, tiny_args, train
from tests.helpers.multirank import run_on_ranks


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return make_dataset(str(tmp_path_factory.mktemp("data")))


def _float_flags() -> list[str]:
    """Every float field of every shared config section and of finetuning's, as its flag."""
    flags = []
    shared = [next((a for a in typing.get_args(f.type) if dataclasses.is_dataclass(a)), f.type)
              for f in dataclasses.fields(Configs)]
    for cls in shared + [TASK_SECTIONS["finetune"]]:
        if not dataclasses.is_dataclass(cls):
            continue
        hints = typing.get_type_hints(cls)
        flags += ["--" + f.name.replace("_", "-") for f in dataclasses.fields(cls)
                  if float in (hints[f.name], *typing.get_args(hints[f.name]))]
    return flags


def _refusal(capsys, argv: list[str]) -> str:
    """The one error line parse_configs exits with (code 2)."""
    with pytest.raises(SystemExit) as stop:
        parse_configs(argv, optional=("finetune",))
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def _logged_lrs(argv: list[str]) -> list[float]:
    """The learning rate of every log line of a pretrain_gpt run (log interval 1)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train(argv)
    return [float(m) for m in re.findall(r"\| lr (\S+) \|", out.getvalue())]


def test_min_lr_defaults_to_zero():
    assert OptimizerConfig().min_lr == 0.0
    assert parse_configs([], defaults=pretrain_gpt.DEFAULTS).optimizer.min_lr == 0.0


def test_a_low_lr_run_never_logs_a_higher_lr(data, tmp_path):
    lrs = run_on_ranks(1, _logged_lrs, tiny_args(data, str(tmp_path / "ck"), 6, "--lr", "1e-5",
                                                 "--log-interval", "1"))[0]
    assert len(lrs) == 6 and max(lrs) <= 1e-5 and lrs[-1] < lrs[0], lrs


@pytest.mark.parametrize("flag", _float_flags())
def test_non_finite_float_flags_are_refused(capsys, flag):
    for value in ("nan", "inf", "-inf"):
        assert _refusal(capsys, [f"{flag}={value}"]) == \
            f"error: {flag} ({float(value)}) must be a finite number"


@pytest.mark.parametrize("argv,expected", [
    (["--adam-beta1", "1.5"], "--adam-beta1 (1.5) must be < 1.0"),
    (["--adam-beta2", "1"], "--adam-beta2 (1.0) must be < 1.0"),
    (["--adam-beta1", "-0.1"], "--adam-beta1 (-0.1) must be >= 0.0"),
    (["--adam-eps", "0"], "--adam-eps (0.0) must be > 0.0"),
    (["--sgd-momentum", "-1"], "--sgd-momentum (-1.0) must be >= 0.0"),
    (["--lr", "1e-5", "--min-lr", "1e-4"], "--min-lr (0.0001) must be <= --lr (1e-05)"),
])
def test_out_of_range_optimizer_flags_are_refused(capsys, argv, expected):
    assert _refusal(capsys, argv).startswith(f"error: {expected}")


def test_split_without_train_share_on_the_builtin_corpus_is_one_line(data, tmp_path, capsys):
    argv = tiny_args(data, str(tmp_path / "ck"), 2, "--split", "0,0,100")
    del argv[argv.index("--data-path"):argv.index("--data-path") + 2]  # the built-in corpus
    with pytest.raises(SystemExit) as stop:
        pretrain_gpt.main(argv)
    assert stop.value.code == 2
    assert capsys.readouterr().err == ("error: --split 0,0,100: the train ratio is 0, so there "
                                       "is nothing to train on (give the train split a share, "
                                       "e.g. 969,30,1)\n")
    assert not (tmp_path / "ck").exists()
