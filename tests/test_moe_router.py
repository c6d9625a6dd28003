"""Router and auxiliary losses vs the explicit reference (tests/helpers/moe_reference.py): top-k
choice and weights (softmax / sigmoid, with and without renormalisation, ties to the lower
index), load-balancing loss with an expert that gets no token, z-loss; the single-process
MoE layer vs a per-token loop; the aux-loss gradient inside an executor step (loss_scale /
microbatches) and after it (1.0), and the chunk's stats reset each step; and one-line errors
for impossible expert layouts."""
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from megalite.config import ModelConfig, ParallelConfig
from megalite.device import current_device
from megalite.moe import (MoELayer, MoEState, load_balancing_loss, native_routing, topk_routing,
                          z_loss)
from megalite.moe.router import tokens_per_expert
from tests.helpers import moe_reference as ref
from tests.helpers.multirank import run_on_ranks
from tests.helpers.reference import rel_err


@pytest.mark.parametrize("score,renorm", [("softmax", False), ("softmax", True),
                                          ("sigmoid", False), ("sigmoid", True)])
def test_topk_choice_and_weights_match_reference(score, renorm, device):
    logits = torch.randn(10, 6, generator=torch.Generator().manual_seed(0)).to(device)
    logits[3] = torch.tensor([0.5, 2.0, 2.0, 2.0, -1.0, 0.5])  # a three-way tie for the top
    logits[4] = 0.0                                             # all tied
    weights, indices, scores = topk_routing(logits, 2, score, renorm)
    choices, ref_scores = ref.route(logits, 2, score, renorm)
    assert indices.tolist() == [[e for e, _ in row] for row in choices]
    assert indices[3].tolist() == [1, 2] and indices[4].tolist() == [0, 1]
    want = torch.stack([torch.stack([w for _, w in row]) for row in choices])
    assert rel_err(weights, want) < 1e-6 and rel_err(scores, ref_scores) < 1e-6


@pytest.mark.parametrize("host_kernel", [True, False])
def test_group_limited_choice_matches_reference(host_kernel, monkeypatch):
    """DeepSeek-V3's group-limited choice from biased sigmoid scores, with tied, all-equal, NaN
    and -inf rows, equals the per-token reference: by the host kernel (routing.c) and by the
    torch ops a machine without a C compiler runs."""
    if host_kernel and native_routing.kernels() is None:
        pytest.skip("no C compiler: the host kernel is not built")
    if not host_kernel:
        monkeypatch.setattr(native_routing, "kernels", lambda: None)
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(40, 16, generator=gen)
    logits[1], logits[2] = logits[1].round(), 0.0  # ties, all equal
    logits[3, 5], logits[4, :6] = float("nan"), float("-inf")
    for bias in (None, torch.randn(16, generator=gen) * 0.1):
        _, indices, scores = topk_routing(logits, 3, "sigmoid", True, bias, 4, 2)
        choice = scores if bias is None else scores + bias
        assert indices.tolist() == ref.group_limited_choice(choice, 3, 4, 2)
    if host_kernel:
        with pytest.raises(ValueError, match="native_routing: the tensors do not match"):
            native_routing.route(native_routing.kernels(), scores, torch.zeros(15), 3, 4, 2)


def test_aux_and_z_loss_match_reference_with_an_idle_expert(device):
    logits = torch.randn(12, 5, generator=torch.Generator().manual_seed(1)).to(device)
    logits[:, 4] = -30.0  # expert 4 is never chosen
    for score in ("softmax", "sigmoid"):
        _, indices, scores = topk_routing(logits, 2, score)
        assert tokens_per_expert(indices, 5)[4] == 0
        choices, ref_scores = ref.route(logits, 2, score, False)
        assert rel_err(load_balancing_loss(scores, indices, 2),
                       ref.aux_loss(ref_scores, choices, 2)) < 1e-6
    assert rel_err(z_loss(logits), ref.z_loss(logits)) < 1e-6
    _, indices, scores = topk_routing(torch.eye(4, device=device).repeat(2, 1), 1)
    assert abs(load_balancing_loss(scores, indices, 1).item() - 1.0) < 1e-6  # balanced: 1


def layer_weights(layer: MoELayer) -> dict:
    """The layer's full weights (single process) as the reference's dict."""
    weights = {"router": layer.router.weight,
               "experts": [(m.dense_h_to_4h.weight, m.dense_4h_to_h.weight)
                           for m in layer.local_experts.values()]}
    if layer.shared_experts is not None:
        weights["shared"] = (layer.shared_experts.dense_h_to_4h.weight,
                             layer.shared_experts.dense_4h_to_h.weight)
    if layer.shared_expert_gate is not None:
        weights["shared_gate"] = layer.shared_expert_gate
    return weights


@pytest.mark.parametrize("kw", [dict(), dict(capacity_factor=1.0),
                                dict(shared_expert_size=24, shared_expert_gate=True,
                                     renormalize=True, score_function="sigmoid")])
