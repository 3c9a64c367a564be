"""`rlix-plugins coordinator/status` commands and CoordinatorHooks against the real coordinator."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import ray

from rlix_plugins import cli
from rlix_plugins.adapters.observability import read_observations
from rlix_plugins.errors import CoordinatorUnavailableError, PipelineFailedError
from rlix_plugins.hooks import make_hooks
from rlix_plugins.hooks.coordinator_hooks import CoordinatorHooks
from rlix_plugins.protocol import ProgressReport
from rlix_plugins.settings import load_settings
from tests.support.roll_pipeline import register_pipeline, wait_until

pytestmark = pytest.mark.integration



def test_cli_start_status_stop(
    ray_session: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ns = f"rlix_cli_{tmp_path.name[-8:]}"
    assert (
        cli.main(
            ["coordinator", "start", "--namespace", ns, "--nodes", "1", "--gpus-per-node", "8"]
        )
        == 0
    )
    assert "1 node(s) x 8 GPU(s)" in capsys.readouterr().out
    try:
        from rlix_plugins.coordinator.service.client import connect

        plane = connect(namespace=ns, create_if_missing=False)
        register_pipeline(plane, "ft_cli000000001", {"actor_train": [0, 1], "critic": [1]})
        sched = plane.scheduler
        ray.get(sched.request_gpus.remote(cluster_id="ft_cli000000001_actor_train", priority=3))
        waiting = sched.request_gpus.remote(cluster_id="ft_cli000000001_critic", priority=2)
        wait_until(lambda: len(plane.status().wait_queue) == 1, 10)
        val = ProgressReport("ft_cli000000001", 10, None, {"completed": 4, "mode": "val"})
        ray.get(sched.report_progress.remote(val))
        assert cli.main(["status", "--namespace", ns]) == 0
        out = capsys.readouterr().out
        assert "ft_cli000000001_actor_train" in out and "OLD_LOG_PROBS" in out
        assert "WAIT QUEUE" in out and "CRITIC_TRAINING" in out
        assert "demand=6  streams=1" in out and "stream val          4/10 done  remaining=6" in out
        # The real entry point, in another process, on this Ray cluster.
        address = ray.get_runtime_context().gcs_address
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "rlix_plugins.cli",
                "status",
                "--namespace",
                ns,
                "--address",
                address,
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        record = json.loads(proc.stdout)
        assert record["gpus"][0]["owner_cluster"] == "ft_cli000000001_actor_train"
        assert record["wait_queue"][0]["cluster_id"] == "ft_cli000000001_critic"
        [stream] = record["pipelines"][0]["streams"]
        assert (stream["mode"], stream["completed"], stream["remaining"]) == ("val", 4, 6)
        assert json.loads(json.dumps(dataclasses.asdict(plane.status())))["gpus"] == record["gpus"]
        # Watching: one JSON record per line, --count of them.
        assert cli.main(["status", "--namespace", ns, "--json", "--watch", "0.05",
                         "--count", "2"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert len(lines) == 2 and all(json.loads(x)["gpus"] == record["gpus"] for x in lines)
        ray.get(sched.notify_release_gpus.remote(cluster_id="ft_cli000000001_actor_train"))
        assert ray.get(waiting, timeout=10) == [1]
        # What the pipeline sent over the protocol, as the scheduler received it.
        assert cli.main(["status", "--namespace", ns, "--wire"]) == 0
        out = capsys.readouterr().out
        assert "ft_cli000000001: 5 calls, 0 failed" in out
        assert "  priorities: request_gpus: CRITIC_TRAINING 1, request_gpus: OLD_LOG_PROBS 1" in out
        assert "report classes: rlix_plugins.protocol.types.ProgressReport 1" in out
        assert cli.main(["status", "--namespace", ns, "--wire", "--json"]) == 0
        wire = json.loads(capsys.readouterr().out)["ft_cli000000001"]
        assert wire["calls"] == {"register_pipeline": 1, "request_gpus": 2,
                                 "report_progress": 1, "notify_release_gpus": 1}
        assert cli.main(["status", "--namespace", ns, "--wire", "--watch", "1"]) == 2
        err = capsys.readouterr()
        assert err.out == "" and err.err.startswith("rlix-plugins status: error: --wire prints")
    finally:
        assert cli.main(["coordinator", "stop", "--namespace", ns]) == 0
    assert "stopped" in capsys.readouterr().out
    assert cli.main(["status", "--namespace", ns]) == 2


def test_status_of_a_scheduler_that_does_not_answer_is_an_error_naming_the_timeout(
    ray_session: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real Ray actor in the scheduler's place whose ``get_status`` never returns in time:
    ``ControlPlane.status`` raises Ray's own timeout, and ``rlix-plugins status`` turns it into
    exit 2 with a message naming the namespace and the timeout."""
    from ray.exceptions import GetTimeoutError

    from rlix_plugins.coordinator.service import client

    @ray.remote(num_cpus=0)
    class StuckScheduler:
        def get_status(self) -> None:
            time.sleep(60)

    stuck = StuckScheduler.remote()  # type: ignore[attr-defined]
    try:
        plane = client.ControlPlane("rlix_stuck", None, stuck, None, None)
        with pytest.raises(GetTimeoutError):
            plane.status(timeout_s=0.3)
        monkeypatch.setattr(client, "connect", lambda *a, **k: plane)
        assert cli.main(["status", "--namespace", "rlix_stuck", "--timeout", "0.3"]) == 2
        out = capsys.readouterr()
        assert out.out == ""  # stdout keeps only the command's output (its JSON)
        assert out.err.startswith("rlix-plugins status: error: the scheduler in namespace "
                                  "'rlix_stuck' did not answer within 0.3s"), out.err
    finally:
        ray.kill(stuck)


