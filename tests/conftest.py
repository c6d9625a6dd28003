"""Shared test setup: offline Hugging Face, one rank pool per world size per session."""
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from tests.multirank import close_pools  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _rank_pools():
    yield
    close_pools()
