"""Driver-adapter checks that need no Ray: the placement check before registration and the
cache sync's rank validation. The plan and the adapter are real; the generation and its worker
group are plain stand-ins carrying only the attributes the adapter reads."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from rlix_plugins.adapters.nemo_rl import CacheSync, NemoRlLayout, NemoRlPipeline
from rlix_plugins.adapters.nemo_rl_placement_plan import (
    PlacementError,
    PlacementPlan,
)
from rlix_plugins.errors import RegistrationError
from rlix_plugins.settings import load_settings
from tests.support.nemo_rl_plans import one_node_plan


def _pipeline(layout: NemoRlLayout, plan: PlacementPlan | None) -> NemoRlPipeline:
    cluster = None if plan is None else SimpleNamespace(rlix_plan=plan)
    generation = SimpleNamespace(worker_group=SimpleNamespace(cluster=cluster))
    hooks: Any = SimpleNamespace()
    return NemoRlPipeline(load_settings(), generation, layout, hooks, "ft_test")


def test_matching_plan_passes_and_no_plan_is_not_checked() -> None:
    layout = NemoRlLayout((0, 1), (0,))
    _pipeline(layout, one_node_plan((0, 1), (0,))).check_placement()
    _pipeline(layout, None).check_placement()


def test_mismatched_plan_fails_registration_before_the_coordinator_is_contacted() -> None:
    # Training placed on GPU 1 while the coordinator would be told GPU 0.
    pipeline = _pipeline(NemoRlLayout((0, 1), (0,)), one_node_plan((0, 1), (1,)))
    with pytest.raises(PlacementError, match=r"actor_train: coordinator told \[0\], workers "
                                             r"placed on \[1\]"):
        pipeline.register()  # raises before any Ray call (none is running here)


def test_cache_sync_rejects_unknown_ranks_naming_the_valid_ones() -> None:
    sync = CacheSync(owner=None, leaders=["leader0", "leader1"], pipeline_id="ft_x")
    with pytest.raises(RegistrationError, match=r"dp ranks \[2\] do not exist; valid: 0\.\.1"):
        sync([0, 2], 1)
