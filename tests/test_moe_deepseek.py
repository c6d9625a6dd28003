"""DeepSeek-V3 routing and grouped experts (one process), and MoE with sequence and context
parallelism (4 ranks), against independent references:

- sigmoid scores, expert bias (selection only), group-limited top-k, renormalisation, the
  scaling factor and the shared expert equal transformers' DeepseekV3MoE with the same
  weights (fp32: outputs and all grads within 1e-5);
- grouped experts (--moe-grouped-gemm) give the looped experts' outputs and grads, and each
  form's full state dict loads into the other;
- the MoE layer at TP2 + SP x EP2 (grouped experts) and CP2 x EP2 (looped) equals the one-process
  layer on every DP rank's whole sequences (outputs, input grads, every weight grad, with the
  sequence-wise aux loss and z-loss on), and the expert bias after one update equals
  bias + rate * sign(mean - load) from the one-process token counts of all DP ranks.
"""
import dataclasses

import pytest
import torch

from megalite.device import current_device
from megalite.hf.moe import deepseek_moe_block_state
from megalite.models.sharding import full_names, full_state_dict, load_full_state_dict
from megalite.moe import MoELayer, update_expert_bias
from megalite.mpu import comm
from megalite.mpu.layers import gather_tensor_parallel
from tests.helpers.multirank import run_on_ranks
from tests.helpers.reference import rel_err

H, E, K, FFN = 32, 8, 2, 16
DEEPSEEK = dict(score_function="sigmoid", renormalize=True, num_groups=4, group_topk=2,
                topk_scaling_factor=2.5, expert_bias=True, shared_expert_size=FFN)


def _layer(device, **kw) -> MoELayer:
    torch.manual_seed(0)
    layer = MoELayer(H, E, FFN, K, device=device, **{**DEEPSEEK, **kw})
    with torch.no_grad():  # a bias that changes the choice of some tokens
        layer.router.expert_bias.copy_(torch.linspace(-0.05, 0.05, E, device=device))
    return layer


def full_grads(layer: MoELayer) -> dict[str, torch.Tensor]:
    """Every parameter's grad under its full state dict name(s), gathered over TP."""
    out = {}
    for name, param in layer.named_parameters():
        grad = gather_tensor_parallel(param.grad, param)
        keys = full_names(name, param)
        out.update(zip(keys, grad.unbind(0)) if hasattr(param, "expert_keys") else
                   [(name, grad)])
    return out


def test_deepseek_v3_routing_equals_transformers_moe_block(device):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    config = DeepseekV3Config(hidden_size=H, moe_intermediate_size=FFN, n_routed_experts=E,
                              num_experts_per_tok=K, n_group=4, topk_group=2,
                              n_shared_experts=1, routed_scaling_factor=2.5,
                              norm_topk_prob=True, hidden_act="silu")
    layer = _layer(device)
    hf = DeepseekV3MoE(config).to(device)
    hf.load_state_dict(deepseek_moe_block_state(full_state_dict(layer), E))
    experts = list(layer.local_experts.values())
    x = torch.randn(6, 3, H, generator=torch.Generator().manual_seed(1)).to(device)
    g = torch.randn(6, 3, H, generator=torch.Generator().manual_seed(2)).to(device)
    ours, theirs = x.clone().requires_grad_(), x.transpose(0, 1).contiguous().requires_grad_()
    with torch.no_grad():  # the bias moves some choices (else the test would not see it)
        biased = layer.router(ours.reshape(-1, H))[1]
        layer.router.expert_bias.zero_()
        unbiased = layer.router(ours.reshape(-1, H))[1]
        layer.router.expert_bias.copy_(hf.gate.e_score_correction_bias)
    assert not torch.equal(biased, unbiased)
    out, want = layer(ours), hf(theirs).transpose(0, 1)
    (out * g).sum().backward()
    (want * g).sum().backward()
    assert rel_err(out, want) < 1e-5 and rel_err(ours.grad, theirs.grad.transpose(0, 1)) < 1e-5
    grads = {"router.weight": hf.gate.weight.grad,
             "shared_experts.dense_4h_to_h.weight": hf.shared_experts.down_proj.weight.grad}
    for e, mlp in enumerate(experts):
        assert rel_err(mlp.dense_h_to_4h.weight.grad, hf.experts.gate_up_proj.grad[e]) < 1e-5
        assert rel_err(mlp.dense_4h_to_h.weight.grad, hf.experts.down_proj.grad[e]) < 1e-5
    ours_grads = dict(layer.named_parameters())
    for name, grad in grads.items():
        assert rel_err(ours_grads[name].grad, grad) < 1e-5, name
    print("vs DeepseekV3MoE: out", rel_err(out, want), "x grad",
          rel_err(ours.grad, theirs.grad.transpose(0, 1)))


