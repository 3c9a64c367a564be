"""Which NeMo RL jobs the coordinator takes: the check ``grpo.setup`` runs first under the gate
(no NeMo RL needed). NeMo RL's real configs and ``setup``:
``tests/integration/test_nemo_rl_pipeline.py::test_unsupported_job_is_refused_before_setup_builds_anything_py312``."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlix_plugins.adapters.job_support import UNSET
from rlix_plugins.adapters.nemo_rl_support import (
    CHECKED_KEYS,
    check_supported_job,
    unsupported_settings,
)
from rlix_plugins.errors import RegistrationError, UnsupportedJobError
from rlix_plugins.gates.gpu_mode import GpuGateOptions, load_jobs
from rlix_plugins.patches.nemo_rl import wrap_setup

GATES = Path(__file__).resolve().parents[2] / "gates"


def _gate_jobs() -> dict[str, dict[str, Any]]:
    """Every NeMo RL job of the GPU gates as nested dicts, from the exact Hydra overrides the
    gates launch (``gpu_mode.load_jobs``: gate 1's job, gate 2's two, gate 3's NeMo RL one)."""
    jobs: dict[str, dict[str, Any]] = {}
    for gate in (1, 2, 3):
        for job in load_jobs(GpuGateOptions(gate=gate, out_dir=GATES), exclusive=False):
            cmd = list(job.command)
            if "examples/run_grpo.py" not in cmd:
                continue  # gate 3's ROLL job
            config: dict[str, Any] = {}
            for override in cmd[cmd.index("--config") + 2:]:
                key, _, value = override.partition("=")
                _set(config, key.lstrip("+"), yaml.safe_load(value))
            jobs[f"gate{gate}:{job.name}"] = config
    return jobs


def _supported() -> dict[str, Any]:
    return copy.deepcopy(_gate_jobs()["gate1:nemo_rl"])


def _set(config: dict[str, Any], dotted: str, value: object) -> dict[str, Any]:
    *parents, leaf = dotted.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return config


def test_every_gate_job_is_supported() -> None:
    jobs = _gate_jobs()
    assert len(jobs) == 4  # gate 1's job, gate 2's two, gate 3's NeMo RL one
    for name, config in jobs.items():
        assert unsupported_settings(config) == (), name
        check_supported_job(config)


@pytest.mark.parametrize(("key", "value"), [
    ("grpo.async_grpo.enabled", False),
    ("policy.megatron_cfg.enabled", False),
    ("policy.generation.backend", "sglang"),
    ("policy.generation.vllm_cfg.async_engine", False),
    ("policy.generation.vllm_cfg.tensor_parallel_size", 0),
    ("policy.generation.vllm_cfg.pipeline_parallel_size", 0),
    ("policy.generation.vllm_cfg.tensor_parallel_size", True),  # a bool is no size
    ("policy.generation.vllm_cfg.pipeline_parallel_size", 2.0),
    ("policy.generation.colocated.enabled", True),
    ("policy.generation.quant_cfg", {"algorithm": "fp8"}),
    ("data_plane.enabled", True),
    ("policy.generation.vllm_cfg.precision", "fp8"),
    ("policy.generation.vllm_kwargs.speculative_config",
     {"method": "eagle3", "num_speculative_tokens": 3}),
    # a bool is no token count (False == 0 in Python, not to the check)
    ("policy.generation.vllm_kwargs.speculative_config",
     {"method": "eagle3", "num_speculative_tokens": False}),
])
def test_each_unsupported_setting_is_named_with_what_is_valid(key: str, value: object) -> None:
    config = _set(_supported(), key, value)
    (problem,) = unsupported_settings(config)
    assert (problem.key, problem.found) == (key, value)
    with pytest.raises(UnsupportedJobError) as info:
        check_supported_job(config)
    message = str(info.value)
    assert f"{key}={value!r} (valid: {problem.valid})" in message
    assert "before any worker was started or GPU claimed" in message
    assert "unset RLIX_CONTROL_PLANE" in message
    assert info.value.problems == (problem,)
    # A registration error: callers that refuse bad registrations refuse this too.
    assert isinstance(info.value, RegistrationError)


def test_nemo_rl_defaults_dtensor_and_sync_are_all_named_at_once() -> None:
    # NeMo RL's default recipe: DTensor policy, synchronous GRPO and vLLM engine, colocated.
    config = {
        "grpo": {"async_grpo": {"enabled": False}},
        "policy": {"dtensor_cfg": {"enabled": True}, "megatron_cfg": {"enabled": False},
                   "generation": {"backend": "vllm", "colocated": {"enabled": True},
                                  "vllm_cfg": {"async_engine": False}}},
    }
    keys = [p.key for p in unsupported_settings(config)]
    assert keys == ["grpo.async_grpo.enabled", "policy.megatron_cfg.enabled",
                    "policy.generation.vllm_cfg.async_engine",
                    "policy.generation.colocated.enabled"]
    problems = {p.key: p for p in unsupported_settings(config)}
    assert "DTensor" in problems["policy.megatron_cfg.enabled"].why


def test_absent_keys_count_as_nemo_rls_defaults() -> None:
    problems = unsupported_settings({})
    # Absent booleans are NeMo RL's False; absent sizes, quantization and data plane are fine.
    assert [p.key for p in problems] == [k for k in CHECKED_KEYS if k not in (
        "policy.generation.quant_cfg", "data_plane.enabled",
        "policy.generation.vllm_cfg.precision",
        "policy.generation.vllm_kwargs.speculative_config",
        "policy.generation.vllm_cfg.tensor_parallel_size",
        "policy.generation.vllm_cfg.pipeline_parallel_size")]
    assert all(p.found is UNSET for p in problems)
    assert "=<unset> (valid: true)" in problems[0].describe()


@pytest.mark.parametrize(("key", "value"), [
    # each vLLM worker of a tensor-parallel engine is a receiver of its own
    ("policy.generation.vllm_cfg.tensor_parallel_size", 2),
    ("policy.generation.vllm_cfg.tensor_parallel_size", 8),
    # each stage's workers load the whole version; vLLM keeps the stage's layers
    ("policy.generation.vllm_cfg.pipeline_parallel_size", 2),
    ("policy.generation.vllm_cfg.precision", "bfloat16"),
    ("policy.generation.vllm_kwargs.speculative_config", None),
    # NeMo RL's own "speculation off" (its vLLM worker drops such a config).
    ("policy.generation.vllm_kwargs.speculative_config",
     {"method": "eagle3", "num_speculative_tokens": 0}),
])
def test_refit_settings_the_receiver_handles_are_accepted(key: str, value: object) -> None:
    assert unsupported_settings(_set(_supported(), key, value)) == ()


def test_truthy_strings_are_not_true() -> None:
    # A YAML "true" string would pass NeMo RL's own truthiness checks but is no boolean.
    config = _set(_supported(), "policy.megatron_cfg.enabled", "true")
    assert [p.key for p in unsupported_settings(config)] == ["policy.megatron_cfg.enabled"]


class _Model:
    """Attribute access, as NeMo RL's pydantic MasterConfig (whose ``policy`` is a dict)."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


def test_attribute_configs_are_read_like_nemo_rls_master_config() -> None:
    plain = _supported()
    model = _Model(grpo=_Model(async_grpo=_Model(enabled=True)), policy=plain["policy"],
                   data_plane=None)
    assert unsupported_settings(model) == ()
    model.grpo.async_grpo.enabled = False
    assert [p.key for p in unsupported_settings(model)] == ["grpo.async_grpo.enabled"]


def test_a_policy_factory_is_refused_once() -> None:
    def make_policy(**kwargs: Any) -> None:
        raise AssertionError("never built")

    (problem,) = unsupported_settings(_supported(), policy_factory=make_policy)
    assert problem.key == "setup(policy_factory=...)"
    assert "make_policy" in str(problem.found)
    # run_grpo.py passes a factory exactly when the data plane is on: named once, by its key.
    with_plane = _set(_supported(), "data_plane.enabled", True)
    keys = [p.key for p in unsupported_settings(with_plane, policy_factory=make_policy)]
    assert keys == ["data_plane.enabled"]


class _RecordingSetup:
    """FAKE of NeMo RL's ``grpo.setup`` (its real one needs Python >= 3.12 and a cluster):
    records calls, returns a marker."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __call__(self, master_config: Any, tokenizer: Any, dataset: Any, val_dataset: Any,
                 processor: Any = None, policy_factory: Any = None) -> str:
        self.calls.append(((master_config, tokenizer, dataset, val_dataset),
                           {"processor": processor, "policy_factory": policy_factory}))
        return "built"


