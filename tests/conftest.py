"""Shared test setup: offline Hugging Face; the device of single-process tests; the rank pools
(tests/helpers/multirank.py: one per world size, replaced when their workers accumulate threads) are
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
from tests.helpers.multirank import close_pools  # noqa: E402

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


@pytest.fixture(scope="session")
def smollm2_checkpoint(tmp_path_factory) -> str:
    """SmolLM2-135M-Instruct's GGUF converted once per session by tools/convert_checkpoint.py
    (megalite.hf; parsing and dequantising take seconds): a megalite weights checkpoint with
    the GGUF's tokenizer (chat template included). Tests only read it."""
    from megalite.hf import smollm2_gguf_path
    from tools import convert_checkpoint
    out = str(tmp_path_factory.mktemp("smollm2") / "ck")
    convert_checkpoint.main(["--direction", "hf-to-megalite", "--model-type", "llama",
                             "--input", smollm2_gguf_path(), "--output", out])
    return out


@pytest.fixture(scope="session")
def smollm2_state(smollm2_checkpoint, tmp_path_factory) -> str:
    """The weights of `smollm2_checkpoint` as one state file ranks memory-map
    (tests/helpers/smollm2.write_megalite_state)."""
    from tests.helpers.smollm2 import write_megalite_state
    return write_megalite_state(smollm2_checkpoint, str(tmp_path_factory.mktemp("smollm2_state")))
