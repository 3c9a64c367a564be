"""Child process of ``tests/integration/test_nemo_rl_placement_tensor_parallel_shared.py``: a
vLLM tp*pp > 1 NeMo RL pipeline under ``RLIX_CONTROL_PLANE=rlix`` with the real coordinator
running, on a fresh local Ray with 2 logical GPUs and NeMo RL's real source (``NEMO_RL_SRC``).

Two orders, each printed as one ``RESULT <name> <json>`` line:

* ``groups_first``: the coordinator's shared per-node groups exist (its manager's
  ``get_state`` made them; they hold both GPUs), then the tp=2 pipeline binds its views.
* ``pipeline_first``: the manager runs but has made no group yet; the tp=2 pipeline binds
  first, then another pipeline asks the manager for its groups (``get_state``, as ROLL's
  proxy and every shared-group pipeline do).

Each bind runs in a thread that is given :data:`WAIT_S` seconds: NeMo RL's own placement
group wait is 180 s per try (with retries), so "still binding" after that is reported as
``pending`` rather than waited out. What is recorded: the bind's outcome, the pipeline's own
placement groups (``rlix_nemo_rl_shared*``) and their state, the pipelines registered with the
coordinator, the adapter's claim and ``PIPELINE_ID``, and whether ``get_state`` answered.

Same helpers (and fakes) as ``tests/support/nemo_rl_placement_run.py``; no GPU worker is
started here (the outcome is decided at the bind, before NeMo RL builds a worker).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from typing import Any

import ray

from tests.support.nemo_rl_placement_run import (
    _generation_config,
    _grpo_clusters,
    run_scenarios,
)

#: Seconds a bind (or the other pipeline's get_state) is given before it counts as blocked.
WAIT_S = 15.0
TP2_LAYOUT = {"infer_gpus": [0, 1], "train_gpus": [0]}
OWN_PG_PREFIX = "rlix_nemo_rl_shared"


def _own_pgs() -> dict[str, str]:
    """The pipeline's own placement groups (the fallback) still in Ray: id -> state."""
    from ray.util.placement_group import placement_group_table

    return {k: v["state"] for k, v in placement_group_table().items()
            if v["name"].startswith(OWN_PG_PREFIX) and v["state"] != "REMOVED"}


def _remove_own_pgs() -> None:
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    for pg_id in _own_pgs():
        remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(pg_id)))


