"""The request ledger of the RLix veRL client: what counts as a duplicate, a loss, a re-dispatch.

Real parts: veRL's router factory building the RLix load balancer (a Ray actor), the RLix
client subclass of veRL's ``LLMServerClient`` (veRL's own ``generate`` / acquire / release
code), the ledger and the observation records. :class:`FakeScriptedServer` stands in for veRL's
vLLM server: the loss and duplicate paths need an engine that aborts on every attempt or a
caller that resubmits, which a real engine cannot be made to do on demand (the real preemption
path is covered by ``test_verl_routing.py``).
"""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.verl_env import VerlEnv

pytestmark = [pytest.mark.verl, pytest.mark.integration]

PIPELINE = "ft_verlledger001"


class FakeScriptedServer:
    """Stands in for veRL's vLLM server: answers ``generate`` with ``max_tokens`` tokens, or
    with one token and ``stop_reason="aborted"`` while ``abort_all`` is on."""

    def __init__(self) -> None:
        self.abort_all = False
        self.calls = 0

    def set_abort_all(self, on: bool) -> None:
        self.abort_all = on

    async def generate(self, *, request_id: str, prompt_ids: list[int],
                       sampling_params: dict[str, Any], **_: Any) -> Any:
        from verl.workers.rollout.replica import TokenOutput

        self.calls += 1
        if self.abort_all:
            return TokenOutput(token_ids=[7], log_probs=[-0.5], stop_reason="aborted")
        n = int(sampling_params["max_tokens"])
        return TokenOutput(token_ids=[5] * n, log_probs=[-0.1] * n, stop_reason="completed")


@pytest.fixture
def routed(verl_env: VerlEnv, verl_ray: Any) -> Iterator[tuple[Any, Any]]:
    from verl.workers.rollout.router import get_router_handle

    from rlix_plugins.patches.verl import VerlPatch

    patch = VerlPatch()
    patch.apply()
    server = verl_ray.remote(num_cpus=0)(FakeScriptedServer).remote()
    lb = get_router_handle({"fake-0": server})
    verl_ray.get(lb.bind_shards.remote([("fake-0", server)]))
    try:
        yield lb, server
    finally:
        verl_ray.kill(lb)
        verl_ray.kill(server)
        patch.revert()


def _client(lb: Any, **kwargs: Any) -> Any:
    from omegaconf import OmegaConf

    from rlix_plugins.patches.verl_routing import RLixLLMServerClient

    cfg = OmegaConf.create(
        {"actor_rollout_ref": {"rollout": {"name": "vllm", "full_determinism": False}}}
    )
    return RLixLLMServerClient(config=cfg, load_balancer_handle=lb, **kwargs)


def test_ledger_counts_turns_duplicates_losses_and_copies(
    routed: tuple[Any, Any], verl_ray: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlix_plugins.adapters.observability import read_observations
    from rlix_plugins.errors import ShardPreemptedError

    lb, server = routed
    observe = tmp_path / "observe"
    monkeypatch.setenv("RLIX_OBSERVE_DIR", str(observe))
    monkeypatch.setenv("PIPELINE_ID", PIPELINE)
    client = _client(lb, max_attempts=3)
    params = {"max_tokens": 4}

    async def scenario() -> None:
        # Two turns of one multi-turn trajectory share the request id (veRL's sticky id):
        # the second turn's prompt is longer, so it is a new sample, not a duplicate.
        await client.generate("traj-1", prompt_ids=[1, 2], sampling_params=params)
        await client.generate("traj-1", prompt_ids=[1, 2, 5, 5, 5, 5, 9], sampling_params=params)
        c = client.counters()
        assert (c.submitted, c.completed, c.duplicated) == (2, 2, 0)
        # The same turn submitted again is a duplicate (it still completes).
        await client.generate("traj-1", prompt_ids=[1, 2], sampling_params=params)
        assert client.counters().duplicated == 1
        # Aborted on every attempt: lost, after max_attempts - 1 re-dispatches.
        await server.set_abort_all.remote(True)
        with pytest.raises(ShardPreemptedError, match="aborted 3 times"):
            await client.generate("traj-2", prompt_ids=[3], sampling_params=params)

    asyncio.run(scenario())
    c = client.counters()
    assert (c.submitted, c.completed, c.lost, c.duplicated, c.redispatched, c.in_flight) == (
        4, 3, 1, 1, 2, 0)
    assert verl_ray.get(server.__ray_call__.remote(lambda self: self.calls)) == 3 + 3

    # The loss forced a record; the last record of this copy is the final bookkeeping.
    obs = read_observations(observe)
    mine = [r for r in obs.router_counters if r.copy_id == c.copy_id]
    assert mine and mine[-1].lost == 1 and mine[-1].submitted == 4
    assert mine[-1].pipeline_id == PIPELINE

    # A pickled copy (as sent to another process) routes with its own, empty ledger.
    copy = pickle.loads(pickle.dumps(client))
    assert copy.counters().copy_id != c.copy_id and copy.counters().submitted == 0


def test_no_records_without_observe_dir(
    routed: tuple[Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lb, _ = routed
    monkeypatch.delenv("RLIX_OBSERVE_DIR", raising=False)
    client = _client(lb)
    out = asyncio.run(client.generate("r", prompt_ids=[1], sampling_params={"max_tokens": 2}))
    assert len(out.token_ids) == 2
    assert client.counters().completed == 1
    assert not list(tmp_path.rglob("*.jsonl"))
