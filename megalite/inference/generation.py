"""Batched generation under TP and PP: prefill the prompts, then decode one token at a time
against a KV cache sized by the request.

Prompts of different lengths are left-padded; the padding is excluded by the attention mask
and skipped by the position ids, so every row computes what it would alone. Each forward
step runs the pipeline stages in turn (activations [s, b, h] sent point-to-point on the
pipeline group); the last stage picks the next tokens (its TP ranks agree) and broadcasts
them on the pipeline group, so every rank sees every token and applies the same stop rules.
"""
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megalite.inference.kv_cache import KVCache
from megalite.inference.sampling import SamplingParams, next_tokens
from megalite.models.sharding import unwrap
from megalite.mpu import comm, parallel_state as ps
from megalite.schedules.p2p import Channel

# stop(row, new tokens of that row so far) -> whether the row is finished
StopRule = Callable[[int, list[int]], bool]


@dataclass
class GenerationStats:
    """Filled in by `generate_steps`: prompt tokens (without padding) and prefill seconds,
    new tokens (over all rows) and decode seconds, and the bytes this rank's KV cache holds
    per position of one sequence (all layers; multi-head latent attention: its latent and
    RoPE key)."""

    prompt_tokens: int = 0
    prefill_s: float = 0.0
    new_tokens: int = 0
    decode_s: float = 0.0
    kv_cache_bytes_per_token: int = 0


def _model(model: nn.Module | list[nn.Module]) -> nn.Module:
    chunks = model if isinstance(model, list) else [model]
    if len(chunks) != 1:
        raise ValueError("generation runs one model chunk per pipeline rank (no --vpp)")
    return unwrap(chunks[0])


def check_prompts(prompts: list[list[int]], context: int) -> None:
    """One ValueError for an empty batch, an empty prompt, or one that fills the context."""
    if not prompts:
        raise ValueError("no prompt given")
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {i} is empty (expected at least one token)")
        if len(prompt) >= context:
            raise ValueError(f"prompt {i} has {len(prompt)} tokens, the model's context is "
                             f"{context} (--max-position-embeddings): expected fewer")


