"""Engine-side worker extension for the NeMo RL pipeline test (imported in vLLM's EngineCore).

``FakeNemoRlWorkerExtension`` stands in for
:class:`~rlix_plugins.adapters.nemo_rl_vllm_ext.RLixVllmInternalWorkerExtension` (NeMo RL's
``VllmInternalWorkerExtension`` + our receiver): NeMo RL's half is a FAKE (its module needs
NeMo RL's GPU refit dependencies, and our worker never calls it under RLix); the receiver half
is the real :class:`~rlix_plugins.training.vllm_receiver.RlixWeightReceiverExtension`, whose
``rlix_receive_weights`` the cache owner's selective sync drives. It only counts the syncs.

Kept in its own small module: the EngineCore process imports it by FQN.
"""

from __future__ import annotations

from typing import Any

from rlix_plugins.training.vllm_receiver import RlixWeightReceiverExtension

EXTENSION_FQN = "tests.support.nemo_rl_vllm_ext.FakeNemoRlWorkerExtension"


class FakeNemoRlWorkerExtension(RlixWeightReceiverExtension):
    """The real receiver extension, counting completed syncs (fake of NeMo RL's half)."""

    def rlix_receive_weights(self, offer: Any) -> dict[str, Any]:
        result = super().rlix_receive_weights(offer)
        if not result.get("failed"):  # a multi-worker engine's failure comes back as a value
            self._rlix_loads = getattr(self, "_rlix_loads", 0) + 1
        return result

    def rlix_load_count(self) -> int:
        """How many syncs this worker applied completely."""
        return int(getattr(self, "_rlix_loads", 0))
