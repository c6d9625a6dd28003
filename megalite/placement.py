"""Pipeline stage placement and the pipeline schedule names.

A leaf module (no megalite imports): megalite.config, megalite.mpu.parallel_state and the
schedules read it. Every schedule name is written here once; the schedules' records
(builders, rules, closed forms) live in megalite.schedules.
"""
from dataclasses import dataclass

GPIPE = "gpipe"
ONE_F_ONE_B = "1f1b"
INTERLEAVED = "interleaved"
ZB_H1 = "zb-h1"
ZBV = "zbv"
TWO_BW = "2bw"
PIPELINE_SCHEDULES = (ONE_F_ONE_B, GPIPE, INTERLEAVED, ZB_H1, ZBV, TWO_BW)  # --pipeline-schedule


@dataclass(frozen=True)
class Placement:
    """Which global stage (rank, local chunk) holds, of p * v stages.

    Loop (gpipe, 1f1b, interleaved, 2bw): chunk c of rank r is stage c*p + r. V (zbv, v = 2):
    chunk 0 of rank r is stage r and chunk 1 is stage 2p-1-r, so rank 0 holds the first
    and the last stage and rank p-1 hands stage p-1 to stage p without communication.
    """

    p: int
    v: int
    v_shape: bool = False

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    def stage(self, rank: int, chunk: int) -> int:
        if self.v_shape:
            return rank if chunk == 0 else 2 * self.p - 1 - rank
        return chunk * self.p + rank

    def layers_per_stage(self, num_layers: int) -> int:
        """Layers of each stage; ValueError (one line) unless they split evenly."""
        if num_layers % self.num_stages:
            raise ValueError(f"--num-layers ({num_layers}) must be divisible by --pp x --vpp = "
                             f"{self.num_stages}")
        return num_layers // self.num_stages

    def locate(self, stage: int) -> tuple[int, int]:
        """(rank, local chunk) holding `stage`."""
        if self.v_shape:
            return (stage, 0) if stage < self.p else (2 * self.p - 1 - stage, 1)
        return stage % self.p, stage // self.p
