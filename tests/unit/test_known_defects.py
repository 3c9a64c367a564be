"""Known defects, one regression test each: a malformed in-flight record at restart, the status
view's fenced pipelines and warming ranks, the gate's exact parameter checksum comparison, the
NeMo RL shared placement's shutdown rounds, and ``LoopThread.run`` racing ``close``."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import sys
import threading
import types
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

from rlix_plugins.coordinator.core import check_plan
from rlix_plugins.coordinator.core.planner import DemandSharePlanner
from rlix_plugins.coordinator.core.snapshot import settle_inflight, snapshot
from rlix_plugins.coordinator.core.state import SchedulerState
from rlix_plugins.coordinator.core.status import build_status, format_status
from rlix_plugins.errors import CorruptStateError, RequestStateError
from rlix_plugins.gates import criteria
from rlix_plugins.gates.criteria import weights_current
from rlix_plugins.generation.loop_thread import LoopThread
from rlix_plugins.protocol import Priority
from tests.core_builders import cycle, new_state, observable, register
from tests.unit.test_gates_flow_failures import _AsyncioLoop, _bare_runtime
from tests.unit.test_nemo_rl_placement_patch_and_records import _bundles, fake_nemo_rl  # noqa: F401

GEN = Priority.GENERATION

#: Hang detector for the thread tests (generous: a pass takes milliseconds).
JOIN_S = 30.0


# ---------------------------------------------------------------- 1. settle_inflight records


def _two_pipelines() -> SchedulerState:
    state = new_state(1, 4)
    register(state, "ft_a", infer=[0, 1, 2, 3])
    register(state, "ft_b", infer=[2, 3])
    state.submit_request("ft_a_actor_infer", GEN, now=0, step_target_estimate=10)
    cycle(state, 0)
    return state


@pytest.mark.parametrize("shrinks, expands, bad", [
    ([("ft_a_actor_infer", "2")], [], "('ft_a_actor_infer', '2')"),  # rank not an int
    ([("ft_a_actor_infer", 2.0)], [], "('ft_a_actor_infer', 2.0)"),
    ([("ft_a_actor_infer", True)], [], "('ft_a_actor_infer', True)"),  # bool read as rank 1
    ([], [("ft_b_actor_infer", "0")], "('ft_b_actor_infer', '0')"),
    ([], [("ft_b_actor_infer", 0, 1)], "('ft_b_actor_infer', 0, 1)"),  # wrong length
    ([], [("ft_b_actor_infer",)], "('ft_b_actor_infer',)"),
    (["ft_a_actor_infer"], [], "'ft_a_actor_infer'"),  # a bare string is not a pair
    ([], [(5, 0)], "(5, 0)"),  # cluster id not a str (was silently ignored)
    ([], [(["ft_b_actor_infer"], 0)], "(['ft_b_actor_infer'], 0)"),  # unhashable
    # a good record first: nothing of it may be applied either
    ([("ft_a_actor_infer", 2), ("ft_a_actor_infer", None)], [],
     "('ft_a_actor_infer', None)"),
])
def test_settle_inflight_refuses_a_malformed_record_with_state_unchanged(
    shrinks: list[Any], expands: list[Any], bad: str
) -> None:
    state = _two_pipelines()
    before = (observable(state), snapshot(state))
    with pytest.raises(CorruptStateError) as err:
        settle_inflight(state, confirmed_shrinks=shrinks, possible_expands=expands, now=5)
    msg = str(err.value)
    assert bad in msg, msg
    assert "(cluster_id: str, dp_rank: int)" in msg  # what would be valid
    assert (observable(state), snapshot(state)) == before


def test_settle_inflight_still_ignores_unknown_clusters_and_accepts_json_lists() -> None:
    state = _two_pipelines()
    # JSON brings pairs back as lists; an unknown (dropped) cluster is ignored, as documented
    settle_inflight(state, confirmed_shrinks=[["ft_a_actor_infer", 2]],
                    possible_expands=[["ft_b_actor_infer", 0], ["ft_gone_actor_infer", 0]],
                    now=5)
    assert set(state.active_ranks["ft_a_actor_infer"]) == {0, 1, 3}
    assert set(state.active_ranks["ft_b_actor_infer"]) == {0}


# ---------------------------------------------------------------- 2. status: fenced + warming


def test_status_shows_fenced_pipelines_and_warming_ranks() -> None:
    state = new_state(1, 4)
    register(state, "ft_a", infer=[0, 1])
    register(state, "ft_b", infer=[2, 3])
    state.submit_request("ft_a_actor_infer", GEN, now=0, step_target_estimate=10)
    state.submit_request("ft_b_actor_infer", GEN, now=0, step_target_estimate=10)
    plan = DemandSharePlanner().plan(state, 0)
    check_plan(state, plan)
    # the service's background expands: committed before their wake + sync finish
    state.commit(plan, now=0, expands_pending=True)
    assert ("ft_a_actor_infer", 0) in state.warming
    state.expand_done("ft_a_actor_infer", 1, now=1)  # rank 1 serves now
    state.fence("ft_b")

    status = build_status(state, 2.0)
    a, b = status.pipeline("ft_a"), status.pipeline("ft_b")
    assert a is not None and b is not None
    assert not a.fenced and b.fenced
    assert status.fenced_pipelines == ("ft_b",)
    [a_infer] = a.clusters
    assert a_infer.active_ranks == (0, 1) and a_infer.warming_ranks == (0,)
    [b_infer] = b.clusters
    assert b_infer.warming_ranks == (0, 1)
    text = format_status(status)
    assert "ft_b  FENCED" in text
    assert "warming ranks [0]" in text and "warming ranks [0, 1]" in text
    assert "FENCED PIPELINES" in text
    # an unfenced state renders no fenced section
    assert "FENCED" not in format_status(build_status(_two_pipelines(), 0.0))


# ---------------------------------------------------------------- 3. gate parameter checksums


@pytest.mark.parametrize("engine, problem", [
    ({"model.norm.weight": "v0"}, "missing ['lm_head.weight']"),
    ({"model.norm.weight": "v0", "lm_head.weight": "v0", "model.extra.weight": "v0"},
     "extra ['model.extra.weight']"),
    ({"model.norm.weight": "v0", "lm_head.weight": "OLD"}, "different ['lm_head.weight']"),
    ({}, "missing ['lm_head.weight', 'model.norm.weight']"),
])
def test_sync_check_compares_the_exact_parameter_sets(engine: dict[str, str],
                                                      problem: str) -> None:
    """The engine's checksums used to be compared only on the names both sides had: a
    parameter the engine lacked (or an extra one) passed the weights criterion."""
    expected = {"model.norm.weight": "v0", "lm_head.weight": "v0"}

    class _Engine:  # FAKE vLLM AsyncLLM answering the receiver extension's RPCs
        async def collective_rpc(self, method: str, args: Any = ()) -> list[Any]:
            return [0] if method == "rlix_weight_version" else [dict(engine)]

    rt = _bare_runtime(expected={0: expected}, _engines_raw=[_Engine()], _loop=_AsyncioLoop())
    rt._verify([0], "expand", 0)
    [check] = rt.sync_checks
    assert not check.ok and not check.checksums_match
    assert problem in check.mismatch
    # the gate's criterion names it too
    crit = weights_current([check])
    assert not crit.passed and problem in crit.measured


def test_compare_checksums_passes_only_identical_non_empty_maps() -> None:
    compare_checksums = criteria.compare_checksums
    same = compare_checksums({"a": "1", "b": "2"}, {"b": "2", "a": "1"})
    assert same.ok and same.compared == 2 and same.describe() == ""
    assert not compare_checksums({}, {}).ok  # nothing compared proves nothing
    diff = compare_checksums({"a": "1", "b": "2"}, {"a": "9", "c": "3"})
    assert (diff.missing, diff.extra, diff.different) == (("b",), ("c",), ("a",))
    assert not diff.ok


# ---------------------------------------------------------------- 4. NeMo RL shared placement

FAKE_VIRTUAL_CLUSTER_SRC = '''
# FAKE NeMo RL virtual cluster: only what RLixPlacementCluster uses without Ray.
class RayVirtualCluster:
    def __init__(self, bundle_ct_per_node_list, use_gpus=True, max_colocated_worker_groups=1,
                 num_gpus_per_node=8, name="", **_):
        self.name = name
        self._bundle_ct_per_node_list = list(bundle_ct_per_node_list)
        self._world_size = sum(self._bundle_ct_per_node_list)
        self.num_gpus_per_node = num_gpus_per_node
        self.max_colocated_worker_groups = max_colocated_worker_groups
        self._node_placement_groups = None
        self.base_shutdowns = 0

    def shutdown(self):
        self.base_shutdowns += 1
        self._node_placement_groups = None
        return True


def get_reordered_bundle(pg):
    raise AssertionError("FAKE: no Ray placement group here")
'''

FAKE_WORKER_GROUPS_SRC = '''
# FAKE NeMo RL worker groups: the base class name only.
class RayWorkerGroup:
    pass
'''


class _FakePlacement:
    """FAKE SharedPlacement: the real plan, a placeholder group, counted shutdowns."""

    def __init__(self, plan: Any) -> None:
        self.plan = plan
        self.placement_groups = [object()]
        self.shutdowns = 0

    def shutdown(self) -> None:
        self.shutdowns += 1


@pytest.fixture
def placement_module(fake_nemo_rl: Path,  # noqa: F811
                     monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """``rlix_plugins.adapters.nemo_rl_placement`` imported over the FAKE NeMo RL modules."""
    pkg = fake_nemo_rl / "nemo_rl" / "distributed"
    (pkg / "virtual_cluster.py").write_text(FAKE_VIRTUAL_CLUSTER_SRC)
    (pkg / "worker_groups.py").write_text(FAKE_WORKER_GROUPS_SRC)
    name = "rlix_plugins.adapters.nemo_rl_placement"
    assert name not in sys.modules
    monkeypatch.delenv("RLIX_CONTROL_PLANE", raising=False)  # own placement group, not shared
    try:
        yield importlib.import_module(name)
    finally:
        sys.modules.pop(name, None)  # bound to the FAKE bases: nobody else may get it


def test_shared_placement_shutdown_rounds_are_counted_once_and_reset(
    placement_module: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlix_plugins.adapters.nemo_rl_placement_plan import plan_placement

    plan = plan_placement([0, 1], [0], _bundles(0, 1), {"n0": 0}, 2)
    created: list[_FakePlacement] = []

    def create(cls: type, infer: Any, train: Any, name: str = "") -> _FakePlacement:
        created.append(_FakePlacement(plan))
        return created[-1]

    monkeypatch.setattr(placement_module.SharedPlacement, "create", classmethod(create))
    cluster = placement_module.RLixPlacementCluster
    train = cluster([1], name="grpo_train_cluster")
    infer = cluster([2], name="grpo_inference_cluster")
    cfg = {"rlix": {"infer_gpus": [0, 1], "train_gpus": [0]}}
    pair = train._rlix_pair
    assert pair is infer._rlix_pair

    train.rlix_bind(cfg)
    first = created[0]
    assert train.shutdown() and train.shutdown()  # released twice: counted once
    assert first.shutdowns == 0 and infer._node_placement_groups
    assert infer.shutdown()
    assert first.shutdowns == 1
    # after the last release the pair is as before the first bind
    assert pair.placement is None and pair.layout is None and pair.released == set()
    assert infer.shutdown() and train.shutdown()  # idempotent
    assert first.shutdowns == 1 and pair.released == set()
    assert train.base_shutdowns == infer.base_shutdowns == 0  # never NeMo RL's own shutdown

    # the pair reused: a second round binds a new placement, released by both views again
    infer.rlix_bind(cfg)
    second = created[1]
    assert len(created) == 2 and pair.placement is second
    assert train._node_placement_groups == second.placement_groups
    assert train.shutdown()
    assert second.shutdowns == 0, "released while the inference view still used it"
    assert infer.shutdown()
    assert second.shutdowns == 1 and first.shutdowns == 1


def test_a_rebind_after_one_release_counts_that_view_as_bound_again(
    placement_module: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlix_plugins.adapters.nemo_rl_placement_plan import plan_placement

    plan = plan_placement([0, 1], [0], _bundles(0, 1), {"n0": 0}, 2)
    only = _FakePlacement(plan)
    monkeypatch.setattr(placement_module.SharedPlacement, "create",
                        classmethod(lambda cls, *a, **kw: only))
    cluster = placement_module.RLixPlacementCluster
    train = cluster([1], name="grpo_train_cluster")
    infer = cluster([2], name="grpo_inference_cluster")
    cfg = {"rlix": {"infer_gpus": [0, 1], "train_gpus": [0]}}
    train.rlix_bind(cfg)
    assert train.shutdown()
    infer.rlix_bind(cfg)  # re-applies the placement to both views, the released one too
    assert train._node_placement_groups == only.placement_groups
    assert infer.shutdown()
    assert only.shutdowns == 0, "the training view holds the placement again"
    assert train.shutdown()
    assert only.shutdowns == 1


def test_a_failed_placement_shutdown_marks_nothing_and_is_retried(
    placement_module: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlix_plugins.adapters.nemo_rl_placement_plan import plan_placement

    class _Failing(_FakePlacement):  # FAKE placement whose first removal fails
        def shutdown(self) -> None:
            super().shutdown()
            if self.shutdowns == 1:
                raise RuntimeError("placement group removal failed")

    only = _Failing(plan_placement([0, 1], [0], _bundles(0, 1), {"n0": 0}, 2))
    monkeypatch.setattr(placement_module.SharedPlacement, "create",
                        classmethod(lambda cls, *a, **kw: only))
    cluster = placement_module.RLixPlacementCluster
    train = cluster([1], name="grpo_train_cluster")
    infer = cluster([2], name="grpo_inference_cluster")
    train.rlix_bind({"rlix": {"infer_gpus": [0, 1], "train_gpus": [0]}})
    pair = train._rlix_pair
    assert train.shutdown()
    with pytest.raises(RuntimeError, match="removal failed"):
        infer.shutdown()
    assert pair.placement is only and pair.released == {"actor_train"}
    assert infer._node_placement_groups == only.placement_groups
    assert infer.shutdown()  # the retry removes it
    assert only.shutdowns == 2 and pair.placement is None and pair.released == set()


# ---------------------------------------------------------------- 5. LoopThread run vs close


async def _forever() -> None:
    await asyncio.sleep(3600)


def test_run_and_submit_after_close_raise_the_typed_error_and_close_the_coroutine() -> None:
    lt = LoopThread(name="closed-loop")
    lt.close()
    for call in (lt.run, lt.submit):
        coro = _forever()
        with pytest.raises(RequestStateError, match="closed"):
            call(coro)
        assert inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED
    lt.close()  # idempotent


@pytest.mark.parametrize("window", ["after_close", "before_loop_close"])
def test_run_racing_close_raises_the_typed_error_and_never_hangs(window: str) -> None:
    """``run`` passed the closed check, then ``close`` ran before the coroutine reached the
    loop: the submission hit a closed loop (bare RuntimeError, coroutine never awaited) or a
    stopped one (the future never completed: ``run`` hung forever)."""
    lt = LoopThread(name=f"race-{window}")
    loop = lt.loop
    real_call = loop.call_soon_threadsafe
    real_close = loop.close
    at_loop_close = threading.Event()
    submitted = threading.Event()
    closer = threading.Thread(target=lt.close, name="closer", daemon=True)
    coro: Coroutine[Any, Any, None] = _forever()
    outcome: dict[str, Any] = {}
    fired = False

    # FAKE interleaving hooks around the real loop's methods: they only pause a thread.
    def hooked_call(callback: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal fired
        if threading.current_thread() is runner and not fired:
            fired = True
            # A submission made outside close()'s lock can be overtaken by close(): let it.
            overtaken = not lt._close_lock.locked()
            closer.start()
            if overtaken and window == "after_close":
                closer.join(JOIN_S)
            elif overtaken:
                at_loop_close.wait(JOIN_S)
        try:
            return real_call(callback, *args, **kwargs)
        finally:
            if threading.current_thread() is runner:
                submitted.set()

    def hooked_close() -> None:
        at_loop_close.set()
        submitted.wait(JOIN_S)
        real_close()

    def call() -> None:
        try:
            outcome["result"] = lt.run(coro)
        except BaseException as exc:  # judged below
            outcome["error"] = exc

    loop.call_soon_threadsafe = hooked_call  # type: ignore[method-assign]
    if window == "before_loop_close":
        loop.close = hooked_close  # type: ignore[method-assign]
    runner = threading.Thread(target=call, name="runner", daemon=True)
    runner.start()
    runner.join(JOIN_S)
    assert not runner.is_alive(), "run() hung: its coroutine went to a loop that had stopped"
    closer.join(JOIN_S)
    assert not closer.is_alive()
    error = outcome.get("error")
    assert isinstance(error, RequestStateError) and "closed" in str(error), outcome
    assert inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED  # not leaked un-awaited
    assert lt.closed and loop.is_closed()
    lt.close()  # idempotent


def test_many_real_run_close_races_end_with_a_result_or_the_typed_error() -> None:
    for i in range(40):
        lt = LoopThread(name=f"stress-{i}")
        outcome: dict[str, Any] = {}
        start = threading.Barrier(2)

        def call(lt: LoopThread = lt, outcome: dict[str, Any] = outcome,
                 start: threading.Barrier = start, i: int = i) -> None:
            start.wait()
            try:
                outcome["result"] = lt.run(asyncio.sleep(0, result=i))
            except BaseException as exc:  # judged below
                outcome["error"] = exc

        def close(lt: LoopThread = lt, start: threading.Barrier = start) -> None:
            start.wait()
            lt.close()

        threads = [threading.Thread(target=call, daemon=True),
                   threading.Thread(target=close, daemon=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(JOIN_S)
        assert not any(t.is_alive() for t in threads), f"round {i}: run or close hung"
        if "error" in outcome:
            assert isinstance(outcome["error"], RequestStateError), outcome
        else:
            assert outcome["result"] == i
        lt.close()


def test_close_unblocks_a_run_whose_task_ignores_cancellation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """close() gives up on a task that swallows its cancellation and stops the loop: the
    run() waiting on that task used to wait forever."""
    import rlix_plugins.generation.loop_thread as loop_thread

    monkeypatch.setattr(loop_thread, "_CLOSE_WAIT_S", 0.5)  # close's bounded wait, shortened
    lt = LoopThread(name="stubborn")
    started = threading.Event()

    async def stubborn() -> None:
        started.set()
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                continue  # swallowed on purpose

    outcome: dict[str, Any] = {}

    def call() -> None:
        try:
            outcome["result"] = lt.run(stubborn())
        except BaseException as exc:  # judged below
            outcome["error"] = exc

    runner = threading.Thread(target=call, daemon=True)
    runner.start()
    assert started.wait(JOIN_S)
    lt.close()
    runner.join(JOIN_S)
    assert not runner.is_alive(), "run() hung on a task close() gave up on"
    assert isinstance(outcome.get("error"), RequestStateError), outcome
