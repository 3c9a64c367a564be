"""Child process of ``tests/integration/test_nemo_rl_placement.py``: one placement scenario
on a fresh local Ray with 2 logical GPUs, against NeMo RL's real source (``NEMO_RL_SRC``).

A child process because the scenario needs its own Ray (``num_gpus=2``; NeMo RL's bundles ask
for 2 CPUs each), while the test session may already run one with other resources. It prints
one JSON line (prefixed ``RESULT``) with what the workers reported; the test asserts on it.

GPU workers are replaced by **fakes** (``InferenceProbeWorker``, ``TrainingProbeWorker``):
Ray actors that load no model and only report where Ray put them. Everything that decides
that placement is real: NeMo RL's ``RayVirtualCluster``, ``RayWorkerBuilder``,
``RayWorkerGroup``, ``VllmGeneration.__init__`` (the inference fake borrows the real vLLM
worker's ``configure_worker``, which sets its GPU request and env), and our patch.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import ray

REPO = Path(__file__).resolve().parents[2]
PROBE_MODULE = "tests.support.nemo_rl_placement_run"
INFER_FQN = f"{PROBE_MODULE}.InferenceProbeWorker"
TRAIN_FQN = f"{PROBE_MODULE}.TrainingProbeWorker"


def _where() -> dict[str, Any]:
    ctx = ray.get_runtime_context()
    return {
        "gpu_ids": [int(g) for g in ray.get_gpu_ids()],
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "node_id": ctx.get_node_id(),
        "pg_id": ctx.get_placement_group_id(),
        "rank": os.environ.get("RANK"),
        "vllm_port": os.environ.get("VLLM_PORT"),
        "pid": os.getpid(),
        # Ray's accounting of this worker's GPU share (per placement group and bundle).
        "assigned": {k: v for k, v in ctx.get_assigned_resources().items()
                     if k.startswith("GPU")},
    }


class _InferenceProbe:
    """Fake of NeMo RL's vLLM worker: no engine; the methods VllmGeneration calls at init."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.init_kwargs = sorted(kwargs)

    def post_init(self) -> None:
        return None

    def report_device_id(self) -> str:
        return json.dumps(_where())

    def where(self) -> dict[str, Any]:
        return _where()


def _vllm_configure_worker(*args: Any, **kwargs: Any) -> Any:
    # The real vLLM worker's resource/env logic (num_gpus, VLLM_PORT, TP followers get 0).
    # Runs in NeMo RL's worker initializer, where the transformers shim is needed too.
    from tests.fixtures.nemo_rl_src import _import_policy_package

    _import_policy_package()
    from nemo_rl.models.generation.vllm.vllm_worker import BaseVllmGenerationWorker

    return BaseVllmGenerationWorker.configure_worker(*args, **kwargs)


_InferenceProbe.configure_worker = staticmethod(_vllm_configure_worker)  # type: ignore[attr-defined]
InferenceProbeWorker = ray.remote(_InferenceProbe)