def test_patched_setup_refuses_before_nemo_rls_setup_runs() -> None:
    stock = _RecordingSetup()
    setup = wrap_setup(stock)
    config = _set(_supported(), "policy.megatron_cfg.enabled", False)
    with pytest.raises(UnsupportedJobError, match=r"policy\.megatron_cfg\.enabled="):
        setup(config, "tok", "data", None)
    with pytest.raises(UnsupportedJobError, match=r"setup\(policy_factory=\.\.\.\)"):
        setup(_supported(), "tok", "data", None, policy_factory=dict)
    assert stock.calls == []
    # A supported job reaches NeMo RL's setup with its arguments unchanged.
    good = _supported()
    assert setup(good, "tok", "data", None) == "built"
    assert stock.calls == [((good, "tok", "data", None),
                            {"processor": None, "policy_factory": None})]


def test_patched_setup_leaves_a_malformed_call_to_nemo_rl() -> None:
    stock = _RecordingSetup()
    with pytest.raises(TypeError):  # NeMo RL's own error for a call that fits no signature
        wrap_setup(stock)(tokenizer="tok")
    assert stock.calls == []


class _FakeClaimedPipeline:
    """FAKE pipeline claimed by ``claim_setup``: records its shutdown."""

    def __init__(self) -> None:
        self.shut = 0

    def shutdown(self) -> None:
        self.shut += 1