def _bind_in_thread(infer: Any, cfg: dict[str, Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """``bind_cluster(infer, cfg)`` (what ``RLixPlacedVllmGeneration`` does first) in a
    daemon thread; the dict gets ``outcome`` (ok / error type) and ``error`` when it ends."""
    from rlix_plugins.adapters.nemo_rl_placement import bind_cluster

    box: dict[str, Any] = {}

    def run() -> None:
        try:
            plan = bind_cluster(infer, cfg)
            box["outcome"] = "ok"
            box["pinned"] = None if plan is None else plan.pinned
        except BaseException as exc:  # recorded, the test asserts on it
            box["outcome"] = type(exc).__name__
            box["error"] = str(exc)

    thread = threading.Thread(target=run, name="tp2-bind", daemon=True)
    thread.start()
    thread.join(WAIT_S)
    if thread.is_alive():
        box["outcome"] = "pending"
    return thread, box


def _pipeline_state(plane: Any) -> dict[str, Any]:
    from rlix_plugins.adapters import nemo_rl

    status = plane.status(timeout_s=30)
    return {
        "registered": sorted(p.pipeline_id for p in status.pipelines),
        "owners": sorted({o for o in status.owners().values() if o is not None}),
        "claimed": nemo_rl._claimed is not None,
        "pipeline_id_env": os.environ.get("PIPELINE_ID"),
    }


def _shared_gpu(pgs: list[Any]) -> dict[str, float]:
    """Ray's accounting of the shared groups' GPUs (``GPU_group_<pg id>``), read once Ray
    published them (a moment after the groups are ready)."""
    keys = [f"GPU_group_{pg.id.hex()}" for pg in pgs]
    deadline = time.monotonic() + 10
    while True:
        avail = ray.available_resources()  # type: ignore[no-untyped-call]
        total = ray.cluster_resources()  # type: ignore[no-untyped-call]
        got = {"free": sum(float(avail.get(k, 0.0)) for k in keys),
               "total": sum(float(total.get(k, 0.0)) for k in keys)}
        if got["total"] > 0 or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


class _ControlPlane:
    """``RLIX_CONTROL_PLANE=rlix`` in ``namespace`` with the real coordinator started;
    environment restored and coordinator stopped on exit."""

    KEYS = ("RLIX_CONTROL_PLANE", "RLIX_NAMESPACE", "PIPELINE_ID")

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.saved: dict[str, str | None] = {}
        self.plane: Any = None

    def __enter__(self) -> Any:
        from rlix_plugins.coordinator.service.client import connect

        self.saved = {k: os.environ.get(k) for k in self.KEYS}
        os.environ.pop("PIPELINE_ID", None)
        os.environ.update(RLIX_CONTROL_PLANE="rlix", RLIX_NAMESPACE=self.namespace)
        self.plane = connect(namespace=self.namespace, create_if_missing=True)
        return self.plane

    def __exit__(self, *exc: object) -> None:
        from rlix_plugins.adapters.nemo_rl import abandon_setup
        from rlix_plugins.coordinator.service.client import stop_coordinator

        try:
            abandon_setup()  # a pipeline the unfixed bind claimed leaves the coordinator
            stop_coordinator(self.namespace)
        finally:
            for k, v in self.saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _cleanup(thread: threading.Thread, clusters: tuple[Any, ...]) -> None:
    """Let go of whatever the bind reserved (a pending group of the pipeline's own too)."""
    _remove_own_pgs()
    thread.join(10)
    for cluster in clusters:
        try:
            cluster.shutdown()
        except Exception:
            traceback.print_exc()
    _remove_own_pgs()


def scenario_groups_first() -> dict[str, Any]:
    """The coordinator's groups hold every GPU; then the tp=2 pipeline binds."""
    with _ControlPlane("rlix_tp_shared_a") as plane:
        state = ray.get(plane.roll_resource_manager.get_state.remote(), timeout=60)
        pgs = list(state["placement_groups"])
        out: dict[str, Any] = {}
        train, infer = _grpo_clusters(1, 1)
        thread, box = _bind_in_thread(infer, _generation_config(TP2_LAYOUT, tp=2))
        out["bind"] = dict(box)
        out["own_pgs"] = sorted(_own_pgs().values())
        out["pipelines"] = _pipeline_state(plane)
        out["views_bound"] = [train.rlix_plan is not None, infer.rlix_plan is not None]
        out["shared_after"] = _shared_gpu(pgs)
        _cleanup(thread, (train, infer))
    return out


def scenario_pipeline_first() -> dict[str, Any]:
    """The manager runs without groups; the tp=2 pipeline binds first, then another
    pipeline asks the manager for the shared groups."""
    with _ControlPlane("rlix_tp_shared_b") as plane:
        train, infer = _grpo_clusters(1, 1)
        thread, box = _bind_in_thread(infer, _generation_config(TP2_LAYOUT, tp=2))
        out: dict[str, Any] = {"bind": dict(box), "own_pgs": sorted(_own_pgs().values())}
        out["pipelines"] = _pipeline_state(plane)
        t0 = time.monotonic()
        try:
            state = ray.get(plane.roll_resource_manager.get_state.remote(), timeout=WAIT_S)
            out["others_get_state"] = "ok"
            out["shared_after"] = _shared_gpu(list(state["placement_groups"]))
        except ray.exceptions.GetTimeoutError:
            out["others_get_state"] = f"blocked for {time.monotonic() - t0:.0f}s"
        _cleanup(thread, (train, infer))
    return out


SCENARIOS = {"groups_first": scenario_groups_first, "pipeline_first": scenario_pipeline_first}


def main(argv: list[str]) -> int:
    return run_scenarios(SCENARIOS, argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
