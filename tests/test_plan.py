"""megalite.planning.planner against hand-computed closed forms, the schedule tables and real models."""
import dataclasses
import importlib.util
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from megalite.config import (CheckpointConfig, Configs, DataConfig, ModelConfig, OptimizerConfig,
                             ParallelConfig, PrecisionConfig, TrainConfig)
from megalite.device import current_device
from megalite.models import GPTModel
from megalite.mpu import initialize_model_parallel
from megalite.mpu.layers import pad_vocab_size
from megalite.planning import activations
from megalite.planning import params as param_counts
from megalite.planning import planner
from megalite.planning.flops import flops_per_iteration
from megalite.schedules import SCHEDULE_KINDS
from megalite.schedules.accounting import (bubble_fraction, peak_inflight_microbatches,
                                           schedule_bubble)
from megalite.schedules.tables import build_schedule
from tests.helpers.multirank import run_on_ranks

GIB = 2 ** 30


def configs(layers=4, hidden=64, heads=4, vocab=1000, seq=32, tp=1, pp=1, vpp=None, dp=1,
            micro=2, batch=None, precision="bf16", recompute=None, distributed=False,
            schedule="1f1b") -> Configs:
    return Configs(
        ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                    vocab_size=vocab, max_position_embeddings=seq,
                    recompute_granularity=recompute),
        ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                       virtual_pipeline_model_parallel_size=vpp, data_parallel_size=dp,
                       pipeline_schedule=schedule),
        PrecisionConfig(bf16=precision == "bf16", fp16=precision == "fp16"),
        OptimizerConfig(use_distributed_optimizer=distributed),
        TrainConfig(micro_batch_size=micro, global_batch_size=batch, seq_length=seq),
        DataConfig(), CheckpointConfig())


def test_activations_per_layer_follow_korthikanti():
    s, b, h, a, t = 64, 2, 128, 8, 4
    sbh = s * b * h
    per = activations.activation_bytes_per_layer
    assert per(s, b, h, a, 1, 2, None) == sbh * (34 + 5 * a * s / h)
    assert per(s, b, h, a, t, 2, None) == sbh * (10 + 24 / t + 5 * a * s / (h * t))
    assert per(s, b, h, a, t, 2, "selective") == sbh * (10 + 24 / t)
    assert per(s, b, h, a, t, 2, None, True) == pytest.approx(sbh / t * (34 + 5 * a * s / h))
    assert per(s, b, h, a, t, 2, "selective", True) == pytest.approx(34 * sbh / t)
    assert per(s, b, h, a, t, 2, "full") == 2 * sbh
    # 4-byte activations: every 2-byte term doubles, the 1-byte dropout masks do not
    assert per(s, b, h, a, 1, 4, None) == sbh * (66 + 9 * a * s / h)
    assert per(s, b, h, a, 1, 4, "full") == 4 * sbh


CASES = [(name, p, m, v) for p in (2, 3, 4) for m in (p, 2 * p, 3 * p)
         for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3))]


@pytest.mark.parametrize("case", CASES, ids=[f"{n}-p{p}-m{m}-v{v}" for n, p, m, v in CASES])
def test_inflight_microbatches_and_bubble_match_the_schedule_tables(case):
    name, p, m, v = case
    table = build_schedule(name, p, m, v)
    for rank in range(p):
        assert activations.inflight_microbatches(name, p, m, v, rank) == \
            peak_inflight_microbatches(table, rank)
    assert schedule_bubble(SCHEDULE_KINDS[name], p, m, v) == Fraction(p - 1, v * m) == \
        bubble_fraction(table)


ZB_CASES = [(p, m) for p in (2, 3, 4, 8) for m in (p, 2 * p, 3 * p)]


@pytest.mark.parametrize("p, m", ZB_CASES)
def test_zero_bubble_inflight_and_bubble_follow_their_closed_forms(p, m):
    """ZB-H1: 1F1B's min(p - r, m) in flight and Qi et al.'s (p-1)(F+B-W)/(m(F+B+W)) with
    F = B = W; ZBV: min((m + r + 1) / 2, m, p) in flight; both against the simulated tables."""
    h1, zbv = build_schedule("zb-h1", p, m), build_schedule("zbv", p, m, 2)
    for rank in range(p):
        assert activations.inflight_microbatches("zb-h1", p, m, 1, rank) == min(p - rank, m) == \
            peak_inflight_microbatches(h1, rank)
        want = min(Fraction(m + rank + 1, 2), m, p)
        assert activations.inflight_microbatches("zbv", p, m, 2, rank) == want == \
            peak_inflight_microbatches(zbv, rank)
    f = b = w = 1
    closed_form = Fraction((p - 1) * (f + b - w), m * (f + b + w))
    assert schedule_bubble(SCHEDULE_KINDS["zb-h1"], p, m) == closed_form == bubble_fraction(h1)
    if p in (2, 4, 8) and m <= 2 * p:  # where the V table reaches (p-1)/(6m)
        assert schedule_bubble(SCHEDULE_KINDS["zbv"], p, m, 2) == Fraction(p - 1, 6 * m)


