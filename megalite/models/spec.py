"""What a transformer layer is made of, as data: the spec the layer and stack are built from.

`TransformerSpec.from_config(ModelConfig)` reads the Megatron-style flags once; GPT-2, BERT
and Llama differ only in the values (see `megalite.hf` for the configs each family maps to).
The spec is also the one place that knows the layer's parameter and FLOP counts.
"""
from dataclasses import asdict, dataclass

from megalite.config import ModelConfig
from megalite.mpu.rotary import yarn_mscale


@dataclass(frozen=True)
class AttentionSpec:
    """Keyword arguments of megalite.mpu.ParallelAttention (less init and placement)."""

    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    qkv_bias: bool
    output_bias: bool
    causal: bool
    attention_dropout: float
    qk_layernorm: bool = False
    normalization: str = "LayerNorm"  # of the q/k norms (the model's)
    norm_epsilon: float = 1e-5


@dataclass(frozen=True)
class MLPSpec:
    """Keyword arguments of megalite.mpu.ParallelMLP (less init and placement)."""

    hidden_size: int
    ffn_hidden_size: int
    activation: str
    bias: bool


@dataclass(frozen=True)
class MoESpec:
    """Keyword arguments of megalite.moe.MoELayer (less init, placement and layer number)."""

    hidden_size: int
    num_experts: int
    ffn_hidden_size: int
    topk: int
    activation: str
    score_function: str
    renormalize: bool
    aux_loss_coeff: float
    z_loss_coeff: float
    capacity_factor: float | None
    shared_expert_size: int | None
    shared_expert_gate: bool
    load_balancing_type: str
    expert_bias: bool
    bias_update_rate: float
    num_groups: int | None
    group_topk: int | None
    topk_scaling_factor: float | None
    grouped_gemm: bool


