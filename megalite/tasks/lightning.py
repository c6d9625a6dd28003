"""megalite's tasks as LightningModules for megalite.lightning's MegaliteStrategy, each from its
entry script's flags (the same flags, parsed the same way, minus the --save/--load defaults:
see megalite.lightning.module.lightning_configs). Not imported by megalite.tasks itself, so
the entry scripts need no Lightning.

- GPTModule: pretrain_gpt.py (pretraining, or continuing a checkpoint given with --load);
- ChatSFTModule: finetune_gpt.py (chat SFT);
- BertClassificationModule: finetune_bert.py (sentence-pair classification): logs
  `valid_accuracy` at each validation point (every epoch by default).
"""
from megalite.tasks import bert, gpt, sft
from megalite.lightning.module import MegaliteModule, lightning_configs


class GPTModule(MegaliteModule):
    """GPT pretraining / continuation: `GPTModule(["--num-layers", "4", ...])`."""

    def __init__(self, flags: list[str] | None = None) -> None:
        configs = lightning_configs(gpt.parse_args(flags or []))
        super().__init__(gpt.GPTPretraining(configs), configs)


class ChatSFTModule(MegaliteModule):
    """Chat supervised finetuning of a GPT-family model (finetune_gpt.py's flags)."""

    def __init__(self, flags: list[str] | None = None) -> None:
        super().__init__(sft.ChatFinetuning(), lightning_configs(sft.parse(flags or [])))


class BertClassificationModule(MegaliteModule):
    """BERT sentence-pair classification (finetune_bert.py's flags): the pretrained weights
    at the start, the accuracy at each validation point, the best epoch kept and exported at
    the end as finetune_bert.py does."""

    def __init__(self, flags: list[str] | None = None) -> None:
        super().__init__(bert.PairClassification(), lightning_configs(bert.parse(flags or [])))

    def log_validation(self) -> None:
        correct, total = self.task.counts[-1]
        self.log_value("valid_accuracy", correct / total)
