"""Progress (demand) reporting of a NeMo RL pipeline: the collector's tracker, the sink that
sends its reports to ``rlix:scheduler``, the router hints attached to them, and the ``grpo``
settings that size a step and a validation.

Split from :mod:`rlix_plugins.adapters.nemo_rl` (which re-exports the public names): nothing
here needs the driver's pipeline object, so the collector actor imports only this.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from rlix_plugins.protocol.names import SCHEDULER_ACTOR
from rlix_plugins.protocol.types import ProgressReport
from rlix_plugins.settings import settings_if_enabled
from rlix_plugins.training.progress import (
    OutstandingReader,
    ProgressSink,
    ProgressTracker,
    with_outstanding,
)
from rlix_plugins.values import as_index

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- grpo settings


def _grpo_value(master_config: Any, name: str) -> Any:
    """``master_config.grpo.<name>`` (pydantic model or plain dicts); None when absent."""
    grpo = getattr(master_config, "grpo", None)
    if grpo is None and isinstance(master_config, dict):
        grpo = master_config.get("grpo")
    if grpo is None:
        return None
    value = getattr(grpo, name, None)
    if value is None and isinstance(grpo, dict):
        value = grpo.get(name)
    return value


def num_prompts_per_step(master_config: Any) -> int | None:
    """``grpo.num_prompts_per_step``: prompt groups one step trains on (None when absent)."""
    value = _grpo_value(master_config, "num_prompts_per_step")
    return None if value is None else int(value)


def max_num_steps(master_config: Any) -> int | None:
    """``grpo.max_num_steps``: NeMo RL's loop trains steps below it, so a weight version at or
    past it is never trained. None (no end known) when absent or not an int >= 0 (logged:
    the demand is then cleared only when the pipeline unregisters)."""
    raw = _grpo_value(master_config, "max_num_steps")
    if raw is None:
        return None
    value = as_index(raw)
    if value is None or value < 0:
        logger.warning("rlix: grpo.max_num_steps=%r is not an int >= 0; the final step's "
                       "demand stays until the pipeline unregisters", raw)
        return None
    return value


def validation_size(val_dataloader: Any, master_config: Any) -> int | None:
    """Trajectories NeMo RL's ``validate`` generates: the first
    ``max_val_samples // val_batch_size`` batches of ``val_dataloader`` (fewer when it has
    fewer; its dataset's length caps the prompts), each prompt
    ``val_num_generations_per_prompt`` times (default 1). None when the config does not say
    (the validation then reports no demand)."""
    shape = ValidationShape.of(master_config)
    return None if shape is None else shape.size(val_dataloader)


@dataclass(frozen=True, slots=True)
class ValidationShape:
    """The ``grpo`` settings that size NeMo RL's validation."""

    batch: int
    samples: int
    per_prompt: int

    @staticmethod
    def of(master_config: Any) -> ValidationShape | None:
        """From ``master_config``; None when one is missing or out of range."""
        batch = as_index(_grpo_value(master_config, "val_batch_size"))
        samples = as_index(_grpo_value(master_config, "max_val_samples"))
        raw_k = _grpo_value(master_config, "val_num_generations_per_prompt")
        per_prompt = 1 if raw_k is None else as_index(raw_k)
        if batch is None or batch < 1 or samples is None or samples < 0 or per_prompt is None \
                or per_prompt < 1:
            return None
        return ValidationShape(batch, samples, per_prompt)

    @property
    def per_batch(self) -> int:
        """Trajectories one batch generates."""
        return self.batch * self.per_prompt

    def size(self, val_dataloader: Any) -> int:
        """Trajectories the validation over ``val_dataloader`` generates (see
        :func:`validation_size`)."""
        batches = self.samples // self.batch
        with contextlib.suppress(TypeError, AttributeError):
            batches = min(batches, len(val_dataloader))
        prompts = batches * self.batch
        with contextlib.suppress(TypeError, AttributeError):
            prompts = min(prompts, len(val_dataloader.dataset))
        return prompts * self.per_prompt


class CountedBatches:
    """``val_dataloader`` as NeMo RL's ``validate`` iterates it, telling ``on_done`` how many
    batches are finished: fetching batch ``i + 1`` (or the one it breaks at, or the end)
    means batch ``i`` was generated and scored. Anything else is the loader's."""

    def __init__(self, loader: Any, on_done: Callable[[int], None]) -> None:
        self._loader = loader
        self._on_done = on_done

    def __iter__(self) -> Iterator[Any]:
        done = 0
        for batch in self._loader:
            if done:
                self._on_done(done)
            yield batch
            done += 1
        if done:
            self._on_done(done)

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


# ---------------------------------------------------------------------------- reports


#: ``rank_load`` (progress metric): requests in flight per active dp rank. The planner takes
#: the lightest donor rank when it moves GPUs (``coordinator/core/planner.py``).
RankLoad = Callable[[], Mapping[int, int] | None]


def router_rank_load(generation: Any) -> dict[int, int] | None:
    """In-flight requests per ACTIVE dp rank of ``generation``'s router copy (None: no router).

    Under NeMo RL the collector's copy of the generation does all the pipeline's routing, so
    its counts are the pipeline's load; a preempted or sleeping rank is never a donor, so
    only active ranks are reported.
    """
    router = getattr(generation, "rlix_router", None)
    if router is None:
        return None
    inflight = router.inflight
    return {int(r): int(inflight[r]) for r in router.state.snapshot().active}


