"""One training step of a tiny GPT-family model on any TP x CP x DP x PP (x VPP) layout, through
the real path: build_model_chunks, DistributedDataParallel, the pipeline schedule,
pretrain_gpt.forward_step (CP slicing) and loss_func, finalize_model_grads.

"""
import dataclasses

import torch

from megalite.tasks import gpt as pretrain_gpt
from megalite.config import ModelConfig
from megalite.device import current_device
from megalite.distributed import DistributedDataParallel
from megalite.distributed.finalize import finalize_model_grads, sync_shared_embedding
from megalite.models import GPTModel
from megalite.models.stage import build_model_chunks
from megalite.models.transformer_stage import moe_states
from megalite.moe.stats import reduce_mtp_loss
from megalite.mpu import comm, initialize_model_parallel, model_parallel_seed
from megalite.mpu import parallel_state as ps
from megalite.mpu.layers import gather_tensor_parallel
from megalite.schedules import get_forward_backward_func

SEED, MICRO, MICROBATCHES, SEQ, VOCAB = 1234, 2, 2, 16, 97

GPT2 = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                   max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0)
LLAMA = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                    max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0,
                    normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
                    ffn_hidden_size=64, group_query_attention=True, num_query_groups=2,
                    disable_bias_linear=True, untie_embeddings_and_output_weights=True)


def with_(config: ModelConfig, **changes) -> ModelConfig:
    return dataclasses.replace(config, **changes)


def global_batch(dp: int, vocab: int = VOCAB) -> torch.Tensor:
    """[dp * m * micro, SEQ + 1] tokens, the same on every rank, on its device."""
    return torch.randint(0, vocab, (dp * MICROBATCHES * MICRO, SEQ + 1),
                         generator=torch.Generator().manual_seed(7)).to(current_device())


def parallel_step(config: ModelConfig, tp: int, pp: int, cp: int, sp: bool,
                  vpp: int | None = None, load=None, ep: int = 1, batches=None,
                  microbatches: int = MICROBATCHES, overlap_grad_reduce: bool = True) -> dict:
    """Mean loss over all tokens of the global batch, the grads of this rank's parameters
    (full over TP, by name), and whether the TP-partial replicated grads agree over TP (and
    the multi-token-prediction loss, with --mtp-num-layers).
    `load(chunks)` fills the weights (default: megalite's seeded init). `batches(dp_rank,
    dp)`: this DP rank's `microbatches` batches of MICRO rows (default: its slice of
    `global_batch(dp)`, {"tokens": [MICRO, SEQ + 1]} each)."""
    initialize_model_parallel(tp, pp, vpp, context_parallel_size=cp,
                              expert_model_parallel_size=ep)
    model_parallel_seed(SEED, ps.get_tensor_model_parallel_rank(),
                        ps.get_pipeline_model_parallel_rank())
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    chunks = build_model_chunks(lambda pre_process, post_process: GPTModel(
        config, pre_process, post_process, init_seed=SEED, sequence_parallel=sp,
        device=current_device()))
    if load is not None:
        load(chunks)
    sync_shared_embedding(chunks)
    model = [DistributedDataParallel(chunk, overlap_grad_reduce=overlap_grad_reduce)
             for chunk in chunks]
    if batches is None:
        rows = global_batch(dp, config.vocab_size).split(MICROBATCHES * MICRO)[dp_rank]
        mine = [{"tokens": t} for t in rows.split(MICRO)]
    else:
        mine = batches(dp_rank, dp)
    losses = get_forward_backward_func()(
        forward_step_func=pretrain_gpt.forward_step, data_iterator=iter(mine),
        model=model if len(model) > 1 else model[0], num_microbatches=microbatches,
        seq_length=SEQ, micro_batch_size=MICRO)
    finalize_model_grads(model)
    loss = torch.stack([d["lm loss"].float() for d in losses]).mean().reshape(1)
    comm.all_reduce(loss, ps.get_data_parallel_group(with_context_parallel=True))
    loss /= ps.get_data_parallel_world_size(with_context_parallel=True)
    grads, partial_agree = {}, True
    for chunk in model:
        for name, param in chunk.module.named_parameters():
            grads[name] = gather_tensor_parallel(param.main_grad, param)
            if getattr(param, "tp_grad_partial", False) and not param.tensor_model_parallel:
                copies = comm.all_gather_stacked(param.main_grad,
                                                 ps.get_tensor_model_parallel_group())
                partial_agree &= bool((copies == copies[0]).all())
    out = {"loss": loss.item(), "grads": grads, "tp partial grads agree": partial_agree}
    if config.mtp_num_layers:
        out["mtp loss"] = reduce_mtp_loss(
            moe_states(model), microbatches, current_device(),
            ps.get_pipeline_model_parallel_group(),
            ps.get_data_parallel_group(with_context_parallel=True))
    return out