def _shared_seed(params: SamplingParams, device: torch.device) -> int | None:
    """The request's seed; when sampling without one, rank 0 draws it for every rank (world
    group)."""
    if params.greedy or params.seed is not None:
        return params.seed
    seed = torch.tensor([random.randrange(2 ** 62)], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(seed, src=0)
    return int(seed)


def _left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """-> tokens [b, S] left-padded with pad_id, valid [b, S] (False on padding)."""
    longest = max(map(len, prompts))
    tokens = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    valid = torch.zeros(len(prompts), longest, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        tokens[row, longest - len(prompt):] = torch.tensor(prompt)
        valid[row, longest - len(prompt):] = True
    return tokens.to(device), valid.to(device)


def pipeline_forward(model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor,
                     mask: torch.Tensor | None, cache: KVCache | None) -> torch.Tensor | None:
    """One forward step through every pipeline stage (call on all of them).

    tokens, positions [b, s] -> last stage: vocab-parallel logits, of the last position
    [b, V/tp] with a `cache` (which then moves on by s), of every position [b, s, V/tp]
    without; other stages: None (they send [s, b, h] on to the next stage).
    """
    b, s = tokens.shape
    param = next(model.parameters())
    channel = Channel((s, b, model.config.hidden_size), param.dtype, param.device)
    rank = ps.get_pipeline_model_parallel_rank()
    with torch.no_grad():
        if not model.pre_process:
            model.set_input_tensor(channel.exchange([("recv", None, rank - 1)])[0])
        out = model(tokens, position_ids=positions, attention_mask=mask, inference_params=cache)
    if cache is not None:
        cache.advance(s)
    if not model.post_process:
        channel.exchange([("send", out, rank + 1)])
        return None
    return out


class BatchDecoder:
    """A batch of prompts of different lengths and its KV cache of `longest + max_new`
    positions: `prefill()` runs the prompts, then `decode(tokens [b])` one new token per row;
    both return the last stage's vocab-parallel logits [b, V/tp] for the next token (None
    on other stages). Padding is left: masked as keys, skipped by the positions."""

    def __init__(self, model: nn.Module, prompts: list[list[int]], max_new: int,
                 pad_id: int = 0) -> None:
        self.model = model
        device = next(model.parameters()).device
        self.tokens, valid = _left_pad(prompts, pad_id, device)
        b, self.longest = self.tokens.shape
        self.padded = not bool(valid.all())
        self.positions = (valid.long().cumsum(1) - 1).clamp(min=0)
        self.next_position = torch.tensor([len(p) for p in prompts], device=device)
        self.key_valid = torch.ones(b, self.longest + max_new, dtype=torch.bool, device=device)
        self.key_valid[:, :self.longest] = valid
        self.cache = KVCache(self.longest + max_new)

    def prefill(self) -> torch.Tensor | None:
        mask = None
        if self.padded:  # a padding query attends to itself only, so no softmax row is empty
            eye = torch.eye(self.longest, dtype=torch.bool, device=self.tokens.device)
            mask = self.key_valid[:, None, None, :self.longest] | eye
        return pipeline_forward(self.model, self.tokens, self.positions, mask, self.cache)

    def decode(self, tokens: torch.Tensor) -> torch.Tensor | None:
        keys = self.cache.offset + 1
        mask = self.key_valid[:, None, None, :keys] if self.padded else None
        positions = self.next_position.unsqueeze(1)
        self.next_position = self.next_position + 1
        return pipeline_forward(self.model, tokens.unsqueeze(1), positions, mask, self.cache)


def generate_steps(model: nn.Module | list[nn.Module], prompts: list[list[int]],
                   params: SamplingParams, eos_id: int | None = None,
                   stop: StopRule | None = None, pad_id: int = 0,
                   stats: GenerationStats | None = None) -> Iterator[list[int | None]]:
    """Yield, per decoding step, each row's new token (None once the row has finished).

    A row finishes after `eos_id`, when `stop` says so, after `params.max_new_tokens`, or
    when the model's context is full. Call on every rank of the model with the same
    arguments (collectives on the TP and pipeline groups, and on the world group to share
    a drawn seed).
    """
    model = _model(model)
    params.validate()
    context = model.config.max_position_embeddings
    check_prompts(prompts, context)
    stats = stats if stats is not None else GenerationStats()
    lengths = [len(p) for p in prompts]
    max_new = min(params.max_new_tokens, context - max(lengths))
    if max_new == 0:
        return
    device = next(model.parameters()).device
    seed = _shared_seed(params, device)
    generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    vocab_start = model.output_weights().vocab_start if model.post_process else 0
    tp_group = ps.get_tensor_model_parallel_group()
    pp_group = ps.get_pipeline_model_parallel_group()
    last_stage_rank = ps.get_pipeline_model_parallel_ranks()[-1]
    decoder = BatchDecoder(model, prompts, max_new, pad_id)
    new: list[list[int]] = [[] for _ in prompts]
    finished = [False] * len(prompts)
    start = time.perf_counter()
    logits = decoder.prefill()
    stats.kv_cache_bytes_per_token = decoder.cache.bytes_per_token()
    for t in range(max_new):
        chosen = torch.empty(len(prompts), dtype=torch.long, device=device)
        if logits is not None:
            with torch.no_grad():
                chosen = next_tokens(logits, params, model.config.vocab_size, vocab_start,
                                     tp_group, generator)
        comm.broadcast(chosen, last_stage_rank, pp_group)
        if t == 0:
            stats.prompt_tokens += sum(lengths)
            stats.prefill_s += time.perf_counter() - start
            start = time.perf_counter()
        out: list[int | None] = []
        for row, token in enumerate(chosen.tolist()):
            if finished[row]:
                out.append(None)
                continue
            new[row].append(token)
            out.append(token)
            stats.new_tokens += 1
            finished[row] = token == eos_id or bool(stop and stop(row, new[row]))
        yield out
        if all(finished) or t == max_new - 1:
            break
        logits = decoder.decode(chosen)
    stats.decode_s += time.perf_counter() - start


def generate(model: nn.Module | list[nn.Module], prompts: list[list[int]],
             params: SamplingParams, eos_id: int | None = None, stop: StopRule | None = None,
             pad_id: int = 0, stats: GenerationStats | None = None) -> list[list[int]]:
    """The new tokens of each prompt (ending with `eos_id` where it was produced)."""
    new: list[list[int]] = [[] for _ in prompts]
    for step in generate_steps(model, prompts, params, eos_id, stop, pad_id, stats):
        for row, token in enumerate(step):
            if token is not None:
                new[row].append(token)
    return new
