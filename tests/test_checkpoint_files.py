"""Checkpoint files: no pickle, safetensors slices and a JSON index other tools read,
verification of what a load needs (truncated or missing shards: one line on every rank,
before any collective), full metadata checks,
re-saves that never lose the old copy, and the --save directory guard."""
import contextlib
import io
import json
import os
import pathlib
import shutil

import pytest
import torch
from safetensors import safe_open

from megalite import checkpoint
from megalite.checkpoint import files as checkpoint_io
from megalite.config import parse_configs
from megalite.layout import RunLayout
from megalite.training.checks import check_before_start
from tests.helpers.gpt_run import VOCAB, make_dataset, tiny_args, train
from tests.helpers.multirank import run_on_ranks

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, str]:
    """(data prefix, checkpoint of 2 steps at TP 2 on 2 ranks)."""
    directory = tmp_path_factory.mktemp("ck")
    prefix = make_dataset(str(directory))
    run_on_ranks(2, train, tiny_args(prefix, str(directory / "ck"), 2, "--tp", "2"))
    return prefix, str(directory / "ck")


def test_no_pickle_anywhere_in_the_code():
    sources = [p for d in ("megalite", "tools", "benchmarks") for p in (ROOT / d).rglob("*.py")]
    sources += [ROOT / "pretrain_gpt.py", ROOT / "finetune_bert.py"]
    offenders = [str(p) for p in sources
                 if "weights_only=False" in p.read_text() or "torch.save(" in p.read_text()]
    assert not offenders


def test_files_are_json_and_safetensors_readable_by_other_tools(saved):
    _, ck = saved
    directory = checkpoint.iteration_dir(ck, 2)
    assert sorted(os.listdir(directory)) == [
        "index.json", "meta.json", "rank_00000.json", "rank_00000.safetensors",
        "rank_00001.json", "rank_00001.safetensors", "shard_00000.json",
        "shard_00000.safetensors", "shard_00001.json", "shard_00001.safetensors"]
    meta = json.load(open(os.path.join(directory, "meta.json")))
    assert meta["model_config"]["vocab_size"] == VOCAB and meta["params_dtype"] == "float32"
    assert meta["optimizer"] == {"optimizer": "adam", "use_distributed_optimizer": False}
    assert meta["layout"] == {"tp": 2, "pp": 1, "dp": 1, "vpp": None}
    index = json.load(open(os.path.join(directory, "index.json")))
    # global shapes: the unpadded vocabulary (all of it in TP rank 0's half of the padded
    # 256 rows), the TP-gathered MLP (4h x h at hidden 32) with each TP rank's half in its own
    # file, readable by slice with safetensors alone
    for name, shape, files in [("embedding.word_embeddings.weight", [VOCAB, 32], 1),
                               ("encoder.layers.0.mlp.dense_h_to_4h.weight", [128, 32], 2)]:
        entry = index["model"][name]
        assert entry["shape"] == shape and entry["dtype"] == "float32"
        assert sorted(p[0] for p in entry["pieces"]) == [
            f"shard_{r:05d}.safetensors" for r in range(files)]
        assert sum(p[3][0] for p in entry["pieces"]) == shape[0]
        for file, key, offsets, lengths in entry["pieces"]:
            with safe_open(os.path.join(directory, file), "pt") as f:
                assert list(f.get_slice(key)[:].shape) == lengths


def test_state_tree_round_trip(tmp_path):
    import random

    import numpy as np
    tree = {"python": random.getstate(), "numpy": np.random.get_state(),
            "opt": {0: {"step": torch.tensor(3.0), "m": torch.ones(2, 3)}}, "none": None}
    checkpoint_io.save_state(str(tmp_path / "s"), tree)
    back = checkpoint_io.load_state(str(tmp_path / "s"))
    assert back["python"] == tree["python"] and back["none"] is None
    assert back["numpy"][0] == "MT19937" and (back["numpy"][1] == tree["numpy"][1]).all()
    assert back["numpy"][1].dtype == tree["numpy"][1].dtype
    assert torch.equal(back["opt"][0]["m"], tree["opt"][0]["m"])