@dataclass(frozen=True)
class LatentAttentionSpec:
    """Keyword arguments of megalite.mpu.latent_attention.ParallelLatentAttention (less init
    and placement): multi-head latent attention instead of the attention spec's Q/K/V."""

    hidden_size: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int
    softmax_scale: float
    norm_epsilon: float
    causal: bool
    attention_dropout: float

    def params(self, tp: int = 1) -> int:
        """Parameters on one TP rank: down-projections and latent norms whole, up-projections
        and the output projection split over the heads."""
        heads, dq = self.num_attention_heads, self.qk_head_dim + self.qk_pos_emb_head_dim
        q = (self.hidden_size * self.q_lora_rank + self.q_lora_rank
             + self.q_lora_rank * heads * dq // tp) if self.q_lora_rank \
            else self.hidden_size * heads * dq // tp
        kv = self.hidden_size * (self.kv_lora_rank + self.qk_pos_emb_head_dim) \
            + self.kv_lora_rank + self.kv_lora_rank * heads * (self.qk_head_dim
                                                              + self.v_head_dim) // tp
        return q + kv + heads * self.v_head_dim * self.hidden_size // tp

    def matmul_params(self) -> int:
        """Weights a token's projections go through (the latent norms left out)."""
        return self.params() - self.kv_lora_rank - (self.q_lora_rank or 0)


@dataclass(frozen=True)
class RotarySpec:
    """Keyword arguments of megalite.mpu.rotary.RotaryEmbedding."""

    head_dim: int
    base: float
    scaling: dict | None
    yarn: dict | None = None


@dataclass(frozen=True)
class TransformerSpec:
    """norm -> attention -> residual -> norm -> MLP -> residual (pre-norm), or the norms after
    the residual adds (post-norm, BERT); positions learned or rotary; output tied or not."""

    normalization: str
    norm_epsilon: float
    post_norm: bool
    position_embedding: str
    rotary: RotarySpec | None
    attention: AttentionSpec
    mlp: MLPSpec
    hidden_dropout: float
    tie_output: bool
    moe: MoESpec | None = None
    moe_layers: tuple[bool, ...] = ()  # per layer: MoE MLP or dense
    latent_attention: LatentAttentionSpec | None = None
    mtp_num_layers: int = 0

    @classmethod
    def from_config(cls, c: ModelConfig) -> "TransformerSpec":
        bias = not c.disable_bias_linear
        scaling = None
        if c.use_rope_scaling:
            scaling = dict(factor=c.rope_scaling_factor, low_freq_factor=c.rope_low_freq_factor,
                           high_freq_factor=c.rope_high_freq_factor,
                           original_max_positions=c.rope_original_max_position_embeddings)
        rope = c.position_embedding_type == "rope"
        activation = "swiglu" if c.swiglu else c.activation
        moe = None if c.num_experts is None else MoESpec(
            c.hidden_size, c.num_experts, c.moe_ffn_hidden_size, c.moe_router_topk, activation,
            c.moe_router_score_function, c.moe_router_topk_renorm, c.moe_aux_loss_coeff,
            c.moe_z_loss_coeff, c.moe_expert_capacity_factor,
            c.moe_shared_expert_intermediate_size, c.moe_shared_expert_gate,
            c.moe_router_load_balancing_type, c.moe_router_enable_expert_bias,
            c.moe_router_bias_update_rate, c.moe_router_num_groups, c.moe_router_group_topk,
            c.moe_router_topk_scaling_factor, c.moe_grouped_gemm)
        yarn = None
        if c.rotary_scaling_factor != 1.0:
            yarn = dict(factor=c.rotary_scaling_factor,
                        original_max_positions=c.rope_original_max_position_embeddings,
                        beta_fast=c.beta_fast, beta_slow=c.beta_slow, mscale=c.mscale,
                        mscale_all_dim=c.mscale_all_dim)
        mla = None
        if c.multi_latent_attention:
            scale = (c.qk_head_dim + c.qk_pos_emb_head_dim) ** -0.5
            if yarn and c.mscale_all_dim:
                scale *= yarn_mscale(c.rotary_scaling_factor, c.mscale_all_dim) ** 2
            mla = LatentAttentionSpec(
                c.hidden_size, c.num_attention_heads, c.q_lora_rank or None, c.kv_lora_rank,
                c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim, scale, c.norm_epsilon,
                c.causal, c.attention_dropout)
        rope_dim = c.qk_pos_emb_head_dim if mla else c.head_dim
        return cls(
            normalization=c.normalization, norm_epsilon=c.norm_epsilon,
            post_norm=c.post_layernorm, position_embedding=c.position_embedding_type,
            rotary=RotarySpec(rope_dim, c.rotary_base, scaling, yarn) if rope else None,
            attention=AttentionSpec(c.hidden_size, c.num_attention_heads, c.query_groups,
                                    c.head_dim, bias or c.add_qkv_bias, bias, c.causal,
                                    c.attention_dropout, c.qk_layernorm, c.normalization,
                                    c.norm_epsilon),
            mlp=MLPSpec(c.hidden_size, c.ffn_hidden_size, activation, bias),
            hidden_dropout=c.hidden_dropout,
            tie_output=not c.untie_embeddings_and_output_weights, moe=moe,
            moe_layers=c.moe_layers, latent_attention=mla,
            mtp_num_layers=c.mtp_num_layers or 0)

    def attention_kwargs(self) -> dict:
        return asdict(self.latent_attention or self.attention)

    def mlp_kwargs(self) -> dict:
        return asdict(self.mlp)

    def is_moe_layer(self, layer: int | None) -> bool:
        """Whether global layer `layer` has the MoE MLP (--moe-layer-freq; the multi-token
        prediction blocks after the main stack are of the last layer's kind)."""
        return self.moe is not None and layer is not None and \
            self.moe_layers[min(layer, len(self.moe_layers) - 1)]

    def moe_kwargs(self) -> dict:
        return asdict(self.moe)

    # --- counts (Megatron's formulas, generalised to GQA, SwiGLU and biases) ---

    def _mlp_matmul(self, ffn: int) -> int:
        """Weights of one (dense or expert) MLP of inner size `ffn`: 2 or 3 (SwiGLU) matrices."""
        return self.mlp.hidden_size * ffn * (3 if self.mlp.activation == "swiglu" else 2)

    def layer_matmul_params(self, layer: int | None = None) -> int:
        """Weights of the layer's linear projections a token goes through: Q, K and V,
        output, MLP (3 with SwiGLU); an MoE layer's router, k experts and shared expert."""
        a = self.attention
        q = a.num_attention_heads * a.kv_channels
        kv = 2 * a.num_query_groups * a.kv_channels
        attention = self.latent_attention.matmul_params() if self.latent_attention \
            else a.hidden_size * (q + kv) + q * a.hidden_size
        return attention + self._mlp_active(layer)

    def _mlp_active(self, layer: int | None) -> int:
        if not self.is_moe_layer(layer):
            return self._mlp_matmul(self.mlp.ffn_hidden_size)
        m = self.moe
        return m.hidden_size * m.num_experts + m.topk * self._mlp_matmul(m.ffn_hidden_size) \
            + self._mlp_matmul(m.shared_expert_size or 0)

    def mlp_params(self, tp: int = 1, layer: int | None = None, ep: int = 1) -> int:
        """MLP parameters of one layer on one TP (and EP) rank: dense, or router (whole),
        E / ep experts and the shared expert (split over TP) and its gate (whole)."""
        if not self.is_moe_layer(layer):
            m = self.mlp
            mlp_in = (2 if m.activation == "swiglu" else 1) * m.ffn_hidden_size
            return self._mlp_matmul(m.ffn_hidden_size) // tp + (
                mlp_in // tp + m.hidden_size if m.bias else 0)
        m = self.moe
        return (m.hidden_size * m.num_experts + self.expert_params(tp, layer, ep)
                + self._mlp_matmul(m.shared_expert_size or 0) // tp
                + (m.hidden_size if m.shared_expert_gate else 0))

    def expert_params(self, tp: int = 1, layer: int | None = None, ep: int = 1) -> int:
        """Parameters of the E / ep experts of one layer on one TP and EP rank (0 if dense)."""
        if not self.is_moe_layer(layer):
            return 0
        return self.moe.num_experts // ep * self._mlp_matmul(self.moe.ffn_hidden_size) // tp

    def layer_params(self, tp: int = 1, layer: int | None = None, ep: int = 1) -> int:
        """Parameters of one layer on one TP rank: split weights and biases / tp (KV groups
        replicated when TP exceeds them), output and MLP-output biases and norms (q/k norms
        included) whole; an MoE layer (`layer` given) holds E / ep experts."""
        a = self.attention
        h, q = a.hidden_size, a.num_attention_heads * a.kv_channels
        kv = 2 * a.num_query_groups * a.kv_channels
        kv_shards = min(tp, a.num_query_groups)
        split = (h * q + q * h) // tp + h * kv // kv_shards
        split_bias = q // tp + kv // kv_shards if a.qkv_bias else 0
        whole_bias = h if a.output_bias else 0
        qk_norms = 2 * self.norm_params(a.kv_channels) if a.qk_layernorm else 0
        attention = self.latent_attention.params(tp) if self.latent_attention \
            else split + split_bias + whole_bias + qk_norms
        return attention + 2 * self.norm_params(h) + self.mlp_params(tp, layer, ep)

    def norm_params(self, h: int) -> int:
        return 2 * h if self.normalization == "LayerNorm" else h

    def mtp_layers(self, num_layers: int) -> range:
        """Global numbers of the multi-token prediction blocks' layers (after the main stack)."""
        return range(num_layers, num_layers + self.mtp_num_layers)

    def mtp_extra_params(self) -> int:
        """Multi-token prediction parameters outside its layers (whole on every TP rank): each
        depth's enorm, hnorm, final norm and eh_proj [h, 2h]."""
        h = self.attention.hidden_size
        return self.mtp_num_layers * (3 * self.norm_params(h) + 2 * h * h)

    def layer_forward_flops(self, seq_length: int, layer: int | None = None) -> float:
        """Forward FLOPs per token of one layer: 2 per matmul weight a token goes through,
        plus attention scores and values 4 s heads d (full s, as Megatron counts)."""
        a, mla = self.attention, self.latent_attention
        score_value_dims = mla.qk_head_dim + mla.qk_pos_emb_head_dim + mla.v_head_dim if mla \
            else 2 * a.kv_channels
        return 2 * self.layer_matmul_params(layer) + 2 * seq_length * a.num_attention_heads \
            * score_value_dims

    def output_forward_flops(self, padded_vocab: int) -> float:
        """Forward FLOPs per token of the output layer (logits): 2 h V."""
        return 2 * self.attention.hidden_size * padded_vocab

    def non_layer_params(self, padded_vocab: int, max_positions: int) -> int:
        """Word embedding, learned positions, final norm, an untied output layer and the
        multi-token prediction blocks outside their layers (whole)."""
        h = self.attention.hidden_size
        return (padded_vocab * h * (1 if self.tie_output else 2) + self.norm_params(h)
                + (max_positions * h if self.position_embedding == "learned_absolute" else 0)
                + self.mtp_extra_params())
