"""The sections every training run has: parallel layout, precision, optimizer, training
loop, data and checkpoints."""
from dataclasses import dataclass

import torch

from megalite.config.fields import Section, arg
from megalite.placement import (INTERLEAVED, ONE_F_ONE_B, PIPELINE_SCHEDULES, TWO_BW, ZB_H1,
                                ZBV)
from megalite.config.sharding import NO_SHARD, OPTIM, STRATEGIES, STRATEGY_NAMES



@dataclass
class ParallelConfig(Section):
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
        f"{ZBV} runs 2 chunks per rank in V placement; {TWO_BW}: PipeDream-2BW, no flush "
        f"between steps, two weight versions, updates one step late)", choices=PIPELINE_SCHEDULES)
    distributed_timeout_minutes: float = arg(10.0, "bound on any collective wait", above=0.0)
    sequence_parallel: bool = arg(False, "split norms, dropout and residual activations along "
                                  "the sequence over TP (needs TP > 1)")
    context_parallel_size: int = arg(1, "context-parallel size: each rank holds 2 load-balanced "
                                     "chunks of every sequence, ring attention",
                                     aliases=("--cp",))
    expert_model_parallel_size: int = arg(
        1, "expert-parallel size: experts split over this many DP ranks (must divide DP)",
        aliases=("--ep",))


@dataclass
class PrecisionConfig(Section):
    """Mixed precision: bf16/fp16 parameters with fp32 main copies in the optimizer."""

    bf16: bool = arg(False, "bf16 parameters and activations, fp32 main params/grads")
    fp16: bool = arg(False, "fp16 parameters with dynamic loss scaling")
    loss_scale: float | None = arg(None, "static fp16 loss scale (default: dynamic)", above=0.0)
    initial_loss_scale: float = arg(2.0 ** 32, "initial dynamic loss scale", above=0.0)
    min_loss_scale: float = arg(1.0, "dynamic loss scale floor", above=0.0)
    loss_scale_window: int = arg(1000, "clean steps before the scale doubles", min=1)
    hysteresis: int = arg(2, "overflowing steps tolerated before the scale halves", min=1)
    tf32: bool = arg(False, "TF32 tensor cores for fp32 matmuls on CUDA (faster, ~1e-3 "
                            "relative error; off: IEEE fp32)")
    deterministic_mode: bool = arg(False, "deterministic CUDA kernels where torch has them: "
                                          "bitwise-repeatable runs, slower")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bf16 and self.fp16:
            raise ValueError("--bf16 and --fp16 are mutually exclusive")

    @property
    def params_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32


