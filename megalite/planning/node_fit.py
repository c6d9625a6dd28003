"""What one node holds of a plan, and the deepest model of a width that fits a node.

A node's ranks (`gpus_per_node`, at most the world) share its host memory and its disk: each
holds the largest share of the plan (megalite.planning.planner): the peak GPU bytes of its
stage, the host bytes of the optimizer's offload tier (the cpu tier's state, or the nvme
tier's buffers) and the nvme tier's file (`Plan.tier_bytes`).
"""
import dataclasses

from megalite.config import Configs
from megalite.planning.planner import Plan, plan


def node_bytes(p: Plan, gpus_per_node: int) -> tuple[float, float, float]:
    """(peak GPU bytes per rank, host bytes of the offload tier per node, bytes of the nvme
    tier's files per node) of plan `p`."""
    nvme, host = p.tier_bytes()
    ranks = min(gpus_per_node, p.layout.world_size)
    return max(s.total for s in p.stages.values()), host * ranks, nvme * ranks


def max_layers(configs: Configs, gpus_per_node: int, budgets: tuple[float, float, float],
               sequence_parallel: bool | None = None, limit: int = 2 ** 16
               ) -> tuple[Plan | None, str]:
    """The plan of the most layers (a multiple of PP x VPP) of `configs`' width whose
    `node_bytes` fit `budgets` (GPU bytes per rank, host bytes, disk bytes per node), and the
    budget one more step of layers exceeds; (None, that budget) when the fewest do not fit."""
    parallel = configs.parallel
    step = parallel.pipeline_model_parallel_size * \
        (parallel.virtual_pipeline_model_parallel_size or 1)
    names = ("GPU memory", "host memory", "disk")

    def at(units: int) -> tuple[Plan, str | None]:
        model = dataclasses.replace(configs.model, num_layers=units * step)
        p = plan(dataclasses.replace(configs, model=model), sequence_parallel)
        over = [n for n, used, cap in zip(names, node_bytes(p, gpus_per_node), budgets)
                if used > cap]
        return p, over[0] if over else None

    if at(1)[1] is not None:
        return None, at(1)[1]
    low, high = 1, 2
    while at(high)[1] is None and high < limit:
        low, high = high, high * 2
    while low + 1 < high:  # at(low) fits, at(high) does not
        middle = (low + high) // 2
        low, high = (middle, high) if at(middle)[1] is None else (low, middle)
    return at(low)[0], at(high)[1] or "planner's limit of layers"
