"""Bad input gives one clear line before any collective: out-of-vocabulary token ids, empty
datasets and splits, zero or negative sizes, tokenizer problems; a run trained with
--tokenizer resumes without repeating --vocab-size; an unusable apex falls back to torch."""
import sys
import types

import numpy as np
import pytest
import torch

from megalite.tasks import gpt as pretrain_gpt
from megalite.config import parse_configs
from megalite.data.indexed_dataset import IndexedDatasetBuilder
from megalite.optimizer.kinds import apex_fused_adam
from megalite.optimizer.optimizer import load_portable_state_dict, portable_state_dict
from megalite.layout import RunLayout
from megalite.training.checks import check_before_start
from tests.helpers.gpt_run import VOCAB, make_dataset, make_sp_model, tiny_args, train
from tests.helpers.multirank import run_on_ranks


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return make_dataset(str(tmp_path_factory.mktemp("data")))


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> str:
    return make_sp_model(str(tmp_path_factory.mktemp("sp")))


def _one_line(error) -> str:
    assert "\n" not in str(error.value)
    return str(error.value)


def test_token_ids_beyond_the_vocabulary(data):
    configs = parse_configs(tiny_args(data, "unused", 2, "--vocab-size", "50"))
    with pytest.raises(ValueError) as error:
        check_before_start(configs, RunLayout.from_configs(configs, 1))
    assert _one_line(error).startswith(f"{data}.bin: token id 96 >= vocabulary size 50")


@pytest.mark.parametrize("documents,split,expected", [
    (0, "969,30,1", "the dataset is empty"),
    (20, "0,1,0", "--split 0,1,0: the train split of"),
])
def test_empty_dataset_or_train_split(tmp_path, documents, split, expected):
    prefix = str(tmp_path / "d")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(documents):
        builder.add_item(np.arange(10))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    configs = parse_configs(tiny_args(prefix, "unused", 2, "--split", split))
    with pytest.raises(ValueError) as error:
        check_before_start(configs, RunLayout.from_configs(configs, 1))
    assert expected in _one_line(error)


@pytest.mark.parametrize("flag,value,expected", [
    ("--micro-batch-size", "0", "--micro-batch-size (0) must be >= 1"),
    ("--num-attention-heads", "0", "--num-attention-heads (0) must be >= 1"),
    ("--log-interval", "0", "--log-interval (0) must be >= 1"),
    ("--hidden-size", "-8", "--hidden-size (-8) must be >= 1"),
    ("--seq-length", "0", "--seq-length (0) must be >= 1"),
    ("--distributed-timeout-minutes", "0", "--distributed-timeout-minutes (0.0) must be > 0.0"),
    ("--max-skipped-steps", "0", "--max-skipped-steps (0) must be >= 1"),
])
def test_zero_or_negative_sizes(data, capsys, flag, value, expected):
    with pytest.raises(SystemExit) as stop:
        parse_configs(tiny_args(data, "unused", 2, flag, value))
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip() == f"error: {expected}"


def test_missing_tokenizer_file(data, tmp_path):
    configs = parse_configs(tiny_args(data, "unused", 2, "--tokenizer", str(tmp_path / "no.model")))
    with pytest.raises(FileNotFoundError) as error:
        pretrain_gpt.check_inputs(configs)
    assert _one_line(error).startswith(f"--tokenizer {tmp_path / 'no.model'}: no such file")


def test_unreadable_tokenizer_file(data, tmp_path):
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a sentencepiece model")
    configs = parse_configs(tiny_args(data, "unused", 2, "--tokenizer", str(bad)))
    with pytest.raises(ValueError) as error:
        pretrain_gpt.check_inputs(configs)
    assert _one_line(error).startswith(f"--tokenizer {bad}: cannot be read as a tokenizer")


def test_vocab_size_that_disagrees_with_the_tokenizer(data, sp_model):
    configs = parse_configs(tiny_args(data, "unused", 2, "--tokenizer", sp_model))
    assert configs.model.vocab_size == VOCAB  # tiny_args passes --vocab-size 97
    with pytest.raises(ValueError) as error:
        pretrain_gpt.check_inputs(configs)
    assert _one_line(error) == (f"--vocab-size 97 disagrees with --tokenizer {sp_model} "
                                f"(300 tokens); drop --vocab-size")


def _without_vocab_size(argv: list[str]) -> list[str]:
    at = argv.index("--vocab-size")
    return argv[:at] + argv[at + 2:]


def _tokenizer_runs(data: str, sp_model: str, root: str) -> tuple[dict, dict, dict]:
    """Train with --tokenizer, resume with --tokenizer only, and with neither flag."""
    argv = _without_vocab_size(tiny_args(data, f"{root}/ck", 2, "--tokenizer", sp_model))
    first = train(argv)
    again = train(_without_vocab_size(tiny_args(data, f"{root}/ck", 3, "--tokenizer", sp_model,
                                                "--load", f"{root}/ck")))
    bare = train(_without_vocab_size(tiny_args(data, f"{root}/bare", 4, "--load",
                                               f"{root}/ck")))
    return first, again, bare


def test_resume_with_tokenizer_needs_no_vocab_size(data, sp_model, tmp_path):
    first, again, bare = run_on_ranks(1, _tokenizer_runs, data, sp_model, str(tmp_path))[0]
    assert sorted(first) == [1, 2] and sorted(again) == [3] and sorted(bare) == [4]


class _ApexStyleAdam(torch.optim.Optimizer):
    """apex FusedAdam's state layout: `step` per param group, exp_avg / exp_avg_sq per param."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 adam_w_mode=True) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      bias_correction=True))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            b1, b2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                state["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                m = state["exp_avg"] / (1 - b1 ** group["step"])
                v = state["exp_avg_sq"] / (1 - b2 ** group["step"])
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.addcdiv_(m, v.sqrt().add_(group["eps"]), value=-group["lr"])


def test_unusable_apex_falls_back_with_a_warning_and_state_moves_between_the_two(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("apex was installed without --cuda_ext")
    fake = types.ModuleType("apex")
    fake.optimizers = types.SimpleNamespace(FusedAdam=broken)
    monkeypatch.setitem(sys.modules, "apex", fake)
    monkeypatch.setitem(sys.modules, "apex.optimizers", fake.optimizers)
    param = torch.nn.Parameter(torch.ones(3))
    with pytest.warns(UserWarning, match="falling back to torch's fused AdamW"):
        assert apex_fused_adam([{"params": [param]}], {"lr": 1e-3}) is None

    def trained(optimizer_cls, steps: int) -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
        p = torch.nn.Parameter(torch.arange(4.0))
        opt = optimizer_cls([p], lr=0.1, weight_decay=0.01)
        for _ in range(steps):
            p.grad = torch.sin(p.detach()) + 0.5
            opt.step()
        return p, opt
    # apex-style state after 2 steps, loaded into torch AdamW, then a third step: equal to
    # three AdamW steps (and back again)
    reference, _ = trained(torch.optim.AdamW, 3)
    for source, target in ((_ApexStyleAdam, torch.optim.AdamW), (torch.optim.AdamW,
                                                                  _ApexStyleAdam)):
        p, opt = trained(source, 2)
        moved = target([p], lr=0.1, weight_decay=0.01)
        load_portable_state_dict(moved, portable_state_dict(opt))
        p.grad = torch.sin(p.detach()) + 0.5
        moved.step()
        assert torch.allclose(p, reference, rtol=1e-6, atol=1e-7), (source, p, reference)
