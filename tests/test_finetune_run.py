"""finetune_bert.py end to end on a tiny random BERT and a tiny JSONL task, in the rank pool.

The task: label 1 when the first sentence is made of colour words, 0 for animal words (the
second sentence is noise); a quarter of the evaluation labels are flipped, so accuracy stays
well inside (0, 1). Checks: the loss falls; the accuracy reported for the best epoch
equals an independent count of the exported transformers model's predictions on the
evaluation file; the export gives the logits of the saved megalite checkpoint.
"""
import json
import os
import random

import pytest
import torch

from megalite.tasks import bert as finetune_bert
from megalite import checkpoint
from megalite.config import ModelConfig, parse_configs
from megalite.models.bert import BertModel
from megalite.models.sharding import load_full_state_dict
from tests.helpers.multirank import run_on_ranks
from tests.helpers.reference import rel_err

COLOURS, ANIMALS = ["red", "green", "blue", "yellow"], ["cat", "dog", "bird", "fish"]
NOISE = ["the", "a", "is", "on", "under", "big", "small"]
SEQ = 16


def tiny_model_dir(directory: str) -> str:
    """A random BertForSequenceClassification (2 labels) and its WordPiece vocabulary."""
    from transformers import BertConfig, BertForSequenceClassification
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *COLOURS, *ANIMALS, *NOISE]
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64, max_position_embeddings=32,
                        num_labels=2)
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(directory)
    with open(os.path.join(directory, "vocab.txt"), "w") as f:
        f.write("\n".join(vocab) + "\n")
    return directory


def write_task(path: str, n: int, seed: int, flip: float = 0.0, label=None) -> str:
    """n JSONL rows {sentence1, sentence2, label}, a `flip` fraction of labels wrong;
    `label` replaces the last row's label."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        words = COLOURS if i % 2 else ANIMALS
        rows.append({"sentence1": " ".join(rng.choices(words, k=rng.randint(2, 4))),
                     "sentence2": " ".join(rng.choices(NOISE, k=rng.randint(2, 5))),
                     "label": i % 2 if rng.random() >= flip else 1 - i % 2})
    if label is not None:
        rows[-1]["label"] = label
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return path


def task_args(root: str, *extra: str) -> list[str]:
    """Flags of a 3-epoch run: 64 training examples, 21 held out (not a whole batch)."""
    return ["--pretrained", os.path.join(root, "model"), "--train-data",
            os.path.join(root, "train.jsonl"), "--valid-data", os.path.join(root, "valid.jsonl"),
            "--seq-length", str(SEQ), "--micro-batch-size", "2", "--global-batch-size", "8",
            "--epochs", "3", "--lr", "5e-3", "--log-interval", "4", *extra]


def write_task_dir(root: str) -> str:
    """`root` with a tiny BERT (model/) and a 64-example training / 21-example held-out task."""
    tiny_model_dir(os.path.join(root, "model"))
    write_task(os.path.join(root, "train.jsonl"), 64, seed=1)
    write_task(os.path.join(root, "valid.jsonl"), 21, seed=2, flip=0.25)
    return root


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> str:
    return write_task_dir(str(tmp_path_factory.mktemp("finetune")))


def _finetune(argv: list[str]) -> dict:
    result = finetune_bert.finetune(parse_configs(argv, defaults=finetune_bert.DEFAULTS,
                                                  optional=("finetune",)))
    return {"losses": result.losses, "counts": result.counts, "best_epoch": result.best_epoch}


def _hf_predictions(export: str, valid: str, pairs: bool
                    ) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """(logits, encoded batch, labels) of the exported model on the evaluation file."""
    from transformers import AutoModelForSequenceClassification, BertTokenizerFast
    rows = [json.loads(line) for line in open(valid)]
    tokenizer = BertTokenizerFast.from_pretrained(export, local_files_only=True)
    batch = tokenizer([r["sentence1"] for r in rows],
                      [r["sentence2"] for r in rows] if pairs else None,
                      padding="max_length", max_length=SEQ, truncation=True, return_tensors="pt")
    hf = AutoModelForSequenceClassification.from_pretrained(
        export, local_files_only=True, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = hf(**batch).logits
    return logits, batch, torch.tensor([r["label"] for r in rows])


@pytest.mark.parametrize("layout", [["--tp", "2", "--pp", "2"],
                                    ["--pp", "2", "--dp", "2", "--recompute-granularity", "full",
                                     "--single-sentence"]])
def test_finetune_reports_the_accuracy_of_its_export(tmp_path, task_dir, layout):
    save, export = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    result = run_on_ranks(4, _finetune, task_args(task_dir, "--save", save, "--export-dir",
                                                  export, *layout))[0]
    losses = [result["losses"][i] for i in sorted(result["losses"])]
    assert len(losses) == 3 * 8
    assert sum(losses[-4:]) < 0.75 * sum(losses[:4]), losses

    logits, batch, labels = _hf_predictions(export, os.path.join(task_dir, "valid.jsonl"),
                                            pairs="--single-sentence" not in layout)
    correct = int((logits.argmax(-1) == labels).sum())
    best = result["best_epoch"]
    assert result["counts"][best] == (correct, 21), (result["counts"], correct)
    assert result["counts"][best][0] == max(c for c, _ in result["counts"][1:])

    meta, full = checkpoint.read_full_model(save)
    assert meta["iteration"] == best * 8
    model = BertModel(ModelConfig(**meta["model_config"]), num_labels=2).eval()
    load_full_state_dict(model, full)
    ours = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    assert rel_err(ours, logits) < 1e-5
