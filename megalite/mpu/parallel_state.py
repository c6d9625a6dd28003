"""Process groups for tensor (TP), pipeline (PP) and data (DP) parallelism.

Ranks are laid out TP fastest, then DP, then PP (Megatron's "tp-dp-pp"):
rank = tp_rank + TP * (dp_rank + DP * pp_rank). The embedding group holds the first
and last stage of each pipeline group (the tied word embedding lives on both).

Expert parallelism (EP) is carved out of DP as in Megatron-core: consecutive blocks of EP
data-parallel ranks form an expert-model-parallel group (experts split over it), and the
ranks with the same place in their block form the expert-data-parallel group (DP / EP ranks
holding the same experts, over which expert grads are reduced).
"""
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class GridLayout:
    """The rank lists of every group for a world of `tp * pp * dp` ranks (pure data)."""

    tp: int
    pp: int
    dp: int
    ep: int = 1

    def rank(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, dp_rank, pp_rank) of a global rank."""
        return rank % self.tp, (rank // self.tp) % self.dp, rank // (self.tp * self.dp)

    def tensor_groups(self) -> list[list[int]]:
        return [[self.rank(t, d, p) for t in range(self.tp)]
                for p in range(self.pp) for d in range(self.dp)]

    def data_groups(self) -> list[list[int]]:
        return [[self.rank(t, d, p) for d in range(self.dp)]
                for p in range(self.pp) for t in range(self.tp)]

    def pipeline_groups(self) -> list[list[int]]:
        return [[self.rank(t, d, p) for p in range(self.pp)]
                for d in range(self.dp) for t in range(self.tp)]

    def model_groups(self) -> list[list[int]]:
        """TP x PP ranks sharing one model replica (one per DP rank)."""
        return [[self.rank(t, d, p) for p in range(self.pp) for t in range(self.tp)]
                for d in range(self.dp)]

    def embedding_groups(self) -> list[list[int]]:
        return [sorted({g[0], g[-1]}) for g in self.pipeline_groups()]

    def expert_model_groups(self) -> list[list[int]]:
        """Blocks of `ep` consecutive DP ranks (same TP rank and stage): experts split over."""
        return [group[block:block + self.ep] for group in self.data_groups()
                for block in range(0, self.dp, self.ep)]

    def expert_data_groups(self) -> list[list[int]]:
        """DP ranks at the same place of their EP block: they hold the same experts."""
        return [group[i::self.ep] for group in self.data_groups() for i in range(self.ep)]


def validate_sizes(world_size: int, tensor_model_parallel_size: int,
                   pipeline_model_parallel_size: int,
                   virtual_pipeline_model_parallel_size: int | None) -> int:
    """Check the requested layout; return the data-parallel size. Raises ValueError (one line)."""
    tp, pp, vpp = tensor_model_parallel_size, pipeline_model_parallel_size, \
        virtual_pipeline_model_parallel_size
    if tp < 1 or pp < 1:
        raise ValueError(f"--tensor-model-parallel-size ({tp}) and --pipeline-model-parallel-size "
                         f"({pp}) must be >= 1")
    if world_size % (tp * pp):
        raise ValueError(f"world size {world_size} is not divisible by tensor ({tp}) x pipeline "
                         f"({pp}) parallel size = {tp * pp}")
    if vpp is not None and (vpp < 1 or pp < 2):
        raise ValueError(f"--virtual-pipeline-model-parallel-size ({vpp}) needs "
                         f"--pipeline-model-parallel-size > 1 and a value >= 1 (got pp={pp})")
    return world_size // (tp * pp)


class _State:
    layout: GridLayout | None = None
    tp_group = dp_group = pp_group = model_group = embedding_group = None
    ep_group = expert_dp_group = None
    tp_ranks: list[int] = []
    dp_ranks: list[int] = []
    pp_ranks: list[int] = []
    embedding_ranks: list[int] = []
    virtual_size: int | None = None
    virtual_rank: int | None = None


_S = _State()


def _new_groups(rank_lists: list[list[int]], my_rank: int):
    """Create every group (all ranks must call new_group for each); return mine or (None, [])."""
    mine = (None, [])
    for ranks in rank_lists:
        group = dist.new_group(ranks)
        if my_rank in ranks:
            mine = (group, ranks)
    return mine


def initialize_model_parallel(tensor_model_parallel_size: int = 1,
                              pipeline_model_parallel_size: int = 1,
                              virtual_pipeline_model_parallel_size: int | None = None,
                              expert_model_parallel_size: int = 1) -> None:
    """Build the TP/PP/DP/model/embedding (and expert) groups on the default process group."""
    if not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel: torch.distributed is not initialized "
                           "(call megalite.device.init_distributed first)")
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = validate_sizes(world, tensor_model_parallel_size, pipeline_model_parallel_size,
                        virtual_pipeline_model_parallel_size)
    if dp % expert_model_parallel_size:
        raise ValueError(f"--expert-model-parallel-size ({expert_model_parallel_size}) must "
                         f"divide the data-parallel size ({dp}): EP ranks are carved out of DP")
    layout = GridLayout(tensor_model_parallel_size, pipeline_model_parallel_size, dp,
                        expert_model_parallel_size)
    _S.layout = layout
    _S.tp_group, _S.tp_ranks = _new_groups(layout.tensor_groups(), rank)
    _S.dp_group, _S.dp_ranks = _new_groups(layout.data_groups(), rank)
    _S.pp_group, _S.pp_ranks = _new_groups(layout.pipeline_groups(), rank)
    _S.model_group, _ = _new_groups(layout.model_groups(), rank)
    _S.embedding_group, _S.embedding_ranks = _new_groups(layout.embedding_groups(), rank)
    _S.ep_group, _ = _new_groups(layout.expert_model_groups(), rank)
    _S.expert_dp_group, _ = _new_groups(layout.expert_data_groups(), rank)
    _S.virtual_size = virtual_pipeline_model_parallel_size
    _S.virtual_rank = 0 if virtual_pipeline_model_parallel_size else None


def model_parallel_is_initialized() -> bool:
    return _S.layout is not None


def destroy_model_parallel() -> None:
    """Forget every group so a test can initialise another layout."""
    for name in ("tp_group", "dp_group", "pp_group", "model_group", "embedding_group",
                 "ep_group", "expert_dp_group"):
        group = getattr(_S, name)
        if group is not None and dist.is_initialized():
            dist.destroy_process_group(group)
        setattr(_S, name, None)
    _S.layout = None
    _S.virtual_size = _S.virtual_rank = None


def _layout() -> GridLayout:
    if _S.layout is None:
        raise RuntimeError("model parallel groups are not initialized "
                           "(call megalite.mpu.initialize_model_parallel)")
    return _S.layout


def _group(name: str):
    """The named group; None (a group of one) in a single process that never initialised."""
    if _S.layout is None and (not dist.is_initialized() or dist.get_world_size() == 1):
        return None
    _layout()
    return getattr(_S, name)


def get_tensor_model_parallel_group():
    return _group("tp_group")


def get_pipeline_model_parallel_group():
    return _group("pp_group")


def get_data_parallel_group():
    return _group("dp_group")


def get_model_parallel_group():
    """TP x PP ranks of this model replica (for inf checks and the global grad norm)."""
    return _group("model_group")


def get_embedding_group():
    return _group("embedding_group")


def get_embedding_ranks() -> list[int]:
    _layout()
    return list(_S.embedding_ranks)


def get_tensor_model_parallel_world_size() -> int:
    return _layout().tp if _S.layout else 1


def get_pipeline_model_parallel_world_size() -> int:
    return _layout().pp if _S.layout else 1


def get_data_parallel_world_size() -> int:
    return _layout().dp if _S.layout else 1


def _coords() -> tuple[int, int, int]:
    return _layout().coords(dist.get_rank()) if _S.layout else (0, 0, 0)


def get_tensor_model_parallel_rank() -> int:
    return _coords()[0]


def get_data_parallel_rank() -> int:
    return _coords()[1]


def get_pipeline_model_parallel_rank() -> int:
    return _coords()[2]


def get_tensor_model_parallel_ranks() -> list[int]:
    return list(_S.tp_ranks)


def get_pipeline_model_parallel_ranks() -> list[int]:
    return list(_S.pp_ranks)


def get_data_parallel_ranks() -> list[int]:
    return list(_S.dp_ranks)


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    return _S.virtual_size


def get_virtual_pipeline_model_parallel_rank() -> int | None:
    return _S.virtual_rank


def set_virtual_pipeline_model_parallel_rank(rank: int | None) -> None:
    _S.virtual_rank = rank


def is_pipeline_first_stage(ignore_virtual: bool = False) -> bool:
    """First stage of the pipeline (and first virtual chunk unless ignore_virtual)."""
    if not ignore_virtual and _S.virtual_size and _S.virtual_rank != 0:
        return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = False) -> bool:
    """Last stage of the pipeline (and last virtual chunk unless ignore_virtual)."""
    if not ignore_virtual and _S.virtual_size and _S.virtual_rank != _S.virtual_size - 1:
        return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def get_pipeline_model_parallel_next_rank() -> int:
    ranks = _S.pp_ranks
    return ranks[(get_pipeline_model_parallel_rank() + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank() -> int:
    ranks = _S.pp_ranks
    return ranks[(get_pipeline_model_parallel_rank() - 1) % len(ranks)]


def get_expert_model_parallel_group():
    """The EP ranks this rank's experts are split over (a block of the DP group)."""
    return _group("ep_group")


def get_expert_data_parallel_group():
    """The DP / EP ranks holding the same experts (expert grads are reduced here)."""
    return _group("expert_dp_group")


def get_expert_model_parallel_world_size() -> int:
    return _layout().ep if _S.layout else 1


def get_expert_model_parallel_rank() -> int:
    return get_data_parallel_rank() % get_expert_model_parallel_world_size()


def get_expert_data_parallel_world_size() -> int:
    return get_data_parallel_world_size() // get_expert_model_parallel_world_size()


def get_expert_data_parallel_rank() -> int:
    return get_data_parallel_rank() // get_expert_model_parallel_world_size()
