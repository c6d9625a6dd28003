"""The model a checkpoint holds, against the model a run asks for (Megatron's
--use-checkpoint-args, on whenever --load finds a checkpoint).

A run that loads a checkpoint takes every field that defines the weights from the
checkpoint's metadata; of those, a flag given on the command line must agree with it. Every
difference is reported in one line. Floats agree when they are equal as float32: a GGUF or a
transformers config stores 1e-5 as float32 (9.999999747378752e-06), and a flag of 1e-5 means
that value.
"""
import dataclasses
from collections.abc import Collection

import numpy as np

from megalite.config import ModelConfig

# ModelConfig fields that may change between save and load: they change neither the
# parameters nor what they mean, and stay this run's own. Every other field (those added
# later too) is the checkpoint's.
RESUMABLE_MODEL_FIELDS = frozenset({
    "hidden_dropout", "attention_dropout", "init_method_std", "make_vocab_size_divisible_by",
    "recompute_granularity", "recompute_method", "recompute_num_layers"})


def same_value(saved, ours) -> bool:
    """Equal, floats compared at float32 precision (booleans and None exactly)."""
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (saved, ours))
    if numbers and (isinstance(saved, float) or isinstance(ours, float)):
        return bool(np.float32(saved) == np.float32(ours))
    return saved == ours


def model_differences(saved: dict, config: ModelConfig,
                      names: Collection[str] | None = None) -> list[str]:
    """'checkpoint has x=1, this run has --x 2' for every field (of `names`, default all but
    RESUMABLE_MODEL_FIELDS) where `config` differs from the saved model config."""
    return [f"checkpoint has {name}={saved.get(name)}, this run has "
            f"--{name.replace('_', '-')} {ours}"
            for name, ours in dataclasses.asdict(config).items()
            if (name in names if names is not None else name not in RESUMABLE_MODEL_FIELDS)
            and not same_value(saved.get(name), ours)]


def differences_error(root: str, differences: list[str], hint: str = "") -> ValueError:
    """One line naming every difference between a run and the checkpoint it loads."""
    return ValueError(f"--load {root}: {'; '.join(differences)}{hint}")


def model_from_checkpoint(saved: dict, config: ModelConfig, explicit: Collection[str],
                          root: str) -> ModelConfig:
    """`config` with every field that defines the weights taken from the saved model config;
    ValueError listing every flag in `explicit` that disagrees with it."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)} - RESUMABLE_MODEL_FIELDS
    differences = model_differences(saved, config, fields & set(explicit))
    if differences:
        raise differences_error(root, differences, " (drop these flags: the model comes from "
                                "the checkpoint)")
    return dataclasses.replace(config, **{k: v for k, v in saved.items() if k in fields})
