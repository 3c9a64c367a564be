"""Gates 1-3 on a real 2-GPU box with NeMo RL (and ROLL for gate 3). UNVERIFIED: written
without a GPU; only the prerequisite check has run (it fails here, as it should).

Flow: check prerequisites -> start the coordinator (namespace ``rlix_gate{N}_*``; ``rlix`` for
gate 3, whose ROLL launcher looks the control plane up there; trace into ``--out``) -> launch
the gate's jobs with ``RLIX_CONTROL_PLANE=rlix``, ``RLIX_OBSERVE_DIR={--out}/observe`` and
``RAY_ADDRESS`` of this Ray (NeMo RL through ``python -m rlix_plugins.adapters.nemo_rl_launch``,
ROLL through RLix's own launcher, see ``gates/gate3.yaml``) while polling ``get_status`` and
sampling GPU utilisation with ``nvidia-smi`` -> stop the coordinator -> run the same jobs again
with the control plane off, one after another on their stock disjoint layouts (the
exclusive-allocation baseline) -> evaluate the criteria from the coordinator's trace and
status, the jobs' exit codes, the utilisation samples and the jobs' observation records (a
shared-run job's steps are the ones its records or wire log show, never its exit code alone).

The weights and requests criteria are judged from the records the NeMo RL jobs' shard
controller and routers write (:mod:`rlix_plugins.gates.observed`), gate 1's memory criterion
from the hooks' GPU memory readings before each training release; without records they FAIL
with "not observed", never pass silently.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlix_plugins.adapters.gpu_memory import ENV_OBSERVE_GPU_MEMORY
from rlix_plugins.adapters.observability import ENV_OBSERVE_DIR, ObservationError
from rlix_plugins.coordinator.service.wire_log import PipelineWire
from rlix_plugins.errors import RlixPluginsError
from rlix_plugins.gates.criteria import (
    CriterionResult,
    GateResult,
    IdleShare,
    RunCount,
    idle_below_exclusive,
    no_double_ownership,
    roll_generation_requests,
    roll_protocol,
    steps_completed,
    time_sharing,
)
from rlix_plugins.gates.observed import (
    memory_from_records,
    observed_criteria,
    overlap_from_records,
    ownership_from_records,
    train_steps_from_records,
)
from rlix_plugins.gates.outputs import clear_outputs, write_text_atomic
from rlix_plugins.gates.timeline import Interval, intervals_from_trace
from rlix_plugins.values import is_int

logger = logging.getLogger(__name__)

GATES_DIR = Path(__file__).resolve().parents[2] / "gates"
#: RLix's launcher and ROLL find the control plane in this namespace (hard-coded there).
RLIX_NAMESPACE = "rlix"
#: Subdirectory of ``--out`` the jobs write their observation records to.
OBSERVE_SUBDIR = "observe"


class PrerequisiteError(RlixPluginsError):
    """The machine cannot run the GPU gate; the message lists every missing piece."""


@dataclass(frozen=True, slots=True)
class GpuGateOptions:
    gate: int
    out_dir: Path
    steps: int | None = None
    config: Path | None = None
    nemo_rl_src: Path | None = None
    roll_src: Path | None = None
    #: rlops/rlix checkout (gate 3: RLix's launcher for the ROLL pipeline)
    rlix_src: Path | None = None
    #: a job (of the shared run, or one of the baseline's) still running after this long is
    #: killed and counted as failed (exit 124)
    job_timeout_s: float | None = 6 * 3600.0

    def roll_dir(self) -> Path | None:
        """The ROLL checkout: ``roll_src``, else the fork inside the RLix checkout."""
        if self.roll_src is not None:
            return self.roll_src
        return None if self.rlix_src is None else self.rlix_src / "external" / "ROLL"


def default_config(gate: int) -> Path:
    return GATES_DIR / ("nemo_rl_gate1.yaml" if gate == 1 else f"gate{gate}.yaml")


def count_cuda_gpus() -> tuple[int, str]:
    """CUDA GPUs visible to NVML (``nvidia-ml-py``) or ``nvidia-smi -L``; (0, why) if none."""
    try:
        import pynvml  # type: ignore[import-not-found,unused-ignore]

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount()), "NVML"
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # not installed, or no driver
        nvml_error = f"NVML unavailable ({type(exc).__name__}: {exc})"
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0, f"{nvml_error}; nvidia-smi not found on PATH"
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30,
                             check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 0, f"{nvml_error}; nvidia-smi failed: {exc}"
    gpus = [ln for ln in out.stdout.splitlines() if ln.startswith("GPU ")]
    return len(gpus), "nvidia-smi" if gpus else f"nvidia-smi listed no GPU ({out.stderr.strip()})"


def _importable_or_src(module: str, src: Path | None) -> bool:
    if src is not None:
        return (src / module).is_dir()
    return importlib.util.find_spec(module) is not None


def check_prerequisites(opts: GpuGateOptions) -> list[str]:
    """Every missing prerequisite, as a sentence naming what to do (empty = ready)."""
    problems: list[str] = []
    n, how = count_cuda_gpus()
    if n < 2:
        problems.append(f"needs >= 2 CUDA GPUs, found {n} ({how})")
    if not _importable_or_src("nemo_rl", opts.nemo_rl_src):
        where = f"--nemo-rl-src {opts.nemo_rl_src}" if opts.nemo_rl_src else "import nemo_rl"
        problems.append(f"NeMo RL not found ({where}); check out NVIDIA-NeMo/RL at 7ea279abf "
                        "and pass --nemo-rl-src or set NEMO_RL_SRC")
    if opts.gate == 3:
        rlix = opts.rlix_src
        if rlix is None or not (rlix / "rlix" / "__init__.py").is_file() or not (
                rlix / "examples" / "start_multi_pipeline_test.py").is_file():
            problems.append(f"RLix not found (--rlix-src / RLIX_SRC: {rlix}); gate 3 launches "
                            "the ROLL pipeline with RLix's own launcher: check out rlops/rlix "
                            "with its external/ROLL submodule")
        if not _importable_or_src("roll", opts.roll_dir()):
            problems.append(f"ROLL not found (import roll / --roll-src / ROLL_SRC / "
                            f"RLIX_SRC/external/ROLL: {opts.roll_dir()}); gate 3 runs a real "
                            "ROLL pipeline next to NeMo RL (pip install external/ROLL)")
    cfg = opts.config or default_config(opts.gate)
    if not cfg.is_file():
        problems.append(f"gate config {cfg} not found")
    else:
        problems.extend(config_problems(cfg, opts.gate))
    return problems


def _is_str_list(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)


#: the override that sets a NeMo RL job's step count (the gate's ``steps`` per job)
STEPS_KEY = "grpo.max_num_steps"


def _override_problems(at: str, key: str, overrides: Mapping[str, Any]) -> list[str]:
    """Values that cannot become a ``key=value`` Hydra override of a NeMo RL job."""
    problems: list[str] = []
    for k, v in overrides.items():
        if isinstance(v, dict):
            problems.append(f"{at}: '{key}' value of {k!r} is a mapping; write each nested "
                            f"setting as its own dotted key ({k}.<name>: value); valid values "
                            "are scalars and lists")
    steps = overrides.get(STEPS_KEY)
    if STEPS_KEY in overrides and (not is_int(steps) or steps < 1):
        problems.append(f"{at}: '{key}' value of {STEPS_KEY!r} must be an integer >= 1 (the "
                        f"job's step count), got {steps!r}")
    return problems


def config_problems(path: Path, gate: int) -> list[str]:
    """What is wrong with a gate config's structure (empty = usable), checked before anything
    is started: ``nemo_rl`` (a list of ``{name, base_config?, overrides?,
    exclusive_overrides?}`` with distinct names) or gate 1's single top-level ``overrides``;
    gate 3 also needs ``roll`` (``{command, cwd?, exclusive_command?, exclusive_cwd?, steps?,
    configs?: [{src, dest, mode?}]}``)."""
    import yaml  # type: ignore[import-untyped,unused-ignore]

    where = f"gate config {path}"
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        return [f"{where} cannot be read: {exc}"]
    if not isinstance(raw, dict):
        return [f"{where} must be a mapping with 'nemo_rl' (or gate 1's 'overrides'), got "
                f"{type(raw).__name__}"]
    problems: list[str] = []
    entries = raw.get("nemo_rl")
    if entries is None:
        if not isinstance(raw.get("overrides"), dict):
            problems.append(f"{where} needs 'nemo_rl' (a list of jobs) or a top-level "
                            "'overrides' mapping (one NeMo RL job)")
        else:
            problems.extend(_override_problems(where, "overrides", raw["overrides"]))
    elif not isinstance(entries, list) or not entries:
        problems.append(f"{where}: 'nemo_rl' must be a non-empty list of jobs")
    else:
        names: list[str] = []
        for i, e in enumerate(entries):
            at = f"{where}: nemo_rl[{i}]"
            if not isinstance(e, dict):
                problems.append(f"{at} must be a mapping")
                continue
            unknown = sorted(set(e) - {"name", "base_config", "overrides",
                                       "exclusive_overrides"})
            if unknown:
                problems.append(f"{at} has unknown keys {unknown}; valid: name, base_config, "
                                "overrides, exclusive_overrides")
            name = e.get("name")
            if not isinstance(name, str) or not name or name == "roll":
                problems.append(f"{at}: 'name' must be a non-empty string other than 'roll' "
                                f"(it names the job's log), got {name!r}")
            else:
                names.append(name)
            for key in ("overrides", "exclusive_overrides"):
                if key in e and not isinstance(e[key], dict):
                    problems.append(f"{at}: '{key}' must be a mapping of NeMo RL overrides")
                elif key in e:
                    problems.extend(_override_problems(at, key, e[key]))
            if "base_config" in e and not isinstance(e["base_config"], str):
                problems.append(f"{at}: 'base_config' must be a path string")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            problems.append(f"{where}: job names {dup} repeat (each names its own log and "
                            "exit code)")
    roll = raw.get("roll")
    if gate == 3 and roll is None:
        problems.append(f"{where}: gate 3 needs a 'roll' job (RLix's launcher command)")
    if roll is not None:
        if not isinstance(roll, dict):
            problems.append(f"{where}: 'roll' must be a mapping")
        else:
            if not _is_str_list(roll.get("command")):
                problems.append(f"{where}: roll.command must be a non-empty list of strings")
            if "exclusive_command" in roll and not _is_str_list(roll["exclusive_command"]):
                problems.append(f"{where}: roll.exclusive_command must be a non-empty list of "
                                "strings")
            steps = roll.get("steps", 0)
            if not is_int(steps) or steps < 0:
                problems.append(f"{where}: roll.steps must be an integer >= 0, got {steps!r}")
            configs = roll.get("configs", [])
            if not isinstance(configs, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("src"), str)
                    and isinstance(c.get("dest"), str)
                    and c.get("mode", "shared") in ("shared", "exclusive") for c in configs):
                problems.append(f"{where}: roll.configs must be a list of {{src, dest, mode}} "
                                "with mode 'shared' or 'exclusive'")
            else:
                missing = [c["src"] for c in configs if not (GATES_DIR / c["src"]).is_file()]
                if missing:
                    problems.append(f"{where}: roll.configs templates {missing} not found in "
                                    f"{GATES_DIR} (src is relative to it); there: "
                                    f"{sorted(f.name for f in GATES_DIR.glob('*.yaml'))}")
    return problems


# ---------------------------------------------------------------------------- jobs


@dataclass(frozen=True, slots=True)
class JobSpec:
    """One job of the gate: a name, a command, a working directory and extra env."""

    name: str
    command: tuple[str, ...]
    cwd: Path
    env: tuple[tuple[str, str], ...] = ()
    steps: int = 0
    #: (template under gates/, destination) config files written before the launch, with
    #: ``max_steps`` set to ``steps``
    configs: tuple[tuple[Path, Path], ...] = ()


def _overrides(d: dict[str, Any]) -> list[str]:
    """``key=value`` Hydra overrides: lists as JSON, booleans ``true``/``false``, YAML's null
    as ``null`` (``str(None)`` would be the string "None"), anything else as ``str``."""
    out = []
    for k, v in d.items():
        if isinstance(v, list) or v is None:
            val = json.dumps(v)
        elif isinstance(v, bool):
            val = str(v).lower()
        else:
            val = str(v)
        out.append(f"{k}={val}")
    return out


def load_jobs(opts: GpuGateOptions, *, exclusive: bool) -> list[JobSpec]:
    """The gate config's jobs. A config has ``nemo_rl`` (list of ``{name, base_config,
    overrides, exclusive_overrides}``) and optionally ``roll`` (``{steps, command, cwd,
    exclusive_command, exclusive_cwd, configs: [{src, dest, mode}]}``, paths relative to the
    RLix checkout, ``src`` relative to ``gates/``); gate 1's ``nemo_rl_gate1.yaml`` (one
    top-level ``overrides``) is read as one NeMo RL job."""
    import yaml  # type: ignore[import-untyped,unused-ignore]

    path = opts.config or default_config(opts.gate)
    raw = yaml.safe_load(path.read_text())
    nemo_entries = raw.get("nemo_rl") or [{"name": "nemo_rl", "overrides": raw["overrides"]}]
    src = opts.nemo_rl_src or Path.cwd()
    jobs: list[JobSpec] = []
    for entry in nemo_entries:
        ov = dict(entry.get("overrides", {}))
        if exclusive:
            # Stock layout, control plane off: drop our keys, apply the baseline's overrides.
            ov = {k: v for k, v in ov.items() if "rlix" not in k}
            ov.update(entry.get("exclusive_overrides", {}))
        if opts.steps is not None:
            ov["grpo.max_num_steps"] = opts.steps
        base = entry.get("base_config", "examples/configs/grpo_math_1B_megatron.yaml")
        cmd = (sys.executable, "-m", "rlix_plugins.adapters.nemo_rl_launch",
               "examples/run_grpo.py", "--config", base, *_overrides(ov))
        jobs.append(JobSpec(str(entry["name"]), cmd, src,
                            steps=int(ov.get("grpo.max_num_steps", 0))))
    roll = raw.get("roll")
    if opts.gate == 3 and roll:
        jobs.append(_roll_job(roll, opts, exclusive=exclusive))
    return jobs


def _roll_job(roll: dict[str, Any], opts: GpuGateOptions, *, exclusive: bool) -> JobSpec:
    rlix = opts.rlix_src or Path.cwd()
    mode = "exclusive" if exclusive else "shared"
    pre = "exclusive_" if exclusive else ""
    cmd = tuple(str(c) for c in (roll.get(f"{pre}command") or roll["command"]))
    cwd = rlix / str(roll.get(f"{pre}cwd") or roll.get("cwd") or ".")
    steps = opts.steps if opts.steps is not None else int(roll.get("steps", 0))
    configs = tuple((GATES_DIR / str(c["src"]), rlix / str(c["dest"]))
                    for c in roll.get("configs", []) if str(c.get("mode", "shared")) == mode)
    # RLix's launcher imports the rlix package from its checkout.
    path = os.pathsep.join(p for p in (str(rlix), os.environ.get("PYTHONPATH")) if p)
    return JobSpec("roll", cmd, cwd, (("PYTHONPATH", path),), steps=steps, configs=configs)


def write_job_configs(job: JobSpec) -> list[Path]:
    """Write the job's config files (templates from ``gates/``) with ``max_steps`` set."""
    import yaml  # type: ignore[import-untyped,unused-ignore]

    written = []
    for src, dest in job.configs:
        cfg = yaml.safe_load(src.read_text())
        if job.steps:
            cfg["max_steps"] = job.steps
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(f"# written by rlix-plugins gate from {src.name}; do not edit\n"
                        + yaml.safe_dump(cfg, sort_keys=False))
        written.append(dest)
    return written


