"""A veRL shrink's waits share the coordinator's resize timeout (``ShrinkBudget``).

The coordinator fences a pipeline whose ``resize_infer`` fails or outlasts
``RLIX_RESIZE_TIMEOUT_S``, so the preempt's retries under a refresh claim and the sleep's wait
for a refresh hold must each give up before that timeout, and an abandoned claim must expire
before the preempt gives up. No veRL import: the controller is built over plain handles that
are never called.
"""

from __future__ import annotations

import math

import pytest

from rlix_plugins.adapters.shard_controller import _lifecycle_engines
from rlix_plugins.adapters.verl import make_shard_controller
from rlix_plugins.adapters.verl_shards import (
    DEFAULT_SHRINK_BUDGET,
    HOLD_WAIT_S,
    REFRESH_WAIT_S,
    ShrinkBudget,
)
from rlix_plugins.errors import RefreshHoldError, SettingsError, ShardStateError
from rlix_plugins.generation.preemption import PreemptionConfig
from rlix_plugins.settings import Settings


@pytest.mark.parametrize(("timeout", "drain"), [(120.0, 30.0), (31.0, 30.0), (600.0, 5.0)])
def test_waits_fit_the_resize_timeout(timeout: float, drain: float) -> None:
    b = ShrinkBudget.within(timeout, drain)
    assert 0 < b.claim_s < b.hold_wait_s  # an abandoned claim expires before the preempt gives up
    # delayed by a claim (until it ends or expires), then the drain, then a refresh hold
    assert b.claim_s + drain + b.refresh_wait_s <= timeout
    assert b.hold_wait_s + drain <= timeout and b.refresh_wait_s + drain <= timeout


def test_defaults_are_the_default_timeouts_budget() -> None:
    budget = ShrinkBudget.within(Settings().resize_timeout_s, PreemptionConfig().drain_timeout_s)
    assert budget == DEFAULT_SHRINK_BUDGET
    assert (budget.hold_wait_s, budget.refresh_wait_s) == (HOLD_WAIT_S, REFRESH_WAIT_S)
    # before: each wait alone was the whole 120 s timeout, so the coordinator fenced first
    assert Settings().resize_timeout_s > REFRESH_WAIT_S and HOLD_WAIT_S < REFRESH_WAIT_S


@pytest.mark.parametrize(
    ("timeout", "drain", "match"),
    [
        (30.0, 30.0, "RLIX_RESIZE_TIMEOUT_S=30s leaves no time"),
        (10.0, 30.0, "raise the timeout above the drain bound"),
        (0, 30.0, "resize_timeout_s"),
        (120.0, -1.0, "drain_timeout_s"),
        (math.nan, 30.0, "resize_timeout_s"),
        ("120", 30.0, "resize_timeout_s"),
    ],
)
def test_a_timeout_without_room_is_a_typed_error(timeout: object, drain: float, match: str) -> None:
    with pytest.raises(SettingsError, match=match):
        ShrinkBudget.within(timeout, drain)  # type: ignore[arg-type]


def _controller(settings: Settings, preemption: PreemptionConfig | None = None) -> object:
    # handles are stored, never called, while the controller is built
    return make_shard_controller(
        object(), [[object()], [object()]], lambda ranks, version: None, lambda: None,
        preemption=preemption, settings=settings,
    )


def test_controller_takes_its_waits_from_rlix_resize_timeout_s() -> None:
    ctl = _controller(Settings(resize_timeout_s=60.0), PreemptionConfig(drain_timeout_s=10.0))
    budget = ShrinkBudget.within(60.0, 10.0)
    assert ctl.shrink_budget == budget  # type: ignore[attr-defined]
    engines = _lifecycle_engines(ctl._lifecycle)  # type: ignore[attr-defined]
    assert [e._refresh_wait_s for e in engines] == [budget.refresh_wait_s] * 2
    assert ctl._lifecycle._state._hold_wait_s == budget.hold_wait_s  # type: ignore[attr-defined]


def test_controller_refuses_a_timeout_the_drain_fills() -> None:
    with pytest.raises(SettingsError, match="RLIX_RESIZE_TIMEOUT_S=20s"):
        _controller(Settings(resize_timeout_s=20.0))  # default drain bound: 30 s


def test_refresh_hold_error_is_a_package_error() -> None:
    """Raised by veRL's balancer actor and recognised by the shard-state view: one class,
    in the package's error module, still a ShardStateError."""
    from rlix_plugins.adapters import verl_shards

    assert issubclass(RefreshHoldError, ShardStateError)
    assert verl_shards.RefreshHoldError is RefreshHoldError


def test_the_lifecycles_sleep_bound_leaves_the_sleep_its_own_time_after_the_refresh_wait() -> None:
    """A replica's sleep first waits up to ``refresh_wait_s`` for an in-place refresh. Before
    the fix the lifecycle bounded the whole call by the default 300 s: under
    ``RLIX_RESIZE_TIMEOUT_S=600`` the refresh wait alone (342 s) outlasted it."""
    default = PreemptionConfig().sleep_timeout_s
    for timeout in (120.0, 600.0):
        ctl = _controller(Settings(resize_timeout_s=timeout))
        wait = ShrinkBudget.within(timeout, PreemptionConfig().drain_timeout_s).refresh_wait_s
        assert ctl._lifecycle.config.sleep_timeout_s == default + wait  # type: ignore[attr-defined]
    # An explicit bound is kept when it has room, refused (naming both) when it has none.
    roomy = PreemptionConfig(sleep_timeout_s=400.0)
    ctl = _controller(Settings(resize_timeout_s=600.0), roomy)
    assert ctl._lifecycle.config is roomy  # type: ignore[attr-defined]
    with pytest.raises(SettingsError, match=r"sleep_timeout_s=300s .* \(342s under "
                                            r"RLIX_RESIZE_TIMEOUT_S=600s\)"):
        _controller(Settings(resize_timeout_s=600.0), PreemptionConfig())