@dataclass
class OptimizerConfig(Section):
    """Optimizer, learning-rate schedule, clipping and the data-parallel gradient buffer."""

    optimizer: str = arg("adam", "an OptimizerKind of megalite/optimizer/kinds.py, by name "
                         "(adam: AdamW, decoupled weight decay; muon: Muon on the 2-D hidden "
                         "weights, AdamW on the rest)")
    lr: float = arg(6e-4, "peak learning rate", min=0.0)
    min_lr: float = arg(0.0, "learning rate at the end of decay (at most --lr)", min=0.0)
    lr_decay_style: str = arg("cosine", "decay after warm-up",
                              choices=("cosine", "linear", "constant"))
    lr_warmup_iters: int = arg(0, "linear warm-up iterations", min=0)
    lr_decay_iters: int | None = arg(None, "decay iterations (default: train-iters)", min=1)
    weight_decay: float = arg(0.01, "AdamW weight decay (never on biases and norms)", min=0.0)
    adam_beta1: float = arg(0.9, "Adam beta1", min=0.0, below=1.0)
    adam_beta2: float = arg(0.95, "Adam beta2", min=0.0, below=1.0)
    adam_eps: float = arg(1e-8, "Adam epsilon", above=0.0)
    sgd_momentum: float = arg(0.9, "SGD momentum", min=0.0)
    muon_momentum: float = arg(0.95, "Muon momentum (--optimizer muon)", min=0.0, below=1.0)
    muon_nesterov: bool = arg(True, "Muon: Nesterov momentum, as torch.optim.Muon",
                              aliases=("--muon-use-nesterov",), negatable=True)
    muon_num_ns_steps: int = arg(5, "Muon: Newton-Schulz iterations", min=1, below=100)
    muon_scale_mode: str = arg("spectral", "Muon: update scale of an m x n matrix: spectral "
                               "sqrt(max(m, n)), unit_rms_norm sqrt(m / n), shape_scaling "
                               "sqrt(max(1, m / n))",
                               choices=("spectral", "unit_rms_norm", "shape_scaling"))
    muon_extra_scale_factor: float = arg(1.0, "Muon: extra factor on the update (0.2 with "
                                         "spectral matches AdamW's update RMS)", above=0.0)
    muon_coefficient_type: str = arg("quintic", "Muon: Newton-Schulz coefficients (simple: "
                                     "torch.optim.Muon's one set)",
                                     choices=("simple", "quintic", "polar_express"))
    muon_fp32_matmul_prec: str = arg("medium", "Muon: Newton-Schulz matmuls in bf16 (medium, "
                                     "torch.optim.Muon's) or fp32 (high, highest)",
                                     choices=("medium", "high", "highest"))
    freeze_step: int = arg(100, "onebit_adam, onebit_lamb: AdamW / LAMB warm-up steps before "
                           "the variance freezes and the momentum travels 1-bit compressed "
                           "(DeepSpeed's name; its papers warm up for 15 to 25 percent of the "
                           "run)", min=1)
    onebit_block_size: int = arg(0, "onebit_adam, onebit_lamb, zero_one_adam: elements per "
                                 "1-bit scale, counted from each tensor's start (0: one scale "
                                 "per tensor's piece of a chunk, as DeepSpeed; 4 bytes more "
                                 "per block)", min=0)
    max_coeff: float = arg(10.0, "onebit_lamb: upper clamp of LAMB's trust ratio", above=0.0)
    min_coeff: float = arg(0.01, "onebit_lamb: lower clamp of LAMB's trust ratio", above=0.0)
    coeff_beta: float = arg(0.9, "onebit_lamb: EMA factor of the warm-up trust ratios, frozen "
                            "for the compressed stage", min=0.0, below=1.0)
    factor_max: float = arg(4.0, "onebit_lamb: upper clamp of the compressed stage's "
                            "variance-ratio factor", above=0.0)
    factor_min: float = arg(0.5, "onebit_lamb: lower clamp of that factor", above=0.0)
    factor_threshold: float = arg(0.1, "onebit_lamb: largest relative change of that factor "
                                  "from one step to the next", min=0.0)
    var_freeze_step: int = arg(100000, "zero_one_adam: the last step that may update the "
                               "variance; local steps after it (DeepSpeed's name and default)",
                               min=1)
    var_update_scaler: int = arg(16, "zero_one_adam: variance updates per interval before the "
                                 "interval between them doubles", min=1)
    local_step_scaler: int = arg(32678, "zero_one_adam: steps after --var-freeze-step per "
                                 "interval before the interval between synchronisations "
                                 "doubles (DeepSpeed's default)", min=1)
    local_step_clipper: int = arg(16, "zero_one_adam: the longest interval between "
                                  "synchronisations, in steps", min=1)
    clip_grad: float = arg(1.0, "clip the global grad L2 norm to this (0: off)", min=0.0)
    use_distributed_optimizer: bool = arg(
        False, "shard optimizer state over DP (ZeRO-1): --data-parallel-sharding-strategy optim")
    data_parallel_sharding_strategy: str | None = arg(
        None, "what data parallelism shards over DP x CP: "
        + ", ".join(f"{s.name} ({s.summary})" for s in STRATEGIES)
        + f" (default: {OPTIM.name} with --use-distributed-optimizer, else {NO_SHARD.name})",
        choices=STRATEGY_NAMES)
    optimizer_cpu_offload: bool = arg(
        False, "fp32 master params and optimizer state in host memory, stepped there (needs a "
        "sharded strategy; with optim_grads_params the sharded params too)")
    optimizer_offload_device: str | None = arg(
        None, "where the optimizer's fp32 masters and state live (DeepSpeed's "
        "offload_optimizer.device): cpu (host memory, as --optimizer-cpu-offload) or nvme "
        "(files under --offload-nvme-path, streamed through a few host buffers; needs a "
        "sharded strategy)", choices=("cpu", "nvme"))
    param_offload_device: str = arg(
        "none", "where ZeRO-3's sharded parameters live between uses (DeepSpeed's "
        "offload_param.device): none (the device), cpu (host memory; no saving on a CPU "
        "machine) or nvme (files under --offload-nvme-path), each layer read back ahead of "
        "its all-gather", choices=("none", "cpu", "nvme"))
    offload_nvme_path: str | None = arg(
        None, "directory (on a fast local disk) for the nvme tiers' scratch files, one "
        "subdirectory per rank and tier, removed at exit (DeepSpeed's nvme_path)")
    offload_sub_group_size: int = arg(
        1_000_000, "parameters per sub-group the nvme tier steps at a time (DeepSpeed's "
        "sub_group_size): host memory holds 3 sub-groups' masters, state and grads", min=1)
    ddp_bucket_size: int = arg(40_000_000, "elements per DP gradient all-reduce bucket", min=1)
    overlap_grad_reduce: bool = arg(True, "start bucket reductions during backward",
                                    negatable=True)

    @property
    def offload_device(self) -> str | None:
        """Where the optimizer state lives off the device: "cpu", "nvme" or None."""
        return "cpu" if self.optimizer_cpu_offload else self.optimizer_offload_device

    @property
    def sharding(self) -> str:
        """The data-parallel sharding strategy (--use-distributed-optimizer: optim)."""
        return self.data_parallel_sharding_strategy or (
            OPTIM.name if self.use_distributed_optimizer else NO_SHARD.name)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.min_lr > self.lr:
            raise ValueError(f"--min-lr ({self.min_lr}) must be <= --lr ({self.lr}): the "
                             f"learning rate would climb as it decays")
        if self.optimizer_cpu_offload and self.optimizer_offload_device == "nvme":
            raise ValueError("--optimizer-cpu-offload is --optimizer-offload-device cpu: it "
                             "cannot go with --optimizer-offload-device nvme")
        if self.param_offload_device == "nvme" and not self.offload_nvme_path:
            raise ValueError("--param-offload-device nvme needs --offload-nvme-path DIR (where "
                             "the parameters' files go)")
        if (self.optimizer_offload_device == "nvme" or self.param_offload_device == "nvme") \
                != bool(self.offload_nvme_path):
            raise ValueError("--optimizer-offload-device nvme and --offload-nvme-path DIR go "
                             "together (got only one of them)")


