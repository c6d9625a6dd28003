"""Packed sequences: several documents (or conversations) in one row of a batch.

Pretraining (Megatron's get_ltor_masks_and_position_ids): a row of tokens whose documents end
with the end-of-document (EOD) token; `document_layout` derives, on the device and without a
host read, each token's document id (the EOD belongs to the document it ends) and its
position inside its document. `with_document_layout` adds what the flags --reset-position-ids,
--reset-attention-mask and --eod-mask-loss ask for to every batch of an iterator.

Finetuning: `pack_examples` places variable-length examples (token ids and a per-token loss
flag) into rows of a fixed length, first fit in the given order, with the same per-row
fields (host arrays); `pad_examples` puts one example per row instead;
`token_weighted_batches` cuts global batches of rows into microbatches whose losses add up to
the mean over every loss-bearing token of the global batch.

Batch fields (all optional but "tokens"): tokens [b, s + 1]; position_ids, document_ids,
loss_mask [b, s] (for the inputs tokens[:, :-1] and the labels tokens[:, 1:]); a 0-d
loss_denominator (see megalite.tasks.gpt.forward_step).
"""
from collections.abc import Iterator, Sequence

import numpy as np
import torch


def document_layout(tokens: torch.Tensor, eod: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [b, s] -> (document ids [b, s], positions restarting after each EOD [b, s])."""
    is_eod = (tokens == eod).long()
    document_ids = is_eod.cumsum(1) - is_eod
    index = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    starts = torch.ones_like(tokens, dtype=torch.bool)
    starts[:, 1:] = is_eod[:, :-1].bool()
    first = torch.where(starts, index, 0).cummax(1).values
    return document_ids, index - first


def with_document_layout(batches: Iterator[dict], eod: int, reset_position_ids: bool,
                         reset_attention_mask: bool, eod_mask_loss: bool) -> Iterator[dict]:
    """Each {"tokens": [b, s + 1]} batch with position_ids (--reset-position-ids),
    document_ids (--reset-attention-mask) and loss_mask (--eod-mask-loss: no loss on the
    prediction made at an EOD input, the first token of the next document) of its inputs."""
    for batch in batches:
        inputs = batch["tokens"][:, :-1]
        document_ids, positions = document_layout(inputs, eod)
        if reset_position_ids:
            batch["position_ids"] = positions
        if reset_attention_mask:
            batch["document_ids"] = document_ids
        if eod_mask_loss:
            batch["loss_mask"] = (inputs != eod).float()
        yield batch


def _row(examples: Sequence[tuple[np.ndarray, np.ndarray]], length: int, pad: int) -> dict:
    """One row of `length` + 1 tokens from whole examples, then padding (its own document)."""
    tokens = np.full(length + 1, pad, dtype=np.int64)
    labels_flag = np.zeros(length + 1, dtype=bool)
    document = np.full(length + 1, len(examples), dtype=np.int64)
    positions = np.zeros(length + 1, dtype=np.int64)
    start = 0
    for number, (ids, flags) in enumerate(examples):
        end = start + len(ids)
        tokens[start:end], labels_flag[start:end] = ids, flags
        document[start:end], positions[start:end] = number, np.arange(len(ids))
        start = end
    positions[start:] = np.arange(length + 1 - start)
    same = document[:-1] == document[1:]  # a label of the input's own document
    return {"tokens": tokens, "position_ids": positions[:-1], "document_ids": document[:-1],
            "loss_mask": (labels_flag[1:] & same).astype(np.float32)}


def pack_examples(examples: Sequence[tuple[np.ndarray, np.ndarray]], seq_length: int,
                  pad: int) -> dict[str, torch.Tensor]:
    """Examples (ids, loss flags per token; each at most seq_length + 1 tokens) -> rows
    {tokens [n, s + 1], position_ids, document_ids, loss_mask [n, s]}: each example goes into
    the first row it fits in (first fit, in order); the rest of a row is padding."""
    rows: list[list] = []
    room: list[int] = []
    for example in examples:
        need = len(example[0])
        row = next((i for i, free in enumerate(room) if free >= need), None)
        if row is None:
            rows.append([])
            room.append(seq_length + 1)
            row = len(rows) - 1
        rows[row].append(example)
        room[row] -= need
    return _stack([_row(row, seq_length, pad) for row in rows])


def pad_examples(examples: Sequence[tuple[np.ndarray, np.ndarray]], seq_length: int,
                 pad: int) -> dict[str, torch.Tensor]:
    """One example per row, padded (the same fields as pack_examples)."""
    return _stack([_row([example], seq_length, pad) for example in examples])


def _stack(rows: list[dict]) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(np.stack([row[name] for row in rows])) for name in rows[0]}


def pad_rows(rows: dict[str, torch.Tensor], multiple: int) -> dict[str, torch.Tensor]:
    """Append copies of row 0 without loss up to a multiple of `multiple` rows."""
    extra = -len(rows["tokens"]) % multiple
    padded = {k: torch.cat([v, v[:1].expand(extra, *v.shape[1:])]) for k, v in rows.items()}
    padded["loss_mask"][len(rows["tokens"]):] = 0
    return padded


def token_weighted_batches(rows: dict[str, torch.Tensor], orders: Iterator[torch.Tensor],
                           micro_batch_size: int, dp_rank: int, dp: int, divisor: int,
                           total_tokens: float | None = None) -> Iterator[dict]:
    """This DP rank's microbatches of each global batch of row indices `orders` yields
    (microbatch j of rank d: rows [(j dp + d) micro, ... + micro) of it, as the samplers cut
    them), each with loss_denominator = the loss-bearing tokens of its global batch (or
    `total_tokens`) / `divisor`. With divisor = microbatches x DP x CP (the values the loop
    averages) the loss is the mean over every loss-bearing token of the global batch,
    whatever the packing, microbatching and layout."""
    for chosen in orders:
        tokens = rows["loss_mask"][chosen].sum() if total_tokens is None else \
            torch.tensor(total_tokens)
        denominator = tokens.float().clamp(min=1) / divisor
        for start in range(dp_rank * micro_batch_size, len(chosen), dp * micro_batch_size):
            take = chosen[start:start + micro_batch_size]
            yield {**{k: v[take] for k, v in rows.items()}, "loss_denominator": denominator}
