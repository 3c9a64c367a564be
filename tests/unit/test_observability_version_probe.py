"""The weight-version probe of in-process vLLM engines reads every worker of a shard.

A shard with TP > 1 has one worker per GPU, each with its own receiver; a selective sync that
failed on one of them leaves that worker on an older version (or none). The probe read only
worker 0's ``rlix_weight_version``, so such a shard was recorded as serving the trainer's
version and gate 1's "every active shard serves the current version" passed on mixed weights.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from rlix_plugins.adapters.observability import collective_rpc_version_probe


class FakeTpEngine:
    """FAKE in-process ``AsyncLLM``: ``collective_rpc`` answers one reply per worker (what
    vLLM returns), here the versions a real engine's receivers would report (a TP=2 engine
    cannot run on this machine)."""

    def __init__(self, worker_versions: Sequence[int | None]) -> None:
        self.worker_versions = list(worker_versions)

    async def collective_rpc(self, method: str) -> list[int | None]:
        assert method == "rlix_weight_version"
        return list(self.worker_versions)


@pytest.mark.parametrize(
    ("workers", "expected"),
    [
        ([4, 4], 4),        # every worker synced version 4
        ([4, None], None),  # worker 1's sync failed: it holds no complete version
        ([4, 3], None),     # worker 1 still serves version 3
        ([None, 4], None),
    ],
)
def test_a_shard_reports_a_version_only_when_every_worker_holds_it(
    workers: list[int | None], expected: int | None
) -> None:
    probe = collective_rpc_version_probe([FakeTpEngine([4]), FakeTpEngine(workers)])
    assert asyncio.run(probe([0, 1])) == {0: 4, 1: expected}
