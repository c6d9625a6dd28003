"""`pretrain_gpt.py --load DIR` takes the model from the checkpoint (Megatron's
--use-checkpoint-args): no model flag needed, a model flag that disagrees is one line naming
every difference, floats compare at float32 precision; a checkpoint trained with --tokenizer
carries it, and resuming with --load alone tokenises the built-in corpus with it."""
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from megalite.tasks import gpt as pretrain_gpt
from megalite import checkpoint
from megalite.checkpoint.metadata import RESUMABLE_MODEL_FIELDS
from megalite.config import ModelConfig
from megalite.data import builtin_corpus as bc
from megalite.data.tokenizers import build_tokenizer, tokenizer_fingerprint
from megalite.layout import RunLayout
from megalite.training.checks import check_before_start
from tests.helpers.gpt_run import make_dataset, make_sp_model, tiny_args, train
from tests.helpers.multirank import run_on_ranks
from tests.test_data_builtin import small_documents

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EPS32 = float(np.float32(1e-5))  # 9.999999747378752e-06, as GGUF and transformers store 1e-5
SAVED = ModelConfig(num_layers=2, hidden_size=48, num_attention_heads=6, vocab_size=97,
                    max_position_embeddings=64, normalization="RMSNorm", norm_epsilon=EPS32,
                    position_embedding_type="rope", rotary_base=100000.0, swiglu=True,
                    group_query_attention=True, num_query_groups=2, disable_bias_linear=True,
                    untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
                    attention_dropout=0.0)


@pytest.fixture(scope="module")
def llama_ck(tmp_path_factory) -> tuple[str, str]:
    """(data prefix, weights-only checkpoint of a small Llama-shaped model)."""
    directory = tmp_path_factory.mktemp("args")
    checkpoint.write_weights_checkpoint(str(directory / "ck"), {}, SAVED)
    return make_dataset(str(directory)), str(directory / "ck")


def _configs(data: str, ck: str, *flags: str):
    configs = pretrain_gpt.parse_args(["--load", ck, "--data-path", data, "--seq-length", "16",
                                       *flags])
    pretrain_gpt.check_inputs(configs)
    return configs


def _defining(config: ModelConfig) -> dict:
    return {k: v for k, v in dataclasses.asdict(config).items()
            if k not in RESUMABLE_MODEL_FIELDS}


def test_load_alone_takes_the_model_from_the_checkpoint(llama_ck):
    data, ck = llama_ck
    configs = _configs(data, ck)
    assert _defining(configs.model) == _defining(SAVED)
    assert configs.checkpoint.save is None  # --load alone writes no checkpoint (Megatron's way)
    check_before_start(configs, RunLayout.from_configs(configs, 1))


def test_model_flags_that_disagree_are_one_line_naming_each(llama_ck):
    data, ck = llama_ck
    with pytest.raises(ValueError) as error:
        _configs(data, ck, "--num-layers", "3", "--hidden-size", "64", "--swiglu",
                 "--position-embedding-type", "learned_absolute", "--norm-epsilon", "1e-6")
    assert str(error.value) == (
        f"--load {ck}: checkpoint has num_layers=2, this run has --num-layers 3; checkpoint has "
        f"hidden_size=48, this run has --hidden-size 64; checkpoint has norm_epsilon={EPS32}, "
        f"this run has --norm-epsilon 1e-06; checkpoint has position_embedding_type=rope, this "
        f"run has --position-embedding-type learned_absolute (drop these flags: the model comes "
        f"from the checkpoint)")


def test_flags_that_agree_are_accepted_floats_at_float32(llama_ck):
    data, ck = llama_ck
    configs = _configs(data, ck, "--norm-epsilon", "1e-5", "--rotary-base", "1e5",
                       "--num-layers", "2", "--normalization", "RMSNorm", "--hidden-dropout", "0.1")
    assert configs.model.norm_epsilon == EPS32 and configs.model.hidden_dropout == 0.1
    meta = checkpoint.read_meta(ck)
    checkpoint.check_compatible(meta, dataclasses.replace(configs.model, norm_epsilon=1e-5),
                                   ck, torch.float32)


def test_every_difference_and_the_precision_in_one_line(tmp_path):
    root = str(tmp_path / "ck")
    checkpoint.write_weights_checkpoint(root, {}, SAVED)
    meta = {**checkpoint.read_meta(root), "params_dtype": "float32"}
    ours = dataclasses.replace(SAVED, num_layers=4, swiglu=False, ffn_hidden_size=None)
    with pytest.raises(ValueError) as error:
        checkpoint.check_compatible(meta, ours, root, torch.bfloat16)
    line = str(error.value)
    assert "\n" not in line and line.count("checkpoint has") == 3  # layers, ffn size, swiglu
    assert "num_layers=2" in line and "--swiglu False" in line
    assert "trained with float32 parameters, this run uses bfloat16" in line


def _train_with_tokenizer(data: str, sp: str, ck: str) -> dict:
    argv = tiny_args(data, ck, 2, "--tokenizer", sp)
    at = argv.index("--vocab-size")
    return train(argv[:at] + argv[at + 2:])


def test_checkpoint_trained_with_tokenizer_resumes_without_it(tmp_path, monkeypatch):
    """Trained with --tokenizer on a dataset; resumed by `pretrain_gpt.py --load CK --save
    OUT` (no model flag, no --tokenizer, no --data-path): the built-in corpus, tokenised again
    with the checkpoint's tokenizer, continues the model, and OUT carries the tokenizer."""
    sp, data, cache = make_sp_model(str(tmp_path)), make_dataset(str(tmp_path)), tmp_path / "c"
    monkeypatch.setattr(bc, "builtin_documents", lambda workers: small_documents())
    monkeypatch.setattr(bc, "VOCAB_SIZE", 320)  # the corpus's own tokenizer: not `sp`
    monkeypatch.setenv("MEGALITE_CACHE", str(cache))
    bc.builtin_corpus()
    ck, out = str(tmp_path / "ck"), str(tmp_path / "out")
    run_on_ranks(1, _train_with_tokenizer, data, sp, ck)
    meta = checkpoint.read_meta(ck)
    assert meta["tokenizer"] == "tokenizer/tokenizer.model"
    with open(sp, "rb") as f, open(checkpoint.checkpoint_tokenizer(ck, meta), "rb") as g:
        assert f.read() == g.read()

    result = subprocess.run(
        [sys.executable, "pretrain_gpt.py", "--load", ck, "--save", out, "--seq-length", "16",
         "--micro-batch-size", "2", "--exit-interval", "3"], cwd=ROOT, capture_output=True,
        text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    assert f"resumed from {ck} at iteration 2" in result.stdout
    resumed = checkpoint.read_meta(out)
    assert resumed["iteration"] == 3
    assert _defining(ModelConfig(**resumed["model_config"])) == \
        _defining(ModelConfig(**meta["model_config"]))
    key = tokenizer_fingerprint(build_tokenizer(sp))
    assert tokenizer_fingerprint(build_tokenizer(checkpoint.checkpoint_tokenizer(
        out, resumed))) == key
    with open(cache / f"builtin-{key[:16]}" / "DONE") as f:
        assert json.load(f)["vocab_size"] == 300
