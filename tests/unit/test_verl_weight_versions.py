"""veRL weight versions and ``bind`` (see also tests/unit/test_verl_routing_and_checkpoint.py,
tests/unit/test_verl_refresh_shrink_and_sleep.py, ...).

* Weight versions: veRL 0.9.1 calls ``update_weights()`` without a step (its v1
  ``_validate`` after a colocated reward model; the stock ``CheckpointEngineManager`` then
  reaches ``send_weights(weights, None)``). ``None`` used to become version 0 every time, so
  the second such update was refused by the cache; a step below the newest was cached and
  shadowed by the newer one the expand serves. Real :class:`RLixCacheCheckpointEngine` and
  :class:`~rlix_plugins.training.bucket_cache.BucketCache`; the managers over veRL's real
  ``WorkerDict`` training group (of the ``FakeTrainingWorker`` of
  ``test_verl_trainer_loop.py``: veRL's training engines need GPUs) and one real veRL rollout
  ``CheckpointEngineWorker`` (its ``FakeServerAdapter``: the vLLM load is CUDA IPC) on Ray.
* ``bind`` refuses a plain ``active()`` callable: it reads the ACTIVE replicas without
  claiming them against a shrink.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from tests.fixtures.verl_env import VerlEnv

pytestmark = pytest.mark.verl

#: a FAKE train step's length: far longer than a sync takes on a loaded box
HOLD_S = 120.0


def _weights(step: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(500 + step)
    return [("a.weight", torch.randn(4, 4, generator=g)), ("b.bias", torch.randn(4, generator=g))]


class _Counted:
    """A weight iterator that counts what was taken from it (a rank's part of the gather)."""

    def __init__(self, step: int) -> None:
        self.items = _weights(step)
        self.taken = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for pair in self.items:
            self.taken += 1
            yield pair

    @property
    def drained(self) -> bool:
        return self.taken == len(self.items)


def _engine() -> Any:
    from rlix_plugins.patches.verl_checkpoint import RLixCacheCheckpointEngine

    return RLixCacheCheckpointEngine(bucket_size=1 << 20, pipeline_id="review5")


def _send(engine: Any, weights: Any, step: Any) -> dict[str, Any]:
    out: dict[str, Any] = asyncio.run(engine.send_weights(iter(weights), global_steps=step))
    return out


def _tensors(engine: Any, version: int) -> dict[str, torch.Tensor]:
    return dict(engine.cache.named_tensors(version))


# ---------------------------------------------------------------- engine: send_weights
def test_send_weights_without_a_step_caches_the_next_version(
    verl_env: VerlEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two updates without a step (veRL's stock manager's ``update_weights()``): versions 0
    and 1, each with its own tensors (was: 0 twice, the second refused by the cache)."""
    monkeypatch.delenv("RANK", raising=False)
    engine = _engine()
    assert _send(engine, _weights(0), None)["rlix/cache_version"] == 0
    assert _send(engine, _weights(1), None)["rlix/cache_version"] == 1
    assert engine.cache.latest_version == 1
    for name, tensor in _weights(1):
        assert torch.equal(_tensors(engine, 1)[name], tensor)
    # after an explicit step, None continues from it
    assert _send(engine, _weights(7), 7)["rlix/cache_version"] == 7
    assert _send(engine, _weights(8), None)["rlix/cache_version"] == 8


@pytest.mark.parametrize("step", [3, 5])
def test_send_weights_refuses_a_step_not_above_the_newest(
    verl_env: VerlEnv, monkeypatch: pytest.MonkeyPatch, step: int
) -> None:
    """A step below (was: cached, and shadowed by the newer version the expand serves) or
    equal to the newest cached version: a WeightCacheError naming both, the weights drained
    (the other ranks' gather needs this rank's part), the cache unchanged."""
    from rlix_plugins.errors import WeightCacheError

    monkeypatch.delenv("RANK", raising=False)
    engine = _engine()
    _send(engine, _weights(5), 5)
    before = (engine.cache.versions(), engine.cache.latest_version)
    weights = _Counted(step)
    with pytest.raises(WeightCacheError, match=rf"weight version {step}\b.*\b5\b"):
        _send(engine, weights, step)
    assert weights.drained
    assert (engine.cache.versions(), engine.cache.latest_version) == before
    for name, tensor in _weights(5):
        assert torch.equal(_tensors(engine, 5)[name], tensor)


@pytest.mark.parametrize("step", [True, -1, "3", 2.0])
def test_send_weights_refuses_a_step_that_is_not_a_version(
    verl_env: VerlEnv, monkeypatch: pytest.MonkeyPatch, step: Any
) -> None:
    """Not an int >= 0 (was: ``int(step or 0)``: True cached as 1, "3" as 3, -1 refused only
    by the cache): a WeightCacheError naming the value, weights drained, nothing cached."""
    from rlix_plugins.errors import WeightCacheError

    monkeypatch.delenv("RANK", raising=False)
    engine = _engine()
    weights = _Counted(0)
    with pytest.raises(WeightCacheError, match="int >= 0 or None, got"):
        _send(engine, weights, step)
    assert weights.drained
    assert engine.rlix_cached_versions() == []


def test_send_weights_on_a_non_owner_rank_only_drains(
    verl_env: VerlEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "1")
    engine = _engine()
    weights = _Counted(0)
    assert _send(engine, weights, None) == {}
    assert weights.drained
    assert engine.rlix_cached_versions() == []


# ---------------------------------------------------------------- managers: update_weights
@dataclass
class FakeStandaloneReplica:
    """FAKE veRL ``RolloutReplica``: its rollout workers are real veRL
    ``CheckpointEngineWorker`` actors; abort/resume (server calls) are only recorded."""

    workers: list[Any]
    calls: list[str] = field(default_factory=list)

    async def abort_all_requests(self) -> None:
        self.calls.append("abort")

    async def resume_generation(self) -> None:
        self.calls.append("resume")


def test_managers_number_versions_monotonically_and_receivers_agree(
    verl_env: VerlEnv, verl_ray: Any, patched: Any
) -> None:
    """Two ``update_weights()`` without a step: v0, v1 (was: v0 again, refused by the cache);
    the hybrid manager's ``update_weights()`` (veRL's wake-up after validation's colocated
    reward) re-serves v1; a step, the same step again (re-served, not re-cached), a step that
    goes back (refused, naming both, nothing cached or loaded), then bound: ``None`` -> the
    next version, and the rollout worker's load and the shard controller's record name the
    version chosen."""
    from verl.workers.config import CheckpointEngineConfig

    from rlix_plugins.errors import WeightCacheError
    from rlix_plugins.patches.verl_checkpoint import (
        RLixCheckpointEngineManager,
        RLixHybridCheckpointManager,
    )
    from tests.integration.test_verl_checkpoint import _rollout_worker_group
    from tests.integration.test_verl_trainer_loop import training_worker_group
    from tests.support.verl_checkpoint import fake_read_claim

    wg = training_worker_group(verl_ray, None)
    rollout = _rollout_worker_group(verl_ray).workers[0]
    replica = FakeStandaloneReplica([rollout])
    config = CheckpointEngineConfig(backend="rlix_cache", update_weights_bucket_megabytes=1)
    hybrid = RLixHybridCheckpointManager(config=config, actor_wg=wg, replicas=[])
    standalone = RLixCheckpointEngineManager(config=config, actor_wg=wg, replicas=[replica])

    def cached() -> list[int]:
        log = wg.get_log()[0]
        return [step for op, step in log if op == "update_weights:rlix_cache"]

    def loads() -> list[int]:
        order: list[int] = verl_ray.get(
            rollout.__ray_call__.remote(lambda self: self.server_adapter.load_order()))
        return order

    assert standalone.update_weights()["rlix/cache_version"] == 0
    assert standalone.update_weights()["rlix/cache_version"] == 1  # was: v0 again, refused
    assert hybrid.update_weights() == {}  # veRL's wake-up after its reward: v1 re-served
    assert standalone.update_weights(4)["rlix/cache_version"] == 4
    assert "rlix/cache_version" not in standalone.update_weights(4)  # served, not re-cached
    assert cached() == [0, 1, 4]
    assert loads() == [0, 1, 4, 4]
    assert hybrid.refreshed == [(1, ())]

    with pytest.raises(WeightCacheError, match=r"weight version 2 goes backwards.*is 4"):
        standalone.update_weights(2)
    with pytest.raises(WeightCacheError, match=r"weight version 3 goes backwards.*is 4"):
        hybrid.update_weights(3)
    assert cached() == [0, 1, 4] and loads() == [0, 1, 4, 4]
    assert standalone.rlix_sync.latest_version() == 4
    assert [v for v, _ in standalone.refreshed] == [0, 1, 4, 4]

    # bound (dp rank 7): the next version without a step, recorded as what was loaded
    observed: list[tuple[list[int], int]] = []
    standalone.bind(fake_read_claim(lambda: {7}), [7],
                    observe=lambda ranks, v: observed.append((list(ranks), v)))
    standalone.update_weights()
    assert cached() == [0, 1, 4, 5]
    assert loads() == [0, 1, 4, 4, 5]
    assert observed == [([7], 5)]
    assert standalone.refreshed[-1] == (5, (7,))
    assert replica.calls == ["abort", "resume"]

    # The coordinator wakes the standalone replica while a train step holds the owner: the
    # version query and the sync run in the cache's concurrency group, answered before the
    # step ends (they waited for the whole step before).
    owner = wg.workers[0]
    step = owner.actor_rollout_hold.remote(HOLD_S)
    try:
        assert standalone.rlix_sync.latest_version() == 5
        standalone.rlix_sync([0], 5)
        assert loads() == [0, 1, 4, 4, 5, 5]
        assert not verl_ray.wait([step], timeout=0)[0], "the sync waited for the train step"
    finally:
        verl_ray.kill(owner)


@pytest.mark.parametrize(("hybrid", "step", "latest", "version"), [
    (False, None, None, 0), (False, None, 4, 5), (False, 4, 4, 4), (False, 6, 4, 6),
    # the hybrid manager's update without a step re-serves the newest (same weights)
    (True, None, 4, 4), (True, None, None, 0), (True, 6, 4, 6),
])
def test_version_each_manager_serves(
    verl_env: VerlEnv, hybrid: bool, step: int | None, latest: int | None, version: int
) -> None:
    """Which version an update serves, per manager (the Ray test above runs the calls)."""
    from rlix_plugins.errors import WeightCacheError
    from rlix_plugins.patches.verl_checkpoint import (
        RLixCheckpointEngineManager,
        RLixHybridCheckpointManager,
    )

    cls = RLixHybridCheckpointManager if hybrid else RLixCheckpointEngineManager
    mgr = cls.__new__(cls)  # veRL's __init__ needs worker groups; this reads no state
    assert mgr._version_for(step, latest) == version
    with pytest.raises(WeightCacheError, match=r"weight version 3 goes backwards.*is 4"):
        mgr._version_for(3, 4)


# ---------------------------------------------------------------- bind: claims only
def test_bind_refuses_a_plain_active_callable(verl_env: VerlEnv) -> None:
    """A plain ``active()`` callable reads the ACTIVE replicas without claiming them (was:
    accepted and wrapped unclaimed): a TypeError naming RefreshClaim, the manager unchanged."""
    from rlix_plugins.patches.verl_checkpoint import RefreshClaim
    from tests.support.verl_checkpoint import bare_refresh_manager

    mgr = bare_refresh_manager([object()])
    before = (mgr._active, list(mgr._ranks), mgr._observe)
    for bad in (lambda: {0}, None, {0}):
        with pytest.raises(TypeError, match="bind needs a RefreshClaim"):
            mgr.bind(bad, [5], observe=lambda ranks, v: None)
        assert (mgr._active, list(mgr._ranks), mgr._observe) == before

    claim = RefreshClaim(begin=lambda ranks: ranks, end=lambda ranks: None)
    mgr.bind(claim, [5])
    assert mgr._active is claim and mgr._ranks == [5]
