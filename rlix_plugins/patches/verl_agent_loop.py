"""Per-trajectory progress from veRL's v1 agent loop.

veRL 0.9.1's v1 trainer generates through ``AgentLoopWorkerTQ`` actors (``agent_loop_tq.py``):
each trajectory ends in ``AgentLoopWorkerTQ._agent_loop_postprocess``, which stores it in the
TransferQueue replay buffer. :class:`RLixAgentLoopWorkerTQ` subclasses the undecorated worker
and, once the store returned, counts the stored trajectory (one per session, however many
outputs its agent loop returned) on the pipeline's load balancer
(:meth:`~.verl_routing.RLixRequestLoadBalancer.rlix_trajectory_done`): the one actor all agent
loop workers share. The trainer reads that count as its demand (collected trajectories), so
progress moves per trajectory, not per finished GRPO group.

``AgentLoopManagerTQ.__init__`` looks ``AgentLoopWorkerTQ`` up in its module at call time, so
the patch replaces that module attribute with the Ray actor class of our subclass (Ray freezes
a decorated class: subclassing the decorated one is not possible). Validation trajectories are
not counted (they are not training demand).
"""

from __future__ import annotations

import logging
from typing import Any

from verl.trainer.ppo.v1 import agent_loop_tq

logger = logging.getLogger(__name__)


def undecorated(actor_cls: Any) -> type:
    """The user class behind a ``@ray.remote`` actor class (Ray wraps it in a subclass)."""
    modified = actor_cls.__ray_metadata__.modified_class
    base: type = modified.__bases__[0]
    return base


_AgentLoopWorkerTQ = undecorated(agent_loop_tq.AgentLoopWorkerTQ)


class RLixAgentLoopWorkerTQ(_AgentLoopWorkerTQ):  # type: ignore[misc,valid-type]
    """veRL's TransferQueue agent-loop worker that reports every stored trajectory."""

    async def _agent_loop_postprocess(self, output: Any, validate: Any, **kwargs: Any) -> None:
        await super()._agent_loop_postprocess(output, validate, **kwargs)
        if validate:
            return
        # One session is one trajectory, however many outputs (rows) its agent loop returned:
        # the trainer consumes, and the step target counts, train_batch_size * rollout.n
        # sessions. An empty list stored nothing.
        if not isinstance(output, list) or output:
            await report_trajectories(self.llm_client, 1)


async def report_trajectories(llm_client: Any, n: int) -> None:
    """Count ``n`` stored trajectories on the client's load balancer (RLix balancer only).

    Progress is advisory: a failed report is logged, never raised into the agent loop.
    """
    lb = getattr(llm_client, "_load_balancer", None)
    if lb is None or not hasattr(lb, "rlix_trajectory_done"):
        return
    try:
        await lb.rlix_trajectory_done.remote(n)
    except Exception:
        logger.exception("progress report of %d trajectories failed", n)


def rlix_agent_loop_worker_actor() -> Any:
    """The Ray actor class installed as ``agent_loop_tq.AgentLoopWorkerTQ``."""
    import ray

    return ray.remote(RLixAgentLoopWorkerTQ)
