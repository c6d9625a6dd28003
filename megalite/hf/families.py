"""The registry of transformers families (one megalite.hf.family.Family record each, in the
order `family_of_config` tries them) and what derives from it: which family a transformers
directory, a GGUF file or a megalite config is, reading a source, loading transformers
weights into a model's shards, and whether a converted state dict holds exactly the weights
of the megalite model it claims.

Family names are tools/convert_checkpoint.py's --model-type values.
"""
import json
import os
from collections.abc import Callable

import torch
from torch import nn

from megalite.config import ModelConfig
from megalite.hf.bert import BERT
from megalite.hf.deepseek_v3 import DEEPSEEK_V3
from megalite.hf.family import Family, State
from megalite.hf.gpt2 import GPT2
from megalite.hf.llama import LLAMA
from megalite.hf.moe import MIXTRAL, QWEN2_MOE
from megalite.hf.qwen3 import QWEN3
from megalite.hf.qwen3_moe import QWEN3_MOE
from megalite.models.sharding import full_names, load_full_state_dict, local_value, \
    persistent_buffers, unwrap

FAMILIES: dict[str, Family] = {family.name: family for family in (
    BERT, DEEPSEEK_V3, QWEN3_MOE, MIXTRAL, QWEN2_MOE, QWEN3, LLAMA, GPT2)}
MODEL_TYPES = {model_type: family for family in FAMILIES.values()
               for model_type in family.model_types}  # config.json "model_type" -> family
CAUSAL = tuple(name for name, family in FAMILIES.items() if family.generates)
_BERT_OPTIONAL = ("classifier.", "lm_head.", "pooler.")  # heads a BERT checkpoint may lack


def family_of_source(path: str, flag: str = "--input",
                     families: tuple[str, ...] = tuple(FAMILIES)) -> str:
    """The family of a transformers directory (its config.json's model_type) or of a .gguf
    file (the family reading GGUF files: its reader refuses other architectures); ValueError
    naming `flag` and the input unless it is one of `families`."""
    if path.endswith(".gguf"):
        return next(name for name, family in FAMILIES.items() if family.gguf_architectures)
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"{flag} {path}: no config.json (expected a transformers model "
                         f"directory or a .gguf file)")
    with open(config_file) as f:
        model_type = json.load(f).get("model_type")
    family = MODEL_TYPES.get(model_type)
    if family is None or family.name not in families:
        names = [t for t, f in MODEL_TYPES.items() if f.name in families]
        raise ValueError(f"{flag} {path}: model_type {model_type!r} is none of "
                         f"{', '.join(names)}")
    return family.name


def family_of_config(config: ModelConfig) -> str:
    """The family a megalite model config exports as (the first whose `exports` accepts it);
    ValueError if none does."""
    name = next((name for name, family in FAMILIES.items() if family.exports(config)), None)
    if name is None:
        raise ValueError("no transformers family exports this model config")
    return name


def read_source(src: str, flag: str, families: tuple[str, ...] = tuple(FAMILIES),
                log: Callable[[str], None] = print) -> tuple[ModelConfig, State]:
    """Config and full megalite weights of a transformers directory or .gguf file of one of
    `families`; ValueError naming `flag` and `src` otherwise."""
    return FAMILIES[family_of_source(src, flag, families)].read(src, log)


def load_hf(model: nn.Module | list[nn.Module], hf_state: State,
            config: ModelConfig | None = None) -> list[str]:
    """Fill this rank's TP/PP(/VPP) shard of a megalite model (or its chunks, wrapped or not)
    from a full transformers state dict of the family of `config` (default: the model's);
    returns the names of the parameters the state lacks and the family allows to be absent
    (a BERT's heads), which keep their seeded initialisation."""
    chunks = [unwrap(c) for c in (model if isinstance(model, list) else [model])]
    config = config or chunks[0].config
    family = FAMILIES[family_of_config(config)]
    state = family.state_from_hf(hf_state, config)
    load_full_state_dict(chunks, state, optional=family.optional_prefixes)
    return [n for c in chunks for n, _ in c.named_parameters() if n not in state]


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
