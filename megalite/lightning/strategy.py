"""`MegaliteStrategy`: a Lightning Strategy that runs a megalite task (a `MegaliteModule`) on
megalite's process grid, the way NeMo's MegatronStrategy runs Megatron-core.

Lightning hook -> megalite (per rank; every collective is over the world unless named):
- setup_environment: join the world (torchrun / SLURM / an existing group), check the flags,
  build the TP x CP x DP x PP (x EP) grid of the RunLayout (training.loop.start_parallel);
- setup: the task's model chunks wrapped as the sharding strategy says (DDP buckets or
  FSDP2), megalite's optimizer and scheduler, a --load checkpoint (training.loop.start_run);
- optimizer_step: the module's closure runs one whole megalite step (every microbatch through
  the pipeline schedule, grad reduction, clipping, the optimizer: manual optimization);
- save_checkpoint / load_checkpoint: megalite's distributed checkpoint in the directory
  Lightning names (`epoch=0-step=2.ckpt/`), loadable by pretrain_gpt.py --load under any
  layout; Lightning's own state (loops, callbacks) beside it in `lightning_state.json`.
"""
import json
import os
from typing import Any

import torch
import torch.distributed as dist
from lightning_fabric.plugins import ClusterEnvironment
from lightning_utilities.core.rank_zero import rank_zero_only as utilities_rank_zero_only
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies import ParallelStrategy
from pytorch_lightning.utilities.rank_zero import rank_zero_only

from megalite import checkpoint, device
from megalite.config import Configs, parse_configs
from megalite.training.loop import start_parallel, start_run, start_logging
from megalite.lightning.environment import detect_environment

LIGHTNING_STATE = "lightning_state.json"  # Lightning's loops and callbacks, beside megalite's files
# MegaliteStrategy keyword -> ParallelConfig field
PARALLEL_KEYWORDS = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
                     "vpp": "virtual_pipeline_model_parallel_size", "cp": "context_parallel_size",
                     "sp": "sequence_parallel", "ep": "expert_model_parallel_size"}


