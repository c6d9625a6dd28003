"""Pretrain a GPT model: `python pretrain_gpt.py` trains a small GPT on the built-in corpus.

Multi-rank: `torchrun --nproc_per_node 8 pretrain_gpt.py --tp 2 --pp 2 --dp 2`; long
sequences: `--sequence-parallel` (TP > 1) and `--cp N` (context parallelism). Packed documents
(Megatron's flags): `--reset-position-ids --reset-attention-mask --eod-mask-loss`.
Own data: `--data-path PREFIX --tokenizer TOKENIZER` (see tools/preprocess_data.py).
Continue a checkpoint (e.g. converted from transformers or GGUF): `--load DIR` alone; the model
and its tokenizer come from the checkpoint, the built-in corpus is tokenised with that
tokenizer, and checkpoints are written only with `--save DIR`.
"""
import functools
import itertools
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist

from megalite import checkpoint, device
from megalite.checkpoint.metadata import model_from_checkpoint
from megalite.config import Configs
from megalite.data.builtin_corpus import builtin_corpus
from megalite.data.gpt_dataset import build_gpt_datasets, parse_data_path
from megalite.data.loader import default_num_workers, token_batches
from megalite.data.packed import with_document_layout
from megalite.data.samplers import PretrainingSampler
from megalite.data.tokenizers import build_tokenizer
from megalite.layout import global_batch_size
from megalite.models import GPTModel
from megalite.mpu import parallel_state as ps
from megalite.mpu.context_parallel import chunk_positions, get_batch_on_this_cp_rank
from megalite.mpu.document_mask import DocumentMask
from megalite.tasks import runner
from megalite.training import PretrainTask, TrainResult

# A small GPT that trains visibly on 2 CPU cores in a few minutes.
DEFAULTS = dict(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=128,
                max_position_embeddings=128, micro_batch_size=8, train_iters=150, lr=1e-3,
                lr_warmup_iters=15, eval_interval=50, eval_iters=4, log_interval=10,
                hidden_dropout=0.0, attention_dropout=0.0, save="checkpoints/gpt_default")


def take_tokenizer_vocab(configs: Configs, from_checkpoint: bool) -> None:
    """--vocab-size from --tokenizer; ValueError if an explicit --vocab-size disagrees or, when
    the model comes from a checkpoint, if the tokenizer has more tokens than the model."""
    try:
        size = build_tokenizer(configs.data.tokenizer).vocab_size
    except (OSError, ValueError):
        raise
    except Exception as error:  # sentencepiece / transformers reading a foreign file
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ValueError(f"--tokenizer {configs.data.tokenizer}: cannot be read as a tokenizer "
                         f"({reason})") from None
    if from_checkpoint:
        if size > configs.model.vocab_size:
            raise ValueError(f"--tokenizer {configs.data.tokenizer} has {size} tokens, more than "
                             f"the vocabulary of the --load checkpoint's model "
                             f"({configs.model.vocab_size}); expected its own tokenizer")
        return
    if "vocab_size" in configs.explicit and configs.model.vocab_size != size:
        raise ValueError(f"--vocab-size {configs.model.vocab_size} disagrees with --tokenizer "
                         f"{configs.data.tokenizer} ({size} tokens); drop --vocab-size")
    configs.model.vocab_size = size


def _loaded_meta(configs: Configs) -> dict | None:
    """The metadata of the checkpoint --load resumes from (None: no --load or none there yet)."""
    return configs.checkpoint.load and checkpoint.read_meta(configs.checkpoint.load)


def check_inputs(configs: Configs) -> None:
    """Before any process group: with a --load checkpoint the model from its metadata (a
    model flag given must agree) and its tokenizer unless --tokenizer is given; the
    vocabulary size from the tokenizer otherwise."""
    meta = _loaded_meta(configs)
    if meta:
        configs.model = model_from_checkpoint(meta["model_config"], configs.model,
                                              configs.explicit, configs.checkpoint.load)
        configs.data.tokenizer = configs.data.tokenizer or \
            checkpoint.checkpoint_tokenizer(configs.checkpoint.load, meta)
    if configs.data.tokenizer:
        take_tokenizer_vocab(configs, from_checkpoint=bool(meta))
    d = configs.data
    packed = [flag for flag in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")
              if getattr(d, flag)]
    if packed and d.data_path and not d.tokenizer:
        raise ValueError(f"--{packed[0].replace('_', '-')} needs --tokenizer with --data-path "
                         f"(its end-of-document token separates the documents)")


def prepare(configs: Configs) -> None:
    """Without --data-path: the built-in corpus (built on first use by rank 0), tokenised with
    the run's tokenizer when it has one, else with the corpus's own (its vocabulary)."""
    if not configs.data.data_path:
        tokenizer = configs.data.tokenizer
        corpus = builtin_corpus(is_builder_rank=dist.get_rank() == 0, barrier=dist.barrier,
                                tokenizer=tokenizer)
        configs.data.data_path = [corpus.data_prefix]
        if not tokenizer:
            configs.data.tokenizer = corpus.tokenizer_path
            take_tokenizer_vocab(configs, from_checkpoint=bool(_loaded_meta(configs)))


def model_provider(configs: Configs, pre_process: bool, post_process: bool) -> torch.nn.Module:
    return GPTModel(configs.model, pre_process=pre_process, post_process=post_process,
                    init_seed=configs.train.seed, params_dtype=configs.precision.params_dtype,
                    device=device.current_device(),
                    sequence_parallel=configs.parallel.sequence_parallel)


