"""``grpo.VllmGeneration`` under partial-overlap placement (own module: it imports NeMo RL's
``vllm_generation``, which :mod:`rlix_plugins.adapters.nemo_rl_placement` must not drag into
processes that only build policies)."""

from __future__ import annotations

from typing import Any

from rlix_plugins.adapters.nemo_rl_generation import RLixVllmGeneration
from rlix_plugins.adapters.nemo_rl_placement import bind_cluster


class RLixPlacedVllmGeneration(RLixVllmGeneration):
    """Binds the inference view to ``policy.generation.rlix`` before NeMo RL's constructor
    reads it; then NeMo RL's constructor runs unchanged (and the router subclass's hook
    registers the pipeline). Picklable by reference, like its base."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        cluster = kwargs["cluster"] if "cluster" in kwargs else args[0]
        config = kwargs["config"] if "config" in kwargs else args[1]
        bind_cluster(cluster, config)
        super().__init__(*args, **kwargs)


__all__ = ["RLixPlacedVllmGeneration"]
