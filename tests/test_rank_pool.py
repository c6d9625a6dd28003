"""megalite.distributed.rank_pool: results in rank order, and bounded failure (traceback, timeout)."""
import time

import pytest
import torch
import torch.distributed as dist

from megalite.device import current_device
from megalite.distributed.rank_pool import RankPool


def _rank_and_sum() -> tuple[int, float]:
    value = torch.tensor([float(dist.get_rank() + 1)], device=current_device())
    dist.all_reduce(value)
    return dist.get_rank(), value.item()


def _fail_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank one refuses")


def _stall_on_rank_one() -> None:
    if dist.get_rank() == 1:
        time.sleep(60)


def test_results_in_rank_order_then_failure_reports_traceback():
    pool = RankPool(2)
    try:
        assert pool.run(_rank_and_sum) == [(0, 3.0), (1, 3.0)]  # 1 + 2, summed on the group
        with pytest.raises(AssertionError, match="(?s)_fail_on_rank_one failed on rank 1 of 2"
                                                 ".*ValueError: rank one refuses"):
            pool.run(_fail_on_rank_one)
        assert not pool.alive()  # killed at once, not left waiting
    finally:
        pool.close(kill=True)


def test_silent_rank_times_out_by_name():
    pool = RankPool(2)
    try:
        pool.run(_rank_and_sum)  # both ranks up, so only the stalled one can be late
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"ranks \[1\] gave no answer within 3 s"):
            pool.run(_stall_on_rank_one, timeout=3)
        assert time.monotonic() - start < 30
        assert not pool.alive()
    finally:
        pool.close(kill=True)