def test_grouped_experts_equal_looped_and_checkpoints_cross_load(device):
    """Each backend of the grouped experts: torch._grouped_mm (forced: it runs on CPU too),
    the padded batched matmul, and its per-expert fallback (a bias that sends every token to
    experts 0 and 1: padding would quadruple the rows)."""
    from megalite.moe.experts import grouped_mm_runs
    x = torch.randn(8, 2, H, generator=torch.Generator().manual_seed(3)).to(device)
    skewed = torch.tensor([10.0, 10.0] + [0.0] * (E - 2), device=device)
    zero = torch.zeros(E, device=device)  # busiest expert: 7 of 32 rows, padded to 56 <= 64
    for backend, bias in (("grouped_mm", zero), ("padded", zero), ("loop", skewed)):
        looped, grouped = _layer(device), _layer(device, grouped_gemm=True)
        grouped.local_experts.use_grouped_mm = backend == "grouped_mm"
        if backend == "grouped_mm":
            assert grouped_mm_runs(torch.device(device), torch.float32, (2 * FFN, H), (H, FFN))
        outs = []
        for layer in (looped, grouped):
            layer.router.expert_bias.copy_(bias)
            inp = x.clone().requires_grad_()
            out = layer(inp)
            out.square().sum().backward()
            outs.append((out, inp.grad, full_grads(layer)))
        (a, a_grad, a_grads), (b, b_grad, b_grads) = outs
        busiest = grouped.moe_state.rows[0][3:].max().item()
        assert (busiest * E <= 2 * x.numel() // H * K) == (backend != "loop"), busiest
        assert rel_err(a, b) < 1e-6 and rel_err(a_grad, b_grad) < 1e-6, backend
        assert sorted(a_grads) == sorted(b_grads)
        for name in a_grads:
            assert rel_err(a_grads[name], b_grads[name]) < 1e-6, (backend, name)
    # a state dict of each form loads into the other (per-expert names, bias buffer included)
    state = full_state_dict(grouped)
    assert "router.expert_bias" in state and "local_experts.3.dense_4h_to_h.weight" in state
    other = _layer(device, expert_bias=True)
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
        other.router.expert_bias.zero_()
    load_full_state_dict(other, state)
    assert all(torch.equal(v, full_state_dict(other)[k]) for k, v in state.items())
    fresh = _layer(device, grouped_gemm=True)
    with torch.no_grad():
        fresh.local_experts.weight1.zero_()
    load_full_state_dict(fresh, full_state_dict(looped))
    assert torch.equal(fresh.local_experts.weight1, grouped.local_experts.weight1)


def test_cpu_grouped_experts_are_the_looped_experts_bit_for_bit():
    """On the CPU the grouped experts run torch._grouped_mm, one matmul per expert with the
    operands the looped experts' linears use: outputs, logged stats and every grad equal bit
    for bit, with an input grad and without one (the rows' grad matmul is then skipped)."""
    x = torch.randn(8, 2, H, generator=torch.Generator().manual_seed(4))
    for input_grad in (True, False):
        looped, grouped = _layer("cpu"), _layer("cpu", grouped_gemm=True)
        assert grouped.local_experts.use_grouped_mm
        results = []
        for layer in (looped, grouped):
            inp = x.clone().requires_grad_(input_grad)
            out = layer(inp)
            out.square().sum().backward()
            results.append((out, inp.grad, full_grads(layer), layer.moe_state.rows[0]))
        (a, a_grad, a_grads, a_row), (b, b_grad, b_grads, b_row) = results
        assert torch.equal(a, b) and torch.equal(a_row, b_row)
        assert torch.equal(a_grad, b_grad) if input_grad else a_grad is b_grad is None
        assert sorted(a_grads) == sorted(b_grads)
        assert all(torch.equal(a_grads[name], b_grads[name]) for name in a_grads)


# --- 4 ranks: TP2 + SP x EP2 and CP2 x EP2 vs the one-process layer -----------------------

S, B, RATE = 8, 2, 1e-3
COEFFS = dict(aux_loss_coeff=0.1, z_loss_coeff=0.01, load_balancing_type="seq_aux_loss",
              bias_update_rate=RATE)


def _inputs(dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10 + dp_rank)
    return tuple(torch.randn(S, B, H, generator=gen).to(current_device()) for _ in range(2))


def _reference(dp: int) -> dict:
    """One process: each DP rank's whole sequences; loss = sum_d <out_d, g_d> + aux + z."""
    from megalite.mpu import initialize_model_parallel, parallel_state as ps
    initialize_model_parallel(1, 1)
    layer = _layer(current_device(), **COEFFS)
    outs, x_grads, loads = [], [], 0
    for d in range(dp):
        x, g = _inputs(d)
        x.requires_grad_()
        out = layer(x)
        (out * g).sum().backward()  # the aux losses get their grads through the layer
        outs.append(out.detach())
        x_grads.append(x.grad)
        loads = loads + layer.moe_state.rows[0][3:]
        layer.moe_state.rows.clear()
    bias = layer.router.expert_bias + RATE * torch.sign(loads.mean() - loads)
    want = dict(outs=outs, x_grads=x_grads, grads=full_grads(layer), bias=bias)
    ps.destroy_model_parallel()
    return want


def _parallel(tp: int, cp: int, grouped: bool, want: dict) -> dict:
    from megalite.mpu import initialize_model_parallel, parallel_state as ps
    initialize_model_parallel(tp, 1, context_parallel_size=cp, expert_model_parallel_size=2)
    layer = _layer(current_device(), grouped_gemm=grouped, sequence_parallel=tp > 1, **COEFFS)
    d, shard = ps.get_data_parallel_rank(), ps.get_tensor_model_parallel_rank() if tp > 1 \
        else ps.get_context_parallel_rank()
    part = slice(shard * S // (tp * cp), (shard + 1) * S // (tp * cp))  # tokens: any split
    x, g = (t[part].clone() for t in _inputs(d))
    x.requires_grad_()
    out = layer(x)
    # CP ranks' grads are averaged (each adds its aux loss, of the whole sequences' counts),
    # so each weighs its tokens' share x cp; TP ranks' are summed (the layer adds aux / t)
    (out * g * cp).sum().backward()
    for param in layer.parameters():
        if getattr(param, "tp_grad_partial", False):
            comm.all_reduce(param.grad, ps.get_tensor_model_parallel_group())
        group = ps.get_expert_data_parallel_group() if getattr(param, "expert_parallel", False) \
            else ps.get_data_parallel_group(with_context_parallel=True)
        comm.all_reduce(param.grad, group)
        param.grad /= cp
    grads = full_grads(layer)
    update_expert_bias(layer)
    errors = {"out": rel_err(out, want["outs"][d][part]),
              "x grad": rel_err(x.grad / cp, want["x_grads"][d][part]),
              "grads": max(rel_err(grads[n], want["grads"][n]) for n in grads),
              "names": set(grads) < set(want["grads"]),  # this EP rank's experts
              "bias": (layer.router.expert_bias - want["bias"]).abs().max().item()}
    ps.destroy_model_parallel()
    return errors


def _sp_and_cp_cases() -> dict:
    want = _reference(2)
    return {"TP2+SP x EP2, grouped": _parallel(2, 1, True, want),
            "CP2 x EP2, looped": _parallel(1, 2, False, want)}


@pytest.fixture(scope="module")
def sp_cp_results() -> list[dict]:
    return run_on_ranks(4, _sp_and_cp_cases)


def test_moe_with_sequence_and_context_parallelism_equals_one_process(sp_cp_results):
    for rank, per_rank in enumerate(sp_cp_results):
        for layout, e in per_rank.items():
            assert e["names"], (rank, layout)
            for name in ("out", "x grad", "grads"):
                assert e[name] < 1e-5, (rank, layout, name, e)
    print({k: {n: e[n] for n in ("out", "x grad", "grads")}
           for k, e in sp_cp_results[0].items()})


def test_expert_bias_update_equals_token_count_reference_over_dp_and_ep(sp_cp_results):
    for rank, per_rank in enumerate(sp_cp_results):
        for layout, e in per_rank.items():
            assert e["bias"] < 1e-7, (rank, layout, e)


def test_bad_router_group_flags_fail_with_one_line():
    from megalite.config import ModelConfig
    base = dict(num_layers=4, num_experts=8, moe_router_topk=4)
    for kw, message in [
            (dict(moe_router_num_groups=3, moe_router_group_topk=1),
             r"^--moe-router-num-groups \(3\) must divide --num-experts \(8\)$"),
            (dict(moe_router_num_groups=4, moe_router_group_topk=1),
             r"^--moe-router-group-topk \(1\) must be in \[1, --moe-router-num-groups \(4\)\]"),
            (dict(moe_router_num_groups=4), r"^--moe-router-num-groups and "),
            (dict(moe_layer_freq="[0]*2+[1]*3"), r"^--moe-layer-freq '\[0\]\*2\+\[1\]\*3': "),
            (dict(moe_layer_freq="__import__('os')"), r"^--moe-layer-freq ")]:
        with pytest.raises(ValueError, match=message):
            ModelConfig(**base, **kw)
    config = ModelConfig(**base, moe_layer_freq="[0]*2+[1]*2")
    assert config.moe_layers == (False, False, True, True)
    assert dataclasses.replace(config, moe_layer_freq="2").moe_layers == (True, False, True,
                                                                          False)
