"""Process groups for tensor (TP), context (CP), pipeline (PP) and data (DP) parallelism.

Ranks are laid out TP fastest, then CP, then DP, then PP (Megatron's "tp-cp-dp-pp"):
rank = tp_rank + TP * (cp_rank + CP * (dp_rank + DP * pp_rank)). The embedding group
holds the first and last stage of each pipeline group (the tied word embedding lives on
both). Parameters are replicated over DP and CP, so their grads are reduced over the
DP x CP group (`get_data_parallel_group(with_context_parallel=True)`).

Expert parallelism (EP) is carved out of DP as in Megatron-core: consecutive blocks of EP
data-parallel ranks form an expert-model-parallel group (experts split over it), and the
ranks with the same place in their block form the expert-data-parallel group (DP / EP ranks
holding the same experts, over which expert grads are reduced; with CP, also over the CP group).
"""
import datetime
import itertools
from dataclasses import dataclass

import torch.distributed as dist

from megalite.device import process_group_timeout
from megalite.placement import Placement


@dataclass(frozen=True)
class GridLayout:
    """The process grid of `tp * cp * dp * pp` ranks: the size of every axis (plus the
    pipeline's virtual chunks and their placement) and the rank lists of every group (pure
    data). `from_world` builds a checked one."""

    tp: int
    pp: int
    dp: int
    cp: int = 1
    ep: int = 1
    vpp: int | None = None
    v_shape: bool = False  # the two chunks of pipeline rank r hold stages r and 2p-1-r (zbv)

    @classmethod
    def from_world(cls, world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                   vpp: int | None = None, v_shape: bool = False) -> "GridLayout":
        """The grid of `world_size` ranks (DP = the rest); ValueError (one line naming the
        flag) for a layout that cannot be built. No process group is touched."""
        for flag, size in (("--tensor-model-parallel-size", tp),
                           ("--pipeline-model-parallel-size", pp),
                           ("--context-parallel-size", cp), ("--expert-model-parallel-size", ep)):
            if size < 1:
                raise ValueError(f"{flag} must be >= 1, got {size}")
        if world_size % (tp * cp * pp):
            raise ValueError(f"world size {world_size} is not divisible by tensor ({tp}) x "
                             f"context ({cp}) x pipeline ({pp}) parallel size = {tp * cp * pp}")
        if vpp is not None and (vpp < 1 or pp < 2):
            raise ValueError(f"--virtual-pipeline-model-parallel-size ({vpp}) needs "
                             f"--pipeline-model-parallel-size > 1 and a value >= 1 (got pp={pp})")
        dp = world_size // (tp * cp * pp)
        if dp % ep:
            raise ValueError(f"--expert-model-parallel-size ({ep}) must divide the data-parallel "
                             f"size ({dp}): EP ranks are carved out of DP")
        if v_shape and vpp != 2:
            raise ValueError(f"V-shape placement needs 2 model chunks per pipeline rank, got "
                             f"--vpp {vpp}")
        return cls(tp, pp, dp, cp, ep, vpp, v_shape)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def placement(self) -> Placement:
        """Where the (pipeline rank, virtual chunk) pairs sit among the stages."""
        return Placement(self.pp, self.vpp or 1, self.v_shape)

    def as_dict(self) -> dict:
        """The layout a checkpoint records (CP and EP only when > 1, so older metadata,
        saved before they existed, compares equal)."""
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "vpp": self.vpp,
                **({"cp": self.cp} if self.cp > 1 else {}),
                **({"ep": self.ep} if self.ep > 1 else {})}

    def rank(self, tp_rank: int, cp_rank: int, dp_rank: int, pp_rank: int) -> int:
        """The global rank at these coordinates (tp-cp-dp-pp order, TP fastest)."""
        return tp_rank + self.tp * (cp_rank + self.cp * (dp_rank + self.dp * pp_rank))

    def coords(self, rank: int) -> tuple[int, int, int, int]:
        """(tp_rank, cp_rank, dp_rank, pp_rank) of a global rank."""
        rest = rank // self.tp
        return rank % self.tp, rest % self.cp, rest // self.cp % self.dp, \
            rest // (self.cp * self.dp)

    def _groups(self, vary: str) -> list[list[int]]:
        """One rank list per setting of the other axes, varying the axes in `vary` (letters of
        'tcdp'), in rank order."""
        sizes = {"t": self.tp, "c": self.cp, "d": self.dp, "p": self.pp}
        fixed = [a for a in "tcdp" if a not in vary]
        groups = []
        for outer in itertools.product(*(range(sizes[a]) for a in reversed(fixed))):
            coord = dict(zip(reversed(fixed), outer))
            ranks = []
            for inner in itertools.product(*(range(sizes[a]) for a in reversed(vary))):
                coord.update(zip(reversed(vary), inner))
                ranks.append(self.rank(coord["t"], coord["c"], coord["d"], coord["p"]))
            groups.append(sorted(ranks))
        return groups

    def tensor_groups(self) -> list[list[int]]:
        return self._groups("t")

    def context_groups(self) -> list[list[int]]:
        return self._groups("c")

    def data_groups(self) -> list[list[int]]:
        return self._groups("d")

    def data_context_groups(self) -> list[list[int]]:
        """DP x CP ranks holding the same parameters (grads reduced over them)."""
        return self._groups("cd")

    def pipeline_groups(self) -> list[list[int]]:
        return self._groups("p")

    def model_groups(self) -> list[list[int]]:
        """TP x PP ranks sharing one model replica (one per DP and CP rank)."""
        return self._groups("tp")

    def embedding_groups(self) -> list[list[int]]:
        return [sorted({g[0], g[-1]}) for g in self.pipeline_groups()]

    def expert_model_groups(self) -> list[list[int]]:
        """Blocks of `ep` consecutive DP ranks (same TP rank and stage): experts split over."""
        return [group[block:block + self.ep] for group in self.data_groups()
                for block in range(0, self.dp, self.ep)]

    def expert_data_groups(self) -> list[list[int]]:
        """DP x CP ranks at the same place of their EP block: they hold the same experts."""
        return [[rank for i, rank in enumerate(group) if i // self.cp % self.ep == place]
                for group in self.data_context_groups() for place in range(self.ep)]


class _ProcessGroups:
    """This process's groups of the current grid (None before initialisation)."""

    grid: GridLayout | None = None
    tp_group = dp_group = pp_group = model_group = embedding_group = None
    cp_group = dp_cp_group = ep_group = expert_dp_group = None
    pp_ranks: list[int] = []
    embedding_ranks: list[int] = []
    virtual_rank: int | None = None  # the chunk being built (build_model_chunks)


_groups = _ProcessGroups()


def _new_groups(rank_lists: list[list[int]], my_rank: int, timeout: datetime.timedelta | None,
                made: dict):
    """Create every group (all ranks call new_group for each, in order) not in `made` (groups
    by sorted ranks, shared). Mine, or (None, [])."""
    mine = (None, [])
    for ranks in rank_lists:
        key = tuple(sorted(ranks))
        if key not in made:
            made[key] = dist.new_group(ranks, timeout=timeout)
        if my_rank in ranks:
            mine = (made[key], ranks)
    return mine


def initialize_model_parallel(tensor_model_parallel_size: int = 1,
                              pipeline_model_parallel_size: int = 1,
                              virtual_pipeline_model_parallel_size: int | None = None,
                              context_parallel_size: int = 1,
                              v_shape_placement: bool = False,
                              timeout_s: float | None = None,
                              expert_model_parallel_size: int = 1, *,
                              grid: GridLayout | None = None) -> None:
    """Build the TP/CP/DP/DPxCP/PP/model/embedding (and expert) groups on the default
    process group: of `grid` (a run's layout, megalite.layout.RunLayout.grid), or of the
    sizes given (Megatron's arguments, checked by GridLayout.from_world).

    v_shape_placement: the two chunks of pipeline rank r hold stages r and 2p-1-r (the zbv
    schedule; needs virtual_pipeline_model_parallel_size 2) instead of r and p + r.
    Every group waits at most `timeout_s` seconds in a collective or p2p operation (default:
    the bound megalite.device.init_distributed gave the default group), so a hang in any of
    them ends the job with an error. With EP = 1 no expert groups are built: the expert-DP
    group is the DP x CP group. Called again, it destroys the previous layout's groups first.
    """
    if not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel: torch.distributed is not initialized "
                           "(call megalite.device.init_distributed first)")
    world, rank = dist.get_world_size(), dist.get_rank()
    if grid is None:
        grid = GridLayout.from_world(world, tensor_model_parallel_size,
                                     pipeline_model_parallel_size, context_parallel_size,
                                     expert_model_parallel_size,
                                     virtual_pipeline_model_parallel_size, v_shape_placement)
    if grid.world_size != world:
        raise ValueError(f"the layout needs {grid.world_size} ranks, the job has {world}")
    destroy_model_parallel()  # a new layout replaces the groups of the previous one
    _groups.grid = grid
    timeout = process_group_timeout() if timeout_s is None \
        else datetime.timedelta(seconds=timeout_s)
    # gloo: kinds with the same ranks share a group (DP x CP = DP at CP 1). NCCL: one per kind, as
    # Megatron (on one communicator the pipeline's sends would queue behind an all-reduce).
    g, shared, gloo = _groups, {}, dist.get_backend() == "gloo"

    def groups(rank_lists: list[list[int]]):
        return _new_groups(rank_lists, rank, timeout, shared if gloo else {})
    g.tp_group, _ = groups(grid.tensor_groups())
    g.dp_group, _ = groups(grid.data_groups())
    g.cp_group, _ = groups(grid.context_groups())
    g.dp_cp_group, _ = groups(grid.data_context_groups())
    g.pp_group, g.pp_ranks = groups(grid.pipeline_groups())
    g.model_group, _ = groups(grid.model_groups())
    g.embedding_group, g.embedding_ranks = groups(grid.embedding_groups())
    if grid.ep > 1:  # EP = 1: no expert groups (see the getters)
        g.ep_group, _ = groups(grid.expert_model_groups())
        g.expert_dp_group, _ = groups(grid.expert_data_groups())
    g.virtual_rank = 0 if grid.vpp else None


