"""The compressed all-reduce's host kernels (signs.c beside this file), compiled once per
machine with the C compiler (`cc`, or $CC) and loaded with ctypes.

Each stage of a call is one pass over memory in C where the torch ops take two to four (add
then norms; compare, pack, look up, subtract), on fp32 CPU tensors; CUDA tensors keep the
torch ops. The library is cached in this machine's megalite cache (`device.cache_root`),
named by the hash of the source, the flags and this CPU's model and flags (it is built for
this CPU, -march=native); ranks that build it at once each write their own file and rename
it into place. Without a compiler, or if the build fails, `kernels()` is None after one
warning line and compressed.Pieces uses the torch ops.
"""
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import warnings
from pathlib import Path

import torch

from megalite.device import cache_root

SOURCE = Path(__file__).with_name("signs.c")
FLAGS = ["-O3", "-march=native", "-shared", "-fPIC"]
_POINTER, _INT = ctypes.c_void_p, ctypes.c_int64
SIGNATURES = {
    "add_sumsq": [_POINTER, _POINTER, _INT, _POINTER, _INT, _POINTER],
    "compress": [_POINTER, _INT, _POINTER, _INT, _POINTER, _POINTER, _INT],
    "decompress": [_POINTER, _INT, _INT, _POINTER, _INT, _POINTER, _POINTER, _INT, ctypes.c_int],
}


def _cpu_identity() -> str:
    """This CPU's model name and flags (what -march=native builds for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "".join(line for line in lines[:40] if line.startswith(("model name", "flags")))


@functools.cache
def kernels() -> ctypes.CDLL | None:
    """signs.c's functions for this machine, built on first use; None where no C compiler
    builds them (one warning)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), " ".join(FLAGS).encode(),
                                     _cpu_identity().encode(), str(compiler).encode()]))
    library = Path(cache_root()) / f"signs-{key.hexdigest()[:16]}.so"
    if not library.exists():
        failure = _build(compiler, library)
        if failure:
            warnings.warn(f"megalite: {failure}; the compressed all-reduce uses torch ops on "
                          f"the host (2-3x slower)")
            return None
    lib = ctypes.CDLL(str(library))
    for name, argtypes in SIGNATURES.items():
        getattr(lib, name).argtypes = argtypes
    return lib


def _build(compiler: str | None, library: Path) -> str | None:
    """Compile SOURCE into `library` (through a file of this process's own, renamed into
    place: ranks building at once never load a half-written one); why not, or None."""
    if compiler is None:
        return f"no C compiler (cc) to build {SOURCE.name}"
    partial = library.with_suffix(f".{os.getpid()}.tmp")
    try:
        library.parent.mkdir(parents=True, exist_ok=True)
        built = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(partial)],
                               capture_output=True, text=True)
        if built.returncode == 0:
            os.replace(partial, library)
            return None
        error = built.stderr.strip()[:200]
    except OSError as os_error:
        error = str(os_error)
    partial.unlink(missing_ok=True)
    return f"building {SOURCE.name} with {compiler} into {library.parent} failed ({error})"


def _check(sizes_agree: bool, **tensors: tuple[torch.Tensor | None, torch.dtype]) -> None:
    """The C side trusts its pointers: each tensor on the host, contiguous, of its dtype, and
    the sizes as the caller's docstring says (`sizes_agree`)."""
    for name, (tensor, dtype) in tensors.items():
        if tensor is not None and (tensor.device.type != "cpu" or tensor.dtype != dtype
                                   or not tensor.is_contiguous()):
            raise ValueError(f"native_signs: {name} must be a contiguous {dtype} host tensor, "
                             f"got {tensor.dtype} on {tensor.device}")
    if not sizes_agree:
        raise ValueError("native_signs: the pieces, rows and buffers do not match in size")


def add_sumsq(lib: ctypes.CDLL, x: torch.Tensor, added: torch.Tensor | None,
              lengths: torch.Tensor) -> torch.Tensor:
    """x [m] (fp32, contiguous) += added [<= m] at its start; returns the fp64 sum of squares
    of x's pieces of `lengths` (int64) [pieces]."""
    count = 0 if added is None else added.numel()
    _check(int(lengths.sum()) == x.numel() >= count, x=(x, torch.float32),
           added=(added, torch.float32), lengths=(lengths, torch.int64))
    sums = torch.empty(len(lengths), dtype=torch.float64)
    lib.add_sumsq(x.data_ptr(), None if added is None else added.data_ptr(), count,
                  lengths.data_ptr(), len(lengths), sums.data_ptr())
    return sums


def compress(lib: ctypes.CDLL, x: torch.Tensor, lengths: torch.Tensor, scales: torch.Tensor,
             payload: torch.Tensor) -> None:
    """Rows x [r, c] (fp32, contiguous): their packed signs into payload [r, >= c / 8]
    (uint8, contiguous) and x -= sign(x) * its piece's scale (`scales` fp32 [pieces])."""
    _check(int(lengths.sum()) == x.numel() and len(scales) == len(lengths)
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
    _check(int(lengths.sum()) == payload.shape[0] * width >= count and len(scales) == len(lengths)
           and payload.shape[-1] >= width // 8 and out.numel() >= (width if fold else count),
           payload=(payload, torch.uint8), lengths=(lengths, torch.int64),
           scales=(scales, torch.float32), out=(out, torch.float32))
    lib.decompress(payload.data_ptr(), payload.shape[-1], width, lengths.data_ptr(),
                   len(lengths), scales.data_ptr(), out.data_ptr(), count, int(fold))
