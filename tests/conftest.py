"""Shared test setup: offline Hugging Face; the device of single-process tests; the rank pools
(tests/multirank.py: one per world size, replaced when their workers accumulate threads) are
closed at the end of the session.

Device: single-process tests that compute take the `device` fixture, code that runs on ranks
builds on `megalite.device.current_device()`: the rank's GPU on a GPU machine (CUDA + NCCL),
else the CPU. On CUDA this process computes in IEEE fp32 (TF32 off) with deterministic
kernels, like the rank pools' workers.
"""
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from megalite.device import current_device, set_tf32, use_deterministic_kernels  # noqa: E402
from tests.multirank import close_pools  # noqa: E402

set_tf32(False)
use_deterministic_kernels()


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where single-process tests build layers and tensors: the GPU if there is one."""
    return current_device()


@pytest.fixture(scope="session", autouse=True)
def _rank_pools():
    yield
    close_pools()
