"""Finetuning data: WordPiece pairs, JSONL/CSV/TSV readers, one-line errors, the built-in task."""
import json
import os
import shutil

import pytest

from megalite.data.finetune import COLUMNS, encode_pairs, load_tokenizer, read_pairs
from megalite.data.finetune_builtin import builtin_pair_task
from megalite.hf.bert import read_bert_dir
from tests.test_bert_hf_parity import minilm_dir

PAIRS = [("The quick brown fox jumps.", "It lands on the lazy dog.", 1),
         ("Python is a programming language", "Snakes are reptiles", 0)]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(minilm_dir())


def _write(path, rows, columns=COLUMNS["default"]):
    """rows of (a, b, label) as .jsonl / .csv / .tsv, by the path's extension."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(dict(zip(columns, r))) + "\n" for r in rows))
    else:
        sep = "," if path.suffix == ".csv" else "\t"
        path.write_text("\n".join(sep.join(map(str, r)) for r in [columns, *rows]) + "\n")
    return str(path)


def test_known_words_are_in_the_shipped_vocabulary(tokenizer):
    assert len(tokenizer) == 30522
    ids = tokenizer("the quick brown fox jumps over the lazy dog", add_special_tokens=False)
    assert tokenizer.unk_token_id not in ids["input_ids"] and len(ids["input_ids"]) == 9


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".tsv"])
def test_pairs_get_token_types_and_padding(tmp_path, tokenizer, suffix):
    examples = read_pairs(_write(tmp_path / f"d{suffix}", PAIRS), num_labels=2)
    assert examples.labels == [1, 0] and examples.second[1] == "Snakes are reptiles"
    item = {k: v[0] for k, v in encode_pairs(tokenizer, examples, seq_length=24).items()}
    ids, types, mask = item["input_ids"].tolist(), item["tokentype_ids"].tolist(), \
        item["attention_mask"].tolist()
    first_sep = ids.index(tokenizer.sep_token_id)
    length = sum(mask)
    assert ids[0] == tokenizer.cls_token_id and ids[length - 1] == tokenizer.sep_token_id
    assert types[:first_sep + 1] == [0] * (first_sep + 1)
    assert types[first_sep + 1:length] == [1] * (length - first_sep - 1)
    assert mask == [1] * length + [0] * (24 - length) and item["labels"].item() == 1
    assert tokenizer.decode(ids[1:first_sep]) == "the quick brown fox jumps."


def test_mnli_columns(tmp_path):
    path = _write(tmp_path / "mnli.jsonl", [("p", "h", 2)], COLUMNS["mnli"])
    premise, hypothesis, label = COLUMNS["mnli"]
    examples = read_pairs(path, 3, premise, hypothesis, label)
    assert (examples.first, examples.second, examples.labels) == (["p"], ["h"], [2])


@pytest.mark.parametrize("label, message", [(3, "label 3 is not an integer in [0, 2)"),
                                            (-1, "label -1 is not an integer in [0, 2)"),
                                            ("yes", "label 'yes' is not an integer in [0, 2)")])
def test_bad_label_is_one_line(tmp_path, label, message):
    path = _write(tmp_path / "bad.jsonl", [PAIRS[0], ("a b", "c d", label)])
    with pytest.raises(ValueError) as e:
        read_pairs(path, num_labels=2)
    assert str(e.value) == f"{path}: row 2: {message}"


def test_missing_column_is_one_line(tmp_path):
    path = _write(tmp_path / "d.csv", PAIRS)
    with pytest.raises(ValueError) as e:
        read_pairs(path, 2, sentence1="premise")
    assert str(e.value) == f"{path}: row 1 has no column 'premise' " \
                           f"(columns: sentence1, sentence2, label)"


def test_model_dir_without_weights_is_one_line(tmp_path):
    shutil.copy(os.path.join(minilm_dir(), "config.json"), tmp_path)
    with pytest.raises(ValueError) as e:
        read_bert_dir(str(tmp_path))
    assert str(e.value) == f"{tmp_path}: no model weights (model.safetensors or pytorch_model.bin)"
    with pytest.raises(ValueError, match="no tokenizer"):
        load_tokenizer(str(tmp_path))


def _where(sentence: str) -> tuple[int, int]:
    """(document, position) of a synthetic sentence 'Document d sentence i here.'"""
    words = sentence.split()
    return int(words[1]), int(words[3])


def test_builtin_task_pairs_are_true_successors_or_other_documents():
    texts = [" ".join(f"Document {d} sentence {i} here." for i in range(5)) for d in range(20)]
    train, valid = builtin_pair_task(seed=3, valid_fraction=0.2, texts=texts)
    assert (train, valid) == builtin_pair_task(seed=3, valid_fraction=0.2, texts=texts)
    assert train != builtin_pair_task(seed=4, valid_fraction=0.2, texts=texts)[0]
    assert len(train.labels) == 16 * 4 and len(valid.labels) == 4 * 4
    for split in (train, valid):
        for a, b, label in zip(split.first, split.second, split.labels):
            (da, ia), (db, ib) = _where(a), _where(b)
            assert (db, ib) == (da, ia + 1) if label == 0 else db != da
    documents = [{_where(s)[0] for s in split.first + split.second} for split in (train, valid)]
    assert not documents[0] & documents[1]


def test_builtin_task_default_texts():
    train, valid = builtin_pair_task()
    assert len(train.labels) > 1000 and len(valid.labels) > 100
    assert 0.4 < sum(train.labels) / len(train.labels) < 0.6
