"""Gate 1's overlap cycle judged from a job's records (GPU mode; the CPU rehearsal runs the same
function on its own records, tests/integration/test_gates_cpu.py): the lifecycle record, and
pass and fail cases built from the records a NeMo RL job writes on the gate-1 layout (shard 0
on GPU 0 shared with training, shard 1 on GPU 1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlix_plugins.adapters.observability import (
    BusyObserved,
    LifecycleObserved,
    Observation,
    ObservationError,
    ShardVersionsObserved,
    parse_line,
    read_observations,
    write_all,
)
from rlix_plugins.gates.observed import overlap_from_records

P = "ft_gate1000000a"


def shrink(t: float, rank: int) -> LifecycleObserved:
    return LifecycleObserved(P, "shrink", time=t, rank=rank, gpus=(rank,))


def nccl(t: float, event: str) -> LifecycleObserved:
    return LifecycleObserved(P, event, time=t, gpus=(0,))


def expand(t: float, *ranks: int) -> ShardVersionsObserved:
    return ShardVersionsObserved(P, "expand", 1, ranks, dict.fromkeys(ranks, 1), time=t)


def train(start: float) -> BusyObserved:
    return BusyObserved(P, "train", (0,), start, start + 9)


def nemo_rl_run(steps: int = 3, *, skip: frozenset[str] = frozenset()) -> list[Observation]:
    """The setup (every shard loaded by NeMo RL, put to sleep at the first refit, groups
    destroyed), then per step: shard 0 preempted, GPU 0 granted, groups re-made, trained,
    destroyed, released, shard 0 woken and synced again (not after the last step).
    ``skip`` drops one kind of record in step 1 ("destroy", "reinit", "expand")."""
    recs: list[Observation] = [shrink(1, 0), shrink(1, 1), nccl(1.5, "nccl_destroy"),
                               expand(2, 0, 1)]
    for s in range(steps):
        t = 10 + 20 * s
        recs += [shrink(t, 0), train(t + 1)]
        if not (s == 1 and "reinit" in skip):
            recs.append(nccl(t + 1.5, "nccl_reinit"))
        if not (s == 1 and "destroy" in skip):
            recs.append(nccl(t + 9, "nccl_destroy"))
        if s + 1 < steps and not (s == 1 and "expand" in skip):
            recs.append(expand(t + 11, 0))
    return recs


def judge(tmp_path: Path, recs: list[Observation], steps: int | None = 3) -> tuple[bool, str]:
    write_all(tmp_path, recs)
    r = overlap_from_records(tmp_path, steps=steps, expected_pipelines=1)
    return r.passed, r.measured


def test_a_full_cycle_every_step_passes(tmp_path: Path) -> None:
    ok, measured = judge(tmp_path, nemo_rl_run())
    assert ok, measured
    # the setup sleep of both shards is not a preemption for training
    assert measured == (f"{P}: overlap shard(s) [0]: 3 preemptions (3 before a train step), "
                        "2 followed by wake+sync+activate; 3 train steps, 0 without an NCCL "
                        "destroy before the release, 0 without a re-init after an earlier "
                        "destroy")


def test_groups_made_at_start_up_need_no_re_init_in_the_first_step(tmp_path: Path) -> None:
    """The rehearsal's trainer makes its groups at start-up: its first step re-makes none."""
    recs = [r for r in nemo_rl_run() if not (isinstance(r, LifecycleObserved)
                                              and r.event == "nccl_reinit" and r.time < 20)]
    recs = [r for r in recs if not (isinstance(r, LifecycleObserved) and r.time == 1.5)]
    ok, measured = judge(tmp_path, recs)
    assert ok, measured


