"""Pretrain a GPT model: `python pretrain_gpt.py` trains a small GPT on the built-in corpus.

Multi-rank: `torchrun --nproc_per_node 8 pretrain_gpt.py --tp 2 --pp 2 --dp 2`; long
sequences: `--sequence-parallel` (TP > 1) and `--cp N` (context parallelism).
Own data: `--data-path PREFIX --tokenizer TOKENIZER` (see tools/preprocess_data.py).
"""
import functools
import itertools
import os
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist

from megalite import checkpointing, device
from megalite.config import Configs, parse_configs
from megalite.data.builtin_corpus import builtin_corpus
from megalite.data.gpt_dataset import build_gpt_datasets, parse_data_path
from megalite.data.loader import default_num_workers, token_batches
from megalite.data.samplers import PretrainingSampler
from megalite.data.tokenizers import build_tokenizer
from megalite.models import GPTModel
from megalite.mpu import parallel_state as ps
from megalite.mpu.context_parallel import chunk_positions, get_batch_on_this_cp_rank
from megalite.resilience import NonFiniteError
from megalite.training import pretrain

# A small GPT that trains visibly on 2 CPU cores in a few minutes.
DEFAULTS = dict(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=128,
                max_position_embeddings=128, micro_batch_size=8, train_iters=150, lr=1e-3,
                lr_warmup_iters=15, eval_interval=50, eval_iters=4, log_interval=10,
                hidden_dropout=0.0, attention_dropout=0.0, save="checkpoints/gpt_default")


def take_tokenizer_vocab(configs: Configs) -> None:
    """--vocab-size from --tokenizer; ValueError if an explicit --vocab-size disagrees."""
    try:
        size = build_tokenizer(configs.data.tokenizer).vocab_size
    except (OSError, ValueError):
        raise
    except Exception as error:  # sentencepiece / transformers reading a foreign file
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ValueError(f"--tokenizer {configs.data.tokenizer}: cannot be read as a tokenizer "
                         f"({reason})") from None
    if "vocab_size" in configs.explicit and configs.model.vocab_size != size:
        raise ValueError(f"--vocab-size {configs.model.vocab_size} disagrees with --tokenizer "
                         f"{configs.data.tokenizer} ({size} tokens); drop --vocab-size")
    configs.model.vocab_size = size


def check_inputs(configs: Configs) -> None:
    """Before any process group: the vocabulary size from --tokenizer or, when resuming
    without either flag, from the checkpoint."""
    if configs.data.tokenizer:
        take_tokenizer_vocab(configs)
    elif "vocab_size" not in configs.explicit and configs.checkpoint.load and \
            (meta := checkpointing.read_meta(configs.checkpoint.load)):
        configs.model.vocab_size = meta["model_config"]["vocab_size"]


def prepare(configs: Configs) -> None:
    """Build the built-in corpus on first use (rank 0) and take the tokenizer's vocabulary."""
    if not configs.data.data_path:
        corpus = builtin_corpus(is_builder_rank=dist.get_rank() == 0, barrier=dist.barrier)
        configs.data.data_path = [corpus.data_prefix]
        configs.data.tokenizer = corpus.tokenizer_path
        take_tokenizer_vocab(configs)


def model_provider(configs: Configs, pre_process: bool, post_process: bool) -> torch.nn.Module:
    return GPTModel(configs.model, pre_process=pre_process, post_process=post_process,
                    init_seed=configs.train.seed, params_dtype=configs.precision.params_dtype,
                    device=device.current_device(),
                    sequence_parallel=configs.parallel.sequence_parallel)


def loss_func(per_token_loss: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss [b, s] -> (mean loss in fp32, {"lm loss": it} for logging)."""
    loss = per_token_loss.float().mean()
    return loss, {"lm loss": loss.detach()}


def forward_step(data_iterator: Iterator, model: torch.nn.Module):
    """tokens [b, s+1] -> per-token loss [b, s] on the last stage (hidden [s, b, h] elsewhere);
    with context parallelism this CP rank's [b, s/cp] tokens, labels and positions. A batch
    without tokens is a middle stage's: its input comes from the previous stage."""
    batch = next(data_iterator)
    if "tokens" not in batch:
        return model(None, None, batch["position_ids"]), loss_func
    tokens = batch["tokens"].to(device.current_device(), non_blocking=True)
    inputs, labels, position_ids = get_batch_on_this_cp_rank(tokens[:, :-1], tokens[:, 1:])
    return model(inputs, labels, position_ids), loss_func


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
    built by --num-workers processes and moved to the device; middle stages read none."""
    d, t = configs.data, configs.train
    cache = d.data_cache_dir or os.path.join(os.path.dirname(parse_data_path(d.data_path)[1][0]),
                                             "index_cache")
    train, valid, _ = build_gpt_datasets(d.data_path, d.split, t.seq_length, num_samples, t.seed,
                                         cache, is_builder_rank=dist.get_rank() == 0,
                                         barrier=dist.barrier)
    rank, size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    reads_tokens = ps.is_pipeline_first_stage(ignore_virtual=True) or \
        ps.is_pipeline_last_stage(ignore_virtual=True)
    workers = default_num_workers() if d.num_workers is None else d.num_workers

    def iterator(dataset, start: int):
        if dataset is None:
            return None
        if not reads_tokens:
            return middle_stage_batches(t.seq_length)
        sampler = PretrainingSampler(len(dataset), start, t.micro_batch_size, rank, size)
        return token_batches(dataset, sampler, workers, device.current_device())
    return iterator(train, consumed), iterator(valid, 0)


def main(argv: list[str] | None = None) -> None:
    configs = parse_configs(argv, __doc__, DEFAULTS)
    if not {"save", "load"} & configs.explicit:  # the default run resumes its own checkpoint
        configs.checkpoint.load = configs.checkpoint.save
    try:
        pretrain(configs, functools.partial(model_provider, configs), forward_step,
                 datasets_provider, prepare=prepare, check_inputs=check_inputs)
    except NonFiniteError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
