"""megalite BERT -> transformers directory -> `from_pretrained`, and import of a bare BertModel.

Single process: a seeded megalite model is exported with `BERT.write` and reloaded
by transformers; the logits must agree (fp32, eval). The MiniLM checkpoint (a plain
BertModel) loads into a classification model with only the classifier left initialised.
"""
import json

import pytest
import torch

from megalite.hf import BERT, load_hf
from megalite.hf.bert import bert_config, read_bert_dir
from megalite.models.bert import BertModel
from megalite.models.sharding import full_state_dict
from tests.helpers.reference import rel_err
from tests.test_bert_hf_parity import NUM_LABELS, _batch, minilm_dir, tiny_bert


@pytest.mark.parametrize("head", ["classification", "mlm"])
def test_export_round_trip(tmp_path, head):
    from transformers import AutoModelForMaskedLM, AutoModelForSequenceClassification, \
        BertTokenizerFast
    config = bert_config(tiny_bert(head).config)
    model = BertModel(config, head=head, num_labels=NUM_LABELS, init_seed=5).eval()
    BERT.write(str(tmp_path), full_state_dict(model), config, tokenizer_dir=minilm_dir())
    auto = AutoModelForSequenceClassification if head == "classification" else AutoModelForMaskedLM
    hf = auto.from_pretrained(tmp_path, local_files_only=True).eval()
    batch = _batch(config.vocab_size, head)
    ours = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    theirs = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                token_type_ids=batch["token_type_ids"]).logits
    assert rel_err(ours[..., :config.vocab_size], theirs) < 1e-6
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == \
        [type(hf).__name__]
    assert len(BertTokenizerFast.from_pretrained(tmp_path, local_files_only=True)) == 30522


def test_load_bare_minilm_keeps_classifier_initialised():
    hf_config, state = read_bert_dir(minilm_dir())
    config = bert_config(hf_config)
    model = BertModel(config, num_labels=NUM_LABELS)
    assert load_hf(model, state) == ["classifier.weight", "classifier.bias"]
    assert torch.equal(model.embedding.word_embeddings.weight[:config.vocab_size],
                       state["embeddings.word_embeddings.weight"])
