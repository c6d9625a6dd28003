"""The global grad norm across TP, PP and DP equals the single-process norm.

Reference: the whole GPT in one process on the global batch of 8, torch's L2 norm over
all its grads. Parallel, on 8 ranks, (TP, PP, DP) = (2, 1, 4) and (2, 2, 2) with the
pipeline executor (1F1B, 2 microbatches per DP rank), each with the plain and the
distributed optimizer: the norm returned by optimizer.step() on every rank equals the
reference within 1e-5 relative (fp32; ~1e-7 seen). This needs every parameter counted
once: TP-replicated params (norms, row-parallel biases, position embeddings) only on TP
rank 0, the tied embedding only on the first stage, and (distributed optimizer) each
rank's shard only, before summing over DP and the model-parallel group.
"""
import torch

from megalite.config import PrecisionConfig
from megalite.device import current_device
from megalite.distributed import DistributedDataParallel
from megalite.distributed.finalize import allreduce_shared_embedding_grads, sync_shared_embedding
from megalite.models import GPTModel
from megalite.models.stage import build_model_chunks
from megalite.mpu import parallel_state as ps
from megalite.optimizer import get_optimizer
from megalite.schedules import get_forward_backward_func
from tests.helpers.dp_reference import (CONFIG, SEQ, Reference, batches, init_grid, local_slice,
                                        opt_config)
from tests.helpers.multirank import run_on_ranks

GLOBAL_BATCH, MICROBATCHES = 8, 2


def _loss_func(per_token: torch.Tensor):
    loss = per_token.mean()
    return loss, {"lm loss": loss.detach()}


def _forward_step(data_iterator, chunk):
    tokens = next(data_iterator)
    return chunk(tokens[:, :-1], tokens[:, 1:]), _loss_func


def _parallel_norm(tokens: torch.Tensor, sharded: bool) -> float:
    config = opt_config(use_distributed_optimizer=sharded)

    def provider(pre_process: bool, post_process: bool) -> DistributedDataParallel:
        return DistributedDataParallel(GPTModel(CONFIG, pre_process, post_process,
                                                device=current_device()),
                                       use_distributed_optimizer=sharded)
    chunks = build_model_chunks(provider)
    sync_shared_embedding(chunks)
    optimizer, _ = get_optimizer(config, PrecisionConfig(), chunks)
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    local = local_slice(tokens, ps.get_data_parallel_group())
    get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=iter(local.chunk(MICROBATCHES)),
        model=chunks[0], num_microbatches=MICROBATCHES, seq_length=SEQ,
        micro_batch_size=local.shape[0] // MICROBATCHES, loss_scale=optimizer.loss_scale)
    for chunk in chunks:
        chunk.finish_grad_sync()
    allreduce_shared_embedding_grads(chunks)
    stepped, norm = optimizer.step()
    assert stepped
    return norm


def _suite() -> dict:
    tokens = batches(1, GLOBAL_BATCH)[0]
    init_grid(1)  # the reference's cross entropy runs on the (here trivial) TP group
    _, _, ref_norm = Reference().grads(tokens)
    ps.destroy_model_parallel()
    results = {}
    for tp, pp in ((2, 1), (2, 2)):
        init_grid(tp, pp)
        for sharded in (False, True):
            results[(tp, pp, sharded)] = (_parallel_norm(tokens, sharded), ref_norm)
        ps.destroy_model_parallel()
    return results


def test_global_grad_norm_over_tp_pp_dp_equals_single_process():
    results = run_on_ranks(8, _suite)
    for rank, per_layout in enumerate(results):
        for (tp, pp, sharded), (norm, ref) in per_layout.items():
            assert abs(norm - ref) / ref < 1e-5, (rank, tp, pp, sharded, norm, ref)
    print("grad norms (rank 0): ", results[0])
