"""The model section: transformer shape, attention variants, MoE routing, MLA, MTP and
regularisation, with the rules between its fields."""
from dataclasses import dataclass

from megalite.config.fields import Section, arg


@dataclass
class ModelConfig(Section):
    """Transformer shape and regularisation (GPT-2 defaults where they apply; Llama: RMSNorm,
    rope, swiglu, group-query-attention, disable-bias-linear, untie-embeddings-and-output-weights).
    """

    num_layers: int = arg(4, "number of transformer layers", min=1)
    hidden_size: int = arg(256, "hidden size h", min=1)
    num_attention_heads: int = arg(4, "attention heads a (divisible by TP)", min=1)
    ffn_hidden_size: int | None = arg(
        None, "MLP inner size (default 4h; with --swiglu 2/3 of 4h rounded down to a multiple "
        "of 64)", min=1)
    vocab_size: int = arg(8000, "real vocabulary size (padded for TP, see "
                          "make-vocab-size-divisible-by)", min=1)
    max_position_embeddings: int = arg(512, "longest sequence (learned position embeddings: "
                                       "rows)", min=1)
    normalization: str = arg("LayerNorm", "normalization layer", choices=("LayerNorm", "RMSNorm"))
    norm_epsilon: float = arg(1e-5, "epsilon of the normalization layers",
                              aliases=("--layernorm-epsilon",), min=0.0)
    position_embedding_type: str = arg("learned_absolute", "position embedding",
                                       choices=("learned_absolute", "rope"))
    rotary_base: float = arg(10000.0, "RoPE base (theta)")
    use_rope_scaling: bool = arg(False, "Llama 3.1 RoPE frequency scaling")
    rope_scaling_factor: float = arg(8.0, "Llama 3.1 scaling: factor")
    rope_low_freq_factor: float = arg(1.0, "Llama 3.1 scaling: low-frequency factor")
    rope_high_freq_factor: float = arg(4.0, "Llama 3.1 scaling: high-frequency factor")
    rope_original_max_position_embeddings: int = arg(
        8192, "Llama 3.1 scaling: context length the model was pretrained at")
    swiglu: bool = arg(False, "SwiGLU MLP (silu(x W_gate) * x W_up) instead of --activation")
    group_query_attention: bool = arg(False, "grouped-query attention (see --num-query-groups)")
    num_query_groups: int | None = arg(None, "KV groups with --group-query-attention (1: MQA)")
    kv_channels: int | None = arg(None, "head dim (default hidden / heads)")
    disable_bias_linear: bool = arg(False, "no biases in the attention and MLP linear layers")
    add_qkv_bias: bool = arg(False, "QKV bias even with --disable-bias-linear (Qwen2)")
    qk_layernorm: bool = arg(False, "normalise each head's q and k over the head dim (the "
                             "--normalization, one weight per head dim) before RoPE (Qwen3)")
    untie_embeddings_and_output_weights: bool = arg(
        False, "separate output layer instead of the input word embedding")
    hidden_dropout: float = arg(0.1, "dropout on embeddings and residual branches", min=0.0)
    attention_dropout: float = arg(0.1, "dropout on attention probabilities", min=0.0)
    init_method_std: float = arg(0.02, "std of the normal weight initialisation", min=0.0)
    make_vocab_size_divisible_by: int = arg(128, "pad the vocabulary to a multiple of this x TP",
                                            min=1)
    activation: str = arg("gelu_tanh", "MLP activation (without --swiglu)",
                          choices=("gelu_tanh", "gelu"))
    num_tokentypes: int = arg(0, "token-type embeddings (BERT: 2)", min=0)
    post_layernorm: bool = arg(False, "LayerNorm after each residual add (BERT) instead of before")
    causal: bool = arg(True, "causal self-attention (GPT); off for bidirectional (BERT)",
                       negatable=True)
    recompute_granularity: str | None = arg(
        None, "activation recomputation: full layers or only the attention core",
        choices=("full", "selective"))
    recompute_method: str = arg(
        "uniform", "full recompute: checkpoint groups of N layers (uniform) or only the first "
        "N layers of each stage (block)", choices=("uniform", "block"))
    recompute_num_layers: int = arg(1, "N for --recompute-method", min=1)
    num_experts: int | None = arg(None, "mixture of experts: experts per MoE layer (off: dense)")
    moe_router_topk: int = arg(2, "experts each token is routed to (k)")
    moe_ffn_hidden_size: int | None = arg(None, "inner size of each expert (default "
                                          "--ffn-hidden-size)")
    moe_shared_expert_intermediate_size: int | None = arg(
        None, "inner size of the shared expert every token also goes through (off: none)")
    moe_shared_expert_gate: bool = arg(False, "scale the shared expert by sigmoid(x w) (Qwen2-MoE)")
    moe_layer_freq: str | int = arg(
        1, "which layers are MoE: N (every N-th: 0, N, 2N, ...) or a per-layer pattern of 0 "
        "(dense) and 1 (MoE) as Megatron writes it, e.g. \"[0]*2+[1]*2\" (DeepSeek's "
        "first_k_dense_replace 2 of 4 layers)")
    moe_router_score_function: str = arg("softmax", "router scores over the experts",
                                         choices=("softmax", "sigmoid"))
    moe_router_topk_renorm: bool = arg(False, "divide the top-k weights by their sum (Mixtral)")
    moe_aux_loss_coeff: float = arg(0.0, "coefficient of the Switch/GShard load-balancing loss")
    moe_z_loss_coeff: float = arg(0.0, "coefficient of the router z-loss")
    moe_expert_capacity_factor: float | None = arg(
        None, "drop choices over capacity x fair share per expert (default: dropless)")
    multi_latent_attention: bool = arg(
        False, "multi-head latent attention (DeepSeek-V2/V3): low-rank q and kv projections, "
        "a decoupled RoPE key shared by the heads; see --q-lora-rank and the head dims")
    q_lora_rank: int | None = arg(None, "MLA: rank of the query compression (0/None: a full "
                                  "query projection)", min=0)
    kv_lora_rank: int = arg(512, "MLA: rank of the compressed key-value latent c_kv (cached in "
                            "generation)")
    qk_head_dim: int = arg(128, "MLA: per-head query/key dim without RoPE")
    qk_pos_emb_head_dim: int = arg(64, "MLA: per-head query/key dim with RoPE (the shared key)")
    v_head_dim: int = arg(128, "MLA: per-head value dim")
    rotary_scaling_factor: float = arg(1.0, "YaRN RoPE scaling factor (DeepSeek-V3: 40; 1: off)",
                                       min=1.0)
    mscale: float = arg(1.0, "YaRN: mscale of the RoPE attention factor")
    mscale_all_dim: float = arg(0.0, "YaRN: mscale_all_dim (softmax scale multiplied by "
                                "mscale(factor, this)^2 when nonzero)")
    beta_fast: float = arg(32.0, "YaRN: fast rotation boundary")
    beta_slow: float = arg(1.0, "YaRN: slow rotation boundary")
    mtp_num_layers: int | None = arg(None, "multi-token prediction: modules after the main "
                                     "stack, module k predicts token i + k + 1 (off: none)", min=0)
    mtp_loss_scaling_factor: float = arg(0.1, "multi-token prediction: the MTP losses' mean "
                                         "is added to the loss times this", min=0.0)
    moe_router_load_balancing_type: str = arg(
        "aux_loss", "load-balancing loss over the whole microbatch (aux_loss) or per sequence, "
        "averaged over sequences (seq_aux_loss, DeepSeek-V3); scaled by --moe-aux-loss-coeff",
        choices=("aux_loss", "seq_aux_loss"))
    moe_router_enable_expert_bias: bool = arg(
        False, "auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias added to the "
        "scores for the top-k choice only, updated after each step from its token counts")
    moe_router_bias_update_rate: float = arg(
        1e-3, "expert bias update: bias += rate * sign(mean load - load) per step", min=0.0)
    moe_router_num_groups: int | None = arg(
        None, "group-limited routing: experts in this many groups (DeepSeek-V3 n_group)")
    moe_router_group_topk: int | None = arg(
        None, "group-limited routing: groups kept per token, by the sum of their top-2 scores "
        "(DeepSeek-V3 topk_group)")
    moe_router_topk_scaling_factor: float | None = arg(
        None, "multiply the top-k weights by this (DeepSeek-V3 routed_scaling_factor)", above=0.0)
    moe_grouped_gemm: bool = arg(
        False, "local experts' weights stacked per layer and run as one grouped matmul "
        "(torch._grouped_mm where it runs, else a loop; checkpoints keep per-expert names)")
    bos_token_id: int | None = arg(None, "beginning-of-sequence token id (carried to exported "
                                   "configs; no effect on training)")
    eos_token_id: int | list[int] | None = arg(
        None, "end-of-sequence token id(s) (carried to exported configs)", nargs="+")
    pad_token_id: int | None = arg(None, "padding token id (carried to exported configs)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = (4 * self.hidden_size * 2 // 3 // 64 * 64 if self.swiglu
                                    else 4 * self.hidden_size)
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"--hidden-size ({self.hidden_size}) must be divisible by "
                             f"--num-attention-heads ({self.num_attention_heads}) "
                             f"(or give --kv-channels)")
        if self.num_query_groups is not None and not self.group_query_attention:
            raise ValueError("--num-query-groups needs --group-query-attention")
        if self.group_query_attention and self.num_query_groups is None:
            raise ValueError("--group-query-attention needs --num-query-groups N")
        groups = self.query_groups
        if groups <= 0 or self.num_attention_heads % groups:
            raise ValueError(f"--num-attention-heads ({self.num_attention_heads}) must be a "
                             f"multiple of --num-query-groups ({groups})")
        if self.position_embedding_type == "rope" and self.head_dim % 2:
            raise ValueError(f"rope needs an even head dim, got {self.head_dim}")
        if self.num_experts is not None:
            if self.num_experts < 1 or not 1 <= self.moe_router_topk <= self.num_experts:
                raise ValueError(f"--moe-router-topk ({self.moe_router_topk}) must be between 1 "
                                 f"and --num-experts ({self.num_experts})")
            self.moe_layer_freq = moe_layer_pattern(self.moe_layer_freq, self.num_layers)[1]
            _check_router_groups(self)
            if self.moe_ffn_hidden_size is None:
                self.moe_ffn_hidden_size = self.ffn_hidden_size

        if self.multi_latent_attention:
            for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
                if getattr(self, name) <= 0:
                    raise ValueError(f"--{name.replace('_', '-')} must be positive with "
                                     f"--multi-latent-attention, got {getattr(self, name)}")
            if self.qk_pos_emb_head_dim % 2 or self.position_embedding_type != "rope":
                raise ValueError("--multi-latent-attention needs --position-embedding-type rope "
                                 f"and an even --qk-pos-emb-head-dim (got "
                                 f"{self.qk_pos_emb_head_dim})")
            if self.group_query_attention:
                raise ValueError("--multi-latent-attention excludes --group-query-attention "
                                 "(every head reads the shared latent)")
        if self.rotary_scaling_factor != 1.0 and self.use_rope_scaling:
            raise ValueError("--rotary-scaling-factor (YaRN) excludes --use-rope-scaling "
                             "(Llama 3.1)")

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """Per layer: whether its MLP is MoE (all False without --num-experts)."""
        if self.num_experts is None:
            return (False,) * self.num_layers
        return moe_layer_pattern(self.moe_layer_freq, self.num_layers)[0]

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """KV groups: --num-query-groups with GQA, else one per head (MHA)."""
        return self.num_query_groups if self.group_query_attention else self.num_attention_heads


