"""RNG states in checkpoints: Python's, numpy's, torch's and the model-parallel tracker's
streams per rank, restored under the saved layout or re-seeded from --seed + iteration.
"""
import random

import numpy as np
import torch
import torch.distributed as dist

from megalite.device import device_type
from megalite.mpu import parallel_state as ps
from megalite.mpu.random import get_rng_tracker, model_parallel_seed


def rng_state() -> dict:
    """Python's, numpy's and the CPU generator's states, and under "device_type" the type of
    the device whose states follow: its default generator's ("cuda", on GPUs) and the
    model-parallel tracker's streams."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "cpu": torch.get_rng_state(), "device_type": get_rng_tracker().device_type,
             "tracker": get_rng_tracker().get_states()}
    if device_type() == "cuda":
        state["cuda"] = torch.cuda.get_rng_state()
    return state



def set_rng_state(state: dict) -> None:
    """Restore `rng_state()`. From a run on another device type (a checkpoint moved between
    CPU and GPU) only Python's and numpy's states: torch's generators keep their seeding from
    --seed, and rank 0 says so in one line."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    saved = state.get("device_type", "cpu")  # checkpoints before the tag come from CPU runs
    if saved != get_rng_tracker().device_type:
        if dist.get_rank() == 0:
            print(f"checkpoint RNG states are from a {saved} run, this run is on "
                  f"{get_rng_tracker().device_type}: torch's RNG streams start from --seed",
                  flush=True)
        return
    torch.set_rng_state(state["cpu"])
    get_rng_tracker().set_states(state["tracker"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])



def reseed(seed: int, iteration: int) -> None:
    """Deterministic RNG streams for a resume under another layout: --seed + iteration."""
    random.seed(seed + iteration)
    np.random.seed(seed + iteration)
    model_parallel_seed(seed + iteration, ps.get_tensor_model_parallel_rank(),
                        ps.get_pipeline_model_parallel_rank())
