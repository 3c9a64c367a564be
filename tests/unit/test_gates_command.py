"""The gate command's GPU-mode front end on a machine without GPUs, the gate configs, and the
RLix-types stand-in the gate-3 ROLL pipeline pickles by reference."""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

import pytest

from rlix_plugins.cli import main
from rlix_plugins.gates import gpu_mode
from rlix_plugins.gates.gpu_mode import (
    GpuGateOptions,
    check_prerequisites,
    load_jobs,
    write_job_configs,
)

REPO = Path(__file__).resolve().parents[2]


def test_gpu_mode_refuses_here_with_every_missing_prerequisite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu_mode, "count_cuda_gpus", lambda: (0, "nvidia-smi not found"))
    code = main(["gate", "3", "--out", str(tmp_path), "--nemo-rl-src", str(tmp_path / "none"),
                 "--roll-src", str(tmp_path / "none"), "--rlix-src", str(tmp_path / "none")])
    err = capsys.readouterr().err
    assert code == 2
    assert "needs >= 2 CUDA GPUs, found 0 (nvidia-smi not found)" in err
    assert "NeMo RL not found" in err and "ROLL not found" in err and "RLix not found" in err
    assert "rlix-plugins gate 3 --cpu" in err


def test_gpu_count_probe_does_not_claim_gpus_on_this_box() -> None:
    n, how = gpu_mode.count_cuda_gpus()
    assert n == 0 and how  # this machine has no GPU; the reason is stated


def test_prerequisites_pass_when_present(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_mode, "count_cuda_gpus", lambda: (2, "NVML"))
    (tmp_path / "nemo" / "nemo_rl").mkdir(parents=True)
    rlix = _rlix_checkout(tmp_path / "rlix")
    opts = GpuGateOptions(3, tmp_path, nemo_rl_src=tmp_path / "nemo", rlix_src=rlix)
    # ROLL found as the fork inside the RLix checkout (no --roll-src)
    assert check_prerequisites(opts) == []
    monkeypatch.setattr(gpu_mode, "count_cuda_gpus", lambda: (1, "NVML"))
    assert check_prerequisites(opts) == ["needs >= 2 CUDA GPUs, found 1 (NVML)"]


def _rlix_checkout(root: Path) -> Path:
    """The files of an rlops/rlix checkout the gate looks for (empty stand-ins)."""
    (root / "rlix").mkdir(parents=True)
    (root / "rlix" / "__init__.py").write_text("")
    (root / "examples").mkdir()
    (root / "examples" / "start_multi_pipeline_test.py").write_text("")
    (root / "external" / "ROLL" / "roll").mkdir(parents=True)
    return root


