"""Model-state bytes per parameter per rank under each sharding strategy (megalite.planning.state_bytes,
megalite.planning.planner) against the ZeRO paper's closed forms, written out here, and real models."""
import dataclasses
import functools

import pytest

from megalite.config import ModelConfig
from megalite.models import GPTModel
from megalite.planning import params as param_counts
from megalite.planning.state_bytes import gather_bytes, state_bytes_per_param, zero_bytes
from megalite.config.sharding import STRATEGY_NAMES as STRATEGIES

NS = (1, 2, 4, 8)


@pytest.mark.parametrize("n", NS)
def test_zero_rule_gives_the_papers_bytes_per_parameter(n):
    """Rajbhandari et al. 2020: mixed precision 2 + 2 + 12 -> 4 + 12/N -> 2 + 14/N -> 16/N;
    fp32 (4 + 4 + 8) likewise sharded: 16, 8 + 8/N, 4 + 12/N, 16/N."""
    paper = {(2, 2, 12): (16, 4 + 12 / n, 2 + 14 / n, 16 / n),
             (4, 4, 8): (16, 8 + 8 / n, 4 + 12 / n, 16 / n)}
    for components, want in paper.items():
        for strategy, total in zip(STRATEGIES, want):
            got = zero_bytes(components, strategy, n)
            assert got.total == pytest.approx(total) and got.host == 0, (components, strategy)


@pytest.mark.parametrize("n", NS)
def test_megalite_bytes_per_parameter_per_strategy_and_offload(n):
    """What megalite holds between steps: the gradient buffer (no_shard, optim) keeps fp32
    grads - Megatron's fp32 16 / 8 + 8/N, bf16 18 / 6 + 12/N, fp16 20 / 4 + 16/N; FSDP2
    (optim_grads, optim_grads_params) keeps an fp32 master shard, fp32 grad shard and Adam
    m, v: 16/N in every precision. Offload puts an fp32 master and m, v (12 B, a copy of
    its own even for fp32 params) on the host, and under FSDP2 everything sharded."""
    buffer = {"fp32": (4 + 4, 8), "bf16": (2 + 4, 12), "fp16": (2 + 2, 16)}  # (p + g, optim)
    for precision, (kept, optim) in buffer.items():
        for strategy, shards in (("no_shard", 1), ("optim", n)):
            total = kept + optim / shards  # 16 / 8 + 8/N, 18 / 6 + 12/N, 20 / 4 + 16/N
            assert state_bytes_per_param(precision, strategy, n).total == pytest.approx(total)
            offloaded = state_bytes_per_param(precision, strategy, n, offload=True)
            assert offloaded.host == pytest.approx(12 / shards)
            assert offloaded.device == pytest.approx(kept)
        for strategy in ("optim_grads", "optim_grads_params"):
            state = state_bytes_per_param(precision, strategy, n)
            assert (state.params, state.grads, state.optimizer) == (4 / n, 4 / n, 8 / n)
            offloaded = state_bytes_per_param(precision, strategy, n, offload=True)
            assert offloaded.host == pytest.approx(16 / n) and offloaded.device == 0


def test_unknown_strategy_is_one_line():
    with pytest.raises(ValueError, match="--data-parallel-sharding-strategy must be one of "
                                         "no_shard, optim, optim_grads, optim_grads_params"):
        state_bytes_per_param("bf16", "zero3")


def _real_units(model: GPTModel) -> tuple[int, list[int]]:
    """(root, sorted units): parameters of the units megalite.distributed.fsdp wraps in a real
    model (inner units first, each parameter in its innermost unit) and of the root."""
    from megalite.distributed.fsdp import _units
    counted, units = set(), []
    for module, _ in _units(model):
        own = [q for q in module.parameters() if id(q) not in counted]
        counted.update(id(q) for q in own)
        units.append(sum(q.numel() for q in own))
    return sum(q.numel() for q in model.parameters() if id(q) not in counted), sorted(units)


@pytest.mark.parametrize("llama", [False, True])
def test_fsdp_units_and_gather_buffers_equal_a_real_model(llama):
    """The FSDP units of a tied GPT (embedding in the root: V h + s h + 2h beside 12 h^2 + 13 h
    layers) and a Llama (untied: the embedding a unit, the head in the root) against the
    units megalite.distributed.fsdp wraps in a real model; ZeRO-3
    gathers the root and the largest unit twice (computing + prefetched), ZeRO-2 and ZeRO-3
    under PP the whole stage and one unit's grads - or, with several microbatches, the
    stage's fp32 unsharded grads accumulated until the step's one reduce-scatter."""
    config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=1000,
                         max_position_embeddings=32)
    if llama:
        config = dataclasses.replace(
            config, normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
            ffn_hidden_size=96, group_query_attention=True, num_query_groups=2,
            disable_bias_linear=True, untie_embeddings_and_output_weights=True)
    root, units = _real_units(GPTModel(config))
    padded = 1024
    planned_root, planned = param_counts.fsdp_units(config, padded, 1, 1, 0)
    assert (planned_root, sorted(planned)) == (root, units)
    stage, largest = root + sum(units), max(units)
    assert param_counts.stage_params(config, padded, 1, 1, 0) == stage
    zero3 = functools.partial(gather_bytes, strategy="optim_grads_params", stage_params=stage,
                              root=root, largest=largest)
    assert zero3("bf16", pipeline=False) == 2 * (root + 2 * largest)
    assert zero3("fp32", pipeline=False) == 4 * (root + 2 * largest)
    assert zero3("bf16", pipeline=True) == 2 * (stage + largest)
    assert zero3("bf16", pipeline=True, microbatches=4) == 2 * stage + 4 * stage
    assert zero3("bf16", pipeline=False, microbatches=4) == 2 * (root + 2 * largest) + 4 * stage
    assert gather_bytes("bf16", "optim_grads", stage, root, largest, False) == \
        2 * (stage + largest)
    assert gather_bytes("bf16", "optim", stage, root, largest, False, 4) == 0


def test_start_up_line_counts_dense_over_dp_and_experts_over_expert_dp():
    """bf16 optim over 4 ranks, EP 2: 1M dense params x (2 + 4 + 12/4) + 0.5M expert params x
    (2 + 4 + 12/2) = 15 MB, 10 B/param; offloaded, the 12-byte optimizer part is host memory."""
    from megalite.planning.state_bytes import describe
    mib = 2 ** 20
    assert describe("bf16", "optim", 4, 2, False, 1_000_000, 500_000, 0) == (
        f"model state per rank: {15e6 / mib:,.1f} MiB (10 B/param, sharding optim over 4 ranks)")
    host = 1e6 * 3 + 5e5 * 6
    assert describe("bf16", "optim_grads_params", 4, 2, True, 1_000_000, 500_000, 2 * mib) == (
        f"model state per rank: {(1e6 * 4 + 5e5 * 8) / mib:,.1f} MiB (5.333 B/param, sharding "
        f"optim_grads_params over 4 ranks); {(1e6 * 4 + 5e5 * 8) / mib:,.1f} MiB of it in host "
        f"memory; + 2.0 MiB of gathered parameters at the peak")
    assert describe("bf16", "optim", 4, 2, True, 1_000_000, 500_000, 0).endswith(
        f"; {host / mib:,.1f} MiB of it in host memory")
