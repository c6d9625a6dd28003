"""Hugging Face BERT <-> megalite BertModel: config, weights, and transformers directories.

HF BERT keeps q, k and v as separate Linear layers; megalite fuses them head-major
([heads, (q, k, v), head_dim] along the output) so a TP split keeps whole heads.
HF state dicts are accepted with or without the `bert.` prefix (BertModel,
BertForSequenceClassification, BertForMaskedLM); head weights are optional on import.
"""
import os
from collections.abc import Callable

import torch

from megalite.checkpoint.files import save_pretrained
from megalite.config import ModelConfig
from megalite.hf.family import Family, State
from megalite.hf.gpt2 import qkv_from_head_major, qkv_to_head_major

_TOP_MAP = {  # megalite name -> HF name (without the `bert.` prefix)
    "embedding.word_embeddings.weight": "embeddings.word_embeddings.weight",
    "embedding.position_embeddings.weight": "embeddings.position_embeddings.weight",
    "embedding.tokentype_embeddings.weight": "embeddings.token_type_embeddings.weight",
    "embedding_layernorm.weight": "embeddings.LayerNorm.weight",
    "embedding_layernorm.bias": "embeddings.LayerNorm.bias",
    "pooler.dense.weight": "pooler.dense.weight",
    "pooler.dense.bias": "pooler.dense.bias",
    "classifier.weight": "classifier.weight",
    "classifier.bias": "classifier.bias",
    "lm_head.dense.weight": "cls.predictions.transform.dense.weight",
    "lm_head.dense.bias": "cls.predictions.transform.dense.bias",
    "lm_head.layernorm.weight": "cls.predictions.transform.LayerNorm.weight",
    "lm_head.layernorm.bias": "cls.predictions.transform.LayerNorm.bias",
    "lm_head.bias": "cls.predictions.bias",
}
_LAYER_MAP = {  # megalite layer suffix -> HF layer suffix
    "self_attention.dense.weight": "attention.output.dense.weight",
    "self_attention.dense.bias": "attention.output.dense.bias",
    "input_layernorm.weight": "attention.output.LayerNorm.weight",
    "input_layernorm.bias": "attention.output.LayerNorm.bias",
    "mlp.dense_h_to_4h.weight": "intermediate.dense.weight",
    "mlp.dense_h_to_4h.bias": "intermediate.dense.bias",
    "mlp.dense_4h_to_h.weight": "output.dense.weight",
    "mlp.dense_4h_to_h.bias": "output.dense.bias",
    "post_attention_layernorm.weight": "output.LayerNorm.weight",
    "post_attention_layernorm.bias": "output.LayerNorm.bias",
}
HEAD_PREFIXES = ("classifier.", "lm_head.")  # may be absent from a checkpoint
_UNPREFIXED = ("classifier.", "cls.")  # HF keys that never carry `bert.`
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


def bert_config(hf_config) -> ModelConfig:
    """megalite ModelConfig equal to a transformers BertConfig.

    The classifier's size is not part of it: pass `hf_config.num_labels` (or the task's) to
    BertModel.
    """
    if hf_config.hidden_act not in _ACTIVATIONS:
        raise ValueError(f"unsupported BERT activation {hf_config.hidden_act!r}")
    if getattr(hf_config, "position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"unsupported BERT position embedding "
                         f"{hf_config.position_embedding_type!r} (only 'absolute')")
    return ModelConfig(
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads,
        ffn_hidden_size=hf_config.intermediate_size, vocab_size=hf_config.vocab_size,
        max_position_embeddings=hf_config.max_position_embeddings,
        norm_epsilon=hf_config.layer_norm_eps, hidden_dropout=hf_config.hidden_dropout_prob,
        attention_dropout=hf_config.attention_probs_dropout_prob,
        init_method_std=hf_config.initializer_range, activation=_ACTIVATIONS[hf_config.hidden_act],
        num_tokentypes=hf_config.type_vocab_size, post_layernorm=True, causal=False)


def to_bert_config(config: ModelConfig, num_labels: int = 2):
    """transformers BertConfig equal to a megalite ModelConfig (inverse of bert_config)."""
    from transformers import BertConfig
    if not config.post_layernorm or config.causal or not config.num_tokentypes:
        raise ValueError("not a BERT config: needs post_layernorm, no causal mask and token types")
    return BertConfig(
        num_hidden_layers=config.num_layers, hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads, intermediate_size=config.ffn_hidden_size,
        vocab_size=config.vocab_size, max_position_embeddings=config.max_position_embeddings,
        layer_norm_eps=config.norm_epsilon, hidden_dropout_prob=config.hidden_dropout,
        attention_probs_dropout_prob=config.attention_dropout,
        initializer_range=config.init_method_std, type_vocab_size=config.num_tokentypes,
        hidden_act="gelu" if config.activation == "gelu" else "gelu_new", num_labels=num_labels)


def _name_pairs(config: ModelConfig) -> list[tuple[str, str]]:
    """(megalite name, unprefixed HF name) of every non-QKV tensor."""
    pairs = list(_TOP_MAP.items())
    for i in range(config.num_layers):
        pairs += [(f"encoder.layers.{i}.{ours}", f"encoder.layer.{i}.{theirs}")
                  for ours, theirs in _LAYER_MAP.items()]
    return pairs