def model_parallel_is_initialized() -> bool:
    return _groups.grid is not None


GROUP_NAMES = ("tp_group", "dp_group", "pp_group", "model_group", "embedding_group", "cp_group",
               "dp_cp_group", "ep_group", "expert_dp_group")


def destroy_model_parallel() -> None:
    """Destroy and forget every group (a shared one once): another layout may follow."""
    destroyed = []
    for name in GROUP_NAMES:
        group = getattr(_groups, name)
        if group is not None and dist.is_initialized() and all(group is not d for d in destroyed):
            dist.destroy_process_group(group)
            destroyed.append(group)
        setattr(_groups, name, None)
    _groups.grid = _groups.virtual_rank = None


def get_grid() -> GridLayout | None:
    """The current grid (None before initialisation)."""
    return _groups.grid


def _grid() -> GridLayout:
    if _groups.grid is None:
        raise RuntimeError("model parallel groups are not initialized "
                           "(call megalite.mpu.initialize_model_parallel)")
    return _groups.grid


def _group(name: str):
    """The named group; None (a group of one) in a single process that never initialised."""
    if _groups.grid is None and (not dist.is_initialized() or dist.get_world_size() == 1):
        return None
    _grid()
    return getattr(_groups, name)


def get_tensor_model_parallel_group():
    return _group("tp_group")


