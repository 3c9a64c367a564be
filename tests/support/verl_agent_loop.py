"""An ``RLixAgentLoopWorkerTQ`` set up on CPU for tests: real TransferQueue, a real
``RLixRequestLoadBalancer`` actor, veRL's own ``_run_prompt``; what veRL's ``__init__`` would
load (a tokenizer, a model config) is set to what the tested methods read instead."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AgentLoopRig:
    worker: Any
    load_balancer: Any
    config: Any


@contextmanager
def agent_loop_worker(
    verl_ray: Any, *, loop_name: str, loop_target: str, n: int, data: dict[str, Any]
) -> Iterator[AgentLoopRig]:
    """The worker, with agent loop ``loop_name`` (class path ``loop_target``) registered and
    rollout ``n`` sessions per prompt; TransferQueue, the registration and the balancer are
    undone on exit."""
    import transfer_queue as tq
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop import agent_loop as agent_loop_mod

    from rlix_plugins.patches.verl_agent_loop import RLixAgentLoopWorkerTQ
    from rlix_plugins.patches.verl_routing import RLixLLMServerClient, RLixRequestLoadBalancer

    lb = verl_ray.remote(RLixRequestLoadBalancer).options(num_cpus=0).remote(servers={})
    cfg = OmegaConf.create({
        "actor_rollout_ref": {"rollout": {"n": n, "val_kwargs": {"n": 1}}},
        "data": data,
        "transfer_queue": {"enable": True},
    })
    tq.init(OmegaConf.create({
        "enable": True, "metrics": {"enabled": False, "port": 0},
        "backend": {"storage_backend": "SimpleStorage",
                    "SimpleStorage": {"total_storage_size": 1000, "num_data_storage_units": 1}},
    }))
    agent_loop_mod._agent_loop_registry[loop_name] = {"_target_": loop_target}
    worker = RLixAgentLoopWorkerTQ.__new__(RLixAgentLoopWorkerTQ)
    worker.config = cfg
    worker.llm_client = RLixLLMServerClient(config=cfg, load_balancer_handle=lb)
    worker.tokenizer = worker.processor = worker.dataset_cls = worker.hf_model_type = None
    worker.tools = []
    worker.reward_loop_worker_handles = None
    worker.distillation_enabled = False
    try:
        yield AgentLoopRig(worker, lb, cfg)
    finally:
        agent_loop_mod._agent_loop_registry.pop(loop_name, None)
        tq.close()
        verl_ray.kill(lb)
