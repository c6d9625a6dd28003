"""Host-side I/O of the offload tiers' scratch files (megalite.optimizer.nvme_tier, the
parameter tier megalite.distributed.param_tier) and of checkpoint writes: a tensor's bytes in
place, whole positional reads and writes (os.preadv / os.pwritev release the GIL, so a tier's
reader and writer threads overlap the step), and glibc's allocator kept from hoarding freed
host memory.
"""
import ctypes
import os
import shutil

import torch

MMAP_THRESHOLD = 128 * 1024  # glibc's default, made fixed
M_MMAP_THRESHOLD = -3  # glibc malloc.h


def host_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, in place (any dtype), read through its address:
    numpy would leave its storage unresizable for good, which the parameter tier resizes.
    The caller keeps `tensor` alive while the view is used."""
    nbytes = tensor.numel() * tensor.element_size()
    if not nbytes:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def read_exactly(fd: int, tensor: torch.Tensor, offset: int, what: str) -> int:
    """Fill host `tensor` from file `fd` at `offset`; a file ending early is one error naming
    `what` (e.g. 'nvme tier: the file in DIR'). Returns the bytes read."""
    view, done = host_bytes(tensor), 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise OSError(f"{what} ends at byte {offset + done} (truncated)")
        done += n
    return done


def write_all(fd: int, tensor: torch.Tensor, offset: int) -> int:
    """Write host `tensor` to file `fd` at `offset`. Returns the bytes written."""
    view, done = host_bytes(tensor), 0
    while done < len(view):
        done += os.pwritev(fd, [view[done:]], offset + done)
    return done


def remove_scratch(fd: int, directory: str) -> None:
    """Close a tier's file and remove its scratch directory."""
    os.close(fd)
    shutil.rmtree(directory, ignore_errors=True)


def pin_mmap_threshold() -> None:
    """Keep glibc's mmap threshold at its default. glibc raises it to the size of every freed
    mmapped block (up to 32 MiB), so after the first step's sub-group-sized transients (lazily
    created state, the optimizer's temporaries) later ones come from the heap, which keeps
    them resident: ~30 MiB of peak RSS at 1M-parameter sub-groups. Process-wide: every later
    host allocation over 128 KiB is mmapped and unmapped when freed. A no-op without glibc."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def trim_heap() -> None:
    """glibc's malloc_trim(0): free heap pages back to the system (a no-op without glibc)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
