"""Memory-mapped token datasets in Megatron-LM's `.bin` + `.idx` layout.

`.bin` is the raw token array. `.idx` (little-endian) is:
9-byte magic `MMIDIDX\\x00\\x00`; uint64 version (1); uint8 dtype code; uint64 number
of sequences N; uint64 number of document-index entries D (documents + 1);
int32 sequence lengths [N]; int64 byte offsets of each sequence into `.bin` [N];
int64 document indices [D] (sequence where each document starts; first 0, last N).
Files written by Megatron-LM's preprocessing load unchanged, and vice versa.
"""
from __future__ import annotations

import os
import struct

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES: dict[int, type] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32,
    5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, N, D


def best_dtype(vocab_size: int) -> type:
    """Token dtype Megatron picks: uint16 when the vocabulary fits, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def dtype_code(dtype) -> int:
    """The `.idx` code of a numpy dtype; ValueError for dtypes the format lacks."""
    for code, candidate in DTYPE_CODES.items():
        if np.dtype(candidate) == np.dtype(dtype):
            return code
    raise ValueError(f"dtype {np.dtype(dtype)} has no code in the .idx format; "
                     f"expected one of {[np.dtype(d).name for d in DTYPE_CODES.values()]}")


def write_index(idx_path: str, dtype, sizes: np.ndarray, document_indices: np.ndarray) -> None:
    """Write an `.idx` file for sequences of `sizes` [N] tokens and `document_indices` [D]."""
    sizes = np.asarray(sizes, dtype=np.int32)
    pointers = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= np.dtype(dtype).itemsize
    with open(idx_path, "wb") as f:
        f.write(_HEADER.pack(MAGIC, VERSION, dtype_code(dtype), len(sizes), len(document_indices)))
        f.write(sizes.tobytes())
        f.write(pointers.tobytes())
        f.write(np.asarray(document_indices, dtype=np.int64).tobytes())


class IndexedDatasetBuilder:
    """Appends sequences to a `.bin` file; `finalize` writes the matching `.idx`.

    Each `add_item` adds one sequence; `end_document` closes the current document
    (a document is one or more consecutive sequences).
    """

    def __init__(self, bin_path: str, dtype=np.int32) -> None:
        dtype_code(dtype)
        self.dtype = np.dtype(dtype)
        self._file = open(bin_path, "wb")
        self._sizes: list[int] = []
        self._document_indices: list[int] = [0]

    def add_item(self, tokens) -> None:
        """Append one sequence of token ids (any 1-D array-like of ints)."""
        array = np.asarray(tokens, dtype=self.dtype)
        self._file.write(array.tobytes())
        self._sizes.append(array.size)

    def end_document(self) -> None:
        """Mark the sequences added since the last call as one document."""
        self._document_indices.append(len(self._sizes))

    def finalize(self, idx_path: str) -> None:
        """Close the `.bin` file and write the `.idx` file."""
        self._file.close()
        write_index(idx_path, self.dtype, np.array(self._sizes, dtype=np.int32),
                    np.array(self._document_indices, dtype=np.int64))


class IndexedDataset:
    """Read-only view of `<prefix>.bin` / `<prefix>.idx`.

    `dataset[i]` is sequence i as a numpy view [sizes[i]] of the `.bin` memory map;
    `sizes` [N] int32, `pointers` [N] int64 (byte offsets), `document_indices` [D] int64.
    """

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.prefix = prefix = os.fspath(prefix)
        idx_path, bin_path = prefix + ".idx", prefix + ".bin"
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path}: no such file (expected the .bin/.idx pair of "
                                        f"dataset prefix {prefix!r})")
        self._read_index(idx_path)
        expected = int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize if len(self) else 0
        found = os.path.getsize(bin_path)
        if found != expected:
            raise ValueError(f"{bin_path}: {found} bytes, expected {expected} as {idx_path} "
                             f"describes (truncated or mismatched .bin)")
        self._tokens = (np.memmap(bin_path, dtype=self.dtype, mode="r") if expected
                        else np.empty(0, dtype=self.dtype))

    def _read_index(self, idx_path: str) -> None:
        self._idx = np.memmap(idx_path, dtype=np.uint8, mode="r") if os.path.getsize(idx_path) else b""
        if len(self._idx) < _HEADER.size:
            raise ValueError(f"{idx_path}: {len(self._idx)} bytes, shorter than the "
                             f"{_HEADER.size}-byte header of a Megatron .idx file")
        magic, version, code, n, d = _HEADER.unpack(bytes(self._idx[:_HEADER.size]))
        if magic != MAGIC:
            raise ValueError(f"{idx_path}: magic {magic!r}, expected {MAGIC!r} (not a Megatron "
                             f"mmap .idx file)")
        if version != VERSION:
            raise ValueError(f"{idx_path}: version {version}, expected {VERSION}")
        if code not in DTYPE_CODES:
            raise ValueError(f"{idx_path}: dtype code {code}, expected one of {sorted(DTYPE_CODES)}")
        expected = _HEADER.size + 12 * n + 8 * d
        if len(self._idx) != expected:
            raise ValueError(f"{idx_path}: {len(self._idx)} bytes, expected {expected} for "
                             f"{n} sequences and {d} document-index entries (truncated .idx)")
        self.dtype = np.dtype(DTYPE_CODES[code])
        buf, offset = self._idx, _HEADER.size
        self.sizes = np.frombuffer(buf, np.int32, n, offset)
        self.pointers = np.frombuffer(buf, np.int64, n, offset + 4 * n)
        self.document_indices = np.frombuffer(buf, np.int64, d, offset + 12 * n)
        if d == 0 or self.document_indices[0] != 0 or self.document_indices[-1] != n:
            raise ValueError(f"{idx_path}: document indices must start at 0 and end at {n}")

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [length] of sequence `idx` from token `offset` (default: to its end)."""
        size = int(self.sizes[idx])
        if length is None:
            length = size - offset
        if not (0 <= offset and length >= 0 and offset + length <= size):
            raise IndexError(f"tokens [{offset}, {offset + length}) outside sequence {idx} "
                             f"of {size} tokens")
        start = int(self.pointers[idx]) // self.dtype.itemsize + offset
        return self._tokens[start:start + length]

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def max_token(self, block: int = 1 << 24) -> int:
        """The largest token id in the .bin (-1 if empty), read in blocks of `block` tokens."""
        return max((int(self._tokens[i:i + block].max())
                    for i in range(0, len(self._tokens), block)), default=-1)