def moe_layer_pattern(freq: str | int, num_layers: int) -> tuple[tuple[bool, ...], str | int]:
    """--moe-layer-freq -> (per layer: MoE or not, the value normalised: an int N or the
    pattern string). N: layers 0, N, 2N, ... are MoE; a pattern is a Python list expression of
    0s and 1s built only from brackets, digits, *, + and commas (Megatron's syntax)."""
    text = str(freq).replace(" ", "")
    if text.isdigit():
        if int(text) < 1:
            raise ValueError(f"--moe-layer-freq must be >= 1, got {text}")
        return tuple(i % int(text) == 0 for i in range(num_layers)), int(text)
    bad = ValueError(f"--moe-layer-freq {freq!r}: expected an int >= 1 or a list of "
                     f"{num_layers} 0/1 entries such as \"[0]*2+[1]*{num_layers - 2}\"")
    if not text or set(text) - set("[]()0123456789*+,"):
        raise bad
    try:
        pattern = eval(text, {"__builtins__": {}})  # only list arithmetic can pass the check
    except Exception:
        raise bad from None
    if not isinstance(pattern, list) or len(pattern) != num_layers \
            or any(v not in (0, 1) or isinstance(v, bool) for v in pattern):
        raise bad
    return tuple(v == 1 for v in pattern), text


def _check_router_groups(c: "ModelConfig") -> None:
    """Group-limited routing: groups divide the experts, kept groups hold top-k experts."""
    groups, keep = c.moe_router_num_groups, c.moe_router_group_topk
    if (groups is None) != (keep is None):
        raise ValueError("--moe-router-num-groups and --moe-router-group-topk go together")
    if groups is None:
        return
    if groups < 1 or c.num_experts % groups:
        raise ValueError(f"--moe-router-num-groups ({groups}) must divide --num-experts "
                         f"({c.num_experts})")
    if not 1 <= keep <= groups or keep * (c.num_experts // groups) < c.moe_router_topk:
        raise ValueError(f"--moe-router-group-topk ({keep}) must be in [1, "
                         f"--moe-router-num-groups ({groups})] and its groups hold at least "
                         f"--moe-router-topk ({c.moe_router_topk}) experts")
