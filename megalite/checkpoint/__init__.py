"""Distributed, atomic, pickle-free checkpoints: every rank writes the slices it owns, and a
load reshards weights and optimizer state to any layout.

Layout of `<dir>/iter_<N:07d>/`:
  meta.json                   iteration, consumed samples, the whole model config, parameter
                              dtype, optimizer settings, scheduler and loss-scaler states,
                              parallel layout, the training task's small JSON state (rank 0)
  index.json                  per global tensor (by kind: "model", "main", "optim.exp_avg", ...)
                              its global shape, dtype and which file holds which slice
                              (shards.py); per-parameter scalars (Adam's step)
  shard_<R>.safetensors/.json the slices rank R owns (state.py): its TP shard,
                              its DP share (its ZeRO-1 fragment, or an even split over DP),
                              its stage's and its experts' parameters under their global names
  rank_<R>.json/.safetensors  rank R's RNG states (files.py: JSON + tensors)
  tokenizer/                  the tokenizer the model was trained with, when the run had one
                              (Tokenizer.save: a sentencepiece .model or a transformers
                              tokenizer directory); meta.json names it
`<dir>/latest_checkpointed_iteration.txt` names the newest complete iteration.

Nothing is unpickled. A save checks on every rank that the weights are finite, copies each
rank's slices to the host, writes them into `iter_<N>.tmp` (in a background thread with
--async-save: `PendingSave`, saving.py), fsyncs every file and directory, and once every rank has
finished rank 0 writes the index, renames the directory (an older copy of the same iteration
is moved aside first and deleted only after the new one is in place) and then replaces the
marker, so an interrupted save never becomes what `--load` picks. A load reads, on each
rank, only the slices of its own parameters and optimizer fragments, under any TP/PP/VPP/
DP/CP/EP layout and ZeRO sharding; RNG states apply under the saved layout only (else
re-seeded, one line). Format-2 checkpoints (full tensors per stage) load their weights.
`verify` checks, with no communication, that every file the run needs exists and
is complete, so every rank reports the same error line.

The package: files.py (safetensors and JSON files, fsync), slices.py (which slice of a
global tensor a rank owns), shards.py (per-rank shard files and the merged index), state.py
(model and optimizer state to and from slices), metadata.py (meta.json, compatibility),
rng.py, dirs.py (iteration directories, marker, publish, retention), legacy.py (format 2),
saving.py and loading.py.
"""
from megalite.checkpoint.dirs import (MARKER, describe_start, iteration_dir, latest_iteration,
                                      mark_latest, prune_checkpoints)
from megalite.checkpoint.loading import load, read_full_model, read_model_weights, verify
from megalite.checkpoint.metadata import (FORMAT, check_compatible, checkpoint_tokenizer,
                                          model_from_checkpoint, read_meta)
from megalite.checkpoint.saving import PendingSave, save, write_weights_checkpoint

__all__ = ["MARKER", "FORMAT", "PendingSave", "save", "load", "read_meta", "verify",
           "check_compatible", "checkpoint_tokenizer", "model_from_checkpoint", "describe_start",
           "iteration_dir", "latest_iteration", "mark_latest", "prune_checkpoints",
           "read_full_model", "read_model_weights", "write_weights_checkpoint"]
