"""Which model family a transformers directory, a GGUF file or a megalite config is, and
whether a converted state dict holds exactly the weights of the megalite model it claims.

Family names are tools/convert_checkpoint.py's --model-type values.
"""
import json
import os

import torch

from megalite.config import ModelConfig
from megalite.hf.moe import moe_family
from megalite.models.sharding import full_names, local_value, persistent_buffers

# transformers' config.json "model_type" -> family
FAMILIES = {"gpt2": "gpt", "llama": "llama", "mixtral": "mixtral", "qwen2_moe": "qwen2_moe",
            "bert": "bert"}
_BERT_OPTIONAL = ("classifier.", "lm_head.", "pooler.")  # heads a BERT checkpoint may lack


def family_of_source(path: str, flag: str = "--input",
                     families: tuple[str, ...] = tuple(FAMILIES.values())) -> str:
    """The family of a transformers directory (its config.json's model_type) or of a .gguf
    file (llama: the reader refuses other architectures); ValueError naming `flag` and the
    input unless it is one of `families`."""
    if path.endswith(".gguf"):
        return "llama"
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"{flag} {path}: no config.json (expected a transformers model "
                         f"directory or a .gguf file)")
    with open(config_file) as f:
        model_type = json.load(f).get("model_type")
    if FAMILIES.get(model_type) not in families:
        names = [name for name, family in FAMILIES.items() if family in families]
        raise ValueError(f"{flag} {path}: model_type {model_type!r} is none of "
                         f"{', '.join(names)}")
    return FAMILIES[model_type]


def family_of_config(config: ModelConfig) -> str:
    """The family a megalite model config exports as."""
    if not config.causal:
        return "bert"
    if config.num_experts is not None:
        return moe_family(config)
    return "llama" if config.normalization == "RMSNorm" else "gpt"


def _megalite_model(config: ModelConfig, full: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The single-stage megalite model of `config` on the meta device (no memory, no init);
    a BERT with the head its weights carry."""
    from megalite.models import BertModel, GPTModel
    if config.causal:
        return GPTModel(config, device="meta")
    mlm = "lm_head.bias" in full
    labels = full["classifier.weight"].shape[0] if "classifier.weight" in full else 2
    return BertModel(config, head="mlm" if mlm else "classification", num_labels=labels,
                     device="meta")


def check_weights(full: dict[str, torch.Tensor], config: ModelConfig, source: str) -> None:
    """ValueError (one line naming `source`) unless `full` holds every parameter of the
    megalite model of `config` (BERT heads optional) in its shape, and nothing else."""
    model = _megalite_model(config, full)
    entries = [*model.named_parameters(), *persistent_buffers(model)]
    expected = [key for name, param in entries for key in full_names(name, param)]
    optional = _BERT_OPTIONAL if not config.causal else ()
    missing = [n for n in expected if n not in full and not n.startswith(optional)]
    unexpected = [n for n in full if n not in set(expected)]
    if missing or unexpected:
        raise ValueError(f"{source}: the weights do not make the model its config describes: "
                         f"missing {_few(missing)}, unexpected {_few(unexpected)}")
    for name, param in entries:
        if all(key in full for key in full_names(name, param)):
            try:
                local_value(full, name, param)
            except ValueError as error:
                raise ValueError(f"{source}: weight {name!r}: {error}") from None


def _few(names: list[str]) -> str:
    """'none', or the first three names and how many there are."""
    if not names:
        return "none"
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return ", ".join(names[:3]) + more
