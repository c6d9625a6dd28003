"""Index arrays cached as `.npy` files, built once by one rank.

The cache key is a hash of a JSON description of everything the arrays depend on.
The builder rank writes each file atomically (temporary name, then rename); every
rank then calls `barrier()` once and memory-maps the files. torch.distributed is
never imported here: training code passes `torch.distributed.barrier`.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable

import numpy as np


def cache_key(description: dict) -> str:
    """Hex digest identifying `description` (JSON-serialisable)."""
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:32]


def cached_indices(cache_dir: str | None, description: dict, names: tuple[str, ...],
                   build: Callable[[], dict[str, np.ndarray]], is_builder_rank: bool = True,
                   barrier: Callable[[], None] = lambda: None) -> dict[str, np.ndarray]:
    """Arrays `names` for `description`: loaded from `cache_dir` if present, else made
    by `build()` on the builder rank and saved. With `cache_dir=None` every rank builds
    in memory. All ranks must call this together (it calls `barrier()` exactly once)."""
    if cache_dir is None:
        barrier()
        return build()
    prefix = os.path.join(cache_dir, f"{description['kind']}-{cache_key(description)}")
    paths = {name: f"{prefix}-{name}.npy" for name in names}
    if is_builder_rank and not all(map(os.path.isfile, paths.values())):
        os.makedirs(cache_dir, exist_ok=True)
        arrays = build()
        for name, path in paths.items():
            tmp = f"{path}.tmp-{os.getpid()}.npy"
            np.save(tmp, arrays[name], allow_pickle=False)
            os.replace(tmp, path)
        with open(f"{prefix}-description.json", "w") as f:
            json.dump(description, f, indent=1, sort_keys=True)
    barrier()
    missing = [path for path in paths.values() if not os.path.isfile(path)]
    if missing:
        raise FileNotFoundError(f"{missing[0]}: index cache file missing after the builder rank's "
                                f"barrier (expected the builder rank to write it; is {cache_dir} "
                                f"shared by all ranks?)")
    return {name: np.load(path, mmap_mode="r", allow_pickle=False) for name, path in paths.items()}