def get_pipeline_model_parallel_group():
    return _group("pp_group")


def get_data_parallel_group(with_context_parallel: bool = False):
    """DP ranks; with_context_parallel: DP x CP ranks (where parameter grads are reduced)."""
    return _group("dp_cp_group" if with_context_parallel else "dp_group")


def get_context_parallel_group():
    """The CP ranks that hold the other chunks of the same sequences (the ring)."""
    return _group("cp_group")


def get_model_parallel_group():
    """TP x PP ranks of this model replica (for inf checks and the global grad norm)."""
    return _group("model_group")


def get_embedding_group():
    return _group("embedding_group")


def get_embedding_ranks() -> list[int]:
    _grid()
    return list(_groups.embedding_ranks)


def get_tensor_model_parallel_world_size() -> int:
    return _groups.grid.tp if _groups.grid else 1


def get_pipeline_model_parallel_world_size() -> int:
    return _groups.grid.pp if _groups.grid else 1


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    grid = _groups.grid
    if grid is None:
        return 1
    return grid.dp * (grid.cp if with_context_parallel else 1)


def get_context_parallel_world_size() -> int:
    return _groups.grid.cp if _groups.grid else 1


def _coords() -> tuple[int, int, int, int]:
    """(tp, cp, dp, pp) rank of this process (all 0 before initialisation)."""
    return _groups.grid.coords(dist.get_rank()) if _groups.grid else (0, 0, 0, 0)


