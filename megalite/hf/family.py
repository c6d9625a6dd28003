"""The record of one transformers model family: what it reads, how its config and weights
convert both ways, how a directory is read and written. Each megalite.hf.<family> module
exposes its record(s); megalite.hf.families lists them (detection, readers, writers, the
converter's --model-type values and generation's --hf sources derive from that list).

The special-token ids (bos/eos/pad) travel with the config both ways for every family:
`config_from_hf` stores the transformers config's ids in the ModelConfig, `config_to_hf`
writes them back.
"""
import dataclasses
import os
import shutil
from collections.abc import Callable

import torch

from megalite.checkpoint.files import write_tensors
from megalite.config import ModelConfig

State = dict[str, torch.Tensor]  # parameter name -> full tensor (megalite or transformers names)
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json")


@dataclasses.dataclass(frozen=True)
class Family:
    """One transformers family (`name`: tools/convert_checkpoint.py's --model-type value).

    `hf_class`: the transformers class its directories load as and its exports name;
    `from_hf` / `to_hf`: config conversion without the token ids (the methods add them);
    `state_from_hf(hf_state, config)` / `state_to_hf(state, config)`: full state dicts;
    `exports(config)`: whether a megalite config is of this family (checked in the registry's
    order); `gguf_architectures`: the GGUF `general.architecture`s its reader takes;
    `reader` / `writer`: replace the default `read` / `write` (a directory through
    `hf_class`) where the family needs more; `optional_prefixes`: megalite weights a source
    may lack (heads); `generates`: a causal LM that generation can load.
    """

    name: str
    model_types: tuple[str, ...]
    hf_class: str
    from_hf: Callable[[object], ModelConfig]
    to_hf: Callable[[ModelConfig], object]
    state_from_hf: Callable[[State, ModelConfig], State]
    state_to_hf: Callable[[State, ModelConfig], State]
    exports: Callable[[ModelConfig], bool]
    gguf_architectures: tuple[str, ...] = ()
    reader: Callable[["Family", str, Callable[[str], None]], tuple[ModelConfig, State]] \
        | None = None
    writer: Callable[["Family", str, State, ModelConfig], None] | None = None
    optional_prefixes: tuple[str, ...] = ()
    generates: bool = True

    def config_from_hf(self, hf_config) -> ModelConfig:
        """The megalite config of a transformers config, its token ids included."""
        ids = {name: getattr(hf_config, name, None) for name in TOKEN_IDS}
        return dataclasses.replace(self.from_hf(hf_config), **ids)

    def config_to_hf(self, config: ModelConfig):
        """The transformers config of a megalite config, its token ids included."""
        hf_config = self.to_hf(config)
        for name in TOKEN_IDS:
            setattr(hf_config, name, getattr(config, name))
        return hf_config

    def read(self, src: str, log: Callable[[str], None] = print) -> tuple[ModelConfig, State]:
        """Config and full megalite weights of a transformers directory (or a GGUF file where
        the family reads one; progress lines to `log`); ValueError when its weights do not
        fit."""
        if self.reader is not None:
            return self.reader(self, src, log)
        return self.read_directory(src)

    def read_directory(self, src: str) -> tuple[ModelConfig, State]:
        """`read` through `hf_class.from_pretrained` (fp32, every weight must fit)."""
        hf = from_pretrained(self.transformers_class(), src)
        config = self.config_from_hf(hf.config)
        return config, self.state_from_hf(hf.state_dict(), config)

    def write(self, directory: str, state: State, config: ModelConfig,
              tokenizer_dir: str | None = None) -> None:
        """A `from_pretrained`-loadable directory of a full megalite state of all stages;
        the tokenizer files found in `tokenizer_dir` are copied alongside."""
        if self.writer is not None:
            self.writer(self, directory, state, config)
        else:
            write_hf_dir(directory, self.config_to_hf(config), self.hf_class,
                         self.state_to_hf(state, config))
        for name in TOKENIZER_FILES if tokenizer_dir else ():
            if os.path.isfile(os.path.join(tokenizer_dir, name)):
                shutil.copy(os.path.join(tokenizer_dir, name), directory)

    def transformers_class(self):
        """The transformers class named `hf_class`."""
        import transformers
        return getattr(transformers, self.hf_class)


def from_pretrained(cls, src: str):
    """`cls.from_pretrained(src)` in fp32; ValueError if the directory's weights and the
    class's differ (transformers would initialise the missing ones at random)."""
    hf, info = cls.from_pretrained(src, local_files_only=True, dtype="float32",
                                   output_loading_info=True)
    bad = {kind: sorted(info[kind]) for kind in ("missing_keys", "unexpected_keys",
                                                  "mismatched_keys") if info[kind]}
    if bad:
        raise ValueError(f"{src}: weights do not fit {type(hf).__name__}: " + "; ".join(
            f"{kind.replace('_', ' ')} {names[:3]} ({len(names)})" for kind, names in bad.items()))
    return hf


def write_hf_dir(directory: str, hf_config, architecture: str, weights: State) -> None:
    """config.json (naming `architecture`) + model.safetensors of transformers-named `weights`
    (the tied lm_head left out) in `directory`, the weights by megalite's checkpoint writer."""
    hf_config.architectures = [architecture]
    os.makedirs(directory, exist_ok=True)
    hf_config.save_pretrained(directory)
    if hf_config.tie_word_embeddings:
        weights.pop("lm_head.weight")
    write_tensors(os.path.join(directory, "model.safetensors"), weights, {"format": "pt"})
