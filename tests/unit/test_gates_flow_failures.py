"""Failure handling of the gate flows (rehearsal, NeMo RL-like runtime, ROLL sequence, GPU mode):
races, cleanup on failure, config translation. Every fake here is marked FAKE; no Ray, no
engine, no GPU."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from rlix_plugins.gates import gpu_mode
from rlix_plugins.gates.gpu_mode import GpuGateOptions, check_prerequisites
from rlix_plugins.gates.nemo_rehearsal import PipelineSpec, RehearsalRuntime
from rlix_plugins.generation.engine import GenerationRequest, GenerationResult
from rlix_plugins.generation.loop_thread import LoopThread
from rlix_plugins.generation.shard_state import ShardStatus
from rlix_plugins.generation.state_store import ShardStateStore

# ---------------------------------------------------------------------------- NeMo RL-like runtime


def _spec(**kw: Any) -> PipelineSpec:
    return PipelineSpec("t", (0, 1), (0,), ("0", "1"), "unused-model-dir", **kw)


def _bare_runtime(**attrs: Any) -> RehearsalRuntime:
    """FAKE: a runtime without engines, trainer or cache (each test sets what it uses)."""
    rt = object.__new__(RehearsalRuntime)
    rt.pipeline_id = "ft_000000000000"
    rt.spec = _spec()
    rt.infer_cluster = "ft_000000000000_actor_infer"
    rt.train_cluster = "ft_000000000000_actor_train"
    rt.busy = []
    rt.sync_checks = []
    rt.expands = 0
    rt.rank_events = []
    rt._step = 0
    rt._sync_lock = threading.Lock()
    for k, v in attrs.items():
        setattr(rt, k, v)
    return rt


class _FakeCache:
    """FAKE BucketCache: versions and the active one, with a hook right after activation."""

    def __init__(self) -> None:
        self.active: int | None = None
        self.on_activate: Any = None
        self.closed = False

    @property
    def active_version(self) -> int | None:
        return self.active

    def build(self, version: int, tensors: Any) -> None:
        pass

    def activate(self, version: int) -> None:
        self.active = version
        if self.on_activate is not None:
            self.on_activate(version)

    def close(self) -> None:
        self.closed = True


class _FakeTrainer:
    """FAKE trainer: checksums name the version they belong to."""

    def __init__(self) -> None:
        self.version = 0
        self.closed = False
        self.cycles = 0

    def hf_weights(self) -> list[Any]:
        return []

    def plain_checksums(self) -> dict[str, str]:
        time.sleep(0.05)  # the real one hashes the embeddings: takes a while
        return {"model.norm.weight": f"v{self.version}"}

    def close(self) -> None:
        self.closed = True


class _FakeEngine:
    """FAKE vLLM AsyncLLM: answers the receiver extension's version/checksum RPCs."""

    def __init__(self, trainer: _FakeTrainer) -> None:
        self.trainer = trainer
        self.synced: int | None = None
        self.shut = False
        self.fail_shutdown = False

    async def collective_rpc(self, method: str, args: Sequence[Any] = ()) -> list[Any]:
        if method == "rlix_weight_version":
            return [self.synced]
        return [{"model.norm.weight": f"v{self.synced}"}]

    def shutdown(self) -> None:
        self.shut = True
        if self.fail_shutdown:
            raise RuntimeError("engine core died")


