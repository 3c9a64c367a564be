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
``policy`` is a dict, or nested dicts); no NeMo RL import. Absent keys count as NeMo RL's
defaults (``False`` for the booleans it reads with ``.get(..., False)``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, NoReturn

from rlix_plugins.adapters.job_support import (
    UNSET,
    JobProblem,
    JobRule,
    differs_from,
    equals,
    is_false,
    is_false_or_unset,
    is_none_or_unset,
    is_true,
    lookup,
    raise_if_unsupported,
    unsupported,
)
from rlix_plugins.adapters.shared_groups import PlacementError, find_manager
from rlix_plugins.values import is_int


def _positive_int_or_unset(value: object) -> bool:
    return value is UNSET or (is_int(value) and int(value) >= 1)


def _no_speculation(value: object) -> bool:
    """No draft model: unset, null, or NeMo RL's own "off" (``num_speculative_tokens: 0``)."""
    if value is UNSET or value is None:
        return True
    tokens = value.get("num_speculative_tokens") if isinstance(value, Mapping) else None
    return is_int(tokens) and tokens == 0


#: Why refits that NeMo RL post-processes are refused: NeMo RL's ``_load_weights`` and its
#: weight-update lifecycle do more than vLLM's ``reload_weights``, which the receiver calls.
_REFIT_EXTRAS = ("the selective sync loads the policy's weights through vLLM's own "
                 "reload_weights, without NeMo RL's refit extras")

_RULES: Final[tuple[JobRule, ...]] = (
    JobRule("grpo.async_grpo.enabled", is_true, "true",
            "the pipeline follows async_grpo_train (its collector reports the demand, its "
            "start step numbers the weight versions); NeMo RL's synchronous trainers "
            "(grpo_train) are not plugged: nothing would report their demand"),
    JobRule("policy.megatron_cfg.enabled", is_true, "true",
            "the training GPUs are given back through the Megatron worker extension (weights "
            "cached on CPU, NCCL groups destroyed after each step and re-made before the "
            "next); the DTensor policy (policy.dtensor_cfg.enabled) has no such extension"),
    JobRule("policy.generation.backend", equals("vllm"), "'vllm'",
            "shards are preempted (abort, drain, sleep) and synced through NeMo RL's vLLM "
            "workers only"),
    JobRule("policy.generation.vllm_cfg.async_engine", is_true, "true",
            "the time-sharing worker subclasses NeMo RL's async vLLM worker; the synchronous "
            "VllmGenerationWorker cannot be preempted"),
    JobRule("policy.generation.vllm_cfg.tensor_parallel_size", _positive_int_or_unset,
            "an int >= 1",
            "each of the engine's vLLM workers receives the synced version on its own and "
            "keeps its slice"),
    JobRule("policy.generation.vllm_cfg.pipeline_parallel_size", _positive_int_or_unset,
            "an int >= 1",
            "each of the engine's vLLM workers receives the synced version on its own and "
            "vLLM's loader keeps its stage's layers"),
    JobRule("policy.generation.colocated.enabled", is_false, "false",
            "the coordinator shares GPUs by partial overlap of separate training and inference "
            "clusters (policy.generation.rlix); colocated inference keeps NeMo RL's own "
            "placement on every GPU"),
    JobRule("policy.generation.quant_cfg", is_none_or_unset, "unset or null",
            "ModelOpt-quantized vLLM workers have no time-sharing subclass: their shards could "
            "not be preempted"),
    JobRule("policy.generation.vllm_cfg.precision", differs_from("fp8"),
            "any but 'fp8' (e.g. 'bfloat16')",
            f"{_REFIT_EXTRAS}: NeMo RL's fp8 engines take their weights through its fp8 "
            "loader (quantization.fp8.load_weights), which the receiver does not call (an fp8 "
            "KV cache needs fp8 weights)"),
    JobRule("policy.generation.vllm_kwargs.speculative_config", _no_speculation,
            "unset, null or num_speculative_tokens: 0",
            f"{_REFIT_EXTRAS}: draft weights ('draft.' names, MTP layers) go to vLLM's "
            "drafter only through NeMo RL's _load_weights; a synced engine's drafter would "
            "keep drafting with stale weights"),
    JobRule("data_plane.enabled", is_false_or_unset, "false or unset",
            "with the data plane, examples/run_grpo.py builds a TQPolicy through setup's "
            "policy_factory, which the patch does not plug: training would run without asking "
            "the coordinator for its GPUs"),
)

#: The config keys :func:`unsupported_settings` reads (documented in docs/nemo_rl.md).
CHECKED_KEYS: Final[tuple[str, ...]] = tuple(r.key for r in _RULES)


def unsupported_settings(master_config: object,
                         policy_factory: object | None = None) -> tuple[JobProblem, ...]:
    """Every setting of ``master_config`` (NeMo RL's ``MasterConfig``, or the same keys as
    nested dicts) and of ``setup``'s ``policy_factory`` argument the coordinator cannot
    time-share, in a fixed order; empty when the job is supported."""
    problems = unsupported(master_config, _RULES)
    # With the data plane on, run_grpo.py passes its factory: that problem is named already.
    if policy_factory is not None and not any(p.key == "data_plane.enabled" for p in problems):
        problems.append(JobProblem(
            "setup(policy_factory=...)", getattr(policy_factory, "__qualname__", policy_factory),
            "None (grpo.Policy)",
            "the policy would be built by the factory instead of grpo.Policy, which the patch "
            "plugs: training would run without asking the coordinator for its GPUs",
        ))
    return tuple(problems)


def check_supported_job(master_config: object, policy_factory: object | None = None) -> None:
    """Raise when the job cannot be time-shared (see :func:`unsupported_settings`).

    Raises:
        UnsupportedJobError: listing every unsupported setting, its value, what is valid and
            why; ``.problems`` holds them as :class:`~.job_support.JobProblem` records.
    """
    raise_if_unsupported("NeMo RL", unsupported_settings(master_config, policy_factory))


def vllm_model_parallel(generation_cfg: object) -> int:
    """vLLM's GPUs per engine: ``tensor_parallel_size * pipeline_parallel_size`` of
    ``generation_cfg.vllm_cfg`` (NeMo RL's ``policy.generation``); an absent key counts as
    NeMo RL's default, 1."""
    product = 1
    for key in ("tensor_parallel_size", "pipeline_parallel_size"):
        value = lookup(generation_cfg, f"vllm_cfg.{key}")
        product *= 1 if value is UNSET else int(value)  # type: ignore[call-overload]
    return product


def refuse_model_parallel(model_parallel: int, namespace: str) -> NoReturn:
    """Raise the :class:`~.shared_groups.PlacementError` for a vLLM tp*pp > 1 pipeline under
    the coordinator's running manager (in ``namespace``)."""
    raise PlacementError(
        f"vLLM tp*pp={model_parallel} cannot run under the coordinator "
        f"(rlix:roll_resource_manager runs in namespace {namespace!r}): NeMo RL's "
        "tensor-parallel vLLM path places vLLM's own workers on one bundle per GPU, and the "
        "coordinator's shared placement groups have one bundle per node holding every GPU "
        "of that node; a placement group of this pipeline's own could never be placed next "
        "to them (or, made first, would keep them from being created for every other "
        "pipeline). Nothing was reserved or registered. Valid: "
        "policy.generation.vllm_cfg.tensor_parallel_size * pipeline_parallel_size == 1 on "
        "a shared cluster, or run this job without the control plane (unset "
        "RLIX_CONTROL_PLANE)"
    )


def check_shared_placement(master_config: object) -> None:
    """Refuse, before NeMo RL's setup loads anything, a vLLM tp*pp > 1 job when the
    coordinator's manager runs (its placement bind would refuse it only after the tokenizer,
    the data and the cluster were set up). Nothing to check before ``ray.init`` (NeMo RL's
    ``run_grpo.py`` starts Ray first; otherwise the bind still refuses it).

    Raises:
        PlacementError: naming tp*pp, the manager's namespace and what is valid.
    """
    model_parallel = vllm_model_parallel(lookup(master_config, "policy.generation"))
    if model_parallel == 1:
        return
    import ray

    if not ray.is_initialized():
        return
    found = find_manager()
    if found is not None:
        refuse_model_parallel(model_parallel, found[1])


__all__ = [
    "CHECKED_KEYS",
    "check_shared_placement",
    "check_supported_job",
    "refuse_model_parallel",
    "unsupported_settings",
    "vllm_model_parallel",
]
