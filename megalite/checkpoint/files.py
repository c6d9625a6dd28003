"""Pickle-free checkpoint files: nested state as JSON + tensors as safetensors, all fsynced.

`save_state(path, tree)` splits a nested structure of dicts, lists, tuples, tensors, numpy
arrays and plain scalars into `<path>.json` (the structure, tensors replaced by
references) and `<path>.safetensors` (the tensors); `load_state(path)` rebuilds it. Dict
keys that are not strings, tuples and numpy arrays are tagged so they come back as they
were (the RNG states of `random` and numpy, torch optimizer states keyed by int).

`safetensors_shapes(path)` reads only a safetensors header and checks the file holds
every byte the header announces, so a truncated or foreign file is one clear error
before any tensor is read.
"""
import json
import os
import struct

import numpy as np
import torch
from safetensors.torch import load_file, save_file


class CheckpointFileError(ValueError):
    """A checkpoint file is missing, truncated or not what megalite wrote."""


def fsync_dir(path: str) -> None:
    """Make a directory's entries (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: str) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def write_json(path: str, value) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointFileError(f"{path}: missing (expected a megalite checkpoint file)") \
            from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointFileError(f"{path}: unreadable JSON ({error}); truncated or not written "
                                  f"by megalite") from None


def _own(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor that owns its storage (safetensors refuses views and shared storage)."""
    tensor = tensor.detach().cpu()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size() \
            or not tensor.is_contiguous():
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def write_tensors(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """safetensors file of `tensors`, fsynced."""
    save_file({k: _own(v) for k, v in tensors.items()}, path)
    _fsync_file(path)


def safetensors_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """{name: shape} from the header of `path`; CheckpointFileError if missing or truncated."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            header = json.loads(f.read(length)) if 0 <= length <= size - 8 else None
    except FileNotFoundError:
        raise CheckpointFileError(f"{path}: missing (expected a safetensors file)") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        header = None
    if not isinstance(header, dict):
        raise CheckpointFileError(f"{path}: not a safetensors file (truncated or corrupt header)")
    header.pop("__metadata__", None)
    end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    if size < 8 + length + end:
        raise CheckpointFileError(f"{path}: truncated ({size} bytes, the header announces "
                                  f"{8 + length + end})")
    return {name: tuple(v["shape"]) for name, v in header.items()}


def read_tensors(path: str) -> dict[str, torch.Tensor]:
    safetensors_shapes(path)
    return load_file(path)


def _encode(value, tensors: dict[str, torch.Tensor]):
    if isinstance(value, torch.Tensor):
        key = str(len(tensors))
        tensors[key] = value
        return {"__tensor__": key}
    if isinstance(value, np.ndarray):
        return {"__ndarray__": _encode(torch.from_numpy(value.astype(np.int64)
                                                        if value.dtype.kind in "ui" else value),
                                       tensors), "dtype": value.dtype.str}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, tensors) for v in value]}
    if isinstance(value, list):
        return [_encode(v, tensors) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: _encode(v, tensors) for k, v in value.items()}
        return {"__items__": [[_encode(k, tensors), _encode(v, tensors)]
                              for k, v in value.items()]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"checkpoint state: cannot store {type(value).__name__} without pickle")


def _decode(value, tensors: dict[str, torch.Tensor]):
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        return tensors[value["__tensor__"]]
    if "__ndarray__" in value:
        return _decode(value["__ndarray__"], tensors).numpy().astype(np.dtype(value["dtype"]))
    if "__tuple__" in value:
        return tuple(_decode(v, tensors) for v in value["__tuple__"])
    if "__items__" in value:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in value["__items__"]}
    return {k: _decode(v, tensors) for k, v in value.items()}


def save_state(path: str, tree) -> None:
    """`<path>.json` + `<path>.safetensors` holding `tree` (see the module docstring)."""
    tensors: dict[str, torch.Tensor] = {}
    structure = _encode(tree, tensors)
    write_tensors(path + ".safetensors", tensors)
    write_json(path + ".json", structure)


def state_files(path: str) -> list[str]:
    return [path + ".json", path + ".safetensors"]


def load_state(path: str):
    """The tree written by `save_state(path, ...)`."""
    structure = read_json(path + ".json")
    return _decode(structure, read_tensors(path + ".safetensors"))
