"""Per-trajectory progress from veRL 0.9.1's real v1 agent-loop worker.

The worker under test is :class:`RLixAgentLoopWorkerTQ`, the plugin's subclass of veRL's
``AgentLoopWorkerTQ``; its real ``_run_prompt`` runs ``n`` sessions through veRL's
``_run_agent_loop`` and the TransferQueue ``_agent_loop_postprocess`` (real TransferQueue).
Each stored trajectory must be counted on the pipeline's load balancer (a real
``RLixRequestLoadBalancer`` Ray actor) as it lands, not when its group finishes.

Named fakes: :class:`FakeEchoAgentLoop` (veRL's single-turn loop needs a tokenizer and an LLM
server; this one returns a fixed response), and the worker's ``__init__`` (it loads a tokenizer
and a model config) is skipped: the attributes veRL's methods read are set instead.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.integration]

N = 3


class FakeEchoAgentLoop:
    """Stands in for veRL's single-turn agent loop: waits for its turn, answers 4 tokens."""

    gates: dict[int, asyncio.Event] = {}

    def __init__(self, **kwargs: Any) -> None:
        self.server_manager = kwargs["server_manager"]

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        from verl.experimental.agent_loop import AgentLoopOutput
        from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics

        await self.gates[int(kwargs["session_id"])].wait()
        return AgentLoopOutput(
            prompt_ids=[1, 2, 3], response_ids=[4, 5, 6, 7], response_mask=[1, 1, 1, 1],
            metrics=AgentLoopMetrics(), extra_fields={"min_global_steps": 1,
                                                      "max_global_steps": 1},
        )


def test_the_patch_installs_the_worker_veRLs_manager_builds(patched: Any) -> None:
    import verl.trainer.ppo.v1.agent_loop_tq as agent_loop_tq
    from omegaconf import OmegaConf

    from rlix_plugins.patches.verl_agent_loop import RLixAgentLoopWorkerTQ, undecorated

    assert undecorated(agent_loop_tq.AgentLoopWorkerTQ) is RLixAgentLoopWorkerTQ
    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {}, "model": {}}})
    manager = agent_loop_tq.AgentLoopManagerTQ(config=cfg, llm_client=None)
    assert undecorated(manager.agent_loop_workers_class) is RLixAgentLoopWorkerTQ
    patched.revert()
    assert undecorated(agent_loop_tq.AgentLoopWorkerTQ).__name__ == "AgentLoopWorkerTQ"
    assert undecorated(agent_loop_tq.AgentLoopWorkerTQ) is not RLixAgentLoopWorkerTQ


def test_each_stored_trajectory_is_counted_as_it_lands(patched: Any, verl_ray: Any) -> None:
    import transfer_queue as tq

    from tests.support.verl_agent_loop import agent_loop_worker

    with agent_loop_worker(verl_ray, loop_name="rlix_test_echo",
                           loop_target=f"{__name__}.FakeEchoAgentLoop", n=N, data={}) as rig:
        worker, lb = rig.worker, rig.load_balancer

        async def scenario() -> list[int]:
            FakeEchoAgentLoop.gates = {i: asyncio.Event() for i in range(N)}
            prompt = {"uid": "u1", "agent_name": "rlix_test_echo", "global_steps": 1}
            task = asyncio.create_task(worker._run_prompt(
                prompt, {"temperature": 1.0},
                trajectory={"step": 1, "sample_index": 0, "rollout_n": 0, "validate": False},
            ))
            counts = []
            for i in range(N):  # release the sessions one by one
                FakeEchoAgentLoop.gates[i].set()
                for _ in range(500):
                    n = await lb.rlix_pending.remote()
                    if n == i + 1:
                        break
                    await asyncio.sleep(0.01)
                counts.append(n)
                if i < N - 1:  # counted while its group is still running
                    assert tq.kv_list("train")["train"]["u1"]["status"] == "running"
            await task
            return counts

        counts = asyncio.run(scenario())
        assert counts == [1, 2, 3]
        stored = tq.kv_list("train")["train"]
        assert stored["u1"]["status"] == "finished"
        assert sorted(k for k in stored if k != "u1") == [f"u1_{s}_0" for s in range(N)]
        assert verl_ray.get(lb.rlix_consume.remote(N)) == 0
