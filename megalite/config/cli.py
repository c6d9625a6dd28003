"""The command line generated from the config dataclasses (`--hidden-size` for
`hidden_size`, plus aliases such as `--tp`), `Configs` (every section of a run, a task's own
included) and `parse_configs`, which turns the parsed flags back into the dataclasses.
"""
import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from megalite.config.model import ModelConfig
from megalite.config.sections import (CheckpointConfig, DataConfig, OptimizerConfig,
                                      ParallelConfig, PrecisionConfig, TrainConfig)


def _base_type(tp):
    """int for `int | None`, list element type for list[str]."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if typing.get_origin(tp) is list:
        tp = typing.get_args(tp)[0]
    return tp


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def add_arguments(parser: argparse.ArgumentParser, config_cls,
                  names: Collection[str] | None = None) -> None:
    """Add one flag per field of `config_cls` (only `names`, if given) in an argument group
    named after it; no group when no field is offered."""
    fields = [f for f in dataclasses.fields(config_cls) if names is None or f.name in names]
    unknown = set(names or ()) - {f.name for f in dataclasses.fields(config_cls)}
    if unknown:
        raise ValueError(f"{config_cls.__name__} has no field {sorted(unknown)[0]!r}")
    if not fields:
        return
    group = parser.add_argument_group(config_cls.__name__, config_cls.__doc__)
    hints = typing.get_type_hints(config_cls)
    for f in fields:
        meta, flags = f.metadata, ["--" + f.name.replace("_", "-"), *f.metadata["aliases"]]
        tp = _base_type(hints[f.name])
        if tp is bool:
            action = argparse.BooleanOptionalAction if meta.get("negatable") else "store_true"
            group.add_argument(*flags, dest=f.name, action=action, default=_default(f),
                               help=meta["help"])
            continue
        group.add_argument(*flags, dest=f.name, type=tp, default=_default(f), help=meta["help"],
                           choices=meta["choices"], nargs=meta.get("nargs"))


def build_parser(config_classes: list[type], description: str = "",
                 offer: dict[type, Collection[str]] | None = None) -> argparse.ArgumentParser:
    """The flags of `config_classes`; `offer` limits a class to the named fields. No
    abbreviations (as in Megatron-LM): a prefix of a flag is refused, not guessed (finetuning's
    --epochs must not take pretraining's --ep)."""
    parser = argparse.ArgumentParser(description=description, allow_abbrev=False,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for cls in config_classes:
        add_arguments(parser, cls, (offer or {}).get(cls))
    return parser


def config_from_args(config_cls, args: argparse.Namespace):
    """Build `config_cls` from parsed args (a field without a flag takes the parser-level
    default, else its own); a ValueError from validation exits with one line."""
    values = {f.name: getattr(args, f.name, _default(f)) for f in dataclasses.fields(config_cls)}
    return config_cls(**values)


# A task's own config section by name ("finetune"), registered by its module (task_section).
TASK_SECTIONS: dict[str, type] = {}


def task_section(name: str) -> Callable[[type], type]:
    """Class decorator of a task's config dataclass: `parse_configs(..., optional=(name,))`
    adds its flags and `configs.<name>` holds it (None in runs that do not parse it)."""
    def register(cls: type) -> type:
        TASK_SECTIONS[name] = cls
        return cls
    return register


@dataclass
class Configs:
    """Every config of a training run, as parsed from the command line: the shared sections,
    and a task's own by name (`configs.finetune` reads `sections["finetune"]`)."""

    model: ModelConfig
    parallel: ParallelConfig
    precision: PrecisionConfig
    optimizer: OptimizerConfig
    train: TrainConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    sections: dict[str, Any] = field(default_factory=dict)  # task sections by name
    explicit: frozenset[str] = frozenset()  # fields set on the command line (not defaults)

    def __getattr__(self, name: str) -> Any:
        if name != "sections" and name in TASK_SECTIONS:
            return self.sections.get(name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")


def parse_configs(argv: list[str] | None = None, description: str = "",
                  defaults: dict | None = None, optional: Collection[str] = (),
                  offer: dict[str, Collection[str]] | None = None) -> Configs:
    """Parse the generated flags into `Configs`; invalid values exit with one clear line.

    `optional` names the task sections (registered with `task_section`) this parse adds,
    e.g. ("finetune",). `offer` maps a section ("model", "train", ...) to the only fields a
    script offers as flags: argparse refuses the others, which keep their defaults
    (`defaults` included). Sections it does not name offer every field.
    """
    unknown = [name for name in optional if name not in TASK_SECTIONS]
    if unknown:
        raise ValueError(f"no task section {unknown[0]!r} (registered: {sorted(TASK_SECTIONS)})")
    shared = {f.name: f.type for f in dataclasses.fields(Configs)
              if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    sections = {**shared, **{name: TASK_SECTIONS[name] for name in optional}}
    parser = build_parser(list(sections.values()), description,
                          {sections[name]: names for name, names in (offer or {}).items()})
    if defaults:
        parser.set_defaults(**defaults)
    unset = object()
    dests = [a.dest for a in parser._actions if a.dest != "help"]
    args = parser.parse_args(argv, argparse.Namespace(**dict.fromkeys(dests, unset)))
    explicit = frozenset(d for d in dests if getattr(args, d) is not unset)
    for dest in set(dests) - explicit:
        setattr(args, dest, parser.get_default(dest))
    try:
        built = {name: config_from_args(cls, args) for name, cls in sections.items()}
    except ValueError as error:
        parser.exit(2, f"error: {error}\n")
    return Configs(**{name: built.pop(name) for name in shared}, sections=built,
                   explicit=explicit)


def default_checkpoint_dirs(configs: Configs) -> None:
    """An entry script's --save/--load defaults: a run given neither resumes its own default
    --save directory; --load alone writes no checkpoint (Megatron's behaviour)."""
    ckpt = configs.checkpoint
    if not {"save", "load"} & configs.explicit:
        ckpt.load = ckpt.save
    elif "save" not in configs.explicit:
        ckpt.save = None