def test_plan_of_a_zero_bubble_layout_uses_its_schedule():
    zb = planner.plan(configs(layers=8, pp=4, batch=16, schedule="zb-h1"))
    v = planner.plan(configs(layers=8, pp=4, batch=16, schedule="zbv"))
    assert zb.layout.schedule.name == "zb-h1" and zb.bubble == Fraction(3, 24)
    assert v.layout.schedule.name == "zbv" and v.bubble == Fraction(3, 48)
    assert zb.stages["first"].inflight == v.stages["last"].inflight == 4
    assert zb.stages["last"].inflight == 1


def test_interleaving_penalty_on_stage_zero():
    p, v, m = 8, 4, 64
    assert activations.inflight_microbatches("interleaved", p, m, v) == \
        p * (1 + Fraction(p - 1, p * v))


@pytest.mark.parametrize("recompute", [None, "full"])
def test_flops_are_megatrons_formula(recompute):
    c = configs(layers=4, hidden=64, vocab=1000, seq=32, micro=2, batch=8, dp=2,
                recompute=recompute)
    B, s, L, h, V = 8, 32, 4, 64, 1024  # vocabulary padded to a multiple of 128
    if recompute == "full":
        want = 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    else:
        want = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    got = planner.plan(c).flops
    assert got == pytest.approx(want) and got == flops_per_iteration(c.model, B, s, V)


def test_stage_memory_is_state_plus_inflight_activations_plus_extras():
    c = configs(layers=8, pp=4, micro=2, batch=16, precision="bf16", recompute="selective")
    s, b, h, V = 32, 2, 64, 1024
    sbh = s * b * h
    p = planner.plan(c)
    first, last = p.stages["first"], p.stages["last"]
    # stage 0 holds p = 4 microbatches of its 2 layers, each 34 sbh, and 4 embedding masks
    layer = 2 * (12 * h * h + 13 * h)  # 2 layers of 12h^2 + 13h parameters
    assert first.params == layer + V * h + s * h
    assert last.params == layer + 2 * h + V * h
    assert first.total == first.params * 18 + 4 * 2 * 34 * sbh + 4 * sbh
    # the last stage holds one microbatch plus LayerNorm/LM-head inputs and fp32 logits
    assert last.total == last.params * 18 + 2 * 34 * sbh + 2 * 2 * sbh + 4 * s * b * V


def test_recompute_working_set():
    s, b, h, a = 256, 2, 64, 4  # a s / h = 16: the attention core outweighs what is freed first
    sbh = s * b * h
    selective = planner.plan(configs(hidden=h, heads=a, seq=s, micro=b, recompute="selective"))
    assert selective.stages["first"].recompute_working == (5 * 16 - (2 * 2 + 2 + 9 * 2)) * sbh
    full = planner.plan(configs(hidden=h, heads=a, seq=s, micro=b, recompute="full"))
    assert full.stages["first"].recompute_working == (34 + 5 * 16) * sbh  # one layer, whole
    assert full.stages["first"].layer_activations == 4 * 2 * sbh  # the 4 layers' inputs


def test_comm_volumes_per_step():
    c = configs(layers=4, tp=2, pp=2, dp=4, micro=2, batch=32, precision="bf16")
    p, m = planner.plan(c), 4
    sbh, sb = 32 * 2 * 64, 32 * 2
    first, last = p.comm("first"), p.comm("last")
    assert first["TP all-reduce"] == ("all_reduce", m * (2 * 4 * sbh * 2 + sbh * 2), 2)
    assert last["TP all-reduce"] == ("all_reduce", m * (2 * 4 * sbh * 2 + sbh * 2 + 3 * sb * 4),
                                     2)
    assert first["PP send"] == last["PP send"] == ("send", m * sbh * 2, 2)
    assert first["DP grad all-reduce"] == ("all_reduce", p.stages["first"].params * 4, 4)
    assert activations.ring_wire("all_reduce", 1000, 4) == 1500
    assert activations.ring_wire("reduce_scatter", 1000, 4) == 750


def test_gpt3_175b_fits_80gb_with_tp8_pp16_selective_distributed_but_not_alone():
    gpt3 = dict(layers=96, hidden=12288, heads=96, vocab=51200, seq=2048, micro=1,
                precision="bf16", recompute="selective")
    parallel = planner.plan(configs(**gpt3, tp=8, pp=16, dp=8, batch=1536, distributed=True))
    assert max(s.total for s in parallel.stages.values()) < 80 * GIB
    alone = planner.plan(configs(**gpt3, batch=1))
    assert alone.stages["first"].total > 80 * GIB
    assert alone.total_params == pytest.approx(175e9, rel=0.01)


