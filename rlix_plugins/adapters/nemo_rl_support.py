"""Which NeMo RL jobs the coordinator can time-share, checked before ``grpo.setup`` builds
anything.

Under ``RLIX_CONTROL_PLANE=rlix`` the patch plugs into NeMo RL's async GRPO loop, its Megatron
policy workers and its async vLLM workers (docs/nemo_rl.md, "Supported jobs"). A job configured
otherwise used to get far: it registered, held its GPUs, loaded its models, and then failed on
the first step with an error from deep inside (a DTensor worker has no ``rlix_build_cache``)
or, worse, ran without ever asking for its training GPUs (a ``policy_factory`` policy is not our
subclass). :func:`check_supported_job` names every unsupported setting at once, with what is
valid and why, and the patched ``grpo.setup`` raises it before any placement group, worker or
registration exists.

Pure: reads the config NeMo RL's ``setup`` is given (its pydantic ``MasterConfig``, whose
``policy`` is a dict, or nested dicts); no NeMo RL import.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

from rlix_plugins.errors import UnsupportedJobError
from rlix_plugins.values import is_int


class _Unset:
    """A setting absent from the config (NeMo RL reads most of these keys with
    ``.get(..., False)``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<unset>"


UNSET: Final = _Unset()


@dataclass(frozen=True, slots=True)
class JobProblem:
    """One setting of a NeMo RL job the coordinator cannot time-share."""

    key: str
    found: object
    valid: str
    why: str

    def describe(self) -> str:
        return f"{self.key}={self.found!r} (valid: {self.valid}): {self.why}"


@dataclass(frozen=True, slots=True)
class _Rule:
    key: str
    accepts: Callable[[object], bool]
    valid: str
    why: str


def _is_true(value: object) -> bool:
    return value is True


def _is_one_or_unset(value: object) -> bool:
    return value is UNSET or (is_int(value) and value == 1)


def _is_false_or_unset(value: object) -> bool:
    return value is False or value is None or value is UNSET


_RULES: Final[tuple[_Rule, ...]] = (
    _Rule("grpo.async_grpo.enabled", _is_true, "true",
          "the pipeline follows async_grpo_train (its collector reports the demand, its start "
          "step numbers the weight versions); NeMo RL's synchronous trainers (grpo_train) are "
          "not plugged: nothing would report their demand"),
    _Rule("policy.megatron_cfg.enabled", _is_true, "true",
          "the training GPUs are given back through the Megatron worker extension (weights "
          "cached on CPU, NCCL groups destroyed after each step and re-made before the next); "
          "the DTensor policy (policy.dtensor_cfg.enabled) has no such extension"),
    _Rule("policy.generation.backend", lambda v: v == "vllm", "'vllm'",
          "shards are preempted (abort, drain, sleep) and synced through NeMo RL's vLLM "
          "workers only"),
    _Rule("policy.generation.vllm_cfg.async_engine", _is_true, "true",
          "the time-sharing worker subclasses NeMo RL's async vLLM worker; the synchronous "
          "VllmGenerationWorker cannot be preempted"),
    *(
        _Rule(f"policy.generation.vllm_cfg.{size}", _is_one_or_unset, "1",
              "the selective sync's receiver takes one vLLM worker per engine; "
              "multi-worker (tensor- or pipeline-parallel) engines are not wired")
        for size in ("tensor_parallel_size", "pipeline_parallel_size")
    ),
    _Rule("policy.generation.colocated.enabled", lambda v: v is False, "false",
          "the coordinator shares GPUs by partial overlap of separate training and inference "
          "clusters (policy.generation.rlix); colocated inference keeps NeMo RL's own "
          "placement on every GPU"),
    _Rule("policy.generation.quant_cfg", lambda v: v is None or v is UNSET, "unset or null",
          "ModelOpt-quantized vLLM workers have no time-sharing subclass: their shards could "
          "not be preempted"),
    _Rule("data_plane.enabled", _is_false_or_unset, "false or unset",
          "with the data plane, examples/run_grpo.py builds a TQPolicy through setup's "
          "policy_factory, which the patch does not plug: training would run without asking "
          "the coordinator for its GPUs"),
)

#: The config keys :func:`unsupported_settings` reads (documented in docs/nemo_rl.md).
CHECKED_KEYS: Final[tuple[str, ...]] = tuple(r.key for r in _RULES)


def _lookup(config: object, dotted: str) -> object:
    # NeMo RL's MasterConfig mixes pydantic models (``grpo``, ``grpo.async_grpo``) and plain
    # dicts (``policy``, ``policy["generation"]``); a test or a user may pass a plain dict.
    node: object = config
    for part in dotted.split("."):
        if isinstance(node, Mapping):
            if part not in node:
                return UNSET
            node = node[part]
        elif node is not None and not isinstance(node, (str, bytes)) and hasattr(node, part):
            node = getattr(node, part)
        else:
            return UNSET
    return node


def unsupported_settings(master_config: object,
                         policy_factory: object | None = None) -> tuple[JobProblem, ...]:
    """Every setting of ``master_config`` (NeMo RL's ``MasterConfig``, or the same keys as
    nested dicts) and of ``setup``'s ``policy_factory`` argument the coordinator cannot
    time-share, in a fixed order; empty when the job is supported."""
    problems = [
        JobProblem(rule.key, found, rule.valid, rule.why)
        for rule in _RULES
        if not rule.accepts(found := _lookup(master_config, rule.key))
    ]
    # With the data plane on, run_grpo.py passes its factory: that problem is named already.
    if policy_factory is not None and not any(p.key == "data_plane.enabled" for p in problems):
        problems.append(JobProblem(
            "setup(policy_factory=...)", getattr(policy_factory, "__qualname__", policy_factory),
            "None (grpo.Policy)",
            "the policy would be built by the factory instead of grpo.Policy, which the patch "
            "plugs: training would run without asking the coordinator for its GPUs",
        ))
    return tuple(problems)


def check_supported_job(master_config: object,
                        policy_factory: object | None = None) -> None:
    """Raise when the job cannot be time-shared (see :func:`unsupported_settings`).

    Raises:
        UnsupportedJobError: listing every unsupported setting, its value, what is valid and
            why; ``.problems`` holds them as :class:`JobProblem` records.
    """
    problems = unsupported_settings(master_config, policy_factory)
    if not problems:
        return
    lines = "\n".join(f"  - {p.describe()}" for p in problems)
    raise UnsupportedJobError(
        "rlix: this NeMo RL job cannot be time-shared under RLIX_CONTROL_PLANE=rlix (nothing "
        "was started; unset RLIX_CONTROL_PLANE to run it unchanged, or change):\n" + lines,
        problems,
    )


__all__ = ["CHECKED_KEYS", "UNSET", "JobProblem", "check_supported_job", "unsupported_settings"]
