"""veRL patch routing, checkpoint and progress regressions (real verl 0.9.1, no Ray actors)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest

from tests.fixtures.verl_env import VerlEnv

pytestmark = pytest.mark.verl


class _Done:
    """What a Ray ``.remote()`` call returns here: an awaitable that already holds its value."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __await__(self) -> Any:
        if False:  # pragma: no cover - makes this a generator
            yield
        return self.value


class _Method:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> _Done:
        return _Done(self._fn(*args, **kwargs))


class _Handle:
    """An in-process stand-in for a Ray actor handle over ``obj`` (sync methods only)."""

    def __init__(self, obj: Any) -> None:
        self._obj = obj

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self._obj, name))


# ---------------------------------------------------------------- routing: response budget
class _ServerStandIn:
    """A veRL vLLM server actor's ``generate.remote(...)``, served by ``_generate``."""

    async def _generate(self, **kwargs: Any) -> Any:
        raise NotImplementedError

    @property
    def generate(self) -> Any:
        server = self

        class _Gen:
            def remote(self, **kwargs: Any) -> Any:
                return server._generate(**kwargs)

        return _Gen()


class _AbortOnceServer(_ServerStandIn):
    """veRL's vLLM server default budget (no ``max_tokens``): min(response_length,
    prompt_length + response_length - len(prompt)); the first attempt is aborted halfway."""

    def __init__(self, prompt_length: int, response_length: int) -> None:
        self.prompt_length = prompt_length
        self.response_length = response_length
        self.calls: list[dict[str, Any]] = []

    async def _generate(self, *, request_id: str, prompt_ids: list[int],
                        sampling_params: dict[str, Any], **_: Any) -> Any:
        from verl.workers.rollout.replica import TokenOutput

        self.calls.append(dict(sampling_params))
        cap = min(self.response_length,
                  self.prompt_length + self.response_length - len(prompt_ids))
        n = int(sampling_params.get("max_tokens", cap))
        if len(self.calls) == 1:
            half = n // 2
            return TokenOutput(token_ids=[1] * half, log_probs=[-0.1] * half,
                               stop_reason="aborted")
        return TokenOutput(token_ids=[2] * n, log_probs=[-0.2] * n, stop_reason="length")


def test_continuation_without_max_tokens_keeps_the_response_budget(verl_env: VerlEnv) -> None:
    """A preempted request of a job that sets no ``max_tokens`` (veRL's default) must not get
    a fresh response budget on its continuation: the total stays <= response_length."""
    from omegaconf import OmegaConf

    from rlix_plugins.patches.verl_routing import RLixLLMServerClient, RLixRequestLoadBalancer

    prompt_length, response_length = 16, 20
    server = _AbortOnceServer(prompt_length, response_length)
    lb = RLixRequestLoadBalancer({"s0": server})
    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {
        "name": "vllm", "full_determinism": False,
        "prompt_length": prompt_length, "response_length": response_length,
    }}})
    client = RLixLLMServerClient(config=cfg, load_balancer_handle=_Handle(lb))
    out = asyncio.run(client.generate("r", prompt_ids=[9] * 4, sampling_params={}))
    assert len(out.token_ids) <= response_length, (len(out.token_ids), server.calls)
    assert len(out.token_ids) == response_length  # the budget is used, not cut short
    assert server.calls[0] == {}  # the first attempt is veRL's own, unchanged
    assert out.num_preempted == 1


class _RoutedServer(_ServerStandIn):
    """Returns MoE routing rows for prompt + generated tokens (one row per token, tagged with
    the attempt) and a prefix-cache hit count; the first attempt is aborted after 3 tokens."""

    def __init__(self) -> None:
        self.attempts = 0

    async def _generate(self, *, request_id: str, prompt_ids: list[int],
                        sampling_params: dict[str, Any], **_: Any) -> Any:
        import numpy as np
        from verl.workers.rollout.replica import TokenOutput

        self.attempts += 1
        n = 3 if self.attempts == 1 else int(sampling_params["max_tokens"])
        rows = np.full((len(prompt_ids) + n, 2), self.attempts)
        return TokenOutput(
            token_ids=[self.attempts] * n, log_probs=[-0.1] * n, routed_experts=rows,
            stop_reason="aborted" if self.attempts == 1 else "length",
            extra_fields={"num_cached_tokens": 10 * self.attempts},
        )


