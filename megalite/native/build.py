"""Build and load a C source beside its Python wrapper: `cc -O3 -march=native` into this
machine's megalite cache (`device.cache_root`), named by the hash of the source, the flags,
the compiler and this CPU's model and flags (the library is built for this CPU). Ranks that
build at once each write their own file and rename it into place. Without a compiler, or if
the build fails, `load` returns None after one warning line and the caller keeps its torch
ops."""
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import warnings
from pathlib import Path

import torch

from megalite.device import cache_root

FLAGS = ["-O3", "-march=native", "-shared", "-fPIC"]
POINTER, INT64 = ctypes.c_void_p, ctypes.c_int64  # the argument types of the kernels' C calls


def _cpu_identity() -> str:
    """This CPU's model name and flags (what -march=native builds for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "".join(line for line in lines[:40] if line.startswith(("model name", "flags")))


def load(source: Path, signatures: dict[str, list], fallback: str) -> ctypes.CDLL | None:
    """`source`'s functions with their ctypes argument types (`signatures`), built on first
    use; None where no C compiler builds them (one warning naming `fallback`, what the caller
    does instead)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    key = hashlib.sha256(b"\0".join([source.read_bytes(), " ".join(FLAGS).encode(),
                                     _cpu_identity().encode(), str(compiler).encode()]))
    library = Path(cache_root()) / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if not library.exists():
        failure = _build(source, compiler, library)
        if failure:
            warnings.warn(f"megalite: {failure}; {fallback}")
            return None
    lib = ctypes.CDLL(str(library))
    for name, argtypes in signatures.items():
        getattr(lib, name).argtypes = argtypes
    return lib


def _build(source: Path, compiler: str | None, library: Path) -> str | None:
    """Compile `source` into `library` (through a file of this process's own, renamed into
    place: ranks building at once never load a half-written one); why not, or None."""
    if compiler is None:
        return f"no C compiler (cc) to build {source.name}"
    partial = library.with_suffix(f".{os.getpid()}.tmp")
    try:
        library.parent.mkdir(parents=True, exist_ok=True)
        built = subprocess.run([compiler, *FLAGS, str(source), "-o", str(partial)],
                               capture_output=True, text=True)
        if built.returncode == 0:
            os.replace(partial, library)
            return None
        error = built.stderr.strip()[:200]
    except OSError as os_error:
        error = str(os_error)
    partial.unlink(missing_ok=True)
    return f"building {source.name} with {compiler} into {library.parent} failed ({error})"


def check_host(owner: str, sizes_agree: bool,
               **tensors: tuple[torch.Tensor | None, torch.dtype]) -> None:
    """The C side trusts its pointers: each tensor on the host, contiguous, of its dtype, and
    the sizes as the caller's docstring says (`sizes_agree`); else one ValueError naming
    `owner`."""
    for name, (tensor, dtype) in tensors.items():
        if tensor is not None and (tensor.device.type != "cpu" or tensor.dtype != dtype
                                   or not tensor.is_contiguous()):
            raise ValueError(f"{owner}: {name} must be a contiguous {dtype} host tensor, "
                             f"got {tensor.dtype} on {tensor.device}")
    if not sizes_agree:
        raise ValueError(f"{owner}: the tensors do not match in size")
