"""meta.json: the format, iteration, model config, precision, optimizer settings and layout of
a checkpoint, and whether a run can load it (the model and precision must agree; optimizer
state and RNG streams apply when the optimizer, respectively the layout, is the saved one).

The model a checkpoint holds, against the model a run asks for (Megatron's
--use-checkpoint-args, on whenever --load finds a checkpoint).

A run that loads a checkpoint takes every field that defines the weights from the
checkpoint's metadata; of those, a flag given on the command line must agree with it. Every
difference is reported in one line. Floats agree when they are equal as float32: a GGUF or a
transformers config stores 1e-5 as float32 (9.999999747378752e-06), and a flag of 1e-5 means
that value.
"""
import dataclasses
import os
from collections.abc import Collection

import numpy as np
import torch

from megalite.checkpoint.dirs import latest_iteration, published_dir
from megalite.checkpoint.files import CheckpointFileError, read_json
from megalite.config import ModelConfig
from megalite.data.tokenizers import Tokenizer
from megalite.models.sharding import params_dtype
from megalite.mpu import parallel_state as ps

FORMAT = 3



LEGACY_FORMAT = 2  # full tensors per pipeline stage; its weights still load



def current_layout() -> dict:
    """The running grid's layout as checkpoints record it (a single process: all ones)."""
    return (ps.get_grid() or ps.GridLayout(1, 1, 1)).as_dict()



def params_dtype_name(model: list[torch.nn.Module]) -> str:
    return str(params_dtype(model[0])).removeprefix("torch.")



def save_tokenizer(directory: str, tokenizer: Tokenizer | None) -> dict:
    """Write `tokenizer` into `directory`/tokenizer; the meta.json entry naming it."""
    if tokenizer is None:
        return {}
    path = tokenizer.save(os.path.join(directory, "tokenizer"))
    return {"tokenizer": os.path.relpath(path, directory)}



def checkpoint_tokenizer(root: str, meta: dict) -> str | None:
    """The path of the tokenizer saved with the checkpoint `meta` describes, or None."""
    name = meta.get("tokenizer")
    return name and os.path.join(published_dir(root, meta["iteration"]), name)



def read_meta(root: str, iteration: int | None = None) -> dict | None:
    """The metadata of the newest (or the given) checkpoint (no communication), or None."""
    iteration = latest_iteration(root) if iteration is None else iteration
    if iteration is None:
        return None
    meta = read_json(os.path.join(published_dir(root, iteration), "meta.json"))
    if meta.get("format") not in (LEGACY_FORMAT, FORMAT):
        raise CheckpointFileError(f"{root}: checkpoint format {meta.get('format')}, expected "
                                  f"{FORMAT} or {LEGACY_FORMAT} (written by another megalite "
                                  f"version)")
    return meta



def check_compatible(meta: dict, model_config: ModelConfig, root: str,
                     params_dtype: torch.dtype | None = None) -> None:
    """One clear error naming every model field (and the precision) that differs.

    Every ModelConfig field must match except RESUMABLE_MODEL_FIELDS (floats at float32
    precision, see megalite.checkpoint.metadata). A weights-only checkpoint
    (tools/convert_checkpoint.py) has no precision and loads under any.
    """
    differences = model_differences(meta["model_config"], model_config)
    theirs = meta.get("params_dtype")
    ours = str(params_dtype).removeprefix("torch.") if params_dtype is not None else None
    if theirs and ours and theirs != ours:
        differences.append(f"checkpoint was trained with {theirs} parameters, this run uses "
                           f"{ours} (use the same --bf16/--fp16, or make a weights-only copy "
                           f"with tools/convert_checkpoint.py --direction reshard)")
    if differences:
        raise differences_error(root, differences)



def restores_optimizer(meta: dict, optimizer_settings: dict) -> bool:
    """Whether the saved optimizer state applies: the same optimizer (any layout and ZeRO
    sharding; a weights-only or format-2 checkpoint has none)."""
    saved = meta.get("optimizer")
    return meta.get("format") == FORMAT and saved is not None \
        and saved["optimizer"] == optimizer_settings["optimizer"]



def restores_rng(meta: dict, layout: dict) -> bool:
    """Whether the per-rank RNG states apply: the run's layout is the saved one."""
    return meta.get("format") == FORMAT and meta.get("optimizer") is not None \
        and meta["layout"] == layout


# The special-token ids a transformers config carries: not weight-defining, taken from the
# checkpoint unless the run gives them.
TOKEN_ID_FIELDS = frozenset({"bos_token_id", "eos_token_id", "pad_token_id"})
# ModelConfig fields that may change between save and load: they change neither the
# parameters nor what they mean, and stay this run's own (token ids: see TOKEN_ID_FIELDS).
# Every other field (those added later too) is the checkpoint's.
RESUMABLE_MODEL_FIELDS = frozenset({
    "hidden_dropout", "attention_dropout", "init_method_std", "make_vocab_size_divisible_by",
    "recompute_granularity", "recompute_method", "recompute_num_layers"}) | TOKEN_ID_FIELDS


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
    """`config` with every field that defines the weights taken from the saved model config
    (and the token ids not in `explicit`); ValueError listing every flag in `explicit` that
    disagrees with a weight-defining field."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)} - RESUMABLE_MODEL_FIELDS
    differences = model_differences(saved, config, fields & set(explicit))
    if differences:
        raise differences_error(root, differences, " (drop these flags: the model comes from "
                                "the checkpoint)")
    taken = fields | (TOKEN_ID_FIELDS - set(explicit))
    return dataclasses.replace(config, **{k: v for k, v in saved.items() if k in taken})