def _load_and_report(prefix: str, ck: str, out: str) -> str:
    """Resume `ck` at TP 2; the error line this rank prints (exit code appended)."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            train(tiny_args(prefix, out, 3, "--tp", "2", "--load", ck))
        except SystemExit as stop:
            return stderr.getvalue().strip() + f" [exit {stop.code}]"
    return "no error"


@pytest.mark.parametrize("damage,expected", [
    ("truncate_shard0", "shard_00000.safetensors: truncated"),
    ("delete_shard1", "shard_00001.safetensors: missing"),
])
def test_damaged_shard_is_one_line_naming_the_file_on_every_rank(saved, tmp_path, damage,
                                                                 expected):
    prefix, original = saved
    ck = str(tmp_path / "ck")
    shutil.copytree(original, ck)
    directory = checkpoint.iteration_dir(ck, 2)
    if damage == "truncate_shard0":
        path = os.path.join(directory, "shard_00000.safetensors")
        os.truncate(path, os.path.getsize(path) // 2)
    else:
        os.remove(os.path.join(directory, "shard_00001.safetensors"))
    lines = run_on_ranks(2, _load_and_report, prefix, ck, str(tmp_path / "out"))
    assert lines[0] == lines[1], lines
    assert lines[0].startswith("error: ") and expected in lines[0] and "\n" not in lines[0]
    assert lines[0].endswith("[exit 2]")


def test_resave_of_an_iteration_keeps_the_old_copy_until_the_new_one_is_in_place(tmp_path,
                                                                              monkeypatch):
    root = str(tmp_path)
    for text in ("old", "new"):
        tmp = checkpoint.iteration_dir(root, 5) + ".tmp"
        os.makedirs(tmp)
        open(os.path.join(tmp, "payload"), "w").write(text)
        if text == "new":  # crash between moving the old copy aside and moving the new in
            real_rename = os.rename
            monkeypatch.setattr(os, "rename", lambda a, b: real_rename(a, b) if a.endswith(
                "0000005") else (_ for _ in ()).throw(OSError("crash (simulated)")))
            with pytest.raises(OSError):
                checkpoint.dirs.publish(root, 5, tmp)
            monkeypatch.undo()
        else:
            checkpoint.dirs.publish(root, 5, tmp)
    assert checkpoint.latest_iteration(root) == 5
    published = checkpoint.dirs.published_dir(root, 5)
    assert open(os.path.join(published, "payload")).read() == "old"


def test_save_into_a_directory_with_a_newer_iteration_is_refused(saved, tmp_path):
    prefix, ck = saved
    configs = parse_configs(tiny_args(prefix, ck, 4))
    with pytest.raises(ValueError, match=f"--save {ck} already holds iteration 2, newer than "
                                         f"this run's start \\(0\\)") as error:
        check_before_start(configs, RunLayout.from_configs(configs, 1))
    assert "\n" not in str(error.value)
    resume = parse_configs(tiny_args(prefix, ck, 4, "--load", ck, "--tp", "2"))
    check_before_start(resume, RunLayout.from_configs(resume, 2))  # resuming it is fine


@pytest.mark.parametrize("argv,expected", [
    (["--activation", "gelu"], "checkpoint has activation=gelu_tanh, this run has --activation gelu"),
    (["--layernorm-epsilon", "1e-6"], "norm_epsilon=1e-05"),
    (["--no-causal"], "causal=True"),
    (["--post-layernorm"], "post_layernorm=False"),
    (["--bf16"], "trained with float32 parameters, this run uses bfloat16"),
])
def test_every_model_field_and_the_precision_are_checked_on_load(saved, argv, expected):
    prefix, ck = saved
    configs = parse_configs(tiny_args(prefix, "unused", 4, "--load", ck, "--tp", "2", *argv))
    with pytest.raises(ValueError, match="--load") as error:
        check_before_start(configs, RunLayout.from_configs(configs, 2))
    assert expected in str(error.value) and "\n" not in str(error.value)


def _train_and_print(argv: list[str]) -> tuple[dict, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        losses = train(argv)
    return losses, out.getvalue()


def test_another_optimizer_loads_weights_only(saved, tmp_path):
    """Adam's state means nothing to SGD: the weights load (at another layout too, TP 2 ->
    DP 2), the optimizer starts fresh, and rank 0 says so in one line."""
    prefix, ck = saved
    losses, out = run_on_ranks(2, _train_and_print, tiny_args(
        prefix, str(tmp_path / "z"), 3, "--load", ck, "--optimizer", "sgd"))[0]
    assert sorted(losses) == [3]
    assert "loaded weights only (checkpoint optimizer {'optimizer': 'adam'" in out


def test_a_format_2_checkpoint_still_loads_its_weights(saved, tmp_path):
    """megalite's previous format (full TP-gathered tensors per pipeline stage, no index)
    reads back as the same full weights as the sharded checkpoint it is made from."""
    _, ck = saved
    meta, full = checkpoint.read_full_model(ck)
    old = checkpoint.iteration_dir(str(tmp_path / "old"), 2)
    os.makedirs(old)
    half = len(full) // 2  # stage files hold disjoint names; split them over two "stages"
    for stage, names in enumerate((list(full)[:half], list(full)[half:])):
        checkpoint_io.write_tensors(checkpoint.legacy.model_file(old, stage),
                                    {n: full[n] for n in names})
    checkpoint_io.write_json(os.path.join(old, "meta.json"), {
        **meta, "format": 2, "layout": {"tp": 1, "pp": 2, "dp": 1, "vpp": None}})
    checkpoint.mark_latest(str(tmp_path / "old"), 2)
    _, back = checkpoint.read_full_model(str(tmp_path / "old"))
    assert sorted(back) == sorted(full)
    assert all(torch.equal(back[n], full[n]) for n in full)
