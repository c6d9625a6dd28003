"""Tensor-parallel self-attention from plain arguments: MHA, GQA and MQA, optional RoPE.

Query heads are split over the TP group. With `num_query_groups` KV groups (heads / groups
query heads share one K and V):
- groups == heads (MHA): one fused QKV projection laid out head-major
  [heads, (q, k, v), d] along its output, so a contiguous split keeps whole heads;
- groups < heads: a query projection [heads, d] and a key-value projection [groups, (k, v), d];
  when TP divides the groups each rank holds groups/TP of them, when TP is a multiple of the
  groups each KV group is replicated on the TP/groups ranks whose query heads use it (weights
  identical, grads summed by `allreduce_tp_partial_grads`).
One all-reduce on the TP group after the output projection in forward, one for the input
grad in backward; with `sequence_parallel` an all-gather of the [s/t, b, h] input and a
reduce-scatter of the output instead (and the converse in backward).
`qk_layernorm` (Qwen3; Megatron's --qk-layernorm) normalises each head's q and k over the head
dim before RoPE with one weight [d] each, replicated over TP: each rank sees only its heads,
so the weights' grads are TP-partial (`tp_grad_partial`, summed over the TP group).
With a context-parallel group of more than one rank, each rank holds s/cp tokens (two
load-balanced chunks, see megalite.mpu.context_parallel) and the core is ring attention.
"""
import torch
import torch.nn.functional as F
from torch import nn

from megalite.mpu import comm, parallel_state
from megalite.mpu.document_mask import DocumentMask
from megalite.mpu.ring_attention import ring_attention
from megalite.mpu.layers import (ColumnParallelLinear, InitMethod, RowParallelLinear,
                                 set_tensor_model_parallel_attributes)
from megalite.mpu.mappings import copy_to_tensor_model_parallel_region, \
    gather_from_sequence_parallel_region
from megalite.mpu.random import checkpoint, get_rng_tracker
from megalite.mpu.rotary import apply_rotary


def check_attention_split(num_attention_heads: int, num_query_groups: int, tp: int) -> None:
    """One clear ValueError when heads / KV groups cannot be split over TP (the run layout
    checks it before any process group; the layer again, as cheaply)."""
    if num_attention_heads % tp:
        raise ValueError(f"--num-attention-heads ({num_attention_heads}) must be divisible by "
                         f"the tensor-parallel size ({tp})")
    if num_query_groups % tp and tp % num_query_groups:
        raise ValueError(f"--num-query-groups ({num_query_groups}) must be a multiple or a "
                         f"divisor of the tensor-parallel size ({tp})")


def replicated_norm(normalization: str, size: int, eps: float, dtype: torch.dtype, device,
                    tp: int) -> nn.Module:
    """LayerNorm or RMSNorm over `size`, replicated on the TP ranks, applied to this rank's
    heads only: its grads are TP-partial (summed over the TP group before the optimizer)."""
    norm_cls = nn.LayerNorm if normalization == "LayerNorm" else nn.RMSNorm
    norm = norm_cls(size, eps=eps, dtype=dtype, device=device)
    for param in norm.parameters():
        set_tensor_model_parallel_attributes(param, False)
        param.tp_grad_partial = tp > 1
    return norm


def core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   attention_mask: torch.Tensor | DocumentMask | None, causal: bool,
                   dropout: float, cp_group, scale: float | None = None) -> torch.Tensor:
    """Softmax attention of q [b, heads, sq, d] over k [b, groups, sk, d], v [b, groups, sk, dv]
    -> [b, heads, sq, dv]; scale 1/sqrt(d) unless given. `causal` adds the causal mask to
    any given mask (queries aligned to the last keys); a DocumentMask (packed documents,
    causal within each) replaces it. Dropout (probabilities) draws from the TP-rank RNG
    stream. More than one rank in `cp_group`: ring attention over it (causal or per-document
    causal masks only)."""
    documents = attention_mask if isinstance(attention_mask, DocumentMask) else None
    if comm.world_size(cp_group) > 1:
        if attention_mask is not None and documents is None:
            raise ValueError("context parallelism supports no attention mask other than "
                             "causal or per-document causal")
        return ring_attention(q, k, v, causal, cp_group, scale,
                              None if documents is None else documents.document_ids)
    sq, sk = q.shape[2], k.shape[2]
    if documents is not None:
        mask, is_causal = documents.dense, False
    else:
        is_causal = causal and attention_mask is None and sq == sk
        mask = attention_mask
        if causal and not is_causal and sq > 1:
            tril = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
            mask = tril if attention_mask is None else attention_mask & tril
    gqa = k.shape[1] != q.shape[1]  # SDPA shares each KV group among its heads: no copy
    if dropout == 0.0:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                              enable_gqa=gqa, scale=scale)
    with get_rng_tracker().fork():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                              is_causal=is_causal, enable_gqa=gqa, scale=scale)


