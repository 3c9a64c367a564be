"""Settings built in code (not by ``load_settings``) are checked as the environment is.

``Settings`` compares its control plane by identity, so a plane given by its value
(``Settings(control_plane="rlix")``) silently ran standalone: ``make_hooks`` handed out no-op
hooks and the job never asked the coordinator for its GPUs. Timeouts and the lease were not
checked either (a lease of 0 made the heartbeat a busy loop).
"""

from __future__ import annotations

from typing import Any

import pytest

from rlix_plugins.errors import SettingsError
from rlix_plugins.hooks import make_hooks
from rlix_plugins.hooks.coordinator_hooks import CoordinatorHooks
from rlix_plugins.settings import ControlPlane, Settings, load_settings


@pytest.mark.parametrize("value", ["rlix", "RLIX", " rlix "])
def test_a_control_plane_given_by_value_turns_time_sharing_on(value: str) -> None:
    settings = Settings(control_plane=value)  # type: ignore[arg-type]
    assert settings.control_plane is ControlPlane.RLIX and settings.enabled
    hooks = make_hooks(settings, pipeline_id="ft_settings001", scheduler=object(),
                       heartbeat=False)
    assert isinstance(hooks, CoordinatorHooks)


def test_off_given_by_value_stays_off() -> None:
    assert Settings(control_plane="off").control_plane is ControlPlane.OFF  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs, needle", [
    ({"control_plane": "rlx"}, "Settings.control_plane='rlx' is not valid; expected one of "
                               "'off', 'rlix'"),
    ({"control_plane": None}, "Settings.control_plane=None"),
    ({"lease_s": 0}, "Settings.lease_s=0 is out of range; expected finite seconds >= 0.1"),
    ({"request_timeout_s": float("nan")}, "Settings.request_timeout_s=nan"),
    ({"resize_timeout_s": float("inf")}, "Settings.resize_timeout_s=inf"),
    ({"lease_s": True}, "Settings.lease_s=True"),
    ({"request_timeout_s": "60"}, "Settings.request_timeout_s='60'"),
    ({"vllm_sleep_level": 3}, "Settings.vllm_sleep_level=3 is not valid; expected 0, 1 or 2"),
    ({"vllm_sleep_level": True}, "Settings.vllm_sleep_level=True"),
])
def test_a_bad_value_in_code_is_refused_by_name(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(SettingsError) as err:
        Settings(**kwargs)
    assert needle in str(err.value)


def test_the_environment_path_is_unchanged() -> None:
    s = load_settings({"RLIX_CONTROL_PLANE": "Rlix", "RLIX_LEASE_S": "3"})
    assert s.control_plane is ControlPlane.RLIX and s.lease_s == 3.0
    with pytest.raises(SettingsError, match="RLIX_CONTROL_PLANE='x' is not valid; expected "
                                            "unset or one of 'off', 'rlix'"):
        load_settings({"RLIX_CONTROL_PLANE": "x"})
    assert Settings(lease_s=5).lease_s == 5.0  # an int number of seconds is fine
