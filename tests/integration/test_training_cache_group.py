"""The cache owner serves weight syncs while it trains (its own Ray concurrency group).

A training step is one long task of the owner's actor. Before the group, a sync or version
query the coordinator sent meanwhile (a shard of the pipeline woken while it trains) waited
for the whole step. Real Ray actors of the real NeMo RL worker extension
(:class:`RLixMegatronWorkerMixin`) over the FAKE Megatron host (megatron-bridge cannot be
installed here); the step is a FAKE that only holds the actor.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from rlix_plugins.patches.megatron import RLixMegatronWorkerMixin
from rlix_plugins.training.cache_group import (
    CACHE_GROUP,
    cache_group_actor,
    in_cache_group,
    runs_in_cache_group,
)
from tests.support.megatron_host import FakeMegatronHostWorker

pytestmark = pytest.mark.integration

#: how long the fake step holds the owner: far longer than a query takes on a loaded box
STEP_S = 60.0


class StepOwner(RLixMegatronWorkerMixin, FakeMegatronHostWorker):
    """The extension over the fake host, plus a FAKE training step that holds the actor."""

    def fake_step(self, seconds: float) -> float:
        time.sleep(seconds)
        return time.monotonic()


def test_the_extensions_cache_methods_are_in_the_cache_group() -> None:
    assert runs_in_cache_group(RLixMegatronWorkerMixin.rlix_push_weights)
    assert runs_in_cache_group(RLixMegatronWorkerMixin.rlix_latest_version)
    # the step's own collective gather stays with training
    assert not runs_in_cache_group(RLixMegatronWorkerMixin.rlix_build_cache)


def test_a_tagged_method_on_a_class_without_the_group_is_refused_when_made(
    ray_session: Any,
) -> None:
    """Ray's check that makes tagging safe: no actor that would die on its first sync."""

    class Untagged:
        @in_cache_group
        def serve(self) -> int:
            return 1

    with pytest.raises(AssertionError):
        ray_session.remote(Untagged).remote()


def test_a_call_sent_to_a_group_the_actor_lacks_kills_it(ray_session: Any) -> None:
    """Why callers never pick the group per call (``.options(concurrency_group=...)``): an
    actor made without the group dies of such a call (Ray's own check fails in the worker)."""

    class Plain:
        def serve(self) -> int:
            return 1

    actor = ray_session.remote(Plain).options(num_cpus=0).remote()
    assert ray_session.get(actor.serve.remote(), timeout=120) == 1
    with pytest.raises(ray_session.exceptions.ActorDiedError):
        ray_session.get(actor.serve.options(concurrency_group=CACHE_GROUP).remote(), timeout=120)


def test_owner_answers_a_push_and_a_version_query_while_it_trains(ray_session: Any) -> None:
    ray = ray_session
    owner = cache_group_actor(StepOwner).options(num_cpus=0).remote()
    try:
        ray.get(owner.__ray_ready__.remote(), timeout=120)
        step = owner.fake_step.remote(STEP_S)  # sent first: it runs before anything after it
        latest = ray.get(owner.rlix_latest_version.remote(), timeout=STEP_S / 2)
        # no receivers: the real push returns its empty report without contacting anyone
        push = ray.get(owner.rlix_push_weights.remote(0, []), timeout=STEP_S / 2)
        ready, _ = ray.wait([step], timeout=0)
        assert not ready, f"the step ended before the {CACHE_GROUP} calls were answered"
        assert latest is None  # nothing cached yet
        assert push["shards"] == [] and push["bytes"] == 0
    finally:
        ray.kill(owner)
