"""The MoE layer on 8 ranks (gloo) at EP 1, 2, 4, 8 (TP 1) and EP 2 x TP 2 vs the explicit
per-token reference over the full weights (tests/helpers/moe_reference.py), fp32: every rank's
outputs and input grads, the router grad (summed over DP) and every expert's weight grads
(summed over its expert-data-parallel group, gathered over TP) within 1e-5; with a capacity
factor the same number of choices is dropped. Also the dispatch/combine bytes of a uniform
routing vs the closed form T k h (EP - 1) / EP elements per rank each way, and the process
grid's expert groups and the planner's per-rank MoE parameter count."""
import pytest
import torch
import torch.distributed as dist

from megalite.config import ModelConfig
from megalite.device import current_device
from megalite.models.spec import TransformerSpec
from megalite.moe import MoELayer
from megalite.mpu import comm, initialize_model_parallel
from megalite.mpu import parallel_state as ps
from megalite.mpu.layers import gather_tensor_parallel
from megalite.mpu.parallel_state import GridLayout
from tests.helpers import moe_reference as ref
from tests.helpers.multirank import run_on_ranks
from tests.helpers.reference import rel_err

H, E, K, FFN, S, B = 16, 8, 2, 24, 3, 4
COEFFS = dict(aux_loss_coeff=0.1, z_loss_coeff=0.01)


def _layer(capacity_factor=None) -> MoELayer:
    torch.manual_seed(0)
    return MoELayer(H, E, FFN, K, capacity_factor=capacity_factor, shared_expert_size=8,
                    device=current_device(), **COEFFS)


def _inputs(dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + dp_rank)
    return tuple(torch.randn(S, B, H, generator=gen).to(current_device()) for _ in range(2))


def _reference(dp: int, capacity_factor) -> dict:
    """Full weights (EP 1, TP 1 build: init does not depend on the layout), every DP rank's
    tokens through the loop reference; loss = sum_d <out_d, g_d> + coeffs x losses."""
    initialize_model_parallel(1, 1)
    layer = _layer(capacity_factor)
    ps.destroy_model_parallel()
    w = {"router": layer.router.weight.detach().clone().requires_grad_(),
         "experts": [tuple(p.detach().clone().requires_grad_() for p in
                           (m.dense_h_to_4h.weight, m.dense_4h_to_h.weight))
                     for m in layer.local_experts.values()],
         "shared": tuple(p.detach().clone().requires_grad_() for p in
                         (layer.shared_experts.dense_h_to_4h.weight,
                          layer.shared_experts.dense_4h_to_h.weight))}
    outs, xs, dropped, loss = [], [], [], 0
    for d in range(dp):
        x, g = _inputs(d)
        x = x.reshape(-1, H).requires_grad_()
        out, aux, z, drop = ref.moe_forward(x, w, K, capacity_factor=capacity_factor)
        loss = loss + (out * g.reshape(-1, H)).sum() + COEFFS["aux_loss_coeff"] * aux \
            + COEFFS["z_loss_coeff"] * z
        outs.append(out.detach())
        xs.append(x)
        dropped.append(drop)
    loss.backward()
    return dict(w=w, outs=outs, x_grads=[x.grad for x in xs], dropped=dropped)


