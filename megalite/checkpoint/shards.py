"""Slices of global tensors in safetensors files, and the JSON index that says where each lies.

Every rank writes one `shard_<R>.safetensors` (the slices it owns, keys `<kind>/<name>/<i>`)
and a small `shard_<R>.json` listing them; rank 0 merges the lists into `index.json`:

    {"<kind>": {"<global name>": {"shape": [...], "dtype": "float32",
                                  "pieces": [["shard_00003.safetensors", key, offsets, lengths]]}}}

with kinds "model" (the parameters, in their training dtype), "main" (fp32 master copies of
bf16/fp16 parameters) and "optim.<state>" (e.g. "optim.exp_avg"), and "scalars": {name:
{state: value}} (e.g. Adam's step). A reader fills any box of a global tensor from the pieces
that overlap it, reading only those byte ranges (`safe_open(...).get_slice(key)[...]`).
"""
import os

import torch
from safetensors import safe_open

from megalite.checkpoint.files import (CheckpointFileError, read_json, safetensors_shapes,
                                       write_json, write_tensors)
from megalite.checkpoint.slices import Box, box_slices

INDEX = "index.json"


def shard_name(rank: int) -> str:
    return f"shard_{rank:05d}"


class ShardWriter:
    """One rank's slices: add them (views of the live tensors, nothing is copied; an async
    save stages them first, staging.py), then `write` them, streamed (files.write_tensors),
    from any thread (no communication)."""

    def __init__(self, rank: int) -> None:
        self.name = shard_name(rank)
        self.tensors: dict[str, torch.Tensor] = {}
        self.entries: list[list] = []  # [kind, name, global shape, dtype, key, offsets, lengths]
        self.scalars: dict[str, dict[str, float]] = {}

    def add(self, kind: str, name: str, shape: tuple[int, ...], box: Box,
            values: torch.Tensor) -> None:
        key = f"{kind}/{name}/{len(self.tensors)}"
        self.tensors[key] = values.detach()
        self.entries.append([kind, name, list(shape), str(values.dtype).removeprefix("torch."),
                             key, list(box[0]), list(box[1])])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def write(self, directory: str) -> None:
        """`<directory>/shard_<R>.safetensors` and its `.json` list, fsynced."""
        write_tensors(os.path.join(directory, self.name + ".safetensors"), self.tensors)
        write_json(os.path.join(directory, self.name + ".json"),
                   {"entries": self.entries, "scalars": self.scalars})


def merge_index(directory: str, world_size: int) -> dict:
    """index.json from every rank's shard list (rank 0, once all are written)."""
    index: dict = {"scalars": {}}
    for rank in range(world_size):
        listing = read_json(os.path.join(directory, shard_name(rank) + ".json"))
        for kind, name, shape, dtype, key, offsets, lengths in listing["entries"]:
            entry = index.setdefault(kind, {}).setdefault(
                name, {"shape": shape, "dtype": dtype, "pieces": []})
            entry["pieces"].append([shard_name(rank) + ".safetensors", key, offsets, lengths])
        for name, values in listing["scalars"].items():
            index["scalars"].setdefault(name, {}).update(values)
    write_json(os.path.join(directory, INDEX), index)
    return index


def index_files(index: dict) -> list[str]:
    """Every file the index names, sorted."""
    return sorted({piece[0] for kind, entries in index.items() if kind != "scalars"
                   for entry in entries.values() for piece in entry["pieces"]})


def _overlap(a: Box, b: Box) -> Box | None:
    """The intersection of two boxes, or None."""
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + m, y + n) for x, m, y, n in zip(a[0], a[1], b[0], b[1]))
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, tuple(h - l for l, h in zip(lo, hi))


def _shift(box: Box, origin: tuple[int, ...]) -> Box:
    return tuple(o - z for o, z in zip(box[0], origin)), box[1]


class ShardReader:
    """Reads boxes of the global tensors of a checkpoint directory through its index."""

    def __init__(self, directory: str, index: dict) -> None:
        self.directory, self.index = directory, index
        self._files: dict = {}

    def has(self, kind: str, name: str) -> bool:
        return name in self.index.get(kind, {})

    def entry(self, kind: str, name: str) -> dict:
        entry = self.index.get(kind, {}).get(name)
        if entry is None:
            raise CheckpointFileError(f"{os.path.join(self.directory, INDEX)}: no {kind} "
                                      f"tensor {name!r}")
        return entry

    def _file(self, name: str):
        if name not in self._files:
            self._files[name] = safe_open(os.path.join(self.directory, name), framework="pt")
        return self._files[name]

    def read_into(self, kind: str, name: str, box: Box, out: torch.Tensor) -> None:
        """Fill `out` (shaped like `box`) with `box` of global tensor `name`; every element
        must be covered by the saved pieces."""
        entry, covered = self.entry(kind, name), 0
        if any(o + n > s for o, n, s in zip(*box, entry["shape"])):
            raise CheckpointFileError(f"{self.directory}: {kind} tensor {name!r} has shape "
                                      f"{tuple(entry['shape'])}, this run needs {box}")
        for file, key, offsets, lengths in entry["pieces"]:
            piece = (tuple(offsets), tuple(lengths))
            common = _overlap(piece, box) if box[0] else piece
            if common is None:
                continue
            values = self._file(file).get_slice(key)[box_slices(_shift(common, piece[0]))]
            out[box_slices(_shift(common, box[0]))].copy_(values.reshape(common[1]))
            covered += torch.Size(common[1]).numel()
        if covered != out.numel():
            raise CheckpointFileError(f"{self.directory}: the saved pieces of {kind} tensor "
                                      f"{name!r} cover {covered} of the {out.numel()} elements "
                                      f"this rank needs")

    def read_full(self, kind: str, name: str) -> torch.Tensor:
        """The whole global tensor, in its saved dtype."""
        entry = self.entry(kind, name)
        out = torch.empty(entry["shape"], dtype=getattr(torch, entry["dtype"]))
        self.read_into(kind, name, (tuple(0 for _ in out.shape), tuple(out.shape)), out)
        return out


def verify_files(directory: str, index: dict) -> None:
    """Every shard file the index names exists and holds every byte its header announces
    (headers only); CheckpointFileError naming the first bad file."""
    for name in index_files(index):
        safetensors_shapes(os.path.join(directory, name))
