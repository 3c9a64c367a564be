"""Which veRL jobs the coordinator can time-share, checked before veRL starts anything.

Under ``RLIX_CONTROL_PLANE=rlix`` the patch plugs into veRL's v1 trainers, its vLLM rollout
replicas and the ``rlix_cache`` checkpoint engine (docs/verl.md, "Supported jobs"). A job
configured otherwise used to start: the legacy trainer (``trainer.use_v1=false``) ran without
the coordinator at all, another rollout engine's replicas could not be put to sleep, and
another checkpoint backend left the coordinator no cached version to sync a woken replica
with. :func:`check_supported_job` names every such setting at once; the driver runs it on the
job's config before Ray starts (veRL's ``run_ppo`` builds the runtime env with the config
first), the RLix trainer again before it builds any worker (a driver of its own).

Pure: reads veRL's OmegaConf config (or nested dicts); no veRL import.
"""

from __future__ import annotations

from typing import Final

from rlix_plugins.adapters.job_support import (
    JobProblem,
    JobRule,
    equals,
    is_false_or_unset,
    is_none_or_unset,
    is_true,
    lookup,
    raise_if_unsupported,
    unsupported,
)

#: The backend name of the RLix checkpoint engine (``patches.verl_checkpoint.BACKEND``; kept
#: here too so this module imports nothing of veRL).
CACHE_BACKEND: Final = "rlix_cache"

_DRIVER_RULES: Final[tuple[JobRule, ...]] = (
    JobRule("trainer.use_v1", is_true, "true",
            "the RLix trainer subclasses veRL's v1 trainers (trainer.v1.trainer_mode); "
            "veRL's legacy main_ppo_v0 TaskRunner is not plugged: the job would run without "
            "the coordinator"),
)

_TRAINER_RULES: Final[tuple[JobRule, ...]] = (
    JobRule("actor_rollout_ref.rollout.name", equals("vllm"), "'vllm'",
            "the replicas' sleep, wake, abort and weight version are plugged into veRL's vLLM "
            "replica (RolloutReplicaRegistry['vllm']); another engine's replicas could not be "
            "preempted"),
    JobRule("actor_rollout_ref.rollout.checkpoint_engine.backend", equals(CACHE_BACKEND),
            repr(CACHE_BACKEND),
            "a replica the coordinator wakes is synced from the CPU cache this backend fills; "
            "with another backend there is no cached version to send it, and veRL's own "
            "managers would sync replicas the coordinator put to sleep"),
    JobRule("actor_rollout_ref.rollout.router_config_path", is_none_or_unset, "null or unset",
            "a router plugin replaces veRL's GlobalRequestLoadBalancer, which RLix's "
            "load balancer (shard state, preemption, migration) subclasses; the job would "
            "load every model and then fail to bind its replicas"),
    JobRule("actor_rollout_ref.rollout.full_determinism", is_false_or_unset, "false or unset",
            "veRL reproduces a run by routing each request to the same replica every run; "
            "under RLix which replicas are awake depends on the other pipelines, and a "
            "preempted or migrated request continues on another replica, so the run would not "
            "be reproducible while the flag says it is"),
)

#: The actor's engine section per ``actor_rollout_ref.actor.strategy`` (veRL 0.9.1's engine
#: workers build the actor's engine from it, ``param_offload`` / ``optimizer_offload`` included).
_ENGINE_SECTIONS: Final[dict[str, str]] = {
    "megatron": "actor_rollout_ref.actor.megatron",
    "fsdp": "actor_rollout_ref.actor.fsdp_config",
    "fsdp2": "actor_rollout_ref.actor.fsdp_config",
}
_OFFLOAD_WHY: Final = (
    "the trainer GPUs are lent between steps (to other pipelines' replicas and training); "
    "veRL's engine moves the actor's parameters and optimizer state off them after each update "
    "only with this set, and RLix sends no offload of its own: they would stay on GPUs the "
    "coordinator hands to others")


def _offload_rules(config: object) -> tuple[JobRule, ...]:
    """The actor engine's offload settings, for the strategy the job names (none when the
    strategy is unset or one veRL itself refuses)."""
    strategy = lookup(config, "actor_rollout_ref.actor.strategy")
    section = _ENGINE_SECTIONS.get(strategy) if isinstance(strategy, str) else None
    if section is None:
        return ()
    return (JobRule(f"{section}.param_offload", is_true, "true", _OFFLOAD_WHY),
            JobRule(f"{section}.optimizer_offload", is_true, "true", _OFFLOAD_WHY))


#: The config keys :func:`unsupported_settings` reads always (documented in docs/verl.md);
#: the actor engine's offload keys are read from the section its strategy names.
CHECKED_KEYS: Final[tuple[str, ...]] = tuple(r.key for r in (*_DRIVER_RULES, *_TRAINER_RULES))


def unsupported_settings(config: object, *, driver: bool = True) -> tuple[JobProblem, ...]:
    """Every setting of veRL's job ``config`` the coordinator cannot time-share, in a fixed
    order; empty when the job is supported. ``driver=False`` (the v1 trainer's own check)
    skips ``trainer.use_v1``: a v1 trainer is running."""
    rules = (*_DRIVER_RULES, *_TRAINER_RULES) if driver else _TRAINER_RULES
    return tuple(unsupported(config, (*rules, *_offload_rules(config))))


def check_supported_job(config: object, *, driver: bool = True) -> None:
    """Raise when the job cannot be time-shared (see :func:`unsupported_settings`).

    Raises:
        UnsupportedJobError: listing every unsupported setting, its value, what is valid and
            why; ``.problems`` holds them as :class:`~.job_support.JobProblem` records.
    """
    raise_if_unsupported("veRL", unsupported_settings(config, driver=driver))


__all__ = ["CACHE_BACKEND", "CHECKED_KEYS", "check_supported_job", "unsupported_settings"]