def test_stage_params_equal_a_real_model():
    c = configs(layers=4, pp=2)
    padded = 1024
    for rank, (pre, post, layers) in enumerate([(True, False, (0, 2)), (False, True, (2, 4))]):
        model = GPTModel(c.model, pre, post, layer_range=layers)
        assert param_counts.stage_params(c.model, padded, 1, 2, rank) == \
            sum(q.numel() for q in model.parameters())


def llama(c: Configs, groups: int = 2) -> Configs:
    """The same shape with the Llama spec: RMSNorm, rope, SwiGLU (ffn 96), GQA, untied head."""
    c.model = dataclasses.replace(
        c.model, normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
        ffn_hidden_size=96, group_query_attention=True, num_query_groups=groups,
        disable_bias_linear=True, untie_embeddings_and_output_weights=True)
    return c


def _tp_params(tp: int, spec: str) -> tuple[int, int]:
    initialize_model_parallel(tp, 1)
    c = configs(layers=2)
    model = GPTModel((llama(c) if spec == "llama" else c).model, device=current_device())
    return sum(q.numel() for q in model.parameters()), pad_vocab_size(1000, 128, tp)


@pytest.mark.parametrize("spec", ["gpt2", "llama"])
def test_tp_stage_params_equal_a_real_model(spec):
    """TP 2 and (Llama, 2 KV groups replicated) TP 4: the planner counts each rank's shard."""
    c = configs(layers=2)
    c = llama(c) if spec == "llama" else c
    for tp in (2, 4) if spec == "llama" else (2,):
        for count, padded in run_on_ranks(tp, _tp_params, tp, spec):
            assert count == param_counts.stage_params(c.model, padded, tp, 1, 0), tp


def test_llama_stage_params_and_total_equal_a_real_model():
    c = llama(configs(layers=4, pp=2), groups=1)
    padded, stages = 1024, []
    for rank, (pre, post, layers) in enumerate([(True, False, (0, 2)), (False, True, (2, 4))]):
        model = GPTModel(c.model, pre, post, layer_range=layers)
        stages.append(sum(q.numel() for q in model.parameters()))
        assert param_counts.stage_params(c.model, padded, 1, 2, rank) == stages[-1]
    assert planner.plan(c).total_params == sum(stages)


def deepseek_v3(mtp: int) -> Configs:
    """The test_plan shape with DeepSeek-V3's parts: MLA (q and kv compressed), 2 dense then 2
    MoE layers (8 experts, top-2, shared expert; looped: the grouped form's padding rows would
    count as FLOPs), untied head, `mtp` prediction depths."""
    from megalite.config import parse_configs
    from tests.test_moe_training import DEEPSEEK_FLAGS
    return parse_configs([
        *(f for f in DEEPSEEK_FLAGS if f != "--moe-grouped-gemm"), "--num-layers", "4",
        "--hidden-size", "64", "--num-attention-heads", "4", "--vocab-size", "1000",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--multi-latent-attention", "--q-lora-rank", "24", "--kv-lora-rank", "16",
        "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8",
        "--untie-embeddings-and-output-weights",
        *(["--mtp-num-layers", str(mtp)] if mtp else [])])


def test_deepseek_v3_with_mtp_stage_params_total_and_flops_equal_a_real_model():
    """Multi-token prediction (2 depths: each a layer of the last layer's kind, 3 norms and
    eh_proj [h, 2h]) sits on the last stage, which under PP 2 also keeps a copy of the word
    embedding: the planner's stage counts equal a real model's at PP 1 and 2, the total is the
    PP 1 model's, and the FLOPs the prediction depths add are those counted by
    torch.utils.flop_counter in a forward (x 3 for forward and backward)."""
    from torch.utils.flop_counter import FlopCounterMode
    c = deepseek_v3(mtp=2)
    whole = GPTModel(c.model, device="meta")
    assert param_counts.stage_params(c.model, 1024, 1, 1, 0) == \
        sum(q.numel() for q in whole.parameters()) == planner.plan(c).total_params
    for rank, (pre, post, layers) in enumerate([(True, False, (0, 2)), (False, True, (2, 4))]):
        stage = GPTModel(c.model, pre, post, layer_range=layers, device="meta")
        assert param_counts.stage_params(c.model, 1024, 1, 2, rank) == \
            sum(q.numel() for q in stage.parameters()), rank
    tokens = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(0))
    counted = {}
    for mtp in (0, 2):
        model = GPTModel(deepseek_v3(mtp).model)
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(tokens, labels=tokens)
        counted[mtp] = counter.get_total_flops()
    added = flops_per_iteration(c.model, 2, 32, 1024) - \
        flops_per_iteration(deepseek_v3(0).model, 2, 32, 1024)
    assert added == 3 * (counted[2] - counted[0]), (added, counted)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_llama_flops_are_megatrons_gqa_swiglu_formula(groups):
    """Megatron-LM's num_floating_point_operations: 12 B s L h^2 [(1 + G/H + s/h) (H d / h)
    + (ffn / h) 3/2 + V / (2 L h)] (query projection ratio H d / h, gated-linear 3/2)."""
    c = llama(configs(layers=4, hidden=64, heads=4, vocab=1000, seq=32, micro=2, batch=8),
              groups)
    B, s, L, h, V, H, d, ffn = 8, 32, 4, 64, 1024, 4, 16, 96
    want = 12 * B * s * L * h * h * ((1 + groups / H + s / h) * (H * d / h) + ffn / h * 1.5
                                     + V / (2 * L * h))
    assert flops_per_iteration(c.model, B, s, V) == pytest.approx(want)


