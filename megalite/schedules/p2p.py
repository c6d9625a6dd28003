"""Pipeline point-to-point: activations and their grads, [s, b, h], between pipeline ranks.

One call posts one batch of sends and recvs on the pipeline group (through
`megalite.mpu.comm.batch_send_recv`, which counts the bytes) and waits for all of
them, as the executor rule in `megalite.schedules.instructions` requires. Every message
has the same shape and dtype, so receivers allocate their buffers up front.
"""
from dataclasses import dataclass

import torch

from megalite.mpu import comm, parallel_state


@dataclass(frozen=True)
class Channel:
    """What travels between stages: [seq_length, micro_batch_size, hidden_size] of `dtype`."""

    shape: tuple[int, int, int]
    dtype: torch.dtype
    device: torch.device

    def exchange(self, ops: list[tuple[str, torch.Tensor | None, int]]
                 ) -> list[torch.Tensor | None]:
        """Post [("send", tensor [s, b, h], peer) | ("recv", None, peer), ...] in list order
        as one batch on the pipeline group and wait for all of it.

        `peer` is a pipeline rank (0 .. p-1). Returns, in order, the received tensors
        (None in the places of sends).
        """
        ranks = parallel_state.get_pipeline_model_parallel_ranks()
        batch, received = [], []
        for kind, tensor, peer in ops:
            if kind == "send":
                if tensor.shape != self.shape or tensor.dtype != self.dtype:
                    raise ValueError(f"pipeline send: got {tuple(tensor.shape)} {tensor.dtype}, "
                                     f"expected [s, b, h] = {self.shape} {self.dtype}")
                tensor = tensor.contiguous()
            else:
                tensor = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            batch.append((kind, tensor, ranks[peer]))
            received.append(tensor if kind == "recv" else None)
        for work in comm.batch_send_recv(batch, parallel_state.get_pipeline_model_parallel_group()):
            work.wait()
        return received
