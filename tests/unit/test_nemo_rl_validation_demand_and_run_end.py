"""NeMo RL validation demand and end of run: each test pins a gap (it failed before the
fix next to it: the functions it calls did not exist, and without them nothing was reported).

* Validation reported no demand: NeMo RL's ``validate`` generates on the pipeline's inference
  ranks through the driver's generation, but only the collector reported progress, so the
  coordinator could lend those ranks away mid-validation. :func:`nemo_rl.validation_demand`
  (around ``validate``) reports the validation's trajectories as a ``val`` stream, lowers it
  per finished batch and reports nothing remaining when ``validate`` returns or raises.
* A run that ended early kept its last demand until ``policy_generation.shutdown()``
  unregistered the pipeline (or, on the paths that return before NeMo RL's ``finally``,
  until its lease lapsed). :func:`nemo_rl.end_run` clears it where the loop ends
  (``checkpointer.shutdown()``, :func:`nemo_rl.make_checkpoint_manager_class`) and
  :func:`nemo_rl.training_run` around the whole call.

The hooks, the pipeline and the coordinator are real (Ray); the NeMo RL ``validate`` and
loader are FAKE (``grpo`` needs Python 3.12). What the wrappers assume of NeMo RL's source is
checked in ``tests/integration/test_nemo_rl_validation_demand.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from rlix_plugins.adapters import nemo_rl
from rlix_plugins.adapters.nemo_rl import NemoRlLayout, NemoRlPipeline
from rlix_plugins.coordinator.core import DemandSharePlanner
from rlix_plugins.errors import ProtocolError
from rlix_plugins.protocol import ProgressReport
from tests.core_builders import cycle, new_state, progress, register

PID = "ft_00000000c0de"
#: NeMo RL's validation config: 3 batches of 2 prompts (max_val_samples 6), 4 generations
VAL_CFG = {"grpo": {"val_batch_size": 2, "max_val_samples": 6,
                    "val_num_generations_per_prompt": 4, "num_prompts_per_step": 4}}


class FakeValLoader:
    """FAKE validation dataloader: ``batches`` batches over a dataset of ``prompts``."""

    def __init__(self, batches: int, prompts: int) -> None:
        self.batches = batches
        self.dataset = list(range(prompts))
        self.iterated = 0

    def __iter__(self) -> Iterator[list[int]]:
        for i in range(self.batches):
            self.iterated += 1
            yield [i]

    def __len__(self) -> int:
        return self.batches


def fake_validate(val_dataloader: Any, master_config: Any, seen: list[int | None],
                  demand: Any, fail_at: int | None = None) -> None:
    """FAKE NeMo RL ``validate``: its batch loop at 7ea279abf (``enumerate(val_dataloader)``,
    stop at ``max_val_samples // val_batch_size``); records the coordinator's demand as each
    batch starts generating."""
    grpo = master_config["grpo"]
    max_batches = grpo["max_val_samples"] // grpo["val_batch_size"]
    for batch_idx, _ in enumerate(val_dataloader):
        if batch_idx >= max_batches:
            break
        seen.append(demand())
        if batch_idx == fail_at:
            raise RuntimeError("generation failed mid-validation")


# ------------------------------------------------------------------ real coordinator


@pytest.fixture
def pipeline(coordinator: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[NemoRlPipeline]:
    """A pipeline registered with the real coordinator, its real :class:`CoordinatorHooks`
    (no heartbeat: the test is shorter than nothing; the lease applies from the first beat),
    installed as the driver's; unregistered after."""
    import ray

    from rlix_plugins.hooks import make_hooks
    from rlix_plugins.protocol.names import pipeline_namespace
    from rlix_plugins.settings import load_settings

    settings = load_settings({"RLIX_CONTROL_PLANE": "rlix",
                              "RLIX_NAMESPACE": coordinator.namespace})
    layout = NemoRlLayout((0, 1), (0,))
    ray.get(coordinator.orchestrator.register_pipeline.remote(
        pipeline_id=PID, ray_namespace=pipeline_namespace(PID),
        cluster_tp_configs=layout.tp_configs(),
        cluster_device_mappings=layout.device_mappings()))
    hooks = make_hooks(settings, pipeline_id=PID, heartbeat=False)
    p = NemoRlPipeline(settings, SimpleNamespace(), layout, hooks, PID)
    p._registered = True
    monkeypatch.setattr(nemo_rl, "_pipeline", p)
    yield p
    p.shutdown()


def _demand(coordinator: Any) -> int | None:

    status = coordinator.status()
    (mine,) = [p for p in status.pipelines if p.pipeline_id == PID]
    return mine.demand  # type: ignore[no-any-return]


def _train_demand(p: NemoRlPipeline, remaining: int) -> None:
    """What the collector's tracker reports for a step (4 groups, ``remaining`` to go)."""
    p.hooks.report_progress(step_target_trajectories=4, collected=4 - remaining,
                            current_train_step=2, new_batch=True)


@pytest.mark.integration
def test_validation_reports_its_demand_while_it_runs(coordinator: Any,
                                                     pipeline: NemoRlPipeline) -> None:
    _train_demand(pipeline, 3)
    assert _demand(coordinator) == 3
    seen: list[int | None] = []
    loader = FakeValLoader(batches=5, prompts=10)
    with nemo_rl.validation_demand(loader, VAL_CFG, 2) as batches:
        fake_validate(batches, VAL_CFG, seen, lambda: _demand(coordinator))
    # 3 batches x 2 prompts x 4 generations = 24, lowered by 8 per finished batch, on top of
    # the collector's 3 (was [3, 3, 3]: validation counted nothing)
    assert seen == [3 + 24, 3 + 16, 3 + 8]
    assert _demand(coordinator) == 3  # the training stream untouched, validation's gone
    assert loader.iterated == 4  # NeMo RL's own loop (it fetches one batch past the last)


@pytest.mark.integration
def test_the_patched_validate_hands_nemo_rls_loop_the_counted_loader(
    coordinator: Any, pipeline: NemoRlPipeline,
) -> None:
    """``grpo.validate`` as the patch replaces it (``wrap_validate``), called with NeMo RL's
    argument names: the same demand as ``validation_demand`` around the loop, the result
    passed back."""
    from rlix_plugins.patches.nemo_rl import wrap_validate

    seen: list[int | None] = []

    def stock(policy_generation: Any, val_dataloader: Any, tokenizer: Any,
              val_task_to_env: Any, step: int, master_config: Any) -> str:
        fake_validate(val_dataloader, master_config, seen, lambda: _demand(coordinator))
        return "validation metrics"

    loader = FakeValLoader(batches=5, prompts=10)
    assert wrap_validate(stock)(None, loader, None, {}, step=2,
                                master_config=VAL_CFG) == "validation metrics"
    assert seen == [24, 16, 8] and loader.iterated == 4
    assert _demand(coordinator) == 0  # the validation stream ended, nothing else reported


@pytest.mark.integration
def test_validation_that_raises_leaves_no_demand(coordinator: Any,
                                                 pipeline: NemoRlPipeline) -> None:
    _train_demand(pipeline, 1)
    seen: list[int | None] = []
    with pytest.raises(RuntimeError, match="mid-validation"), \
            nemo_rl.validation_demand(FakeValLoader(3, 6), VAL_CFG, 4) as batches:
        fake_validate(batches, VAL_CFG, seen, lambda: _demand(coordinator), fail_at=1)
    assert seen == [1 + 24, 1 + 16]
    assert _demand(coordinator) == 1


@pytest.mark.integration
def test_the_run_ending_by_an_exception_clears_the_demand(coordinator: Any,
                                                          pipeline: NemoRlPipeline) -> None:
    def fake_loop() -> None:
        """FAKE ``async_grpo_train`` that fails before reaching its ``finally`` (as NeMo RL's
        initial buffer fill raises when the dataset runs out)."""
        _train_demand(pipeline, 2)
        assert _demand(coordinator) == 2
        raise RuntimeError("Trajectory collector stopped")

    with pytest.raises(RuntimeError, match="collector stopped"), \
            nemo_rl.training_run({"current_step": 0}):
        fake_loop()
    assert _demand(coordinator) == 0  # was 2 until the lease lapsed
    # a validation after the end (none happens in NeMo RL) reports nothing
    with nemo_rl.validation_demand(FakeValLoader(3, 6), VAL_CFG, 9) as batches:
        list(batches)
    assert _demand(coordinator) == 0


@pytest.mark.integration
def test_the_collector_reporting_after_the_end_of_the_run_is_ignored(
        coordinator: Any, pipeline: NemoRlPipeline) -> None:
    """NeMo RL kills its trajectory collector only after finalising the checkpoint; until
    then it generates and its tracker reports each 2% bucket. With ``clear_progress`` alone
    the next report brought the demand back (4 here) until the pipeline unregistered."""
    with nemo_rl.training_run({"current_step": 0}):
        _train_demand(pipeline, 4)
    # the collector's own sink (a separate actor, not the driver's hooks)
    sink = nemo_rl.SchedulerProgressSink(coordinator.namespace, None, None)
    sink(ProgressReport(PID, 4, None, {"mode": "train", "completed": 0, "new_batch": True}))
    assert _demand(coordinator) == 0


@pytest.mark.integration
def test_the_checkpointer_shutdown_ends_the_run_before_its_own_work(
        coordinator: Any, pipeline: NemoRlPipeline) -> None:
    class FakeCheckpointManager:
        """FAKE NeMo RL ``CheckpointManager`` (the real one is used by the contract test):
        its ``shutdown`` finalises a pending save."""

        def __init__(self) -> None:
            self.demand_at_finalise: list[int | None] = []

        def shutdown(self) -> None:
            self.demand_at_finalise.append(_demand(coordinator))

    checkpointer = nemo_rl.make_checkpoint_manager_class(FakeCheckpointManager)()
    _train_demand(pipeline, 4)
    checkpointer.shutdown()  # NeMo RL: the loop's return, then its finally: twice
    checkpointer.shutdown()
    assert checkpointer.demand_at_finalise == [0, 0]  # was [4, 4]


# ------------------------------------------------------------------ no coordinator


class FailingHooks:
    """FAKE hooks whose coordinator is unreachable: every report and clear raises."""

    def __init__(self) -> None:
        self.tries = 0

    def report_progress(self, **kwargs: Any) -> None:
        self.tries += 1
        raise ConnectionError("scheduler unreachable")

    def clear_progress(self) -> None:
        self.tries += 1
        raise ConnectionError("scheduler unreachable")


def _pipeline_with(hooks: Any, monkeypatch: pytest.MonkeyPatch) -> NemoRlPipeline:
    from rlix_plugins.settings import load_settings

    p = NemoRlPipeline(load_settings({}), SimpleNamespace(), NemoRlLayout((0, 1), (0,)),
                       hooks, PID)
    monkeypatch.setattr(nemo_rl, "_pipeline", p)
    return p


def test_an_unreachable_coordinator_never_fails_validation_or_the_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    hooks = FailingHooks()
    _pipeline_with(hooks, monkeypatch)
    seen: list[int | None] = []
    with nemo_rl.validation_demand(FakeValLoader(3, 6), VAL_CFG, 1) as batches:
        fake_validate(batches, VAL_CFG, seen, lambda: None)
    with nemo_rl.training_run({"current_step": 0}):
        pass
    # each tried once, none raised: begin, 3 finished batches, end; the run's clear
    assert len(seen) == 3 and hooks.tries == 6


@pytest.mark.parametrize(("step", "target"), [("1", 4), (1, -1), (True, 4), (1.0, 4)])
def test_malformed_validation_counts_are_refused_and_send_nothing(
        monkeypatch: pytest.MonkeyPatch, step: object, target: object) -> None:
    hooks = FailingHooks()
    p = _pipeline_with(hooks, monkeypatch)
    with pytest.raises(ProtocolError, match="valid: an int >= 0"):
        p.begin_validation(step, target)
    assert hooks.tries == 0 and p._validation_target is None


@pytest.mark.parametrize("cfg", [
    {"grpo": {"val_batch_size": 0, "max_val_samples": 6}},
    {"grpo": {"max_val_samples": 6}},
    {"grpo": {"val_batch_size": 2, "max_val_samples": 6, "val_num_generations_per_prompt": 0}},
    {},
])
def test_a_validation_of_unknown_size_runs_unchanged_and_reports_nothing(
        monkeypatch: pytest.MonkeyPatch, cfg: dict[str, Any],
        caplog: pytest.LogCaptureFixture) -> None:
    hooks = FailingHooks()
    _pipeline_with(hooks, monkeypatch)
    loader = FakeValLoader(3, 6)
    with nemo_rl.validation_demand(loader, cfg, 1) as batches:
        assert batches is loader
    assert hooks.tries == 0 and "reports no demand" in caplog.text


def test_the_validation_size_follows_nemo_rl_s_batch_loop() -> None:
    # max_val_samples 7 // 2 = 3 batches, but the loader has 2 and its dataset 3 prompts
    assert nemo_rl.validation_size(FakeValLoader(2, 3), VAL_CFG | {"grpo": {
        "val_batch_size": 2, "max_val_samples": 7}}) == 3
    assert nemo_rl.validation_size(FakeValLoader(9, 100), VAL_CFG) == 24
    assert nemo_rl.validation_size(iter([[0]]), VAL_CFG) == 24  # no len: the config's count


def test_no_pipeline_no_wrapping(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nemo_rl, "_pipeline", None)
    loader = FakeValLoader(3, 6)
    with nemo_rl.validation_demand(loader, VAL_CFG, 1) as batches:
        assert batches is loader
    nemo_rl.end_run()


# ------------------------------------------------------------------ the planner counts it


def _val_report(pid: str, target: int, done: int) -> ProgressReport:
    """The report :meth:`NemoRlPipeline.begin_validation` sends (through ``report_progress``
    of the real hooks, ``tests`` above), built the way ``CoordinatorHooks`` builds it."""
    return ProgressReport(pid, target, None, {"mode": nemo_rl.VALIDATION_MODE,
                                              "completed": done, "outstanding": target - done})


@pytest.mark.parametrize("validating", [False, True])
def test_the_planner_keeps_a_validating_pipelines_ranks(validating: bool) -> None:
    """Pipeline ``v`` generates on GPUs 0-3 and its collector's step is complete; pipeline
    ``b`` (same GPUs) has demand. Without validation demand ``v``'s ranks are lent to ``b``
    (what happened mid-validation before); with it, ``v`` keeps its share as a rollout's
    demand would."""
    state = new_state()
    register(state, "v", infer=[0, 1, 2, 3])
    register(state, "b", infer=[0, 1, 2, 3])
    progress(state, "v", 8, 0)
    cycle(state, 0.0, DemandSharePlanner())
    assert len(state.active_ranks.get("v_actor_infer", {})) == 4
    progress(state, "v", 8, 8)  # the step's trajectories are all in
    if validating:
        state.report_progress(_val_report("v", 24, 0))
    progress(state, "b", 8, 0)
    for t in (100.0, 200.0, 300.0):
        cycle(state, t, DemandSharePlanner())
    kept = len(state.active_ranks.get("v_actor_infer", {}))
    # with validation: its share (each pipeline with demand is guaranteed one rank first, the
    # other two split 24:8 by largest remainder, a tie at .5 each), else all lent
    assert kept >= 2 if validating else kept == 0
