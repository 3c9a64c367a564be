"""The host-memory probe finds the memory limit on this process's own cgroup path.

The cgroup trees here are FAKE directories in ``tmp_path`` laid out as the kernel's cgroupfs
(this machine cannot create cgroups); /proc/self/cgroup is a FAKE file with the kernel's
format. The real probe on this machine is checked in test_training_cache.py.
"""

from __future__ import annotations

from pathlib import Path

from rlix_plugins.training.host_memory import available_host_memory

GiB = 1 << 30


def _cgroup(directory: Path, *, limit: str, current: int, v1: bool = False) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    if v1:
        (directory / "memory.limit_in_bytes").write_text(f"{limit}\n")
        (directory / "memory.usage_in_bytes").write_text(f"{current}\n")
    else:
        (directory / "memory.max").write_text(f"{limit}\n")
        (directory / "memory.current").write_text(f"{current}\n")


def _probe(tmp_path: Path, proc_cgroup: str) -> tuple[int, str]:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {64 * GiB // 1024} kB\nMemAvailable: {60 * GiB // 1024} kB\n")
    (tmp_path / "self_cgroup").write_text(proc_cgroup)
    mem = available_host_memory(meminfo, tmp_path / "cg", tmp_path / "self_cgroup")
    return mem.available_bytes, mem.source


def test_a_slurm_step_limit_on_a_sub_cgroup_is_found(tmp_path: Path) -> None:
    """No cgroup namespace: the root's memory.max is "max", the job's limit is below it. The
    probe used to read the root only and report the host's 60 GiB."""
    root = tmp_path / "cg"
    _cgroup(root, limit="max", current=30 * GiB)
    _cgroup(root / "slurm" / "job_7" / "step_0", limit=str(8 * GiB), current=3 * GiB)
    got, source = _probe(tmp_path, "0::/slurm/job_7/step_0\n")
    assert (got, source) == (5 * GiB, "cgroup memory limit - usage")


def test_an_ancestor_limit_tighter_than_the_own_one_wins(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _cgroup(root / "job", limit=str(4 * GiB), current=3 * GiB)
    _cgroup(root / "job" / "step", limit=str(16 * GiB), current=1 * GiB)
    assert _probe(tmp_path, "0::/job/step\n")[0] == 1 * GiB


def test_a_namespaced_container_reads_its_root(tmp_path: Path) -> None:
    _cgroup(tmp_path / "cg", limit=str(10 * GiB), current=4 * GiB)
    assert _probe(tmp_path, "0::/\n")[0] == 6 * GiB


def test_cgroup_v1_memory_controller_limit_is_found(tmp_path: Path) -> None:
    mem = tmp_path / "cg" / "memory"
    _cgroup(mem, limit="9223372036854771712", current=20 * GiB, v1=True)  # v1's "no limit"
    _cgroup(mem / "batch" / "job_3", limit=str(12 * GiB), current=2 * GiB, v1=True)
    got, _ = _probe(tmp_path, "5:cpu,cpuacct:/batch/job_3\n4:memory:/batch/job_3\n0::/\n")
    assert got == 10 * GiB


def test_no_limit_anywhere_leaves_memavailable(tmp_path: Path) -> None:
    _cgroup(tmp_path / "cg", limit="max", current=GiB)
    _cgroup(tmp_path / "cg" / "user.slice", limit="max", current=GiB)
    assert _probe(tmp_path, "0::/user.slice\n") == (60 * GiB, "MemAvailable")


def test_an_unreadable_proc_cgroup_falls_back_to_the_root(tmp_path: Path) -> None:
    _cgroup(tmp_path / "cg", limit=str(2 * GiB), current=GiB)
    mem = available_host_memory(tmp_path / "no_meminfo", tmp_path / "cg", tmp_path / "missing")
    assert mem.available_bytes == GiB
