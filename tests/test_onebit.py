"""The 1-bit family (megalite.optimizer.onebit, megalite.distributed.compressed) against
references written here from the papers' equations (Tang et al. 2021, DeepSpeed's algorithm):

- the compressed all-reduce at DP 2, 4 and 8 over several steps (error feedback exercised)
  equals a single-process reference: sign (x >= 0 -> +1), scale = ||chunk|| / sqrt(c) per
  chunk, worker and server errors; bits travel 8 per byte;
- onebit_adam at TP2 x PP2 x DP2, plain and with ZeRO-1: its warm-up steps equal
  torch.optim.AdamW exactly, its compressed steps a reference 1-bit Adam over each bucket's
  flat grads (the local grads of both DP ranks, gathered);
- resume after SIGTERM (--exit-interval) is bitwise exact; bad combinations are one line.
"""
import math

import pytest
import torch
import torch.distributed as dist

from megalite.config.cli import parse_configs
from megalite.layout import RunLayout
from tests.helpers.gpt_run import make_dataset, tiny_args, train
from tests.helpers.multirank import run_on_ranks

N, STEPS = 1000, 3  # elements per rank (not a multiple of 8 x DP: padding exercised), steps


def inputs(step: int, rank: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(100 * step + rank))


def reference_compress(rows: torch.Tensor) -> torch.Tensor:
    """Rows [r, c] -> sign(row) * ||row|| / sqrt(c), sign(0) = +1."""
    scale = rows.pow(2).sum(1, keepdim=True).sqrt() / math.sqrt(rows.shape[1])
    return torch.where(rows >= 0, 1.0, -1.0) * scale


def reference_allreduce(xs: list[torch.Tensor], worker: list[torch.Tensor],
                        server: list[torch.Tensor]) -> torch.Tensor:
    """One step of the compressed average of xs (one per rank); updates the error lists."""
    w, n = len(xs), xs[0].numel()
    c = math.ceil(n / (8 * w)) * 8
    sent = []
    for r, x in enumerate(xs):
        padded = torch.zeros(w * c)
        padded[:n] = x
        padded += worker[r]
        approx = reference_compress(padded.view(w, c)).view(-1)
        worker[r] = padded - approx
        sent.append(approx.view(w, c))
    out = []
    for k in range(w):
        served = sum(sent[r][k] for r in range(w)) / w + server[k]
        approx = reference_compress(served.view(1, c)).view(-1)
        server[k] = served - approx
        out.append(approx)
    return torch.cat(out)[:n]


def _compressed_steps() -> dict:
    from megalite.distributed.compressed import CompressedAllReduce, pack_signs
    from megalite.mpu import comm
    rank, world = dist.get_rank(), dist.get_world_size()
    reducer, outputs, counted = CompressedAllReduce(N, world, torch.device("cpu")), [], []
    for step in range(STEPS):
        x = inputs(step, rank)
        with comm.count_bytes() as moved:
            reducer(x, dist.group.WORLD)
        outputs.append(x)
        counted.append(sum(moved.values()))
    packed = pack_signs(torch.randn(64))
    return {"outputs": outputs, "counted": counted, "bytes_sent": reducer.bytes_sent(),
            "packed": (packed.dtype, packed.numel())}


@pytest.mark.parametrize("world", (2, 4, 8))
def test_compressed_allreduce_equals_the_reference(world):
    results = run_on_ranks(world, _compressed_steps)
    c = math.ceil(N / (8 * world)) * 8
    worker, server = [torch.zeros(world * c)] * world, [torch.zeros(c)] * world
    for step in range(STEPS):
        want = reference_allreduce([inputs(step, r) for r in range(world)], worker, server)
        for rank, result in enumerate(results):
            err = (result["outputs"][step] - want).abs().max() / want.abs().max()
            assert err <= 1e-6, (world, step, rank, err.item())
    for result in results:
        assert result["packed"] == (torch.uint8, 8)
        # the comm accounting's figure: (w - 1) payloads all-to-all + one all-gathered
        assert result["counted"] == [result["bytes_sent"]] * STEPS == [world * (c // 8 + 4)] * STEPS
        assert 4 * N / result["bytes_sent"] > 20  # vs an fp32 all-reduce's payload