class ParallelAttention(nn.Module):
    """forward(x [s, b, h], attention_mask [b, 1, 1|s, s + cached] bool (True = attend), a
    DocumentMask (packed sequences) or None, rotary (cos, sin) [b, 1, s, d] | None,
    recompute_core, kv_cache) -> [s, b, h].

    `causal` adds the causal mask to any given mask (queries aligned to the last keys).
    Dropout on the probabilities draws from the TP-rank RNG stream. `sequence_parallel`: x and
    the output are [s/t, b, h]. `context_parallel_group` (default: the grid's CP group): more
    than one rank -> ring attention over it (causal or a DocumentMask; no attention dropout).
    `kv_cache` (inference): an object whose `update(k, v)` stores this step's k, v
    [b, groups/tp, s, d] and returns the keys and values of every position so far.
    """

    def __init__(self, hidden_size: int, num_attention_heads: int,
                 num_query_groups: int | None = None, kv_channels: int | None = None,
                 qkv_bias: bool = True, output_bias: bool = True, causal: bool = True,
                 attention_dropout: float = 0.0, init_method: InitMethod | None = None,
                 output_init_method: InitMethod | None = None, group=None,
                 params_dtype: torch.dtype = torch.float32, device=None,
                 sequence_parallel: bool = False, context_parallel_group=None,
                 qk_layernorm: bool = False, normalization: str = "LayerNorm",
                 norm_epsilon: float = 1e-5) -> None:
        super().__init__()
        group = parallel_state.get_tensor_model_parallel_group() if group is None else group
        self.cp_group = parallel_state.get_context_parallel_group() \
            if context_parallel_group is None else context_parallel_group
        tp = comm.world_size(group)
        groups = num_query_groups or num_attention_heads
        # megalite.layout checks this for a run, with one line naming the flag
        assert comm.world_size(self.cp_group) == 1 or not attention_dropout, \
            "context parallelism needs attention dropout 0"
        assert num_attention_heads % groups == 0, "megalite.config checks heads vs KV groups"
        check_attention_split(num_attention_heads, groups, tp)
        self.head_dim = kv_channels or hidden_size // num_attention_heads
        self.causal, self.attention_dropout = causal, attention_dropout
        self.heads_per_rank = num_attention_heads // tp
        self.groups_per_rank = max(groups // tp, 1)
        d, kw = self.head_dim, dict(init_method=init_method, group=group,
                                    params_dtype=params_dtype, device=device,
                                    sequence_parallel=sequence_parallel)
        self.fused_qkv = groups == num_attention_heads
        if self.fused_qkv:
            self.query_key_value = ColumnParallelLinear(hidden_size, 3 * num_attention_heads * d,
                                                        bias=qkv_bias, **kw)
            # rows [head: q, k, v]: Q, K and V are separate matrices (megalite.optimizer.muon)
            self.query_key_value.weight.fused_matrices = (num_attention_heads, 3)
        else:  # one input region for both (_project): one grad all-reduce, not one each
            self.group, self.sequence_parallel = group, sequence_parallel and tp > 1
            kw["disable_grad_reduce"] = True
            self.query = ColumnParallelLinear(hidden_size, num_attention_heads * d, bias=qkv_bias,
                                              **kw)
            self.key_value = ColumnParallelLinear(hidden_size, 2 * groups * d, bias=qkv_bias,
                                                  tp_replicas=max(tp // groups, 1), **kw)
            self.key_value.weight.fused_matrices = (groups, 2)  # rows [group: k, v]
        self.dense = RowParallelLinear(num_attention_heads * d, hidden_size, bias=output_bias,
                                       input_is_parallel=True, init_method=output_init_method,
                                       group=group, params_dtype=params_dtype, device=device,
                                       sequence_parallel=sequence_parallel)
        self.qk_layernorm = qk_layernorm
        if qk_layernorm:
            self.q_layernorm, self.k_layernorm = (
                replicated_norm(normalization, d, norm_epsilon, params_dtype, device, tp)
                for _ in range(2))

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [s, b, h] (sequence parallel: [s/t, b, h]) -> q [b, heads/tp, s, d],
        k, v [b, local groups, s, d]."""
        if self.fused_qkv:
            qkv, _ = self.query_key_value(x)
            return _SplitQKV.apply(qkv, self.heads_per_rank, self.head_dim)
        x = gather_from_sequence_parallel_region(x, self.group) if self.sequence_parallel \
            else copy_to_tensor_model_parallel_region(x, self.group)
        q, _ = self.query(x)
        kv, _ = self.key_value(x)
        s, b = q.shape[:2]
        q = q.view(s, b, self.heads_per_rank, self.head_dim).permute(1, 2, 0, 3)
        k, v = kv.view(s, b, self.groups_per_rank, 2, self.head_dim).permute(3, 1, 2, 0, 4)
        return q, k, v

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       attention_mask: torch.Tensor | DocumentMask | None) -> torch.Tensor:
        """q [b, heads/tp, s, d], k, v [b, groups/tp, s, d] -> [b, heads/tp, s, d]."""
        return core_attention(q, k, v, attention_mask, self.causal,
                              self.attention_dropout if self.training else 0.0, self.cp_group)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
                recompute_core: bool = False, kv_cache=None) -> torch.Tensor:
        q, k, v = self._project(x)
        b, s = q.shape[0], q.shape[2]
        if self.qk_layernorm:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)
        if recompute_core:
            context = checkpoint(self.core_attention, q, k, v, attention_mask)
        else:
            context = self.core_attention(q, k, v, attention_mask)
        out, _ = self.dense(context.permute(2, 0, 1, 3).reshape(s, b, -1))
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
