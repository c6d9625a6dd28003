"""The host side of an asynchronous save: what the background writer reads must not change
until it has been written.

Tensors on a device (the GPU) are copied into one host buffer per rank, sized to the rank's
device share of the shard, allocated at the first save and reused by every later one (pinned
when CUDA is available, so the copies run at DMA speed). Tensors already in host memory
(every CPU run, the fp32 masters and moments with --optimizer-cpu-offload) are not copied:
the writer reads them in place, and the next optimizer step, the only thing that changes
them (weights, masters, moments; the routers' expert bias follows the step), first waits
for the writer, which has had the step's forward and backward to write. On a CPU run a
copy would cost the shard's size in host memory, the very cost a streamed save avoids
(measured in docs/checkpoints.md: 1,253 MiB, 0.2 s per save once allocated), against
a step that waits for what is left of the write; the in-place save is never slower than a
synchronous one and adds no more memory.
"""
import threading

import torch

ALIGN = 64  # bytes: each staged tensor starts at a multiple of this in the buffer


class AsyncStaging:
    """One rank's reusable host buffer for --async-save and the writer thread that reads it."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.writer: threading.Thread | None = None
        self._hook = None

    def stage(self, tensors: dict[str, torch.Tensor], optimizer) -> dict[str, torch.Tensor]:
        """`tensors` with those on a device replaced by copies in the host buffer (grown if
        this save needs more; the previous save's writer is waited for first). If any stay
        in host memory, the next step of `optimizer` (megalite's: its torch optimizer's)
        waits for the writer."""
        self.wait()
        on_device = {k: t for k, t in tensors.items() if t.device.type != "cpu"}
        sizes = {k: t.numel() * t.element_size() for k, t in on_device.items()}
        total = sum(-(-n // ALIGN) * ALIGN for n in sizes.values())
        if total > self.buffer.numel():
            self.buffer = torch.empty(0, dtype=torch.uint8)  # free the old one first
            self.buffer = torch.empty(total, dtype=torch.uint8,
                                      pin_memory=torch.cuda.is_available())
        staged, offset = dict(tensors), 0
        for key, tensor in on_device.items():
            copy = self.buffer[offset:offset + sizes[key]].view(tensor.dtype).view(tensor.shape)
            staged[key] = copy.copy_(tensor, non_blocking=True)
            offset += -(-sizes[key] // ALIGN) * ALIGN
        if on_device:
            torch.accelerator.synchronize()
        if len(on_device) < len(tensors):
            self._hook = optimizer.optimizer.register_step_pre_hook(lambda *_: self._join())
        return staged

    def _join(self) -> None:
        if self.writer is not None:
            self.writer.join()
            self.writer = None

    def wait(self) -> None:
        """Until the writer (set by the save) is done; then no step waits any more."""
        self._join()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
