"""The scheduler's wire log (what each pipeline sent) and gate 3's roll_protocol criterion."""

from __future__ import annotations

import asyncio
import enum
from typing import Any

import pytest

from rlix_plugins.coordinator.service.wire_log import (
    UNKNOWN_CALLER,
    PipelineWire,
    WireLog,
    caller_of,
    format_wire,
    on_wire,
)
from rlix_plugins.errors import ProtocolError
from rlix_plugins.gates.criteria import RLIX_PRIORITY_CLASS, roll_protocol
from rlix_plugins.protocol.types import Priority, ProgressReport

OURS = "rlix_plugins.protocol.types.Priority"


class _Service:
    """The decorator's host: a wire log and protocol methods, like the scheduler actor."""

    def __init__(self, log: WireLog | None = None) -> None:
        self.wire_log = log or WireLog()

    @on_wire("report_progress")
    async def report_progress(self, report: Any) -> None:
        del report

    @on_wire("request_gpus")
    async def request_gpus(self, *, cluster_id: str, priority: Any) -> list[int]:
        if int(priority) == Priority.GENERATION:
            raise ProtocolError(f"{cluster_id} is not a generation cluster")
        return [0]

    @on_wire("unregister_pipeline")
    async def unregister_pipeline(self, pipeline_id: str) -> tuple[int, ...]:
        del pipeline_id
        return ()


def test_calls_are_counted_by_argument_name_positional_or_keyword() -> None:
    svc = _Service()
    pid = "ft_wire00000001"
    report = ProgressReport(pid, 8, 1.0, {"completed": 2})
    asyncio.run(svc.report_progress(report))  # positional, as ROLL sends it
    asyncio.run(svc.request_gpus(cluster_id=f"{pid}_actor_train", priority=Priority.ACTOR_TRAINING))
    asyncio.run(svc.unregister_pipeline(pid))  # positional pipeline_id
    wire = svc.wire_log.snapshot()[pid]
    assert wire.calls == {"report_progress": 1, "request_gpus": 1, "unregister_pipeline": 1}
    assert wire.report_classes == {"rlix_plugins.protocol.types.ProgressReport": 1}
    assert wire.priority_classes == {OURS: 1}
    assert wire.priorities == {"request_gpus: ACTOR_TRAINING": 1}
    assert wire.requested("ACTOR_TRAINING") == 1 and wire.requested("GENERATION") == 0
    assert wire.failures == {} and wire.failed() == 0


def test_a_failed_call_is_counted_and_its_error_reaches_the_caller_unchanged() -> None:
    svc = _Service()
    cid = "ft_wire00000002_actor_train"
    with pytest.raises(ProtocolError, match="not a generation cluster"):
        asyncio.run(svc.request_gpus(cluster_id=cid, priority=Priority.GENERATION))
    with pytest.raises(TypeError):  # a call that cannot even bind is counted too
        asyncio.run(svc.request_gpus(cluster_id=cid))  # type: ignore[call-arg]
    wire = svc.wire_log.snapshot()["ft_wire00000002"]
    assert wire.calls == {"request_gpus": 2}
    assert wire.failures == {"request_gpus: ProtocolError": 1, "request_gpus: TypeError": 1}
    assert wire.priorities == {"request_gpus: GENERATION": 1}


def test_an_unreadable_priority_is_labelled_invalid() -> None:
    log = WireLog()
    log.received("request_gpus", {"cluster_id": "ft_wire00000003_actor_train", "priority": 99})
    wire = log.snapshot()["ft_wire00000003"]
    assert wire.priorities == {"request_gpus: invalid": 1}
    assert wire.priority_classes == {"builtins.int": 1}


