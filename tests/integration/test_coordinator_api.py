"""The wire API: typed errors that leave state unchanged, RLix's own classes, ownership."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import ray

from rlix_plugins.errors import (
    OwnershipError,
    ProtocolError,
    RegistrationError,
    RequestStateError,
    UnknownClusterError,
    UnknownPipelineError,
)
from rlix_plugins.gates.roll_sequence import RLIX_TYPES_SOURCE
from rlix_plugins.protocol.names import pipeline_namespace
from tests.support.roll_pipeline import GpuLedger, RollPipelineDriver

pytestmark = pytest.mark.integration



def _register(plane: Any, pid: str, tps: dict[str, Any], maps: dict[str, Any]) -> None:
    ray.get(
        plane.orchestrator.register_pipeline.remote(
            pipeline_id=pid,
            ray_namespace=pipeline_namespace(pid),
            cluster_tp_configs=tps,
            cluster_device_mappings=maps,
        )
    )


MALFORMED = [
    ({"actor_train": 3}, {"actor_train": [0, 1, 2]}, "tp=3"),
    ({"actor_train": 1}, {"actor_train": [1, 0]}, "sorted"),
    ({"actor_train": 1}, {"actor_train": [7, 8]}, "outside"),
    ({"actor_train": 1}, {"policy": [0]}, "unknown cluster"),
    ({}, {"actor_train": [0]}, "no tp config"),
    ({"actor_infer": 2}, {"actor_infer": [0, 2]}, "not contiguous"),
    ({"actor_train": 1}, {"actor_train": []}, "non-empty"),
]


def test_bad_calls_get_typed_errors_and_leave_state_unchanged(coordinator: Any) -> None:
    sched = coordinator.scheduler
    _register(
        coordinator,
        "ft_good00000001",
        {"actor_train": 1, "actor_infer": 1},
        {"actor_train": [0], "actor_infer": [0, 1]},
    )
    ray.get(sched.request_gpus.remote(cluster_id="ft_good00000001_actor_train", priority=0))
    before = coordinator.status()
    for tps, maps, match in MALFORMED:
        with pytest.raises(RegistrationError, match=match):
            _register(coordinator, "ft_bad000000001", tps, maps)
    with pytest.raises(RegistrationError, match="already registered"):
        _register(coordinator, "ft_good00000001", {"actor_train": 1}, {"actor_train": [3]})
    with pytest.raises(RegistrationError, match="invalid characters"):
        _register(coordinator, "ft:bad", {"actor_train": 1}, {"actor_train": [3]})
    # (typed error, the bad value its message must name, call): the type alone cannot tell
    # the intended check from any other failure of the same class.
    calls = [
        (
            UnknownClusterError,
            "cluster 'ft_nobody000001_actor_train' is not registered",
            sched.request_gpus.remote(cluster_id="ft_nobody000001_actor_train", priority=1),
        ),
        (
            ProtocolError,
            "cluster_id 'ft_good00000001_policy' does not end in a known cluster name",
            sched.request_gpus.remote(cluster_id="ft_good00000001_policy", priority=1),
        ),
        (
            ProtocolError,
            r"priority 9 .* is not valid",
            sched.request_gpus.remote(cluster_id="ft_good00000001_actor_train", priority=9),
        ),
        (
            RequestStateError,
            "cluster 'ft_good00000001_actor_train' is not a generation cluster",
            sched.request_gpus.remote(cluster_id="ft_good00000001_actor_train", priority=6),
        ),
        (
            OwnershipError,
            "pipeline 'ft_other0000001' may not act on cluster 'ft_good00000001_actor_train'",
            sched.notify_release_gpus.remote(
                cluster_id="ft_good00000001_actor_train", pipeline_id="ft_other0000001"
            ),
        ),
        (
            UnknownClusterError,
            "cluster 'ft_nobody000001_actor_infer' is not registered",
            sched.notify_release_gpus.remote(cluster_id="ft_nobody000001_actor_infer"),
        ),
        (
            UnknownClusterError,
            "cluster 'ft_nobody000001_actor_infer' is not registered",
            sched.await_release_gpus.remote(cluster_id="ft_nobody000001_actor_infer"),
        ),
        (
            RequestStateError,
            "generation clusters only, got 'ft_good00000001_actor_train'",
            sched.await_release_gpus.remote(cluster_id="ft_good00000001_actor_train"),
        ),
        (
            ProtocolError,
            "lacks field 'step_target_trajectories'",
            sched.report_progress.remote({"pipeline_id": "ft_good00000001"}),
        ),
        (
            UnknownPipelineError,
            "pipeline 'ft_nobody000001' is not registered",
            sched.report_progress.remote(
                {"pipeline_id": "ft_nobody000001", "step_target_trajectories": 4}
            ),
        ),
        (
            UnknownPipelineError,
            "pipeline 'ft_nobody000001' is not registered",
            sched.heartbeat.remote("ft_nobody000001"),
        ),
        (
            UnknownPipelineError,
            "pipeline 'ft_nobody000001' is not registered",
            coordinator.orchestrator.admit_pipeline.remote(pipeline_id="ft_nobody000001"),
        ),
        (
            OwnershipError,
            "pipeline 'ft_other0000001' may not act on cluster 'ft_good00000001_actor_train'",
            sched.notify_release_then_request_gpus.remote(
                release_cluster_id="ft_good00000001_actor_train",
                release_global_step=0,
                request_cluster_id="ft_good00000001_actor_infer",
                request_priority=6,
                pipeline_id="ft_other0000001",
            ),
        ),
    ]
    for error, match, ref in calls:
        with pytest.raises(error, match=match):
            ray.get(ref)
    after = coordinator.status()
    assert after == before
    # The wire log counts every call by the pipeline it speaks for, refusals by error type.
    wire = ray.get(sched.get_wire_log.remote())
    good = wire["ft_good00000001"]
    assert good.calls == {"register_pipeline": 2, "request_gpus": 3, "await_release_gpus": 1,
                          "report_progress": 1}
    assert good.failures == {
        "register_pipeline: RegistrationError": 1,
        "request_gpus: ProtocolError": 1,
        "request_gpus: RequestStateError": 1,
        "await_release_gpus: RequestStateError": 1,
        "report_progress: ProtocolError": 1,
    }
    assert good.priorities == {"request_gpus: INITIALIZATION": 1, "request_gpus: invalid": 1,
                               "request_gpus: GENERATION": 1}
    assert wire["ft_other0000001"].failures == {
        "notify_release_gpus: OwnershipError": 1,
        "notify_release_then_request_gpus: OwnershipError": 1,
    }
    assert wire["ft_nobody000001"].failures["admit_pipeline: UnknownPipelineError"] == 1
    # RLix's shutdown ends every pipeline's scheduling but leaves Ray (and us) running.
    assert ray.get(coordinator.orchestrator.shutdown.remote(reason="test")) == 1
    assert coordinator.status().pipelines == ()
    assert coordinator.status().idle_gpus == tuple(range(8))


def test_rlix_own_progress_report_class_is_accepted(
    coordinator: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # RLix's module exists only on this driver's sys.path: the coordinator processes cannot
    # import it and must still read the instances ROLL pickles by reference.
    pkg = tmp_path / "rlixsrc" / "rlix" / "protocol"
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "types.py").write_text(RLIX_TYPES_SOURCE)  # the gate's stand-in of RLix's module
    monkeypatch.syspath_prepend(str(tmp_path / "rlixsrc"))
    for name in [m for m in sys.modules if m == "rlix" or m.startswith("rlix.")]:
        monkeypatch.delitem(sys.modules, name)
    from rlix.protocol.types import Priority as RlixPriority  # type: ignore[import-not-found]
    from rlix.protocol.types import ProgressReport as RlixReport

    assert RlixReport.__module__ == "rlix.protocol.types"
    sched = coordinator.scheduler
    pid = "ft_rlixreport01"
    _register(coordinator, pid, {"actor_infer": 1}, {"actor_infer": [4, 5]})
    ray.get(
        sched.report_progress.remote(
            RlixReport(pid, 40, 1.0, {"mode": "train", "completed": 10, "bucket": 12})
        )
    )
    assert coordinator.status().pipeline(pid).demand == 30  # type: ignore[union-attr]
    ray.get(sched.report_progress.remote(RlixReport(pid, 40, 2.0, {"collected": 35})))
    assert coordinator.status().pipeline(pid).demand == 5  # type: ignore[union-attr]
    # RLix's Priority enum also arrives by reference and is read by value.
    ray.get(sched.clear_progress.remote(pipeline_id=pid))
    ledger = GpuLedger.remote()
    driver = RollPipelineDriver(
        coordinator, ledger, train=[2], infer=[2, 3], steps=2, report_cls=RlixReport
    )
    driver.setup()
    gpus = ray.get(
        sched.request_gpus.remote(
            cluster_id=driver.train_cluster, priority=RlixPriority.INITIALIZATION
        )
    )
    assert gpus == [2]
    ray.get(sched.notify_release_gpus.remote(cluster_id=driver.train_cluster))
    result = driver.run()  # progress goes through the pipeline coordinator actor too
    assert result.error is None, repr(result.error)
    assert result.steps_done == 2
    # The scheduler saw RLix's classes as RLix's (by their module path), and refused nothing.
    wire = ray.get(sched.get_wire_log.remote())
    assert wire[pid].report_classes == {"rlix.protocol.types.ProgressReport": 2}
    assert wire[pid].failures == {}
    assert wire[driver.pipeline_id].priority_classes["rlix.protocol.types.Priority"] == 1
    assert wire[driver.pipeline_id].failures == {}