@pytest.mark.parametrize(("skip", "expected"), [
    ("destroy", "1 without an NCCL destroy before the release"),
    ("reinit", "1 without a re-init after an earlier destroy"),
    ("expand", "3 preemptions (3 before a train step), 1 followed by wake+sync+activate"),
])
def test_a_missing_step_of_the_cycle_fails(tmp_path: Path, skip: str, expected: str) -> None:
    ok, measured = judge(tmp_path, nemo_rl_run(skip=frozenset({skip})))
    assert not ok and expected in measured, measured


def test_a_preemption_no_train_step_followed_is_not_counted_for_training(
        tmp_path: Path) -> None:
    """Shard 0 taken down and woken again with no train step between: a preemption, but not
    one for training (only the three before train steps are)."""
    ok, measured = judge(tmp_path, [*nemo_rl_run(), shrink(4, 0), expand(5, 0)])
    assert ok, measured
    assert "4 preemptions (3 before a train step), 3 followed by" in measured


def test_groups_re_made_after_the_destroy_of_a_step_fail(tmp_path: Path) -> None:
    """The step's last NCCL event before the release must be the destroy."""
    recs = [r for r in nemo_rl_run() if not (isinstance(r, LifecycleObserved)
                                              and r.event == "nccl_reinit" and r.time == 31.5)]
    recs += [nccl(31.2, "nccl_destroy"), nccl(38.5, "nccl_reinit")]
    recs = [r for r in recs if not (isinstance(r, LifecycleObserved) and r.time == 39)]
    ok, measured = judge(tmp_path, recs)
    assert not ok and "1 without an NCCL destroy before the release" in measured, measured


def test_a_shard_that_never_left_the_training_gpu_fails(tmp_path: Path) -> None:
    """Only the setup sleep: shard 0 was never preempted for a train step."""
    recs = [r for r in nemo_rl_run() if not (isinstance(r, LifecycleObserved)
                                              and r.event == "shrink" and r.time >= 10)]
    ok, measured = judge(tmp_path, recs)
    assert not ok and "0 preemptions (0 before a train step)" in measured, measured


def test_missing_evidence_fails(tmp_path: Path) -> None:
    ok, measured = judge(tmp_path / "steps", nemo_rl_run(2))
    assert not ok and f"{P}: 2 of 3 train steps recorded" in measured
    no_gpus = [LifecycleObserved(P, "shrink", time=r.time, rank=r.rank)
               if isinstance(r, LifecycleObserved) and r.event == "shrink" else r
               for r in nemo_rl_run()]
    ok, measured = judge(tmp_path / "gpus", no_gpus)
    assert not ok and "no shard on its training GPUs was ever shrunk" in measured
    ok, measured = judge(tmp_path / "none", [expand(2, 0)])
    assert not ok and measured.startswith("not observed: no train records")


def test_lifecycle_records_round_trip_and_bad_ones_are_refused(tmp_path: Path) -> None:
    recs = [shrink(1, 0), nccl(2, "nccl_reinit")]
    write_all(tmp_path, recs)
    assert read_observations(tmp_path).lifecycle == tuple(recs)
    with pytest.raises(ObservationError, match="event 'sleep' is not one of"):
        LifecycleObserved(P, "sleep")
    with pytest.raises(ObservationError, match="a shrink names its rank and only a shrink"):
        LifecycleObserved(P, "shrink")
    with pytest.raises(ObservationError, match="a shrink names its rank and only a shrink"):
        LifecycleObserved(P, "nccl_destroy", rank=0)
    with pytest.raises(ObservationError, match="rank=-1 is not valid"):
        LifecycleObserved(P, "shrink", rank=-1)
    with pytest.raises(ObservationError, match=r"step=1\.5 is not valid"):
        LifecycleObserved(P, "nccl_reinit", step=1.5)  # type: ignore[arg-type]
    line = json.dumps({"kind": "lifecycle", "pipeline_id": P, "event": "shrink", "time": 1.0,
                       "rank": -1})
    with pytest.raises(ObservationError, match=r"x.jsonl:2: rank=-1 is not valid"):
        parse_line(line, "x.jsonl:2")