@pytest.mark.parametrize(
    ("kwargs", "caller"),
    [
        ({"pipeline_id": "ft_a", "cluster_id": "ft_b_actor_train"}, "ft_a"),
        ({"report": ProgressReport("ft_c", 1)}, "ft_c"),
        ({"report": {"pipeline_id": "ft_d", "step_target_trajectories": 1}}, "ft_d"),
        ({"release_cluster_id": "ft_e_actor_train", "request_cluster_id": "x"}, "ft_e"),
        ({"request_cluster_id": "ft_f_actor_infer"}, "ft_f"),
        ({"cluster_id": "ft_g_policy"}, UNKNOWN_CALLER),  # not a cluster id
        ({"pipeline_id": None, "report": object()}, UNKNOWN_CALLER),
        ({}, UNKNOWN_CALLER),
    ],
)
def test_caller_of_reads_the_pipeline_a_call_speaks_for(kwargs: dict[str, Any],
                                                         caller: str) -> None:
    assert caller_of(kwargs) == caller


def test_the_least_recently_heard_pipeline_is_forgotten_first() -> None:
    log = WireLog(max_pipelines=2)
    for pid in ("ft_one", "ft_two", "ft_one", "ft_three"):
        log.received("clear_progress", {"pipeline_id": pid})
    snap = log.snapshot()
    assert sorted(snap) == ["ft_one", "ft_three"]
    assert snap["ft_one"].calls == {"clear_progress": 2}
    with pytest.raises(ValueError, match="max_pipelines must be >= 1"):
        WireLog(max_pipelines=0)


def test_a_snapshot_is_a_copy() -> None:
    log = WireLog()
    log.received("clear_progress", {"pipeline_id": "ft_copy"})
    before = log.snapshot()
    log.received("clear_progress", {"pipeline_id": "ft_copy"})
    assert before["ft_copy"].calls == {"clear_progress": 1}
    assert log.snapshot()["ft_copy"].calls == {"clear_progress": 2}


# ---------------------------------------------------------------- roll_protocol (gate 3)


class _RlixPriority(enum.IntEnum):
    """Stands in for RLix's enum: same values, RLix's module path (as unpickled)."""

    INITIALIZATION = 0
    ACTOR_TRAINING = 1
    OLD_LOG_PROBS = 3
    GENERATION = 6


_RlixPriority.__module__ = "rlix.protocol.types"
_RlixPriority.__qualname__ = "Priority"


def _roll_calls(log: WireLog, pid: str) -> None:
    """ROLL's sequence for one step (protocol.md), priorities in RLix's class."""
    train, infer = f"{pid}_actor_train", f"{pid}_actor_infer"
    log.received("register_pipeline", {"pipeline_id": pid})
    log.received("request_gpus", {"cluster_id": train, "priority": _RlixPriority.INITIALIZATION})
    log.received("notify_release_gpus", {"cluster_id": train})
    log.received("notify_release_then_request_gpus", {
        "release_cluster_id": train, "request_cluster_id": infer,
        "request_priority": _RlixPriority.GENERATION})
    log.received("report_progress", {"report": ProgressReport(pid, 8)})
    log.received("request_gpus", {"cluster_id": train, "priority": _RlixPriority.ACTOR_TRAINING})


def _nemo_calls(log: WireLog, pid: str) -> None:
    log.received("request_gpus", {"cluster_id": f"{pid}_actor_train",
                                  "priority": Priority.ACTOR_TRAINING})
    log.received("report_progress", {"report": ProgressReport(pid, 8)})


def test_roll_protocol_passes_on_rolls_sequence_next_to_a_nemo_rl_pipeline() -> None:
    log = WireLog()
    _roll_calls(log, "ft_roll")
    _nemo_calls(log, "ft_nemo")
    result = roll_protocol(log.snapshot(), sender_module="rlix.protocol.types")
    assert result.passed, result.measured
    assert result.measured.startswith("ft_roll: 6 calls")
    assert "ft_nemo" not in result.measured


def _judged(mutate: Any, **kwargs: Any) -> str:
    log = WireLog()
    _roll_calls(log, "ft_roll")
    _nemo_calls(log, "ft_nemo")
    mutate(log)
    result = roll_protocol(log.snapshot(), **kwargs)
    assert not result.passed, result.measured
    return result.measured


