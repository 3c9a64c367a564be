"""NeMo RL's vLLM worker extensions with the selective-sync receiver mixed in.

Imported by FQN inside vLLM's worker processes (``worker_extension_cls``, set by
``RLixVllmAsyncGenerationWorkerImpl._create_engine``). NeMo RL's own methods (``_load_weights``,
refit helpers, ...) stay; :class:`~rlix_plugins.training.vllm_receiver.RlixWeightReceiverExtension`
adds ``rlix_receive_weights`` / ``rlix_weight_version`` / ``rlix_forget_weights`` /
``rlix_param_checksums``, so the cache owner's :func:`~rlix_plugins.training.sync.sync_version`
reaches the model directly.
"""

from __future__ import annotations

from nemo_rl.models.generation.vllm.vllm_backend import (
    VllmInternalWorkerExtension,
    VllmInternalWorkerExtensionWithCheckpointEngine,
)

from rlix_plugins.training.vllm_receiver import RlixWeightReceiverExtension


class RLixVllmInternalWorkerExtension(
    RlixWeightReceiverExtension, VllmInternalWorkerExtension  # type: ignore[misc]
):
    """NeMo RL's ``VllmInternalWorkerExtension`` + the RLix weight receiver."""


class RLixVllmInternalWorkerExtensionWithCheckpointEngine(
    RlixWeightReceiverExtension, VllmInternalWorkerExtensionWithCheckpointEngine  # type: ignore[misc]
):
    """NeMo RL's checkpoint-engine extension + the RLix weight receiver."""
