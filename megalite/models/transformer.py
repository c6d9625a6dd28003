"""The transformer layer and the stack of a pipeline stage, assembled from a TransformerSpec.

Activations are [s, b, h]. Each layer does two all-reduces on the TP group in forward
(after the attention output projection and after the MLP) and two in backward (the
grads entering the QKV and first MLP projections). With sequence parallelism the
activations between those regions are [s/t, b, h]: each all-reduce becomes an all-gather
before the projection and a reduce-scatter after it, norms, dropout and residual adds see
s/t tokens, the dropout masks come from the per-TP-rank RNG stream, and the norm weights'
grads are summed over TP (`tp_grad_partial`) before the optimizer.
"""
import zlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import ModelConfig
from megalite.models.layer_drop import LayerDropState
from megalite.models.spec import TransformerSpec
from megalite.moe import MoELayer, MoEState
from megalite.mpu.attention import ParallelAttention
from megalite.mpu.latent_attention import ParallelLatentAttention
from megalite.mpu.layers import (init_method_normal, scaled_init_method_normal,
                                 set_tensor_model_parallel_attributes)
from megalite.mpu.mlp import ParallelMLP
from megalite.mpu.random import checkpoint, get_rng_tracker, seeded

Rotary = tuple[torch.Tensor, torch.Tensor] | None


def init_scope(seed: int, key: str):
    """Seeded scope (a private CPU generator, yielded) for initialising the part of the model
    named `key`.

    Every part's full weights depend only on (seed, key), whatever the TP/PP layout and the
    device; the global RNG is never touched.
    """
    return seeded(zlib.crc32(f"{seed}:{key}".encode()))


def layer_norm(config: ModelConfig, dtype: torch.dtype, device,
               sequence_parallel: bool = False) -> nn.Module:
    """The spec's normalization (LayerNorm or RMSNorm) over h, replicated on every TP rank
    (with `sequence_parallel` applied to s/t tokens, so its grads are TP-partial)."""
    norm_cls = nn.LayerNorm if config.normalization == "LayerNorm" else nn.RMSNorm
    norm = norm_cls(config.hidden_size, eps=config.norm_epsilon, dtype=dtype, device=device)
    for param in norm.parameters():
        set_tensor_model_parallel_attributes(param, False)
        param.tp_grad_partial = sequence_parallel
    return norm


def dropout(x: torch.Tensor, p: float, training: bool, sequence_parallel: bool) -> torch.Tensor:
    """Dropout of [s, b, h]; of [s/t, b, h] on the per-TP-rank RNG stream (sequence parallel),
    since each TP rank then holds different tokens."""
    if not training or p == 0.0 or not sequence_parallel:
        return F.dropout(x, p, training)
    with get_rng_tracker().fork():
        return F.dropout(x, p, training)


