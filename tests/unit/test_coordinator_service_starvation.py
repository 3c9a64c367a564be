"""The starvation guard through the scheduler service: a pipeline left without a rank by shares
that never move shows in the status as starving and gets one rank after ``starve_after_s``
(Ray-free service from tests/fixtures/scheduler_service.py; FAKE pipeline coordinators)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from rlix_plugins.coordinator.core import PolicyConfig, Topology
from rlix_plugins.coordinator.core.status import CoordinatorStatus
from rlix_plugins.protocol import Priority, ProgressReport
from tests.fixtures.scheduler_service import (
    FakePipelineCoordinator,
    ServiceBuilder,
    register_pipeline,
)

A, B, C = "ft_donor0000001", "ft_starved00001", "ft_chainend0001"


def _infer(status: CoordinatorStatus, pid: str) -> tuple[tuple[int, ...], float | None]:
    p = status.pipeline(pid)
    assert p is not None
    [infer] = p.clusters
    return infer.active_ranks, infer.starving_s


def test_a_pipeline_starved_by_a_chain_of_spans_gets_a_rank_after_starve_after_s(
    scheduler_service: ServiceBuilder,
    fake_coordinators: dict[str, FakePipelineCoordinator],
    tmp_path: Path,
) -> None:
    """The chain of ``tests.core_builders.chain_of_spans``: A and B share GPUs 0-3, C maps
    3-11 and holds one rank; the idle GPUs only C reaches keep A at its target. Noted on
    cycles with nothing to commit, B's starving record is saved at once (a restart must not
    restart its clock)."""

    def saved_starving() -> dict[str, float]:
        record = json.loads((tmp_path / "scheduler_state.json").read_text())
        starving: dict[str, float] = record["state"]["starving_since"]
        return starving

    async def go() -> None:
        service = scheduler_service(
            topology=Topology(1, 12), policy=PolicyConfig(starve_after_s=1.0)
        )
        await register_pipeline(service, A, infer=[0, 1, 2, 3])
        await register_pipeline(service, B, infer=[0, 1, 2, 3])
        await register_pipeline(service, C, infer=list(range(3, 12)))
        await service.report_progress(ProgressReport(A, 24, None, {"completed": 0}))
        await service.request_gpus(cluster_id=f"{C}_actor_infer", priority=Priority.GENERATION)
        await asyncio.sleep(0.3)
        assert _infer(await service.get_status(), A) == ((0, 1, 2, 3), None)
        await service.report_progress(ProgressReport(B, 8, None, {"completed": 0}))
        await asyncio.sleep(0.3)
        ranks, starving = _infer(await service.get_status(), B)
        assert ranks == () and starving is not None and 0 < starving < 1.0
        assert list(saved_starving()) == [f"{B}_actor_infer"]
        deadline = time.monotonic() + 10
        while not _infer(await service.get_status(), B)[0]:
            assert time.monotonic() < deadline, "the starved pipeline never got a rank"
            await asyncio.sleep(0.05)
        status = await service.get_status()
        (rank,), starving = _infer(status, B)
        assert starving is None and set(_infer(status, A)[0]) == {0, 1, 2, 3} - {rank}
        shrink = {"dp_ranks_to_add": [], "dp_ranks_to_remove": [rank]}
        assert fake_coordinators[A].calls[-1] == shrink
        names = [e["name"] for e in (await service.get_trace())["traceEvents"]]
        assert f"starvation: {A}_actor_infer[{rank}]" in names
        assert saved_starving() == {}
        await service.stop()

    asyncio.run(asyncio.wait_for(go(), 60))
