"""Where the processes of a Lightning run come from: Lightning's own torchrun (TorchElastic)
and SLURM environments when their variables are set, else `MegaliteEnvironment`.

megalite never spawns processes from inside the Trainer: every rank is started outside it
(torchrun, srun, tools/run_multinode.sh, a rank pool), as for megalite's own entry scripts.
"""
import os

import torch.distributed as dist
from lightning_fabric.plugins.environments import (ClusterEnvironment, SLURMEnvironment,
                                                   TorchElasticEnvironment)


class MegaliteEnvironment(ClusterEnvironment):
    """Ranks started outside Lightning: the process group this process has already joined
    (megalite's test rank pools, a launcher of one's own), else torchrun-style variables
    (RANK, WORLD_SIZE, LOCAL_RANK, GROUP_RANK, MASTER_ADDR, MASTER_PORT), else one lone
    process. The ranks are what the world says; Lightning's `set_*` requests are ignored."""

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        return int(os.environ.get("MASTER_PORT", 29500))

    @staticmethod
    def detect() -> bool:
        return True

    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else \
            int(os.environ.get("WORLD_SIZE", 1))

    def set_world_size(self, size: int) -> None:
        pass

    def global_rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))

    def set_global_rank(self, rank: int) -> None:
        pass

    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", self.global_rank()))

    def node_rank(self) -> int:
        return int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", 0)))

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        if self.world_size() % num_nodes:
            raise ValueError(f"Trainer(num_nodes={num_nodes}): the world has "
                             f"{self.world_size()} ranks, not a multiple of num_nodes")


def detect_environment() -> ClusterEnvironment:
    """torchrun's (TorchElastic) variables first, as Lightning does, then SLURM's (srun), else
    MegaliteEnvironment."""
    for environment in (TorchElasticEnvironment, SLURMEnvironment):
        if environment.detect():
            return environment()
    return MegaliteEnvironment()
