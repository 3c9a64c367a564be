"""Property tests: random sequences of scheduling events never break an invariant.

Every event either succeeds or raises a typed error with the state unchanged; every plan passes
check_plan and every commit leaves a state that passes check_state, including when resize RPCs
fail at random.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from rlix_plugins.coordinator.core import (
    DemandSharePlanner,
    Plan,
    PolicyConfig,
    SchedulerState,
    ShrinkReason,
    Topology,
    check_plan,
    check_state,
    validate_registration,
)
from rlix_plugins.errors import RlixPluginsError
from rlix_plugins.protocol import Priority, ProgressReport
from tests.core_builders import observable

GPN = 4
TOPO = Topology(num_nodes=2, gpus_per_node=GPN)
PIDS = [f"ft_{i}" for i in range(4)]
CLUSTERS = [f"{p}_{c}" for p in PIDS for c in ("actor_train", "actor_infer")]


@st.composite
def span(draw: st.DrawFn, tp: int) -> list[int]:
    """A sorted, TP-aligned mapping: whole TP groups inside nodes."""
    groups = [list(range(s, s + tp)) for s in range(0, TOPO.num_gpus, tp)]
    chosen = draw(st.lists(st.sampled_from(range(len(groups))), min_size=1, unique=True))
    return sorted(g for i in chosen for g in groups[i])


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.state = SchedulerState(TOPO)
        # starve_after_s within a few cycles' reach: wherever a random run engages the guard
        # (rarely: no move in 200 runs of 40 steps; the chain case is tested on its own, in
        # test_core_starvation_guard.py), _check_starvation_moves checks what it took
        self.planner = DemandSharePlanner(PolicyConfig(aging_s=5, min_hold_s=1, starve_after_s=8))
        self.now = 0.0

    def guarded(self, fn: object, *args: object, **kwargs: object) -> None:
        before = observable(self.state)
        try:
            fn(*args, **kwargs)  # type: ignore[operator]
        except RlixPluginsError:
            assert observable(self.state) == before, "a failed event changed the state"
            return
        # As in the service, an accepted event triggers a scheduling cycle.
        plan = self.planner.plan(self.state, self.now)
        check_plan(self.state, plan)
        self._check_starvation_moves(plan)
        self.state.commit(plan, now=self.now)

    @initialize(data=st.data())
    def register_all(self, data: st.DataObject) -> None:
        for pid in PIDS:
            self.register(pid, data, data.draw(st.sampled_from([1, 2])))
        assert len(self.state.pipelines) == len(PIDS)

    @rule(pid=st.sampled_from(PIDS), data=st.data(), infer_tp=st.sampled_from([1, 2]))
    def register(self, pid: str, data: st.DataObject, infer_tp: int) -> None:
        infer = data.draw(span(infer_tp))
        train = data.draw(span(1))
        weight = data.draw(st.sampled_from([0.5, 1.0, 2.0]))

        def do() -> None:
            spec = validate_registration(
                TOPO,
                pipeline_id=pid,
                ray_namespace="ns",
                cluster_tp_configs={"actor_train": 1, "actor_infer": infer_tp},
                cluster_device_mappings={"actor_train": train, "actor_infer": infer},
                weight=weight,
            )
            self.state.register(spec)

        self.guarded(do)

    @rule(
        pid=st.sampled_from(PIDS),
        infer=st.booleans(),
        prio=st.sampled_from(list(Priority)),
        est=st.one_of(st.none(), st.integers(0, 64)),
    )
    def request(self, pid: str, infer: bool, prio: Priority, est: int | None) -> None:
        # Mostly well-formed calls (GENERATION for actor_infer); INITIALIZATION and a wrong
        # priority for actor_train (GENERATION) still occur.
        cid = f"{pid}_actor_infer" if infer else f"{pid}_actor_train"
        if infer and prio is not Priority.INITIALIZATION:
            prio = Priority.GENERATION
        self.guarded(self.state.submit_request, cid, prio, now=self.now, step_target_estimate=est)

    @rule(cid=st.sampled_from(CLUSTERS))
    def release(self, cid: str) -> None:
        self.guarded(self.state.release, cid)

    @rule(pid=st.sampled_from(PIDS))
    def await_release(self, pid: str) -> None:
        self.guarded(self.state.plan_release, f"{pid}_actor_infer", now=self.now)

    @rule(cid=st.sampled_from(CLUSTERS))
    def cancel(self, cid: str) -> None:
        self.state.cancel_request(cid)

    @rule(pid=st.sampled_from(PIDS), total=st.integers(0, 64), done=st.integers(0, 80))
    def progress(self, pid: str, total: int, done: int) -> None:
        report = ProgressReport(pid, total, None, {"completed": done})
        self.guarded(self.state.report_progress, report)

    @rule(pid=st.sampled_from(PIDS))
    def die(self, pid: str) -> None:
        self.guarded(self.state.unregister, pid)

    @rule(
        dt=st.floats(0, 10),
        fail=st.lists(st.sampled_from(CLUSTERS), max_size=2),
        fail_expand=st.booleans(),
        repeat=st.integers(1, 3),
        background=st.booleans(),
    )
    def cycle(
        self, dt: float, fail: list[str], fail_expand: bool, repeat: int, background: bool
    ) -> None:
        # ``background``: the service commits before its expands ran (ranks warm up).
        for _ in range(repeat):
            self.now += dt
            plan = self.planner.plan(self.state, self.now)
            check_plan(self.state, plan)
            self._check_starvation_moves(plan)
            failed_expands = fail if fail_expand else []
            self.state.commit(
                plan,
                now=self.now,
                failed_shrinks=fail,
                failed_expands=failed_expands,
                expands_pending=background,
            )
            fail = []

    def _check_starvation_moves(self, plan: Plan) -> None:
        """The guard takes one rank for a cluster that starved ``starve_after_s``, and never
        a donor's last one: the donor owns a rank after the plan (one the same plan gives it
        on idle GPUs counts: the guard may take the donor's only rank on the starving
        cluster's GPUs while the donor grows elsewhere)."""
        for m in plan.shrinks:
            if m.reason is not ShrinkReason.STARVATION:
                continue
            assert m.beneficiary is not None
            since = self.state.starving_since[m.beneficiary]
            assert self.now - since >= self.planner.config.starve_after_s
            left = (
                set(self.state.active_ranks[m.cluster_id])
                - {s.dp_rank for s in plan.shrinks if s.cluster_id == m.cluster_id}
            ) | {e.dp_rank for e in plan.expands if e.cluster_id == m.cluster_id}
            assert left, f"the guard took {m.cluster_id}'s last rank"

    @rule(data=st.data())
    def expand_returns(self, data: st.DataObject) -> None:
        """A background expand returns: the rank serves, its hold time starts now."""
        if not self.state.warming:
            return
        cid, rank = data.draw(st.sampled_from(sorted(self.state.warming)))
        assert self.state.expand_done(cid, rank, now=self.now)
        assert (cid, rank) not in self.state.warming
        assert self.state.active_ranks[cid][rank] == self.now
        # Returning twice is a no-op (the task may race a shrink or an unregistration).
        before = observable(self.state)
        assert not self.state.expand_done(cid, rank, now=self.now)
        assert observable(self.state) == before

    @invariant()
    def consistent(self) -> None:
        check_state(self.state)


SchedulerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestScheduler = SchedulerMachine.TestCase


def test_requests_are_eventually_granted_when_everyone_releases() -> None:
    """Liveness: with no failures and every holder releasing, each pending request is granted."""
    state = SchedulerState(TOPO)
    for i, pid in enumerate(PIDS):
        spec = validate_registration(
            TOPO,
            pipeline_id=pid,
            ray_namespace="ns",
            cluster_tp_configs={"actor_train": 1, "actor_infer": 1},
            cluster_device_mappings={"actor_train": [i, i + 1], "actor_infer": list(range(8))},
        )
        state.register(spec)
        state.submit_request(
            f"{pid}_actor_infer", Priority.GENERATION, now=0, step_target_estimate=8
        )
        state.submit_request(f"{pid}_actor_train", Priority(1 + i % 5), now=0)
    planner = DemandSharePlanner()
    granted: set[str] = set()
    for t in range(20):
        plan = planner.plan(state, float(t))
        check_plan(state, plan)
        result = state.commit(plan, now=float(t))
        check_state(state)
        for cid in result.granted:
            granted.add(cid)
            if cid.endswith("actor_train"):
                state.release(cid)
    assert granted == set(CLUSTERS)