def test_continuation_keeps_each_tokens_routing_and_the_first_prefix_hit(
    verl_env: VerlEnv,
) -> None:
    """MoE router replay needs the routing each token had when it was generated: the earlier
    tokens' rows from the first attempt (a continuation's prefill re-routes them), only the new
    tokens' rows from the continuation; the prefix-cache hit count is the first prefill's."""
    from omegaconf import OmegaConf

    from rlix_plugins.patches.verl_routing import RLixLLMServerClient, RLixRequestLoadBalancer

    server = _RoutedServer()
    lb = RLixRequestLoadBalancer({"s0": server})
    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {
        "name": "vllm", "full_determinism": False, "response_length": 8,
    }}})
    client = RLixLLMServerClient(config=cfg, load_balancer_handle=_Handle(lb))
    out = asyncio.run(client.generate("r", prompt_ids=[9] * 4,
                                      sampling_params={"max_tokens": 8}))
    assert out.token_ids == [1, 1, 1, 2, 2, 2, 2, 2]
    # 4 prompt rows + 3 tokens from attempt 1, then the 5 new tokens' rows from attempt 2
    assert out.routed_experts[:, 0].tolist() == [1] * 7 + [2] * 5
    assert out.extra_fields["num_cached_tokens"] == 10


# ---------------------------------------------------------------- routing: bind_shards input
def test_trajectory_counts_refuse_what_is_not_a_count(verl_env: VerlEnv) -> None:
    """A bool or a float would be added to the pipeline's progress count as is."""
    from rlix_plugins.patches.verl_routing import RLixRequestLoadBalancer

    lb = RLixRequestLoadBalancer({"a": object()})
    assert lb.rlix_trajectory_done(3) == 3
    for bad in (True, 1.5, -1, "2"):
        with pytest.raises(ValueError, match=r"rlix_trajectory_done: n=.* valid: an int >= 0"):
            lb.rlix_trajectory_done(bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"rlix_consume: n=.* valid: an int >= 0"):
            lb.rlix_consume(bad)  # type: ignore[arg-type]
    assert lb.rlix_consume(2) == 1 and lb.rlix_pending() == 1


def test_bind_shards_bad_input_is_typed_and_changes_nothing(verl_env: VerlEnv) -> None:
    from rlix_plugins.errors import ShardStateError
    from rlix_plugins.generation.migration import MigrationConfig
    from rlix_plugins.patches.verl_routing import RLixRequestLoadBalancer

    lb = RLixRequestLoadBalancer({"a": object(), "b": object()})
    before = lb.migration()
    off = MigrationConfig(enabled=False)
    with pytest.raises(ShardStateError, match=r"'bogus'.*valid.*active"):
        lb.bind_shards([("a", object())], initial="bogus", migration=off)
    assert lb.migration() == before
    with pytest.raises(ShardStateError, match=r"'a'.*more than once"):
        lb.bind_shards([("a", object()), ("a", object())], migration=off)
    assert lb.migration() == before
    lb.bind_shards([("a", object()), ("b", object())])
    with pytest.raises(ShardStateError, match="already bound"):
        lb.bind_shards([("a", object())], migration=off)
    assert lb.migration() == before  # a refused second bind leaves the config alone
    with pytest.raises(ShardStateError, match=r"'bogus'.*valid.*preempt"):
        lb.apply_shard_event([0], "bogus")
    assert lb.shard_snapshot().active == (0, 1)


