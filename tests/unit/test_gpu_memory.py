"""GPU memory readings for gate 1's memory criterion: the reader (NVML, else nvidia-smi), the
record, the hooks' reading before each release, and the criterion judged from the records.

This machine has no GPU: NVML and nvidia-smi are FAKES here (a module object with NVML's
function names, a ``subprocess.run`` stand-in). Only the no-GPU path runs for real."""

from __future__ import annotations

import json
import shutil
import subprocess
import types
from pathlib import Path
from typing import Any

import pytest

from rlix_plugins.adapters.gpu_memory import (
    ENV_OBSERVE_GPU_MEMORY,
    MemoryReadError,
    NvmlMemoryReader,
    memory_reader_from_env,
    parse_smi_used_mib,
)
from rlix_plugins.adapters.observability import (
    BusyObserved,
    MemoryObserved,
    ObservationError,
    ObservationWriter,
    parse_line,
    read_observations,
    write_all,
)
from rlix_plugins.gates.gpu_mode import shared_job_env
from rlix_plugins.gates.observed import GIB, memory_from_records
from rlix_plugins.hooks.coordinator_hooks import CoordinatorHooks
from rlix_plugins.settings import load_settings

A = "ft_aaaaaaaaaaaa"
B = "ft_bbbbbbbbbbbb"


def fake_nvml(used: dict[int, int], *, init_error: Exception | None = None) -> Any:
    """FAKE ``pynvml``: GPUs ``used`` (index -> bytes in use); an unknown index raises."""

    def init() -> None:
        if init_error is not None:
            raise init_error

    def handle(i: int) -> int:
        if i not in used:
            raise RuntimeError(f"NVML_ERROR_INVALID_ARGUMENT for index {i}")
        return i

    return types.SimpleNamespace(
        nvmlInit=init, nvmlDeviceGetHandleByIndex=handle,
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=used[h]))


