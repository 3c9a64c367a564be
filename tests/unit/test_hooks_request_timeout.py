"""A ``before_training`` that gives up waiting withdraws its request from the coordinator.

The hooks wait for ``request_gpus`` up to their own ``RLIX_REQUEST_TIMEOUT_S`` (plus a
grace); the scheduler waits up to its own, which may be longer (another process's
setting). A client that gave up used to leave its request queued: it was granted later to
nobody (the training GPUs, taken from other pipelines' shards, stayed held by a pipeline
that was not training), and a retried ``before_training`` was refused as "already has a
pending request". The hooks now cancel the call, so the scheduler withdraws the request.

Real coordinator (Ray), real hooks; the other pipeline holding GPU 1 is a second registered
pipeline.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import ray

from rlix_plugins.errors import CoordinatorUnavailableError
from rlix_plugins.hooks import coordinator_hooks
from rlix_plugins.hooks.coordinator_hooks import CoordinatorHooks
from rlix_plugins.settings import load_settings
from tests.support.roll_pipeline import gpu_owners, register_pipeline, wait_until


def test_a_request_the_hooks_gave_up_on_is_withdrawn_not_granted_later(
    coordinator: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    pid, other = "ft_hookstimeout1", "ft_hooksholder1"
    register_pipeline(coordinator, pid, {"actor_train": [0, 1], "actor_infer": [0, 1, 2, 3]})
    register_pipeline(coordinator, other, {"actor_train": [1]})
    sched = coordinator.scheduler
    ray.get(sched.request_gpus.remote(cluster_id=f"{other}_actor_train", priority=1))
    # The client waits 0.5 s (no grace), the coordinator 60 s (FAST_CONFIG).
    monkeypatch.setattr(coordinator_hooks, "_REQUEST_GRACE_S", 0.0)
    settings = dataclasses.replace(
        load_settings({"RLIX_CONTROL_PLANE": "rlix", "RLIX_NAMESPACE": coordinator.namespace}),
        request_timeout_s=0.5,
    )
    hooks = CoordinatorHooks(pid, settings, heartbeat=False)
    with pytest.raises(CoordinatorUnavailableError, match="did not answer request_gpus"):
        hooks.before_training(0)  # blocked behind the other pipeline's step on GPU 1
    # The coordinator forgets the request the client no longer waits for ...
    wait_until(lambda: len(coordinator.status().wait_queue) == 0, 10)
    # ... so the GPUs the other pipeline frees are not granted to a pipeline not training.
    ray.get(sched.notify_release_gpus.remote(cluster_id=f"{other}_actor_train"))
    assert gpu_owners(coordinator, [0, 1]) == [None, None]
    # A retry is a fresh request (it was refused as "already has a pending request").
    hooks.settings = dataclasses.replace(settings, request_timeout_s=30.0)
    hooks.before_training(0)
    assert gpu_owners(coordinator, [0, 1]) == [pid, pid]
    hooks.after_training(0)
    assert gpu_owners(coordinator, [0, 1]) == [None, None]
