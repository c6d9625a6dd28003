"""finetune_bert.py on bad input: one line on stderr and exit status 2, before any process group."""
import os
import shutil

import pytest

from megalite.tasks import bert as finetune_bert
from tests.test_finetune_run import task_args, tiny_model_dir, write_task


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("bad_input"))
    tiny_model_dir(os.path.join(root, "model"))
    write_task(os.path.join(root, "train.jsonl"), 8, seed=1)
    write_task(os.path.join(root, "valid.jsonl"), 4, seed=2)
    write_task(os.path.join(root, "label3.jsonl"), 8, seed=1, label=3)
    os.makedirs(os.path.join(root, "no_weights"))
    for name in ("config.json", "vocab.txt"):
        shutil.copy(os.path.join(root, "model", name), os.path.join(root, "no_weights"))
    return root


CASES = {
    "label": (["--train-data", "{root}/label3.jsonl"],
              "{root}/label3.jsonl: row 8: label 3 is not an integer in [0, 2)"),
    "column": (["--columns", "mnli"],
               "{root}/train.jsonl: row 1 has no column 'premise' "
               "(columns: sentence1, sentence2, label)"),
    "weights": (["--pretrained", "{root}/no_weights"],
                "{root}/no_weights: no model weights (model.safetensors or pytorch_model.bin)"),
    "file": (["--valid-data", "{root}/missing.jsonl"], "{root}/missing.jsonl: no such file"),
    "labels": (["--num-labels", "3"], "{root}/model: its classifier has 2 labels, "
                                      "--num-labels is 3"),
    "context parallel": (["--cp", "2"], "--context-parallel-size: BERT batches carry padding "
                                        "masks, which ring attention does not take (use TP "
                                        "with --sequence-parallel)"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_exits_with_one_line(root, case, capsys):
    extra, message = CASES[case]
    with pytest.raises(SystemExit) as exit_info:
        finetune_bert.main(task_args(root, *(flag.format(root=root) for flag in extra)))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"error: {message.format(root=root)}\n"
