"""Pickle-free checkpoint files: nested state as JSON + tensors as safetensors, all fsynced.

`save_state(path, tree)` splits a nested structure of dicts, lists, tuples, tensors, numpy
arrays and plain scalars into `<path>.json` (the structure, tensors replaced by
references) and `<path>.safetensors` (the tensors); `load_state(path)` rebuilds it. Dict
keys that are not strings, tuples and numpy arrays are tagged so they come back as they
were (the RNG states of `random` and numpy, torch optimizer states keyed by int).

`write_tensors(path, tensors)` streams a safetensors file: the header (computed from shapes
and dtypes), then each tensor's bytes straight from its memory (a contiguous host tensor,
views and bf16 included) or, for a tensor that is not contiguous or not in host memory,
through one reusable host buffer of at most STREAM_BUFFER_BYTES, chunk by chunk; so writing
costs no more host memory than that buffer and the header. The file is byte for byte what
`safetensors.torch.save_file` writes for the same tensors.

`safetensors_shapes(path)` reads only a safetensors header and checks the file holds
every byte the header announces, so a truncated or foreign file is one clear error
before any tensor is read.
"""
import json
import os
import struct
from collections.abc import Iterator

import numpy as np
import torch
from safetensors.torch import load_file

from megalite.distributed.scratch_io import host_bytes

STREAM_BUFFER_BYTES = 64 * 2 ** 20  # the most host memory a file write copies through

# safetensors' dtype names, in the order of its Dtype enum: its writer puts the tensors of the
# last one first (descending alignment), then sorts by name
SAFETENSORS_DTYPES = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fn: "F8_E4M3", torch.int16: "I16", torch.uint16: "U16",
    torch.float16: "F16", torch.bfloat16: "BF16", torch.int32: "I32", torch.uint32: "U32",
    torch.float32: "F32", torch.complex64: "C64", torch.float64: "F64", torch.int64: "I64",
    torch.uint64: "U64"}
_DTYPE_RANK = {dtype: i for i, dtype in enumerate(SAFETENSORS_DTYPES)}


class CheckpointFileError(ValueError):
    """A checkpoint file is missing, truncated or not what megalite wrote."""


def fsync_dir(path: str) -> None:
    """Make a directory's entries (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def _file_order(tensors: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The tensors in safetensors' file order (dtype rank descending, then name)."""
    for name, tensor in tensors.items():
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise TypeError(f"tensor {name!r}: safetensors cannot store {tensor.dtype}")
    return sorted(tensors.items(), key=lambda item: (-_DTYPE_RANK[item[1].dtype], item[0]))


def safetensors_header(order: list[tuple[str, torch.Tensor]],
                       metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte little-endian length and the JSON header of a file holding the tensors of
    `order` in that order, padded with spaces to a multiple of 8 bytes as safetensors pads."""
    header: dict = {"__metadata__": metadata} if metadata is not None else {}
    offset = 0
    for name, tensor in order:
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _chunks(tensor: torch.Tensor, limit: int) -> Iterator[torch.Tensor]:
    """Views of `tensor` of at most `limit` elements each (whole rows where they fit), whose
    elements in order are `tensor`'s in row-major order."""
    if tensor.numel() <= limit:
        yield tensor
        return
    rows = limit // (tensor.numel() // tensor.shape[0])
    if rows:
        yield from (tensor[i:i + rows] for i in range(0, tensor.shape[0], rows))
    else:
        for row in tensor:
            yield from _chunks(row, limit)


def _in_place(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s bytes can be written from its own memory."""
    return tensor.device.type == "cpu" and tensor.is_contiguous()


def _write_through(f, tensor: torch.Tensor, buffer: torch.Tensor) -> None:
    """Write `tensor` (any device and strides) in chunks copied into the host `buffer`."""
    size = tensor.element_size()
    for chunk in _chunks(tensor.detach(), buffer.numel() // size):
        piece = buffer[:chunk.numel() * size]
        piece.view(tensor.dtype).view(chunk.shape).copy_(chunk)
        f.write(host_bytes(piece))


def write_tensors(path: str, tensors: dict[str, torch.Tensor],
                  metadata: dict[str, str] | None = None) -> None:
    """safetensors file of `tensors` (any device, views allowed), streamed and fsynced; the
    same bytes as `safetensors.torch.save_file(tensors, path, metadata)`. Tensors not in
    host memory or not contiguous go through one host buffer of at most STREAM_BUFFER_BYTES
    (pinned when one of them is on a CUDA device)."""
    order = _file_order(tensors)
    staged = [t for _, t in order if not _in_place(t) and t.numel()]
    buffer = None
    if staged:
        largest = max(t.numel() * t.element_size() for t in staged)
        buffer = torch.empty(min(STREAM_BUFFER_BYTES, largest), dtype=torch.uint8,
                             pin_memory=any(t.is_cuda for t in staged))
    with open(path, "wb") as f:
        f.write(safetensors_header(order, metadata))
        for _, tensor in order:
            if _in_place(tensor):
                f.write(host_bytes(tensor))
            elif tensor.numel():
                _write_through(f, tensor, buffer)
        f.flush()
        os.fsync(f.fileno())


def save_pretrained(model, directory: str) -> None:
    """`model.save_pretrained(directory)` (a transformers model: its config, and the weights
    transformers picks, tied copies left out) with the safetensors files streamed by
    `write_tensors` instead of transformers' `safe_save_file`."""
    from transformers import modeling_utils
    saver = modeling_utils.safe_save_file
    modeling_utils.safe_save_file = lambda tensors, path, metadata=None: write_tensors(
        path, tensors, metadata)
    try:
        model.save_pretrained(directory)
    finally:
        modeling_utils.safe_save_file = saver


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