def test_hooks_block_release_report_and_keep_the_lease(
    coordinator: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("RLIX_CONTROL_PLANE", "rlix")
    monkeypatch.setenv("RLIX_NAMESPACE", coordinator.namespace)
    monkeypatch.setenv("RLIX_LEASE_S", "1.5")
    monkeypatch.setenv("RLIX_OBSERVE_DIR", str(tmp_path / "observe"))
    monkeypatch.setenv("RLIX_OBSERVE_GPU_MEMORY", "1")
    settings = load_settings()
    pid, other = "ft_hooks0000001", "ft_hooksother01"
    register_pipeline(coordinator, pid, {"actor_train": [0, 1], "actor_infer": [0, 1, 2, 3]})
    register_pipeline(coordinator, other, {"actor_train": [1]})
    sched = coordinator.scheduler
    ray.get(sched.request_gpus.remote(cluster_id=f"{other}_actor_train", priority=1))
    hooks = make_hooks(settings, pipeline_id=pid)
    assert isinstance(hooks, CoordinatorHooks)
    try:
        done = threading.Event()
        t = threading.Thread(target=lambda: (hooks.before_training(0), done.set()))
        t.start()
        # Blocked behind the other pipeline's training on GPU 1.
        wait_until(lambda: len(coordinator.status().wait_queue) == 1, 10)
        assert not done.is_set()
        ray.get(sched.notify_release_gpus.remote(cluster_id=f"{other}_actor_train"))
        assert done.wait(10)
        t.join()
        owners = coordinator.status().owners()
        assert owners[0] == owners[1] == pid
        assert read_observations(tmp_path / "observe").busy == ()
        hooks.after_training(0)
        assert coordinator.status().owners()[0] is None
        # the train step's busy record (gates judge ownership from it): the granted GPUs, from
        # the grant to the release call
        (rec,) = read_observations(tmp_path / "observe").busy
        assert (rec.pipeline_id, rec.stage, rec.gpus) == (pid, "train", (0, 1))
        assert rec.end >= rec.start
        # GPU memory readings on: this machine has no NVML nor nvidia-smi, so the record says
        # why there is no figure (a gate fails it) and the release above still went out.
        (mem,) = read_observations(tmp_path / "observe").memory
        assert (mem.pipeline_id, mem.step, mem.gpus, mem.used_bytes) == (pid, 0, (0, 1),
                                                                        (None, None))
        assert "nvidia-smi" in mem.error  # NVML failed first; then nvidia-smi was absent or failed
        # Progress: 2% buckets; the scheduler sees the remaining demand.
        sent = []
        real_call = hooks._call

        def counting(method: str, *a: Any, **kw: Any) -> Any:
            sent.append(method)
            return real_call(method, *a, **kw)

        monkeypatch.setattr(hooks, "_call", counting)
        for collected in range(0, 101):
            hooks.report_progress(
                step_target_trajectories=1000, collected=collected, current_train_step=1
            )
        assert sent.count("report_progress") == 6  # buckets 0..5 (20 trajectories each)
        status = coordinator.status().pipeline(pid)
        assert status is not None and status.demand == 900
        hooks.report_progress(step_target_trajectories=1000, collected=1000, current_train_step=1)
        assert coordinator.status().pipeline(pid).demand == 0  # type: ignore[union-attr]
        hooks.clear_progress()
        assert coordinator.status().pipeline(pid).progress_streams == 0  # type: ignore[union-attr]
        # The heartbeat thread keeps the lease well past lease_s: let three leases elapse
        # (the property under test is about time passing, nothing to synchronise on).
        time.sleep(3 * settings.lease_s)
        assert coordinator.status().pipeline(pid) is not None
    finally:
        hooks.close()  # type: ignore[union-attr]
    # Without heartbeats the lease lapses and the pipeline is declared dead.
    wait_until(lambda: coordinator.status().pipeline(pid) is None, 10)
    with pytest.raises(PipelineFailedError, match=f"pipeline '{pid}' was declared dead"):
        hooks.before_training(1)


def test_hooks_beat_at_the_coordinators_lease_when_theirs_is_longer(
    coordinator: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The coordinator's lease (1.5 s here) is the one that counts: a pipeline started with
    RLIX_LEASE_S=10 used to beat every 3.3 s and was declared dead."""
    monkeypatch.setenv("RLIX_CONTROL_PLANE", "rlix")
    monkeypatch.setenv("RLIX_NAMESPACE", coordinator.namespace)
    monkeypatch.setenv("RLIX_LEASE_S", "10")
    pid = "ft_hookslease01"
    register_pipeline(coordinator, pid, {"actor_train": [0]})
    hooks = make_hooks(load_settings(), pipeline_id=pid)
    assert isinstance(hooks, CoordinatorHooks)
    try:
        # three of the coordinator's leases (time passing is the property under test)
        time.sleep(3 * 1.5)
        assert coordinator.status().pipeline(pid) is not None
        assert hooks.heartbeat_error is None
    finally:
        hooks.close()


@ray.remote(num_cpus=0)
class _HungScheduler:
    """FAKE scheduler: answers nothing within any timeout (the state a deadlocked or
    overloaded coordinator would be in, which the real one cannot be put in on demand)."""

    def notify_release_gpus(self, **_: Any) -> None:
        time.sleep(30)

    def heartbeat(self, pipeline_id: str) -> float:
        return 1.5


def test_a_call_to_a_hung_scheduler_is_bounded(ray_session: Any) -> None:
    settings = dataclasses.replace(load_settings({"RLIX_CONTROL_PLANE": "rlix"}),
                                   request_timeout_s=1.0)
    hung = _HungScheduler.remote()  # type: ignore[attr-defined]
    hooks = CoordinatorHooks("ft_hookshung001", settings, scheduler=hung, heartbeat=False)
    started = time.monotonic()
    with pytest.raises(CoordinatorUnavailableError, match="did not answer notify_release_gpus"):
        hooks.after_training(0)
    assert time.monotonic() - started < 10  # bounded by the 1 s setting, not the 30 s hang
    ray.kill(hung)


def test_hooks_ride_through_a_recreated_coordinator(
    coordinator: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlix_plugins.coordinator.service.client import connect, stop_coordinator

    monkeypatch.setenv("RLIX_CONTROL_PLANE", "rlix")
    monkeypatch.setenv("RLIX_NAMESPACE", coordinator.namespace)
    settings = load_settings()
    pid, other = "ft_recreate0001", "ft_recreateoth1"
    register_pipeline(coordinator, pid, {"actor_train": [0]})
    register_pipeline(coordinator, other, {"actor_train": [0]})
    ray.get(
        coordinator.scheduler.request_gpus.remote(cluster_id=f"{other}_actor_train", priority=1)
    )
    hooks = CoordinatorHooks(pid, settings, heartbeat=False)
    errors: list[BaseException] = []
    done = threading.Event()

    def train() -> None:
        try:
            hooks.before_training(0)
        except BaseException as exc:
            errors.append(exc)
        done.set()

    t = threading.Thread(target=train)
    t.start()
    wait_until(lambda: len(coordinator.status().wait_queue) == 1, 10)
    # Stop (keeping the saved state) and start a new coordinator: new actor ids.
    stop_coordinator(coordinator.namespace, clear_state=False)
    plane = connect(namespace=coordinator.namespace, config=None)
    assert plane.scheduler._actor_id != coordinator.scheduler._actor_id
    owners = plane.status().owners()
    assert owners[0] == other, "the recovered state still has the other pipeline's grant"
    ray.get(plane.scheduler.notify_release_gpus.remote(cluster_id=f"{other}_actor_train"))
    assert done.wait(30), "before_training returned after the coordinator came back"
    t.join()
    assert errors == []
    assert plane.status().owners()[0] == pid
