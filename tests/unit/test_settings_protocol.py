from __future__ import annotations

import pickle
import sys
import types
from dataclasses import dataclass
from typing import Any

import pytest

from rlix_plugins.errors import ProtocolError, SettingsError
from rlix_plugins.protocol import (
    Priority,
    ProgressReport,
    cluster_id,
    coerce_priority,
    coerce_progress_report,
    new_pipeline_id,
    parse_cluster_id,
    pipeline_coordinator_actor,
    pipeline_namespace,
    progress_bucket,
)
from rlix_plugins.settings import ControlPlane, load_settings


def test_control_plane_values() -> None:
    assert load_settings({}).control_plane is ControlPlane.OFF
    assert not load_settings({"RLIX_CONTROL_PLANE": "off"}).enabled
    assert load_settings({"RLIX_CONTROL_PLANE": "rlix"}).enabled
    with pytest.raises(SettingsError, match=r"RLIX_CONTROL_PLANE='roll'.*'off', 'rlix'"):
        load_settings({"RLIX_CONTROL_PLANE": "roll"})


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"RLIX_LEASE_S": "soon"}, "RLIX_LEASE_S='soon' is not a number"),
        ({"RLIX_LEASE_S": "-1"}, "out of range"),
        ({"RLIX_RESIZE_TIMEOUT_S": "inf"}, "out of range"),
        # a lease of 1e-9 s made the heartbeat a busy loop
        ({"RLIX_LEASE_S": "1e-9"}, r"expected finite seconds >= 0.1"),
        ({"RLIX_REQUEST_TIMEOUT_S": "1e-300"}, r"expected finite seconds >= 0.1"),
        ({"RLIX_NAMESPACE": " "}, "RLIX_NAMESPACE is set but empty"),
        ({"RLIX_VLLM_SLEEP_LEVEL": "3"}, "expected 0, 1 or 2"),
        ({"RLIX_BACKGROUND_EXPANDS": "yes"}, r"RLIX_BACKGROUND_EXPANDS='yes'.*expected 0 .* or 1"),
    ],
)
def test_other_settings_are_validated(env: dict[str, str], needle: str) -> None:
    with pytest.raises(SettingsError, match=needle):
        load_settings(env)


def test_settings_values() -> None:
    s = load_settings({"RLIX_LEASE_S": "2.5", "RLIX_TRACE_DIR": "/tmp/t", "PIPELINE_ID": "ft_1"})
    assert (s.lease_s, str(s.trace_dir), s.pipeline_id) == (2.5, "/tmp/t", "ft_1")
    assert s.vllm_sleep_level == 2
    assert load_settings({"RLIX_VLLM_SLEEP_LEVEL": "1"}).vllm_sleep_level == 1
    assert not s.background_expands
    assert load_settings({"RLIX_BACKGROUND_EXPANDS": "1"}).background_expands


def test_names_match_rlix() -> None:
    pid = new_pipeline_id("ft")
    assert pid.startswith("ft_") and len(pid) == 15 and ":" not in pid
    assert pipeline_namespace("ft_1") == "pipeline_ft_1_NS"
    assert pipeline_coordinator_actor("ft_1") == "rlix:coordinator:ft_1"
    assert cluster_id("ft_abc", "actor_infer") == "ft_abc_actor_infer"
    assert parse_cluster_id("lora_x_y_actor_train") == ("lora_x_y", "actor_train")
    with pytest.raises(ProtocolError, match="known cluster name"):
        parse_cluster_id("ft_1_reward")
    with pytest.raises(ProtocolError):
        new_pipeline_id("full")
    assert [p.value for p in Priority] == list(range(7))


def test_progress_bucket() -> None:
    assert [progress_bucket(c, 100) for c in (0, 1, 2, 99, 100, 150)] == [0, 0, 1, 49, 50, 50]


def test_progress_bucket_is_exact_where_floats_round_down() -> None:
    # 29/50 * 50 is 28.999... in floating point: the 58% report landed in bucket 28 and the
    # throttle dropped it as a repeat of 28/50.
    assert progress_bucket(29, 50) == 29
    for target in range(1, 400):
        for completed in range(target + 1):
            assert progress_bucket(completed, target) == completed * 50 // target


def test_reports_from_rlix_module_path_are_accepted_by_fields(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A class of RLix's own module path, pickled and unpickled as ROLL would send it.
    mod = types.ModuleType("rlix.protocol.types")

    @dataclass(frozen=True)
    class RlixProgressReport:
        pipeline_id: str
        step_target_trajectories: int
        fifo_timestamp: float | None = None
        metrics: dict[str, Any] | None = None

    RlixProgressReport.__module__ = "rlix.protocol.types"
    RlixProgressReport.__qualname__ = "ProgressReport"
    mod.ProgressReport = RlixProgressReport  # type: ignore[attr-defined]
    for name in ("rlix", "rlix.protocol", "rlix.protocol.types"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "rlix.protocol.types", mod)
    theirs = pickle.loads(
        pickle.dumps(RlixProgressReport("ft_1", 64, 3.0, {"completed": 80, "bucket": 50}))
    )
    ours = coerce_progress_report(theirs)
    assert isinstance(ours, ProgressReport)
    assert (ours.completed, ours.remaining, ours.fifo_timestamp) == (64, 0, 3.0)
    with pytest.raises(ProtocolError, match="lacks field 'step_target_trajectories'"):
        coerce_progress_report(types.SimpleNamespace(pipeline_id="ft_1"))
    with pytest.raises(ProtocolError, match="completed"):
        coerce_progress_report(
            {"pipeline_id": "ft_1", "step_target_trajectories": 1, "metrics": {"completed": -1}}
        )
    assert coerce_priority(6) is Priority.GENERATION
    with pytest.raises(ProtocolError, match="INITIALIZATION=0"):
        coerce_priority(9)
