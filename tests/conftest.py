"""Shared test setup: offline Hugging Face; the rank pools (tests/multirank.py: one per world
size, replaced when their workers accumulate threads) are closed at the end of the session."""
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from tests.multirank import close_pools  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _rank_pools():
    yield
    close_pools()