def _compare(tp: int, ep: int, refs: dict, capacity_factor=None) -> dict:
    dp = dist.get_world_size() // tp
    if (dp, capacity_factor) not in refs:
        refs[dp, capacity_factor] = _reference(dp, capacity_factor)
    want = refs[dp, capacity_factor]
    initialize_model_parallel(tp, 1, expert_model_parallel_size=ep)
    layer = _layer(capacity_factor)
    d = ps.get_data_parallel_rank()
    x, g = _inputs(d)
    x.requires_grad_()
    out = layer(x)
    (out * g).sum().backward()
    router_grad = layer.router.weight.grad.clone()
    comm.all_reduce(router_grad, ps.get_data_parallel_group())
    errors = {"out": rel_err(out.reshape(-1, H), want["outs"][d]),
              "x grad": rel_err(x.grad.reshape(-1, H), want["x_grads"][d]),
              "router grad": rel_err(router_grad, want["w"]["router"].grad),
              "dropped": (int(layer.moe_state.rows[0][2]), want["dropped"][d]),
              "experts": sorted(int(e) for e in layer.local_experts)}
    expert_errors = []
    for e, mlp in layer.local_experts.items():
        for param, full in zip((mlp.dense_h_to_4h.weight, mlp.dense_4h_to_h.weight),
                               want["w"]["experts"][int(e)]):
            grad = param.grad.clone()
            comm.all_reduce(grad, ps.get_expert_data_parallel_group())
            expert_errors.append(rel_err(gather_tensor_parallel(grad, param), full.grad))
    errors["expert grads"] = max(expert_errors)
    spec = TransformerSpec.from_config(ModelConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, swiglu=True, num_experts=E,
        moe_router_topk=K, moe_ffn_hidden_size=FFN, moe_shared_expert_intermediate_size=8))
    errors["params"] = (sum(p.numel() for p in layer.parameters()), spec.mlp_params(tp, 0, ep))
    return errors


def _uniform_bytes(ep: int, tokens: int = 16) -> dict:
    """Token t picks experts t mod E and t + 1 mod E: each expert gets T k / E choices."""
    initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
    layer, dev = _layer(), current_device()
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[:, :E] = torch.eye(E, device=dev)
    t, x = torch.arange(tokens, device=dev), torch.zeros(tokens, 1, H, device=dev)
    x[t, 0, t % E], x[t, 0, (t + 1) % E] = 2.0, 1.0
    x.requires_grad_()
    with comm.count_bytes() as moved:
        layer(x).sum().backward()
    return dict(moved)


def _all_cases() -> dict:
    refs: dict = {}
    out = {(1, ep): _compare(1, ep, refs) for ep in (1, 2, 4, 8)}
    out[(2, 2)] = _compare(2, 2, refs)
    out["capacity"] = _compare(1, 4, refs, capacity_factor=1.0)
    out["bytes"] = {ep: _uniform_bytes(ep) for ep in (2, 4, 8)}
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_on_ranks(8, _all_cases)


def test_moe_layer_at_ep_1_2_4_8_and_ep2_tp2_matches_loop_reference(results):
    for rank, per_rank in enumerate(results):
        for key, e in per_rank.items():
            if key == "bytes":
                continue
            for name in ("out", "x grad", "router grad", "expert grads"):
                assert e[name] < 1e-5, (rank, key, name, e)
            assert e["dropped"][0] == e["dropped"][1], (rank, key, e)
            assert e["params"][0] == e["params"][1], (rank, key, e)  # planner's count
    assert results[0]["capacity"]["dropped"][1] > 0
    assert results[1][(1, 2)]["experts"] == [4, 5, 6, 7]  # DP rank 1 of its EP block
    print({k: {n: e[n] for n in ("out", "x grad", "router grad", "expert grads")}
           for k, e in results[0].items() if k != "bytes"})


def test_dispatch_bytes_match_closed_form_for_uniform_routing(results):
    tokens = 16
    for ep, moved in results[0]["bytes"].items():
        each_way = tokens * K * H * (ep - 1) // ep * 4  # fp32 elements -> bytes
        # dispatch + combine, forward and backward: four all-to-alls of the same size
        assert moved["all_to_all"] == 4 * each_way, (ep, moved)
        assert moved["all_to_all_counts"] == (E // ep) * (ep - 1) * 8, (ep, moved)
    print({ep: m["all_to_all"] for ep, m in results[0]["bytes"].items()})


def test_expert_groups_are_carved_out_of_data_parallel():
    grid = GridLayout(tp=2, pp=2, dp=4, ep=2)
    assert grid.data_groups()[0] == [0, 2, 4, 6]
    assert grid.expert_model_groups()[:2] == [[0, 2], [4, 6]]
    assert grid.expert_data_groups()[:2] == [[0, 4], [2, 6]]
    ranks = sorted(r for g in grid.expert_model_groups() for r in g)
    assert ranks == list(range(16))
