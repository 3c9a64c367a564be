"""The weights and requests criteria as GPU mode judges them, from observation records: pass
and fail cases built from records, the "not observed" verdict, and the job environment that
makes a launched job write the records the gate reads."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rlix_plugins.adapters.observability import (
    RouterCountersObserved,
    ShardVersionsObserved,
    read_observations,
    write_all,
)
from rlix_plugins.gates.gpu_mode import JobSpec, run_jobs, shared_job_env
from rlix_plugins.gates.observed import (
    observed_criteria,
    requests_from_records,
    weights_from_records,
)

REPO = Path(__file__).resolve().parents[2]
A = "ft_aaaaaaaaaaaa"
B = "ft_bbbbbbbbbbbb"


def sv(event: str, version: int, synced: tuple[int, ...], served: dict[int, int | None],
       pid: str = A, step: int | None = None) -> ShardVersionsObserved:
    return ShardVersionsObserved(pid, event, version, synced, served, step=step)


def rc(copy: str, submitted: int, completed: int, *, lost: int = 0, dup: int = 0,
       cancelled: int = 0, in_flight: int = 0, redispatched: int = 0, pid: str = A,
       t: float = 1.0) -> RouterCountersObserved:
    return RouterCountersObserved(pid, copy, submitted, completed, redispatched, lost, dup,
                                  cancelled, in_flight, time=t)


def judge(tmp_path: Path, records: list[ShardVersionsObserved | RouterCountersObserved],
          expected: int | None = None) -> tuple[bool, str, bool, str]:
    write_all(tmp_path, records)
    w, r = observed_criteria([("shared", tmp_path)], expected_pipelines=expected)
    return w.passed, w.measured, r.passed, r.measured


# ---------------------------------------------------------------------------- weights


def test_a_steps_records_pass(tmp_path: Path) -> None:
    records = [
        sv("expand", 0, (0, 1), {0: 0, 1: 0}),
        sv("refresh", 1, (1,), {1: 1}, step=0),  # shard 0 was preempted for training
        sv("expand", 1, (0,), {0: 1, 1: 1}),
        sv("refresh", 2, (0, 1), {0: 2, 1: 2}, step=1),
    ]
    ok, measured, _, _ = judge(tmp_path, records)
    assert ok, measured
    assert measured.startswith("7 engine-reported shard versions in 4 sync records "
                               "(expand 2, refresh 2) of 1 pipeline(s)")


def test_a_synced_shard_serving_the_old_version_fails(tmp_path: Path) -> None:
    ok, measured, _, _ = judge(tmp_path, [
        sv("expand", 0, (0, 1), {0: 0, 1: 0}),
        sv("refresh", 1, (0, 1), {0: 1, 1: 0}, step=0),
    ])
    assert not ok
    assert f"1 stale, first: shared/{A} step 0 after refresh: synced shard 1 serves v0, " \
           "trainer v1" in measured


def test_a_shard_without_a_version_fails(tmp_path: Path) -> None:
    ok, measured, _, _ = judge(tmp_path, [sv("expand", 0, (0,), {0: None})])
    assert not ok and "synced shard 0 serves no version" in measured


def test_an_older_active_shard_passes_only_if_a_refresh_follows(tmp_path: Path) -> None:
    # Expand between the cache build of v2 and the refresh: shard 1 still serves v1.
    race = [sv("expand", 1, (0, 1), {0: 1, 1: 1}), sv("expand", 2, (0,), {0: 2, 1: 1})]
    ok, measured, _, _ = judge(tmp_path / "no_refresh", race)
    assert not ok and "active shard 1 serves v1, trainer v2" in measured
    ok, measured, _, _ = judge(tmp_path / "refresh", [*race,
                                                      sv("refresh", 2, (0, 1), {0: 2, 1: 2})])
    assert ok, measured
    # ...and a refresh of ANOTHER pipeline does not excuse it
    ok, _, _, _ = judge(tmp_path / "other", [*race, sv("refresh", 2, (0,), {0: 2}, pid=B)])
    assert not ok


def test_a_version_newer_than_the_trainers_fails(tmp_path: Path) -> None:
    ok, measured, _, _ = judge(tmp_path, [sv("expand", 1, (0,), {0: 1, 1: 5})])
    assert not ok and "active shard 1 serves v5, trainer v1" in measured


def test_records_of_too_few_pipelines_fail(tmp_path: Path) -> None:
    ok, measured, rok, rmeasured = judge(
        tmp_path, [sv("expand", 0, (0,), {0: 0}), rc("c", 4, 4)], expected=2)
    assert not ok and "shared: records of 1 of 2 pipelines" in measured
    assert not rok and "shared: records of 1 of 2 pipelines" in rmeasured


def test_no_records_fail_as_not_observed(tmp_path: Path) -> None:
    w, r = observed_criteria([("shared", tmp_path / "observe")])
    assert not w.passed and w.measured.startswith("not observed: no shard-version records in")
    assert not r.passed and r.measured.startswith("not observed: no router-counter records in")
    # records with nothing active to check do not pass either
    ok, measured, _, _ = judge(tmp_path / "empty", [sv("refresh", 1, (), {})])
    assert not ok and measured.startswith("0 engine-reported shard versions")


def test_unreadable_records_fail_both_with_file_and_line(tmp_path: Path) -> None:
    (tmp_path / f"{A}.jsonl").write_text('{"kind": "nope"}\n')
    w, r = observed_criteria([("shared", tmp_path)])
    assert not w.passed and not r.passed
    assert f"{A}.jsonl:1" in w.measured and "kind 'nope' is not valid" in r.measured


# ---------------------------------------------------------------------------- requests


def test_requests_pass_from_the_last_record_of_each_copy(tmp_path: Path) -> None:
    _, _, ok, measured = judge(tmp_path, [
        rc("driver", 3, 1, in_flight=2, t=1.0),
        rc("driver", 8, 8, redispatched=3, t=2.0),  # supersedes the one above
        rc("collector", 5, 4, cancelled=1, t=2.0),  # a caller's cancel is not a loss
        rc("other", 6, 6, pid=B),
    ], expected=2)
    assert ok, measured
    assert f"shared/{A}: 12/13 completed, 0 lost, 0 dup, 0 in flight at the end, 1 cancelled " \
           "by the caller, 3 re-dispatched (2 router copies)" in measured


def test_lost_duplicated_or_unfinished_requests_fail(tmp_path: Path) -> None:
    for name, recs in [("lost", [rc("c0", 4, 4), rc("c", 5, 4, lost=1)]),
                       ("dup", [rc("c0", 4, 4), rc("c", 5, 5, dup=1)]),
                       ("unfinished", [rc("c0", 4, 4), rc("c", 5, 3, in_flight=2)]),
                       ("none", [rc("c", 0, 0)])]:
        _, _, ok, measured = judge(tmp_path / name, recs)
        assert not ok, (name, measured)


def test_weights_and_requests_functions_take_several_runs(tmp_path: Path) -> None:
    write_all(tmp_path / "s", [sv("expand", 0, (0,), {0: 0}), rc("c", 2, 2)])
    write_all(tmp_path / "e", [sv("initial", 0, (1,), {1: 0}), rc("d", 2, 2)])
    runs = [("shared", read_observations(tmp_path / "s")),
            ("exclusive", read_observations(tmp_path / "e"))]
    w = weights_from_records(runs, name="weights_observed")
    r = requests_from_records(runs, name="requests_observed")
    assert w.passed and w.name == "weights_observed" and "initial 1" in w.measured
    assert r.passed and "exclusive/" in r.measured and "shared/" in r.measured


def test_a_run_without_records_fails_even_when_the_other_run_has_them(tmp_path: Path) -> None:
    """The shared run and its exclusive baseline use the same pipeline ids: records of the
    baseline must not stand in for a shared run (the one with preemption) that wrote none."""
    (tmp_path / "s").mkdir()
    write_all(tmp_path / "e", [sv("initial", 0, (1,), {1: 0}), rc("d", 2, 2)])
    w, r = observed_criteria([("shared", tmp_path / "s"), ("exclusive", tmp_path / "e")],
                             expected_pipelines=1)
    assert not w.passed and "no shard-version records of shared" in w.measured
    assert not r.passed and "no router-counter records of shared" in r.measured
    write_all(tmp_path / "s", [sv("expand", 0, (0,), {0: 0}), rc("c", 2, 2)])
    w, r = observed_criteria([("shared", tmp_path / "s"), ("exclusive", tmp_path / "e")],
                             expected_pipelines=1)
    assert w.passed and r.passed, (w.measured, r.measured)


# ---------------------------------------------------------------------------- job plumbing

JOB = """
import os
from rlix_plugins.adapters.observability import router_counters_emitter
from rlix_plugins.generation.router import RouterCounters
emit = router_counters_emitter()
assert emit is not None, "RLIX_OBSERVE_DIR did not reach the job"
emit(RouterCounters("job", 3, 3, 0, 0, 0, 0, 1))
"""


def test_a_launched_job_writes_where_gpu_mode_reads(tmp_path: Path) -> None:
    """gpu_mode's job environment carries RLIX_OBSERVE_DIR into a real subprocess whose
    writer the gate's evaluation then reads (the NeMo RL adapter's path, minus NeMo RL)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("RLIX_")}
    # As on a GPU box, the job imports rlix-plugins through PYTHONPATH (docs/gates.md).
    base["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), base.get("PYTHONPATH")) if p)
    env = shared_job_env({**base, "PIPELINE_ID": A}, tmp_path, "rlix_gate_test", "addr:1")
    assert env["RLIX_CONTROL_PLANE"] == "rlix" and env["RAY_ADDRESS"] == "addr:1"
    job = JobSpec("nemo_rl", (sys.executable, "-c", JOB), tmp_path)
    assert run_jobs([job], env, tmp_path, concurrent=True) == {"nemo_rl": 0}, \
        (tmp_path / "nemo_rl.log").read_text()
    w, r = observed_criteria([("shared", tmp_path / "observe")], expected_pipelines=1)
    assert r.passed and f"{A}: 3/3 completed" in r.measured
    assert not w.passed and w.measured.startswith("not observed")