def get_tensor_model_parallel_rank() -> int:
    return _coords()[0]


def get_context_parallel_rank() -> int:
    return _coords()[1]


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    _, cp_rank, dp_rank, _ = _coords()
    if with_context_parallel:
        return dp_rank * get_context_parallel_world_size() + cp_rank
    return dp_rank


def get_pipeline_model_parallel_rank() -> int:
    return _coords()[3]


def get_pipeline_model_parallel_ranks() -> list[int]:
    return list(_groups.pp_ranks)


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    return _groups.grid.vpp if _groups.grid else None


def get_virtual_pipeline_model_parallel_rank() -> int | None:
    """The chunk being built (megalite.models.stage.build_model_chunks sets it)."""
    return _groups.virtual_rank


def set_virtual_pipeline_model_parallel_rank(rank: int | None) -> None:
    _groups.virtual_rank = rank


def is_pipeline_v_shape() -> bool:
    """Whether the two chunks of each pipeline rank sit in V placement (zbv)."""
    return bool(_groups.grid and _groups.grid.v_shape)


def get_pipeline_placement() -> Placement:
    """Where this grid's (pipeline rank, virtual chunk) pairs sit among the stages."""
    return _groups.grid.placement if _groups.grid else Placement(1, 1)


def is_pipeline_first_stage(ignore_virtual: bool = False) -> bool:
    """This rank holds the first stage: in its current virtual chunk, or (ignore_virtual) in
    any chunk."""
    place = get_pipeline_placement()
    rank = get_pipeline_model_parallel_rank()
    return place.locate(0) == (rank, _groups.virtual_rank or 0) if not ignore_virtual \
        else place.locate(0)[0] == rank


def is_pipeline_last_stage(ignore_virtual: bool = False) -> bool:
    """This rank holds the last stage: in its current virtual chunk, or (ignore_virtual) in
    any chunk."""
    place = get_pipeline_placement()
    rank = get_pipeline_model_parallel_rank()
    last = place.locate(place.num_stages - 1)
    return last == (rank, _groups.virtual_rank or 0) if not ignore_virtual else last[0] == rank


def get_pipeline_model_parallel_next_rank() -> int:
    return _groups.pp_ranks[(get_pipeline_model_parallel_rank() + 1) % len(_groups.pp_ranks)]


def get_pipeline_model_parallel_prev_rank() -> int:
    return _groups.pp_ranks[(get_pipeline_model_parallel_rank() - 1) % len(_groups.pp_ranks)]


def get_expert_model_parallel_group():
    """The EP ranks this rank's experts are split over (a block of the DP group)."""
    return _group("ep_group")


def get_expert_data_parallel_group():
    """The DP / EP x CP ranks holding the same experts (expert grads are reduced here); with
    EP = 1 the DP x CP group."""
    return _group("expert_dp_group" if get_expert_model_parallel_world_size() > 1
                  else "dp_cp_group")


def get_expert_model_parallel_world_size() -> int:
    return _groups.grid.ep if _groups.grid else 1
