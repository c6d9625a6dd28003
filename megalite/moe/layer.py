"""The mixture-of-experts MLP: router, all-to-all dispatch over the EP group, local experts,
optional (gated) shared expert, auxiliary losses.

Experts are carved out over the expert-model-parallel (EP) group (E / EP per rank, named by
their global index: `experts.local_experts.{e}...`, so full state dicts of EP ranks merge
by key); each expert's FFN is split over TP like the dense MLP. Without sequence
parallelism all TP ranks of a group route the same tokens (one all-reduce on the TP group
after the local experts). With it (Megatron's all-to-all dispatcher over TP x EP) each TP
rank routes its own s/t tokens: all-to-all over EP, then the received rows are gathered over
TP, the experts' partial outputs reduce-scattered back over TP, all-to-all back over EP.
With SP or CP the load-balancing losses count the choices of the whole sequences (an
all-reduce of [b, E] counts on the TP and/or CP group).
"""
import torch
from torch import nn

from megalite.moe.dispatcher import combine, dispatch, expert_capacity, plan_dispatch
from megalite.moe.experts import GroupedExperts
from megalite.moe.router import TopKRouter, load_balancing_loss, sequence_counts, z_loss
from megalite.moe.stats import MoEState, attach_aux_loss
from megalite.mpu import comm, parallel_state
from megalite.mpu.layers import InitMethod, init_method_normal, \
    set_tensor_model_parallel_attributes
from megalite.mpu.mappings import (copy_to_tensor_model_parallel_region,
                                   reduce_from_tensor_model_parallel_region)
from megalite.mpu.mlp import ParallelMLP
from megalite.mpu.random import init_generator, seeded
from megalite.mpu.weight_grad import linear


class LocalExperts(nn.ModuleDict):
    """This EP rank's experts (ParallelMLPs by global expert index); a module of its own so
    data parallelism can treat them apart (FSDP shards them over expert-DP).
    forward(rows [M, h] grouped by local expert, counts per local expert) -> [M, h]: one
    matmul pair per expert (also for an expert with no rows, so every expert has a grad);
    weight grads are deferrable (zb-h1, zbv)."""

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return torch.cat([linear(mlp.activate(linear(part, mlp.dense_h_to_4h.weight)),
                                 mlp.dense_4h_to_h.weight)
                          for mlp, part in zip(self.values(), rows.split(counts))])