@dataclass
class TrainConfig(Section):
    """Batch sizes, iterations, evaluation and logging."""

    micro_batch_size: int = arg(4, "sequences per microbatch per DP rank", min=1)
    global_batch_size: int | None = arg(
        None, "sequences per step (default: micro x DP); micro x DP x microbatches", min=1)
    seq_length: int = arg(256, "tokens per sequence", min=1)
    train_iters: int = arg(200, "optimizer steps", min=0)
    exit_interval: int | None = arg(None, "stop (after saving, with --save) once the iteration "
                                    "is a multiple of this; resume later with --load", min=1)
    eval_interval: int = arg(100, "evaluate every N steps", min=0)
    eval_iters: int = arg(10, "microbatch-steps per evaluation", min=0)
    log_interval: int = arg(10, "log every N steps", min=1)
    seed: int = arg(1234, "random seed")
    tensorboard_dir: str | None = arg(None, "write every logged field as TensorBoard scalars "
                                      "here (needs the optional tensorboard package)")
    max_skipped_steps: int = arg(5, "stop with an error after this many consecutive steps "
                                 "skipped for a non-finite loss or grad norm (fp16: counted "
                                 "once the loss scale is at its minimum)", min=1)
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
class DataConfig(Section):
    """Training data: Megatron .bin/.idx prefixes, blended by weight."""

    data_path: list[str] = arg(list, "prefix, or w1 prefix1 w2 prefix2 ... "
                               "(default: the built-in corpus)", nargs="*")
    split: str = arg("969,30,1", "train,valid,test document ratios")
    tokenizer: str | None = arg(None, "sentencepiece .model, Hugging Face tokenizer directory "
                                "or .gguf (default with --load: the checkpoint's)")
    data_cache_dir: str | None = arg(None, "where sample indices are cached (default: beside data)")
    num_workers: int | None = arg(None, "processes that build the batches (0: the training "
                                        "process; default 1 on CUDA, 0 on the CPU)", min=0)
    reset_position_ids: bool = arg(False, "positions restart after each end-of-document token")
    reset_attention_mask: bool = arg(False, "no attention across end-of-document tokens "
                                            "(each packed document attends to itself)")
    eod_mask_loss: bool = arg(False, "no loss on the prediction made at an end-of-document "
                                     "token (the next document's first token)")


@dataclass
class CheckpointConfig(Section):
    """Saving and resuming."""

    save: str | None = arg(None, "checkpoint directory to write")
    load: str | None = arg(None, "checkpoint directory to resume from")
    save_interval: int | None = arg(None, "save every N steps and at the end (default with "
                                    "--save: a tenth of --train-iters, between 10 and 1000)", min=1)
    keep_latest_checkpoints: int | None = arg(
        None, "after each save keep only the newest N iterations in --save (default: all)", min=1)
    async_save: bool = arg(False, "write checkpoints from a host copy in a background thread "
                           "while training goes on; published when the next save, the end of "
                           "the run or a SIGTERM save waits for it")