def test_roll_protocol_fails_naming_what_is_missing_or_wrong() -> None:
    assert "ft_roll: refused or failed calls {'request_gpus: ProtocolError': 1}" in _judged(
        lambda log: log.raised("ft_roll", "request_gpus", ProtocolError("bad")))
    assert "ft_roll: priorities also of ['rlix_plugins.protocol.types.Priority']" in _judged(
        lambda log: log.received("request_gpus", {"cluster_id": "ft_roll_actor_train",
                                                  "priority": Priority.OLD_LOG_PROBS}))
    assert "2 pipeline(s) sent RLix's Priority class, expected 1" in _judged(
        lambda log: _roll_calls(log, "ft_roll2"))
    assert "the ROLL stand-in built its reports from rlix_plugins.protocol.types" in _judged(
        lambda log: None, sender_module="rlix_plugins.protocol.types")


def test_roll_protocol_needs_training_generation_reports_and_a_release() -> None:
    wire = {"ft_roll": PipelineWire(
        "ft_roll", {"request_gpus": 1}, {}, {}, {RLIX_PRIORITY_CLASS: 1},
        {"request_gpus: INITIALIZATION": 1})}
    measured = roll_protocol(wire).measured
    for gap in ("0 GENERATION requests for 1 step(s)", "no ACTOR_TRAINING request",
                "no progress report received", "no release received"):
        assert f"ft_roll: {gap}" in measured
    # one GENERATION request per step: a run that asked for fewer did not run its steps
    log = WireLog()
    _roll_calls(log, "ft_roll")
    short = roll_protocol(log.snapshot(), steps=2)
    assert not short.passed
    assert "ft_roll: 1 GENERATION requests for 2 step(s)" in short.measured
    empty = roll_protocol({})
    assert not empty.passed
    assert empty.measured == ("no ROLL pipeline; 0 pipeline(s) sent RLix's Priority class, "
                              "expected 1")


def test_format_wire_prints_a_block_per_pipeline() -> None:
    log = WireLog()
    _roll_calls(log, "ft_roll")
    log.raised("ft_roll", "request_gpus", ProtocolError("bad"))
    text = format_wire(log.snapshot())
    assert text.splitlines() == [
        "ft_roll: 6 calls, 1 failed",
        "  calls: notify_release_gpus 1, notify_release_then_request_gpus 1, "
        "register_pipeline 1, report_progress 1, request_gpus 2",
        "  failures: request_gpus: ProtocolError 1",
        "  report classes: rlix_plugins.protocol.types.ProgressReport 1",
        "  priority classes: rlix.protocol.types.Priority 3",
        "  priorities: notify_release_then_request_gpus: GENERATION 1, "
        "request_gpus: ACTOR_TRAINING 1, request_gpus: INITIALIZATION 1",
    ]
    assert format_wire({}) == "no protocol calls received"


def test_failures_reach_the_hook_and_a_failing_hook_never_changes_the_callers_error() -> None:
    seen: list[tuple[str, str]] = []
    svc = _Service(WireLog(on_failure=lambda m, e: seen.append((m, e))))
    cid = "ft_wire00000004_actor_train"
    with pytest.raises(ProtocolError):
        asyncio.run(svc.request_gpus(cluster_id=cid, priority=Priority.GENERATION))
    assert seen == [("request_gpus", "ProtocolError")]

    def broken(method: str, error: str) -> None:
        raise RuntimeError("metrics down")

    svc = _Service(WireLog(on_failure=broken))
    with pytest.raises(ProtocolError, match="not a generation cluster"):
        asyncio.run(svc.request_gpus(cluster_id=cid, priority=Priority.GENERATION))
    assert svc.wire_log.snapshot()["ft_wire00000004"].failures == {
        "request_gpus: ProtocolError": 1}
