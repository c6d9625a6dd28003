"""Activation memory and in-flight microbatches of a layout (Korthikanti et al. 2022,
generalised to e-byte activations; REFERENCES.md), the context-parallel ring's elements and
the bytes a ring collective puts on the wire.
"""
from fractions import Fraction

from megalite.config import ModelConfig
from megalite.placement import GPIPE, INTERLEAVED, ZBV

ACTIVATION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}



def activation_bytes_per_layer(s: int, b: int, h: int, a: int, tp: int, act_bytes: int,
                               recompute: str | None, sequence_parallel: bool = False) -> float:
    """Bytes one layer keeps for backward per microbatch on one TP rank (Korthikanti et al.):
    sbh(10 + 24/t + 5as/(ht)) at e = 2 without recompute, sbh(10 + 24/t) selective, 2sbh
    full (the layer input); sequence parallelism also splits the first term (and the input)."""
    e, sbh = act_bytes, s * b * h
    split = tp if sequence_parallel else 1
    if recompute == "full":
        return e * sbh / split
    per_layer = (4 * e + 2) * sbh / split + 12 * e * sbh / tp
    if recompute is None:
        per_layer += (2 * e + 1) * a * s * s * b / tp
    return per_layer



def moe_activation_delta(s: int, b: int, h: int, tp: int, act_bytes: int, model: ModelConfig
                         ) -> float:
    """Bytes an MoE layer keeps for backward per microbatch on one TP rank beyond the dense
    layer of `activation_bytes_per_layer`: fp32 router logits and scores (8 sbE), the k
    dispatched copies of each token (e k sbh; uniform routing receives as many rows as it
    sends), the experts' hidden activations (2 or, SwiGLU, 3 x e k sb ffn_e / t) and the
    shared expert's, in place of the dense MLP's GeLU input and output (8e sbh / t)."""
    e, sb = act_bytes, s * b
    per_row = 3 if model.swiglu else 2
    hidden = model.moe_router_topk * model.moe_ffn_hidden_size \
        + (model.moe_shared_expert_intermediate_size or 0)
    return (8 * sb * model.num_experts + e * model.moe_router_topk * sb * h
            + per_row * e * sb * hidden / tp - 8 * e * sb * h / tp)



def ring_attention_elements(s: int, b: int, kv_groups: int, head_dim: int, cp: int
                            ) -> tuple[int, int, int]:
    """Elements one CP rank sends per layer per microbatch in ring attention: (forward K/V,
    backward K/V, backward dK/dV). A K/V block [2, b, g, s/cp, d] travels cp - 1 hops in
    forward and again in backward; its grads (fp32) travel cp hops, the last one home -
    backward about twice forward. `kv_groups`: the KV groups on this TP rank."""
    block = 2 * (s // cp) * b * kv_groups * head_dim
    return (cp - 1) * block, (cp - 1) * block, cp * block



def inflight_microbatches(schedule: str, p: int, m: int, v: int = 1, rank: int = 0) -> Fraction:
    """Microbatches (in whole-stage units) whose activations rank `rank` holds at its peak,
    from forward to (input-grad) backward: GPipe m; 1F1B, ZB-H1 and 2BW min(p - r, m);
    interleaved min(2(p-r-1) + (v-1)p + 1, m v) / v chunks, p (1 + (p-1)/(p v)) on rank 0
    (Megatron's interleaving penalty); ZBV min((m + r + 1) / 2, m, p). The linear layers'
    inputs and output grads that a deferred weight grad (W) keeps after B are not counted."""
    if schedule == GPIPE:
        return Fraction(m)
    if schedule == INTERLEAVED:
        return Fraction(min(2 * (p - rank - 1) + (v - 1) * p + 1, m * v), v)
    if schedule == ZBV:
        return min(Fraction(m + rank + 1, 2), Fraction(min(m, p)))
    return Fraction(min(p - rank, m))



def ring_wire(kind: str, payload: float, n: int) -> float:
    """Bytes one rank sends on a ring for a collective given `payload` bytes on each of n ranks
    (for an all-gather the payload is the local shard, as `megalite.mpu.comm` counts it)."""
    factor = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n,
              "all_gather": n - 1, "send": 1}[kind]
    return factor * payload