def bert_to_megalite(hf_state: dict[str, torch.Tensor], config: ModelConfig
                     ) -> dict[str, torch.Tensor]:
    """Full megalite state dict from a HF BERT state dict; heads only where present."""
    sd = {k.removeprefix("bert."): v for k, v in hf_state.items()}
    out = {ours: sd[theirs] for ours, theirs in _name_pairs(config) if theirs in sd}
    for i in range(config.num_layers):
        src = f"encoder.layer.{i}.attention.self."
        for kind in ("weight", "bias"):
            parts = [src + f"{name}.{kind}" for name in ("query", "key", "value")]
            if all(p in sd for p in parts):
                out[f"encoder.layers.{i}.self_attention.query_key_value.{kind}"] = \
                    qkv_to_head_major(torch.cat([sd[p] for p in parts]),
                                      config.num_attention_heads)
    return {k: v.contiguous() for k, v in out.items()}


def megalite_to_bert(state: dict[str, torch.Tensor], config: ModelConfig
                     ) -> dict[str, torch.Tensor]:
    """HF state dict (BertForSequenceClassification or BertForMaskedLM naming) from a full
    megalite state dict of all stages."""
    def hf_name(name: str) -> str:
        return name if name.startswith(_UNPREFIXED) else "bert." + name

    out = {hf_name(theirs): state[ours] for ours, theirs in _name_pairs(config) if ours in state}
    for i in range(config.num_layers):
        dst = f"bert.encoder.layer.{i}.attention.self."
        for kind in ("weight", "bias"):
            fused = state[f"encoder.layers.{i}.self_attention.query_key_value.{kind}"]
            q, k, v = qkv_from_head_major(fused, config.num_attention_heads).chunk(3)
            out.update({dst + f"query.{kind}": q, dst + f"key.{kind}": k, dst + f"value.{kind}": v})
    if "lm_head.bias" in state:
        out["cls.predictions.decoder.weight"] = state["embedding.word_embeddings.weight"]
        out["cls.predictions.decoder.bias"] = state["lm_head.bias"]
    return {k: v.contiguous() for k, v in out.items()}


def read_bert_dir(model_dir: str) -> tuple[object, dict[str, torch.Tensor]]:
    """(BertConfig, state dict) of a local transformers BERT directory; nothing downloaded.

    Raises ValueError naming the directory when config.json or the weights are missing.
    """
    from safetensors.torch import load_file
    from transformers import BertConfig
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ValueError(f"{model_dir}: no config.json (expected a transformers BERT directory)")
    safetensors, binary = (os.path.join(model_dir, f)
                           for f in ("model.safetensors", "pytorch_model.bin"))
    if os.path.isfile(safetensors):
        state = load_file(safetensors)
    elif os.path.isfile(binary):
        state = torch.load(binary, map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"{model_dir}: no model weights (model.safetensors or pytorch_model.bin)")
    return BertConfig.from_pretrained(model_dir, local_files_only=True), state


def _read(family: Family, src: str, log: Callable[[str], None]) -> tuple[ModelConfig, State]:
    """Every weight of the directory must map (a pretraining head, e.g., would be lost)."""
    hf_config, state = read_bert_dir(src)
    config = family.config_from_hf(hf_config)
    full = bert_to_megalite(state, config)
    mapped = {k.removeprefix("bert.") for k in megalite_to_bert(full, config)}
    unused = sorted({k.removeprefix("bert.") for k in state} - mapped
                    - {"embeddings.position_ids"})
    if unused:
        raise ValueError(f"{src}: weights megalite's BERT has no place for: {unused[:3]} "
                         f"({len(unused)})")
    return config, full


def _write(family: Family, directory: str, state: State, config: ModelConfig) -> None:
    """A classification model as BertForSequenceClassification, an MLM model as
    BertForMaskedLM, a bare encoder (all-MiniLM-L6-v2) as BertModel."""
    from transformers import BertForMaskedLM, BertForSequenceClassification, BertModel
    classification = "classifier.weight" in state
    num_labels = state["classifier.weight"].shape[0] if classification else 2
    hf_config = family.config_to_hf(config)
    hf_config.num_labels = num_labels
    hf_state = megalite_to_bert(state, config)
    if any(name.startswith(HEAD_PREFIXES) for name in state):
        model = (BertForSequenceClassification if classification else BertForMaskedLM)(hf_config)
    else:
        model = BertModel(hf_config, add_pooling_layer="pooler.dense.weight" in state)
        hf_state = {k.removeprefix("bert."): v for k, v in hf_state.items()}
    model.load_state_dict(hf_state, strict=True)
    save_pretrained(model, directory)


BERT = Family(
    name="bert", model_types=("bert",), hf_class="BertModel", from_hf=bert_config,
    to_hf=to_bert_config, state_from_hf=bert_to_megalite, state_to_hf=megalite_to_bert,
    exports=lambda c: not c.causal, reader=_read, writer=_write,
    optional_prefixes=HEAD_PREFIXES, generates=False)