class _AsyncioLoop:
    """FAKE LoopThread.run: a fresh event loop per call."""

    def run(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run(coro)


def test_an_expand_racing_the_cache_build_verifies_a_version_it_knows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An expand (another pipeline's train step freed our shard's GPU) can run while our own
    step builds the next cache version. It used to see the new version active before its
    expected checksums were recorded: KeyError in the verification, the expand failed and the
    coordinator declared the pipeline dead."""
    import rlix_plugins.training.sync as sync_mod

    trainer = _FakeTrainer()
    engines = [_FakeEngine(trainer), _FakeEngine(trainer)]
    cache = _FakeCache()
    rt = _bare_runtime(cache=cache, trainer=trainer, expected={}, version=-1,
                       _engines_raw=engines, receivers=[0, 1], _loop=_AsyncioLoop())

    def fake_sync_version(cache_: Any, version: int, receivers: Sequence[int],
                          **_: Any) -> None:  # FAKE transport: the engines take the version
        for r in receivers:
            engines[r].synced = version

    monkeypatch.setattr(sync_mod, "sync_version", fake_sync_version)
    rt._build_version(0)
    errors: list[BaseException] = []

    def concurrent_expand() -> None:
        try:
            with rt._sync_lock:  # what expand() / refresh_active() hold around _sync
                rt._sync([1], "expand")
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads: list[threading.Thread] = []

    def on_activate(version: int) -> None:
        if version == 1:
            t = threading.Thread(target=concurrent_expand)
            threads.append(t)
            t.start()
            t.join(timeout=0.5)  # let it run now if nothing stops it

    cache.on_activate = on_activate
    trainer.version = 1
    rt._build_version(1)
    for t in threads:
        t.join(timeout=5)
    assert not errors, errors
    assert rt.sync_checks and all(c.ok for c in rt.sync_checks), rt.sync_checks


class _HangingRouter:
    """FAKE router: step-0 requests complete, step-1 requests hang until cancelled."""

    def __init__(self) -> None:
        self.inflight = 0
        self.outstanding = 0

    def _reset_runtime(self) -> None:
        pass

    def emit_counters(self) -> None:
        pass

    def stats(self) -> Any:
        class S:
            redispatched = 0
            requests = 0
            completed = 0
        return S()

    async def generate(self, req: GenerationRequest) -> GenerationResult:
        self.inflight += 1
        try:
            if "-s1-" in req.request_id:
                await asyncio.Event().wait()
            return GenerationResult(req.request_id, (1,) * req.max_tokens, "length", None, 0, 1)
        finally:
            self.inflight -= 1


class _FailingTrainer(_FakeTrainer):
    def train_step(self, samples: Any, step: int) -> Any:
        raise RuntimeError("train step failed")


class _Lifecycle:  # FAKE ShardLifecycle counters
    preemptions = 0
    forced_sleeps = 0


def test_a_failed_step_cancels_the_batch_already_generating() -> None:
    """One-step off-policy: batch s+1 generates while step s trains. When the step failed,
    that batch kept running on the engines after run() returned, into the next run (whose
    router counters and records it then polluted)."""
    from rlix_plugins.hooks.protocol import NoOpRLixHooks

    loop = LoopThread("review-run")
    router = _HangingRouter()
    rt = _bare_runtime(spec=_spec(batch=2, max_tokens=3), _loop=loop, router=router,
                       store=ShardStateStore(2, initial=ShardStatus.ACTIVE),
                       lifecycle=_Lifecycle(), trainer=_FailingTrainer(), version=0)
    rt._enter_mode = lambda mode: None  # type: ignore[method-assign]  # FAKE: no shards to set up
    try:
        run = rt.run(2, "exclusive", NoOpRLixHooks(), lambda _s: None)
        assert run.error is not None and "train step failed" in run.error
        deadline = time.monotonic() + 3.0
        while router.inflight and time.monotonic() < deadline:
            time.sleep(0.02)
        assert router.inflight == 0, f"{router.inflight} requests still generating after run()"
    finally:
        loop.close()


def test_shutdown_stops_every_engine_and_closes_everything_when_one_engine_fails() -> None:
    trainer = _FakeTrainer()
    engines = [_FakeEngine(trainer), _FakeEngine(trainer)]
    engines[0].fail_shutdown = True
    loop = LoopThread("review-shutdown")
    cache = _FakeCache()
    rt = _bare_runtime(_engines_raw=engines, receivers=[], cache=cache, trainer=trainer,
                       _loop=loop)
    with pytest.raises(RuntimeError, match="engine core died"):
        rt.shutdown()
    assert engines[1].shut, "the second engine was left running"
    assert cache.closed and trainer.closed and loop.closed


# ---------------------------------------------------------------------------- rehearsal + ROLL


class _Ref:
    """FAKE object ref: remembers which actor method made it."""

    def __init__(self, method: str = "") -> None:
        self.method = method


class _FakeRay:
    """FAKE ray module: get() of the NeMo pipelines' run fails (a hung or dead pipeline)."""

    def __init__(self) -> None:
        self.killed: list[Any] = []

    def get(self, ref: Any, timeout: float | None = None) -> Any:
        if isinstance(ref, list):
            raise TimeoutError("pipeline run did not return")
        return None

    def kill(self, actor: Any, no_restart: bool = True) -> None:
        self.killed.append(actor)


class _Method:
    def __init__(self, name: str) -> None:
        self.name = name

    def remote(self, *a: Any, **k: Any) -> _Ref:
        return _Ref(self.name)


class _FakeActor:
    def __getattr__(self, name: str) -> _Method:
        return _Method(name)


class _FakePlane:
    namespace = "rlix_review"
    scheduler = _FakeActor()
    orchestrator = _FakeActor()


def _rehearsal(tmp_path: Path) -> Any:
    from rlix_plugins.gates.rehearsal import RehearsalConfig, _Rehearsal

    reh: Any = object.__new__(_Rehearsal)  # FAKE: no Ray, no coordinator
    reh.cfg = RehearsalConfig(gate=3, steps=1, out_dir=tmp_path)
    reh.out = tmp_path
    reh.ray = _FakeRay()
    reh.namespace = "rlix_review"
    reh.plane = _FakePlane()
    reh.actors = [("ft_a", _FakeActor())]
    reh.rolls = []  # as __init__ sets it
    reh.rlix_types = object()
    return reh


class _FakeRoll:
    """FAKE RollSequencePipeline: records setup/run/close."""

    instances: list[_FakeRoll] = []
    release = threading.Event()

    def __init__(self, plane: Any, spec: Any, types: Any) -> None:
        self.spec = spec
        self.pipeline_id = "ft_roll"
        self.closed = False
        _FakeRoll.instances.append(self)

    def setup(self) -> None:
        pass

    def run(self, steps: int, mode: str = "shared") -> Any:
        from rlix_plugins.gates.roll_sequence import RollRun

        _FakeRoll.release.wait(timeout=10)
        return RollRun("ft_roll", "roll", mode, steps, steps_done=steps)

    def collect(self, run: Any) -> Any:
        self.close()
        return run

    def close(self) -> None:
        self.closed = True


def test_a_failed_shared_phase_still_stops_the_roll_pipeline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gate 3: when the NeMo RL pipelines' run failed, the ROLL pipeline's coordinator actor
    stayed alive and registered (close() only knew the NeMo RL actors)."""
    import rlix_plugins.coordinator.service.client as client
    import rlix_plugins.gates.roll_sequence as roll_sequence

    _FakeRoll.instances = []
    _FakeRoll.release.set()
    monkeypatch.setattr(roll_sequence, "RollSequencePipeline", _FakeRoll)
    monkeypatch.setattr(client, "stop_coordinator", lambda ns: None)
    reh = _rehearsal(tmp_path)
    with pytest.raises(TimeoutError):
        reh.shared_phase([])
    reh.close()
    assert _FakeRoll.instances and all(r.closed for r in _FakeRoll.instances)


def test_a_roll_run_that_does_not_finish_in_time_counts_as_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It used to be dropped: the phase had no ROLL run, so `steps` judged NeMo RL alone."""
    import rlix_plugins.gates.rehearsal as rehearsal
    import rlix_plugins.gates.roll_sequence as roll_sequence

    _FakeRoll.instances = []
    _FakeRoll.release.clear()
    monkeypatch.setattr(roll_sequence, "RollSequencePipeline", _FakeRoll)
    monkeypatch.setattr(rehearsal, "PHASE_TIMEOUT_S", 0.3)
    reh = _rehearsal(tmp_path)
    reh.actors = []  # no NeMo RL pipeline: ray.get([]) of nothing

    class _Status:  # FAKE scheduler status
        dead_pipelines: list[Any] = []
        wait_queue: list[Any] = []

    class _Ray(_FakeRay):  # FAKE: no NeMo RL runs; the trace, the status, no wire log
        def get(self, ref: Any, timeout: float | None = None) -> Any:
            if isinstance(ref, list):
                return []
            return {} if ref.method == "get_wire_log" else _Status()

    reh.ray = _Ray()
    monkeypatch.setattr(rehearsal, "intervals_from_trace", lambda trace: ([], 0.0))
    try:
        phase = reh.shared_phase([])
    finally:
        _FakeRoll.release.set()
    assert len(phase.roll) == 1 and phase.roll[0].error, phase.roll
    assert _FakeRoll.instances[0].closed


# ---------------------------------------------------------------------------- GPU mode


def test_null_override_values_reach_hydra_as_null() -> None:
    """`key: null` in a gate config became `key=None`: Hydra reads the string "None"."""
    assert gpu_mode._overrides({"a.b": None, "c": [None, True]}) == ["a.b=null",
                                                                     "c=[null, true]"]


def _prereq_opts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str) -> GpuGateOptions:
    monkeypatch.setattr(gpu_mode, "count_cuda_gpus", lambda: (2, "NVML"))
    (tmp_path / "nemo" / "nemo_rl").mkdir(parents=True)
    cfg = tmp_path / "gate.yaml"
    cfg.write_text(text)
    return GpuGateOptions(2, tmp_path / "out", config=cfg, nemo_rl_src=tmp_path / "nemo")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("nemo_rl:\n  - name: a\n    overrides: {grpo.max_num_steps: twenty}\n",
         "grpo.max_num_steps"),
        ("nemo_rl:\n  - name: a\n    overrides: {policy.x: {y: 1}}\n", "policy.x"),
        ("overrides: {grpo.max_num_steps: [1]}\n", "grpo.max_num_steps"),
    ],
)
def test_override_values_that_cannot_become_a_job_are_prerequisite_problems(
    text: str, needle: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A non-integer step count used to be a ValueError/TypeError from load_jobs after Ray
    started; a mapping value became Python's repr on the command line."""
    problems = check_prerequisites(_prereq_opts(tmp_path, monkeypatch, text))
    assert any(needle in p for p in problems), problems


def test_a_missing_roll_config_template_is_a_prerequisite_problem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It used to be a FileNotFoundError from the launch, with the coordinator and the
    NeMo RL job already started."""
    text = ("nemo_rl:\n  - name: a\n    overrides: {x: 1}\n"
            "roll:\n  command: [python, x.py]\n"
            "  configs:\n    - {src: no_such_template.yaml, dest: out.yaml, mode: shared}\n")
    problems = gpu_mode.config_problems(
        _prereq_opts(tmp_path, monkeypatch, text).config or Path(), 3)
    assert any("no_such_template.yaml" in p for p in problems), problems


class _Runtime:  # FAKE ray runtime context
    gcs_address = "127.0.0.1:6379"


def _fake_gpu_run(monkeypatch: pytest.MonkeyPatch, stopped: list[str]) -> None:
    """FAKE everything run_gpu_gate starts: Ray, the coordinator, the jobs."""
    import ray

    import rlix_plugins.coordinator.service.client as client

    monkeypatch.setattr(gpu_mode, "check_prerequisites", lambda opts: [])
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: _Runtime())
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: {})
    monkeypatch.setattr(client, "connect", lambda **kw: _FakePlane())
    monkeypatch.setattr(client, "stop_coordinator", lambda ns: stopped.append(ns))
    monkeypatch.setattr(gpu_mode, "load_jobs", lambda opts, exclusive: [])
    monkeypatch.setattr(gpu_mode, "run_jobs", lambda *a, **k: {})
    monkeypatch.setattr(gpu_mode, "intervals_from_trace", lambda trace: ([], 0.0))


def test_gpu_mode_needs_nvidia_smi_before_it_starts_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NVML can count the GPUs without nvidia-smi on PATH; the utilisation sampler then died
    with a FileNotFoundError after the coordinator had started."""
    stopped: list[str] = []
    _fake_gpu_run(monkeypatch, stopped)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(gpu_mode.PrerequisiteError, match="nvidia-smi"):
        gpu_mode.run_gpu_gate(GpuGateOptions(1, tmp_path / "out"))
    assert stopped == []  # nothing was started


def gpu_run_whose_jobs_fail(monkeypatch: pytest.MonkeyPatch, stopped: list[str]) -> None:
    """A FAKE GPU run past every prerequisite (nvidia-smi found, sampler not started) whose
    jobs fail inside it (``RuntimeError("job launch failed")``)."""
    _fake_gpu_run(monkeypatch, stopped)
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/" + name)
    monkeypatch.setattr(gpu_mode.UtilSampler, "start", lambda self: None)

    def launch_fails(*a: Any, **k: Any) -> Any:  # FAKE: the jobs fail inside the run
        raise RuntimeError("job launch failed")

    monkeypatch.setattr(gpu_mode, "run_jobs", launch_fails)


def test_the_coordinator_is_stopped_even_when_the_sampler_does_not_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stopped: list[str] = []
    gpu_run_whose_jobs_fail(monkeypatch, stopped)

    def stop_hangs(self: Any, timeout_s: float = 10.0) -> None:  # FAKE: nvidia-smi hung
        raise subprocess.TimeoutExpired("nvidia-smi", timeout_s)

    monkeypatch.setattr(gpu_mode.UtilSampler, "stop", stop_hangs)
    with pytest.raises((RuntimeError, subprocess.TimeoutExpired)):
        gpu_mode.run_gpu_gate(GpuGateOptions(1, tmp_path / "out"))
    assert len(stopped) == 1, "the coordinator was left running"


def test_sampler_stop_kills_an_nvidia_smi_that_ignores_sigterm() -> None:
    sampler = gpu_mode.UtilSampler()
    # FAKE nvidia-smi: ignores SIGTERM (a wedged driver makes the real one hang)
    sampler._proc = subprocess.Popen(
        [sys.executable, "-c", "import signal, sys, time\n"
         "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('up', flush=True)\n"
         "time.sleep(60)\n"], stdout=subprocess.PIPE, text=True)
    assert sampler._proc.stdout is not None and sampler._proc.stdout.readline() == "up\n"
    t0 = time.monotonic()
    sampler.stop(timeout_s=0.5)
    assert sampler._proc.poll() is not None and time.monotonic() - t0 < 10
