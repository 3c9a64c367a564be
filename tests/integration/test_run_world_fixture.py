"""The gloo world fixture itself: results by rank, a failing rank's traceback, a dead rank."""

from __future__ import annotations

import os

import pytest

from tests.fixtures.distributed import run_world

pytestmark = pytest.mark.integration


def _rank_times_ten(rank: int, world_size: int) -> int:
    import torch.distributed as dist

    t = __import__("torch").tensor([rank + 1])
    dist.all_reduce(t)  # a real collective: the world is really formed
    return rank * 10 + int(t.item()) * 100


def _raise_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def _exit_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(7)  # no result, no traceback: like a segfault or an OOM kill
    import time

    time.sleep(120)  # rank 0 would wait for its peer; the fixture must not wait for it
    return rank


def test_results_come_back_by_rank() -> None:
    assert run_world(_rank_times_ten, 2) == [300, 310]


def test_failing_rank_reports_its_traceback() -> None:
    with pytest.raises(pytest.fail.Exception, match=r"(?s)rank 1 failed:.*boom on rank 1"):
        run_world(_raise_on_rank_one, 2)


def test_dead_rank_fails_with_its_exit_code_not_the_timeout() -> None:
    # timeout_s is far beyond the sleeping rank's 120 s: only the liveness check can end it early.
    with pytest.raises(pytest.fail.Exception, match="rank 1: exit code 7"):
        run_world(_exit_on_rank_one, 2, timeout_s=600)
