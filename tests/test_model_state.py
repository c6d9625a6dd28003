"""Model-state bytes per parameter per rank under each sharding strategy (megalite.model_state,
megalite.planner) against the ZeRO paper's closed forms, written out here, and real models."""
import dataclasses

import pytest

from megalite import planner
from megalite.config import ModelConfig
from megalite.model_state import STRATEGIES, gather_bytes, state_bytes_per_param, zero_bytes
from megalite.models import GPTModel

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


def _units(model: GPTModel) -> list[int]:
    """Parameter counts of the FSDP units of a real model: each layer, the embedding, the
    final norm with an untied output layer."""
    count = lambda module: sum(q.numel() for q in module.parameters())  # noqa: E731
    tail = count(model.final_layernorm) + (count(model.output_layer)
                                           if hasattr(model, "output_layer") else 0)
    return [count(layer) for layer in model.encoder.layers.values()] + [
        count(model.embedding), tail]


@pytest.mark.parametrize("llama", [False, True])
def test_largest_unit_and_gather_buffers_equal_a_real_model(llama):
    """The largest FSDP unit of a GPT (the embedding: V h + s h > 12 h^2 + 13 h) and a Llama
    (untied output layer); ZeRO-3 gathers it twice (compute + prefetch) in bf16, ZeRO-2 and
    ZeRO-3 under PP hold the whole stage; several microbatches add the stage's fp32
    unsharded grads, accumulated until the step's one reduce-scatter."""
    config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=1000,
                         max_position_embeddings=32)
    if llama:
        config = dataclasses.replace(
            config, normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
            ffn_hidden_size=96, group_query_attention=True, num_query_groups=2,
            disable_bias_linear=True, untie_embeddings_and_output_weights=True)
    units = _units(GPTModel(config))
    padded = 1024
    largest = planner.largest_unit(config, padded, 1, 1, 0)
    assert largest == max(units)
    stage = planner.stage_params(config, padded, 1, 1, 0)
    assert stage == sum(units)
    assert gather_bytes("bf16", "optim_grads_params", stage, largest, False) == 2 * 2 * max(units)
    assert gather_bytes("fp32", "optim_grads_params", stage, largest, False) == 2 * 4 * max(units)
    assert gather_bytes("bf16", "optim_grads", stage, largest, False) == 2 * sum(units)
    assert gather_bytes("bf16", "optim_grads_params", stage, largest, True) == 2 * sum(units)
    assert gather_bytes("bf16", "optim_grads_params", stage, largest, True, 4) == \
        (2 + 4) * sum(units)
    assert gather_bytes("fp32", "optim_grads_params", stage, largest, False, 2) == \
        2 * 4 * max(units) + 4 * sum(units)
    assert gather_bytes("bf16", "optim", stage, largest, False) == 0


def test_start_up_line_counts_dense_over_dp_and_experts_over_expert_dp():
    """bf16 optim over 4 ranks, EP 2: 1M dense params x (2 + 4 + 12/4) + 0.5M expert params x
    (2 + 4 + 12/2) = 15 MB, 10 B/param; offloaded, the 12-byte optimizer part is host memory."""
    from megalite.model_state import describe
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
