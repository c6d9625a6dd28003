"""Multi-token prediction (DeepSeek-V3, Megatron's --mtp-num-layers) on the last pipeline stage.

Module k = 1..D takes the previous depth's hidden states h^{k-1} (h^0: the main stack's
output, before the final norm) and the embedding of the inputs shifted k to the left:
h'_i = W [norm(emb(t_{i+k})); norm(h^{k-1}_i)], h^k = block_k(h'), and predicts token
i + k + 1 through its own final norm and the model's output layer. Positions i >= s - k have
no such token inside the sequence: they are left out of that depth's mean loss (Megatron's
rolled loss mask). The MTP loss is the mean of the D depths' losses.
"""
import torch
from torch import nn

from megalite.config import ModelConfig
from megalite.models.transformer import ParallelTransformerLayer, init_scope, layer_norm
from megalite.moe import MoEState
from megalite.mpu.cross_entropy import vocab_parallel_cross_entropy
from megalite.mpu.layers import init_method_normal, set_tensor_model_parallel_attributes
from megalite.mpu.mappings import scatter_to_sequence_parallel_region


class MTPModule(nn.Module):
    """One depth: enorm, hnorm, eh_proj [h, 2h] (replicated over TP; TP-partial grads with
    sequence parallelism, as the norms), one transformer layer (global number
    num_layers + depth - 1), final_layernorm."""

    def __init__(self, config: ModelConfig, depth: int, init_seed: int, group=None,
                 params_dtype=torch.float32, device=None, sequence_parallel: bool = False,
                 moe_state: MoEState | None = None) -> None:
        super().__init__()
        self.enorm = layer_norm(config, params_dtype, device, sequence_parallel)
        self.hnorm = layer_norm(config, params_dtype, device, sequence_parallel)
        weight = torch.empty(config.hidden_size, 2 * config.hidden_size)
        with init_scope(init_seed, f"mtp.{depth}.eh_proj"):
            init_method_normal(config.init_method_std)(weight)
        self.eh_proj = nn.Parameter(weight.to(device=device, dtype=params_dtype))
        set_tensor_model_parallel_attributes(self.eh_proj, False)
        self.eh_proj.tp_grad_partial = sequence_parallel
        with init_scope(init_seed, f"mtp.{depth}.layer"):
            self.layer = ParallelTransformerLayer(
                config, config.num_layers + depth - 1, group=group, params_dtype=params_dtype,
                device=device, sequence_parallel=sequence_parallel, moe_state=moe_state)
        self.final_layernorm = layer_norm(config, params_dtype, device, sequence_parallel)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, rotary) -> torch.Tensor:
        """hidden, embedded [s, b, h] ([s/t, b, h] sequence parallel) -> h^k, same shape."""
        combined = torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1)
        return self.layer(nn.functional.linear(combined, self.eh_proj), None, rotary)


class MultiTokenPrediction(nn.Module):
    """The D modules `layers.0 .. D-1`; forward returns the mean of their losses (a scalar)."""

    def __init__(self, config: ModelConfig, init_seed: int, sequence_parallel: bool = False,
                 **kw) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.layers = nn.ModuleList(
            MTPModule(config, depth, init_seed, sequence_parallel=sequence_parallel, **kw)
            for depth in range(1, config.mtp_num_layers + 1))

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor,
                embedding: nn.Module, output_layer: nn.Module, rotary) -> torch.Tensor:
        """hidden [s, b, h] ([s/t, b, h]) of the main stack, input_ids and labels [b, s];
        `embedding` maps ids [b, s] to [s, b, h], `output_layer` is the vocab-parallel head."""
        s = input_ids.shape[1]
        losses = []
        for depth, module in enumerate(self.layers, start=1):
            embedded = embedding(input_ids.roll(-depth, dims=1))
            if self.sequence_parallel:
                embedded = scatter_to_sequence_parallel_region(embedded)
            hidden = module(hidden, embedded, rotary)
            logits = output_layer.lm_logits(module.final_layernorm(hidden),
                                            self.sequence_parallel)
            per_token = vocab_parallel_cross_entropy(logits, labels.roll(-depth, dims=1).t())
            losses.append(per_token[:s - depth].float().mean())
        return torch.stack(losses).mean()