@ray.remote
class TrainingProbeWorker:
    """Fake of NeMo RL's Megatron policy worker: only reports where Ray put it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.init_kwargs = sorted(kwargs)

    def where(self) -> dict[str, Any]:
        return _where()


# ----------------------------------------------------------------------------- scenarios


def _setup_nemo_rl() -> None:
    src = os.environ["NEMO_RL_SRC"]
    paths = [str(REPO), src] + [p for p in [os.environ.get("NEMO_RL_DEPS")] if p]
    sys.path[:0] = paths
    # Every NeMo RL actor inherits the driver's environment (NeMo RL's documented way).
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])
    os.environ["NEMO_RL_PY_EXECUTABLES_SYSTEM"] = "1"
    from tests.fixtures.nemo_rl_src import _import_policy_package

    _import_policy_package()


def _patch() -> Any:
    """Apply NemoRlPatch for real; register the fakes' venv (the driver's python)."""
    import nemo_rl.distributed.ray_actor_environment_registry as registry
    import nemo_rl.distributed.worker_groups
    import nemo_rl.models.generation.vllm.vllm_generation  # noqa: F401

    from rlix_plugins.patches.nemo_rl import NemoRlPatch

    registry.ACTOR_ENVIRONMENT_REGISTRY[INFER_FQN] = sys.executable
    registry.ACTOR_ENVIRONMENT_REGISTRY[TRAIN_FQN] = sys.executable
    patch = NemoRlPatch()
    patch.apply()
    return patch


def _grpo_clusters(train_gpus_per_node: int, inference_gpus_per_node: int) -> tuple[Any, Any]:
    """The two clusters grpo.setup builds in non-colocated mode on one node (same arguments;
    grpo itself needs Python >= 3.12), through the class the patch puts in its place."""
    from rlix_plugins.adapters.nemo_rl_placement import RLixPlacementCluster

    train = RLixPlacementCluster(
        name="grpo_train_cluster", bundle_ct_per_node_list=[train_gpus_per_node],
        use_gpus=True, num_gpus_per_node=train_gpus_per_node, max_colocated_worker_groups=1,
        port_range_low=None, port_range_high=None, segment_size=None,
        node_resource_constraints=None,
    )
    infer = RLixPlacementCluster(
        name="grpo_inference_cluster", bundle_ct_per_node_list=[inference_gpus_per_node],
        use_gpus=True, num_gpus_per_node=inference_gpus_per_node,
        max_colocated_worker_groups=1, port_range_low=None, port_range_high=None,
        segment_size=None, node_resource_constraints=None,
    )
    return train, infer


def _generation_config(rlix: dict[str, Any], tp: int) -> dict[str, Any]:
    return {
        "backend": "vllm", "model_name": "fake/probe", "max_new_tokens": 8,
        "temperature": 1.0, "top_p": 1.0, "top_k": None, "stop_token_ids": None,
        "val_temperature": 1.0, "val_top_p": 1.0, "val_top_k": None,
        "stop_strings": None, "colocated": {"enabled": False, "resources": {}},
        "vllm_cfg": {"async_engine": False, "tensor_parallel_size": tp,
                     "pipeline_parallel_size": 1, "expert_parallel_size": tp,
                     "max_model_len": 64, "precision": "bfloat16",
                     "gpu_memory_utilization": 0.5},
        "rlix": rlix,
    }


def _build(rlix: dict[str, Any], tp: int, train_gpus_per_node: int,
           inference_gpus_per_node: int) -> dict[str, Any]:
    import nemo_rl.models.generation.vllm.vllm_generation as vgen
    from nemo_rl.distributed.worker_groups import RayWorkerBuilder

    from rlix_plugins.adapters.nemo_rl_placement import RLixRayWorkerGroup, bind_cluster
    from rlix_plugins.adapters.nemo_rl_placement_generation import RLixPlacedVllmGeneration

    train, infer = _grpo_clusters(train_gpus_per_node, inference_gpus_per_node)
    cfg = _generation_config(rlix, tp)
    # Test fake: the real resolver would pick the vLLM worker; ours reports its placement.
    vgen.resolve_generation_worker_cls = lambda default_cls, config: INFER_FQN
    groups: list[Any] = []
    try:
        # grpo's init_vllm: VllmGeneration(cluster=inference_cluster, config=generation_config)
        generation = RLixPlacedVllmGeneration(cluster=infer, config=cfg)
        groups.append(generation.worker_group)
        # Policy.__init__ cannot import here (lm_policy needs mlflow, wandb, ...): what our
        # Policy subclass does (bind), then NeMo RL's own call for a cluster with
        # _sorted_bundle_indices, through the class the patch puts at lm_policy.RayWorkerGroup.
        plan = bind_cluster(train, cfg)
        assert plan is not None and train._sorted_bundle_indices is not None
        group_size = train.num_gpus_per_node
        tied = [(i // group_size, [b]) for i, b in enumerate(train._sorted_bundle_indices)]
        policy_group = RLixRayWorkerGroup(
            train, RayWorkerBuilder(TRAIN_FQN, {}), name_prefix="lm_policy",
            bundle_indices_list=tied, env_vars={},
        )
        groups.append(policy_group)
        out = {
            "plan": {
                "infer_gpus": list(plan.infer.gpus), "infer_bundles": list(plan.infer.bundles),
                "train_gpus": list(plan.train.gpus), "train_bundles": list(plan.train.bundles),
                "bundle_gpu": {b.bundle_index: plan.global_gpu_of_bundle(b.bundle_index)
                               for b in plan.bundle_gpus},
                "device_mappings": plan.device_mappings(),
            },
            "generation": {
                "dp_size": generation.dp_size,
                "world_size": infer.world_size(),
                "worker_group_class": type(generation.worker_group).__name__,
                "dp_leaders": list(generation.worker_group.dp_leader_worker_indices),
                "reported": [json.loads(d) for d in generation.device_uuids or []],
            },
            "policy_world_size": train.world_size(),
            "max_colocated": [train.max_colocated_worker_groups,
                              infer.max_colocated_worker_groups],
            "shared_pg": [p.id.hex() for p in infer.get_placement_groups()]
            + [p.id.hex() for p in train.get_placement_groups()],
            "infer_workers": ray.get([w.where.remote() for w in generation.worker_group.workers]),
            "train_workers": ray.get([w.where.remote() for w in policy_group.workers]),
        }
    finally:
        # Shut down as grpo does (both clusters); the shared group goes with the last one.
        for group in groups:
            group.shutdown(force=True)
        train.shutdown()
        train.shutdown()  # released twice: counted once, the group stays for inference
        remaining = [p.id.hex() for p in infer._node_placement_groups or []]
        infer.shutdown()
        pair = infer._rlix_pair
        pair_after = {"placement_cleared": pair.placement is None,
                      "released": sorted(pair.released)}
        infer.shutdown()  # idempotent once the round is over
    from ray.util.placement_group import placement_group_table

    out["pg_after_train_shutdown"] = remaining
    out["pair_after_shutdown"] = pair_after
    out["pg_states_after"] = sorted(
        {v["state"] for v in placement_group_table().values()
         if v["name"].startswith("rlix_nemo_rl_shared")}
    )
    return out


def scenario_overlap() -> dict[str, Any]:
    """Gate 1 layout: inference shards on GPUs 0 and 1 (tp=1), training on GPU 0."""
    # gates/nemo_rl_gate1.yaml: cluster.gpus_per_node 2, colocated.resources.gpus_per_node 1
    return _build({"infer_gpus": [0, 1], "train_gpus": [0]}, tp=1,
                  train_gpus_per_node=1, inference_gpus_per_node=1)


def scenario_tp2() -> dict[str, Any]:
    """One tp=2 shard over GPUs 0,1 (vLLM's tied-group path); training on GPU 1."""
    return _build({"infer_gpus": [0, 1], "train_gpus": [1]}, tp=2,
                  train_gpus_per_node=1, inference_gpus_per_node=1)


def scenario_gpu_taken() -> dict[str, Any]:
    """GPU 0 is held by another actor: a layout naming GPU 0 must be refused, clearly."""
    from rlix_plugins.adapters.nemo_rl_placement import bind_cluster
    from rlix_plugins.adapters.nemo_rl_placement_plan import PlacementError

    holder = TrainingProbeWorker.options(num_gpus=1, num_cpus=0).remote()
    held = ray.get(holder.where.remote())["gpu_ids"]
    free = 1 - held[0]
    train, infer = _grpo_clusters(1, 1)
    cfg = _generation_config({"infer_gpus": [held[0]], "train_gpus": [held[0]]}, tp=1)
    out: dict[str, Any] = {"held": held}
    try:
        bind_cluster(infer, cfg)
        out["error"] = None
    except PlacementError as exc:
        out["error"] = str(exc)
        out["error_type"] = type(exc).__name__
    # Unbound views refuse to place on their own.
    try:
        train.get_placement_groups()
        out["unbound_error"] = None
    except PlacementError as exc:
        out["unbound_error"] = str(exc)
    # The GPU Ray does give is accepted.
    train2, infer2 = _grpo_clusters(1, 1)
    plan = bind_cluster(infer2, _generation_config(
        {"infer_gpus": [free], "train_gpus": [free]}, tp=1))
    assert plan is not None
    out["free_plan"] = plan.device_mappings()
    infer2.shutdown()
    train2.shutdown()
    ray.kill(holder)
    return out


def _pipeline_on_shared_groups(rlix: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """One pipeline's two clusters and worker groups (tp=1), as in :func:`_build`; returns
    (things to shut down in order, what its workers report)."""
    import nemo_rl.models.generation.vllm.vllm_generation as vgen
    from nemo_rl.distributed.worker_groups import RayWorkerBuilder

    from rlix_plugins.adapters.nemo_rl_placement import RLixRayWorkerGroup, bind_cluster
    from rlix_plugins.adapters.nemo_rl_placement_generation import RLixPlacedVllmGeneration

    train, infer = _grpo_clusters(1, 1)
    cfg = _generation_config(rlix, tp=1)
    vgen.resolve_generation_worker_cls = lambda default_cls, config: INFER_FQN
    owned: list[Any] = []
    try:
        generation = RLixPlacedVllmGeneration(cluster=infer, config=cfg)
        owned.append(generation.worker_group)
        plan = bind_cluster(train, cfg)
        assert plan is not None and train._sorted_bundle_indices is not None
        # Policy.__init__'s own call (tied groups from _sorted_bundle_indices).
        tied = [(i // train.num_gpus_per_node, [b])
                for i, b in enumerate(train._sorted_bundle_indices)]
        policy_group = RLixRayWorkerGroup(
            train, RayWorkerBuilder(TRAIN_FQN, {}), name_prefix="lm_policy",
            bundle_indices_list=tied, env_vars={},
        )
        owned.append(policy_group)
    except BaseException:
        for thing in [*owned, train, infer]:
            thing.shutdown()
        raise
    owned += [train, infer]
    return owned, {
        "pinned": plan.pinned,
        "device_mappings": plan.device_mappings(),
        "max_colocated": [train.max_colocated_worker_groups,
                          infer.max_colocated_worker_groups],
        "infer_workers": ray.get([w.where.remote() for w in generation.worker_group.workers]),
        "train_workers": ray.get([w.where.remote() for w in policy_group.workers]),
        "reported": [json.loads(d) for d in generation.device_uuids or []],
    }


def _shared_gpu_free(pgs: list[Any], total: bool = False) -> float:
    # Ray's per-group resource: GPU_group_<pg id hex> (what is left of the groups' GPUs).
    res = ray.cluster_resources() if total else ray.available_resources()
    return sum(float(res.get(f"GPU_group_{pg.id.hex()}", 0.0)) for pg in pgs)


def _own_pgs() -> list[str]:
    from ray.util.placement_group import placement_group_table

    return [k for k, v in placement_group_table().items()
            if v["name"].startswith("rlix_nemo_rl_shared")]


def scenario_two_pipelines_shared() -> dict[str, Any]:
    """Gate 2 layout on the real coordinator's shared per-node groups: pipelines A and B
    both infer on GPUs 0,1; A trains on GPU 0, B on GPU 1; both placed at the same time."""
    from ray.util.placement_group import placement_group_table

    from rlix_plugins.coordinator.service.client import connect, stop_coordinator
    from rlix_plugins.protocol.names import ROLL_RESOURCE_MANAGER_ACTOR

    namespace = "rlix_placement_test"
    saved = {k: os.environ.get(k)
             for k in ("RLIX_CONTROL_PLANE", "RLIX_NAMESPACE", "PIPELINE_ID")}
    os.environ.update(RLIX_CONTROL_PLANE="rlix", RLIX_NAMESPACE=namespace)
    out: dict[str, Any] = {}
    try:
        own_before = len(_own_pgs())
        plane = connect(namespace=namespace, create_if_missing=True)
        state = ray.get(plane.roll_resource_manager.get_state.remote())
        pgs = list(state["placement_groups"])
        out["shared_pgs"] = [pg.id.hex() for pg in pgs]
        owned: list[Any] = []
        try:
            # Each pipeline's process exports its PIPELINE_ID (the adapter does).
            os.environ["PIPELINE_ID"] = "gate2_a"
            a_owned, out["a"] = _pipeline_on_shared_groups(
                {"infer_gpus": [0, 1], "train_gpus": [0]})
            owned += a_owned
            # A's first bind claimed its GPUs for setup (the process's one pipeline: B's
            # binds, in the same process here, find it and claim nothing).
            owners = plane.status().owners()
            out["owners_after_a"] = [owners[0], owners[1]]
            os.environ["PIPELINE_ID"] = "gate2_b"
            b_owned, out["b"] = _pipeline_on_shared_groups(
                {"infer_gpus": [0, 1], "train_gpus": [1]})
            owned += b_owned
            out["shared_gpu_free_while_both"] = _shared_gpu_free(pgs)
            # Read here: Ray publishes a new group's resources a moment after it is ready.
            out["shared_gpu_total"] = _shared_gpu_free(pgs, total=True)
        finally:
            for thing in owned:
                if hasattr(thing, "workers"):
                    thing.shutdown(force=True)
                else:
                    thing.shutdown()
        # Groups of a pipeline's own (the fallback) made during this scenario: none expected.
        out["own_pgs_made"] = len(_own_pgs()) - own_before
        # Worker teardown is asynchronous in Ray: wait until the shares are given back.
        import time

        deadline = time.monotonic() + 30
        while _shared_gpu_free(pgs) < out["shared_gpu_total"] and (
            time.monotonic() < deadline
        ):
            time.sleep(0.2)
        out["shared_gpu_free_after"] = _shared_gpu_free(pgs)
        out["shared_pg_states_before_stop"] = [
            placement_group_table(pg)["state"] for pg in pgs]
        out["stopped"] = ROLL_RESOURCE_MANAGER_ACTOR in stop_coordinator(namespace)
        deadline = time.monotonic() + 30
        while ray.available_resources().get("GPU", 0.0) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        out["gpu_free_after_stop"] = ray.available_resources().get("GPU", 0.0)
        out["shared_pg_states_after_stop"] = [
            placement_group_table(pg)["state"] for pg in pgs]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return out


SCENARIOS = {"overlap": scenario_overlap, "tp2": scenario_tp2, "gpu_taken": scenario_gpu_taken,
             "shared_two": scenario_two_pipelines_shared}


def run_scenarios(scenarios: dict[str, Any], argv: list[str]) -> int:
    """Run the named ``scenarios`` (all by default) in one Ray with NeMo RL patched; one
    ``RESULT <name> <json>`` line each (:func:`tests.support.scenario_results.read_results`)."""
    names = argv or list(scenarios)
    _setup_nemo_rl()
    # Logical resources: 2 GPUs; CPUs for NeMo RL's {CPU: 2, GPU: 1} bundles and helpers.
    ray.init(num_cpus=8, num_gpus=2, include_dashboard=False, log_to_driver=False)
    failed = 0
    try:
        patch = _patch()
        try:
            for name in names:
                try:
                    result: dict[str, Any] = {"ok": scenarios[name]()}
                except Exception as exc:
                    traceback.print_exc()
                    result = {"failed": f"{type(exc).__name__}: {exc}"}
                    failed += 1
                print(f"RESULT {name} " + json.dumps(result), flush=True)
        finally:
            patch.revert()
    finally:
        ray.shutdown()
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    return run_scenarios(SCENARIOS, argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
