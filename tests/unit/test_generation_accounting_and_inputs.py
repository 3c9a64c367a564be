"""Generation counters, logprobs, input checks, migration planning: each test failed before its fix.

Engines here are FAKES (a unit test cannot start vLLM); the router, state owner, views and
state machine are the real ones.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from typing import Any

import pytest

from rlix_plugins.errors import (
    LastActiveShardError,
    NoActiveShardError,
    ProtocolError,
    SettingsError,
    ShardPreemptedError,
    ShardStateError,
)
from rlix_plugins.generation import (
    EngineOutput,
    GenerationRequest,
    LocalShardState,
    MigrationConfig,
    PreemptionConfig,
    RayShardState,
    RedispatchMode,
    RouterConfig,
    ShardEvent,
    ShardRouter,
    ShardSnapshot,
    ShardStateStore,
    VllmAsyncShard,
    apply_event,
)
from rlix_plugins.generation import ray_state as ray_state_module
from rlix_plugins.generation.shard_state import check_event
from tests.support.recording_engine import IdleLifecycleEngine
from tests.unit.test_generation_router_migration import FakeAbortableEngine


class FakeScriptedEngine(IdleLifecycleEngine):
    """FAKE ShardEngine whose attempts return (or raise) scripted outcomes in order; the last
    outcome repeats. Records every attempt it received."""

    def __init__(self, outcomes: Sequence[EngineOutput | BaseException]) -> None:
        self.outcomes = list(outcomes)
        self.received: list[GenerationRequest] = []

    async def generate(self, request: GenerationRequest) -> EngineOutput:
        self.received.append(request)
        outcome = self.outcomes[min(len(self.received), len(self.outcomes)) - 1]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


def _router(engine: FakeScriptedEngine, **config: Any) -> ShardRouter:
    return ShardRouter(LocalShardState(ShardStateStore(1)), [engine], RouterConfig(**config))


# -- counters ----------------------------------------------------------------------------------


def test_redispatched_counts_only_attempts_that_were_sent_again() -> None:
    # The cut that used up max_attempts was counted as re-dispatched though the request was
    # lost instead (3 dispatches reported 3 re-dispatches, veRL's client counts attempts - 1),
    # and so was a cut whose partial output already held every token (returned, not re-sent).
    async def go() -> None:
        engine = FakeScriptedEngine([ShardPreemptedError("FAKE shard gone")])
        router = _router(engine, max_attempts=3)
        with pytest.raises(ShardPreemptedError, match="each of its 3 dispatches"):
            await router.generate(GenerationRequest("lost", (1, 2), 4))
        assert len(engine.received) == 3
        c = router.counters()
        assert (c.submitted, c.lost, c.redispatched) == (1, 1, 2)
        assert router.stats().redispatched == 2

        full = FakeScriptedEngine([EngineOutput((5, 6, 7, 8), "abort")])
        router = _router(full, redispatch=RedispatchMode.CONTINUE)
        result = await router.generate(GenerationRequest("whole", (1, 2), 4))
        assert result.token_ids == (5, 6, 7, 8) and result.attempts == 1
        assert len(full.received) == 1
        assert router.counters().redispatched == 0

    asyncio.run(go())


# -- logprob alignment ---------------------------------------------------------------------------


@pytest.mark.parametrize("segments", [
    # a partial without logprobs, then the rest with them
    [EngineOutput((5, 6), "abort", None), EngineOutput((7, 8), "length", (-0.7, -0.8))],
    # partial with, partial without, rest with
    [EngineOutput((5,), "abort", (-0.5,)), EngineOutput((6,), "abort", None),
     EngineOutput((7, 8), "length", (-0.7, -0.8))],
])
def test_continued_logprobs_are_never_misaligned_with_the_tokens(
    segments: list[EngineOutput],
) -> None:
    # A continued sample concatenated only the segments that had logprobs: 4 tokens came
    # back with 2 or 3 logprobs, silently shifted against the tokens they belong to.
    async def go() -> None:
        engine = FakeScriptedEngine(segments)
        router = _router(engine, redispatch=RedispatchMode.CONTINUE)
        result = await router.generate(
            GenerationRequest("r", (1, 2), 4, {"logprobs": 0}))
        assert result.token_ids == (5, 6, 7, 8)
        assert result.logprobs is None  # unknown for some tokens: none rather than shifted

    asyncio.run(go())


def test_continued_logprobs_of_every_segment_are_concatenated() -> None:
    # (guard for the fix above: complete logprobs still concatenate)
    async def go() -> None:
        engine = FakeScriptedEngine([EngineOutput((5,), "abort", (-0.5,)),
                                     EngineOutput((6, 7, 8), "length", (-0.6, -0.7, -0.8))])
        result = await _router(engine, redispatch=RedispatchMode.CONTINUE).generate(
            GenerationRequest("r", (1, 2), 4, {"logprobs": 0}))
        assert result.logprobs == (-0.5, -0.6, -0.7, -0.8)
        assert engine.received[1].prompt_token_ids == (1, 2, 5)
        assert engine.received[1].max_tokens == 3

    asyncio.run(go())


# -- state machine inputs --------------------------------------------------------------------------


def test_last_active_policy_given_as_its_string_value_is_honoured() -> None:
    # apply_event(..., "refuse") compared the string with `is LastActivePolicy.REFUSE`, so the
    # policy was silently ignored and the last active shard was taken down.
    snap = ShardSnapshot.initial(1)
    with pytest.raises(LastActiveShardError, match="would leave no active shard"):
        apply_event(snap, [0], ShardEvent.PREEMPT, "refuse")  # type: ignore[arg-type]
    with pytest.raises(LastActiveShardError):
        check_event(snap, [0], "preempt", "refuse")  # type: ignore[arg-type]


@pytest.mark.parametrize(("call", "message"), [
    (lambda s: apply_event(s, [0], "bogus"),
     r"unknown shard event 'bogus'; valid values are \['activate', 'asleep', 'preempt', 'wake'\]"),
    (lambda s: apply_event(s, [0], ShardEvent.PREEMPT, "maybe"),
     r"unknown last-active policy 'maybe'; valid values are \['allow', 'refuse'\]"),
])
def test_unknown_event_or_policy_is_a_typed_error(call: Any, message: str) -> None:
    snap = ShardSnapshot.initial(2)
    with pytest.raises(ShardStateError, match=message):
        call(snap)


@pytest.mark.parametrize(("args", "kwargs", "message"), [
    ((True,), {}, "num_shards must be an int >= 1, got True"),
    (("2",), {}, "num_shards must be an int >= 1, got '2'"),
    ((2.0,), {}, "num_shards must be an int >= 1, got 2.0"),
    ((2,), {"initial": "asleep"},
     r"initial status 'asleep' is not valid; expected 'active' or 'sleeping'"),
    ((2,), {"last_active": "never"},
     r"unknown last-active policy 'never'; valid values are \['allow', 'refuse'\]"),
])
def test_store_arguments_get_typed_errors(
    args: tuple[Any, ...], kwargs: dict[str, Any], message: str
) -> None:
    # ShardStateStore(True) built a 1-shard store; "2" and 2.0 raised TypeError; unknown
    # status or policy strings raised enum ValueErrors that did not list the valid values.
    with pytest.raises(ShardStateError, match=message):
        ShardStateStore(*args, **kwargs)


def test_ray_state_create_checks_the_policy_before_starting_an_actor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_actor() -> Any:
        raise AssertionError("an actor was started for invalid arguments")

    monkeypatch.setattr(ray_state_module, "_actor_class", no_actor)
    with pytest.raises(ShardStateError, match="unknown last-active policy 'never'"):
        RayShardState.create(2, last_active="never")  # type: ignore[arg-type]


# -- rebalance arguments ---------------------------------------------------------------------------


@pytest.mark.parametrize(("ranks", "message"), [
    ([7], "dp rank 7 does not exist; valid ranks are 0..1"),
    (["1"], "dp rank must be an int, got '1'"),
    (1, "dp ranks must be an iterable of ints"),
])
def test_rebalance_rejects_ranks_that_do_not_exist(ranks: Any, message: str) -> None:
    # rebalance([7]) silently did nothing (a typo'd rank migrated no request), rebalance(1)
    # raised an untyped TypeError.
    async def go() -> None:
        store = ShardStateStore(2)
        router = ShardRouter(LocalShardState(store),
                             [FakeAbortableEngine(), FakeAbortableEngine()])
        before = store.snapshot()
        with pytest.raises(ShardStateError, match=message):
            await router.rebalance(ranks)
        assert store.snapshot() is before
        assert await router.rebalance() == ()  # valid calls still work (nothing running)
        assert await router.rebalance([]) == ()

    asyncio.run(go())


# -- configuration values ---------------------------------------------------------------


@pytest.mark.parametrize(("build", "message"), [
    (lambda: RouterConfig(max_attempts=True), "max_attempts must be an int >= 1, got True"),
    (lambda: RouterConfig(max_attempts=2.5), "max_attempts must be an int >= 1, got 2.5"),
    (lambda: RouterConfig(max_attempts="3"), "max_attempts must be an int >= 1, got '3'"),
    (lambda: RouterConfig(wait_timeout_s="5"), "wait_timeout_s must be > 0, got '5'"),
    (lambda: RouterConfig(wait_timeout_s=float("nan")), "wait_timeout_s must be > 0, got nan"),
    (lambda: RouterConfig(migration={"bogus": 1}),
     r"unknown migration field\(s\) \['bogus'\]; valid fields are \['auto', 'enabled'"),
    (lambda: MigrationConfig(enabled="false"), "enabled must be a bool, got 'false'"),
    (lambda: MigrationConfig(auto=1), "auto must be a bool, got 1"),
    (lambda: MigrationConfig(min_gap=2.5), "min_gap must be an int >= 2"),
    (lambda: MigrationConfig(min_remaining_tokens="16"),
     "min_remaining_tokens must be an int >= 0, got '16'"),
    (lambda: MigrationConfig(max_per_request=True), "max_per_request must be an int >= 1"),
    (lambda: MigrationConfig(watch_interval_s="1"), "watch_interval_s must be > 0, got '1'"),
    (lambda: PreemptionConfig(sleep_level=True), "sleep_level must be None, 0, 1 or 2, got True"),
    (lambda: PreemptionConfig(sleep_level=1.0), "sleep_level must be None, 0, 1 or 2, got 1.0"),
    (lambda: PreemptionConfig(drain_timeout_s="1"), "drain_timeout_s must be > 0, got '1'"),
    (lambda: PreemptionConfig(drain_poll_s=None), "drain_poll_s must be > 0, got None"),
    (lambda: VllmAsyncShard(object(), sleep_level=True), "sleep_level must be 0, 1 or 2"),
])
def test_config_values_of_the_wrong_type_get_a_typed_error(build: Any, message: str) -> None:
    # Before: True and 2.5 accepted as attempt counts and gaps, "false" read as enabled, and
    # strings failed with TypeError('<' not supported ...) naming neither field nor domain.
    with pytest.raises(SettingsError, match=message):
        build()


# -- vLLM wrapper input ---------------------------------------------------------------------------


class FakeAsyncLlm:
    """FAKE AsyncLLM that must never be reached by a request the wrapper refuses."""

    def generate(self, *args: Any) -> Any:
        raise AssertionError("the engine was reached")

    def get_num_unfinished_requests(self) -> int:
        return 0


@pytest.mark.parametrize("key", ["max_tokens", "output_kind"])
def test_sampling_options_the_wrapper_sets_are_refused_with_a_typed_error(key: str) -> None:
    # sampling={"max_tokens": ...} failed in SamplingParams with TypeError('got multiple
    # values for keyword argument'): an untyped error, and the request counted as submitted.
    async def go() -> None:
        shard = VllmAsyncShard(FakeAsyncLlm())
        with pytest.raises(ProtocolError, match=f"'{key}'.*set by the engine wrapper"):
            await shard.generate(GenerationRequest("r:a1", (1, 2), 4, {key: 3}))
        assert shard.submitted_total == 0 and await shard.num_running() == 0

    asyncio.run(go())


class SelfPreemptingEngine(FakeScriptedEngine):
    """FAKE engine whose shard is preempted while it runs the attempt (never woken again)."""

    def __init__(self, store: ShardStateStore) -> None:
        super().__init__([EngineOutput((1, 2), "abort")])
        self.store = store

    async def generate(self, request: GenerationRequest) -> EngineOutput:
        self.store.apply([0], ShardEvent.PREEMPT)
        return await super().generate(request)


def test_a_cut_is_counted_only_once_the_request_is_really_sent_again() -> None:
    # The cut was counted as re-dispatched at once, though no shard came back before the
    # wait timed out and the request was lost without a second dispatch.
    async def go() -> None:
        store = ShardStateStore(1)
        engine = SelfPreemptingEngine(store)
        router = ShardRouter(LocalShardState(store), [engine], RouterConfig(wait_timeout_s=0.05))
        with pytest.raises(NoActiveShardError):
            await router.generate(GenerationRequest("r", (1,), 8))
        c = router.counters()
        assert len(engine.received) == 1
        assert (c.submitted, c.lost, c.redispatched, c.migrated) == (1, 1, 0, 0)

    asyncio.run(go())


def test_a_router_refuses_what_is_not_a_request_before_recording_it() -> None:
    # An AttributeError from deep in generate before, with nothing saying what was wrong.
    async def go() -> None:
        engine = FakeScriptedEngine([])
        router = _router(engine)
        with pytest.raises(TypeError, match="takes a GenerationRequest, got dict"):
            await router.generate({"request_id": "r", "prompt_token_ids": [1]})  # type: ignore[arg-type]
        assert router.counters().submitted == 0 and engine.received == []

    asyncio.run(go())


@pytest.mark.parametrize("sampling", [{"n": 2}, {"best_of": 3}, {"n": 4, "best_of": 4}])
def test_several_samples_per_request_are_refused_with_a_typed_error(
    sampling: dict[str, int],
) -> None:
    # sampling={"n": 2} was accepted and the wrapper returned outputs[0] only: the other
    # samples were dropped without a word (one request id is one sample for the router).
    async def go() -> None:
        shard = VllmAsyncShard(FakeAsyncLlm())
        with pytest.raises(ProtocolError, match="one GenerationRequest is one sample"):
            await shard.generate(GenerationRequest("r:a1", (1, 2), 4, sampling))
        assert shard.submitted_total == 0 and await shard.num_running() == 0

    asyncio.run(go())


class _Completion:
    def __init__(self, tokens: tuple[int, ...], steps: int) -> None:
        self.token_ids = tokens
        self.finish_reason = "length"
        self.logprobs = [{t: type("L", (), {"logprob": -0.5})()} for t in tokens][:steps]


class ShortLogprobsLlm(FakeAsyncLlm):
    """FAKE AsyncLLM whose final output has fewer logprob steps than tokens."""

    async def generate(self, prompt: Any, params: Any, rid: str) -> Any:  # type: ignore[override]
        yield type("Out", (), {"finished": True, "outputs": [_Completion((7, 8, 9), 2)]})()


def test_logprobs_that_do_not_line_up_with_the_tokens_are_a_typed_error() -> None:
    # A ValueError from zip(strict=True) before: untyped, and on a shard being preempted it
    # passed for a preemption (the router re-dispatches those) instead of a broken contract.
    async def go() -> None:
        shard = VllmAsyncShard(ShortLogprobsLlm())
        # plain stand-ins for vLLM's SamplingParams / TokensPrompt (no vLLM import needed)
        shard._sampling_cls = shard._prompt_cls = lambda **kw: kw
        shard._final_only = "final_only"
        with pytest.raises(ProtocolError, match="2 logprob steps for 3 tokens"):
            await shard.generate(GenerationRequest("r:a1", (1, 2), 3, {"logprobs": 0}))

    asyncio.run(go())


# -- tiny engine environment ------------------------------------------------------------


class FakeEngineCoreClient:
    """FAKE ``AsyncLLM``: no engine, only where vLLM 0.32 keeps its EngineCore processes
    (``engine_core.resources.engine_manager.processes``), here one real child process."""

    def __init__(self, pid: int) -> None:
        process = type("Proc", (), {"pid": pid})()
        manager = type("Manager", (), {"processes": [process]})()
        resources = type("Resources", (), {"engine_manager": manager})()
        self.engine_core = type("Client", (), {"resources": resources})()
        self.shut_down = False

    def shutdown(self) -> None:
        self.shut_down = True


def test_tiny_engine_pins_its_engine_core_and_leaves_the_environment_alone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    # The worker runs inside the EngineCore (UniProcExecutor, passed as the class: the CPU
    # platform turns "uni" into "mp"); the EngineCore is pinned once it runs, so nothing of
    # the process-wide environment changes (VLLM_CPU_OMP_THREADS_BIND or OMP_PLACES set
    # meanwhile would reach other threads' processes, and OMP_PROC_BIND pinned the caller).
    pytest.importorskip("vllm")
    import subprocess

    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    from rlix_plugins.generation.tiny_engine import (
        TinyEngineSpec,
        start_tiny_engine,
        write_tiny_llama,
    )

    child = subprocess.Popen(["sleep", "60"])
    backends: list[Any] = []
    env_seen: list[dict[str, str]] = []

    def fake_from_engine_args(args: Any) -> FakeEngineCoreClient:  # FAKE: no engine
        backends.append(args.distributed_executor_backend)
        env_seen.append(dict(os.environ))
        return FakeEngineCoreClient(child.pid)

    monkeypatch.setattr(AsyncLLM, "from_engine_args", fake_from_engine_args)
    env_before = dict(os.environ)
    caller_cores = os.sched_getaffinity(0)
    try:
        model = write_tiny_llama(tmp_path / "m")
        start_tiny_engine(TinyEngineSpec(model))
        assert os.sched_getaffinity(child.pid) == caller_cores  # not pinned
        start_tiny_engine(TinyEngineSpec(model, cpu_bind="0"))
        assert os.sched_getaffinity(child.pid) == {0}
        assert os.sched_getaffinity(0) == caller_cores  # the caller is not pinned
        assert backends == [UniProcExecutor] * 2
        assert env_seen == [env_before] * 2 and dict(os.environ) == env_before
    finally:
        child.kill()
        child.wait()


def test_engines_started_together_are_all_shut_down_when_one_fails(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    # No engine is left running when another fails: started ones are shut down, the first
    # error reaches the caller.
    pytest.importorskip("vllm")
    from vllm.v1.engine.async_llm import AsyncLLM

    from rlix_plugins.generation.tiny_engine import TinyEngineSpec, start_tiny_engines

    made: list[FakeEngineCoreClient] = []

    def fake_from_engine_args(args: Any) -> FakeEngineCoreClient:  # FAKE: no engine
        if args.seed == 1:
            raise RuntimeError("engine 1 failed to start")
        made.append(FakeEngineCoreClient(os.getpid()))
        return made[-1]

    monkeypatch.setattr(AsyncLLM, "from_engine_args", fake_from_engine_args)
    specs = [TinyEngineSpec(tmp_path, seed=s) for s in (0, 1, 2)]
    with pytest.raises(RuntimeError, match="engine 1 failed to start"):
        start_tiny_engines(specs)
    assert len(made) == 2 and all(e.shut_down for e in made)
    assert [e.shut_down for e in start_tiny_engines([specs[0], specs[2]])] == [False, False]


def test_pinning_an_engine_without_engine_core_processes_is_a_typed_error(
    tmp_path: Any,
) -> None:
    from rlix_plugins.generation.tiny_engine import pin_engine_core

    engine = FakeEngineCoreClient(0)
    engine.engine_core.resources.engine_manager.processes = []
    with pytest.raises(TypeError, match=r"engine_core\.resources\.engine_manager\.processes"):
        pin_engine_core(engine, "0")


@pytest.mark.parametrize("bind", ["", "a", "1-0", "-1", "0,,1", "0-"])
def test_tiny_engine_refuses_a_malformed_cpu_bind(tmp_path: Any, bind: str) -> None:
    from rlix_plugins.generation.tiny_engine import TinyEngineSpec

    with pytest.raises(ValueError, match=r"cpu_bind .* valid: '0', '0,2', '0-3'"):
        TinyEngineSpec(tmp_path, cpu_bind=bind)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"tensor_parallel_size": 0}, r"tensor_parallel_size=0 must be an int >= 1"),
    ({"tensor_parallel_size": True}, r"tensor_parallel_size=True must be an int >= 1"),
    ({"tensor_parallel_size": 2, "cpu_bind": "0"},
     r"pins a one-worker engine; an engine of 2 workers .* VLLM_CPU_OMP_THREADS_BIND"),
    ({"pipeline_parallel_size": 0}, r"pipeline_parallel_size=0 must be an int >= 1"),
    ({"pipeline_parallel_size": 1.0}, r"pipeline_parallel_size=1.0 must be an int >= 1"),
    ({"pipeline_parallel_size": 2, "cpu_bind": "1"},
     r"an engine of 2 workers \(tensor_parallel_size=1, pipeline_parallel_size=2\)"),
])
def test_tiny_engine_refuses_a_bad_parallel_spec(
    tmp_path: Any, kwargs: dict[str, Any], match: str
) -> None:
    from rlix_plugins.generation.tiny_engine import TinyEngineSpec

    with pytest.raises(ValueError, match=match):
        TinyEngineSpec(tmp_path, **kwargs)


def test_a_multi_worker_tiny_engine_asks_for_vllms_multiprocess_executor(tmp_path: Any) -> None:
    # one worker process per rank (vLLM's multiprocess executor); one rank stays in-process
    pytest.importorskip("vllm")
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    from rlix_plugins.generation.tiny_engine import TinyEngineSpec, tiny_engine_args

    tp2 = tiny_engine_args(TinyEngineSpec(tmp_path, tensor_parallel_size=2))
    assert (tp2.distributed_executor_backend, tp2.tensor_parallel_size,
            tp2.pipeline_parallel_size) == ("mp", 2, 1)
    pp2 = tiny_engine_args(TinyEngineSpec(tmp_path, pipeline_parallel_size=2))
    assert (pp2.distributed_executor_backend, pp2.tensor_parallel_size,
            pp2.pipeline_parallel_size) == ("mp", 1, 2)
    one = tiny_engine_args(TinyEngineSpec(tmp_path))
    assert (one.distributed_executor_backend, one.tensor_parallel_size,
            one.pipeline_parallel_size) == (UniProcExecutor, 1, 1)


def test_threads_bind_per_rank_uses_this_process_cores_in_rank_order() -> None:
    import os

    from rlix_plugins.generation.tiny_engine import threads_bind_per_rank

    cores = sorted(os.sched_getaffinity(0))
    parts = threads_bind_per_rank(3).split("|")
    assert parts == [str(cores[r % len(cores)]) for r in range(3)]


# -- request bookkeeping when the state owner cannot be read -----------------------------------


class FakeFlakyView(LocalShardState):
    """FAKE view: the real in-process view whose snapshot read fails once ``down`` is set (a
    RayShardState copy unpickled in another process reads the owner actor on its first
    snapshot, and raises if that actor is gone)."""

    down = False

    def snapshot(self) -> ShardSnapshot:
        if self.down:
            raise ConnectionError("FAKE: shard-state owner unreachable")
        return super().snapshot()


def test_a_failing_first_state_read_counts_the_request_lost_not_in_flight_forever() -> None:
    # generate() counted the request as submitted, then started the migration watcher
    # (which reads the snapshot) outside its try: the error left the request "in flight"
    # for good, so the copy never drained and its watcher never stopped.
    async def go() -> None:
        view = FakeFlakyView(ShardStateStore(2))
        router = ShardRouter(view, [FakeAbortableEngine(), FakeAbortableEngine()])
        view.down = True
        with pytest.raises(ConnectionError, match="FAKE"):
            await router.generate(GenerationRequest("r", (1, 2), 4))
        c = router.counters()
        assert (c.submitted, c.lost, c.in_flight) == (1, 1, 0)
        assert router.outstanding == 0

    asyncio.run(go())


def test_stale_refreshes_count_only_views_that_were_behind() -> None:
    # An attempt aborted on a shard that is still active (a host abort, a migration abort
    # whose id the engine did not report) refreshed the view and counted a "stale refresh"
    # although the in-process view is never behind: the counter meant to show lagging
    # router copies grew on every such abort.
    async def go() -> None:
        engine = FakeScriptedEngine([EngineOutput((5,), "abort"),
                                     EngineOutput((1, 2, 3, 4), "length")])
        router = _router(engine)
        result = await router.generate(GenerationRequest("r", (1, 2), 4))
        assert result.attempts == 2
        stats = router.stats()
        assert (stats.redispatched, stats.stale_refreshes) == (1, 0)

    asyncio.run(go())


class FakeActorHandle:
    """FAKE Ray transport: ``handle.method.remote(...)`` calls the REAL actor body
    (ShardStateActorImpl) in this process, so RayShardState runs without a Ray cluster."""

    def __init__(self, impl: ray_state_module.ShardStateActorImpl) -> None:
        self.impl = impl

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.impl, name)

        class _Remote:
            @staticmethod
            def remote(*args: Any) -> Any:
                return method(*args)

        return _Remote


@pytest.mark.parametrize(("ranks", "event", "message"), [
    (0, ShardEvent.PREEMPT, "dp ranks must be an iterable of ints such as"),
    ([0], "sleep", r"unknown shard event 'sleep'; valid values are"),
])
def test_ray_view_apply_gives_the_typed_error_of_the_local_view(
    ranks: Any, event: Any, message: str
) -> None:
    # RayShardState.apply(0, ...) raised TypeError("'int' object is not iterable") in the
    # caller where LocalShardState raises ShardStateError; the owner's state is unchanged.
    impl = ray_state_module.ShardStateActorImpl(2, "active", "allow")
    view = RayShardState(FakeActorHandle(impl))

    async def go() -> None:
        before = await view.refresh()
        with pytest.raises(ShardStateError, match=message):
            await view.apply(ranks, event)
        assert await view.refresh() is before
        view.close()

    asyncio.run(go())


def test_router_and_lifecycle_refuse_a_config_of_the_wrong_type_at_construction() -> None:
    # ShardRouter(view, engines, {"max_attempts": 3}) was accepted and every request then
    # failed with AttributeError("'dict' object has no attribute 'redispatch'"), counted lost;
    # the lifecycle failed the same way at its first preempt, after marking the shard.
    from rlix_plugins.generation import ShardLifecycle

    store = ShardStateStore(1)
    engine = FakeScriptedEngine([EngineOutput((1,), "length")])
    with pytest.raises(SettingsError, match=r"config must be a RouterConfig, got dict"):
        ShardRouter(LocalShardState(store), [engine], {"max_attempts": 3})  # type: ignore[arg-type]
    with pytest.raises(SettingsError, match=r"config must be a PreemptionConfig, got dict"):
        ShardLifecycle(LocalShardState(store), [engine],
                       {"drain_timeout_s": 1.0})  # type: ignore[arg-type]


# -- migration planned on a state that moved on while it waited -------------------------------


class FakeHeldEngine:
    """FAKE RequestAbortable engine whose requests run until aborted or released (no clock):
    ``reached`` is set once ``want`` requests run at once; with ``hold`` set, per-request
    aborts wait for it (a slow abort round trip) after setting ``abort_entered``."""

    def __init__(self) -> None:
        self.accepting = True
        self.running: dict[str, asyncio.Event] = {}
        self.aborted: set[str] = set()
        self.releasing = False
        self.want = 0
        self.reached = asyncio.Event()
        self.hold: asyncio.Event | None = None
        self.abort_entered = asyncio.Event()

    async def generate(self, request: GenerationRequest) -> EngineOutput:
        if not self.accepting:
            raise ShardPreemptedError("FAKE gate closed")
        rid = request.request_id
        done = self.running[rid] = asyncio.Event()
        if self.releasing:
            done.set()
        if self.want and len(self.running) >= self.want:
            self.reached.set()
        try:
            await done.wait()
        finally:
            del self.running[rid]
        if rid in self.aborted:
            return EngineOutput((7, 7), "abort")
        return EngineOutput(tuple(range(request.max_tokens)), "length")

    def _abort(self, ids: Sequence[str]) -> tuple[str, ...]:
        hit = tuple(i for i in dict.fromkeys(ids) if i in self.running)
        for i in hit:
            self.aborted.add(i)
            self.running[i].set()
        return hit

    async def abort_requests(self, request_ids: Sequence[str]) -> tuple[str, ...]:
        if self.hold is not None:
            self.abort_entered.set()
            await self.hold.wait()
        return self._abort(request_ids)

    async def request_progress(self, request_ids: Sequence[str]) -> dict[str, int]:
        return {i: 0 for i in request_ids if i in self.running}

    async def abort_all(self) -> int:
        self.accepting = False
        return len(self._abort(list(self.running)))

    async def num_running(self) -> int:
        return len(self.running)

    async def sleep(self, level: int | None = None) -> None:
        return None

    async def wake_up(self) -> None:
        return None

    async def resume(self) -> None:
        self.accepting = True

    def release_all(self) -> None:
        self.releasing = True
        for done in self.running.values():
            done.set()


class FakeSignallingView(LocalShardState):
    """FAKE: the real in-process view that also signals each refresh (so a test knows a
    rebalance has read the state and gone on to wait for the rebalance lock)."""

    def __init__(self, store: ShardStateStore) -> None:
        super().__init__(store)
        self.refreshed = asyncio.Event()

    async def refresh(self) -> ShardSnapshot:
        self.refreshed.set()
        return await super().refresh()


def test_a_rebalance_that_waited_for_the_lock_plans_on_the_current_state() -> None:
    # rebalance() read the state, then waited for another rebalance's lock: it planned on
    # that old snapshot and moved requests to a shard preempted meanwhile (each aborted and
    # re-prefilled on a shard that was already serving, its one migration used up).
    from rlix_plugins.generation import ShardLifecycle

    async def go() -> None:
        engines = [FakeHeldEngine() for _ in range(3)]
        store = ShardStateStore(3)
        view = FakeSignallingView(store)
        router = ShardRouter(view, engines,
                             RouterConfig(migration=MigrationConfig(auto=False)))
        life = ShardLifecycle(view, engines)
        await life.preempt([1, 2])
        engines[0].want = 8
        load = [GenerationRequest(f"q{i}", (1, i), 64) for i in range(8)]
        tasks = [asyncio.ensure_future(router.generate(q)) for q in load]
        await engines[0].reached.wait()  # all 8 running on shard 0
        await life.wake([1, 2])
        await life.activate([1, 2])

        hold = engines[0].hold = asyncio.Event()
        first = asyncio.ensure_future(router.rebalance([1]))
        await engines[0].abort_entered.wait()  # first holds the lock, inside its abort
        view.refreshed.clear()
        second = asyncio.ensure_future(router.rebalance([2]))
        await view.refreshed.wait()  # second read the state (2 active), waits for the lock
        await life.preempt([2])
        hold.set()
        assert len(await first) == 4
        assert await second == (), "moves planned to shard 2, preempted while waiting"

        for e in engines:
            e.release_all()
        results = await asyncio.gather(*tasks)
        assert sorted(r.request_id for r in results) == sorted(q.request_id for q in load)
        c = router.counters()
        assert (c.completed, c.lost, c.in_flight, c.migrated) == (8, 0, 0, 4)

    asyncio.run(asyncio.wait_for(go(), 30))


class FakeHeldRefreshView(LocalShardState):
    """FAKE asynchronous view (as ``RayShardState`` is): its first ``refresh`` after ``hold``
    is set waits for it (a slow round trip to the owner), after setting ``entered``."""

    def __init__(self, store: ShardStateStore) -> None:
        super().__init__(store)
        self.hold: asyncio.Event | None = None
        self.entered = asyncio.Event()

    async def snapshot_async(self) -> ShardSnapshot:
        return self.snapshot()

    async def refresh(self) -> ShardSnapshot:
        if self.hold is not None and not self.entered.is_set():
            self.entered.set()
            await self.hold.wait()
        return self.snapshot()


async def _four_running_on_shard_0_and_shard_1_active(
    view: Any, engines: list[Any], config: RouterConfig
) -> tuple[ShardRouter, list[asyncio.Future[Any]]]:
    """A router over two held engines with four requests running on shard 0, then shard 1
    woken and activated (empty): the state a rebalance to shard 1 starts from."""
    from rlix_plugins.generation import ShardLifecycle

    router = ShardRouter(view, engines, config)
    life = ShardLifecycle(view, engines)
    await life.preempt([1])
    engines[0].want = 4
    load = [GenerationRequest(f"q{i}", (1, i), 64) for i in range(4)]
    tasks = [asyncio.ensure_future(router.generate(q)) for q in load]
    await engines[0].reached.wait()
    await life.wake([1])
    await life.activate([1])
    return router, tasks


def test_an_attempt_aborted_by_the_host_is_not_marked_for_migration_once_it_ended() -> None:
    # A host abort on an active shard returned the attempt while its run was still listed as
    # running; while _dispatch awaited the state refresh, a rebalance marked it: the abort
    # was counted as a migration (and under RESTART continued from its partial tokens).
    async def go() -> None:
        engines = [FakeHeldEngine(), FakeHeldEngine()]
        view = FakeHeldRefreshView(ShardStateStore(2))
        router, tasks = await _four_running_on_shard_0_and_shard_1_active(
            view, engines, RouterConfig(redispatch=RedispatchMode.RESTART,
                                        migration=MigrationConfig(auto=False)))
        view.hold = asyncio.Event()
        engines[0]._abort(["q0:a1"])  # the host aborts q0 on its active shard
        await view.entered.wait()  # q0's dispatch awaits the refresh
        abort_hold = engines[0].hold = asyncio.Event()
        rebalance = asyncio.ensure_future(router.rebalance([1]))
        await engines[0].abort_entered.wait()  # marks set, its abort under way
        view.hold.set()
        await asyncio.sleep(0.01)  # q0 decides how it continues
        abort_hold.set()
        moves = await rebalance
        for e in engines:
            e.release_all()
        results = await asyncio.gather(*tasks)
        assert "q0:a1" not in [m.key for m in moves]
        c = router.counters()
        assert (c.migrated, c.redispatched, c.lost) == (len(moves), 1, 0)
        assert results[0].token_ids[:2] != (7, 7), "RESTART continued from partial tokens"

    asyncio.run(asyncio.wait_for(go(), 30))


class FakeSlowProgressEngine(FakeHeldEngine):
    """FAKE: like FakeHeldEngine, and its progress query waits for ``progress_hold`` (a slow
    round trip) after setting ``progress_entered``."""

    def __init__(self) -> None:
        super().__init__()
        self.progress_hold: asyncio.Event | None = None
        self.progress_entered = asyncio.Event()

    async def request_progress(self, request_ids: Sequence[str]) -> dict[str, int]:
        if self.progress_hold is not None:
            self.progress_entered.set()
            await self.progress_hold.wait()
        return await super().request_progress(request_ids)


def test_migration_plans_on_the_loads_after_its_progress_query() -> None:
    # _plan read the in-flight loads, then awaited the engines' progress; requests that
    # finished meanwhile still counted: with 4 -> 2 running on shard 0 it moved 2 of them
    # (leaving 0 | 2, a pointless extra abort and re-prefill) instead of 1 (1 | 1).

    async def go() -> None:
        engines = [FakeSlowProgressEngine(), FakeSlowProgressEngine()]
        router, tasks = await _four_running_on_shard_0_and_shard_1_active(
            LocalShardState(ShardStateStore(2)), engines,
            RouterConfig(migration=MigrationConfig(auto=False)))

        hold = engines[0].progress_hold = asyncio.Event()
        rebalance = asyncio.ensure_future(router.rebalance([1]))
        await engines[0].progress_entered.wait()  # loads read, progress query under way
        for rid in ("q0:a1", "q1:a1"):
            engines[0].running[rid].set()  # two finish normally meanwhile
        await asyncio.gather(tasks[0], tasks[1])
        hold.set()
        moves = await rebalance
        assert len(moves) == 1, moves

        for e in engines:
            e.release_all()
        results = await asyncio.gather(*tasks)
        assert len(results) == 4 and router.counters().completed == 4

    asyncio.run(asyncio.wait_for(go(), 30))


class FakeRaisingAbortEngine(FakeHeldEngine):
    """FAKE: an engine whose aborted requests raise ``error`` instead of returning their
    partial output (NemoRlShard raises ShardPreemptedError for a request it cannot continue,
    and a plain error when an aborted request's stream gave no output), while the shard
    itself stays active."""

    def __init__(self, error: type[Exception]) -> None:
        super().__init__()
        self.error = error

    async def generate(self, request: GenerationRequest) -> EngineOutput:
        out = await super().generate(request)
        if out.aborted:
            raise self.error(f"FAKE: {request.request_id} aborted, no partial output")
        return out


@pytest.mark.parametrize("error", [ShardPreemptedError, RuntimeError])
def test_a_migration_whose_attempt_raises_is_still_a_migration(error: type[Exception]) -> None:
    # The router marked the attempt and aborted it to move it; the engine raised for the
    # abort. ShardPreemptedError: the router counted a preemption, and with max_attempts=1
    # the moved requests were lost ("preempted on each of its 1 dispatches"), although
    # migrations must not use up max_attempts. A plain error on the still-active shard: the
    # router raised it to the caller (lost) until 2026-11-29.
    async def go() -> None:
        engines = [FakeRaisingAbortEngine(error), FakeRaisingAbortEngine(error)]
        router, tasks = await _four_running_on_shard_0_and_shard_1_active(
            LocalShardState(ShardStateStore(2)), engines,
            RouterConfig(max_attempts=1, migration=MigrationConfig(auto=False)))
        engines[1].want = 2
        moves = await router.rebalance([1])
        assert len(moves) == 2
        # Both continued on the target, or (the defect) a request came back.
        reached = asyncio.ensure_future(engines[1].reached.wait())
        await asyncio.wait([reached, *tasks], return_when=asyncio.FIRST_COMPLETED)
        reached.cancel()
        for e in engines:
            e.release_all()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(not isinstance(r, BaseException) for r in results), results
        assert sorted(r.dp_rank for r in results) == [0, 0, 1, 1]  # type: ignore[union-attr]
        c = router.counters()
        assert (c.completed, c.lost, c.migrated, c.redispatched) == (4, 0, 2, 0)

    asyncio.run(asyncio.wait_for(go(), 30))
