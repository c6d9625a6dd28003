"""tools/convert_checkpoint.py --model-type bert: HF directory -> megalite (TP2 x PP2) ->
reshard (TP1 x PP1) -> HF directory, for a classifier, a masked LM and a bare encoder.

The round trip must reproduce the original transformers outputs exactly, and the megalite
checkpoint must give the same logits as transformers in a megalite BertModel (fp32, eval).
"""
import pytest
import torch

from megalite import checkpoint
from megalite.config import ModelConfig
from megalite.models.bert import BertModel
from megalite.models.sharding import load_full_state_dict
from tests.helpers.reference import rel_err
from tests.test_bert_hf_parity import NUM_LABELS, _batch, tiny_bert
from tools import convert_checkpoint


def _bare_encoder():
    """A random transformers BertModel with a pooler (the shape of all-MiniLM-L6-v2)."""
    from transformers import BertModel as HFBertModel
    torch.manual_seed(0)
    return HFBertModel(tiny_bert("classification").config).eval()


def _outputs(model, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    token_type_ids=batch["token_type_ids"])
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _convert(direction: str, src, dst, *layout: str) -> None:
    convert_checkpoint.main(["--direction", direction, "--model-type", "bert", "--input",
                             str(src), "--output", str(dst), *layout])


@pytest.mark.parametrize("kind", ["classification", "mlm", "bare"])
def test_bert_hf_megalite_reshard_hf_round_trip(tmp_path, kind):
    from transformers import AutoModel, AutoModelForMaskedLM, AutoModelForSequenceClassification
    hf = _bare_encoder() if kind == "bare" else tiny_bert(kind)
    hf.save_pretrained(tmp_path / "hf")
    _convert("hf-to-megalite", tmp_path / "hf", tmp_path / "tp2pp2", "--target-tp", "2",
             "--target-pp", "2")
    _convert("reshard", tmp_path / "tp2pp2", tmp_path / "tp1pp1")
    _convert("megalite-to-hf", tmp_path / "tp1pp1", tmp_path / "back")
    auto = {"classification": AutoModelForSequenceClassification, "mlm": AutoModelForMaskedLM,
            "bare": AutoModel}[kind]
    back = auto.from_pretrained(tmp_path / "back", local_files_only=True,
                           attn_implementation="eager").eval()
    assert type(back) is type(hf)
    batch = _batch(hf.config.vocab_size, "mlm" if kind == "mlm" else "classification")
    assert torch.equal(_outputs(back, batch), _outputs(hf, batch))

    meta, full = checkpoint.read_full_model(str(tmp_path / "tp2pp2"))
    assert meta["layout"]["tp"] == 2 and meta["layout"]["pp"] == 2
    if kind == "classification":
        config = ModelConfig(**meta["model_config"])
        model = BertModel(config, num_labels=NUM_LABELS).eval()
        load_full_state_dict(model, full)
        ours = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
        assert rel_err(ours, _outputs(hf, batch)) < 1e-5
