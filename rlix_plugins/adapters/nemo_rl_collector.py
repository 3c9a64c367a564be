"""NeMo RL's trajectory collector with progress reports (runs in the collector's venv).

``AsyncTrajectoryCollector`` is decorated with ``@ray.remote`` and has no undecorated twin; Ray
keeps the user class as ``__ray_metadata__.modified_class.__ray_actor_class__``, which we
subclass and decorate again. After each prompt group is buffered
(``_enqueue_rollout_group``) the collector's progress tracker counts it for the step it
targets and reports (2% buckets) through the pipeline's progress sink. When NeMo RL sets a
weight version it never trains (``>= grpo.max_num_steps``: the final step's refit) the
pipeline's demand is cleared instead of a new batch starting.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import ray
from nemo_rl.algorithms.async_utils import trajectory_collector as _tc

from rlix_plugins.adapters.nemo_rl_progress import CollectorTracker

logger = logging.getLogger(__name__)


def undecorated(actor_class: Any) -> type:
    """The user class behind a ``@ray.remote`` actor class."""
    meta = getattr(actor_class, "__ray_metadata__", None)
    modified = getattr(meta, "modified_class", None)
    original = getattr(modified, "__ray_actor_class__", None)
    if not isinstance(original, type):
        raise TypeError(f"{actor_class!r} is not a Ray actor class with a recoverable user class")
    return original


_Base: Any = undecorated(_tc.AsyncTrajectoryCollector)


class RLixAsyncTrajectoryCollectorImpl(_Base):  # type: ignore[misc]
    """The collector plus progress after each buffered prompt group."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from rlix_plugins.adapters.nemo_rl_progress import progress_tracker_for_collector

        # NeMo RL's __init__ stored both, however they were passed; the generation is this
        # collector's copy, whose router does the pipeline's routing (rank_load hints).
        self._rlix_progress: CollectorTracker | None = progress_tracker_for_collector(
            getattr(self, "master_config", kwargs.get("master_config")),
            getattr(self, "policy_generation", kwargs.get("policy_generation")),
        )
        # Prompt groups buffered per target weight version. NeMo RL generates up to
        # max_trajectory_age_steps ahead, so when a version begins some of its groups are
        # already buffered: they count from the start (the tracker only counts its current
        # version). One lock with the tracker calls: a group is counted once, either here
        # before its version begins or by the tracker after.
        self._rlix_buffered: dict[int, int] = {}
        self._rlix_lock = threading.Lock()

    async def _enqueue_rollout_group(
        self,
        rollout_result: Any,
        generation_weight_version: int,
        target_weight_version: int,
        expected_prompt_groups: int,
        buffered_group_indices: set[int],
        collection_started_at: float,
    ) -> None:
        await super()._enqueue_rollout_group(
            rollout_result,
            generation_weight_version,
            target_weight_version,
            expected_prompt_groups,
            buffered_group_indices,
            collection_started_at,
        )
        tracker = self._rlix_progress
        if tracker is None:
            return
        try:
            target = int(target_weight_version)
            with self._rlix_lock:
                self._rlix_buffered[target] = self._rlix_buffered.get(target, 0) + 1
                # One prompt group buffered for the step that trains target_weight_version.
                tracker.record(1, weight_version=target)
        except Exception:  # progress must never stop collection
            logger.exception("rlix: progress report failed; collection continues")

    def set_weight_version(self, version: int) -> None:
        super().set_weight_version(version)
        tracker = self._rlix_progress
        if tracker is not None:
            try:
                version = int(version)
                with self._rlix_lock:
                    # Earlier targets are sampled (or dropped) by now: forget them.
                    self._rlix_buffered = {
                        t: n for t, n in self._rlix_buffered.items() if t >= version}
                    # Past grpo.max_num_steps this clears the pipeline's demand instead.
                    tracker.begin_version(version,
                                          already_collected=self._rlix_buffered.get(version, 0))
            except Exception:  # NeMo RL's driver waits on this call: progress must not fail it
                logger.exception("rlix: progress for weight version %s failed; collection "
                                 "continues", version)


RLixAsyncTrajectoryCollector = ray.remote(RLixAsyncTrajectoryCollectorImpl)
