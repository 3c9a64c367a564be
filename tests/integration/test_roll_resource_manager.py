"""``rlix:roll_resource_manager`` on a real Ray (8 logical GPUs): its shared per-node groups
are never waited for without bound, and the layouts it hands out are checked first."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from rlix_plugins.coordinator.core import Topology
from rlix_plugins.coordinator.service.resource_manager import (
    RollResourceManagerService,
    SharedGroupsUnplaceableError,
)
from rlix_plugins.errors import RlixPluginsError


def _states_named(ray: Any, name: str) -> list[str]:
    from ray.util.placement_group import placement_group_table

    return [t["state"] for t in placement_group_table().values() if t["name"] == name]


def test_get_state_gives_up_on_groups_another_process_holds_the_gpus_of(
    ray_session: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before the fix ``_ensure`` awaited ``pg.ready()`` without bound under its lock: with
    every GPU reserved by someone else, ``get_state`` (and every later caller, and
    ``destroy_placement_group`` at stop) blocked forever. The message reads Ray's placement
    group table (a blocking GCS call): off the event loop, which serves every other caller."""
    ray = ray_session
    from rlix_plugins.coordinator.service import resource_manager

    message_threads: list[threading.Thread] = []
    real_message = resource_manager._unplaceable_message

    def recording_message(topology: Topology, timeout_s: float) -> str:
        message_threads.append(threading.current_thread())
        return real_message(topology, timeout_s)

    monkeypatch.setattr(resource_manager, "_unplaceable_message", recording_message)
    from ray.util.placement_group import placement_group, remove_placement_group

    holder = placement_group([{"GPU": 8.0}], name="someone_elses_group")
    ray.get(holder.ready(), timeout=30)
    rm = RollResourceManagerService(Topology(1, 8), ready_timeout_s=2.0)
    try:
        with pytest.raises(SharedGroupsUnplaceableError) as err:
            # The outer bound only turns the old hang into a failure.
            asyncio.run(asyncio.wait_for(rm.get_state(), timeout=30))
        msg = str(err.value)
        assert isinstance(err.value, RlixPluginsError)
        assert "rlix_pg_node0" in msg and "2s" in msg and "GPU" in msg
        assert "someone_elses_group" in msg
        # asyncio.run's loop runs on this (the main) thread.
        assert message_threads and threading.main_thread() not in message_threads
        # Nothing left pending to grab the GPUs later behind everyone's back.
        assert "PENDING" not in _states_named(ray, "rlix_pg_node0")
    finally:
        remove_placement_group(holder)
    # Once the GPUs are free the next call makes the groups.
    state = asyncio.run(asyncio.wait_for(rm.get_state(), timeout=30))
    try:
        assert state["num_nodes"] == 1 and len(state["placement_groups"]) == 1
    finally:
        asyncio.run(rm.destroy_placement_group())
    assert "CREATED" not in _states_named(ray, "rlix_pg_node0")


#: Run in a child process: a two-node Ray (``ray.cluster_utils.Cluster``) cannot share this
#: process with the session's local Ray.
_NODE_JOINS_LATER = r"""
import json, sys
import ray
from ray.cluster_utils import Cluster
from rlix_plugins.coordinator.service.client import connect, stop_coordinator
from rlix_plugins.coordinator.service.config import ServiceConfig

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 4})
ray.init(address=cluster.address, log_to_driver=False)
cfg = ServiceConfig(namespace="rlix_node_joins", topology=None, trace_dir=sys.argv[1])
plane = connect(namespace=cfg.namespace, config=cfg)
status = plane.status(timeout_s=60)
cluster.add_node(num_cpus=1, num_gpus=4)
cluster.wait_for_nodes()
state = ray.get(plane.roll_resource_manager.get_state.remote(), timeout=120)
print(json.dumps({
    "scheduler": [status.num_nodes, status.gpus_per_node],
    "manager": [state["num_nodes"], state["gpu_per_node"], len(state["placement_groups"])],
}))
stop_coordinator(cfg.namespace)
ray.shutdown()
cluster.shutdown()
"""


def test_get_state_uses_the_schedulers_topology_when_a_node_joined_since_it_started(
    tmp_path: Any,
) -> None:
    """Before the fix the manager read Ray's nodes on its first call, not when the scheduler
    did: a node that joined in between gave it 2 nodes (and a group on a GPU node the
    scheduler never assigns) while the scheduler's GPU ids covered 1."""
    import json
    import subprocess
    import sys

    pytest.importorskip("ray")
    out = subprocess.run(
        [sys.executable, "-c", _NODE_JOINS_LATER, str(tmp_path / "trace")],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["scheduler"] == [1, 4]
    assert result["manager"] == [1, 4, 1]


def test_a_restarted_manager_adopts_its_groups_and_the_workers_on_them_live_on(
    coordinator: Any,
) -> None:
    """Before the fix the groups belonged to the manager actor: a crash (Ray restarts it,
    ``max_restarts=-1``) removed them, and every pipeline's worker placed on them with it."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=0, num_gpus=0.01)
    class Worker:
        """FAKE pipeline worker: placed as ROLL's and the adapters' workers are."""

        def ping(self) -> str:
            return "alive"

    manager = coordinator.roll_resource_manager
    before = ray.get(manager.get_state.remote(), timeout=60)["placement_groups"]
    worker = Worker.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        before[0], placement_group_bundle_index=0)).remote()
    assert ray.get(worker.ping.remote(), timeout=60) == "alive"
    ray.kill(manager, no_restart=False)  # crash; Ray restarts it
    after = ray.get(manager.get_state.remote(), timeout=60)["placement_groups"]
    assert [pg.id for pg in after] == [pg.id for pg in before]  # adopted, not made anew
    assert ray.get(worker.ping.remote(), timeout=30) == "alive"
    assert _states_named(ray, "rlix_pg_node0").count("CREATED") == 1
    # The coordinator's stop still removes them (and forgets them).
    ray.get(manager.destroy_placement_group.remote(), timeout=60)
    assert "CREATED" not in _states_named(ray, "rlix_pg_node0")
    ray.kill(worker)


def test_groups_that_do_not_sit_one_per_node_are_refused_and_removed(ray_session: Any) -> None:
    """A topology of more nodes than Ray has (here 2 x 4 GPUs on the session's one node of
    8): both groups place on the one node. Before the fix the manager handed them out, and
    ROLL's workers pinned to global GPUs 0 and 4 got the same ``CUDA_VISIBLE_DEVICES=0``
    (only the NeMo RL and veRL adapters checked this)."""
    from rlix_plugins.adapters.shared_groups import PlacementError

    ray = ray_session
    rm = RollResourceManagerService(Topology(2, 4), ready_timeout_s=30.0)
    with pytest.raises(PlacementError) as err:
        asyncio.run(asyncio.wait_for(rm.get_state(), timeout=60))
    assert "node ranks [0, 1]" in str(err.value) and "one per node" in str(err.value)
    # Removed, so they hold nothing; and nothing is handed out on the next call either.
    for name in ("rlix_pg_node0", "rlix_pg_node1"):
        assert "CREATED" not in _states_named(ray, name)
    with pytest.raises(PlacementError):
        asyncio.run(asyncio.wait_for(rm.get_state(), timeout=60))