# ---------------------------------------------------------------- checkpoint: receiver thread
def test_receive_weights_stops_its_thread_when_the_loader_fails(
    verl_env: VerlEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """veRL's loader raising mid-stream must not leave the receiving thread (and its socket
    and buckets) blocked forever on the full hand-over queue."""
    import torch

    import rlix_plugins.training.receiver as receiver
    from rlix_plugins.patches.verl_checkpoint import RLixCacheCheckpointEngine

    stopped = threading.Event()
    handed = []

    def fake_receive(offer: Any, load: Callable[[list[tuple[str, Any]]], None]) -> None:
        try:
            for i in range(10):
                load([(f"w{i}", torch.zeros(2))])
                handed.append(i)
        finally:
            stopped.set()

    monkeypatch.setattr(receiver, "receive_weights", fake_receive)

    class _Offer:
        version = 3

    engine = RLixCacheCheckpointEngine(bucket_size=1 << 20)
    monkeypatch.setattr(engine, "_take_offer", lambda version: _Offer())

    async def broken_loader() -> None:
        async for _name, _t in engine.receive_weights(3):
            raise RuntimeError("shape mismatch in load_weights")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        asyncio.run(broken_loader())
    assert stopped.wait(5.0), f"receiving thread still blocked after {handed}"
    assert engine.loaded_versions == []


def test_taking_an_offer_drops_the_older_ones(verl_env: VerlEnv) -> None:
    """Offers of versions older than the one taken are never taken: they are not kept."""
    from rlix_plugins.errors import WeightSyncError
    from rlix_plugins.patches.verl_checkpoint import RLixCacheCheckpointEngine
    from rlix_plugins.training.checksum import ChecksumKind
    from rlix_plugins.training.wire import SyncOffer, TransportKind

    engine = RLixCacheCheckpointEngine(bucket_size=1 << 20, offer_wait_s=0.1)
    for v in (1, 2, 3):
        engine.rlix_accept_offer(SyncOffer(
            pipeline_id="p", sync_id=f"s{v}", shard_id="r0", version=v,
            transport=TransportKind.ZMQ, control_address="", num_buckets=0, total_bytes=0,
            max_bucket_bytes=16, checksum=ChecksumKind.FLETCHER64, timeout_s=1.0, details={},
        ).to_dict())
    assert engine._take_offer(2).sync_id == "s2"
    assert sorted(engine._offers) == [3]
    assert engine._take_offer(None).version == 3
    with pytest.raises(WeightSyncError, match="no offer for weight version 1"):
        engine._take_offer(1)


def test_two_offers_of_one_version_each_reach_a_receive(verl_env: VerlEnv) -> None:
    """A trainer's in-place refresh and an expand's catch-up can both sync the newest version
    to one replica; the second offer overwrote the first, whose sender then waited its whole
    timeout for a receiver that never came."""
    from rlix_plugins.patches.verl_checkpoint import RLixCacheCheckpointEngine
    from rlix_plugins.training.checksum import ChecksumKind
    from rlix_plugins.training.wire import SyncOffer, TransportKind

    engine = RLixCacheCheckpointEngine(bucket_size=1 << 20, offer_wait_s=0.1)
    for sync_id in ("refresh", "expand"):
        engine.rlix_accept_offer(SyncOffer(
            pipeline_id="p", sync_id=sync_id, shard_id="r0", version=4,
            transport=TransportKind.ZMQ, control_address="", num_buckets=0, total_bytes=0,
            max_bucket_bytes=16, checksum=ChecksumKind.FLETCHER64, timeout_s=1.0, details={},
        ).to_dict())
    assert [engine._take_offer(4).sync_id, engine._take_offer(None).sync_id] == [
        "refresh", "expand"]
    assert engine._offers == {}


# ---------------------------------------------------------------- checkpoint: refresh abort
def test_refresh_resumes_replicas_when_an_abort_fails(verl_env: VerlEnv) -> None:
    """An in-place refresh whose abort fails on one replica must still resume the replicas it
    paused (a closed gate would reject every request routed there)."""
    from tests.support.verl_checkpoint import bare_refresh_manager

    class _Replica:
        def __init__(self, fail: bool) -> None:
            self.fail = fail
            self.paused = False

        async def abort_all_requests(self) -> None:
            self.paused = True
            if self.fail:
                raise RuntimeError("server died")

        async def resume_generation(self) -> None:
            self.paused = False

    good, bad = _Replica(False), _Replica(True)
    mgr = bare_refresh_manager([good, bad])
    with pytest.raises(RuntimeError, match="server died"):
        mgr._refresh(5, {})
    assert not good.paused and not bad.paused


# ---------------------------------------------------------------- trainer: progress thread
def test_close_lets_an_inflight_progress_report_land_before_clearing(
    verl_env: VerlEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A progress report in flight when the run ends must not land after the adapter cleared
    the progress (the coordinator would see demand from a finished job), and the progress
    thread must be gone once close returns."""
    import ray

    from rlix_plugins.patches import verl_trainer

    events: list[str] = []
    release = threading.Event()

    class _Adapter:
        def report_collected(self, collected: int, step: int, outstanding: int) -> None:
            events.append("report")
            release.wait(5.0)
            events.append("report done")

        def close(self) -> None:
            events.append("clear")

    class _Lb:
        class rlix_progress_counts:  # a Ray actor method stand-in
            @staticmethod
            def remote() -> tuple[int, int]:
                return (1, 0)

    monkeypatch.setattr(verl_trainer, "PROGRESS_PERIOD_S", 0.01)
    monkeypatch.setattr(verl_trainer, "routing_load_balancer", lambda trainer: _Lb())
    monkeypatch.setattr(ray, "get", lambda ref, **_: ref)

    class _Trainer(verl_trainer.RLixTrainerMixin):
        pass

    trainer = _Trainer()
    trainer.global_steps = 1
    trainer._rlix_adapter = _Adapter()
    trainer._start_progress()
    for _ in range(500):
        if events:
            break
        threading.Event().wait(0.01)
    assert events == ["report"]
    threading.Timer(0.3, release.set).start()
    trainer._rlix_close()
    assert events[-1] == "clear", events
    assert "report done" in events and events.count("report") == 1, events
    assert not [t for t in threading.enumerate() if t.name == "rlix-verl-progress"]


# ---------------------------------------------------------------- routing: continuation params
class _MinTokensServer(_ServerStandIn):
    """Checks each attempt's sampling params with vLLM's own ``SamplingParams`` (as veRL's
    server builds them) and aborts the first attempt after ``first`` tokens."""

    def __init__(self, first: int) -> None:
        self.first = first
        self.calls: list[dict[str, Any]] = []

    async def _generate(self, **kwargs: Any) -> Any:
        from verl.workers.rollout.replica import TokenOutput
        from vllm import SamplingParams

        params = dict(kwargs["sampling_params"])
        self.calls.append(dict(params))
        n = int(params.pop("max_tokens"))
        SamplingParams(max_tokens=n, **params)  # raises like the server would
        if len(self.calls) == 1:
            return TokenOutput(token_ids=[1] * self.first, log_probs=[-0.1] * self.first,
                               stop_reason="aborted")
        return TokenOutput(token_ids=[2] * n, log_probs=[-0.2] * n, stop_reason="completed")


@pytest.mark.parametrize(("first", "left_min"), [(40, 0), (10, 22)])
def test_continuation_lowers_min_tokens_by_the_tokens_kept(
    verl_env: VerlEnv, first: int, left_min: int
) -> None:
    """``min_tokens`` counts the whole response: a continuation that kept ``first`` tokens
    needs only the rest. Sent unchanged it made vLLM reject the continuation (min_tokens >
    the remaining max_tokens: the request was lost) or forced extra tokens past an EOS."""
    from omegaconf import OmegaConf

    from rlix_plugins.patches.verl_routing import RLixLLMServerClient, RLixRequestLoadBalancer

    server = _MinTokensServer(first)
    lb = RLixRequestLoadBalancer({"s0": server})
    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {
        "name": "vllm", "full_determinism": False}}})
    client = RLixLLMServerClient(config=cfg, load_balancer_handle=_Handle(lb))
    out = asyncio.run(client.generate("r", prompt_ids=[9] * 4,
                                      sampling_params={"max_tokens": 64, "min_tokens": 32}))
    assert len(out.token_ids) == len(out.log_probs) == 64
    assert server.calls[0]["min_tokens"] == 32
    assert server.calls[1]["min_tokens"] == left_min
    assert server.calls[1]["max_tokens"] == 64 - first
    assert client.counters().completed == 1


# ---------------------------------------------------------------- routing: cancelled acquire
class _SlowMethod:
    """A Ray actor call: the actor runs it when it is submitted, whether or not the caller
    still awaits the reply, which arrives a little later."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        value = self._fn(*args, **kwargs)
        loop = asyncio.get_running_loop()
        reply = loop.create_future()
        def answer() -> None:
            if not reply.done():  # the caller may have given up (cancelled) meanwhile
                reply.set_result(value)

        loop.call_later(0.05, answer)
        return reply


class _SlowHandle(_Handle):
    def __getattr__(self, name: str) -> Any:
        return _SlowMethod(getattr(self._obj, name))


class _NeverServer(_ServerStandIn):
    async def _generate(self, **kwargs: Any) -> Any:
        await asyncio.sleep(3600)


def test_a_request_cancelled_while_acquiring_releases_its_server(verl_env: VerlEnv) -> None:
    """A rollout cancelled while its acquire is in flight: the balancer still counted the
    acquire (Ray runs the call anyway), and nothing released it, so the replica's in-flight
    count and the ``outstanding`` demand it reports stayed high for good."""
    from omegaconf import OmegaConf

    from rlix_plugins.patches.verl_routing import RLixLLMServerClient, RLixRequestLoadBalancer

    lb = RLixRequestLoadBalancer({})
    lb.bind_shards([("s0", _NeverServer())])
    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {
        "name": "vllm", "full_determinism": False}}})
    client = RLixLLMServerClient(config=cfg, load_balancer_handle=_SlowHandle(lb))

    async def scenario() -> None:
        # Learn the balancer's fields first, so the next acquire is the actor call itself.
        task = asyncio.ensure_future(client.generate(
            "warm", prompt_ids=[1], sampling_params={"max_tokens": 2}))
        await asyncio.sleep(0.2)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.1)
        assert lb.rlix_outstanding() == 0
        task = asyncio.ensure_future(client.generate(
            "r", prompt_ids=[1], sampling_params={"max_tokens": 2}))
        await asyncio.sleep(0.01)  # the acquire was submitted, its reply not back yet
        assert lb.rlix_outstanding() == 1
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.2)

    asyncio.run(scenario())
    assert lb.rlix_outstanding() == 0, lb.get_status()
    assert lb.rlix_running() == {}
    c = client.counters()
    assert (c.cancelled, c.in_flight) == (2, 0)


def test_no_active_replica_is_a_typed_error_naming_the_bound(verl_env: VerlEnv) -> None:
    """Every replica preempted: the client waits ``wait_timeout_s``, then fails the request
    with NoActiveShardError naming the bound and the setting; nothing stays in flight."""
    from omegaconf import OmegaConf

    from rlix_plugins.errors import NoActiveShardError
    from rlix_plugins.patches.verl_routing import RLixLLMServerClient, RLixRequestLoadBalancer

    lb = RLixRequestLoadBalancer({})
    lb.bind_shards([("s0", _NeverServer())])
    lb.apply_shard_event([0], "preempt")
    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {
        "name": "vllm", "full_determinism": False}}})
    client = RLixLLMServerClient(config=cfg, load_balancer_handle=_Handle(lb),
                                 wait_timeout_s=0.3)
    with pytest.raises(NoActiveShardError, match=r"0\.3s.*RLIX_REQUEST_TIMEOUT_S"):
        asyncio.run(client.generate("r", prompt_ids=[1], sampling_params={"max_tokens": 2}))
    assert lb.rlix_outstanding() == 0
    c = client.counters()
    assert (c.lost, c.in_flight) == (1, 0)
