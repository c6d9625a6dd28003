"""Bytes counted by megalite.mpu.comm for sequence and context parallelism equal closed forms.

One forward + backward of one microbatch (b = 2, s = 16, h = 32, L = 4 layers, fp32), on a
plain model (no DP wrapper, no pipeline):

- SP at TP t in {2, 4}: per layer and forward pass 2 all-gathers of the [s/t, b, h] shard
  (QKV and first MLP projection inputs; counted as the shard) and 2 reduce-scatters of
  [s, b, h] (attention output and MLP output), and the converse in backward (2 + 2); full
  recompute repeats the forward ones. Outside the layers: the embedding's all-reduce of
  s b h and the all-gather of its scattered output's grad, the LM head's all-gather of
  s b h / t and the reduce-scatter of its grad, cross entropy's 3 fp32 all-reduces of s b.
- CP ring at cp in {2, 4} (and TP2 x CP2): a K/V block is 2 (s/cp) b g d elements with g
  the KV groups per TP rank; per layer each rank sends it cp - 1 times in forward, and in
  backward K/V cp - 1 times and dK/dV cp times - (cp - 1) and (2 cp - 1) blocks.
The planner's formulas (megalite.planning.planner) give the same numbers, and its activations per
layer follow sbh(34 + 5as/h)/t (34 sbh/t selective) with SP, divided by cp with CP.
"""
import dataclasses

import pytest
import torch

from megalite.device import current_device
from megalite.models import GPTModel
from megalite.mpu import comm, initialize_model_parallel, model_parallel_seed
from megalite.mpu import parallel_state as ps
from megalite.mpu.context_parallel import get_batch_on_this_cp_rank
from megalite.planning import activations, planner
from tests.helpers.multirank import run_on_ranks
from tests.helpers.parallel_step import GPT2, LLAMA, SEQ, with_
from tests.test_plan import configs

MICRO, FP32 = 2, 4
LAYERS, HIDDEN = GPT2.num_layers, GPT2.hidden_size


def _tokens() -> torch.Tensor:
    return torch.randint(0, GPT2.vocab_size, (MICRO, SEQ + 1),
                         generator=torch.Generator().manual_seed(3)).to(current_device())


def _counts(config, tp: int, cp: int, sp: bool) -> dict:
    initialize_model_parallel(tp, 1, context_parallel_size=cp)
    model_parallel_seed(1234, ps.get_tensor_model_parallel_rank())
    model = GPTModel(config, sequence_parallel=sp, device=current_device())
    tokens = _tokens()
    inputs, labels, positions = get_batch_on_this_cp_rank(tokens[:, :-1], tokens[:, 1:])
    with comm.count_bytes() as counted:
        model(inputs, labels, positions).mean().backward()
    ps.destroy_model_parallel()
    return dict(counted)


def _all() -> dict:
    return {
        **{("sp", tp, recompute): _counts(with_(GPT2, recompute_granularity=recompute), tp, 1,
                                          True)
           for tp in (2, 4) for recompute in (None, "full")},
        **{("cp", tp, cp): _counts(LLAMA, tp, cp, False) for tp, cp in ((1, 2), (1, 4), (2, 2))},
    }


@pytest.fixture(scope="module")
def counts() -> list[dict]:
    return run_on_ranks(4, _all)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("recompute", [None, "full"])
def test_sequence_parallel_bytes_equal_closed_form(counts, tp, recompute):
    sbh, sb = SEQ * MICRO * HIDDEN, SEQ * MICRO
    per_layer = 4 + 2 * (recompute == "full")  # gathers (and scatters) per layer
    want = {"all_gather": (LAYERS * per_layer + 2) * sbh // tp * FP32,
            "reduce_scatter": (LAYERS * per_layer + 1) * sbh * FP32,
            "all_reduce": sbh * FP32 + 3 * sb * FP32}
    for per_rank in counts:
        assert per_rank[("sp", tp, recompute)] == want


@pytest.mark.parametrize("tp,cp", [(1, 2), (1, 4), (2, 2)])
def test_ring_bytes_equal_closed_form(counts, tp, cp):
    groups = LLAMA.num_query_groups // tp
    block = 2 * (SEQ // cp) * MICRO * groups * LLAMA.head_dim
    want = LAYERS * ((cp - 1) + (2 * cp - 1)) * block * FP32
    assert sum(activations.ring_attention_elements(SEQ, MICRO, groups, LLAMA.head_dim, cp)) * FP32 \
        * LAYERS == want
    for per_rank in counts:
        got = per_rank[("cp", tp, cp)]
        assert got["send"] == want and got["recv"] == want, (tp, cp, got, want)


def test_planner_splits_activations_and_counts_sp_collectives():
    base = configs(layers=LAYERS, hidden=HIDDEN, seq=SEQ, micro=MICRO, tp=2, precision="fp32",
                   recompute="selective")
    base = dataclasses.replace(base, model=dataclasses.replace(base.model, attention_dropout=0.0))
    sp = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel,
                                                                sequence_parallel=True))
    cp = dataclasses.replace(sp, parallel=dataclasses.replace(sp.parallel,
                                                              context_parallel_size=2))
    plain, with_sp, with_cp = planner.plan(base), planner.plan(sp), planner.plan(cp)
    sbh = SEQ * MICRO * HIDDEN
    # fp32 selective: 66 sbh / t per layer with SP (34 sbh / t at 2 bytes), then / cp
    per_layer = activations.activation_bytes_per_layer(SEQ, MICRO, HIDDEN, 4, 2, FP32, "selective",
                                                   True)
    assert per_layer == pytest.approx(66 * sbh / 2)
    assert with_sp.stages["first"].layer_activations == pytest.approx(LAYERS * per_layer)
    assert with_cp.stages["first"].activations == pytest.approx(
        with_sp.stages["first"].activations / 2)
    assert plain.stages["first"].layer_activations > with_sp.stages["first"].layer_activations
    comm_sp = with_sp.comm("first")
    assert comm_sp["SP all-gather"][1] == (LAYERS * 4 + 2) * sbh // 2 * FP32
    assert comm_sp["SP reduce-scatter"][1] == (LAYERS * 4 + 1) * sbh * FP32
    assert "TP all-reduce" in plain.comm("first") and with_cp.layout.world_size == 4
