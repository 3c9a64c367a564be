"""NeMo RL's real trajectory collector -> our patch -> the real coordinator (Python >= 3.12).

Run by ``tests/integration/test_nemo_rl_pipeline.py`` with the interpreter named by
``NEMO_RL_PY312`` (NeMo RL's ``grpo`` / ``async_utils`` need Python >= 3.12; this repo's python
is 3.11, and Ray needs one Python version per cluster, so this starts its own local Ray).

Real: NeMo RL's ``async_utils`` package imported with the gate on (our post-import hook swaps
``AsyncTrajectoryCollector`` / ``ReplayBuffer``), NeMo RL's ``AsyncTrajectoryCollector.__init__``,
``set_weight_version`` and ``_enqueue_rollout_group`` (which pushes to the replay buffer
through ``ReplayBuffer.add``), our collector subclass, our progress tracker and sink, and the
coordinator's scheduler. What is not NeMo RL's: the master config is built with pydantic's
``model_construct`` (only the fields the collector reads), and the rollout results are built
by hand (no model, tokenizer or environment runs here); ``running`` is set as
``start_collection`` would.

Prints one JSON line (the last line of stdout) with what the coordinator saw.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from typing import Any


def _demand(scheduler: Any, pid: str, want: int | None, timeout_s: float = 30.0) -> Any:
    """The pipeline's demand once it equals ``want`` (reports are fire and forget)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        status = ray.get(scheduler.get_status.remote())
        p = status.pipeline(pid)
        got = None if p is None else (p.demand, p.progress_streams)
        if (got is not None and got[0] == want) or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def main() -> dict[str, Any]:
    import ray

    ns = f"rlix_py312_{uuid.uuid4().hex[:8]}"
    env = {
        "RLIX_CONTROL_PLANE": "rlix",
        "RLIX_NAMESPACE": ns,
        "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
    }
    os.environ.update(env)
    ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False,
             log_to_driver=False, runtime_env={"env_vars": env})
    out: dict[str, Any] = {"python": sys.version.split()[0]}
    try:
        from rlix_plugins.coordinator.core.model import Topology
        from rlix_plugins.coordinator.service.client import connect, stop_coordinator
        from rlix_plugins.coordinator.service.config import ServiceConfig
        from rlix_plugins.protocol.names import pipeline_namespace

        plane = connect(namespace=ns, config=ServiceConfig(namespace=ns, topology=Topology(1, 2)))
        pid = str(ray.get(plane.orchestrator.allocate_pipeline_id.remote("ft")))
        ray.get(plane.orchestrator.register_pipeline.remote(
            pipeline_id=pid, ray_namespace=pipeline_namespace(pid),
            cluster_tp_configs={"actor_infer": 1, "actor_train": 1},
            cluster_device_mappings={"actor_infer": [0, 1], "actor_train": [0]},
        ))
        # The adapter exports PIPELINE_ID at registration; NeMo RL forwards the driver's env.
        os.environ["PIPELINE_ID"] = pid
        from rlix_plugins import activation

        out["activated"] = activation.activate()
        import torch
        from nemo_rl.algorithms import async_utils
        from nemo_rl.algorithms.grpo import AsyncGRPOConfig, GRPOConfig
        from nemo_rl.algorithms.grpo import MasterConfig as GRPOMasterConfig
        from nemo_rl.distributed.batched_data_dict import BatchedDataDict
        from nemo_rl.experience.rollouts import RolloutGroupResult

        out["collector_class"] = async_utils.AsyncTrajectoryCollector.__ray_metadata__.class_name
        out["buffer_class"] = async_utils.ReplayBuffer.__ray_metadata__.class_name
        target = 4
        cfg = GRPOMasterConfig.model_construct(
            grpo=GRPOConfig(num_prompts_per_step=target,
                            async_grpo=AsyncGRPOConfig(enabled=True)),
            policy={"make_sequence_length_divisible_by": 1},
        )
        actor_env = {"env_vars": {**env, "PIPELINE_ID": pid}}
        buffer = async_utils.ReplayBuffer.options(num_cpus=0, runtime_env=actor_env).remote(
            max_size=64, drop_incomplete_targets_on_restore=False)
        collector = async_utils.AsyncTrajectoryCollector.options(
            num_cpus=0, runtime_env=actor_env).remote(
            policy_generation=None, tokenizer=None, task_to_env={}, master_config=cfg,
            replay_buffer=buffer,
        )
        ray.get(collector.__ray_call__.remote(lambda self: setattr(self, "running", True)))
        # async_grpo_train after a refit: the collector moves to weight version 1.
        ray.get(collector.set_weight_version.remote(1))
        out["after_new_version"] = _demand(plane.scheduler, pid, target)
        seen = []
        for i in range(3):
            result = RolloutGroupResult(
                group_index=i,
                final_batch=BatchedDataDict({"input_ids": torch.zeros((2, 3), dtype=torch.long)}),
                rollout_metrics={},
            )
            ray.get(collector._enqueue_rollout_group.remote(
                result, 1, 1, target, set(), time.perf_counter()))
            seen.append(_demand(plane.scheduler, pid, target - i - 1))
        out["after_groups"] = seen
        out["buffer_size"] = ray.get(buffer.size.remote())
        out["buffer_valid"] = ray.get(buffer.valid_count.remote(1, 0, intended_only=True))
        ray.get(collector.set_weight_version.remote(2))  # next step: a new batch
        out["after_next_version"] = _demand(plane.scheduler, pid, target)
        stop_coordinator(ns)
    finally:
        ray.shutdown()
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
