"""Tensor-parallel multi-head latent attention (MLA, DeepSeek-V2/V3) from plain arguments.

q = W_uq norm(W_dq x) (or W_q x without query compression), split per head into a part
without position [qk_head_dim] and a RoPE part [qk_pos_emb_head_dim]; the latent
c_kv = norm(W_dkv x) [kv_lora_rank] and one RoPE key k_pe shared by every head come from one
down-projection; k_nope, v = W_uk c_kv, W_uv c_kv per head. The key is [k_nope | k_pe], the
softmax scale given (DeepSeek's 1/sqrt(qk + rope dims), times YaRN's mscale^2).

Over TP: the down-projections and the latent norms are replicated (their grads are TP-partial,
each rank back-propagating only its heads: `tp_grad_partial`, summed before the optimizer),
the up-projections column-parallel by heads (their input grads stay partial:
`disable_grad_reduce`), the output projection row-parallel. The replicated down-projections
take x as column-parallel layers do: without sequence parallelism its grad is all-reduced on
the TP group, with it the [s/t, b, h] input is all-gathered (backward: reduce-scatter). With
a context-parallel group the core is ring attention (k and v of different widths).

In generation the KV cache holds the latent c_kv and the rotated k_pe
(kv_lora_rank + qk_pos_emb_head_dim values per token per layer, on every TP rank). A decode
step (one new position) attends the cached latents directly, W_uk absorbed into the query
and W_uv applied to the attended latent (DeepSeek-V2's absorption), so it never expands the
cached positions; the prefill expands them as training does (cheaper for many queries).
"""
import torch
from torch import nn

from megalite.mpu import comm, parallel_state
from megalite.mpu.attention import check_attention_split, core_attention, replicated_norm
from megalite.mpu.layers import ColumnParallelLinear, InitMethod, RowParallelLinear
from megalite.mpu.random import checkpoint
from megalite.mpu.rotary import apply_rotary