class MegaliteStrategy(ParallelStrategy):
    """Lightning's Trainer on megalite's process grid, model wrapping, step and checkpoints.

    `MegaliteStrategy(tp=2, pp=2, vpp=None, cp=1, sp=False, ep=1, sharding="optim")`, or
    `MegaliteStrategy(flags=["--tp", "2", "--use-distributed-optimizer"])` (a flag list or
    megalite Configs: its parallel section and sharding strategy). What is given replaces the
    module's own flags; DP is what the world leaves (world / (TP x CP x PP)). The module must
    be a `megalite.lightning.MegaliteModule`.
    """

    strategy_name = "megalite"

    def __init__(self, tp: int | None = None, pp: int | None = None, vpp: int | None = None,
                 cp: int | None = None, sp: bool | None = None, ep: int | None = None,
                 sharding: str | None = None, flags: list[str] | Configs | None = None,
                 cluster_environment: ClusterEnvironment | None = None, **kwargs: Any) -> None:
        super().__init__(cluster_environment=cluster_environment or detect_environment(),
                         **kwargs)
        self.parallel_overrides = self._overrides(flags, dict(tp=tp, pp=pp, vpp=vpp, cp=cp,
                                                              sp=sp, ep=ep), sharding)
        self.num_nodes = 1

    @staticmethod
    def _overrides(flags: list[str] | Configs | None, keywords: dict, sharding: str | None
                   ) -> dict[str, Any]:
        """{("parallel" | "optimizer", field): value} that replace the module's configs."""
        overrides = {}
        if flags is not None:
            configs = flags if isinstance(flags, Configs) else parse_configs(list(flags))
            overrides = {("parallel", name): getattr(configs.parallel, name)
                         for name in PARALLEL_KEYWORDS.values()}
            overrides[("optimizer", "data_parallel_sharding_strategy")] = \
                configs.optimizer.sharding
        overrides.update({("parallel", PARALLEL_KEYWORDS[k]): v for k, v in keywords.items()
                          if v is not None})
        if sharding is not None:
            overrides[("optimizer", "data_parallel_sharding_strategy")] = sharding
        return overrides

    # where the ranks are
    @property
    def root_device(self) -> torch.device:
        if device.device_type() == "cuda":
            return torch.device("cuda", self.local_rank % torch.cuda.device_count())
        return torch.device("cpu")

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """megalite's tasks sample per DP rank themselves; Lightning must not add a sampler."""
        return {"num_replicas": 1, "rank": 0}

    def set_world_ranks(self) -> None:
        """Tell Lightning's rank-zero-only writers (loggers, prints) this process's rank: the
        world's, which its variables may not name (a process group joined before)."""
        rank_zero_only.rank = utilities_rank_zero_only.rank = self.global_rank

    def _configure_launcher(self) -> None:
        self._launcher = None  # ranks are started outside the Trainer (environment.py)

    def setup_environment(self) -> None:
        """Join the world, then check the flags and build the grid of the module's layout."""
        super().setup_environment()
        if type(self.precision_plugin) is not Precision:
            raise ValueError(f"Trainer(precision=...): {type(self.precision_plugin).__name__} "
                             f"is not used by megalite; pass --bf16 / --fp16 in the module's "
                             f"flags and leave the Trainer at precision='32-true'")
        env = self.cluster_environment
        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", env.main_address)
            os.environ.setdefault("MASTER_PORT", str(env.main_port))
            os.environ.setdefault("LOCAL_RANK", str(env.local_rank()))
            device.init_distributed(env.global_rank(), env.world_size())
        module = self.lightning_module
        for (section, name), value in self.parallel_overrides.items():
            setattr(getattr(module.configs, section), name, value)
        module.layout = start_parallel(module.configs, module.task)

    def setup(self, trainer) -> None:
        """The module's model chunks, optimizer and scheduler on the grid (resumed from the
        module's --load when given) and its megalite Run."""
        self.accelerator.setup(trainer)
        module = self.lightning_module
        module.attach(start_run(module.configs, module.task, module.layout))
        start_logging(module.run)
        self.setup_optimizers(trainer)

    def setup_optimizers(self, trainer) -> None:
        """megalite's optimizer (its OptimizerKind and sharding), as the module's
        configure_optimizers returns it; the LR schedule is megalite's too (stepped with each
        applied step, visible to LearningRateMonitor through the param groups)."""
        self.optimizers = [self.lightning_module.configure_optimizers()]
        self.lr_scheduler_configs = []

    def model_to_device(self) -> None:
        pass  # the chunks are built on their device

    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        """The closure is the whole megalite step (it applies the optimizer itself)."""
        return closure()

    # collectives Lightning asks for (over the world)
    def barrier(self, name: str | None = None) -> None:
        if dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False
                   ) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.stack(parts)

    def reduce(self, tensor: Any, group: Any = None, reduce_op: str | None = "mean") -> Any:
        if not isinstance(tensor, torch.Tensor) or not dist.is_initialized():
            return tensor
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=group)
        if reduce_op in (None, "mean", "avg") or str(reduce_op).lower().endswith("avg"):
            tensor = tensor / dist.get_world_size(group)
        return tensor

    # checkpoints: megalite's distributed format in the directory Lightning names
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the chunks and optimizer must exist to take their slices

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the weights are written by megalite.checkpoint.save, per rank

    def optimizer_state(self, optimizer) -> dict:
        return {}

    def save_checkpoint(self, checkpoint_state: dict[str, Any], filepath: str,
                        storage_options: Any = None) -> None:
        """megalite.checkpoint.save of the run into directory `filepath` (collective over the
        world; every rank writes its slices); rank 0 adds Lightning's state."""
        run = self.lightning_module.run
        checkpoint.save(str(filepath), run.iteration, run.model, run.optimizer, run.scheduler,
                        run.consumed, run.configs.model, run.task.state_dict(),
                        tokenizer=run.tokenizer)
        if self.is_global_zero:
            state = {k: v for k, v in checkpoint_state.items()
                     if k not in ("state_dict", "optimizer_states")}
            write_json_state(state, os.path.join(str(filepath), LIGHTNING_STATE))

    def load_checkpoint(self, checkpoint_path: str, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        """megalite.checkpoint.load into the run (resharded to this layout), the task's state;
        Lightning's state from beside it."""
        module, path = self.lightning_module, str(checkpoint_path)
        run = module.run
        if checkpoint.read_meta(path) is None:
            raise ValueError(f"ckpt_path {path}: no megalite checkpoint there (expected a "
                             f"directory written by MegaliteStrategy or pretrain_gpt.py --save)")
        run.iteration, run.consumed = checkpoint.load(
            path, run.model, run.optimizer, run.scheduler, run.configs.model,
            run.configs.train.seed)
        run.task.load_state_dict(checkpoint.read_meta(path).get("task", {}))
        state_file = os.path.join(path, LIGHTNING_STATE)
        if not os.path.exists(state_file):
            raise ValueError(f"ckpt_path {path}: a megalite checkpoint without Lightning's "
                             f"state; start from it with the module's --load flag instead")
        return {**read_json_state(state_file), "state_dict": {}}

    def load_model_state_dict(self, checkpoint_state: Any, strict: bool = True) -> None:
        pass  # loaded by load_checkpoint

    def load_optimizer_state_dict(self, checkpoint_state: Any) -> None:
        pass  # loaded by load_checkpoint

    def teardown(self) -> None:
        """The grid and the chunks stay (the module can still generate or evaluate)."""
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()


def _encode(value: Any) -> Any:
    """json.dump's hook: a tensor as its values and dtype (callbacks keep scores as tensors)."""
    if isinstance(value, torch.Tensor):
        return {"__tensor__": value.tolist(), "dtype": str(value.dtype).removeprefix("torch.")}
    raise TypeError(f"Lightning's checkpoint state holds a {type(value).__name__}, which "
                    f"{LIGHTNING_STATE} (JSON: no pickle in megalite checkpoints) cannot store")


def _decode(entry: dict) -> Any:
    if "__tensor__" in entry:
        return torch.tensor(entry["__tensor__"], dtype=getattr(torch, entry["dtype"]))
    return entry


def write_json_state(state: dict, path: str) -> None:
    """Lightning's state (loops, callbacks, epoch, step) as JSON, tensors included."""
    with open(path + ".tmp", "w") as f:
        json.dump(state, f, default=_encode)
    os.replace(path + ".tmp", path)


def read_json_state(path: str) -> dict:
    with open(path) as f:
        return json.load(f, object_hook=_decode)