@dataclass(slots=True)
class UtilSampler:
    """``nvidia-smi`` utilisation samples per GPU (busy = utilisation > 0 in a sample)."""

    interval_ms: int = 200
    samples: list[tuple[float, int, int]] = field(default_factory=list)
    _proc: subprocess.Popen[str] | None = None
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits",
             f"-lms={self.interval_ms}"], stdout=subprocess.PIPE, text=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
                self.samples.append((time.time(), int(parts[0]), int(parts[1])))

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate ``nvidia-smi``; killed if it has not exited ``timeout_s`` later (a wedged
        driver can make it ignore SIGTERM)."""
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("nvidia-smi ignored SIGTERM for %.0fs: killed", timeout_s)
                self._proc.kill()
                self._proc.wait()

    def idle(self, start: float, end: float, num_gpus: int) -> IdleShare:
        s = [x for x in self.samples if start <= x[0] <= end and x[1] < num_gpus]
        busy = sum(1 for x in s if x[2] > 0) / len(s) if s else 0.0
        return IdleShare(busy, end - start, num_gpus)


#: exit code recorded for a job killed at the gate's time limit (as ``timeout(1)`` reports)
TIMED_OUT = 124


def run_jobs(jobs: Sequence[JobSpec], env: dict[str, str], out: Path, *,
             concurrent: bool, timeout_s: float | None = None) -> dict[str, int]:
    """Launch ``jobs`` (their configs written first), each logging to ``out/{name}.log``
    (``_exclusive.log`` without the control plane); returns exit codes by job name. A job
    still running ``timeout_s`` after the launch (of all of them, when concurrent) is killed
    and recorded as :data:`TIMED_OUT`; every job still running when this returns or raises
    is killed, so none outlives the gate."""
    codes: dict[str, int] = {}
    running: list[subprocess.Popen[bytes]] = []

    def launch(job: JobSpec) -> subprocess.Popen[bytes]:
        write_job_configs(job)
        log = (out / f"{job.name}{'' if env.get('RLIX_CONTROL_PLANE') else '_exclusive'}.log")
        with log.open("wb") as fh:  # the child keeps its own copy of the descriptor
            proc = subprocess.Popen(list(job.command), cwd=job.cwd,
                                    env={**env, **dict(job.env)}, stdout=fh,
                                    stderr=subprocess.STDOUT)
        running.append(proc)
        return proc

    def wait(job: JobSpec, proc: subprocess.Popen[bytes], deadline: float | None) -> None:
        try:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            codes[job.name] = proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            logger.error("%s still running after %ss: killed", job.name, timeout_s)
            proc.kill()
            proc.wait()
            codes[job.name] = TIMED_OUT

    try:
        if concurrent:
            end = None if timeout_s is None else time.monotonic() + timeout_s
            procs = [(j, launch(j)) for j in jobs]
            for j, p in procs:
                wait(j, p, end)
        else:
            for j in jobs:
                wait(j, launch(j), None if timeout_s is None else time.monotonic() + timeout_s)
    finally:
        for proc in running:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return codes


def _log_figures(out: Path, name: str) -> dict[str, int]:
    """Counts of log lines kept in the report as supporting evidence (not a criterion)."""
    path = out / f"{name}.log"
    text = path.read_text(errors="replace") if path.exists() else ""
    return {
        "weight_applied": len(re.findall(r"weight version \d+ applied", text)),
        "preempted": len(re.findall(r"preempted shards", text)),
        "abort_samples": len(re.findall(r"finish_reason.{0,5}abort", text)),
    }


def shared_run_counts(jobs: Sequence[JobSpec], codes: Mapping[str, int], observe: Path,
                      wire: Mapping[str, PipelineWire]) -> list[RunCount]:
    """The shared run's steps per job from what the jobs left behind, not from their exit
    codes (a job that exits 0 having trained nothing, e.g. on a wrong config, must fail): a
    NeMo RL job's are the train steps its pipeline recorded in ``observe``, the ROLL job's
    the GENERATION requests its pipeline sent (the coordinator's wire log, one per step).

    The records name pipelines by the ids the coordinator allocated, not by job: the
    pipelines with the most steps stand for the jobs with the largest targets (so every job
    is counted as reaching its target exactly when some assignment of pipelines to jobs
    does). More steps than the target count as the target; a target of 0 (the config's own
    count) needs >= 1 step; a non-zero exit is an error whatever was recorded."""
    unreadable: str | None = None
    try:
        recorded = sorted(train_steps_from_records(observe).values(), reverse=True)
    except ObservationError as exc:
        recorded, unreadable = [], f"unreadable records: {exc}"
    nemo = sorted((j for j in jobs if j.name != "roll"), key=lambda j: j.steps, reverse=True)
    done = {j.name: recorded[i] if i < len(recorded) else 0 for i, j in enumerate(nemo)}
    done["roll"] = roll_generation_requests(wire)
    runs: list[RunCount] = []
    for j in jobs:
        n = done[j.name]
        target = j.steps if j.steps > 0 else max(n, 1)
        error = (f"exit {codes[j.name]}" if codes[j.name] != 0
                 else unreadable if j.name != "roll" else None)
        runs.append(RunCount(f"shared/{j.name}", min(n, target), target, error))
    return runs


def shared_job_env(base: Mapping[str, str], out: Path, namespace: str,
                   ray_address: str) -> dict[str, str]:
    """Environment of the shared run's jobs: control plane on, its namespace, trace and
    observation directories under ``out`` (GPU memory readings on), and this Ray's address
    (jobs join it, and so the gate's coordinator, instead of starting their own)."""
    return {**base, "RLIX_CONTROL_PLANE": "rlix", "RLIX_NAMESPACE": namespace,
            "RLIX_TRACE_DIR": str(out), ENV_OBSERVE_DIR: str(out / OBSERVE_SUBDIR),
            ENV_OBSERVE_GPU_MEMORY: "1", "RAY_ADDRESS": ray_address}


def _namespace_free(ray: Any, namespace: str) -> bool:
    from rlix_plugins.protocol.names import ORCHESTRATOR_ACTOR

    try:
        ray.get_actor(ORCHESTRATOR_ACTOR, namespace=namespace)
    except ValueError:
        return True
    return False


def run_gpu_gate(opts: GpuGateOptions) -> GateResult:
    """Run a gate on a GPU box (see module docstring). Raises PrerequisiteError here."""
    problems = check_prerequisites(opts)
    if shutil.which("nvidia-smi") is None:
        # NVML may count the GPUs without it, but the utilisation sampler runs it.
        problems.append("nvidia-smi not found on PATH (the idle-share criterion samples GPU "
                        "utilisation with it)")
    if problems:
        raise PrerequisiteError("\n".join(f"  - {p}" for p in problems))
    import ray

    from rlix_plugins.coordinator.service.client import connect, stop_coordinator
    from rlix_plugins.coordinator.service.config import ServiceConfig

    out = opts.out_dir
    jobs = load_jobs(opts, exclusive=False)
    has_roll = any(j.name == "roll" for j in jobs)
    ns = RLIX_NAMESPACE if has_roll else f"rlix_gate{opts.gate}_{uuid.uuid4().hex[:6]}"
    if not ray.is_initialized():
        # RAY_ADDRESS: join that cluster; unset: a local Ray with every GPU it detects.
        ray.init(address=os.environ.get("RAY_ADDRESS"), namespace=ns)
    if has_roll and not _namespace_free(ray, ns):
        raise PrerequisiteError(f"  - a control plane already runs in namespace {ns!r}; stop "
                                "it (rlix-plugins coordinator stop) so the gate's own serves "
                                "RLix's launcher")
    # Made once every prerequisite is known to be met (a refusal leaves no --out behind).
    out.mkdir(parents=True, exist_ok=True)
    # An earlier run's report must not stand for this run should it crash before writing its own.
    clear_outputs(out, opts.gate)
    observe = out / OBSERVE_SUBDIR
    if observe.exists():
        shutil.rmtree(observe)  # records of an earlier run would be judged as this one's
    env = shared_job_env(os.environ, out, ns, ray.get_runtime_context().gcs_address)
    sampler = UtilSampler()
    plane = connect(namespace=ns, config=ServiceConfig(namespace=ns, trace_dir=str(out)))
    coordinator_up = True
    try:
        sampler.start()
        t0 = time.time()
        codes = run_jobs(jobs, env, out, concurrent=True, timeout_s=opts.job_timeout_s)
        t1 = time.time()
        trace = ray.get(plane.scheduler.get_trace.remote(), timeout=60)
        # What every job said over the protocol (gate 3 judges RLix's ROLL pipeline by it).
        wire = ray.get(plane.scheduler.get_wire_log.remote(), timeout=60)
        ray.get(plane.scheduler.flush_trace.remote(), timeout=60)
        intervals, _ = intervals_from_trace(trace)
        # Stopped before the baseline: nothing may find a control plane there.
        stop_coordinator(ns)
        coordinator_up = False
        base_env = {k: v for k, v in os.environ.items() if not k.startswith("RLIX_")}
        base_env["RAY_ADDRESS"] = env["RAY_ADDRESS"]
        excl_jobs = load_jobs(opts, exclusive=True)
        t2 = time.time()
        excl_codes = run_jobs(excl_jobs, base_env, out, concurrent=False,
                              timeout_s=opts.job_timeout_s)
        t3 = time.time()
    finally:
        # A job that raised or hung must not leave the sampler or the coordinator behind.
        try:
            sampler.stop()
        finally:
            if coordinator_up:
                stop_coordinator(ns)
    criteria: list[CriterionResult] = [
        # What the coordinator decided (its trace holds one owner per GPU at a time, so this
        # only catches a trace that contradicts itself); engine-side evidence of who computed
        # where is what only a GPU run can show (docs/gates.md).
        no_double_ownership("ownership_coordinator", intervals,
                            source="the coordinator's GPU trace"),
        # The shared run by its records and wire log; the baseline runs with the control
        # plane off (no hooks, no records, no coordinator), so its exit codes are all there is
        # (a baseline that did nothing also leaves the idle-share criterion no busy evidence).
        steps_completed(
            shared_run_counts(jobs, codes, observe, wire)
            + [RunCount(f"exclusive/{j.name}", j.steps if excl_codes[j.name] == 0 else 0,
                        j.steps, None if excl_codes[j.name] == 0 else f"exit {excl_codes[j.name]}")
               for j in excl_jobs]),
    ]
    if opts.gate in (2, 3):
        criteria.append(time_sharing(intervals, opts.gate))
    if has_roll:
        # RLix's own pipeline coordinator and pipeline sent these (its classes or the stand-in
        # the coordinator unpickles them as); the NeMo RL jobs send ours.
        criteria.append(roll_protocol(
            wire, steps=max((j.steps for j in jobs if j.name == "roll"), default=1)))
    figs = {j.name: _log_figures(out, j.name) for j in jobs}
    # Only the NeMo RL jobs run our shard controller and router (ROLL uses its own).
    nemo_jobs = sum(1 for j in jobs if j.name != "roll")
    criteria.extend(observed_criteria([("shared", observe)], expected_pipelines=nemo_jobs))
    criteria.append(ownership_from_records(observe, expected_pipelines=nemo_jobs))
    if opts.gate == 1:
        # The overlap shard's preempt/wake cycle and the NCCL destroy/re-init of every step,
        # from the job's own records (the rehearsal judges its records with the same code).
        criteria.append(overlap_from_records(
            observe, steps=min((j.steps for j in jobs if j.name != "roll"), default=None),
            expected_pipelines=nemo_jobs))
        # gates/nemo_rl_gate1.yaml: < 2 GiB on the training GPU after sleep(2) + NCCL destroy.
        criteria.append(memory_from_records(observe, expected_pipelines=nemo_jobs))
    criteria.append(idle_below_exclusive(sampler.idle(t0, t1, 2), sampler.idle(t2, t3, 2)))
    result = GateResult(opts.gate, "gpu", tuple(criteria))
    write_text_atomic(out / f"gate{opts.gate}_report.json", json.dumps({
        "gate": opts.gate, "mode": "gpu", "passed": result.passed,
        "criteria": [dataclasses.asdict(c) for c in result.criteria],
        "exit_codes": {"shared": codes, "exclusive": excl_codes}, "log_figures": figs,
        "namespace": ns, "observe_dir": str(observe),
        "wire_log": {pid: dataclasses.asdict(w) for pid, w in wire.items()},
    }, indent=2))
    return result


__all__ = ["GpuGateOptions", "Interval", "PrerequisiteError", "check_prerequisites",
           "count_cuda_gpus", "load_jobs", "run_gpu_gate", "run_jobs", "shared_job_env",
           "shared_run_counts", "write_job_configs"]
