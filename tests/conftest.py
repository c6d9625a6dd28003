"""Shared test setup: offline Hugging Face, one rank pool per world size per test module.

Pools are closed after each module: every process group a test creates leaves gloo threads
behind in the pool's workers (destroy_process_group does not stop them all, and some keep
polling), so pools kept for the whole session slowed the suite several-fold.
"""
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from tests.multirank import close_pools  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _rank_pools():
    yield
    close_pools()