def test_a_failed_setup_makes_the_claimed_pipeline_leave(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """NeMo RL's setup raising after the claim (a Policy that cannot be built) used to leave
    the setup hold on every GPU of the layout until the driver exited and its lease lapsed."""
    from rlix_plugins.adapters import nemo_rl

    claimed = _FakeClaimedPipeline()
    monkeypatch.setattr(nemo_rl, "_claimed", nemo_rl._Claim(claimed, None))  # type: ignore[arg-type]
    monkeypatch.setenv("PIPELINE_ID", "ft_00000000abcd")

    def failing_setup(master_config: Any, tokenizer: Any, dataset: Any,
                      val_dataset: Any) -> None:
        raise RuntimeError("Policy build failed")

    with pytest.raises(RuntimeError, match="Policy build failed"):
        wrap_setup(failing_setup)(_supported(), "tok", "data", None)
    assert claimed.shut == 1 and nemo_rl._claimed is None
    assert "PIPELINE_ID" not in os.environ  # the id of a pipeline that left
    nemo_rl.abandon_setup()  # nothing claimed any more: a no-op
    assert claimed.shut == 1


@pytest.mark.integration
def test_patched_setup_refuses_tensor_parallel_vllm_when_the_coordinators_manager_runs(
        coordinator: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before the fix a vLLM tp*pp > 1 job was refused only at its first placement bind,
    after NeMo RL's setup had loaded the tokenizer, the data and the clusters (real Ray, the
    real coordinator and its ``rlix:roll_resource_manager``)."""
    from rlix_plugins.adapters.shared_groups import PlacementError

    monkeypatch.setenv("RLIX_CONTROL_PLANE", "rlix")
    monkeypatch.setenv("RLIX_NAMESPACE", coordinator.namespace)
    stock = _RecordingSetup()
    setup = wrap_setup(stock)
    tp2 = _set(_supported(), "policy.generation.vllm_cfg.tensor_parallel_size", 2)
    with pytest.raises(PlacementError, match=r"tp\*pp=2") as err:
        setup(tp2, "tok", "data", None)
    assert coordinator.namespace in str(err.value)
    assert "tensor_parallel_size * pipeline_parallel_size == 1" in str(err.value)
    assert stock.calls == []
    # One GPU per engine still reaches NeMo RL's setup under the running manager.
    assert setup(_supported(), "tok", "data", None) == "built"
    # Without the control plane the job is NeMo RL's own: tp=2 goes through.
    monkeypatch.delenv("RLIX_CONTROL_PLANE")
    assert setup(tp2, "tok", "data", None) == "built"
