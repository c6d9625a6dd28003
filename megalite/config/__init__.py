"""Configuration dataclasses: the single source of truth for every command-line flag.

Each field's `arg(...)` carries its help text and its bounds (`min=`, `above=`, `below=`);
`cli.build_parser` turns the dataclasses into an argparse parser and `parse_configs` turns
parsed arguments back into them. fields.py: `arg` and the range check every section runs
on construction; model.py: ModelConfig; sections.py: the other sections of every run;
cli.py: the parser, `Configs`, and the registry of a task's own section (`task_section`).
"""
from megalite.config.cli import (TASK_SECTIONS, Configs, add_arguments, build_parser,
                                 config_from_args, default_checkpoint_dirs, parse_configs,
                                 task_section)
from megalite.config.fields import Section, arg, check_range
from megalite.config.model import ModelConfig, moe_layer_pattern
from megalite.config.sections import (CheckpointConfig, DataConfig,
                                      OptimizerConfig, ParallelConfig, PrecisionConfig,
                                      TrainConfig)

__all__ = ["arg", "check_range", "Section", "ModelConfig", "moe_layer_pattern",
           "ParallelConfig", "PrecisionConfig", "OptimizerConfig",
           "TrainConfig", "DataConfig", "CheckpointConfig", "Configs", "TASK_SECTIONS",
           "task_section", "add_arguments", "build_parser", "config_from_args",
           "parse_configs", "default_checkpoint_dirs"]
