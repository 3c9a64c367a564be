"""NeMo RL's replay buffer with ``valid_count`` (runs in the replay-buffer actor's venv).

``ReplayBuffer`` is ``@ray.remote``-decorated, so we subclass the undecorated
``ReplayBufferImpl`` and decorate our own; :mod:`rlix_plugins.patches.nemo_rl` replaces
``nemo_rl.algorithms.async_utils.ReplayBuffer`` (imported at call time by ``async_grpo_train``).
"""

from __future__ import annotations

from typing import Any

import ray
from nemo_rl.algorithms.async_utils.replay_buffer import ReplayBufferImpl

from rlix_plugins.training.progress import VersionRecord, valid_count


class RLixReplayBufferImpl(ReplayBufferImpl):  # type: ignore[misc]
    """``ReplayBufferImpl`` plus :meth:`valid_count` (undecorated, subclassable)."""

    def valid_count(
        self, current_weight_version: int, max_age_steps: int, *, intended_only: bool = False
    ) -> int:
        """Prompt groups usable at ``current_weight_version`` (NeMo RL's age window).

        ``intended_only``: only those whose target weight version is the current one, i.e.
        what ``sample`` would hand to this step.
        """
        lock: Any = self._lock
        with lock:
            records = [
                VersionRecord(int(v), None if t is None else int(t))
                for v, t in zip(self.trajectory_versions, self.target_weight_versions, strict=True)
            ]
        return valid_count(
            records, current_weight_version, max_age_steps, intended_only=intended_only
        )


RLixReplayBuffer = ray.remote(RLixReplayBufferImpl)
