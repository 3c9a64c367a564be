"""A NeMo RL pipeline whose registration fails leaves nothing behind, on real Ray against the
real coordinator service: no registration, no heartbeat, no shard-state actor, no pipeline id
in the environment.

The NeMo RL generation is a stand-in carrying only what the adapter reads (NeMo RL's own
``VllmGeneration`` needs its source and GPUs; tests/integration/test_nemo_rl_pipeline.py runs
the real one where NEMO_RL_SRC is set); the adapter, the hooks (with their heartbeat thread),
the coordinator, the shard-state actor and the placement check are real.
"""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import ray

from rlix_plugins.adapters import nemo_rl
from rlix_plugins.adapters.nemo_rl import NemoRlLayout, NemoRlPipeline
from rlix_plugins.adapters.nemo_rl_placement_plan import PlacementError, PlacementPlan
from rlix_plugins.hooks import make_hooks
from rlix_plugins.protocol.names import pipeline_namespace
from rlix_plugins.settings import ENV_PIPELINE_ID, load_settings
from tests.support.nemo_rl_plans import one_node_plan
from tests.support.roll_pipeline import wait_until

pytestmark = pytest.mark.integration



def _heartbeats() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("rlix-heartbeat-")}


def _generation(dp_size: int, plan: PlacementPlan | None = None) -> Any:
    """Stand-in for NeMo RL's VllmGeneration: the attributes the adapter reads."""
    cluster = None if plan is None else SimpleNamespace(rlix_plan=plan)
    return SimpleNamespace(cfg={}, dp_size=dp_size, model_parallel_size=1,
                           worker_group=SimpleNamespace(cluster=cluster))


@pytest.fixture
def rlix_env(coordinator: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("RLIX_CONTROL_PLANE", "rlix")
    monkeypatch.setenv("RLIX_NAMESPACE", coordinator.namespace)
    monkeypatch.setenv("RLIX_LEASE_S", "1.5")
    monkeypatch.delenv(ENV_PIPELINE_ID, raising=False)
    return coordinator


def test_a_registration_refused_by_the_placement_check_stops_its_heartbeat(
    rlix_env: Any,
) -> None:
    # Training placed on GPU 1 while the layout (and so the coordinator) would say GPU 0.
    gen = _generation(2, one_node_plan((0, 1), (1,)))
    before = _heartbeats()
    with pytest.raises(PlacementError, match=r"actor_train: coordinator told \[0\], workers "
                       r"placed on \[1\]"):
        nemo_rl.attach_generation(gen)
    wait_until(lambda: _heartbeats() <= before, 5)  # the pipeline that never registered stops
    assert rlix_env.status().pipelines == ()
    assert nemo_rl.current_pipeline() is None
    assert ENV_PIPELINE_ID not in os.environ  # the id of a pipeline that does not exist
    assert not hasattr(gen, "weight_synchronizer")


def test_a_failure_after_register_pipeline_unregisters_and_stops_the_actors(
    rlix_env: Any,
) -> None:
    pid = "ft_00000000c1ea"
    settings = load_settings()
    gen = _generation(2)

    def attach(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("router attach failed")

    gen.rlix_attach = attach
    before = _heartbeats()
    pipeline = NemoRlPipeline(settings, gen, NemoRlLayout((0, 1), (0,)),
                              make_hooks(settings, pipeline_id=pid), pid)
    with pytest.raises(RuntimeError, match="router attach failed"):
        pipeline.register()
    # Registered, then failed: it leaves again (its GPUs are free), the shard-state actor it
    # created is stopped and its heartbeat ends; nobody else could ever do it.
    assert rlix_env.status().pipeline(pid) is None
    assert set(rlix_env.status().owners().values()) == {None}
    wait_until(lambda: _heartbeats() <= before, 5)

    def state_actor_gone() -> bool:
        try:
            ray.get_actor(f"rlix:shard_state:{pid}", namespace=pipeline_namespace(pid))
        except ValueError:
            return True
        return False

    wait_until(state_actor_gone, 10)
