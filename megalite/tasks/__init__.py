"""The tasks the entry scripts run, each a `megalite.training.Task` with its own flags:

- gpt.py: GPT pretraining (pretrain_gpt.py): Megatron-style provider functions
  (model_provider, forward_step, datasets_provider) and `GPTPretraining`;
- bert.py: BERT sentence-pair classification finetuning (finetune_bert.py):
  `PairClassification`, its config section `finetune` (FinetuneConfig);
- sft.py: chat (supervised) finetuning of a GPT-family model (finetune_gpt.py):
  `ChatFinetuning`, its config section `sft` (SFTConfig);
- runner.py: parsing, the error-exit policy (one `error:` line, exit 2) and `main`.

A task's config section is a dataclass registered with `megalite.config.task_section(name)`
when its module is imported (this package imports all three); the module parses with
`optional=(name,)` and reads it as `configs.<name>`. Each module's `run(argv)` trains in this
process and `main(argv)` is its script's entry point.
"""
from megalite.tasks import bert, gpt, runner, sft  # importing a task registers its section

__all__ = ["bert", "gpt", "runner", "sft"]
