"""Tensor-parallel transformer: attention, MLP, layer and the stack of a pipeline stage.

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
from megalite.mpu import comm, parallel_state
from megalite.mpu.layers import (ColumnParallelLinear, RowParallelLinear, init_method_normal,
                                 scaled_init_method_normal, set_tensor_model_parallel_attributes)
from megalite.mpu.random import checkpoint, get_rng_tracker, seeded


def init_scope(seed: int, key: str):
    """Seeded RNG scope for initialising the part of the model named `key`.

    Every part's full weights depend only on (seed, key), whatever the TP/PP layout.
    """
    return seeded(zlib.crc32(f"{seed}:{key}".encode()))


def layer_norm(config: ModelConfig, dtype: torch.dtype, device) -> nn.LayerNorm:
    norm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon, dtype=dtype,
                        device=device)
    for param in norm.parameters():
        set_tensor_model_parallel_attributes(param, False)
    return norm


def _tp_size(group) -> int:
    group = parallel_state.get_tensor_model_parallel_group() if group is None else group
    return comm.world_size(group)


class ParallelAttention(nn.Module):
    """Self-attention with whole heads per TP rank.

    The fused QKV weight is laid out head-major, [heads, (q, k, v), head_dim] along its
    output, so a contiguous column split hands each rank the q, k and v of its own heads.
    forward(x [s, b, h], attention_mask [b, 1, 1|s, s] bool, True = attend) -> [s, b, h].
    """

    def __init__(self, config: ModelConfig, group=None, params_dtype=torch.float32,
                 device=None) -> None:
        super().__init__()
        self.config = config
        tp = _tp_size(group)
        if config.num_attention_heads % tp:
            raise ValueError(f"--num-attention-heads ({config.num_attention_heads}) must be "
                             f"divisible by the tensor-parallel size ({tp})")
        self.heads_per_rank = config.num_attention_heads // tp
        init = init_method_normal(config.init_method_std)
        kw = dict(group=group, params_dtype=params_dtype, device=device)
        self.query_key_value = ColumnParallelLinear(config.hidden_size, 3 * config.hidden_size,
                                                    init_method=init, **kw)
        self.dense = RowParallelLinear(
            config.hidden_size, config.hidden_size, input_is_parallel=True,
            init_method=scaled_init_method_normal(config.init_method_std, config.num_layers), **kw)

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       attention_mask: torch.Tensor | None) -> torch.Tensor:
        """q, k, v [b, heads/tp, s, d] -> [b, heads/tp, s, d]; dropout on the TP RNG stream."""
        dropout = self.config.attention_dropout if self.training else 0.0
        causal = self.config.causal and attention_mask is None
        mask = attention_mask
        if self.config.causal and attention_mask is not None:
            s = q.shape[2]
            mask = attention_mask & torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        if dropout == 0.0:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        with get_rng_tracker().fork():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                  is_causal=causal)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                recompute_core: bool = False) -> torch.Tensor:
        s, b, _ = x.shape
        qkv, _ = self.query_key_value(x)
        q, k, v = _SplitQKV.apply(qkv, self.heads_per_rank, self.config.head_dim)
        if recompute_core:
            context = checkpoint(self.core_attention, q, k, v, attention_mask)
        else:
            context = self.core_attention(q, k, v, attention_mask)
        context = context.permute(2, 0, 1, 3).reshape(s, b, -1)
        out, _ = self.dense(context)
        return out


class _SplitQKV(torch.autograd.Function):
    """qkv [s, b, heads * (q, k, v) * d] -> q, k, v [b, heads, s, d], strided views, no copy
    (SDPA's CPU flash kernel and CUDA kernels take them as they are).

    Backward stacks the three grads straight into the [s, b, heads, 3, d] layout: one copy,
    where autograd's unbind + permute + view backward stacks them and then makes a strided
    copy (about 4x slower on CPU).
    """

    @staticmethod
    def forward(ctx, qkv, heads, head_dim):
        s, b, _ = qkv.shape
        ctx.shape = qkv.shape
        return qkv.view(s, b, heads, 3, head_dim).permute(3, 1, 2, 0, 4).unbind(0)

    @staticmethod
    def backward(ctx, *grads):
        grads = [g.permute(2, 0, 1, 3) if g is not None else None for g in grads]
        like = next(g for g in grads if g is not None)
        grads = [torch.zeros_like(like) if g is None else g for g in grads]
        return torch.stack(grads, dim=3).view(ctx.shape), None, None


class ParallelMLP(nn.Module):
    """h -> ffn/tp (column-parallel) -> GeLU -> h (row-parallel, one all-reduce). [s, b, h]."""

    def __init__(self, config: ModelConfig, group=None, params_dtype=torch.float32,
                 device=None) -> None:
        super().__init__()
        self.approximate = "tanh" if config.activation == "gelu_tanh" else "none"
        kw = dict(group=group, params_dtype=params_dtype, device=device)
        self.dense_h_to_4h = ColumnParallelLinear(
            config.hidden_size, config.ffn_hidden_size,
            init_method=init_method_normal(config.init_method_std), **kw)
        self.dense_4h_to_h = RowParallelLinear(
            config.ffn_hidden_size, config.hidden_size, input_is_parallel=True,
            init_method=scaled_init_method_normal(config.init_method_std, config.num_layers), **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.dense_h_to_4h(x)
        out, _ = self.dense_4h_to_h(F.gelu(hidden, approximate=self.approximate))
        return out


class ParallelTransformerLayer(nn.Module):
    """One layer, pre-LayerNorm (GPT-2) or post-LayerNorm (BERT). [s, b, h] -> [s, b, h]."""

    def __init__(self, config: ModelConfig, layer_number: int, group=None,
                 params_dtype=torch.float32, device=None) -> None:
        super().__init__()
        self.config, self.layer_number = config, layer_number
        kw = dict(group=group, params_dtype=params_dtype, device=device)
        self.input_layernorm = layer_norm(config, params_dtype, device)
        self.self_attention = ParallelAttention(config, **kw)
        self.post_attention_layernorm = layer_norm(config, params_dtype, device)
        self.mlp = ParallelMLP(config, **kw)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.config.hidden_dropout, self.training)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        recompute_core = self.config.recompute_granularity == "selective" and self.training
        if self.config.post_layernorm:
            x = self.input_layernorm(
                x + self._dropout(self.self_attention(x, attention_mask, recompute_core)))
            return self.post_attention_layernorm(x + self._dropout(self.mlp(x)))
        x = x + self._dropout(
            self.self_attention(self.input_layernorm(x), attention_mask, recompute_core))
        return x + self._dropout(self.mlp(self.post_attention_layernorm(x)))


class ParallelTransformer(nn.Module):
    """The layers [first, last) of the whole model, keyed by their global index.

    Full recompute checkpoints groups of `recompute_num_layers` layers (uniform) or the
    first `recompute_num_layers` layers (block). forward(x [s, b, h], mask) -> [s, b, h].
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

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        for group, recompute in self._groups():
            if not group:
                continue
            if recompute:
                x = checkpoint(_run_layers, group, x, attention_mask)
            else:
                x = _run_layers(group, x, attention_mask)
        return x


def _run_layers(layers: list[nn.Module], x: torch.Tensor,
                attention_mask: torch.Tensor | None) -> torch.Tensor:
    for layer in layers:
        x = layer(x, attention_mask)
    return x