def fake_smi(stdout: str, rc: int = 0) -> Any:
    """FAKE ``subprocess.run`` answering like ``nvidia-smi --query-gpu=memory.used``."""
    calls: list[list[str]] = []

    def run(argv: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        calls.append(argv)
        return subprocess.CompletedProcess(argv, rc, stdout, "no such GPU" if rc else "")

    run.calls = calls  # type: ignore[attr-defined]
    return run


# ---------------------------------------------------------------------------- reader


def test_nvml_reader_reads_used_bytes_and_names_a_gpu_it_does_not_have() -> None:
    reader = NvmlMemoryReader(nvml=fake_nvml({0: 700 << 20, 1: 3 << 30}))
    assert reader.used_bytes(0) == 700 << 20
    assert reader.used_bytes(1) == 3 << 30
    with pytest.raises(MemoryReadError, match="GPU 5: NVML read failed"):
        reader.used_bytes(5)
    for bad in (-1, True, "0"):
        with pytest.raises(MemoryReadError, match="not valid; expected an index >= 0"):
            reader.used_bytes(bad)  # type: ignore[arg-type]


def test_without_nvml_the_reader_asks_nvidia_smi_for_that_gpu() -> None:
    run = fake_smi("1536\n")
    reader = NvmlMemoryReader(nvml=fake_nvml({}, init_error=RuntimeError("driver not loaded")),
                              run=run)
    assert reader.used_bytes(1) == 1536 << 20
    assert run.calls[0][-2:] == ["-i", "1"]
    failing = NvmlMemoryReader(nvml=fake_nvml({}, init_error=RuntimeError("x")),
                               run=fake_smi("", rc=6))
    with pytest.raises(MemoryReadError, match="nvidia-smi exited 6: no such GPU"):
        failing.used_bytes(3)


def test_nvml_v2_is_asked_when_the_module_has_it() -> None:
    """v1's ``used`` includes driver-reserved memory; v2 reports it apart."""
    asked: list[object] = []

    def info(handle: int, version: object = None) -> Any:
        asked.append(version)
        return types.SimpleNamespace(used=(5 << 20) if version == "v2" else (900 << 20))

    nvml = fake_nvml({0: 0})
    nvml.nvmlMemory_v2 = "v2"
    nvml.nvmlDeviceGetMemoryInfo = info
    assert NvmlMemoryReader(nvml=nvml).used_bytes(0) == 5 << 20
    assert asked == ["v2"]


def test_a_hung_nvidia_smi_is_not_asked_again() -> None:
    calls: list[str] = []

    def hung(argv: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        calls.append(argv[-1])
        raise subprocess.TimeoutExpired(argv, 10)

    reader = NvmlMemoryReader(nvml=fake_nvml({}, init_error=RuntimeError("x")), run=hung)
    for gpu in (0, 1):
        with pytest.raises(MemoryReadError, match="GPU 0: nvidia-smi failed"):
            reader.used_bytes(gpu)
    assert calls == ["0"]


@pytest.mark.parametrize("text", ["", "N/A", "12\n13", "1.5"])
def test_nvidia_smi_output_that_is_not_one_integer_is_an_error(text: str) -> None:
    with pytest.raises(MemoryReadError, match="expected one integer"):
        parse_smi_used_mib(text, 0)
    assert parse_smi_used_mib(" 42 \n", 0) == 42 << 20


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_on_a_machine_without_gpus_the_real_reader_says_why_every_time() -> None:
    reader = NvmlMemoryReader()
    for _ in range(2):  # decided once, the same reason again
        with pytest.raises(MemoryReadError, match=r"NVML unavailable .*nvidia-smi not found"):
            reader.used_bytes(0)


def test_readings_are_off_unless_the_variable_is_1() -> None:
    assert memory_reader_from_env({}) is None
    assert memory_reader_from_env({ENV_OBSERVE_GPU_MEMORY: "0"}) is None
    assert isinstance(memory_reader_from_env({ENV_OBSERVE_GPU_MEMORY: "1"}), NvmlMemoryReader)
    env = shared_job_env({}, Path("/tmp/out"), "ns", "addr:1")
    assert env[ENV_OBSERVE_GPU_MEMORY] == "1"  # the GPU-mode gates' jobs read their memory


# ---------------------------------------------------------------------------- record


def test_memory_record_round_trips_and_bad_records_are_refused(tmp_path: Path) -> None:
    rec = MemoryObserved(A, 3, (0, 1), (512 << 20, None), time=5.0, error="GPU 1: gone")
    write_all(tmp_path, [rec])
    assert read_observations(tmp_path).memory == (rec,)
    assert read_observations(tmp_path).pipelines() == [A]
    with pytest.raises(ObservationError, match="2 readings for 1 GPUs"):
        MemoryObserved(A, 0, (0,), (1, 2))
    with pytest.raises(ObservationError, match="needs the error"):
        MemoryObserved(A, 0, (0,), (None,))
    with pytest.raises(ObservationError, match="used_bytes must be integers"):
        MemoryObserved(A, 0, (0,), (-1,))
    with pytest.raises(ObservationError, match="gpus must be a non-empty list"):
        MemoryObserved(A, 0, (), ())
    line = json.dumps({"kind": "memory", "pipeline_id": A, "step": 0, "gpus": [0],
                       "used_bytes": [1.5], "time": 1.0})
    with pytest.raises(ObservationError, match=r"f.jsonl:1: used_bytes\[0\]=1.5 is not valid"):
        parse_line(line, "f.jsonl:1")


# ---------------------------------------------------------------------------- hooks


class ListReader:
    """FAKE GPU memory reader: fixed figures, each read logged into ``calls``."""

    def __init__(self, calls: list[str], used: dict[int, int]) -> None:
        self.calls = calls
        self.used = used

    def used_bytes(self, gpu: int) -> int:
        self.calls.append(f"read {gpu}")
        if gpu == 7:
            raise ZeroDivisionError("a reader's own bug")
        if gpu not in self.used:
            raise MemoryReadError(f"GPU {gpu}: not on this node")
        return self.used[gpu]


def hooks_with(tmp_path: Path, calls: list[str], reader: ListReader,
               observe: bool = True) -> CoordinatorHooks:
    hooks = CoordinatorHooks(
        A, load_settings({"RLIX_CONTROL_PLANE": "rlix"}), scheduler=object(), heartbeat=False,
        observer=ObservationWriter(tmp_path if observe else None, A), memory_reader=reader)

    def fake_call(method: str, *args: Any, **kwargs: Any) -> Any:
        """FAKE scheduler call (no Ray here): grants GPUs 0 and 1, accepts the release."""
        calls.append(method)
        return [0, 1] if method == "request_gpus" else None

    hooks._call = fake_call  # type: ignore[method-assign]
    return hooks


def test_hooks_read_the_training_gpus_after_training_and_before_the_release(
    tmp_path: Path,
) -> None:
    calls: list[str] = []
    hooks = hooks_with(tmp_path, calls, ListReader(calls, {0: 600 << 20}))
    hooks.before_training(4)
    hooks.after_training(4)
    # GPU 1 cannot be read: recorded with the reason, and the release still goes out.
    assert calls == ["request_gpus", "read 0", "read 1", "notify_release_gpus"]
    (rec,) = read_observations(tmp_path).memory
    assert (rec.step, rec.gpus, rec.used_bytes) == (4, (0, 1), (600 << 20, None))
    assert rec.error == "GPU 1: not on this node"


def test_a_reader_that_raises_anything_never_holds_up_the_release(tmp_path: Path) -> None:
    calls: list[str] = []
    hooks = hooks_with(tmp_path, calls, ListReader(calls, {}))
    hooks._training = ((7,), 0.0)  # as before_training leaves it after a grant of GPU 7
    hooks.after_training(0)
    assert calls == ["read 7", "notify_release_gpus"]
    (rec,) = read_observations(tmp_path).memory
    assert rec.used_bytes == (None,) and rec.error == "GPU 7: ZeroDivisionError: a reader's own bug"


@pytest.mark.parametrize("step", [None, 2.0, -1])
def test_a_record_that_cannot_be_built_never_holds_up_the_release(tmp_path: Path,
                                                                    step: Any) -> None:
    """A host passing a step the record refuses (None, a float, a negative) still releases,
    and writes nothing the gate could not read back."""
    calls: list[str] = []
    hooks = hooks_with(tmp_path, calls, ListReader(calls, {0: 1, 1: 1}))
    hooks.before_training(0)
    hooks.after_training(step)
    assert calls[-1] == "notify_release_gpus"
    assert read_observations(tmp_path).memory == ()


def test_hooks_read_nothing_when_no_records_are_written(tmp_path: Path) -> None:
    calls: list[str] = []
    hooks = hooks_with(tmp_path, calls, ListReader(calls, {0: 1, 1: 1}), observe=False)
    hooks.before_training(0)
    hooks.after_training(0)
    assert calls == ["request_gpus", "notify_release_gpus"]


# ---------------------------------------------------------------------------- criterion


def releases(pid: str, n: int) -> list[BusyObserved]:
    return [BusyObserved(pid, "train", (0,), float(s), s + 0.5) for s in range(n)]


def test_memory_criterion_passes_below_the_limit_on_every_release(tmp_path: Path) -> None:
    write_all(tmp_path, [*releases(A, 2), MemoryObserved(A, 0, (0,), (GIB,)),
                         MemoryObserved(A, 1, (0,), (GIB + GIB // 2,))])
    r = memory_from_records(tmp_path, expected_pipelines=1)
    assert r.passed, r.measured
    assert r.measured == ("2 readings in 2 releases of 1 pipeline(s), max 1.50 GiB "
                          f"({A} step 1 GPU 0)")


@pytest.mark.parametrize(
    ("records", "expected"),
    [
        ([*releases(A, 1), MemoryObserved(A, 0, (0,), (2 * GIB,))],
         f"first: {A} step 0 GPU 0: 2.00 GiB"),
        ([*releases(A, 1), MemoryObserved(A, 0, (0,), (None,), error="NVML unavailable")],
         f"first: {A} step 0 GPU 0 not read: NVML unavailable"),
        ([*releases(A, 2), MemoryObserved(A, 0, (0,), (GIB,))],
         f"first: {A}: 1 memory records for 2 releases"),
        ([*releases(A, 1), MemoryObserved(A, 0, (0,), (GIB,)), *releases(B, 1)],
         f"first: {B}: 0 memory records for 1 releases"),
    ],
    ids=["over_limit", "unread", "release_not_measured", "pipeline_not_measured"],
)
def test_memory_criterion_fails_on_any_gap(tmp_path: Path, records: list[Any],
                                           expected: str) -> None:
    write_all(tmp_path, records)
    r = memory_from_records(tmp_path, expected_pipelines=1)
    assert not r.passed and expected in r.measured, r.measured


def test_memory_criterion_without_records_is_not_observed(tmp_path: Path) -> None:
    write_all(tmp_path, releases(A, 1))
    r = memory_from_records(tmp_path)
    assert not r.passed and r.measured.startswith("not observed")
    write_all(tmp_path / "two", [MemoryObserved(A, 0, (0,), (1,))])
    r = memory_from_records(tmp_path / "two", expected_pipelines=2)
    assert not r.passed and "memory records of 1 of 2 pipelines" in r.measured
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / f"{A}.jsonl").write_text('{"kind":"memory"}\n')
    r = memory_from_records(tmp_path / "bad")
    assert not r.passed and r.measured.startswith("unreadable records")
