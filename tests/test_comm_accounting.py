"""Collective bytes counted by megalite.mpu.comm equal closed forms derived here.

TP (no sequence parallelism), per forward + backward of one microbatch, fp32: each layer
all-reduces b s h twice in forward (attention output projection, MLP output) and twice in
backward (grads entering the QKV and first MLP projections), full recompute adds the two
forward ones again; GQA (separate query and key-value projections) the same: one all-reduce
of their common input's grad; outside the layers the vocab-parallel embedding all-reduces
b s h in forward, the tied LM head all-reduces the grad of its input b s h in backward, and
cross entropy all-reduces three fp32 [s, b] tensors (max, target logit, sum of exp).
PP: every microbatch crosses each stage boundary once forward (activation) and once
backward (its grad), b s h each.
"""
import pytest
import torch
import torch.distributed as dist

from megalite.config import ModelConfig
from megalite.device import current_device
from megalite.models import GPTModel
from megalite.models.stage import build_model_chunks
from megalite.mpu import comm, initialize_model_parallel, model_parallel_seed
from megalite.mpu import parallel_state as ps
from megalite.schedules import get_forward_backward_func
from tests.helpers.multirank import run_on_ranks

LAYERS, HIDDEN, SEQ, MICRO, FP32 = 4, 32, 8, 2, 4


def _config(recompute: str | None = None, groups: int | None = None) -> ModelConfig:
    return ModelConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4,
                       vocab_size=97, max_position_embeddings=SEQ, hidden_dropout=0.0,
                       attention_dropout=0.0, recompute_granularity=recompute,
                       group_query_attention=groups is not None, num_query_groups=groups)


def _tokens(m: int = 1) -> torch.Tensor:
    return torch.randint(0, 97, (m * MICRO, SEQ + 1),
                         generator=torch.Generator().manual_seed(m)).to(current_device())


def _tp_counts() -> dict:
    """Bytes per kind of one forward + backward on TP = world size, per recompute mode."""
    initialize_model_parallel(dist.get_world_size(), 1)
    model_parallel_seed(1234, ps.get_tensor_model_parallel_rank())
    tokens, counts = _tokens(), {}
    for recompute, groups in ((None, None), ("selective", None), ("full", None), ("gqa", 2)):
        config = _config(None if recompute == "gqa" else recompute, groups)
        model = GPTModel(config, device=current_device())
        with comm.count_bytes() as counted:
            model(tokens[:, :-1], tokens[:, 1:]).mean().backward()
        counts[recompute] = dict(counted)
    return counts


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_bytes_per_forward_backward_equal_closed_form(tp):
    sbh = SEQ * MICRO * HIDDEN
    outside_layers = 2 * sbh * FP32 + 3 * SEQ * MICRO * FP32
    for counts in run_on_ranks(tp, _tp_counts):
        for recompute, per_layer in ((None, 4), ("selective", 4), ("full", 6), ("gqa", 4)):
            want = LAYERS * per_layer * sbh * FP32 + outside_layers
            assert counts[recompute] == {"all_reduce": want}, recompute


def _pp_counts(schedule: str, v: int, m: int) -> dict:
    """This rank's bytes per kind in one pipeline step on PP = world size."""
    initialize_model_parallel(1, dist.get_world_size(), v if v > 1 else None)
    model_parallel_seed(1234, 0, ps.get_pipeline_model_parallel_rank())
    chunks = build_model_chunks(lambda pre_process, post_process: GPTModel(
        _config(), pre_process, post_process, device=current_device()))

    def forward_step(data_iterator, chunk):
        tokens = next(data_iterator)
        return chunk(tokens[:, :-1], tokens[:, 1:]), lambda out: (out.mean(), {})
    with comm.count_bytes() as counted:
        get_forward_backward_func(schedule)(
            forward_step_func=forward_step, data_iterator=iter(_tokens(m).split(MICRO)),
            model=chunks if v > 1 else chunks[0], num_microbatches=m, seq_length=SEQ,
            micro_batch_size=MICRO)
    return dict(counted)


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("gpipe", 1), ("1f1b", 2)])
def test_pp_p2p_bytes_equal_two_bsh_per_microbatch_per_boundary(schedule, v):
    m, p = 4, 2
    counts = run_on_ranks(p, _pp_counts, schedule, v, m)
    boundaries = p * v - 1
    want = boundaries * 2 * m * SEQ * MICRO * HIDDEN * FP32
    assert sum(c["send"] for c in counts) == want
    assert sum(c["recv"] for c in counts) == want
    if v == 1:  # rank 0 sends the activations, rank 1 their grads
        assert counts[0]["send"] == counts[1]["send"] == want // 2