def loss_func(loss_mask: torch.Tensor | None, denominator: torch.Tensor | None,
              per_token_loss: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss [b, s] -> (loss in fp32, {"lm loss": it} for logging): the mean over all
    tokens, or with loss_mask [b, s] the masked losses summed and divided by `denominator`
    (the loss-bearing tokens this value stands for; see `forward_step`)."""
    if loss_mask is None:
        loss = per_token_loss.float().mean()
    else:
        loss = (per_token_loss.float() * loss_mask).sum() / denominator
    return loss, {"lm loss": loss.detach()}


def forward_step(data_iterator: Iterator, model: torch.nn.Module):
    """tokens [b, s+1] -> per-token loss [b, s] on the last stage (hidden [s, b, h] elsewhere);
    with context parallelism this CP rank's [b, s/cp] tokens, labels and positions. A batch
    without tokens is a middle stage's: its input comes from the previous stage.

    Packed batches (megalite.data.packed) may carry position_ids (restarting per document),
    document_ids (attention within each document), loss_mask, all [b, s], and
    loss_denominator: the masked loss is summed and divided by it, by default the
    microbatch's loss-bearing tokens / CP (CP ranks' values are averaged), so the loss is
    their mean."""
    batch = next(data_iterator)
    if "tokens" not in batch:
        return model(None, None, batch["position_ids"]), functools.partial(loss_func, None, None)
    target = device.current_device()
    batch = {name: value.to(target, non_blocking=True) for name, value in batch.items()}
    tokens, names = batch["tokens"], [n for n in ("position_ids", "loss_mask") if n in batch]
    inputs, labels, *fields, positions = get_batch_on_this_cp_rank(
        tokens[:, :-1], tokens[:, 1:], *(batch[n] for n in names))
    fields = dict(zip(names, fields))
    documents = DocumentMask(batch["document_ids"]) if "document_ids" in batch else None
    loss_mask, denominator = fields.get("loss_mask"), batch.get("loss_denominator")
    if loss_mask is not None and denominator is None:
        denominator = batch["loss_mask"].sum().clamp(min=1) / \
            ps.get_context_parallel_world_size()
    output = model(inputs, labels, fields.get("position_ids", positions), documents)
    return output, functools.partial(loss_func, loss_mask, denominator)


def middle_stage_batches(seq_length: int) -> Iterator[dict]:
    """The batches of a rank that holds neither the first nor the last pipeline stage: no
    tokens, only this CP rank's positions [1, s/cp] (None without CP) for rotary embeddings."""
    cp = ps.get_context_parallel_world_size()
    positions = None if cp == 1 else chunk_positions(
        seq_length, cp, ps.get_context_parallel_rank(), device.current_device()).unsqueeze(0)
    return itertools.repeat({"position_ids": positions})


def datasets_provider(configs: Configs, num_samples: tuple[int, int, int], consumed: int):
    """Train and validation iterators over this DP rank's microbatches. Only the ranks of the
    first stage (inputs) and of the last (labels) read tokens, each TP rank its own copy,
    built by --num-workers processes and moved to the device; middle stages read none, unless
    a packed-documents flag asks for per-document positions or masks (then every stage
    reads them: its attention and rotary positions depend on the documents)."""
    d, t = configs.data, configs.train
    cache = d.data_cache_dir or os.path.join(os.path.dirname(parse_data_path(d.data_path)[1][0]),
                                             "index_cache")
    train, valid, _ = build_gpt_datasets(d.data_path, d.split, t.seq_length, num_samples, t.seed,
                                         cache, is_builder_rank=dist.get_rank() == 0,
                                         barrier=dist.barrier)
    rank, size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    packed = d.reset_position_ids or d.reset_attention_mask or d.eod_mask_loss
    reads_tokens = packed or ps.is_pipeline_first_stage(ignore_virtual=True) or \
        ps.is_pipeline_last_stage(ignore_virtual=True)
    workers = default_num_workers() if d.num_workers is None else d.num_workers
    eod = build_tokenizer(d.tokenizer).eod if packed else None

    def iterator(dataset, start: int):
        if dataset is None:
            return None
        if not reads_tokens:
            return middle_stage_batches(t.seq_length)
        sampler = PretrainingSampler(len(dataset), start, t.micro_batch_size, rank, size)
        batches = token_batches(dataset, sampler, workers, device.current_device())
        return with_document_layout(batches, eod, d.reset_position_ids, d.reset_attention_mask,
                                    d.eod_mask_loss) if packed else batches
    # a resumed run's validations go on after those its first part made (Megatron's
    # consumed_valid_samples): one per --eval-interval steps, --eval-iters global batches each
    batch = global_batch_size(t, size)
    done = consumed // batch // t.eval_interval if t.eval_interval else 0
    return iterator(train, consumed), iterator(valid, done * t.eval_iters * batch)


class GPTPretraining(PretrainTask):
    """GPT pretraining: this module's Megatron-style provider functions as a Task (what
    `pretrain(configs, model_provider, forward_step, datasets_provider)` trains)."""

    def __init__(self, configs: Configs) -> None:
        super().__init__(functools.partial(model_provider, configs), forward_step,
                         datasets_provider, prepare=prepare, check_inputs=check_inputs)


def parse_args(argv: list[str] | None = None) -> Configs:
    """The run's configs. With neither --save nor --load the run saves to and resumes from
    checkpoints/gpt_default; --load alone writes no checkpoint (as in Megatron-LM: only
    --save does), so the loaded one is never overwritten."""
    return runner.parse(argv, __doc__, DEFAULTS)


def run(argv: list[str] | None = None) -> TrainResult:
    """Train as the command line says, in this (possibly already distributed) process."""
    configs = parse_args(argv)
    return runner.train(configs, GPTPretraining(configs))


def main(argv: list[str] | None = None) -> TrainResult:
    """pretrain_gpt.py: `run` under the runner's error-exit policy."""
    return runner.main(run, argv)