def _plan_tool():
    path = Path(__file__).resolve().parents[1] / "tools" / "plan.py"
    spec = importlib.util.spec_from_file_location("plan_tool", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_plan_tool_prints_a_plan(capsys):
    _plan_tool().main(["--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96",
               "--vocab-size", "51200", "--seq-length", "2048", "--tp", "8", "--pp", "16",
               "--dp", "8", "--micro-batch-size", "1", "--global-batch-size", "1536", "--bf16",
               "--recompute-granularity", "selective", "--use-distributed-optimizer",
               "--peak-tflops", "312", "--mfu", "0.5"])
    out = capsys.readouterr().out
    assert "fits 80 GiB: yes" in out and "Pipeline bubble: 0.0781" in out


def test_plan_tool_prints_the_model_state_of_each_strategy(capsys):
    """bf16 over DP 8: 2 + 4 + 12 = 18, 2 + 4 + 12/8 = 7.5 B/param on the grad buffer; FSDP
    4 + 4 + 8 over 8 = 2; offloaded, ZeRO-3 keeps none of it on the GPU."""
    tool = _plan_tool()
    model = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
             "--vocab-size", "1000", "--seq-length", "32", "--dp", "8", "--bf16"]
    want = {"no_shard": "18 B/param (2 params + 4 grads + 12 optimizer; 18 on the GPU, 0 in",
            "optim": "7.5 B/param (2 params + 4 grads + 1.5 optimizer; 7.5 on the GPU, 0 in",
            "optim_grads": "2 B/param (0.5 params + 0.5 grads + 1 optimizer; 2 on the GPU",
            "optim_grads_params": "2 B/param (0.5 params + 0.5 grads + 1 optimizer; 2 on the"}
    for strategy, line in want.items():
        tool.main(model + ["--data-parallel-sharding-strategy", strategy])
        assert f"Model state per rank: {line}" in capsys.readouterr().out, strategy
    tool.main(model + ["--data-parallel-sharding-strategy", "optim_grads_params",
                       "--optimizer-cpu-offload"])
    assert "1 optimizer; 0 on the GPU, 2 in host memory)" in capsys.readouterr().out


def test_moe_expert_states_shard_over_expert_data_parallel_ranks():
    """EP 2 of DP 4, distributed optimizer: the E / ep experts of each MoE layer count on the
    rank, and their optimizer states shard over DP / EP = 2 ranks, the rest over DP = 4."""
    c = configs(layers=4, pp=2, dp=4, distributed=True, precision="fp32")
    c.model = dataclasses.replace(c.model, num_experts=8, moe_ffn_hidden_size=24,
                                  moe_layer_freq=2)
    c.parallel.expert_model_parallel_size = 2
    first = planner.plan(c).stages["first"]
    h, experts_per_rank, moe_layers_on_stage = 64, 8 // 2, 1  # layers 0 (MoE) and 1 (dense)
    assert first.expert_params == moe_layers_on_stage * experts_per_rank * 2 * h * 24
    dense = first.params - first.expert_params
    state = first.state_bytes
    assert state.params == 4 * first.params and state.grads == 4 * first.params
    assert state.optimizer == dense * 8 / 4 + first.expert_params * 8 / 2
    # activations: one MoE layer adds router fp32 logits + scores, k dispatched token copies
    # and k experts' GeLU in/out, less the dense layer's 4h GeLU in/out (e = 4 bytes, fp32)
    dense_plan = planner.plan(configs(layers=4, pp=2, dp=4, distributed=True, precision="fp32"))
    s, b, e = 32, 2, 4
    delta = 8 * s * b * 8 + e * 2 * s * b * h + 2 * e * s * b * 2 * 24 - 8 * e * s * b * h
    inflight = first.inflight  # 1F1B, PP 2: the first stage holds 2 microbatches
    assert first.layer_activations == dense_plan.stages["first"].layer_activations \
        + inflight * delta