def with_rank_load(report: ProgressReport, load: Mapping[int, int] | None) -> ProgressReport:
    """``report`` with ``metrics["rank_load"]`` set from ``load`` (unchanged when None)."""
    if load is None:
        return report
    metrics = dict(report.metrics or {})
    metrics["rank_load"] = {int(r): int(n) for r, n in load.items()}
    return dataclasses.replace(report, metrics=metrics)


def router_outstanding(generation: Any) -> int | None:
    """Requests ``generation``'s router copy accepted and has not finished (None: no router):
    the ``outstanding`` metric. Under NeMo RL's async GRPO the collector submits the next
    step's prompts while the oldest step is still open, so this is the job's whole GPU need."""
    router = getattr(generation, "rlix_router", None)
    if router is None:
        return None
    return max(0, int(router.outstanding))


class SchedulerProgressSink:
    """Progress sink that sends reports to ``rlix:scheduler`` (fire and forget).

    ``rank_load`` and ``outstanding`` (both optional) are read at each report and attached as
    metrics; a failing reader drops only its metric, never the report.
    """

    def __init__(self, namespace: str, rank_load: RankLoad | None = None,
                 outstanding: OutstandingReader | None = None) -> None:
        self.namespace = namespace
        self.rank_load = rank_load
        self.outstanding = outstanding

    def _load(self) -> Mapping[int, int] | None:
        if self.rank_load is None:
            return None
        try:
            return self.rank_load()
        except Exception:  # a load hint is advisory
            logger.warning("rlix: rank_load unavailable; report sent without it", exc_info=True)
            return None

    def _outstanding(self) -> int | None:
        if self.outstanding is None:
            return None
        try:
            return self.outstanding()
        except Exception:  # advisory, like rank_load
            logger.warning("rlix: outstanding unavailable; report sent without it",
                           exc_info=True)
            return None

    def decorate(self, report: ProgressReport) -> ProgressReport:
        """``report`` with the metrics this sink attaches (``rank_load``, ``outstanding``)."""
        return with_outstanding(with_rank_load(report, self._load()), self._outstanding())

    def __call__(self, report: ProgressReport) -> None:
        import ray

        sched = ray.get_actor(SCHEDULER_ACTOR, namespace=self.namespace)
        sched.report_progress.remote(self.decorate(report))

    def clear(self, pipeline_id: str) -> None:
        import ray

        sched = ray.get_actor(SCHEDULER_ACTOR, namespace=self.namespace)
        sched.clear_progress.remote(pipeline_id=pipeline_id)


class CollectorTracker(ProgressTracker):
    """The collector's tracker: a :class:`ProgressTracker` that knows the run's shape
    (``step_target`` trajectories per step, ``grpo.max_num_steps`` as ``max_steps``) and opens
    a batch per NeMo RL weight version."""

    def __init__(self, pipeline_id: str, sink: ProgressSink, *, step_target: int,
                 max_steps: int | None = None, on_clear: Callable[[], None] | None = None) -> None:
        super().__init__(pipeline_id, sink, on_clear=on_clear)
        self.step_target = step_target
        #: versions at or past it are never trained (None: no end known)
        self.max_steps = max_steps

    def begin_version(self, weight_version: int,
                      already_collected: int = 0) -> ProgressReport | None:
        """New weight version = new step: count groups targeted at it from
        ``already_collected``.

        A version at or past ``max_steps`` is never trained: NeMo RL sets it after the final
        step's refit and its loop then ends. No batch starts; the pipeline's demand is cleared
        (``clear_progress``) and, the tracker being inactive, nothing more is reported,
        although NeMo RL's collector goes on generating until it is killed. Returns None then.
        """
        if self.max_steps is not None and weight_version >= self.max_steps:
            self.end_batch()
            return None
        return self.begin_batch(step=weight_version, step_target=self.step_target,
                                weight_version=weight_version,
                                already_collected=already_collected)


def progress_tracker_for_collector(master_config: Any,
                                   generation: Any = None) -> CollectorTracker | None:
    """The collector's tracker (None when standalone or no pipeline id is known).

    ``generation``: the collector's copy of the generation; its router's in-flight counts go
    with every report as ``rank_load``.
    """
    settings = settings_if_enabled()
    if settings is None or not settings.pipeline_id:
        return None
    target = num_prompts_per_step(master_config)
    if target is None:
        logger.warning("rlix: grpo.num_prompts_per_step unknown; no progress reports")
        return None
    load: RankLoad | None = None
    outstanding: OutstandingReader | None = None
    if generation is not None:
        def load() -> Mapping[int, int] | None:
            return router_rank_load(generation)

        def outstanding() -> int | None:
            return router_outstanding(generation)
    sink = SchedulerProgressSink(settings.namespace, load, outstanding)
    pid = settings.pipeline_id
    return CollectorTracker(pid, sink, step_target=target,
                            max_steps=max_num_steps(master_config),
                            on_clear=lambda: sink.clear(pid))