@pytest.mark.parametrize("gate", [1, 2, 3])
def test_gate_configs_parse_into_jobs(gate: int, tmp_path: Path) -> None:
    opts = GpuGateOptions(gate, tmp_path, steps=5, nemo_rl_src=tmp_path, rlix_src=tmp_path)
    shared = load_jobs(opts, exclusive=False)
    exclusive = load_jobs(opts, exclusive=True)
    names = [j.name for j in shared]
    assert names == [j.name for j in exclusive]
    assert len(shared) == {1: 1, 2: 2, 3: 2}[gate]
    for job in shared:
        if job.name.startswith("nemo_rl"):
            assert job.command[1:4] == ("-m", "rlix_plugins.adapters.nemo_rl_launch",
                                        "examples/run_grpo.py")
            assert "grpo.max_num_steps=5" in job.command and job.steps == 5
            assert any(a.startswith("+policy.generation.rlix.infer_gpus=[0, 1]")
                       for a in job.command)
    for job in exclusive:
        if job.name.startswith("nemo_rl"):
            assert not any("rlix" in a for a in job.command[4:]), job.command
    if gate == 3:
        (roll,) = [j for j in shared if j.name == "roll"]
        (roll_x,) = [j for j in exclusive if j.name == "roll"]
        # RLix's launcher in the RLix checkout; ROLL's stock launcher in its ROLL fork
        assert "examples/start_multi_pipeline_test.py" in roll.command and roll.cwd == tmp_path
        assert "examples/start_agentic_pipeline.py" in roll_x.command
        assert roll_x.cwd == tmp_path / "external" / "ROLL" and roll.steps == 5
        assert dict(roll.env)["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path)
    if gate == 2:
        trains = [next(a for a in j.command if "rlix.train_gpus" in a) for j in shared]
        assert trains == ["+policy.generation.rlix.train_gpus=[0]",
                          "+policy.generation.rlix.train_gpus=[1]"]


def test_rlix_types_stand_in_pickles_by_reference_and_stays_out_of_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlix_plugins.gates.roll_sequence import provide_rlix_types
    from rlix_plugins.protocol.types import coerce_progress_report

    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in [m for m in sys.modules if m == "rlix" or m.startswith("rlix.")]:
        monkeypatch.delitem(sys.modules, name)
    mod = provide_rlix_types(tmp_path)
    try:
        rep = mod.ProgressReport("ft_0123456789ab", 40, 1.0, {"completed": 10})
        assert type(rep).__module__ == "rlix.protocol.types"
        assert b"rlix.protocol.types" in pickle.dumps(rep)
        ours = coerce_progress_report(rep)
        assert ours.step_target_trajectories == 40 and ours.completed == 10
        assert int(mod.Priority.GENERATION) == 6
        assert mod.__file__.startswith(str(tmp_path))
        assert not (REPO / "rlix").exists()
    finally:
        for name in [m for m in sys.modules if m == "rlix" or m.startswith("rlix.")]:
            del sys.modules[name]


def test_gate3_roll_configs_are_written_with_the_layout_and_steps(tmp_path: Path) -> None:
    """The files the gate writes into the RLix checkout: RLix's example config composed with
    gate 3's layout (what Hydra then loads; composition itself checked by hand, see docs)."""
    import yaml

    opts = GpuGateOptions(3, tmp_path, steps=4, rlix_src=tmp_path)
    for exclusive, name, train, infer in [(False, "rlix_plugins_gate3", "[1, ]", "[0, 1, ]"),
                                          (True, "rlix_plugins_gate3_exclusive", "[0, ]",
                                           "[1, ]")]:
        (roll,) = [j for j in load_jobs(opts, exclusive=exclusive) if j.name == "roll"]
        (written,) = write_job_configs(roll)
        assert written == tmp_path / "examples" / "rlix_test" / f"{name}.yaml"
        assert roll.command[roll.command.index("--config_name") + 1] == name
        cfg = yaml.safe_load(written.read_text())
        assert cfg["defaults"] == ["full_finetune_pipeline1", "_self_"]
        assert cfg["max_steps"] == 4 and cfg["num_gpus_per_node"] == 2
        assert cfg["actor_train"]["device_mapping"] == train
        assert cfg["reference"]["device_mapping"] == train
        assert cfg["actor_infer"]["device_mapping"] == infer
        assert ("pipeline_cls" in cfg) is exclusive  # stock ROLL pipeline for the baseline


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("", "must be a mapping"),
        ("nemo_rl: []\n", "'nemo_rl' must be a non-empty list"),
        ("something: 1\n", "needs 'nemo_rl' (a list of jobs) or a top-level 'overrides'"),
        ("nemo_rl:\n  - overrides: {}\n", "'name' must be a non-empty string"),
        ("nemo_rl:\n  - name: a\n    overrides: [x]\n", "'overrides' must be a mapping"),
        ("nemo_rl:\n  - name: a\n  - name: a\n", "job names ['a'] repeat"),
        ("nemo_rl:\n  - name: a\n    override: {}\n", "unknown keys ['override']"),
        ("nemo_rl:\n  - name: a\n", "gate 3 needs a 'roll' job"),
        ("nemo_rl:\n  - name: a\nroll:\n  command: python\n", "roll.command must be"),
        ("nemo_rl:\n  - name: a\nroll:\n  command: [python]\n  configs: [{src: x}]\n",
         "roll.configs must be"),
        ("nemo_rl: [\n", "cannot be read"),
    ],
)
def test_a_malformed_gate_config_is_a_prerequisite_problem(
    text: str, needle: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found before Ray, the coordinator or any job starts (it used to be a KeyError or
    AttributeError traceback after --out was created and Ray started)."""
    monkeypatch.setattr(gpu_mode, "count_cuda_gpus", lambda: (2, "NVML"))
    (tmp_path / "nemo" / "nemo_rl").mkdir(parents=True)
    cfg = tmp_path / "gate.yaml"
    cfg.write_text(text)
    opts = GpuGateOptions(3, tmp_path / "out", config=cfg, nemo_rl_src=tmp_path / "nemo",
                          rlix_src=_rlix_checkout(tmp_path / "rlix"))
    problems = check_prerequisites(opts)
    assert any(needle in p for p in problems), problems
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("gate", [1, 2, 3])
def test_the_shipped_gate_configs_have_no_problems(gate: int) -> None:
    assert gpu_mode.config_problems(gpu_mode.default_config(gate), gate) == []


def test_a_hung_job_is_killed_at_the_time_limit(tmp_path: Path) -> None:
    quick = gpu_mode.JobSpec("quick", (sys.executable, "-c", "pass"), tmp_path)
    hung = gpu_mode.JobSpec("hung", (sys.executable, "-c", "import time; time.sleep(60)"),
                            tmp_path)
    codes = gpu_mode.run_jobs([quick, hung], {"PATH": os.environ["PATH"]}, tmp_path,
                              concurrent=True, timeout_s=2.0)
    assert codes == {"quick": 0, "hung": gpu_mode.TIMED_OUT}
