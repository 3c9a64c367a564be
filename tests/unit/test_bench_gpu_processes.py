"""The GPU benchmarks' process runner (benchmarks/gpu/processes.py), on this CPU box: what a
child reports comes back with its exit code, and a child that reports nothing is recorded as
failed instead of hanging the benchmark (device time is scarce)."""

from __future__ import annotations

from typing import Any

from benchmarks.gpu.processes import free_port, run_in_process


def _reports(value: int, queue: Any) -> None:
    queue.put({"value": value * 2})


def _silent(queue: Any) -> None:
    return None


def test_a_child_report_comes_back_with_its_exit_code() -> None:
    assert run_in_process(_reports, (21,), timeout_s=120) == {"value": 42, "exitcode": 0}


def test_a_silent_child_is_recorded_as_failed() -> None:
    out = run_in_process(_silent, (), timeout_s=5)
    assert out["status"].startswith("failed: Empty")
    assert out["exitcode"] == 0


def test_free_port_is_bindable() -> None:
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