class MoELayer(nn.Module):
    """forward(x [s, b, h]) -> [s, b, h].

    Every token goes to its top-k experts (dropless, or at most `capacity_factor` x its
    fair share of this rank's choices per expert); the output is the router-weighted sum of
    their outputs, plus the shared expert's (times sigmoid(gate(x)) when gated). In training
    the aux (load-balancing: over the microbatch, or per sequence with `load_balancing_type`
    "seq_aux_loss") and z losses, times their coefficients, get the gradient
    `moe_state.backward_scale` through `attach_aux_loss`; their values are recorded per layer
    in `moe_state` (the model chunk's MoEState; the layer's own when not given), those only
    logged (coefficient 0) while `moe_state.log_router_losses`.
    `sequence_parallel`: x is this TP rank's [s/t, b, h] (see the module docstring).
    `grouped_gemm`: the local experts as one GroupedExperts (stacked weights) instead of one
    ParallelMLP each (same initial weights, same per-expert names in full state dicts).
    """

    def __init__(self, hidden_size: int, num_experts: int, ffn_hidden_size: int, topk: int,
                 activation: str = "swiglu", score_function: str = "softmax",
                 renormalize: bool = False, aux_loss_coeff: float = 0.0,
                 z_loss_coeff: float = 0.0, capacity_factor: float | None = None,
                 shared_expert_size: int | None = None, shared_expert_gate: bool = False,
                 layer_number: int = 0, init_method: InitMethod | None = None,
                 output_init_method: InitMethod | None = None, init_std: float = 0.02,
                 group=None, expert_group=None, params_dtype: torch.dtype = torch.float32,
                 device=None, moe_state: MoEState | None = None,
                 load_balancing_type: str = "aux_loss", expert_bias: bool = False,
                 bias_update_rate: float = 0.0, num_groups: int | None = None,
                 group_topk: int | None = None, topk_scaling_factor: float | None = None,
                 grouped_gemm: bool = False, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.moe_state = MoEState() if moe_state is None else moe_state
        self.expert_group = (parallel_state.get_expert_model_parallel_group()
                             if expert_group is None else expert_group)
        self.tp_group = parallel_state.get_tensor_model_parallel_group() if group is None \
            else group
        ep = comm.world_size(self.expert_group)
        # megalite.config and megalite.layout check these for a run, naming the flag
        assert 1 <= topk <= num_experts and num_experts % ep == 0, \
            "top-k must be in [1, experts] and the experts divisible by the EP size"
        self.num_experts, self.topk, self.layer_number = num_experts, topk, layer_number
        self.aux_loss_coeff, self.z_loss_coeff = aux_loss_coeff, z_loss_coeff
        self.capacity_factor = capacity_factor
        self.per_sequence = load_balancing_type == "seq_aux_loss"
        self.bias_update_rate = bias_update_rate
        tp = comm.world_size(self.tp_group)
        self.sequence_parallel = sequence_parallel and tp > 1
        cp = parallel_state.get_context_parallel_world_size() \
            if parallel_state.model_parallel_is_initialized() else 1
        # ranks holding other tokens of the same sequences: their choices are counted together
        self.token_groups = ([self.tp_group] if self.sequence_parallel else []) + (
            [parallel_state.get_context_parallel_group()] if cp > 1 else [])
        self.shards = (tp if self.sequence_parallel else 1) * cp
        self.router = TopKRouter(hidden_size, num_experts, topk, score_function, renormalize,
                                 init_std, params_dtype, device, expert_bias, num_groups,
                                 group_topk, topk_scaling_factor)
        self.router.weight.tp_grad_partial = self.sequence_parallel
        seeds = torch.randint(0, 2 ** 31 - 1, (num_experts,),
                              generator=init_generator()).tolist()
        local = num_experts // ep
        first = local * (torch.distributed.get_rank(self.expert_group) if ep > 1 else 0)
        kw = dict(activation=activation, bias=False, init_method=init_method,
                  output_init_method=output_init_method, group=group,
                  params_dtype=params_dtype, device=device)
        experts = {}
        for e in range(first, first + local):
            with seeded(seeds[e]):
                experts[str(e)] = ParallelMLP(hidden_size, ffn_hidden_size, **kw)
        self.local_experts = GroupedExperts(experts) if grouped_gemm else \
            LocalExperts(experts)
        for param in self.local_experts.parameters():
            param.expert_parallel = True
        self.shared_experts = ParallelMLP(hidden_size, shared_expert_size, **kw,
                                          sequence_parallel=self.sequence_parallel) \
            if shared_expert_size else None
        self.shared_expert_gate = None
        if shared_expert_gate:
            gate = torch.empty(1, hidden_size)
            (init_method or init_method_normal(init_std))(gate)
            self.shared_expert_gate = nn.Parameter(gate.to(device=device, dtype=params_dtype))
            set_tensor_model_parallel_attributes(self.shared_expert_gate, False)
            self.shared_expert_gate.tp_grad_partial = self.sequence_parallel

    def _run_experts(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows grouped by local expert [M, h] -> this TP rank's partial outputs [M, h]
        (GroupedExperts or LocalExperts)."""
        return self.local_experts(rows, counts)

    def _experts_output(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows [M, h] -> expert outputs [M, h], complete (all-reduced over TP), or partial
        over TP with sequence parallelism (`combine` reduce-scatters them)."""
        if self.sequence_parallel:
            return self._run_experts(rows, counts)
        rows = copy_to_tensor_model_parallel_region(rows, self.tp_group)
        return reduce_from_tensor_model_parallel_region(self._run_experts(rows, counts),
                                                        self.tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        weights, indices, scores, logits = self.router(tokens)
        capacity = None if self.capacity_factor is None else expert_capacity(
            tokens.shape[0], self.topk, self.num_experts, self.capacity_factor)
        gather = self.tp_group if self.sequence_parallel else None
        plan = plan_dispatch(indices, weights, self.num_experts, capacity, self.expert_group,
                             gather)
        rows = dispatch(tokens, plan, self.expert_group, gather)
        out = combine(self._experts_output(rows, plan.tokens_per_local_expert), plan,
                      tokens.shape[0], self.expert_group, gather)
        if self.shared_experts is not None:
            shared = self.shared_experts(tokens)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(nn.functional.linear(tokens, self.shared_expert_gate)) \
                    * shared
            out = out + shared
        if torch.is_grad_enabled():  # training: router losses (not computed in inference)
            attached = bool(self.aux_loss_coeff or self.z_loss_coeff)
            losses = None
            if attached or self.moe_state.log_router_losses:
                with torch.set_grad_enabled(attached):  # only logged: no autograd graph
                    losses = aux, z = self._router_losses(scores, indices, logits, x.shape[1])
            self.moe_state.record(self.layer_number, losses, plan.dropped,
                                  plan.tokens_per_expert)
            if attached:
                # summed over TP ranks with SP (their router grads are summed), so each adds
                # 1/t of its value; CP ranks' grads are averaged, so each adds its own
                tp_shares = comm.world_size(self.tp_group) if self.sequence_parallel else 1
                out = attach_aux_loss(out, (self.aux_loss_coeff * aux + self.z_loss_coeff * z)
                                      / tp_shares, self.moe_state)
        return out.view_as(x)

    def _router_losses(self, scores: torch.Tensor, indices: torch.Tensor, logits: torch.Tensor,
                       batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(load-balancing loss, z-loss) of this rank's tokens, each with the choices of the
        whole sequences: their mean over the shards (SP, CP) is the loss of the sequences."""
        sequences = batch if self.per_sequence else 1
        counts = sequence_counts(indices, self.num_experts, sequences)
        for group in self.token_groups:  # choices of the other shards (no gradient)
            comm.all_reduce(counts, group)
        aux = load_balancing_loss(scores, indices, self.topk, sequences, counts, self.shards)
        return aux, z_loss(logits)
