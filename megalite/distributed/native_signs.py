"""The compressed all-reduce's host kernels (signs.c beside this file, built and loaded by
megalite.native).

Each stage of a call is one pass over memory in C where the torch ops take two to four (add
then norms; compare, pack, look up, subtract), on fp32 CPU tensors; CUDA tensors keep the
torch ops. Without a compiler, or if the build fails, `kernels()` is None after one warning
line and compressed.Pieces uses the torch ops.
"""
import ctypes
import functools
from pathlib import Path

import torch

from megalite.native import INT64, POINTER, check_host, load

SOURCE = Path(__file__).with_name("signs.c")
SIGNATURES = {
    "add_sumsq": [POINTER, POINTER, INT64, POINTER, INT64, POINTER],
    "compress": [POINTER, INT64, POINTER, INT64, POINTER, POINTER, INT64],
    "decompress": [POINTER, INT64, INT64, POINTER, INT64, POINTER, POINTER, INT64, ctypes.c_int],
}


@functools.cache
def kernels() -> ctypes.CDLL | None:
    """signs.c's functions for this machine, built on first use; None where no C compiler
    builds them (one warning)."""
    return load(SOURCE, SIGNATURES, "the compressed all-reduce uses torch ops on the host "
                                    "(2-3x slower)")


def add_sumsq(lib: ctypes.CDLL, x: torch.Tensor, added: torch.Tensor | None,
              lengths: torch.Tensor) -> torch.Tensor:
    """x [m] (fp32, contiguous) += added [<= m] at its start; returns the fp64 sum of squares
    of x's pieces of `lengths` (int64) [pieces]."""
    count = 0 if added is None else added.numel()
    check_host("native_signs", int(lengths.sum()) == x.numel() >= count,
               x=(x, torch.float32), added=(added, torch.float32),
               lengths=(lengths, torch.int64))
    sums = torch.empty(len(lengths), dtype=torch.float64)
    lib.add_sumsq(x.data_ptr(), None if added is None else added.data_ptr(), count,
                  lengths.data_ptr(), len(lengths), sums.data_ptr())
    return sums


def compress(lib: ctypes.CDLL, x: torch.Tensor, lengths: torch.Tensor, scales: torch.Tensor,
             payload: torch.Tensor) -> None:
    """Rows x [r, c] (fp32, contiguous): their packed signs into payload [r, >= c / 8]
    (uint8, contiguous) and x -= sign(x) * its piece's scale (`scales` fp32 [pieces])."""
    check_host("native_signs",
               int(lengths.sum()) == x.numel() and len(scales) == len(lengths)
               and payload.shape[0] * x.shape[-1] == x.numel()
               and payload.shape[-1] >= x.shape[-1] // 8,
               x=(x, torch.float32), lengths=(lengths, torch.int64),
               scales=(scales, torch.float32), payload=(payload, torch.uint8))
    lib.compress(x.data_ptr(), x.shape[-1], lengths.data_ptr(), len(lengths), scales.data_ptr(),
                 payload.data_ptr(), payload.shape[-1])


def decompress(lib: ctypes.CDLL, payload: torch.Tensor, width: int, lengths: torch.Tensor,
               scales: torch.Tensor, out: torch.Tensor, fold: bool = False) -> None:
    """Rows of `width` elements from payload [r, >= width / 8]: the first out.numel() values
    sign * scale into out (fp32, contiguous); with `fold`, every row's values added into out
    [width] instead."""
    count = payload.shape[0] * width if fold else out.numel()
    check_host("native_signs",
               int(lengths.sum()) == payload.shape[0] * width >= count
               and len(scales) == len(lengths) and payload.shape[-1] >= width // 8
               and out.numel() >= (width if fold else count),
               payload=(payload, torch.uint8), lengths=(lengths, torch.int64),
               scales=(scales, torch.float32), out=(out, torch.float32))
    lib.decompress(payload.data_ptr(), payload.shape[-1], width, lengths.data_ptr(),
                   len(lengths), scales.data_ptr(), out.data_ptr(), count, int(fold))
