"""Engine-side worker extension for the NeMo RL pipeline test (imported in vLLM's EngineCore).

``FakeNemoRlWorkerExtension`` is a FAKE of NeMo RL's ``VllmInternalWorkerExtension``: it offers
the one method our vLLM worker calls on it, ``_load_weights(weights)``
(``RLixVllmWorkerMixin.rlix_load_weights`` -> ``collective_rpc("_load_weights")``). NeMo RL's
real one calls ``model.load_weights`` straight into the model, which is wrong on vLLM's CPU
backend (linear weights are repacked into the GEMM kernel after loading); this one goes
through vLLM's in-place ``reload_weights``, which re-runs that post-load processing. The
version/checksum readers come from the real
:class:`~rlix_plugins.training.vllm_receiver.RlixWeightReceiverExtension`.

Kept in its own small module: the EngineCore process imports it by FQN.
"""

from __future__ import annotations

from typing import Any

from rlix_plugins.training.vllm_receiver import RlixWeightReceiverExtension

EXTENSION_FQN = "tests.support.nemo_rl_vllm_ext.FakeNemoRlWorkerExtension"


class FakeNemoRlWorkerExtension(RlixWeightReceiverExtension):
    """Fake of NeMo RL's vLLM worker extension: ``_load_weights`` + checksum readers."""

    def _load_weights(self, weights: list[tuple[str, Any]]) -> None:
        # One call = one bucket; the test's cache keeps the tiny model in one bucket, so every
        # layer is reloaded whole.
        self.model_runner.reload_weights(weights_iterator=iter(weights),
                                         is_checkpoint_format=True)
        self._rlix_loads = getattr(self, "_rlix_loads", 0) + 1

    def rlix_load_count(self) -> int:
        """How many ``_load_weights`` calls this worker served."""
        return int(getattr(self, "_rlix_loads", 0))