class ParallelLatentAttention(nn.Module):
    """forward(x [s, b, h], attention_mask [b, 1, 1|s, s + cached] bool | None,
    rotary (cos, sin) [b, 1, s, qk_pos_emb_head_dim] | None, recompute_core, kv_cache)
    -> [s, b, h] ([s/t, b, h] in and out with `sequence_parallel`).

    `kv_cache` (inference): an object whose `update(c_kv, k_pe)` stores this step's latent
    [b, 1, s, kv_lora_rank] and rotated RoPE key [b, 1, s, rope dim] and returns those of
    every position so far.
    """

    def __init__(self, hidden_size: int, num_attention_heads: int, q_lora_rank: int | None,
                 kv_lora_rank: int, qk_head_dim: int, qk_pos_emb_head_dim: int, v_head_dim: int,
                 softmax_scale: float, norm_epsilon: float = 1e-6, causal: bool = True,
                 attention_dropout: float = 0.0, init_method: InitMethod | None = None,
                 output_init_method: InitMethod | None = None, group=None,
                 params_dtype: torch.dtype = torch.float32, device=None,
                 sequence_parallel: bool = False, context_parallel_group=None) -> None:
        super().__init__()
        group = parallel_state.get_tensor_model_parallel_group() if group is None else group
        self.cp_group = parallel_state.get_context_parallel_group() \
            if context_parallel_group is None else context_parallel_group
        tp = comm.world_size(group)
        check_attention_split(num_attention_heads, num_attention_heads, tp)
        self.heads_per_rank = num_attention_heads // tp
        self.kv_lora_rank, self.qk_head_dim = kv_lora_rank, qk_head_dim
        self.rope_dim, self.v_head_dim = qk_pos_emb_head_dim, v_head_dim
        self.softmax_scale, self.causal = softmax_scale, causal
        self.attention_dropout = attention_dropout
        q_dim = num_attention_heads * (qk_head_dim + qk_pos_emb_head_dim)
        kw = dict(bias=False, init_method=init_method, group=group, params_dtype=params_dtype,
                  device=device)
        replicated = dict(tp_replicas=tp, sequence_parallel=sequence_parallel, **kw)
        self.q_lora_rank = q_lora_rank
        if q_lora_rank:
            self.linear_q_down_proj = ColumnParallelLinear(hidden_size, q_lora_rank, **replicated)
            self.q_layernorm = replicated_norm("RMSNorm", q_lora_rank, norm_epsilon,
                                               params_dtype, device, tp)
            self.linear_q_up_proj = ColumnParallelLinear(q_lora_rank, q_dim,
                                                         disable_grad_reduce=True, **kw)
        else:
            self.linear_q_proj = ColumnParallelLinear(hidden_size, q_dim,
                                                      sequence_parallel=sequence_parallel, **kw)
        self.linear_kv_down_proj = ColumnParallelLinear(
            hidden_size, kv_lora_rank + qk_pos_emb_head_dim, **replicated)
        self.kv_layernorm = replicated_norm("RMSNorm", kv_lora_rank, norm_epsilon, params_dtype,
                                            device, tp)
        self.linear_kv_up_proj = ColumnParallelLinear(
            kv_lora_rank, num_attention_heads * (qk_head_dim + v_head_dim),
            disable_grad_reduce=True, **kw)
        self.linear_proj = RowParallelLinear(
            num_attention_heads * v_head_dim, hidden_size, bias=False, input_is_parallel=True,
            init_method=output_init_method, group=group, params_dtype=params_dtype,
            device=device, sequence_parallel=sequence_parallel)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        """x [s(/t), b, h] -> q [b, heads/tp, s, qk + rope dims]."""
        if self.q_lora_rank:
            q, _ = self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(x)[0]))
        else:
            q, _ = self.linear_q_proj(x)
        s, b = q.shape[:2]
        return q.view(s, b, self.heads_per_rank, -1).permute(1, 2, 0, 3)

    def _latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [s(/t), b, h] -> c_kv [b, 1, s, kv_lora_rank] (normalised), k_pe [b, 1, s, rope]."""
        latent, _ = self.linear_kv_down_proj(x)
        c_kv, k_pe = latent.permute(1, 0, 2).unsqueeze(1).split(
            [self.kv_lora_rank, self.rope_dim], dim=-1)
        return self.kv_layernorm(c_kv), k_pe

    def _keys_values(self, c_kv: torch.Tensor, k_pe: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """c_kv [b, 1, S, r], k_pe [b, 1, S, rope] -> k [b, heads/tp, S, qk + rope],
        v [b, heads/tp, S, v dim]."""
        kv, _ = self.linear_kv_up_proj(c_kv.squeeze(1))
        b, S = kv.shape[:2]
        kv = kv.view(b, S, self.heads_per_rank, -1).transpose(1, 2)
        k_nope, v = kv.split([self.qk_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, self.heads_per_rank, -1, -1)], dim=-1)
        return k, v

    def _core(self, q: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
              attention_mask: torch.Tensor | None) -> torch.Tensor:
        k, v = self._keys_values(c_kv, k_pe)
        dropout = self.attention_dropout if self.training else 0.0
        return core_attention(q, k, v, attention_mask, self.causal, dropout, self.cp_group,
                              self.softmax_scale)

    def _absorbed_decode(self, q: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                         attention_mask: torch.Tensor | None) -> torch.Tensor:
        """One new position per sequence, q [b, heads/tp, 1, qk + rope dims], attending the
        cached latents directly: W_uk folded into the query (scores q_nope W_uk . c_kv +
        q_pe . k_pe), the probabilities applied to c_kv, then W_uv per head. The heads are
        the query rows of one shared key/value "head" [c_kv | k_pe] / c_kv."""
        weight = self.linear_kv_up_proj.weight.view(self.heads_per_rank, -1, self.kv_lora_rank)
        w_uk, w_uv = weight.split([self.qk_head_dim, self.v_head_dim], dim=1)
        q_nope, q_pe = q.split([self.qk_head_dim, self.rope_dim], dim=-1)
        query = torch.cat([torch.einsum("bhsd,hdr->bhsr", q_nope, w_uk), q_pe], dim=-1)
        latent = core_attention(query.transpose(1, 2), torch.cat([c_kv, k_pe], dim=-1), c_kv,
                                attention_mask, False, 0.0, self.cp_group, self.softmax_scale)
        return torch.einsum("bshr,hvr->bhsv", latent, w_uv)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
                recompute_core: bool = False, kv_cache=None) -> torch.Tensor:
        q = self._query(x)
        c_kv, k_pe = self._latent(x)
        b, s = q.shape[0], q.shape[2]
        if rotary is not None:
            q_nope, q_pe = q.split([self.qk_head_dim, self.rope_dim], dim=-1)
            q = torch.cat([q_nope, apply_rotary(q_pe, *rotary)], dim=-1)
            k_pe = apply_rotary(k_pe, *rotary)
        if kv_cache is not None:
            c_kv, k_pe = kv_cache.update(c_kv, k_pe)
        if kv_cache is not None and s == 1:
            context = self._absorbed_decode(q, c_kv, k_pe, attention_mask)
        elif recompute_core:
            context = checkpoint(self._core, q, c_kv, k_pe, attention_mask)
        else:
            context = self._core(q, c_kv, k_pe, attention_mask)
        out, _ = self.linear_proj(context.permute(2, 0, 1, 3).reshape(s, b, -1))
        return out
