"""The transformer layer and the stack of a pipeline stage, assembled from a TransformerSpec.

Activations are [s, b, h]. Each layer does two all-reduces on the TP group in forward
(after the attention output projection and after the MLP) and two in backward (the
grads entering the QKV and first MLP projections).
"""
import zlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import ModelConfig
from megalite.models.spec import TransformerSpec
from megalite.moe import MoELayer
from megalite.mpu.attention import ParallelAttention
from megalite.mpu.layers import (init_method_normal, scaled_init_method_normal,
                                 set_tensor_model_parallel_attributes)
from megalite.mpu.mlp import ParallelMLP
from megalite.mpu.random import checkpoint, seeded

Rotary = tuple[torch.Tensor, torch.Tensor] | None


def init_scope(seed: int, key: str):
    """Seeded RNG scope for initialising the part of the model named `key`.

    Every part's full weights depend only on (seed, key), whatever the TP/PP layout.
    """
    return seeded(zlib.crc32(f"{seed}:{key}".encode()))


def layer_norm(config: ModelConfig, dtype: torch.dtype, device) -> nn.Module:
    """The spec's normalization (LayerNorm or RMSNorm) over h, replicated on every TP rank."""
    norm_cls = nn.LayerNorm if config.normalization == "LayerNorm" else nn.RMSNorm
    norm = norm_cls(config.hidden_size, eps=config.norm_epsilon, dtype=dtype, device=device)
    for param in norm.parameters():
        set_tensor_model_parallel_attributes(param, False)
    return norm


class ParallelTransformerLayer(nn.Module):
    """One layer, pre-norm (GPT-2, Llama) or post-norm (BERT).
    forward(x [s, b, h], mask, rotary (cos, sin) | None) -> [s, b, h]."""

    def __init__(self, config: ModelConfig, layer_number: int, group=None,
                 params_dtype=torch.float32, device=None) -> None:
        super().__init__()
        self.config, self.layer_number = config, layer_number
        spec = TransformerSpec.from_config(config)
        self.post_norm, self.hidden_dropout = spec.post_norm, spec.hidden_dropout
        init = init_method_normal(config.init_method_std)
        kw = dict(init_method=init, group=group, params_dtype=params_dtype, device=device,
                  output_init_method=scaled_init_method_normal(config.init_method_std,
                                                               config.num_layers))
        self.input_layernorm = layer_norm(config, params_dtype, device)
        self.self_attention = ParallelAttention(**spec.attention_kwargs(), **kw)
        self.post_attention_layernorm = layer_norm(config, params_dtype, device)
        if spec.is_moe_layer(layer_number):
            self.mlp = MoELayer(**spec.moe_kwargs(), layer_number=layer_number,
                                init_std=config.init_method_std, **kw)
        else:
            self.mlp = ParallelMLP(**spec.mlp_kwargs(), **kw)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.hidden_dropout, self.training)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                rotary: Rotary = None) -> torch.Tensor:
        recompute_core = self.config.recompute_granularity == "selective" and self.training
        if self.post_norm:
            x = self.input_layernorm(
                x + self._dropout(self.self_attention(x, attention_mask, rotary, recompute_core)))
            return self.post_attention_layernorm(x + self._dropout(self.mlp(x)))
        x = x + self._dropout(self.self_attention(self.input_layernorm(x), attention_mask, rotary,
                                                  recompute_core))
        return x + self._dropout(self.mlp(self.post_attention_layernorm(x)))


class ParallelTransformer(nn.Module):
    """The layers [first, last) of the whole model, keyed by their global index.

    Full recompute checkpoints groups of `recompute_num_layers` layers (uniform) or the
    first `recompute_num_layers` layers (block).
    forward(x [s, b, h], mask, rotary (cos, sin) | None) -> [s, b, h].
    """

    def __init__(self, config: ModelConfig, layer_range: tuple[int, int], init_seed: int,
                 group=None, params_dtype=torch.float32, device=None) -> None:
        super().__init__()
        self.config = config
        layers = {}
        for number in range(*layer_range):
            with init_scope(init_seed, f"layer.{number}"):
                layers[str(number)] = ParallelTransformerLayer(
                    config, number, group=group, params_dtype=params_dtype, device=device)
        self.layers = nn.ModuleDict(layers)

    def _groups(self) -> Iterator[tuple[list[nn.Module], bool]]:
        """(consecutive layers, whether to checkpoint them) in order."""
        layers = list(self.layers.values())
        full = self.config.recompute_granularity == "full" and self.training
        n = self.config.recompute_num_layers
        if not full:
            yield layers, False
        elif self.config.recompute_method == "block":
            yield layers[:n], True
            yield layers[n:], False
        else:
            for start in range(0, len(layers), n):
                yield layers[start:start + n], True

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                rotary: Rotary = None) -> torch.Tensor:
        for group, recompute in self._groups():
            if not group:
                continue
            if recompute:
                x = checkpoint(_run_layers, group, x, attention_mask, rotary)
            else:
                x = _run_layers(group, x, attention_mask, rotary)
        return x


def _run_layers(layers: list[nn.Module], x: torch.Tensor, attention_mask: torch.Tensor | None,
                rotary: Rotary) -> torch.Tensor:
    for layer in layers:
        x = layer(x, attention_mask, rotary)
    return x