def test_single_process_layer_matches_loop_outputs_and_grads(kw, device):
    torch.manual_seed(0)
    layer = MoELayer(16, 4, 24, 2, aux_loss_coeff=0.1, z_loss_coeff=0.01, device=device, **kw)
    x = torch.randn(5, 2, 16, requires_grad=True, device=device)
    out = layer(x)
    (out.square().sum()).backward()
    x_ref = x.detach().clone().requires_grad_()
    w = layer_weights(layer)
    ref_out, aux, z, dropped = ref.moe_forward(
        x_ref.reshape(-1, 16), w, 2, kw.get("score_function", "softmax"),
        kw.get("renormalize", False), kw.get("capacity_factor"))
    if kw.get("capacity_factor"):
        assert dropped > 0
    grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    (ref_out.square().sum() + 0.1 * aux + 0.01 * z).backward()
    assert rel_err(out.reshape(-1, 16), ref_out) < 1e-5
    assert rel_err(x.grad, x_ref.grad) < 1e-5
    for got, param in zip(grads, layer.parameters()):
        assert rel_err(got, param.grad) < 1e-5


class _MoEChunk(nn.Module):
    """A one-stage model chunk: an MoE layer (aux loss only) sharing the chunk's MoEState."""

    def __init__(self, hidden: int, coeff: float) -> None:
        super().__init__()
        self.config = SimpleNamespace(hidden_size=hidden)
        self.moe_state = MoEState()
        self.moe = MoELayer(hidden, 4, 24, 2, aux_loss_coeff=coeff, moe_state=self.moe_state,
                            device=current_device())

    def set_input_tensor(self, tensor) -> None:
        assert tensor is None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)


def _aux_grads_in_and_after_a_step(loss_scale: float, coeff: float) -> dict:
    """Two executor steps of 3 microbatches whose main loss is 0 x output (the router grad is
    the aux losses' alone), then a plain backward; router grads vs the reference aux loss."""
    from megalite.mpu import initialize_model_parallel
    from megalite.schedules import get_forward_backward_func
    initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    chunk = _MoEChunk(16, coeff)
    xs = [torch.randn(5, 2, 16, generator=torch.Generator().manual_seed(m)).to(current_device())
          for m in range(3)]

    def reference_aux_grad(x: torch.Tensor) -> torch.Tensor:
        weight = chunk.moe.router.weight.detach().clone().requires_grad_()
        choices, scores = ref.route(x.reshape(-1, 16) @ weight.t(), 2, "softmax", False)
        ref.aux_loss(scores, choices, 2).backward()
        return weight.grad

    def step_func(iterator, model):
        return model(next(iterator)), lambda out: ((out * 0).sum(), {"lm loss": out.new_zeros(())})
    out = {"in step": [], "tokens": []}
    for _ in range(2):
        chunk.zero_grad()
        get_forward_backward_func()(forward_step_func=step_func, data_iterator=iter(xs),
                                    model=chunk, num_microbatches=3, seq_length=5,
                                    micro_batch_size=2, loss_scale=loss_scale)
        want = loss_scale / 3 * coeff * sum(reference_aux_grad(x) for x in xs)
        out["in step"].append(rel_err(chunk.moe.router.weight.grad, want))
        out["tokens"].append(chunk.moe_state.rows[0][3:].sum().item())
    out["scale after"] = chunk.moe_state.backward_scale
    chunk.zero_grad()
    (chunk(xs[0]) * 0).sum().backward()
    out["plain"] = rel_err(chunk.moe.router.weight.grad, coeff * reference_aux_grad(xs[0]))
    return out


def test_executor_step_scales_aux_loss_grads_and_resets_the_chunks_stats():
    (result,) = run_on_ranks(1, _aux_grads_in_and_after_a_step, 4.0, 0.1)
    assert max(result["in step"]) < 1e-5 and result["plain"] < 1e-5, result
    assert result["tokens"] == [3 * 10 * 2] * 2  # 3 microbatches x 10 tokens x top-2, per step
    assert result["scale after"] == 1.0


def test_bad_expert_layouts_fail_with_one_line():
    from megalite.config import (CheckpointConfig, Configs, DataConfig, OptimizerConfig,
                                 PrecisionConfig, TrainConfig)
    from megalite.layout import RunLayout
    with pytest.raises(ValueError, match=r"^--moe-router-topk \(5\) must be between 1 and "
                                         r"--num-experts \(4\)$"):
        ModelConfig(num_experts=4, moe_router_topk=5)

    def check(experts: int, ep: int, world: int) -> str:
        configs = Configs(ModelConfig(num_experts=experts, num_layers=2),
                          ParallelConfig(expert_model_parallel_size=ep), PrecisionConfig(),
                          OptimizerConfig(), TrainConfig(seq_length=64), DataConfig(),
                          CheckpointConfig())
        with pytest.raises(ValueError) as error:
            RunLayout.from_configs(configs, world)
        assert "\n" not in str(error.value)
        return str(error.value)
    assert check(6, 4, 8) == "--num-experts (6) must be divisible by " \
                             "--expert-model-parallel-size (4)"
    assert check(8, 4, 6) == "--expert-model-parallel-size (4) must divide the data-parallel " \
                             "size (6): EP ranks are carved out of DP"