class ParallelTransformerLayer(nn.Module):
    """One layer, pre-norm (GPT-2, Llama) or post-norm (BERT); an MoE layer's MLP records into
    and takes its aux-loss backward scale from `moe_state`.
    forward(x [s, b, h], mask, rotary (cos, sin) | None, inference_params, residual_scale)
    -> [s, b, h]; `inference_params` (a `megalite.inference.KVCache`) holds this layer's keys
    and values; `residual_scale` multiplies both residual branches of a pre-norm layer
    (progressive layer dropping: 1/p of a kept layer)."""

    def __init__(self, config: ModelConfig, layer_number: int, group=None,
                 params_dtype=torch.float32, device=None, sequence_parallel: bool = False,
                 moe_state: MoEState | None = None) -> None:
        super().__init__()
        self.config, self.layer_number = config, layer_number
        spec = TransformerSpec.from_config(config)
        self.post_norm, self.hidden_dropout = spec.post_norm, spec.hidden_dropout
        self.sequence_parallel = sequence_parallel
        init = init_method_normal(config.init_method_std)
        kw = dict(init_method=init, group=group, params_dtype=params_dtype, device=device,
                  output_init_method=scaled_init_method_normal(config.init_method_std,
                                                               config.num_layers),
                  sequence_parallel=sequence_parallel)
        self.input_layernorm = layer_norm(config, params_dtype, device, sequence_parallel)
        attention = ParallelLatentAttention if spec.latent_attention else ParallelAttention
        self.self_attention = attention(**spec.attention_kwargs(), **kw)
        self.post_attention_layernorm = layer_norm(config, params_dtype, device,
                                                   sequence_parallel)
        if spec.is_moe_layer(layer_number):
            self.mlp = MoELayer(**spec.moe_kwargs(), layer_number=layer_number,
                                init_std=config.init_method_std, moe_state=moe_state, **kw)
        else:
            self.mlp = ParallelMLP(**spec.mlp_kwargs(), **kw)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.hidden_dropout, self.training, self.sequence_parallel)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                rotary: Rotary = None, inference_params=None,
                residual_scale: float = 1.0) -> torch.Tensor:
        recompute_core = self.config.recompute_granularity == "selective" and self.training
        kv_cache = None if inference_params is None else inference_params.layer(self.layer_number)
        if self.post_norm:
            x = self.input_layernorm(x + self._dropout(
                self.self_attention(x, attention_mask, rotary, recompute_core, kv_cache)))
            return self.post_attention_layernorm(x + self._dropout(self.mlp(x)))
        x = x + self._scaled(self._dropout(self.self_attention(
            self.input_layernorm(x), attention_mask, rotary, recompute_core, kv_cache)),
            residual_scale)
        return x + self._scaled(self._dropout(self.mlp(self.post_attention_layernorm(x))),
                                residual_scale)

    @staticmethod
    def _scaled(branch: torch.Tensor, scale: float) -> torch.Tensor:
        return branch if scale == 1.0 else branch * scale


class ParallelTransformer(nn.Module):
    """The layers [first, last) of the whole model, keyed by their global index; their MoE
    layers share `moe_state` (the model chunk's).

    Full recompute checkpoints groups of `recompute_num_layers` layers (uniform) or the
    first `recompute_num_layers` layers (block). In training with progressive layer dropping
    (`layer_drop`, megalite.models.layer_drop) only the microbatch's kept layers run, their
    residual branches scaled by 1/p; with none kept the input passes on.
    forward(x [s, b, h], mask, rotary (cos, sin) | None, inference_params) -> [s, b, h].
    """

    def __init__(self, config: ModelConfig, layer_range: tuple[int, int], init_seed: int,
                 group=None, params_dtype=torch.float32, device=None,
                 sequence_parallel: bool = False, moe_state: MoEState | None = None) -> None:
        super().__init__()
        self.config = config
        layers = {}
        for number in range(*layer_range):
            with init_scope(init_seed, f"layer.{number}"):
                layers[str(number)] = ParallelTransformerLayer(
                    config, number, group=group, params_dtype=params_dtype, device=device,
                    sequence_parallel=sequence_parallel, moe_state=moe_state)
        self.layers = nn.ModuleDict(layers)
        self.layer_drop = LayerDropState()

    def _groups(self) -> Iterator[tuple[list[tuple[nn.Module, float]], bool]]:
        """(consecutive layers with their residual scales, whether to checkpoint them) in
        order; dropped layers left out."""
        scales = self.layer_drop.residual_scales() if self.training else None
        layers = [(layer, 1.0 if scales is None else scales.get(int(number)))
                  for number, layer in self.layers.items()]
        layers = [(layer, scale) for layer, scale in layers if scale is not None]
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
                rotary: Rotary = None, inference_params=None) -> torch.Tensor:
        given = x
        for group, recompute in self._groups():
            if not group:
                continue
            if recompute:
                x = checkpoint(_run_layers, group, x, attention_mask, rotary, inference_params)
            else:
                x = _run_layers(group, x, attention_mask, rotary, inference_params)
        # every layer dropped: a view, so that the executor never frees the received tensor
        return x.view_as(x) if x is given and x.requires_grad else x


def _run_layers(layers: list[tuple[nn.Module, float]], x: torch.Tensor,
                attention_mask: torch.Tensor | None, rotary: Rotary,
                inference_params=None) -> torch.Tensor:
    for layer, scale in layers:
        x = layer(x, attention_mask, rotary, inference_params, scale)
    return x
